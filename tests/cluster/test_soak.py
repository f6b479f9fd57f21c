"""A one-minute soak (``benchmarks/soak.py``) on an app of two replicas with small KV pools.

Mixed load with long prompts (preemptions), clients that hang up mid-stream and at random moments
(queued, in prefill, streaming), streaming and non-streaming requests. Afterwards: every request
got an answer or a clear error, both replicas are idle with every block free, their memory did
not grow after the warm-up, and the pools did preempt (so the run exercised recompute).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from benchmarks.soak import ReplicaState, SoakConfig, print_report, soak
from tests.cluster.helpers import KEYS, MODEL, LocalServe, ServeApp, app_config
from tierserve.cluster.load import TrafficClass

pytestmark = [pytest.mark.ray, pytest.mark.slow]

# 48 blocks of 16 (768 tokens): a long prompt (500-600 tokens) and its output (up to 160)
# take most of a pool, and a few short requests that grow fill it.
ENGINE: dict[str, Any] = {"num_kv_blocks": 48, "kv_cache_memory_bytes": None, "max_num_seqs": 16,
                          "max_waiting": 64}


@pytest.fixture(scope="module")
def soak_app(local_serve: LocalServe) -> Iterator[ServeApp]:
    with local_serve.app("soak", app_config("soak", "/soak", ENGINE, {"max_tokens_limit": 256},
                                             {"LLMServer": {"num_replicas": 2}})) as app:
        yield app


def test_a_minute_of_mixed_load_loses_and_leaks_nothing(soak_app: ServeApp) -> None:
    async def probe() -> ReplicaState:
        stats = await asyncio.to_thread(soak_app.replica_stats)
        return {name: {k: float(s[k]) for k in ("waiting", "running", "free_blocks",
                                                  "total_blocks", "rss_bytes")}
                for name, s in stats.items()}

    before = sum(s["preemptions"] for s in soak_app.replica_stats().values())
    classes = [TrafficClass(tier, 1.0, key) for tier, key in KEYS.items()]
    cfg = SoakConfig(duration_s=60, rate=3.0, long_prompt=(500, 600), long_fraction=0.3,
                     output=(8, 160), settle_timeout_s=120)
    report = asyncio.run(soak(soak_app.base_url, MODEL, classes, cfg, probe))
    print_report(report)
    preempted = sum(s["preemptions"] for s in soak_app.replica_stats().values()) - before
    print(f"preemptions during the soak: {preempted}")
    assert report.passed, report.failures
    assert report.requests >= 45, report.requests
    assert report.results.get("ok", 0) >= report.requests // 3, report.results
    assert report.by_kind["mid_stream"].get("hung_up", 0) > 0, report.by_kind
    assert report.by_kind["early"].get("hung_up", 0) > 0, report.by_kind
    assert len(report.rss_mib) == 2, report.rss_mib
    assert preempted > 0, "the soak never preempted: the pools are too large for its load"
