"""What a caller asks the scheduler for (``Request``), the scheduler's record of it (``Seq``)
and where the request is (``Status``).

A request is ``WAITING`` from ``add`` until its admission, ``RUNNING`` while it holds blocks
(prefilling or decoding, docs/scheduler.md §1), ``PREEMPTED`` once a preemption (§5) has sent it
back to the waiting queue (until it is admitted again), and ``FINISHED`` once it stopped, reached
its length or was aborted (the scheduler then forgets it).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tierserve.records import RequestId
from tierserve.replica.prefix_cache import adapter_partition

if TYPE_CHECKING:
    from tierserve.replica.lazy_heap import Handle


@dataclass(slots=True)
class Request:
    """What a caller asks for: prompt token ids, how many tokens to generate, a priority."""

    prompt: Sequence[int]
    max_tokens: int
    priority: int = 0
    # False: compute every prompt position, never starting after a cached prefix (a request
    # that scores its prompt needs the logits of every position).
    reuse_cache: bool = True
    # The time per output token its tier promises (docs/scheduler.md §8); None: no target.
    tpot_target_s: float | None = None
    # Seconds left, as it reaches the scheduler, until its tier's first-token target (that
    # target less what it already waited upstream; below 0: late already); None: no target.
    ttft_left_s: float | None = None
    # The prefix-cache partition its blocks are shared in (``BlockSpace.allocate``); None: the
    # shared one.
    cache_partition: str | None = None
    # The LoRA adapter it runs under (its key, ``LoRARequest.key``: name and id; None: the base
    # model): a step holds the rows of at most ``max_loras`` adapters, and its prefix-cache
    # blocks are that adapter identity's own (a name reloaded with a new id shares none).
    lora: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise TypeError(f"max_tokens must be an int, got {type(self.max_tokens).__name__}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise ValueError(f"priority must be an integer, got {self.priority!r}")
        t = self.tpot_target_s
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float))
                              or not 0.0 < t < float("inf")):
            raise ValueError(f"tpot_target_s must be a positive number of seconds, got {t!r}")
        left = self.ttft_left_s
        if left is not None and (isinstance(left, bool) or not isinstance(left, (int, float))
                                 or not math.isfinite(left)):
            raise ValueError(f"ttft_left_s must be a finite number of seconds, got {left!r}")



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
        "lora",
        "lora_blocked_at",
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
        self.lora = req.lora
        self.partition = adapter_partition(req.cache_partition, req.lora)
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
        # The step in which admission first found it waiting without a slot for its adapter
        # (None: not so since its last admission): how long requests may pass it.
        self.lora_blocked_at: int | None = None


def rank_of(seq: Seq) -> tuple[int, int]:
    """``seq``'s rank (docs/scheduler.md §4): ascending, the smallest runs first."""
    return seq.rank
