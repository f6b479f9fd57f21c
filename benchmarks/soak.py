"""Soak: a long mixed load with preemptions, aborts and disconnects, then a check that nothing
was lost or leaked.

Run against a running cluster (``make serve`` in another terminal):
``python -m benchmarks.soak`` (10 minutes at 2 requests/s on ``http://127.0.0.1:8000``, metrics from
``http://127.0.0.1:8080/metrics``); ``--duration S``, ``--rate R``, ``--url``, ``--metrics-url``,
``--model`` (default: the model the server lists first at ``GET /v1/models``; nothing is sent
when it lists none), ``--key TIER=KEY`` (repeatable: one traffic class per tier key; without keys
every request is in the anonymous tier and the classes differ by ``X-TL-Priority``),
``--invalid-fraction F`` (0), ``--json PATH``. The exit status is 0 when every check passed.
``tests/cluster/test_soak.py`` runs a one-minute version.

The load (Poisson arrivals, a fixed seed): prompts of 8-200 tokens, some long ones (600-900
tokens, so that a small pool preempts), 8-96 new tokens; per request, at random:

- ``stream``: stream to the end;
- ``non_stream``: one JSON answer;
- ``mid_stream``: hang up after the first token (the server must abort it);
- ``early``: hang up after 10-400 ms, whatever the request is doing then (queued, in prefill,
  or streaming);
- ``invalid`` (a fraction ``--invalid-fraction`` of the requests, none by default): one JSON
  request with ``max_tokens`` -1, which the server must refuse with 400 ``invalid_request``.

The checks:

1. every request got an answer or a clear error: a complete stream or JSON body, or an HTTP
   error with an OpenAI error body, or an SSE error event; the client's own hang-ups aside.
   Nothing timed out (``--request-timeout``), nothing broke off without a reason. And the
   answers are what the mix asks for: some request succeeded, and no clear error has a code
   beyond those of the ``invalid`` requests (one ``invalid_request`` each) and a loaded
   server's refusals (``queue_full``, ``shed``): a ``model_not_found`` on every request is a
   failed soak, not a clear error;
2. no block leaked: once the load ends, every replica falls idle (nothing running or waiting)
   with every KV block free, within ``--settle-timeout`` s;
3. memory did not grow: each replica's resident memory at the end is within
   ``--max-rss-growth`` (a fraction) plus 64 MiB of its level once the warm-up (the first 30% of
   the run) was over.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from tierserve.cluster.load import DEFAULT_CLASSES, PREEMPTIONS, Scrape, TrafficClass, parse_metrics
from tierserve.cluster.measure import (
    RequestsFailed,
    machine,
    percentile,
    served_model_async,
    verdict,
)

KINDS = ("stream", "non_stream", "mid_stream", "early", "invalid")
INVALID_CODE = "invalid_request"  # the server's answer to an ``invalid`` request
RSS_SLACK = 64 * 2**20


@dataclass(frozen=True)
class SoakConfig:
    duration_s: float = 600.0
    rate: float = 2.0  # requests per second (Poisson)
    seed: int = 0
    prompt: tuple[int, int] = (8, 200)
    long_prompt: tuple[int, int] = (600, 900)
    long_fraction: float = 0.1
    output: tuple[int, int] = (8, 96)
    kinds: tuple[tuple[str, float], ...] = (
        ("stream", 0.55), ("non_stream", 0.15), ("mid_stream", 0.15), ("early", 0.15))
    request_timeout_s: float = 180.0
    settle_timeout_s: float = 120.0
    max_rss_growth: float = 0.10
    sample_every_s: float = 2.0
    vocab: int = 256  # prompt token ids are drawn below this

    def check(self) -> None:
        if self.duration_s <= 0 or self.rate <= 0:
            raise ValueError("duration and rate must be positive")
        unknown = {k for k, _ in self.kinds} - set(KINDS)
        if unknown:
            raise ValueError(f"unknown request kinds {sorted(unknown)}; choose from {KINDS}")

    @staticmethod
    def with_invalid(kinds: tuple[tuple[str, float], ...], fraction: float
                     ) -> tuple[tuple[str, float], ...]:
        """``kinds`` with ``invalid`` requests a ``fraction`` of the mix (the others scaled to
        the rest); ``kinds`` as they are for 0."""
        if not 0.0 <= fraction < 1.0:
            raise ValueError(f"the invalid fraction must be in [0, 1), got {fraction}")
        if fraction == 0.0:
            return kinds
        total = sum(w for k, w in kinds if k != "invalid")
        return (*((k, w * (1 - fraction) / total) for k, w in kinds if k != "invalid"),
                ("invalid", fraction))


@dataclass
class Outcome:
    """One request as the client saw it."""

    index: int
    kind: str
    cls: str
    status: int = 0
    result: str = ""  # ok | hung_up | clear_error | bad
    detail: str = ""  # the error code, or what went wrong
    tokens: int = 0
    seconds: float = 0.0


ReplicaState = dict[str, dict[str, float]]  # replica -> waiting, running, free/total blocks, rss
Probe = Callable[[], Awaitable[ReplicaState]]


@dataclass
class SoakReport:
    config: dict[str, Any]
    model: str = ""
    requests: int = 0
    results: dict[str, int] = field(default_factory=dict)
    by_kind: dict[str, dict[str, int]] = field(default_factory=dict)
    error_codes: dict[str, int] = field(default_factory=dict)
    bad: list[dict[str, Any]] = field(default_factory=list)
    preemptions: float | None = None
    settled: bool = False
    settle_s: float = 0.0
    final: ReplicaState = field(default_factory=dict)
    rss_mib: dict[str, dict[str, float]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failures


def _error_code(body: bytes) -> str | None:
    try:
        err = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return None
    if isinstance(err, dict) and isinstance(err.get("message"), str) and err.get("code"):
        return str(err["code"])
    return None


async def one_request(client: httpx.AsyncClient, model: str, cls: TrafficClass, index: int,
                      kind: str, prompt: list[int], max_tokens: int, hang_up_s: float,
                      timeout_s: float) -> Outcome:
    """Send one request of ``kind`` and classify what came back."""
    out = Outcome(index, kind, cls.name)
    t0 = time.perf_counter()
    json_only = kind in ("non_stream", "invalid")
    body: dict[str, Any] = {"model": model, "prompt": prompt,
                            "max_tokens": -1 if kind == "invalid" else max_tokens,
                            "ignore_eos": True, "stream": not json_only}

    async def run() -> None:
        if json_only:
            r = await client.post("/v1/completions", json=body, headers=cls.headers())
            out.status = r.status_code
            if r.status_code == 200 and kind == "invalid":
                out.result, out.detail = "bad", f"an invalid request was answered: {r.text[:200]}"
            elif r.status_code == 200:
                data = r.json()
                ok = data["choices"][0]["finish_reason"] in ("length", "stop")
                out.tokens = int(data["usage"]["completion_tokens"])
                out.result, out.detail = ("ok", "") if ok else ("bad", f"finish {data}")
            else:
                code = _error_code(r.content)
                out.result, out.detail = ("clear_error", code) if code else (
                    "bad", f"{r.status_code} without an error body: {r.text[:200]}")
            return
        async with client.stream("POST", "/v1/completions", json=body,
                                 headers=cls.headers()) as r:
            out.status = r.status_code
            if r.status_code != 200:
                code = _error_code(await r.aread())
                out.result, out.detail = ("clear_error", code) if code else (
                    "bad", f"{r.status_code} without an error body")
                return
            finish = None
            done = False
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    code = event["error"].get("code") if isinstance(event["error"], dict) else None
                    out.result, out.detail = ("clear_error", f"stream:{code}") if code else (
                        "bad", f"an error event without a code: {data[:200]}")
                    return
                choice = event["choices"][0]
                if choice["text"]:
                    out.tokens += 1
                    if kind == "mid_stream":
                        out.result = "hung_up"
                        return  # leaving the block closes the connection
                finish = choice["finish_reason"] or finish
            if finish in ("length", "stop") and done:
                out.result = "ok"
            else:
                out.result, out.detail = "bad", f"stream ended: finish={finish} done={done}"

    try:
        if kind == "early":
            try:
                await asyncio.wait_for(run(), timeout=hang_up_s)
            except TimeoutError:
                out.result, out.detail = "hung_up", f"after {hang_up_s:.2f} s"
        else:
            await asyncio.wait_for(run(), timeout=timeout_s)
    except TimeoutError:
        out.result, out.detail = "bad", f"no answer within {timeout_s} s"
    except (httpx.HTTPError, json.JSONDecodeError, KeyError, IndexError, TypeError) as e:
        out.result, out.detail = "bad", f"{type(e).__name__}: {e}"[:300]
    out.seconds = time.perf_counter() - t0
    return out


def metrics_probe(url: str, app: str | None = None) -> Probe:
    """Replica states from a Prometheus endpoint (Ray's metrics pipeline; gauges lag ~10 s)."""

    async def probe() -> ReplicaState:
        async with httpx.AsyncClient(timeout=10) as client:
            r = await client.get(url)
            r.raise_for_status()
        return Scrape(0.0, parse_metrics(r.text)).replicas(app)

    return probe


async def _preemptions(url: str | None) -> float | None:
    if not url:
        return None
    try:
        async with httpx.AsyncClient(timeout=10) as client:
            r = await client.get(url)
        return Scrape(0.0, parse_metrics(r.text)).total(PREEMPTIONS)
    except (httpx.HTTPError, ValueError):
        return None


def _idle(state: ReplicaState) -> bool:
    return bool(state) and all(
        s.get("waiting") == 0 and s.get("running") == 0
        and s.get("free_blocks") == s.get("total_blocks") for s in state.values())


async def soak(base_url: str, model: str | None, classes: Sequence[TrafficClass],
               cfg: SoakConfig, probe: Probe, metrics_url: str | None = None,
               log: Callable[[str], None] = print) -> SoakReport:
    """Run the load for ``cfg.duration_s``, then the checks; the report says what failed.
    ``model`` None: the one the server lists first at ``GET /v1/models`` (``RequestsFailed``,
    before anything is sent, when it lists none)."""
    cfg.check()
    report = SoakReport(config=asdict(cfg) | {"classes": [c.describe() for c in classes]})
    rng = random.Random(cfg.seed)
    kinds, weights = zip(*cfg.kinds, strict=True)
    rss: dict[str, list[tuple[float, float]]] = {}
    pre0 = await _preemptions(metrics_url)
    stop = asyncio.Event()
    t0 = time.perf_counter()

    async def sampler() -> None:
        while not stop.is_set():
            try:
                state = await probe()
            except Exception as e:  # a probe failure is reported, not fatal, during the run
                log(f"  probe failed: {type(e).__name__}: {e}")
                state = {}
            now = time.perf_counter() - t0
            for name, s in state.items():
                if s.get("rss_bytes"):
                    rss.setdefault(name, []).append((now, s["rss_bytes"]))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), cfg.sample_every_s)

    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
    async with httpx.AsyncClient(base_url=base_url, timeout=cfg.request_timeout_s,
                                 limits=limits) as client:
        if model is None:
            model = await served_model_async(client, base_url)
        report.model = model
        sampling = asyncio.create_task(sampler())
        tasks: list[asyncio.Task[Outcome]] = []
        t = 0.0
        last_log = 0.0
        while True:
            t += rng.expovariate(cfg.rate)
            if t >= cfg.duration_s:
                break
            delay = t0 + t - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            long = rng.random() < cfg.long_fraction
            n = rng.randint(*(cfg.long_prompt if long else cfg.prompt))
            prompt = [rng.randrange(3, cfg.vocab) for _ in range(n)]
            kind = rng.choices(kinds, weights)[0]
            cls = rng.choice(list(classes))
            tasks.append(asyncio.create_task(one_request(
                client, model, cls, len(tasks), kind, prompt, rng.randint(*cfg.output),
                rng.uniform(0.01, 0.4), cfg.request_timeout_s)))
            if t - last_log >= 30:
                last_log = t
                done = sum(x.done() for x in tasks)
                log(f"  {t:5.0f} s: {len(tasks)} sent, {done} answered")
        outcomes = await asyncio.gather(*tasks)
        log(f"  load over after {time.perf_counter() - t0:.0f} s: {len(outcomes)} requests")
        # Settle: every replica idle with every block free.
        t_settle = time.perf_counter()
        state: ReplicaState = {}
        while time.perf_counter() - t_settle < cfg.settle_timeout_s:
            try:
                state = await probe()
            except Exception:
                state = {}
            if _idle(state):
                report.settled = True
                break
            await asyncio.sleep(0.5)
        report.settle_s = round(time.perf_counter() - t_settle, 1)
        report.final = state
        stop.set()
        await sampling
    pre1 = await _preemptions(metrics_url)
    if pre0 is not None and pre1 is not None:
        report.preemptions = pre1 - pre0

    report.requests = len(outcomes)
    report.results = dict(Counter(o.result for o in outcomes))
    for k in KINDS:
        report.by_kind[k] = dict(Counter(o.result for o in outcomes if o.kind == k))
    report.error_codes = dict(Counter(o.detail for o in outcomes if o.result == "clear_error"))
    report.bad = [asdict(o) for o in outcomes if o.result not in ("ok", "hung_up", "clear_error")]
    answered = sum(o.result == "ok" or (o.result == "hung_up" and o.tokens > 0) for o in outcomes)
    judged = verdict(sent=len(outcomes), succeeded=answered, errors=report.error_codes,
                     expected={INVALID_CODE: sum(o.kind == "invalid" for o in outcomes)})
    report.failures.extend(judged.reasons)
    if report.bad:
        report.failures.append(f"{len(report.bad)} requests got no answer or an unclear one "
                               f"(first: {report.bad[0]})")
    if not report.settled:
        report.failures.append(f"the cluster did not fall idle with every block free within "
                               f"{cfg.settle_timeout_s} s: {state}")
    warm = 0.3 * cfg.duration_s
    for name, points in sorted(rss.items()):
        after_warmup = [v for t_, v in points if t_ >= warm]
        if len(after_warmup) < 2:
            continue
        base = percentile(after_warmup[: max(1, len(after_warmup) // 5)], 50)
        end = percentile(after_warmup[-max(1, len(after_warmup) // 5):], 50)
        report.rss_mib[name] = {"after_warmup": round(base / 2**20, 1),
                                "end": round(end / 2**20, 1),
                                "max": round(max(after_warmup) / 2**20, 1)}
        if end > base * (1 + cfg.max_rss_growth) + RSS_SLACK:
            report.failures.append(f"replica {name} grew from {base / 2**20:.0f} MiB to "
                                   f"{end / 2**20:.0f} MiB")
    if not report.rss_mib:
        report.failures.append("no memory samples of any replica after the warm-up")
    return report


def print_report(report: SoakReport) -> None:
    print(f"model: {report.model}  requests: {report.requests}  results: {report.results}")
    for kind, counts in report.by_kind.items():
        print(f"  {kind:10s} {counts}")
    print(f"clear errors by code: {report.error_codes}")
    print(f"preemptions during the run: {report.preemptions}")
    print(f"settled idle with every block free: {report.settled} (after {report.settle_s} s)")
    for name, mib in report.rss_mib.items():
        print(f"  memory {name}: {mib}")
    print("PASSED" if report.passed else "FAILED:\n  " + "\n  ".join(report.failures))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--metrics-url", default="http://127.0.0.1:8080/metrics")
    ap.add_argument("--app", default=None, help="the Serve application (default: all)")
    ap.add_argument("--model", default=None, help="default: the first of /v1/models")
    ap.add_argument("--duration", type=float, default=600.0)
    ap.add_argument("--rate", type=float, default=2.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--invalid-fraction", type=float, default=0.0,
                    help="a fraction of invalid requests (400 invalid_request expected)")
    ap.add_argument("--key", action="append", default=[], metavar="TIER=KEY",
                    help="one traffic class per tier key (KEY may be env:VAR)")
    ap.add_argument("--max-rss-growth", type=float, default=0.10)
    ap.add_argument("--settle-timeout", type=float, default=120.0)
    ap.add_argument("--request-timeout", type=float, default=180.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    classes = [TrafficClass.parse(f"{k.partition('=')[0]},key={k.partition('=')[2]}")
               for k in args.key] or [TrafficClass.parse(c) for c in DEFAULT_CLASSES]
    try:
        kinds = SoakConfig.with_invalid(SoakConfig.kinds, args.invalid_fraction)
    except ValueError as e:
        ap.error(f"--invalid-fraction: {e}")
    cfg = SoakConfig(duration_s=args.duration, rate=args.rate, seed=args.seed, kinds=kinds,
                     max_rss_growth=args.max_rss_growth, settle_timeout_s=args.settle_timeout,
                     request_timeout_s=args.request_timeout)
    try:
        report = asyncio.run(soak(args.url, args.model, classes, cfg,
                                  metrics_probe(args.metrics_url, args.app), args.metrics_url))
    except RequestsFailed as e:
        print(f"benchmarks.soak: {e} (or pass --model)", file=sys.stderr)
        return 1
    print_report(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine(torch_info=False), **asdict(report)}, f, indent=1)
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
