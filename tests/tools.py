"""The ecosystem's own tools for the tests that run them as users do: ``guidellm``, ``aiperf``
and LangChain's ``langchain-openai`` (``benchmarks.tools``: virtualenvs of their own),
Debian's ``prometheus``.

Each is installed by the test setup when missing, from the package registries only:
``prometheus`` with apt (its service is not started: the tests start their own).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from benchmarks.tools import AIPERF, GUIDELLM, LANGCHAIN, ROOT, TOOLS, tool_venv  # noqa: F401 (the tests' names)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def prometheus_binary() -> str:
    """Debian's ``prometheus``, installed with apt when it is missing (as root)."""
    found = shutil.which("prometheus")
    if found:
        return found
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise RuntimeError("prometheus is not installed and apt-get cannot run here: "
                           "apt-get install prometheus")
    env = os.environ | {"DEBIAN_FRONTEND": "noninteractive"}
    policy = Path("/usr/sbin/policy-rc.d")
    added = not policy.exists()
    if added:  # keep the package's own service from starting on :9090
        policy.write_text("#!/bin/sh\nexit 101\n")
        policy.chmod(0o755)
    try:
        install = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "prometheus"]
        if subprocess.run(install, env=env, capture_output=True, timeout=900).returncode != 0:
            subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True,
                           timeout=900, check=True)
            proc = subprocess.run(install, env=env, capture_output=True, text=True, timeout=900)
            if proc.returncode != 0:
                raise RuntimeError(f"apt-get install prometheus failed:\n{proc.stderr[-3000:]}")
    finally:
        if added:
            policy.unlink()
    found = shutil.which("prometheus")
    if not found:
        raise RuntimeError("apt-get installed prometheus but it is not on PATH")
    return found


@dataclass
class Prometheus:
    """A Prometheus server of the test's own, scraping ``targets`` every second."""

    url: str
    proc: subprocess.Popen[bytes]
    workdir: Path

    @classmethod
    def start(cls, targets: list[str], workdir: Path) -> Prometheus:
        binary = prometheus_binary()
        port = free_port()
        config = workdir / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
            "scrape_configs:\n  - job_name: tierserve-test\n    static_configs:\n"
            f"      - targets: {targets!r}\n".replace("'", '"')
        )
        log = open(workdir / "prometheus.log", "wb")  # noqa: SIM115 (lives with the process)
        proc = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}"],
            stdout=log, stderr=subprocess.STDOUT,
        )
        server = cls(f"http://127.0.0.1:{port}", proc, workdir)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"prometheus exited: {(workdir / 'prometheus.log').read_text()}")
            try:
                if httpx.get(f"{server.url}/-/ready", timeout=2).status_code == 200:
                    return server
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError("prometheus did not become ready in 60 s")

    def query(self, expr: str) -> list[dict[str, object]]:
        """The result vector of an instant query (raises on a PromQL error)."""
        r = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=30)
        body = r.json()
        if r.status_code != 200 or body.get("status") != "success":
            raise AssertionError(f"prometheus refused {expr!r}: {body}")
        result: list[dict[str, object]] = body["data"]["result"]
        return result

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
