"""One step's SLO limit, which the phases of ``Scheduler.schedule`` consult (docs/scheduler.md §8).

``schedule()`` makes one ``StepLimit`` a step: ``NO_LIMIT`` (a ``NoLimit``) where no limit exists
(``slo_scheduling`` off, or no unfinished request with a TPOT target), whose every answer is §2's;
else a ``SloLimit`` for the limit L of the strictest target present, whose requests are
*protected*. A ``SloLimit`` owns the step's SLO state, which lives no longer than the step (the
items are §8's):

- the **reserve** (item 0): the part of the step kept for protected prompts, and ``kept``, what
  of it protected chunks have not taken yet (the lower tiers' work is timed as if it were taken);
- the **burst** L′ (item 5): what protected chunks are timed against, worked out when the first
  one is timed;
- the **floor** (item 2): a block's worth past L for a protected prompt that fits nothing, while
  no protected prompt has a chunk in the step;
- the **left-out** requests (item 1): running requests kept out of the step with their blocks
  (the first victims of a preemption, and item 4's candidates to run anyway);
- whether a protected request has **passed** the queue's head (item 3, once a step).

Its hooks, one contract each (with the phase of §2, or item 4, that asks):

- ``leaves_out(seq, shape, n)`` (1): whether ``seq``'s decode is left out of the step.
- ``block_victim(seq, bottom)`` (1, 4): whom to preempt for a block ``seq`` needs (``bottom``: §2's).
- ``prefill_chunk(seq, take, shape)`` (2): how many of the policy's ``take`` positions run now.
- ``admissible(head, shape, fed, preempted)`` (3): the request to admit next; None: admission stops.
- ``seat_victim(head)`` (3): whom ``head`` may preempt for a seat or blocks; None: nobody.
- ``admit_chunk(head, start, take, shape, fed)`` (3): how many of its first ``take`` positions run.
- ``stalled()`` (4): with nothing planned, the left-out decode that runs anyway; None: none.
- ``close(fed)``: the step is planned; what the stats report of it (``StepReport``).

``shape`` is the plan's work so far (``StepShape``), ``fed`` its (request, positions) entries so
far. Pure Python, no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import NamedTuple, Protocol, runtime_checkable

from tierserve.records import RequestId
from tierserve.replica.lazy_heap import LazyHeap
from tierserve.replica.prefill_policy import PrefillPolicy
from tierserve.replica.seq import RUNNING, Seq, rank_of
from tierserve.replica.step_cost import (
    StepCostModel,
    StepShape,
    chunk_attention,
    decode_attention,
)

Fed = Sequence[tuple[Seq, int]]


class StepReport(NamedTuple):
    """What the stats report of a step: its limit (None: none), the strictest target, the
    running requests it left out, and its plan as one decode each (None without a limit)."""

    limit_s: float | None = None
    strict: float | None = None
    paused: int = 0
    decoding: StepShape | None = None


UNLIMITED = StepReport()


@runtime_checkable
class StepLimit(Protocol):
    """One step's SLO limit, as the phases of ``schedule()`` consult it."""

    def leaves_out(self, seq: Seq, shape: StepShape, n: int) -> bool:
        """Whether the decode of ``seq`` (context ``n``) is left out of this step (it keeps its
        blocks)."""
        ...

    def block_victim(self, seq: Seq, bottom: Seq) -> Seq:
        """Whom to preempt when ``seq`` needs a block and the pool has none (``seq`` itself: it
        waits); ``bottom`` is §2's victim, the lowest-ranked running request."""
        ...

    def prefill_chunk(self, seq: Seq, take: int, shape: StepShape) -> int:
        """How many of the ``take`` positions the prefill policy grants ``seq``, a prefill in
        progress, run this step (0: left out)."""
        ...

    def admissible(self, head: Seq, shape: StepShape, fed: Fed,
                   preempted: Collection[RequestId]) -> Seq | None:
        """The request to admit next: ``head``, or one that passes a head the limit refuses;
        None: admission stops (none of ``preempted`` passes)."""
        ...

    def seat_victim(self, head: Seq) -> Seq | None:
        """Whom ``head``, without a seat or blocks, may preempt (None: nobody; it waits)."""
        ...

    def admit_chunk(self, head: Seq, start: int, take: int, shape: StepShape, fed: Fed) -> int:
        """How many of the ``take`` positions after ``start`` the prefill policy grants
        ``head``, admitted now, run this step (0: it waits)."""
        ...

    def stalled(self) -> Seq | None:
        """With nothing planned, the left-out decode that runs anyway (None: none)."""
        ...

    def close(self, fed: Fed) -> StepReport:
        """The step is planned (``fed``): what the stats report of it."""
        ...


class NoLimit:
    """No limit: every answer is §2's (nobody is left out, passed or preempted for a seat)."""

    __slots__ = ()

    def leaves_out(self, seq: Seq, shape: StepShape, n: int) -> bool:
        return False

    def block_victim(self, seq: Seq, bottom: Seq) -> Seq:
        return bottom  # §2: the lowest-ranked running request, seq itself when none ranks lower

    def prefill_chunk(self, seq: Seq, take: int, shape: StepShape) -> int:
        return take

    def admissible(self, head: Seq, shape: StepShape, fed: Fed,
                   preempted: Collection[RequestId]) -> Seq | None:
        return head

    def seat_victim(self, head: Seq) -> Seq | None:
        return None

    def admit_chunk(self, head: Seq, start: int, take: int, shape: StepShape, fed: Fed) -> int:
        return take

    def stalled(self) -> Seq | None:
        return None

    def close(self, fed: Fed) -> StepReport:
        return UNLIMITED

    def __repr__(self) -> str:
        return "NoLimit()"


NO_LIMIT = NoLimit()


class SloLimit:
    """The limit L = ``limit`` of the strictest TPOT target present, ``strict``, for one step.

    ``running`` and ``waiting`` are the scheduler's own (running in rank order, best first);
    ``burst_of(limit, strict)`` works out L′ (item 5). ``beta``: the step's token budget (§1).
    """

    __slots__ = ("_block_size", "_burst", "_burst_of", "_cost", "_floor", "_left_out",
                 "_passed", "_running", "_waiting", "kept", "limit_s", "reserve", "strict")

    def __init__(self, limit: float, strict: float, cost: StepCostModel, running: list[Seq],
                 waiting: LazyHeap[Seq], policy: PrefillPolicy, beta: int, block_size: int,
                 burst_of: Callable[[float, float], float]) -> None:
        self.limit_s = limit
        self.strict = strict
        self._cost = cost
        self._running = running
        self._waiting = waiting
        self._block_size = block_size
        self._burst_of = burst_of
        self._burst: float | None = None  # L′, once a protected chunk is timed
        self._floor = True  # a block's worth past L, while no protected prompt has a chunk
        self._left_out: list[Seq] = []  # running requests left out of this step
        self._passed = False  # a protected request passed the queue's head
        self.reserve = self._reserve(policy, beta)
        self.kept = self.reserve.tokens  # of the reserve, what protected chunks have not taken

    def protects(self, seq: Seq) -> bool:
        """Of the strictest target present: never left out, or preempted for another."""
        return seq.target is not None and seq.target <= self.strict

    # ------------------------------------------------------------------ the hooks

    def leaves_out(self, seq: Seq, shape: StepShape, n: int) -> bool:
        t = seq.target
        if t is not None and t <= self.strict:
            return False  # protected decodes always run
        r = self.reserve
        if self._cost.predict(shape.plus(r.tokens + 1, r.sequences + 1,
                                         r.attention + n)) > self.limit_s:
            self._left_out.append(seq)  # it keeps its blocks
            return True
        return False

    def block_victim(self, seq: Seq, bottom: Seq) -> Seq:
        """A protected ``seq`` takes from any request not protected (one left out of this step
        first, then the lowest-ranked); another from one left out that ranks below it, else
        from ``bottom`` unless that one is protected (then ``seq`` waits itself)."""
        protect = self.protects(seq)
        victim = self._victim(seq, protect)
        if victim is None:
            victim = bottom
            if self.protects(victim) and not protect:
                victim = seq  # never the strictest tier's for another: seq waits
        return victim

    def prefill_chunk(self, seq: Seq, take: int, shape: StepShape) -> int:
        protect = self.protects(seq)
        take = self._timed(seq.computed, take, shape, protect)
        if take == 0:
            self._left_out.append(seq)
        elif protect:
            self.kept -= take
        return take

    def admissible(self, head: Seq, shape: StepShape, fed: Fed,
                   preempted: Collection[RequestId]) -> Seq | None:
        """``head`` when protected or when it fits (``_fits``); else, once a step, the
        best-ranked waiting protected request (not preempted this step)."""
        if self.protects(head) or self._fits(head, fed, self._with_reserve(shape, False)):
            return head
        if self._passed:
            return None
        self._passed = True
        return min((s for s in self._waiting.items()
                    if self.protects(s) and s.id not in preempted), key=rank_of, default=None)

    def seat_victim(self, head: Seq) -> Seq | None:
        """A protected ``head`` may preempt any request not protected (those left out of this
        step first); another only one left out of this step that ranks below it."""
        return self._victim(head, self.protects(head))

    def admit_chunk(self, head: Seq, start: int, take: int, shape: StepShape, fed: Fed) -> int:
        """Timed as a prefill's chunk; a request not protected also only when a step decoding
        every request of the plan and it fits L. A protected one spends the reserve's part
        kept for the queue's protected head."""
        protect = self.protects(head)
        take = self._timed(start, take, shape, protect)
        if take and not protect and not self._carries(head, fed):
            take = 0  # it would slow the decodes past the limit once it decodes
        if protect:
            self.kept = 0
        return take

    def stalled(self) -> Seq | None:
        """The best-ranked decode left out (no longer counted as left out)."""
        first = next((s for s in self._left_out
                      if s.status is RUNNING and len(s.tokens) - s.computed == 1), None)
        if first is not None:
            self._left_out.remove(first)
        return first

    def close(self, fed: Fed) -> StepReport:
        paused = sum(1 for s in self._left_out if s.status is RUNNING)
        return StepReport(self.limit_s, self.strict, paused, decoding(fed))

    # ------------------------------------------------------------------ the rules

    def _reserve(self, policy: PrefillPolicy, beta: int) -> StepShape:
        """The part of the step kept for protected prompts: what the prefill policy would give
        each of them this step (those running and the head of the queue), at most
        ``reserve_cap``."""
        chunk = policy.chunk_len
        want = sum(chunk(len(s.tokens) - s.computed, beta, False) for s in self._running
                   if self.protects(s) and len(s.tokens) - s.computed > 1)
        head = self._waiting.peek()
        if head is not None and self.protects(head):
            want += chunk(len(head.tokens), beta, False)
        if want <= 0:
            return StepShape()
        take = min(want, reserve_cap(self._cost, self.limit_s, beta))
        return StepShape(take, 1, chunk_attention(0, take))

    def _with_reserve(self, shape: StepShape, protect: bool) -> StepShape:
        """What a chunk is timed against: the step so far, plus what is still kept for
        protected prompts unless the chunk is one of them."""
        k = self.kept
        if k <= 0 or protect:
            return shape
        return shape.plus(k, 1, chunk_attention(0, k))

    def _chunk_limit(self, protect: bool) -> float:
        """L, or L′ for a protected chunk."""
        if not protect:
            return self.limit_s
        if self._burst is None:
            self._burst = self._burst_of(self.limit_s, self.strict)
        return self._burst

    def _timed(self, start: int, take: int, shape: StepShape, protect: bool) -> int:
        """The part of a ``take``-position chunk (after ``start`` computed positions) that keeps
        the step within its limit. A protected request that fits nothing gets a block's worth
        all the same while no protected prompt has a chunk in this step (its first token has a
        target too); a protected chunk uses up the floor."""
        fit = self._cost.max_tokens(self._with_reserve(shape, protect),
                                    self._chunk_limit(protect), start, take, new_sequence=True)
        if protect and fit == 0 and self._floor:
            fit = min(take, self._block_size)
        if protect and fit > 0:
            self._floor = False  # one protected prompt progressing a step is all it promises
        return fit

    def _fits(self, head: Seq, fed: Fed, shape: StepShape) -> bool:
        """Whether ``head`` (not protected) can be admitted within L: a first position of it
        fits this step, and a step decoding the plan and it fits too."""
        return (self._cost.predict(shape.plus(1, 1, chunk_attention(0, 1))) <= self.limit_s
                and self._carries(head, fed)) if head.tokens else False

    def _carries(self, head: Seq, fed: Fed) -> bool:
        """Whether a step decoding every request of this plan and ``head`` fits L."""
        shape = decoding(fed).plus(1, 1, decode_attention(len(head.tokens)))
        return self._cost.predict(shape) <= self.limit_s

    def _victim(self, seq: Seq, anyone: bool) -> Seq | None:
        """Whom ``seq`` may preempt: with ``anyone``, any request not protected (one left out of
        this step first, the lowest-ranked of them); else one left out that ranks below it."""
        idle = [s for s in self._left_out
                if s.status is RUNNING and s is not seq and not self.protects(s)]
        if not anyone:
            idle = [s for s in idle if s.rank > seq.rank]
        if idle:
            return max(idle, key=rank_of)
        if anyone:
            return next((s for s in reversed(self._running)
                         if s is not seq and not self.protects(s)), None)
        return None


# ---------------------------------------------------------------------- shared with the stats


def reserve_cap(cost: StepCostModel, limit: float, beta: int) -> int:
    """The most of a step kept for protected prompts: three quarters of what an empty step
    holds within ``limit`` (``beta``: the step's token budget)."""
    return cost.max_tokens(StepShape(), limit, 0, beta, new_sequence=True) * 3 // 4


def decoding(fed: Fed) -> StepShape:
    """A plan's requests as one decode each (the steps to come once their prompts are in)."""
    shape = StepShape()
    for seq, _ in fed:
        shape = shape.plus(1, 1, decode_attention(len(seq.tokens)))
    return shape


def seats_within(cost: StepCostModel, decoding: StepShape, free: int, limit: float) -> int:
    """How many more decodes (at most ``free``, each at the mean context of ``decoding``) a step
    decoding ``decoding`` takes within ``limit``."""
    per = decoding.attention / decoding.sequences if decoding.sequences else 256.0
    seats = 0
    while seats < free and cost.predict(decoding.plus(seats + 1, seats + 1,
                                                      per * (seats + 1))) <= limit:
        seats += 1
    return seats
