"""A burst on the default cluster's very first start, as a new user sends it: ``tierserve serve
configs/cluster.yaml`` with an empty ``TIERSERVE_CACHE_DIR`` (the replicas dequantize the weights
and build their native kernels), and as soon as ``GET /health`` answers, 64 requests at once
through the ``openai`` SDK (completions and chat, streamed and not). None may be refused, not
even on a first try that the SDK would retry: a burst is not an overload. Then ``GET /ready``
says ready. (``benchmarks.burst`` runs the same round and reports it.)

This module starts its own cluster on the default ports; it runs after ``tests/cluster`` and
before ``test_quickstart`` has started its own (pytest runs this package's modules in order).
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from benchmarks.burst import run_round

pytestmark = [pytest.mark.ray, pytest.mark.model, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def test_a_burst_at_the_first_start_is_answered_in_full(tmp_path: Path) -> None:
    r = run_round(ROOT, "configs/cluster.yaml", "cold", "health", 64, 7, tmp_path / "serve.log")
    assert r.answered == 64, (r.refused, r.failed)
    assert r.attempts == 64 and r.retry_after == [], f"{len(r.retry_after)} first tries refused"
    with pytest.raises(httpx.HTTPError):  # and the cluster is stopped again
        httpx.get("http://127.0.0.1:8000/health", timeout=2)
