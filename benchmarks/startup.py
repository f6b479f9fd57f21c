"""Start-up, side by side with Ray Serve's own floor: ``python -m benchmarks.startup``.

Each round starts, one after the other on this machine, as ``make serve`` does
(``python -m tierserve.cluster.launch CONFIG``, which starts a local Ray instance and runs the config):

- ``tierserve``: ``CONFIG`` (default ``configs/cluster.yaml``);
- ``floor``: the same launcher on a config made from ``CONFIG`` whose deployments keep their
  names, replica counts and resources but do nothing: an ``Ingress`` that answers ``GET /`` by
  calling one ``LLMServer`` replica, which returns a string (no model, no tokenizer, Serve's own
  request router). What this takes is Ray's and Serve's part of the start-up: the Ray instance,
  the Serve controller and proxy, the application's build and one worker process per replica.

Times, from the launcher's start: ``http`` (the proxy answers the app's route: ``GET
/v1/models`` names a model, or ``GET /`` for the floor) and ``ready`` (the first answered request
through a model replica: a one-token completion of the model ``/v1/models`` names, or ``GET /``
for the floor). tierserve's time above the floor is what its own code adds. ``--rounds R`` (3;
the order alternates), ``--config PATH``, ``--json PATH``. Nothing here asserts on time; but a
launch that never answers (within 300 s), names no model, or refuses the completion for a
reason that waiting cannot change (a 4xx other than 429, e.g. ``model_not_found``) ends the run
with exit status 1.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from benchmarks.serving import (
    DEFAULT_CONFIG,
    answers,
    completion_ready,
    names_a_model,
    stop,
    wait_for,
)
from benchmarks.tools import ROOT
from tierserve.cluster.measure import load_avg_1m, machine

FLOOR_IMPORT_PATH = "benchmarks.startup:floor_app"
TIMEOUT_S = 300.0


def floor_app(args: dict[str, Any] | None = None) -> Any:
    """The floor's Serve application: ``Ingress`` -> ``LLMServer``, both trivial (the config
    supplies replicas and resources)."""
    from ray import serve
    from ray.serve.handle import DeploymentHandle

    class Echo:
        async def __call__(self) -> str:
            return "ok"

    class Front:
        def __init__(self, llm: DeploymentHandle) -> None:
            self.llm = llm

        async def __call__(self, request: Any) -> str:
            return str(await self.llm.remote())

    echo = serve.deployment(name="LLMServer")(Echo)
    front = serve.deployment(name="Ingress")(Front)
    return front.bind(echo.bind())


def floor_config(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` (a Serve deploy config) with its application replaced by ``floor_app``: the
    same HTTP options and, per deployment, the same name, replica count and actor resources."""
    out = {k: v for k, v in config.items() if k != "applications"}
    apps = []
    for app in config.get("applications") or []:
        deployments = [
            {k: d[k] for k in ("name", "num_replicas", "ray_actor_options") if k in d}
            for d in app.get("deployments") or []
        ]
        apps.append({"name": app.get("name", "default"), "route_prefix": app.get("route_prefix", "/"),
                     "import_path": FLOOR_IMPORT_PATH, "deployments": deployments})
    if not apps:
        raise ValueError("the config has no applications")
    out["applications"] = apps
    return out


@dataclass(slots=True)
class Start:
    system: str  # tierserve or floor
    round: int
    http_s: float
    ready_s: float


def _port(config: dict[str, Any]) -> int:
    return int((config.get("http_options") or {}).get("port", 8000))


def measure(system: str, rnd: int, config_path: Path, port: int, log: Path) -> Start:
    """Start the launcher on ``config_path``; the times until HTTP and the first request answer.
    The launcher is stopped (Ctrl-C to its process group) before returning. ``RuntimeError``
    when it does not answer in time; ``RequestsFailed`` when it names no model or refuses the
    completion for good."""
    url = f"http://127.0.0.1:{port}"
    found: list[str] = []
    if system == "floor":
        http = ready = lambda: answers(lambda: httpx.get(f"{url}/", timeout=30))
    else:
        http = lambda: names_a_model(url, found)  # noqa: E731
        ready = lambda: completion_ready(url, found[-1])  # noqa: E731
    with open(log, "wb") as out:
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "tierserve.cluster.launch", str(config_path)],
                                cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        name = f"{system} (the launcher)"
        wait_for(proc, http, log, t0, TIMEOUT_S, name, poll_s=0.1)
        http_s = time.perf_counter() - t0
        wait_for(proc, ready, log, t0, TIMEOUT_S, name, poll_s=0.1)
        ready_s = time.perf_counter() - t0
    finally:
        stop(proc)
    return Start(system, rnd, http_s, ready_s)


def summarize(starts: list[Start]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for system in sorted({s.system for s in starts}):
        mine = [s for s in starts if s.system == system]
        out[system] = {"http_s": statistics.median(s.http_s for s in mine),
                       "ready_s": statistics.median(s.ready_s for s in mine)}
    if {"tierserve", "floor"} <= out.keys():
        out["above_floor_s"] = out["tierserve"]["ready_s"] - out["floor"]["ready_s"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--config", default=DEFAULT_CONFIG)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    config_path = Path(args.config).resolve()
    if not config_path.is_file():
        ap.error(f"--config {args.config}: no such file")
    config = yaml.safe_load(config_path.read_text())
    try:
        floor = floor_config(config)
    except (ValueError, AttributeError, TypeError) as e:
        ap.error(f"--config {args.config}: not a Serve deploy config ({e})")
    m = machine(load_avg_before=load_avg_1m())
    print(f"machine: {m}\nconfig: {config_path}", flush=True)
    starts: list[Start] = []
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp:
        floor_path = Path(tmp) / "floor.yaml"
        floor_path.write_text(yaml.safe_dump(floor))
        paths = {"tierserve": config_path, "floor": floor_path}
        for rnd in range(args.rounds):
            order = ["tierserve", "floor"] if rnd % 2 == 0 else ["floor", "tierserve"]
            for system in order:
                try:
                    s = measure(system, rnd, paths[system], _port(config),
                                Path(tmp) / f"{system}.log")
                except RuntimeError as e:
                    print(f"benchmarks.startup: {system} round {rnd}: {e}", file=sys.stderr)
                    return 1
                print(f"  {system:9s} round {rnd}: HTTP after {s.http_s:.1f} s, first answer "
                      f"after {s.ready_s:.1f} s", flush=True)
                starts.append(s)
    summary = summarize(starts)
    m["load_avg_after"] = load_avg_1m()
    print("medians: " + json.dumps(summary))
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": m, "config": str(config_path),
                                               "starts": [asdict(s) for s in starts],
                                               "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
