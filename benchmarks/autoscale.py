"""Autoscaling under a load that comes and goes: ``python -m benchmarks.autoscale``.

Starts ``--config`` (``configs/cluster-autoscale.yaml``: one replica, at most two, on
tierserve's policy) with ``benchmarks.tiers``' keys and traffic classes (interactive,
standard tenants a and b, batch; prompts ``uniform:64:256``, outputs ``uniform:16:64``), as
``make serve`` would (``python -m tierserve.cluster.launch``), with the policy's trace on
(``TIERSERVE_AUTOSCALE_TRACE``: what it saw and decided, each second). Then three phases of
open-loop Poisson arrivals with no client cap: ``--low`` requests/s for ``--low-s`` s (one
replica carries it), ``--high`` for ``--high-s`` (above one replica's capacity), then nothing
until the policy is back at one replica (at most ``--idle-timeout`` s).

Figures: when the policy asked for the second replica (from the high phase's start and from
the first interactive request that missed a target), when it ran, when the policy let it go
after the load stopped and when it was gone; every request's outcome (answered, refused with
429/503, lost: no answer, a transport error or a stream cut); the interactive tier's target
attainment before the load rose, during the high phase before and after the scale-up, and
after; every replica idle with all KV blocks free at the end (from the metrics). Output
(``--out-dir``, ``--name``): ``NAME.json``, ``NAME_timeline.png`` (load, replicas, interactive
attainment over time, 10 s bins), ``NAME_cluster.log``; ``--trace-out`` also writes the
recorded trace in the form ``tests/cluster/test_autoscaling_policy.py`` replays.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from benchmarks import tiers as tb
from benchmarks.serving import stop
from benchmarks.tools import ROOT
from tierserve.cluster.app import POLICY
from tierserve.cluster.autoscaling import TRACE_ENV
from tierserve.cluster.load import LengthDist, Result
from tierserve.cluster.measure import machine, pyplot

BIN_S = 10.0
AFTER_S = 20.0


def autoscaling(config: dict[str, Any]) -> dict[str, Any]:
    """The ``autoscaling_config`` of ``config``'s deployment on tierserve's policy."""
    for app in config.get("applications") or []:
        for dep in app.get("deployments") or []:
            scaling = dep.get("autoscaling_config") or {}
            if (scaling.get("policy") or {}).get("policy_function") == POLICY:
                return dict(scaling)
    raise ValueError(f"the config has no deployment autoscaled by {POLICY}")


def read_trace(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def first_time(trace: Sequence[dict[str, Any]], after: float, ok: Any) -> float | None:
    return next((t["t"] for t in trace if t["t"] >= after and ok(t)), None)


def attainment(results: Sequence[tuple[float, Result]], targets: tb.Targets,
               t0: float, t1: float) -> dict[str, Any]:
    """The interactive requests that arrived in ``[t0, t1)`` (wall seconds): how many, and the
    share answered within both targets."""
    sel = [r for t, r in results if t0 <= t < t1]
    met = sum(1 for r in sel if all(targets.met(r)))
    return {"n": len(sel), "both": round(met / len(sel), 4) if sel else None}


def outcomes(results: Sequence[Result]) -> dict[str, int]:
    out = {"sent": len(results), "answered": 0, "refused_429": 0, "refused_503": 0,
           "refused_other": 0, "lost": 0}
    for r in results:
        if r.outcome == "ok":
            out["answered"] += 1
        elif r.outcome == "rejected":
            key = {429: "refused_429", 503: "refused_503"}.get(r.status, "refused_other")
            out[key] += 1
        else:
            out["lost"] += 1
    return out


def timeline(results: Sequence[tuple[float, Result]], trace: Sequence[dict[str, Any]],
             interactive: tb.Targets, start: float, end: float) -> list[dict[str, Any]]:
    """Per ``BIN_S`` bin from ``start``: requests sent per second, the interactive share within
    targets, and the replicas (target and running) at the bin's end."""
    rows = []
    inter = [(w, r) for w, r in results if r.cls == "interactive"]
    t = start
    while t < end:
        sent = [r for w, r in results if t <= w < t + BIN_S]
        last = next((x for x in reversed(trace) if x["t"] < t + BIN_S), None)
        rows.append({"t": round(t - start, 1), "sent_per_s": round(len(sent) / BIN_S, 3),
                     "interactive": attainment(inter, interactive, t, t + BIN_S),
                     "target": last["replicas"] if last else None,
                     "running": last["running"] if last else None})
        t += BIN_S
    return rows


def plot(rows: Sequence[dict[str, Any]], marks: dict[str, float | None], path: Path,
         title: str, replicas: Sequence[tuple[float, int, int]] = ()) -> None:
    """Three panels over time: load, replicas (from ``replicas``: the trace's (seconds, target,
    running) at its own resolution, else the bins'), interactive attainment per bin."""
    plt = pyplot()
    fig, axes = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    ts = [r["t"] for r in rows]
    axes[0].step(ts, [r["sent_per_s"] for r in rows], where="post", label="requests sent /s")
    axes[0].set_ylabel("load (req/s)")
    points = list(replicas) or [(r["t"], r["target"], r["running"]) for r in rows]
    axes[1].step([p[0] for p in points], [p[1] for p in points], where="post",
                 label="target (policy)")
    axes[1].step([p[0] for p in points], [p[2] for p in points], where="post", linestyle="--",
                 label="running")
    axes[1].set_ylabel("replicas")
    axes[1].set_ylim(0, 3)
    axes[2].plot(ts, [r["interactive"]["both"] for r in rows], marker="o")
    axes[2].set_ylabel("interactive within\nboth targets")
    axes[2].set_ylim(-0.05, 1.05)
    axes[2].set_xlabel(f"seconds ({BIN_S:g} s bins)")
    for ax in axes:
        for name, at in marks.items():
            if at is not None:
                ax.axvline(at, color="grey", linewidth=0.8, linestyle=":")
                if ax is axes[0]:
                    ax.annotate(name, (at, ax.get_ylim()[1]), rotation=90, fontsize=7,
                                va="top", ha="right")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    axes[1].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.autoscale", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/cluster-autoscale.yaml")
    p.add_argument("--low", type=float, default=0.5, help="requests/s before (default 0.5)")
    p.add_argument("--high", type=float, default=3.0,
                   help="requests/s of the high phase (default 3.0: about twice what one "
                   "replica of the default config serves on 2 cores)")
    p.add_argument("--low-s", type=float, default=60.0)
    p.add_argument("--high-s", type=float, default=180.0)
    p.add_argument("--idle-timeout", type=float, default=300.0)
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--metrics-port", type=int, default=8080)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default="benchmarks/out")
    p.add_argument("--name", default="autoscale")
    p.add_argument("--trace-out", default=None, help="also write the trace for the tests here")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    base = yaml.safe_load((ROOT / args.config).read_text())
    config = tb.derive_config(base, "tiers")
    scaling = autoscaling(config)
    kwargs = dict(scaling["policy"].get("policy_kwargs") or {})
    bounds = [scaling.get("min_replicas", 1), scaling.get("max_replicas", 1)]
    targets = tb.tier_targets(config)
    keys = tb.new_keys()
    url = tb.http_target(config)
    metrics_url = f"http://127.0.0.1:{args.metrics_port}/metrics"
    tb.raise_fd_limit()
    with tempfile.TemporaryDirectory(prefix="tierserve-autoscale-") as tmp:
        cfg_path, trace_path = Path(tmp) / "cluster.yaml", Path(tmp) / "trace.jsonl"
        cfg_path.write_text(yaml.safe_dump(config))
        env = dict(os.environ) | keys | {TRACE_ENV: str(trace_path)}
        proc, start_s = tb.start_cluster(cfg_path, env, out / f"{args.name}_cluster.log", url,
                                         args.metrics_port, keys[tb.KEY_VARS["interactive"]],
                                         args.start_timeout)
        try:
            plan = tb.Plan(url=url, metrics_url=metrics_url,
                           prompt_len=LengthDist.parse("uniform:64:256"),
                           output_len=LengthDist.parse("uniform:16:64"), duration_s=60.0,
                           drain_s=120.0, seed=args.seed, progress=not args.no_progress)
            classes = tb.traffic(keys)
            phases: dict[str, float] = {}
            results: list[tuple[float, Result]] = []
            for i, (name, rate, seconds) in enumerate((("low", args.low, args.low_s),
                                                       ("high", args.high, args.high_s))):
                phases[f"{name}_start"] = time.time()
                run, _, _ = tb.run_load(plan, classes, args.seed + i, rate=rate,
                                        duration_s=seconds)
                phases[f"{name}_stop"] = phases[f"{name}_start"] + seconds
                results += [(phases[f"{name}_start"] + r.start, r) for r in run.results]
            deadline = time.time() + args.idle_timeout
            while time.time() < deadline:
                trace = read_trace(trace_path)
                if trace and trace[-1]["t"] > phases["high_stop"] and trace[-1]["running"] == 1:
                    break
                time.sleep(2.0)
            time.sleep(AFTER_S)  # the trace goes on a while after the scale-down
            phases["end"] = time.time()
            idle_scrape, idle = tb.settle(metrics_url, 60.0, 0.0)
        finally:
            stop(proc)
        trace = read_trace(trace_path)

    t0 = phases["low_start"]
    up_asked = first_time(trace, phases["high_start"], lambda x: x["action"] == "up")
    up_running = first_time(trace, up_asked or float("inf"), lambda x: x["running"] >= 2)
    down_asked = first_time(trace, phases["high_stop"], lambda x: x["action"] == "down")
    down_done = first_time(trace, down_asked or float("inf"),
                           lambda x: x["running"] == 1 and x["target"] == 1)
    inter = [(w, r) for w, r in results if r.cls == "interactive"]
    first_miss = next((w for w, r in sorted(inter, key=lambda x: x[0])
                       if w >= phases["high_start"] and not all(targets["interactive"].met(r))),
                      None)

    def rel(x: float | None, zero: float) -> float | None:
        return None if x is None else round(x - zero, 2)

    report = {
        "tool": "benchmarks.autoscale", "machine": machine(torch_info=False),
        "config": args.config, "policy_kwargs": kwargs, "cluster_start_s": round(start_s, 1),
        "phases": {k: round(v - t0, 2) for k, v in phases.items()},
        "rates": {"low": args.low, "high": args.high},
        "scale_up": {"asked_after_high_start_s": rel(up_asked, phases["high_start"]),
                     "asked_after_first_interactive_miss_s": rel(up_asked, first_miss)
                     if first_miss is not None and up_asked is not None else None,
                     "running_after_high_start_s": rel(up_running, phases["high_start"])},
        "scale_down": {"asked_after_load_stop_s": rel(down_asked, phases["high_stop"]),
                       "done_after_load_stop_s": rel(down_done, phases["high_stop"])},
        "decisions": [{"t": round(x["t"] - t0, 1), "action": x["action"],
                       "reason": x["reason"], "replicas": x["replicas"]}
                      for x in trace if x["action"] != "hold"],
        "outcomes": {name: outcomes([r for w, r in results
                                     if phases[f"{name}_start"] <= w < phases[f"{name}_stop"]])
                     for name in ("low", "high")},
        "interactive_attainment": {
            "low": attainment(inter, targets["interactive"], phases["low_start"],
                              phases["low_stop"]),
            "high_before_second_replica": attainment(
                inter, targets["interactive"], phases["high_start"],
                up_running or phases["high_stop"]),
            "high_with_two_replicas": attainment(
                inter, targets["interactive"], up_running or phases["high_stop"],
                phases["high_stop"]),
        },
        "idle_at_end": idle,
        # Per replica as the last scrape has it (a replica scaled down keeps its last gauges
        # there until Ray lets them expire).
        "replicas_at_end": None if idle_scrape is None else idle_scrape.replicas(),
        "timeline": timeline(results, trace, targets["interactive"], t0, phases["end"]),
    }
    path = out / f"{args.name}.json"
    path.write_text(json.dumps(report, indent=1))
    marks = {"high load": phases["high_start"] - t0, "load stops": phases["high_stop"] - t0,
             "up asked": rel(up_asked, t0), "down asked": rel(down_asked, t0)}
    plot(report["timeline"], marks, out / f"{args.name}_timeline.png",
         f"autoscaling {args.config}: {args.low:g} -> {args.high:g} req/s -> 0 "
         f"({report['machine'].get('cpu', '')})",
         [(x["t"] - t0, x["replicas"], x["running"]) for x in trace])
    if args.trace_out:
        ticks = [{"t": round(x["t"] - t0, 3), "running": x["running"], "target": x["target"],
                  "reports": x["reports"], "action": x["action"]} for x in trace]
        Path(args.trace_out).write_text(json.dumps({
            "source": f"python -m benchmarks.autoscale --config {args.config}",
            "policy_kwargs": kwargs, "bounds": bounds,
            "phases": {"load_start": round(phases["high_start"] - t0, 3),
                       "load_stop": round(phases["high_stop"] - t0, 3)},
            "ticks": ticks}, separators=(",", ":")) + "\n")
    summary = {k: report[k] for k in ("scale_up", "scale_down", "outcomes",
                                      "interactive_attainment", "idle_at_end", "replicas_at_end")}
    print(json.dumps(summary, indent=1))
    print(f"wrote {path}")
    lost = sum(o["lost"] for o in report["outcomes"].values())
    leaked = [r for r in (report["replicas_at_end"] or {}).values()
              if r.get("free_blocks") != r.get("total_blocks")]
    ok = up_asked is not None and down_done is not None and lost == 0 and idle and not leaked
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
