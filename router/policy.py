"""The ranking: which replica has the most free KV blocks for this request. Pure and Ray-free.

A replica's report (``RoutingStats``) is a snapshot taken at ``report_time``. Requests this router
sent it after that moment are not in the snapshot, so they are subtracted; requests sent before
it are already counted by the replica (running ones in ``free_blocks``, waiting ones in
``waiting_blocks``) and are not subtracted twice.

A replica that has not reported yet is assumed to be as large as the largest reported pool
(replicas of one deployment share a pool size; a new replica's pool is empty), minus everything
this router has sent it. Before any replica has reported this falls back to "fewest blocks
outstanding from this router".
"""

from __future__ import annotations

import random
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from router.stats import RoutingStats

K = TypeVar("K", bound=Hashable)

# The keyword arguments of the replica's ``generate`` call that the router reads.
PRIORITY = "priority"
PROMPT_TOKENS = "prompt_tokens"
MAX_TOKENS = "max_tokens"


def blocks_for(tokens: int, block_tokens: int) -> int:
    """Blocks that hold ``tokens`` positions."""
    return -(-max(tokens, 0) // block_tokens)


def charge_blocks(prompt_tokens: int, block_tokens: int) -> int:
    """Blocks a request is charged when routed: its prompt and its first generated token."""
    return blocks_for(prompt_tokens + 1, block_tokens)


def _int_or(value: Any, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


@dataclass(frozen=True, slots=True)
class RequestShape:
    """What the router knows about one request, from the handle call's arguments."""

    prompt_tokens: int
    max_tokens: int = 0
    priority: int = 0

    @classmethod
    def from_call(cls, args: Sequence[Any], kwargs: Mapping[Any, Any]) -> RequestShape:
        """Read ``priority``, ``prompt_tokens`` and ``max_tokens`` from the kwargs.

        Missing or ill-typed values never fail routing (the replica validates its input):
        ``prompt_tokens`` falls back to ``len(args[0])`` (the prompt ids), the others to 0.
        """
        prompt = _int_or(kwargs.get(PROMPT_TOKENS), -1)
        if prompt < 0:
            first = args[0] if args else None
            prompt = len(first) if isinstance(first, Sequence) else 0
        return cls(
            prompt_tokens=prompt,
            max_tokens=max(_int_or(kwargs.get(MAX_TOKENS), 0), 0),
            priority=_int_or(kwargs.get(PRIORITY), 0),
        )


@dataclass(frozen=True, slots=True)
class Charge:
    """A request this router sent to a replica that has not completed yet."""

    blocks: int
    routed_at: float  # time.time() on the router when it was sent


@dataclass(frozen=True, slots=True)
class ReplicaLoad(Generic[K]):
    """One replica as this router sees it: its last report and its outstanding charges."""

    key: K
    stats: RoutingStats | None
    charges: Sequence[Charge] = ()


@dataclass(frozen=True, slots=True)
class Ranked(Generic[K]):
    """A replica's place in the ranking for one request."""

    key: K
    est_free: int  # estimated free blocks before this request (may be negative: a backlog)
    need: int  # blocks this request would be charged there
    est_waiting: int  # reported waiting plus requests sent since the report
    saturated: bool  # cannot hold the request now and has a long queue
    never_fits: bool  # its pool is too small for prompt + max_tokens


def charged_since_report(stats: RoutingStats | None, charges: Sequence[Charge]) -> list[Charge]:
    """The charges the report does not reflect: all of them without a report."""
    if stats is None:
        return list(charges)
    return [c for c in charges if c.routed_at >= stats.report_time]


def estimate_free(stats: RoutingStats | None, charges: Sequence[Charge], assumed_total: int) -> int:
    """Reported free blocks, less the waiting queue's needs, less what was sent since."""
    unseen = sum(c.blocks for c in charged_since_report(stats, charges))
    if stats is None:
        return assumed_total - unseen
    return stats.free_blocks - stats.waiting_blocks - unseen


def rank_replicas(
    loads: Sequence[ReplicaLoad[K]],
    request: RequestShape,
    rng: random.Random,
    *,
    saturation_waiting: int = 8,
    default_block_tokens: int = 16,
) -> list[Ranked[K]]:
    """Best replica first.

    Order: replicas that fit and are not saturated, then saturated ones, then those whose pool
    can never hold ``prompt + max_tokens``; within each, most estimated free blocks first; ties
    at random (``rng``). Saturated: the estimated free blocks cannot hold the request and the
    estimated queue is at least ``saturation_waiting``. A replica without a report is never
    saturated and never too small (nothing is known against it).
    """
    reported = [load.stats for load in loads if load.stats is not None]
    assumed_total = max((s.total_blocks for s in reported), default=0)
    fallback_block_tokens = reported[0].block_tokens if reported else default_block_tokens

    ranked: list[tuple[tuple[bool, bool, int, float], Ranked[K]]] = []
    for load in loads:
        stats = load.stats
        block_tokens = stats.block_tokens if stats is not None else fallback_block_tokens
        need = charge_blocks(request.prompt_tokens, block_tokens)
        est_free = estimate_free(stats, load.charges, assumed_total)
        unseen = len(charged_since_report(stats, load.charges))
        est_waiting = (stats.waiting if stats is not None else 0) + unseen
        saturated = stats is not None and est_free < need and est_waiting >= saturation_waiting
        longest = request.prompt_tokens + request.max_tokens
        never_fits = stats is not None and blocks_for(longest, block_tokens) > stats.total_blocks
        entry = Ranked(load.key, est_free, need, est_waiting, saturated, never_fits)
        ranked.append(((never_fits, saturated, -est_free, rng.random()), entry))
    ranked.sort(key=lambda pair: pair[0])
    return [entry for _, entry in ranked]


def all_saturated(ranked: Sequence[Ranked[Any]]) -> bool:
    """True when every replica that could ever hold the request is saturated.

    False when no replica could ever hold it: the replica's own check should refuse it at once.
    """
    fitting = [r for r in ranked if not r.never_fits]
    return bool(fitting) and all(r.saturated for r in fitting)
