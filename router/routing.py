"""One router's state and its steps, Ray-free: the ledger of requests in flight, the prefix index,
the replicas' last reports, and the ranking that uses them.

``FreeKVBlocksRouter`` (the Serve adapter) drives a ``RouterState`` from Serve's hooks under its
lock; the offline router benchmarks drive the very same class in virtual time, so what they
measure is the router that runs. A request's life:

1. ``route``: ranked (``tierserve.router.policy.rank_replicas``, with the prefix hits each replica would
   probably give it), charged tentatively to the replica ranked first, and its prompt's block
   names recorded there (a burst of one system prompt then follows the first request);
2. ``routed``: a replica took it; the charge moves there (recomputed when it is not the one
   ranked first, whose names are then recorded too);
3. ``completed``: the call is over; its charge goes.

Not thread-safe: the caller holds a lock around every call.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any, Generic, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tierserve.records import DEFAULT_BLOCK_SIZE, RoutingStats
from tierserve.replica.config import describe
from tierserve.router.ledger import InFlightLedger
from tierserve.router.policy import (
    Affinity,
    Charge,
    Ranked,
    ReplicaLoad,
    RequestShape,
    charge_blocks,
    full_blocks,
    rank_replicas,
)
from tierserve.router.prefix_index import PrefixIndex

R = TypeVar("R", bound=Hashable)


_AFFINITY = Affinity()  # the defaults of its fields below


class RouterSettings(BaseModel):
    """``request_router_kwargs`` of the deployment's ``request_router_config``, each field
    described where it is declared; ``tierserve serve`` checks them before anything starts."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    saturation_waiting: int = Field(
        default=8, ge=0, description="a replica out of blocks for a request is saturated from "
        "this (estimated) queue length on")
    default_block_size: int = Field(
        default=DEFAULT_BLOCK_SIZE, gt=0,
        description="the block size assumed before any replica has reported")
    tentative_ttl_s: float = Field(
        default=5.0, gt=0.0, description="a tentative charge that Serve never confirms (the "
        "request was not routed after all) is forgotten after this long")
    seed: int | None = Field(
        default=None, description="the seed of the random tie-break; `null`: from the OS")
    prefix_affinity: bool = Field(
        default=True, description="rank by prefix hits too "
        "([prefix_caching.md](docs/prefix_caching.md)); false ranks by KV room and load alone")
    prefix_index_blocks: int = Field(
        default=4096, gt=0, description="block names remembered per replica before its first "
        "report (then its pool size)")
    balance_abs: int = Field(
        default=_AFFINITY.balance_abs, ge=0, description="the load imbalance (requests in "
        "flight, most less fewest) past which prefix hits only break ties, together with "
        "`balance_rel`")
    balance_rel: float = Field(
        default=_AFFINITY.balance_rel, ge=1.0, description="the load ratio (most over fewest "
        "in flight) past which prefix hits only break ties, together with `balance_abs`")
    min_hit_fraction: float = Field(
        default=_AFFINITY.min_hit_fraction, ge=0.0, le=1.0, description="the lower tiers "
        "follow their prefix only where this share of the prompt is cached")
    adapter_load_tokens: int = Field(
        default=_AFFINITY.adapter_load_tokens, ge=0, description="what loading a request's "
        "LoRA adapter costs a replica that does not hold it, in prefill tokens: the top tier "
        "weighs it against the queues, the lower tiers prefer a replica holding the adapter "
        "between equally loaded ones; 0: no adapter affinity")

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any]) -> RouterSettings:
        """The settings of ``kwargs``; raises ``ValueError`` naming each field at fault."""
        unknown = sorted(set(kwargs) - set(cls.model_fields))
        if unknown:
            raise ValueError(f"unknown request_router_kwargs {unknown} for FreeKVBlocksRouter; "
                             f"known: {sorted(cls.model_fields)}")
        try:
            return cls.model_validate(kwargs)
        except ValidationError as e:
            raise ValueError("invalid request_router_kwargs for FreeKVBlocksRouter: "
                             + describe(e)) from None

    def affinity(self) -> Affinity:
        return Affinity(self.balance_abs, self.balance_rel, self.min_hit_fraction,
                        adapter_load_tokens=self.adapter_load_tokens)


class RouterState(Generic[R]):
    """See the module docstring. ``R``: how replicas are named (Serve's ``ReplicaID``, an index)."""

    def __init__(self, settings: RouterSettings | None = None) -> None:
        self.configure(settings or RouterSettings())
        self.ledger: InFlightLedger[R] = InFlightLedger()

    def configure(self, settings: RouterSettings) -> None:
        self.settings = settings
        self._affinity = settings.affinity()
        self.rng = random.Random(settings.seed)
        self.index: PrefixIndex[R] = PrefixIndex(settings.prefix_index_blocks)

    # ------------------------------------------------------------------ ranking

    def prefix_hits(self, replica: R, stats: RoutingStats | None, request: RequestShape) -> int:
        """Leading blocks of ``request`` this router sent ``replica`` (0 with affinity off)."""
        if not self.settings.prefix_affinity or not request.prefix:
            return 0
        if stats is not None:
            self.index.set_capacity(replica, stats.total_blocks)
        block_size = stats.block_size if stats else self.settings.default_block_size
        return self.index.match(replica, request.prefix, request.usable_prefix(block_size))

    def rank(
        self,
        reports: Iterable[tuple[R, RoutingStats | None]],
        request: RequestShape,
        skip: Hashable | None = None,
    ) -> list[Ranked[R]]:
        """Every replica of ``reports`` ranked for ``request``, best first (``skip``: the routing
        key of the request itself, whose tentative charge must not count against it)."""
        s = self.settings
        loads = [
            ReplicaLoad(r, stats, self.ledger.charges(r, skip), self.prefix_hits(r, stats, request))
            for r, stats in reports
        ]
        return rank_replicas(
            loads,
            request,
            self.rng,
            saturation_waiting=s.saturation_waiting,
            default_block_size=s.default_block_size,
            affinity=self._affinity,
        )

    # ------------------------------------------------------------------ a request's life

    def route(
        self,
        key: Hashable,
        reports: Sequence[tuple[R, RoutingStats | None]],
        request: RequestShape,
        request_id: Hashable,
        now: float,
        holder: object = None,
    ) -> list[Ranked[R]]:
        """Rank ``request`` (routing ``key``) and charge it tentatively to the first replica."""
        self.ledger.expire(now, self.settings.tentative_ttl_s)
        ranked = self.rank(reports, request, skip=key)
        if ranked:
            self.ledger.charge_tentatively(key, ranked[0], request_id, now, holder, request.lora)
            self._record(ranked[0].key, request)
        return ranked

    def routed(
        self,
        key: Hashable,
        replica: R,
        request_id: Hashable,
        now: float,
        stats: RoutingStats | None,
        request: Callable[[], RequestShape],
        holder: object = None,
    ) -> None:
        """``replica`` took the request: confirm its charge there. ``request()`` gives its shape
        when the charge has to be recomputed (it went elsewhere than ranked first)."""
        moved: list[RequestShape] = []

        def recharge() -> Charge:
            shape = request()
            moved.append(shape)
            bt = stats.block_size if stats else self.settings.default_block_size
            return Charge(charge_blocks(shape.prompt_tokens, bt), now,
                          full_blocks(shape.prompt_tokens, shape.max_tokens, bt),
                          shape.prompt_tokens if shape.latency else 0, shape.lora)

        self.ledger.confirm(key, replica, request_id, now, recharge, holder=holder)
        for shape in moved:
            self._record(replica, shape)

    def completed(self, replica: R, request_id: Hashable) -> None:
        self.ledger.complete(replica, request_id)

    def drop(self, key: Hashable) -> None:
        """Forget the tentative charge of a request that went to no known replica."""
        self.ledger.drop_tentative(key)

    def forget_replicas(self, keep: set[R]) -> None:
        self.ledger.forget_replicas(keep)
        self.index.forget(keep)

    def _record(self, replica: R, request: RequestShape) -> None:
        if self.settings.prefix_affinity and request.prefix:
            self.index.record(replica, request.prefix)
