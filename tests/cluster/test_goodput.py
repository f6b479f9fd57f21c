"""Goodput at the ingress: each request counted once against its tier's targets (no Ray)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from tierserve.cluster.config import TierConfig
from tierserve.cluster.ingress import Ingress, _Route
from tierserve.cluster.tiers import Caller
from tierserve.records import RequestOutput, SamplingParams

TIER = TierConfig(name="interactive", base_priority=10, max_priority=15, ttft_target_s=3.0,
                  tpot_target_s=0.1)
BATCH = TierConfig(name="batch", base_priority=0, max_priority=4, ttft_target_s=60.0)


class Metrics:
    def __init__(self) -> None:
        self.calls: list[tuple[str, bool | None, bool | None]] = []

    def slo(self, tier: str, ttft: bool | None, tpot: bool | None, both: bool) -> None:
        self.calls.append((tier, ttft, tpot, both))


def route(tier: TierConfig, arrival: float, first: float | None, last: float | None,
          tokens: int) -> _Route:
    r = _Route(SamplingParams(), Caller(tier, tier.base_priority), 0)
    r.arrival, r.first, r.last, r.tokens = arrival, first, last, tokens
    return r


def count(r: _Route, failed: bool = False) -> list[Any]:
    fake = SimpleNamespace(metrics=Metrics())
    Ingress.func_or_class._count_slo(fake, r, failed)
    Ingress.func_or_class._count_slo(fake, r, failed)  # counted once
    return fake.metrics.calls


@pytest.mark.parametrize(("first", "last", "tokens", "want"), [
    (1.0, 2.0, 21, (True, True, True)),     # TTFT 1 s, TPOT 50 ms
    (4.0, 5.0, 21, (False, True, False)),   # TTFT 4 s
    (1.0, 5.0, 21, (True, False, False)),   # TPOT 200 ms
    (1.0, 1.0, 1, (True, None, True)),      # one token: no TPOT
])
def test_a_request_meets_or_misses_each_target(first: float, last: float, tokens: int,
                                               want: tuple[bool, bool | None, bool]) -> None:
    assert count(route(TIER, 0.0, first, last, tokens)) == [("interactive", *want)]


def test_a_shed_or_failed_request_misses_its_first_token_target() -> None:
    assert count(route(TIER, 0.0, None, None, 0), failed=True) == [
        ("interactive", False, None, False)]
    tpot_only = TierConfig(name="x", base_priority=0, max_priority=0, tpot_target_s=0.1)
    assert count(route(tpot_only, 0.0, None, None, 0), failed=True) == [("x", None, None, False)]
    untargeted = TierConfig(name="y", base_priority=0, max_priority=0)
    assert count(route(untargeted, 0.0, 1.0, 2.0, 5)) == []


def test_a_tier_without_a_tpot_target_is_counted_on_ttft_alone() -> None:
    assert count(route(BATCH, 0.0, 30.0, 90.0, 10)) == [("batch", True, None, True)]


def test_only_the_first_samples_tokens_time_the_request() -> None:
    r = route(TIER, 0.0, None, None, 0)
    fake = SimpleNamespace(gate=None)
    Ingress.func_or_class._timed(fake, r, RequestOutput(0, "a", [5], index=1))
    assert r.first is None
    Ingress.func_or_class._timed(fake, r, RequestOutput(0, "a", [5, 6], index=0))
    Ingress.func_or_class._timed(fake, r, RequestOutput(0, "", [], index=0))
    assert r.first is not None and r.tokens == 2
