"""The router's in-flight ledger on its own (no Serve): what FreeKVBlocksRouter and the offline
router benchmark both drive."""

from __future__ import annotations

import random

from tierserve.records import RoutingStats
from tierserve.router.ledger import InFlightLedger
from tierserve.router.policy import Charge, Ranked, ReplicaLoad, RequestShape, rank_replicas

T0 = 1000.0


def best(replica: str, need: int = 3, full: int = 5) -> Ranked[str]:
    return Ranked(replica, 100, need, 0, False, False, full=full)


def no_recharge() -> Charge:
    raise AssertionError("the tentative charge should have moved")


def test_a_request_from_ranking_to_completion() -> None:
    ledger: InFlightLedger[str] = InFlightLedger()
    ledger.charge_tentatively("k1", best("a"), "r1", T0)
    assert ledger.charges("a") == [Charge(3, T0, 5)] and ledger.charges("a", skip="k1") == []
    assert ledger.confirm("k1", "a", "r1", T0 + 1, no_recharge) == Charge(3, T0 + 1, 5)
    assert not ledger.tentative and ledger.outstanding_blocks("a") == 3
    ledger.complete("a", "r1")
    assert ledger.charges("a") == [] and ledger.confirmed == {"a": {}}


def test_a_request_taken_by_another_replica_is_charged_there() -> None:
    ledger: InFlightLedger[str] = InFlightLedger()
    ledger.charge_tentatively("k1", best("a"), "r1", T0)
    ledger.confirm("k1", "b", "r1", T0 + 1, lambda: Charge(7, 0.0, 9, 120))
    assert ledger.charges("a") == [] and ledger.charges("b") == [Charge(7, T0 + 1, 9, 120)]
    # ... and so is one whose routing key now names another request (another holder).
    ledger.charge_tentatively("k2", best("b"), "r2", T0, holder=object())
    ledger.confirm("k2", "b", "r2", T0 + 2, lambda: Charge(1, 0.0, 1), holder=object())
    assert ledger.charges("b")[-1] == Charge(1, T0 + 2, 1)


def test_calls_that_share_an_id_complete_one_at_a_time() -> None:
    ledger: InFlightLedger[str] = InFlightLedger()
    for k, need in (("k1", 1), ("k2", 2)):
        ledger.charge_tentatively(k, best("a", need), "shared", T0)
        ledger.confirm(k, "a", "shared", T0, no_recharge)
    ledger.complete("a", "shared")
    assert [c.blocks for c in ledger.charges("a")] == [2]  # the oldest went first


def test_a_refused_request_drops_its_tentative_charge() -> None:
    ledger: InFlightLedger[str] = InFlightLedger()
    ledger.charge_tentatively("k1", best("a"), "r1", T0)
    ledger.charge_tentatively("k2", best("a"), "r2", T0)
    ledger.complete("a", "r1")  # never confirmed
    assert set(ledger.tentative) == {"k2"}


def test_unconfirmed_charges_expire_and_replicas_are_forgotten() -> None:
    ledger: InFlightLedger[str] = InFlightLedger()
    ledger.charge_tentatively("old", best("a"), "r1", T0)
    ledger.charge_tentatively("new", best("b"), "r2", T0 + 4)
    ledger.expire(T0 + 5.5, ttl_s=5.0)
    assert set(ledger.tentative) == {"new"}
    ledger.confirm("new", "b", "r2", T0 + 6, no_recharge)
    ledger.charge_tentatively("k3", best("c"), "r3", T0 + 6)
    ledger.forget_replicas({"a"})
    assert not ledger.confirmed and not ledger.tentative


def test_loads_charge_what_the_reports_have_not_seen() -> None:
    # b reported more free blocks, but this router sent it 60 since: the policy picks a.
    ledger: InFlightLedger[str] = InFlightLedger()
    ledger.charge_tentatively("k1", best("b", 60, 60), "r1", T0 + 0.5)
    reports = [("a", RoutingStats(40, 100, 16, report_time=T0)),
               ("b", RoutingStats(90, 100, 16, report_time=T0))]
    loads = [ReplicaLoad(r, stats, ledger.charges(r)) for r, stats in reports]
    assert [len(x.charges) for x in loads] == [0, 1]
    ranked = rank_replicas(loads, RequestShape(31, latency=True), random.Random(0))
    assert [r.key for r in ranked] == ["a", "b"] and ranked[1].est_free == 30
