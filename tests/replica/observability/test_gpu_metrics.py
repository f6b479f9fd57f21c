"""The replica's memory gauges (KV pool bytes, GPU memory used and total), from fake stats sources:
no Ray cluster, no GPU."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from tierserve.records import EngineStats
from tierserve.replica.metrics import (
    EXPORTED,
    GAUGES,
    MEMORY_GAUGES,
    ReplicaMetrics,
    gauge_values,
    gpu_memory,
)

GiB = 2**30
STATS = EngineStats(running=2, waiting=1, free_blocks=10, total_blocks=16, block_size=16)


class FakeGauge:
    def __init__(self) -> None:
        self.values: list[float] = []
        self.set_once = threading.Event()

    def set(self, value: float) -> None:
        self.values.append(value)
        self.set_once.set()


def fake_metrics() -> ReplicaMetrics:
    """A ``ReplicaMetrics`` whose gauges record what they are set to (Ray's are not built)."""
    m = object.__new__(ReplicaMetrics)
    m.gauges = {name: FakeGauge() for name in GAUGES | MEMORY_GAUGES}  # type: ignore[misc]
    m._stop = threading.Event()
    m._thread = None
    return m


def test_the_memory_gauges_are_exported_under_rays_prefix() -> None:
    assert set(MEMORY_GAUGES) == {
        "tierserve_kv_pool_bytes", "tierserve_gpu_memory_used_bytes",
        "tierserve_gpu_memory_total_bytes"}
    assert {f"ray_{g}" for g in MEMORY_GAUGES} <= EXPORTED
    assert not set(MEMORY_GAUGES) & set(GAUGES)


def test_a_gpu_replicas_stats_set_the_memory_gauges() -> None:
    from dataclasses import replace

    stats = replace(STATS, kv_pool_bytes=5 * GiB, gpu_memory_used_bytes=60 * GiB,
                    gpu_memory_total_bytes=80 * GiB, rss_bytes=3 * GiB)
    metrics = fake_metrics()
    read = threading.Event()

    def source() -> EngineStats:  # the replica's stats, as LLMServer.stats gives them
        read.set()
        return stats

    metrics.start(source)
    try:
        gauges: dict[str, Any] = metrics.gauges
        assert gauges["tierserve_gpu_memory_total_bytes"].set_once.wait(timeout=30)
    finally:
        metrics.stop()
        assert metrics._thread is not None
        metrics._thread.join(timeout=30)
    assert read.is_set()
    last = {name: g.values[-1] for name, g in gauges.items() if g.values}
    assert last["tierserve_kv_pool_bytes"] == 5 * GiB
    assert last["tierserve_gpu_memory_used_bytes"] == 60 * GiB
    assert last["tierserve_gpu_memory_total_bytes"] == 80 * GiB
    assert last["tierserve_replica_resident_memory_bytes"] == 3 * GiB
    assert last["tierserve_kv_blocks_total"] == 16


def test_a_cpu_replica_exports_its_gpu_gauges_at_zero_and_its_pool_always() -> None:
    from dataclasses import replace

    values = gauge_values(replace(STATS, kv_pool_bytes=512 * 2**20))
    assert values["tierserve_gpu_memory_used_bytes"] == 0
    assert values["tierserve_gpu_memory_total_bytes"] == 0
    assert values["tierserve_kv_pool_bytes"] == 512 * 2**20
    # every gauge has a value but the resident memory, which waits until it is known
    assert set(values) == set(GAUGES | MEMORY_GAUGES) - {"tierserve_replica_resident_memory_bytes"}


def test_gpu_memory_reads_the_driver_for_cuda_devices_only() -> None:
    asked: list[torch.device] = []

    def info(device: torch.device) -> tuple[int, int]:
        asked.append(device)
        return 20 * GiB, 80 * GiB

    assert gpu_memory(torch.device("cuda", 1), info) == (60 * GiB, 80 * GiB)
    assert asked == [torch.device("cuda", 1)]
    assert gpu_memory(torch.device("cpu"), info) == (0, 0)
    assert asked == [torch.device("cuda", 1)]

    def broken(device: torch.device) -> tuple[int, int]:
        raise RuntimeError("CUDA driver not found")

    assert gpu_memory(torch.device("cuda"), broken) == (0, 0)


@dataclass
class FakePool:
    nbytes: int


@dataclass
class FakeRunner:
    device: torch.device
    pool: FakePool


@dataclass
class FakeEngine:
    runner: FakeRunner
    calls: list[str] = field(default_factory=list)

    def stats(self) -> EngineStats:
        self.calls.append("stats")
        return STATS

    def shutdown(self) -> None:  # LLMServer.__del__ stops its engine
        self.calls.append("shutdown")


@pytest.mark.parametrize("device", ["cpu", "cuda:0"])
def test_the_replicas_stats_carry_its_memory(monkeypatch: pytest.MonkeyPatch, device: str) -> None:
    pytest.importorskip("ray")
    from tierserve.replica import deployment

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (30 * GiB, 80 * GiB))
    server = object.__new__(deployment.LLMServer)
    server.engine = FakeEngine(FakeRunner(torch.device(device), FakePool(7 * GiB)))  # type: ignore[assignment]
    s = server.stats()
    assert s.kv_pool_bytes == 7 * GiB and s.total_blocks == STATS.total_blocks
    if device == "cpu":
        assert (s.gpu_memory_used_bytes, s.gpu_memory_total_bytes) == (0, 0)
    else:
        assert (s.gpu_memory_used_bytes, s.gpu_memory_total_bytes) == (50 * GiB, 80 * GiB)


def test_the_lora_gauges_carry_the_adapter_counts_without_names() -> None:
    from dataclasses import replace

    values = gauge_values(replace(STATS, lora_adapters_loaded=3, lora_adapters_running=2))
    assert values["tierserve_lora_adapters_loaded"] == 3
    assert values["tierserve_lora_adapters_running"] == 2
    assert gauge_values(STATS)["tierserve_lora_adapters_loaded"] == 0
    assert {"ray_tierserve_lora_adapters_loaded", "ray_tierserve_lora_adapters_running"} <= EXPORTED
