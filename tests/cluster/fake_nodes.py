"""The driver of ``tests/cluster/test_autoscaling_nodes.py``, run as a process of its own
(``python -m tests.cluster.fake_nodes``): it starts a Ray cluster whose autoscaler adds and
removes fake nodes, deploys the autoscaled app on it, drives a load and checks what the test
describes; exit status 0 when every check held, the observations as JSON on a line of stdout that starts with ``MARK``.

A process of its own, because the cluster runs without token authentication (its own token
would have to reach the driver) and Ray reads that setting once per process: the test
process, whose other modules start their own Ray, must not be touched.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import ray
from ray import serve

from tests.cluster.helpers import ServeApp, deploy, free_port, start_serve, wait_for
from tests.cluster.test_autoscaling import autoscaled, complete, load, running

SLOT = "replica_slot"
MARK = "fake-nodes: "  # the line of stdout that carries the observations (Ray logs there too)
IDLE_TIMEOUT_MIN = 0.1  # a worker node idle this long (6 s) is removed


def autoscaler_config(gcs: str) -> dict[str, Any]:
    """Ray's cluster config for the fake-node provider (what Ray's own fake-cluster tests use)."""
    return {
        "cluster_name": "tierserve-fake",
        "max_workers": 2,
        "upscaling_speed": 1.0,
        "idle_timeout_minutes": IDLE_TIMEOUT_MIN,
        "provider": {"type": "fake_multinode", "use_node_id_as_ip": True,
                     "disable_node_updaters": True, "disable_launch_config_check": True,
                     "gcs_address": gcs},
        "auth": {}, "docker": {}, "file_mounts": {}, "cluster_synced_files": [],
        "file_mounts_sync_continuously": False, "rsync_exclude": [], "rsync_filter": [],
        "initialization_commands": [], "setup_commands": [], "head_setup_commands": [],
        "worker_setup_commands": [], "head_start_ray_commands": [],
        "worker_start_ray_commands": [],
        "head_node_type": "ray.head.default",
        "available_node_types": {
            "ray.head.default": {"resources": {"CPU": 2}, "node_config": {}, "max_workers": 0},
            "replica.node": {"resources": {"CPU": 1, SLOT: 1}, "node_config": {},
                             "min_workers": 0, "max_workers": 2},
        },
    }


def kill_cluster(temp_dir: str) -> None:
    """Every process whose command line names ``temp_dir`` (this cluster's and no other)."""
    for pid_dir in Path("/proc").iterdir():
        if not pid_dir.name.isdigit() or int(pid_dir.name) == os.getpid():
            continue
        try:
            cmd = (pid_dir / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if temp_dir in cmd:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(int(pid_dir.name), signal.SIGKILL)


def slot_nodes() -> int:
    """Alive nodes that offer a replica slot (the ones Ray's autoscaler added)."""
    return sum(1 for n in ray.nodes() if n["Alive"] and n["Resources"].get(SLOT))


def scenario(app: ServeApp) -> dict[str, Any]:
    seen: list[tuple[int, int]] = []
    first = (running(app), slot_nodes())

    async def go() -> None:
        task = asyncio.ensure_future(load(app, 60.0, concurrency=8))
        while not task.done():
            seen.append(await asyncio.to_thread(lambda: (running(app), slot_nodes())))
            await asyncio.sleep(1.0)
        complete(await task)

    asyncio.run(go())
    wait_for("one replica again", lambda: running(app) == 1, timeout_s=180, every_s=1.0)
    wait_for("the idle node let go", lambda: slot_nodes() == 1, timeout_s=240, every_s=1.0)
    app.wait_idle()
    return {"first": first, "seen": seen, "last": (running(app), slot_nodes())}


def main() -> int:
    temp_dir = tempfile.mkdtemp(prefix="tsfake-", dir="/tmp")
    port, ip = free_port(), "127.0.0.1"
    config = Path(temp_dir) / "autoscaler.json"
    config.write_text(json.dumps(autoscaler_config(f"{ip}:{port}")))
    ray_bin = str(Path(sys.executable).parent / "ray")
    env = dict(os.environ, AUTOSCALER_UPDATE_INTERVAL_S="1", RAY_FAKE_CLUSTER="1",
               RAY_USAGE_STATS_ENABLED="0")
    try:
        subprocess.run([ray_bin, "start", "--head", f"--port={port}", f"--node-ip-address={ip}",
                        "--num-cpus=2", f"--temp-dir={temp_dir}", "--include-dashboard=false",
                        f"--autoscaling-config={config}"],
                       env=env, check=True, capture_output=True, timeout=180)
        ray.init(address=f"{ip}:{port}", logging_level=logging.WARNING, log_to_driver=False)
        http = free_port()
        cfg = autoscaled(kwargs={"upscale_after_s": 1, "downscale_after_s": 5,
                                 "waiting_high": 1, "busy_low": 0.95})
        llm = next(d for d in cfg["deployments"] if d["name"] == "LLMServer")
        llm["ray_actor_options"] = {"num_cpus": 0.5, "resources": {SLOT: 1}}
        deploy(start_serve(http), [cfg], timeout_s=600)
        app = ServeApp("auto", f"http://127.0.0.1:{http}/auto", num_replicas=1)
        app.wait_ready()
        print(MARK + json.dumps(scenario(app)), flush=True)
        return 0
    finally:
        if ray.is_initialized():
            with contextlib.suppress(Exception):
                serve.shutdown()
            ray.shutdown()
        kill_cluster(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
