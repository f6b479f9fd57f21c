"""A burst on a cluster that has just come up: ``python -m benchmarks.burst``.

What a new user does first: start the cluster (``tierserve serve CONFIG``, as ``make serve``
does), and as soon as it answers, fan out a few dozen calls at once through the ``openai`` SDK
as it comes (its own two retries, its own timeout): completions and chat, streamed and not, up to
60 words in and up to 48 tokens out. Nothing else runs. Each round starts a fresh cluster:

- ``--cache cold``: an empty ``TIERSERVE_CACHE_DIR`` (the replicas dequantize the weights and
  build their native kernels while the burst waits), ``warm``: the usual cache;
- ``--wait health``: the burst goes as soon as ``GET /health`` answers (liveness), ``ready``: once
  ``GET /ready`` says every replica can take work;
- ``--code DIR[,DIR...]``: the checkouts whose code runs the cluster (each with its own
  ``configs/``; e.g. a worktree of an earlier commit beside this one, to measure before and after
  in one run); default: this one.

Printed and written (``--json``): per round, the requests answered, refused (by status) and
failed, the SDK's retries (every HTTP attempt past the first), the burst's wall time, and the
time from the launcher's start to health and to readiness, and how many first tries were
refused (429s the SDK then retried) with their ``Retry-After``. Exit status 1 when any request
of a round was not answered in the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from benchmarks.serving import DEFAULT_CONFIG, answers, stop, wait_for
from benchmarks.tools import ROOT
from tierserve.cluster.measure import machine

TEXT = ("the quick brown fox jumps over a lazy dog while seven wise owls count stars above "
        "quiet hills near an old river where children once built small wooden boats")
WORDS = TEXT.split()


@dataclass(slots=True)
class Round:
    code: str
    cache: str
    wait: str
    requests: int
    health_s: float = 0.0  # from the launcher's start
    ready_s: float | None = None  # /ready said ready (None: not asked, or never)
    burst_s: float = 0.0
    answered: int = 0
    refused: dict[str, int] = field(default_factory=dict)  # HTTP status -> count
    failed: dict[str, int] = field(default_factory=dict)  # exception type -> count
    attempts: int = 0  # HTTP attempts the SDK made (retries included)
    retry_after: list[str] = field(default_factory=list)  # Retry-After of each 429 seen


def prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 60)))


async def one(client: Any, model: str, i: int, rng: random.Random) -> tuple[str, str | None]:
    """One request of the burst: ("ok", None), ("status", code) or ("error", type)."""
    import openai

    kind = i % 4  # completions / chat, each streamed and not
    max_tokens = rng.randint(1, 48)
    text = prompt(rng)
    try:
        if kind < 2:
            if kind == 0:
                await client.completions.create(model=model, prompt=text, max_tokens=max_tokens)
            else:
                stream = await client.completions.create(model=model, prompt=text,
                                                         max_tokens=max_tokens, stream=True)
                async for _ in stream:
                    pass
        else:
            messages = [{"role": "user", "content": text}]
            if kind == 2:
                await client.chat.completions.create(model=model, messages=messages,
                                                     max_tokens=max_tokens)
            else:
                stream = await client.chat.completions.create(
                    model=model, messages=messages, max_tokens=max_tokens, stream=True)
                async for _ in stream:
                    pass
        return "ok", None
    except openai.APIStatusError as e:
        return "status", str(e.status_code)
    except Exception as e:
        return "error", type(e).__name__


async def burst(url: str, model: str, n: int, seed: int, rnd: Round) -> None:
    import openai

    async def seen(response: Any) -> None:
        rnd.attempts += 1
        if response.status_code == 429:
            rnd.retry_after.append(response.headers.get("retry-after", "-"))

    # The SDK's own client (its connection limits, timeout and retries as they come), with a
    # hook that sees every attempt.
    http = openai.DefaultAsyncHttpxClient(event_hooks={"response": [seen]})
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", http_client=http)
    rng = random.Random(seed)
    rngs = [random.Random(rng.random()) for _ in range(n)]
    t0 = time.perf_counter()
    outcomes = await asyncio.gather(*(one(client, model, i, rngs[i]) for i in range(n)))
    rnd.burst_s = time.perf_counter() - t0
    await http.aclose()
    rnd.answered = sum(1 for kind, _ in outcomes if kind == "ok")
    rnd.refused = dict(Counter(str(v) for kind, v in outcomes if kind == "status"))
    rnd.failed = dict(Counter(str(v) for kind, v in outcomes if kind == "error"))


def first_model(args: dict[str, Any]) -> str:
    """The first model an application's ``args`` serve: the first of ``models``, else the one
    ``engine`` (its ``served_model_name``, else ``engine.model``). Read from the raw YAML, so
    that a config of an older checkout (before ``models``) reads the same."""
    if args.get("models"):
        return str(args["models"][0]["name"])
    return str(args.get("served_model_name") or args["engine"]["model"])


def run_round(code: Path, config: str, cache: str, wait: str, n: int, seed: int,
              log: Path) -> Round:
    raw = yaml.safe_load((code / config).read_text())
    port = int((raw.get("http_options") or {}).get("port", 8000))
    url = f"http://127.0.0.1:{port}"
    model = first_model(raw["applications"][0]["args"])
    rnd = Round(str(code), cache, wait, n)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["PYTHONPATH"] = os.pathsep.join([str(code), *filter(None, [env.get("PYTHONPATH")])])
    cold = tempfile.TemporaryDirectory(prefix="tierserve-cold-") if cache == "cold" else None
    if cold is not None:
        env["TIERSERVE_CACHE_DIR"] = cold.name
    t0 = time.perf_counter()
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "tierserve.cluster.launch", config],
                                stdout=out, stderr=subprocess.STDOUT, env=env, cwd=code,
                                start_new_session=True)
    try:
        wait_for(proc, lambda: answers(lambda: httpx.get(f"{url}/health", timeout=5)), log, t0,
                 600, "the cluster")
        rnd.health_s = time.perf_counter() - t0
        if wait == "ready":
            wait_for(proc, lambda: answers(lambda: httpx.get(f"{url}/ready", timeout=5)), log,
                     t0, 600, "the cluster's readiness")
            rnd.ready_s = time.perf_counter() - t0
        asyncio.run(burst(url, model, n, seed, rnd))
    finally:
        stop(proc)
        if cold is not None:
            cold.cleanup()
    return rnd


def fmt(r: Round) -> str:
    ready = f"{r.ready_s:.1f} s" if r.ready_s is not None else "-"
    return (f"{Path(r.code).name:<10} cache={r.cache:<4} wait={r.wait:<6} health "
            f"{r.health_s:5.1f} s ready {ready:>7}  answered {r.answered}/{r.requests} (first "
            f"tries refused: {len(r.retry_after)}, Retry-After {sorted(set(r.retry_after)) or '-'})"
            f"  final refusals {r.refused or 0} failures {r.failed or 0}  attempts {r.attempts}"
            f"  burst {r.burst_s:.1f} s")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.burst", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=DEFAULT_CONFIG)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--cache", default="cold,warm", help="rounds' caches: cold, warm (comma list)")
    p.add_argument("--wait", default="health", help="health or ready (comma list)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--code", default=str(ROOT),
                   help="checkouts whose code runs the cluster (comma list; default: this one)")
    p.add_argument("--json", default=None, help="write the rounds and the machine here")
    p.add_argument("--log-dir", default=None, help="keep each launcher's log here")
    args = p.parse_args(argv)
    logs = Path(args.log_dir or tempfile.mkdtemp(prefix="tierserve-burst-"))
    logs.mkdir(parents=True, exist_ok=True)
    rounds: list[Round] = []
    for cache in args.cache.split(","):
        for wait in args.wait.split(","):
            for code in args.code.split(","):
                if wait == "ready" and not (Path(code) / "cluster" / "readiness.py").exists():
                    continue  # that code has no /ready
                r = run_round(Path(code).resolve(), args.config, cache, wait, args.requests,
                              args.seed, logs / f"launch-{Path(code).name}-{cache}-{wait}.log")
                print(fmt(r), flush=True)
                rounds.append(r)
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"machine": machine(torch_info=False), "config": args.config,
             "rounds": [asdict(r) for r in rounds]}, indent=2))
    return 0 if all(r.answered == r.requests for r in rounds) else 1


if __name__ == "__main__":
    sys.exit(main())
