"""The router's in-flight ledger: the requests it sent that have not completed, as charges.

A replica's report is a snapshot; the requests sent to it since are not in it. The ledger keeps
one ``Charge`` per such request (blocks at admission and at full length, and when it was sent),
and ``charges`` hands them to ``tierserve.router.routing.RouterState``, which ranks them with each
replica's report (``tierserve.router.policy.rank_replicas`` counts only those sent after the report was
taken).

A request's life in the ledger, as ``RouterState`` drives it from Serve's hooks:

1. ``charge_tentatively`` when it is ranked: a charge on the replica ranked first, at once, so
   that a burst routed in one round trip does not all land on one replica;
2. ``confirm`` when a replica took it: the charge moves to that replica (recomputed when it is
   not the one ranked first) and is dated then;
3. ``complete`` when the call is over (or the replica refused it): its charge goes.

``expire`` drops tentative charges never confirmed; ``forget_replicas`` those of replicas that
left. Pure and Ray-free (the offline router benchmark drives the same class in virtual time);
not thread-safe: the router holds its lock around every call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from tierserve.router.policy import Charge, Ranked

R = TypeVar("R", bound=Hashable)


@dataclass(slots=True)
class Tentative(Generic[R]):
    """A charge made while its request is being routed."""

    replica: R  # the replica ranked first
    request_id: Hashable  # the id the completion hook will name
    charge: Charge
    # The object whose ``id()`` keys the entry (Serve's PendingRequest), held so that the id
    # cannot be reused by another request while the entry lives.
    holder: object = None


@dataclass(slots=True)
class InFlightLedger(Generic[R]):
    """Charges per replica: confirmed ones by request id, oldest first, and tentative ones."""

    # replica -> request id -> charges (a list: Serve's ids are not unique per call)
    confirmed: dict[R, dict[Hashable, list[Charge]]] = field(default_factory=dict)
    # routing key -> the charge made while that request is being routed
    tentative: dict[Hashable, Tentative[R]] = field(default_factory=dict)

    def charges(self, replica: R, skip: Hashable | None = None) -> list[Charge]:
        """Every outstanding charge on ``replica``; ``skip``: a routing key left out (the request
        being ranked again must not count against itself)."""
        out = [c for lst in self.confirmed.get(replica, {}).values() for c in lst]
        out.extend(
            t.charge for k, t in self.tentative.items() if t.replica == replica and k != skip
        )
        return out

    def outstanding_blocks(self, replica: R) -> int:
        """Blocks charged to ``replica``, confirmed and tentative."""
        return sum(c.blocks for c in self.charges(replica))

    def charge_tentatively(
        self,
        key: Hashable,
        best: Ranked[R],
        request_id: Hashable,
        now: float,
        holder: object = None,
        lora: str | None = None,
    ) -> None:
        """Charge the request (routing ``key``, of LoRA adapter ``lora``: None for the base
        model) to the replica ranked first, as of ``now``."""
        self.tentative[key] = Tentative(
            best.key, request_id, Charge(best.need, now, best.full, best.own_prefill, lora),
            holder,
        )

    def drop_tentative(self, key: Hashable) -> None:
        self.tentative.pop(key, None)

    def confirm(
        self,
        key: Hashable,
        replica: R,
        request_id: Hashable,
        now: float,
        recharge: Callable[[], Charge],
        holder: object = None,
    ) -> Charge:
        """``replica`` took the request: its charge is confirmed there, dated ``now``.

        The tentative charge moves when it was made for this replica (and this ``holder``);
        otherwise the request went elsewhere (the first choice was full) and ``recharge()``
        gives its charge on ``replica`` (dated here).
        """
        t = self.tentative.pop(key, None)
        base = (t.charge if t is not None and t.holder is holder and t.replica == replica
                else recharge())
        charge = dataclasses.replace(base, routed_at=now)
        self.confirmed.setdefault(replica, {}).setdefault(request_id, []).append(charge)
        return charge

    def complete(self, replica: R, request_id: Hashable) -> None:
        """The call ``request_id`` on ``replica`` is over: its oldest charge goes. A call the
        replica refused was never confirmed: its tentative charge goes instead."""
        per_id = self.confirmed.get(replica)
        charges = per_id.get(request_id) if per_id else None
        if per_id is not None and charges:
            charges.pop(0)
            if not charges:
                del per_id[request_id]
            return
        for key, t in self.tentative.items():
            if t.replica == replica and t.request_id == request_id:
                del self.tentative[key]
                break

    def expire(self, now: float, ttl_s: float) -> None:
        """Drop tentative charges older than ``ttl_s`` (never confirmed: e.g. under Ray Client,
        where the confirmation hook does not fire)."""
        for key in [k for k, t in self.tentative.items() if now - t.charge.routed_at > ttl_s]:
            del self.tentative[key]

    def forget_replicas(self, keep: set[R]) -> None:
        """Drop the charges of every replica not in ``keep``."""
        for r in [r for r in self.confirmed if r not in keep]:
            del self.confirmed[r]
        for key in [k for k, t in self.tentative.items() if t.replica not in keep]:
            del self.tentative[key]
