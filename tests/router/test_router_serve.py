"""FreeKVBlocksRouter in a real local Ray Serve app, with SimEngine replicas of different pools."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import ray
from ray import serve
from ray.serve.handle import DeploymentHandle

from benchmarks.router_sim import SimClient, SimEngine, SimOutput
from tests.router.helpers import outstanding_blocks
from tierserve.records import GenerateRequest, SamplingParams
from tierserve.router import registry

pytestmark = [pytest.mark.ray, pytest.mark.slow]

APP = "router-test"
POOLS = [256, 128, 32]  # blocks of replica rank 0, 1, 2 (16 tokens per block)
REPORT_S = 1.0  # request_routing_stats_period_s in SimEngine's config


@pytest.fixture(scope="module")
def client() -> Iterator[DeploymentHandle]:
    ray.init(num_cpus=4, include_dashboard=False, logging_level="warning", log_to_driver=False)
    try:
        engine = SimEngine.options(num_replicas=len(POOLS)).bind(pool_blocks=POOLS)
        handle = serve.run(SimClient.bind(engine), name=APP, route_prefix=None)
        time.sleep(2.5 * REPORT_S)  # every replica has reported
        yield handle
    finally:
        serve.shutdown()
        ray.shutdown()


def settle() -> None:
    """Let every replica report again after the previous load finished."""
    time.sleep(1.5 * REPORT_S)


def pools(results: list[dict[str, Any]]) -> Counter[int]:
    return Counter(r["total_blocks"] for r in results)


def test_requests_go_to_the_replica_with_the_most_free_blocks(client: DeploymentHandle) -> None:
    served = [client.run.remote(1, 64, 8).result(timeout_s=30)[0] for _ in range(6)]
    assert [r["tokens"] for r in served] == [8] * 6
    assert pools(served) == {256: 6}
    settle()


def test_replica_reporting_few_free_blocks_gets_fewer_requests(client: DeploymentHandle) -> None:
    # Waves of concurrent requests (13 blocks each); reports refresh between waves.
    seen: Counter[int] = Counter()
    for _ in range(3):
        seen += pools(client.run.remote(12, 200, 32).result(timeout_s=60))
        settle()
    assert sum(seen.values()) == 36
    # Batch-tier requests (priority 0) are spread by count where their whole length fits: the
    # 32-block pool holds two of them (15 blocks each) at a time, the others six and more.
    assert seen[32] < seen[128] <= seen[256], seen
    # Interactive-tier requests go where their prompt fits now with the least prefill queued
    # ahead: a burst spreads over the pools that hold it, the 32-block one takes fewest.
    seen = Counter()
    for _ in range(2):
        seen += pools(
            client.run.remote(12, 200, 32, priority=10, latency=True).result(timeout_s=60)
        )
        settle()
    assert seen[32] < min(seen[128], seen[256]), seen


def test_burst_faster_than_reports_spreads_across_replicas(client: DeploymentHandle) -> None:
    # 24 requests of 16 blocks in well under a report period. On reports alone all would go to
    # the 256-block replica; charging in-flight requests leaves it with ~15, the 128 one ~8.
    seen = pools(client.run.remote(24, 250, 64).result(timeout_s=60))
    assert sum(seen.values()) == 24
    assert seen[256] <= 18, seen
    assert seen[128] >= 5, seen
    assert seen[32] <= seen[128], seen
    settle()


def test_streaming_call_from_a_handle_charges_until_its_stream_ends(
    client: DeploymentHandle,
) -> None:
    engine = serve.get_deployment_handle("SimEngine", app_name=APP).options(stream=True)
    sent = GenerateRequest((7,) * 40, SamplingParams(max_tokens=200), priority=3)
    stream = engine.generate.remote(sent)
    first = next(iter(stream))
    assert isinstance(first, SimOutput) and first.total_blocks == 256
    (router,) = registry.routers(APP, "SimEngine")  # this process's router for the handle
    assert sorted(outstanding_blocks(router).values()) == [0, 0, 3]  # ceil(41 / 16) blocks
    assert len([first, *stream]) == 200
    deadline = time.time() + 5
    while any(outstanding_blocks(router).values()) and time.time() < deadline:
        time.sleep(0.05)
    assert not any(outstanding_blocks(router).values())
