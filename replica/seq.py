"""The scheduler's record of one request (``Seq``) and where the request is (``Status``).

A request is ``WAITING`` from ``add`` until its admission, ``RUNNING`` while it holds blocks
(prefilling or decoding, docs/scheduler.md §1), ``PREEMPTED`` once a preemption (§5) has sent it
back to the waiting queue (until it is admitted again), and ``FINISHED`` once it stopped, reached
its length or was aborted (the scheduler then forgets it).
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

from tierserve.records import RequestId

if TYPE_CHECKING:
    from tierserve.replica.lazy_heap import Handle
    from tierserve.replica.scheduler import Request


class Status(enum.Enum):
    WAITING = "waiting"  # in the waiting queue, never admitted
    RUNNING = "running"  # admitted: holds blocks, prefilling or decoding
    PREEMPTED = "preempted"  # back in the waiting queue after a preemption, holding nothing
    FINISHED = "finished"  # stopped, at its length, or aborted

    @property
    def queued(self) -> bool:
        """In the waiting queue (waiting or preempted)."""
        return self is Status.WAITING or self is Status.PREEMPTED


# A member read off its Enum class costs a lookup of about 70 ns (Python 3.11): what runs per
# request reads these names.
WAITING, RUNNING = Status.WAITING, Status.RUNNING
PREEMPTED, FINISHED = Status.PREEMPTED, Status.FINISHED


class Seq:
    """Scheduler-side state of one request."""

    __slots__ = (
        "cached",
        "computed",
        "deadline",
        "first_at",
        "handle",
        "id",
        "max_tokens",
        "partition",
        "priority",
        "prompt_len",
        "rank",
        "reuse",
        "status",
        "target",
        "tokens",
    )

    def __init__(self, id: RequestId, req: Request, rank: tuple[int, int]) -> None:
        self.id = id
        self.tokens: list[int] = list(req.prompt)
        self.prompt_len = len(self.tokens)
        self.max_tokens = req.max_tokens
        self.priority = req.priority
        self.reuse = req.reuse_cache
        self.partition = req.cache_partition
        self.target = req.tpot_target_s
        self.rank = rank  # ascending = better; fixed at arrival, kept across preemption
        self.status = WAITING
        self.computed = 0  # positions whose K/V are in the cache
        self.cached: int | None = None  # prompt positions found cached at first admission
        # Its entry in the waiting queue while queued (removed in O(1) on admission or abort).
        self.handle: Handle[Seq] | None = None
        # When its first token was sampled (the scheduler's clock; §8's budget): kept across
        # preemption, as the client's clock runs on.
        self.first_at: float | None = None
        # When its first token is due (the scheduler's clock; set by ``add``); None: no target.
        self.deadline: float | None = None


def rank_of(seq: Seq) -> tuple[int, int]:
    """``seq``'s rank (docs/scheduler.md §4): ascending, the smallest runs first."""
    return seq.rank
