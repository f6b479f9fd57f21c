"""llama.cpp as a peer: its ``llama-server`` on a GGUF file, driven with token-id prompts.

llama.cpp is not a dependency. Build it once (about 15 minutes on 2 cores) from the source that
the ``llama-cpp-python`` sdist vendors::

    pip download --no-deps --no-binary :all: llama-cpp-python && tar xzf llama_cpp_python-*.tar.gz
    cd llama_cpp_python-*/vendor/llama.cpp
    cmake -B build -DLLAMA_CURL=OFF -DGGML_NATIVE=ON -DCMAKE_BUILD_TYPE=Release
    cmake --build build --target llama-server -j2

and point ``$TIERSERVE_LLAMA_SERVER`` at ``build/bin/llama-server`` (else ``llama-server`` on the
PATH). ``run_mix`` starts a server with ``slots`` parallel sequences (its ``-np``: the cap on
running requests) and a context of ``slots x ctx_per_slot`` positions, ``threads`` threads, waits
for ``/health``, sends every request of the mix at once to ``/completion`` (prompt as token ids,
greedy, EOS ignored, ``n_predict`` the request's tokens, the prompt cache on, as tierserve's
prefix cache is) and times from the first send to the last answer. Start-up is timed apart.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ENV_BIN = "TIERSERVE_LLAMA_SERVER"


def server_binary() -> Path:
    """The ``llama-server`` to run; ``FileNotFoundError`` (saying how to build one) if none."""
    named = os.environ.get(ENV_BIN)
    found = named or shutil.which("llama-server")
    if not found or not Path(found).is_file():
        raise FileNotFoundError(
            f"no llama-server ({ENV_BIN}={named!r}, none on the PATH): build one as "
            "benchmarks/llamacpp_peer.py's docstring says"
        )
    return Path(found)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(slots=True)
class MixResult:
    """What one pass over the mix gave."""

    wall_s: float
    startup_s: float
    tokens: list[list[int]]
    version: str


def run_mix(gguf: Path, mix: Sequence[tuple[Sequence[int], int]], slots: int,
            ctx_per_slot: int, threads: int = 2, timeout_s: float = 3600) -> MixResult:
    """Every ``(prompt ids, new tokens)`` of ``mix`` through one fresh ``llama-server``."""
    binary = server_binary()
    port = _free_port()
    cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
           "-np", str(slots), "-c", str(slots * ctx_per_slot), "-t", str(threads),
           "-tb", str(threads), "--cont-batching", "--no-webui", "-b", "2048", "-ub", "512"]
    with tempfile.NamedTemporaryFile(prefix="llama-server-", suffix=".log") as log:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            import httpx

            base = f"http://127.0.0.1:{port}"
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"llama-server exited with {proc.returncode}: "
                        f"{Path(log.name).read_text()[-2000:]}")
                try:
                    if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.perf_counter() - t0 > 600:
                    raise RuntimeError("llama-server did not become healthy in 600 s")
                time.sleep(0.5)
            startup = time.perf_counter() - t0
            version = httpx.get(f"{base}/props", timeout=5).json().get("build_info", "?")

            async def one(client: Any, prompt: Sequence[int], n: int) -> list[int]:
                r = await client.post(f"{base}/completion", json={
                    "prompt": list(prompt), "n_predict": n, "temperature": 0.0, "top_k": 1,
                    "ignore_eos": True, "cache_prompt": True, "return_tokens": True,
                    "samplers": ["top_k"],
                }, timeout=timeout_s)
                r.raise_for_status()
                return [int(t) for t in r.json()["tokens"]]

            async def everything() -> tuple[float, list[list[int]]]:
                limits = httpx.Limits(max_connections=len(mix) + 1)
                async with httpx.AsyncClient(limits=limits) as client:
                    await one(client, list(mix[0][0])[:16], 4)  # warm-up
                    t = time.perf_counter()
                    out = await asyncio.gather(*(one(client, p, n) for p, n in mix))
                    return time.perf_counter() - t, list(out)

            wall, tokens = asyncio.run(everything())
            return MixResult(wall, startup, tokens, str(version))
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
