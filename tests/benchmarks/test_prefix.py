"""The routing part of ``benchmarks.prefix`` in small (virtual time, deterministic for its seeds): on a
shared-system-prompt mix the prefix-aware router finds most of what the oracle finds, clearly more
than the router without prefix affinity, and the requests and cached counts add up."""

from __future__ import annotations

import itertools
import random

import pytest

from benchmarks.prefix import (
    ROUTING_ENGINE,
    RoutingSpec,
    routing_policies,
    routing_requests,
    routing_summary,
)
from benchmarks.router import simulate


def test_prefix_tier_routing_finds_most_of_what_the_oracle_finds() -> None:
    replicas = 4
    spec = RoutingSpec(duration_s=6.0, rate_per_replica=8.0)
    reqs = routing_requests(replicas, seed=7, spec=spec)
    assert all(q.ids is not None and len(q.prefix) == q.prompt // 16 for q in reqs)
    results = [
        simulate(reqs, replicas, ROUTING_ENGINE, make(replicas, random.Random(0)), name, 0)
        for name, make in routing_policies().items()
    ]
    for r in results:
        assert len(r.cached) == len(reqs)
        assert all(0 <= c < q.prompt for c, q in zip(r.cached, reqs, strict=True))
    summary = routing_summary(results, [reqs])
    assert all(row["served"] == len(reqs) for row in summary.values())
    ours, plain, oracle = (summary[k]["hit_rate"] for k in ("prefix-tier", "free-blocks",
                                                              "oracle"))
    assert oracle > 0.5
    assert ours >= 0.85 * oracle
    assert ours > plain + 0.1


def test_poisson_arrivals_start_at_zero_rise_and_keep_their_rate() -> None:
    from benchmarks.prefix import poisson_arrivals

    due = poisson_arrivals(2000, rate=4.0, seed=3)
    assert due[0] == 0.0 and all(b >= a for a, b in itertools.pairwise(due))
    assert 0.9 * 2000 / 4.0 < due[-1] < 1.1 * 2000 / 4.0  # mean gap 1/rate
    assert poisson_arrivals(2000, rate=4.0, seed=3) == due  # fixed by the seed


def test_a_rate_that_is_not_positive_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks.prefix import main

    with pytest.raises(SystemExit) as exc:
        main(["--part", "arrivals", "--arrival-rate", "0"])
    assert exc.value.code == 2 and "--arrival-rate must be positive, got 0.0" in (
        capsys.readouterr().err)


def test_users_below_one_are_refused_for_either_engine_part(
        capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks.prefix import main

    for part in ("engine", "arrivals"):
        with pytest.raises(SystemExit) as exc:
            main(["--part", part, "--users", "0"])
        assert exc.value.code == 2 and "--users must be at least 1, got 0" in (
            capsys.readouterr().err)
