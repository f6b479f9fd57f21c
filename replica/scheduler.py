"""The continuous-batching scheduler (its specification: docs/scheduler.md).

Every step ``schedule()`` re-forms the batch in three phases: (1) running decodes, highest rank
first, each growing its block table by ``append_slot`` and preempting the lowest-ranked running
request not yet scheduled when the pool is empty; (2) prefills already in progress, each getting the
chunk its ``PrefillPolicy`` grants; (3) admissions from the waiting queue in rank order, all or
nothing, stopping at the first request that does not fit. Each phase consults the step's limit
(``StepLimit``, replica/step_limit.py: SLO-aware steps, docs/scheduler.md §8; ``NoLimit``, whose
answers are those above, when there is none). ``on_step`` then advances the computed positions,
appends the sampled tokens and finishes requests. Each request's record (``Seq``, replica/seq.py)
says where it is: waiting, running, preempted or finished (``Status``).

The plan (``StepPlan``) carries everything the runner feeds, so the runner never asks the
scheduler back: each decode its newest token, position and block table (``Decode``), each chunk
its token ids and block table, and the chunk that admits a request its cached prefix (``Chunk``).

Rank: higher priority runs first. Under ``SchedPolicy.PRIORITY`` the waiting queue is a heap on the
fixed key ``priority * aging_steps - arrival`` (docs/scheduler.md §4; ``aging_steps == 0`` means strict
priority without aging), equal keys by arrival; under ``FCFS`` by arrival only. Running requests
are ranked by the same key; the victim of a preemption is the lowest-ranked, the newest among
equals. Note: vLLM's ``priority`` runs lower values first; ours runs higher values first.
"""

from __future__ import annotations

import bisect
import enum
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from tierserve.arith import ceil_div
from tierserve.records import EngineStats, ServingError
from tierserve.replica.block_space import (
    Allocation,
    BlockSpace,
    FreeListBlocks,
    NoCapacity,
    RequestId,
)
from tierserve.replica.config import EngineConfig
from tierserve.replica.lazy_heap import LazyHeap
from tierserve.replica.prefill_policy import Chunked, PrefillPolicy, WholePrompt
from tierserve.replica.seq import FINISHED, PREEMPTED, RUNNING, Request, Seq, Status, rank_of
from tierserve.replica.step_cost import StepCostModel, StepShape, chunk_attention, decode_attention
from tierserve.replica.step_limit import (
    NO_LIMIT,
    UNLIMITED,
    SloLimit,
    StepLimit,
    StepReport,
    decoding,
    reserve_cap,
    seats_within,
)

__all__ = [
    "AdmitError",
    "Allocation",
    "BlockSpace",
    "Chunk",
    "Chunked",
    "Decode",
    "EmptyPrompt",
    "FinishReason",
    "FinishedEvent",
    "FreeListBlocks",
    "NeverFits",
    "NoCapacity",
    "PrefillPolicy",
    "QueueFull",
    "Request",
    "RequestEvent",
    "RequestId",
    "SampledToken",
    "SchedPolicy",
    "SchedStats",
    "Scheduler",
    "Status",
    "StepPlan",
    "TokenEvent",
    "TooLong",
    "WholePrompt",
]


class SchedPolicy(enum.Enum):
    FCFS = "fcfs"
    PRIORITY = "priority"


class AdmitError(ServingError):
    """``add`` refused a request: a ``ServingError`` whose ``code`` (also ``reason``, the label
    of the scheduler's rejection counts) says why and whose ``status`` is the HTTP status a
    server answers it with (429: retry later; 400: it can never run)."""

    code = "refused"

    @property
    def reason(self) -> str:
        return self.code


class QueueFull(AdmitError):
    code = "queue_full"
    status = 429

    def __init__(self, limit: int) -> None:
        self.limit = limit
        super().__init__(f"the waiting queue is full ({limit} requests); retry later")


class EmptyPrompt(AdmitError):
    code = "empty"
    param = "prompt"

    def __init__(self) -> None:
        super().__init__("the prompt is empty; it needs at least one token")


class TooLong(AdmitError):
    code = "too_long"

    def __init__(self, tokens: int, limit: int) -> None:
        self.tokens = tokens
        self.limit = limit
        super().__init__(
            f"prompt has {tokens} tokens; this model's context is {limit}, so a prompt may have "
            f"at most {limit - 1} tokens to leave room for one generated token"
        )


class NeverFits(AdmitError):
    code = "never_fits"

    def __init__(self, blocks: int, total: int) -> None:
        self.blocks = blocks
        self.total = total
        super().__init__(
            f"the request could grow to {blocks} KV blocks but the pool holds only {total}; "
            "lower max_tokens or shorten the prompt"
        )


@dataclass(frozen=True, slots=True)
class Chunk:
    """Prefill positions ``start .. start + len`` of request ``id``; ``last`` ones get sampled.

    What the runner feeds comes with it: ``tokens``, the ``len`` token ids of those positions
    (``start`` positions are computed already: a cached prefix, earlier chunks), and the
    request's ``block_table``; ``prompt_len`` bounds the rows that score its prompt. On the
    chunk that admits the request (from the waiting queue), ``cached_tokens`` is the prompt
    positions the prefix cache held at its first admission; None on a prefill in progress.
    Equality compares the positions planned (``id``, ``start``, ``len``, ``last``) alone: the
    rest follows from them.
    """

    id: RequestId
    start: int
    len: int
    last: bool
    tokens: Sequence[int] = field(default=(), compare=False, repr=False)
    block_table: Sequence[int] = field(default=(), compare=False, repr=False)
    prompt_len: int = field(default=0, compare=False)
    cached_tokens: int | None = field(default=None, compare=False)


class Decode(NamedTuple):
    """A running request feeding its newest ``token`` at ``position`` (its positions computed so
    far), over ``block_table`` (a NamedTuple: one is made per decode per step, so it must be
    cheap; the token alone is carried, never the request's whole sequence)."""

    id: RequestId
    token: int
    position: int
    block_table: Sequence[int]


@dataclass(slots=True)
class StepPlan:
    """One step's plan: the scheduler's word to the runner, which reads nothing else of it.

    prefill: chunks to prefill, in rank order. decodes: requests feeding their newest token, in
    rank order (``decode``: their ids). preempted: requests preempted this step (blocks
    released, back in the waiting queue). A block table is the ``BlockSpace``'s own sequence, not
    a copy: it holds until the next ``schedule`` or ``abort``.
    """

    prefill: list[Chunk] = field(default_factory=list)
    decodes: list[Decode] = field(default_factory=list)
    preempted: list[RequestId] = field(default_factory=list)
    # The step's work, for the cost model (docs/scheduler.md §8).
    shape: StepShape = field(default_factory=StepShape)
    # With a step limit: the seconds the step may take, and running requests it leaves out.
    limit_s: float | None = None
    paused: int = 0

    @property
    def decode(self) -> list[RequestId]:
        """The ids of ``decodes``, in order."""
        return [d.id for d in self.decodes]

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(c.len for c in self.prefill)

    @property
    def is_empty(self) -> bool:
        return not self.prefill and not self.decodes


@dataclass(frozen=True, slots=True)
class SampledToken:
    """What the engine hands the scheduler after a step (``on_step``): a token sampled for ``id``;
    ``stop`` when the engine saw an end condition (EOS, stop string)."""

    id: RequestId
    token: int
    stop: bool = False


class FinishReason(enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


class TokenEvent(NamedTuple):
    """``id`` sampled ``token`` (a NamedTuple: one is made per sampled row, so it must be cheap)."""

    id: RequestId
    token: int


class FinishedEvent(NamedTuple):
    id: RequestId
    reason: FinishReason


RequestEvent = TokenEvent | FinishedEvent


@dataclass(frozen=True, slots=True)
class SchedStats:
    running: int
    waiting: int
    free_blocks: int
    total_blocks: int
    preemptions: int
    rejected: dict[str, int]
    step: int
    # With SLO-aware steps (§8): the last step's limit in seconds (None: no target present),
    # running requests it left out, and how many more decoding requests it could carry (any,
    # then of the strictest target, for which the lower tiers' decodes give way).
    limit_s: float | None = None
    paused: int = 0
    seats: int = 0
    target_seats: int = 0


def _shape_of(fed: Sequence[tuple[Seq, int]]) -> StepShape:
    """The work of a plan's (request, positions fed) entries."""
    shape = StepShape()
    for seq, n in fed:
        start = seq.computed
        shape = shape.plus(n, 1, decode_attention(start + 1) if n == 1
                           else chunk_attention(start, n))
    return shape


class Scheduler:
    """Continuous batching with admission by free blocks, priority with aging, preemption, abort."""

    def __init__(
        self,
        cfg: EngineConfig,
        blocks: BlockSpace,
        prefill_policy: PrefillPolicy | None = None,
        max_model_len: int | None = None,
        cost: StepCostModel | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Caps from ``cfg`` (``max_num_seqs``, ``max_num_batched_tokens``, ``max_waiting``,
        ``scheduling_policy``, ``aging_steps``); the context is ``max_model_len`` (the engine
        resolves it from the model) or else ``cfg.max_model_len``; the prefill policy is
        ``prefill_policy`` or else chunks of ``cfg.prefill_chunk_tokens`` (whole prompts when
        None). ``cost``: the step cost model of SLO-aware steps (§8), when ``cfg.slo_scheduling``
        is on (a default one when None); requests' ``tpot_target_s`` then bound each step.
        ``clock``: seconds, for the TPOT budget of §8 (when each request's first token came)."""
        context = max_model_len if max_model_len is not None else cfg.max_model_len
        if context is None or context < 2:
            raise ValueError(
                f"the scheduler needs a context of at least 2 tokens (max_model_len), got {context}"
            )
        self.cfg = cfg
        self.max_model_len = context
        self.policy = SchedPolicy(cfg.scheduling_policy)
        self._blocks = blocks
        if prefill_policy is None:
            chunk = cfg.prefill_chunk_tokens
            prefill_policy = Chunked(chunk) if chunk else WholePrompt()
        self._policy: PrefillPolicy = prefill_policy
        self._waiting: LazyHeap[Seq] = LazyHeap()  # WAITING and PREEMPTED requests
        self._running: list[Seq] = []  # RUNNING requests, sorted by rank, best first
        self._seqs: dict[RequestId, Seq] = {}  # every unfinished request
        self._next_id = 0
        self._step = 0
        self._preemptions = 0
        self._rejected: dict[str, int] = {}
        self._last: list[tuple[Seq, int]] = []  # (seq, positions fed) of the last schedule()
        self.cost: StepCostModel | None = None
        if cfg.slo_scheduling:
            self.cost = cost or StepCostModel()
        self._targets: dict[float, int] = {}  # TPOT target -> unfinished requests holding it
        self._report: StepReport = UNLIMITED  # the last step's limit, as the stats report it
        self._clock = clock
        # LoRA: whether a request's adapter (its key) is loaded in the replica's adapter cache;
        # the engine's, which starts a load of one that is not. None: every adapter is (the
        # scheduler alone, in tests).
        self.lora_ready: Callable[[str], bool] | None = None

    # ------------------------------------------------------------------ admission

    def check(self, req: Request) -> None:
        """Raise the ``AdmitError`` that ``add`` would raise for ``req`` (a full queue aside)."""
        self._check(req, queue=False)

    def add(self, req: Request) -> RequestId:
        """Queue a request; raises an ``AdmitError`` for what could never run or a full queue."""
        try:
            self._check(req)
        except AdmitError as e:
            self._rejected[e.reason] = self._rejected.get(e.reason, 0) + 1
            raise
        rid = self._next_id
        self._next_id += 1
        seq = Seq(rid, req, (self._rank_key(req.priority), rid))
        if req.ttft_left_s is not None and self.cost is not None:
            seq.deadline = self._clock() + req.ttft_left_s
        self._seqs[rid] = seq
        if seq.target is not None:
            self._targets[seq.target] = self._targets.get(seq.target, 0) + 1
        self._enqueue(seq)
        return rid

    def _rank_key(self, priority: int) -> int:
        """The first part of the rank of a request of ``priority`` arriving now (§4): smaller
        ranks higher, the request id breaks ties (arrival order)."""
        if self.policy is SchedPolicy.FCFS:
            return 0
        if self.cfg.aging_steps == 0:
            return -priority
        return self._step - priority * self.cfg.aging_steps

    def _check(self, req: Request, queue: bool = True) -> None:
        n = len(req.prompt)
        if n == 0:
            raise EmptyPrompt()
        ctx = self.max_model_len
        if n >= ctx:
            raise TooLong(n, ctx)
        longest = min(n + req.max_tokens, ctx)
        need = ceil_div(longest, self._blocks.block_size)
        if need > self._blocks.total_blocks:
            raise NeverFits(need, self._blocks.total_blocks)
        if queue and len(self._waiting) >= self.cfg.max_waiting:
            raise QueueFull(self.cfg.max_waiting)

    def _enqueue(self, seq: Seq) -> None:
        seq.handle = self._waiting.push(seq.rank, seq)

    # ------------------------------------------------------------------ abort

    def abort(self, id: RequestId) -> bool:
        """Drop a request, waiting (O(1)) or running (its blocks freed at once); False if unknown."""
        seq = self._seqs.pop(id, None)
        if seq is None:
            return False
        self._untarget(seq)
        if seq.status is RUNNING:
            self._running.remove(seq)
            self._blocks.release(id)
        else:  # waiting or preempted: in the queue
            assert seq.handle is not None
            self._waiting.remove(seq.handle)
            seq.handle = None
        seq.status = FINISHED
        return True

    # ------------------------------------------------------------------ the step

    def schedule(self) -> StepPlan:
        """Plan one step in the phases of docs/scheduler.md §2: decodes, prefills in progress,
        admissions, each consulting the step's limit (§8; ``NoLimit`` without one: every answer
        is §2's), and progress when a limit leaves the step empty."""
        cfg = self.cfg
        blocks = self._blocks
        table = blocks.block_table
        running = self._running
        step = self._limit_for_step()
        out = StepPlan()
        fed: list[tuple[Seq, int]] = []  # (request, positions fed) of this plan
        budget = cfg.max_num_batched_tokens
        shape = StepShape()  # the plan's work so far

        # Phase 1: decodes, highest rank first. ``running`` is copied: room for a decode may
        # preempt from its bottom, never a request already scheduled.
        partial = False  # a prefill in progress was seen (only with chunked prefill)
        decodes = out.decodes
        new_decode = tuple.__new__
        append_slot = blocks.append_slot
        leaves_out = step.leaves_out
        for seq in list(running):
            if seq.status is not RUNNING:
                continue  # preempted for a request above it
            n = len(seq.tokens)
            if n - seq.computed != 1:
                partial = True
                continue  # a prefill in progress: phase 2
            if budget == 0:
                break
            if leaves_out(seq, shape, n):
                continue  # left out by the limit, keeping its blocks
            try:
                append_slot(seq.id, n)
            except NoCapacity:
                if not self._preempt_for_block(seq, n, out, fed, step):
                    break  # seq preempted itself: nothing ranks lower
            # A Decode made by tuple.__new__: NamedTuple's own __new__ is Python code, and one
            # is made per decode per step.
            decodes.append(new_decode(Decode, (seq.id, seq.tokens[n - 1], n - 1, table(seq.id))))
            fed.append((seq, 1))
            budget -= 1
            shape = shape.plus(1, 1, decode_attention(n))

        # Phase 2: prefills in progress (chunked prefill), rank order, each the chunk its policy
        # grants and the limit allows. Blocks were allocated at admission for every position.
        chunk_len = self._policy.chunk_len
        for seq in running if partial and budget else ():
            remaining = len(seq.tokens) - seq.computed
            if remaining <= 1 or budget == 0:
                continue
            take = chunk_len(remaining, budget, not fed)
            if take > 0:
                take = step.prefill_chunk(seq, take, shape)
            if take <= 0:
                continue
            start = seq.computed
            out.prefill.append(Chunk(seq.id, start, take, take == remaining,
                                     seq.tokens[start : start + take], table(seq.id),
                                     seq.prompt_len))
            fed.append((seq, take))
            budget -= take
            shape = shape.plus(take, 1, chunk_attention(start, take))

        # Phase 3: admissions in rank order, all or nothing, no skipping ahead (a protected
        # request may pass a head the limit refuses, once a step).
        waiting = self._waiting
        passed: list[Seq] = []  # requests set aside: their adapter has no slot (LoRA only)
        while waiting and budget > 0:
            head = waiting.peek()
            assert head is not None
            if head.id in out.preempted:
                # Preempted this step for room: not back before the next one (a prefix cache
                # would otherwise hand it its own blocks back at once, and it would thrash).
                break
            admit = step.admissible(head, shape, fed, out.preempted)
            if admit is None:
                break  # it would take the step, or the decodes to come, past the limit
            if admit.lora is not None and not (self._adapter_loaded(admit.lora)
                                               and self._adapter_fits(admit.lora)):
                # Its adapter is not loaded yet (the engine loads it meanwhile) or max_loras
                # adapters run: it waits for the load or a slot, first in line, or, while it
                # has not waited lora_bypass_steps, set aside for the requests behind it to
                # pass it.
                if not self._may_pass(admit, passed):
                    break
                assert admit.handle is not None
                waiting.remove(admit.handle)
                admit.handle = None
                passed.append(admit)
                continue
            alloc = self._allocate(admit)
            while alloc is None and (victim := step.seat_victim(admit)) is not None:
                self._preempt(victim, out, fed)
                budget = cfg.max_num_batched_tokens - sum(k for _, k in fed)
                shape = _shape_of(fed)
                alloc = self._allocate(admit)
            if alloc is None:
                break  # no seat or no blocks: it waits
            # Only what is not cached costs budget (the last position is always computed).
            cached = min(alloc.cached_tokens, len(admit.tokens) - 1)
            remaining = len(admit.tokens) - cached
            take = chunk_len(remaining, budget, not fed)
            if take > 0:
                take = step.admit_chunk(admit, cached, take, shape, fed)
            if take <= 0:
                blocks.release(admit.id)  # all or nothing: it waits, holding nothing
                break
            self._admit(admit, cached)
            out.prefill.append(Chunk(admit.id, cached, take, take == remaining,
                                     admit.tokens[cached : cached + take], table(admit.id),
                                     admit.prompt_len, admit.cached))
            fed.append((admit, take))
            budget -= take
            shape = shape.plus(take, 1, chunk_attention(cached, take))
        for seq in passed:  # back in the queue, their rank unchanged
            self._enqueue(seq)

        # Progress: when nothing fits the limit (a target below what one decode takes here),
        # the best-ranked request left out runs anyway, so the replica never stalls.
        first = step.stalled() if not fed else None
        if first is not None:
            n = len(first.tokens)
            if self._grow(first, n, out, fed, step):
                out.decodes.append(Decode(first.id, first.tokens[n - 1], n - 1, table(first.id)))
                fed.append((first, 1))
                shape = shape.plus(1, 1, decode_attention(n))

        out.shape = shape
        self._report = step.close(fed)
        out.limit_s, out.paused = self._report.limit_s, self._report.paused
        self._last = fed
        self._step += 1
        return out

    def _limit_for_step(self) -> StepLimit:
        """This step's limit (docs/scheduler.md §8): ``NO_LIMIT`` where none exists."""
        limit = self.step_limit()
        if limit is None:
            return NO_LIMIT
        assert self.cost is not None
        return SloLimit(limit, min(self._targets), self.cost, self._running, self._waiting,
                        self._policy, self.cfg.max_num_batched_tokens, self._blocks.block_size,
                        self._burst_limit)

    def _adapter_fits(self, lora: str) -> bool:
        """Whether a request of adapter ``lora`` may run beside the running ones: its adapter
        runs already, or fewer than ``max_loras`` distinct adapters do (the base not counted).
        Running requests keep their adapter's slot until they finish or are preempted; the
        waiting queue is not passed (admission stays in rank order), so the head's adapter gets
        a slot as soon as one drains: no adapter starves."""
        running = {s.lora for s in self._running if s.lora is not None}
        return lora in running or len(running) < self.cfg.max_loras

    def _adapter_loaded(self, lora: str) -> bool:
        """Whether adapter ``lora`` (its key) is loaded, so that a request of it may run; an
        adapter of a running request always is (its entry is pinned). Where it is not, asking
        starts its load (``lora_ready``), and the request waits as one without a slot."""
        ready = self.lora_ready
        return ready is None or ready(lora)

    def running_adapters(self) -> set[str]:
        """The keys of the running requests' adapters: the pinned entries of the adapter cache
        (nothing evicts nor unloads them); a waiting request pins nothing."""
        return {s.lora for s in self._running if s.lora is not None}

    def _may_pass(self, seq: Seq, passed: list[Seq]) -> bool:
        """Whether admission may go on past ``seq``, a waiting request whose adapter has no slot
        (``_adapter_fits`` is false): only while it has stood so for fewer than
        ``lora_bypass_steps`` steps (counted from the first step admission found it without a
        slot), and while fewer than ``max_num_seqs`` requests were set aside in this step (a
        bound on the scan). Requests behind it can then only be of the base model or of an
        adapter already running (the running adapters fill every slot), so the slots stay as
        they are. Past the bound admission stops at it again, as with ``lora_bypass_steps``
        0: nothing new of the running adapters starts, they drain, and it gets the first slot
        freed (no starvation)."""
        if seq.lora_blocked_at is None:
            seq.lora_blocked_at = self._step
        return (self._step - seq.lora_blocked_at < self.cfg.lora_bypass_steps
                and len(passed) < self.cfg.max_num_seqs)

    def _allocate(self, seq: Seq) -> Allocation | None:
        """Blocks for every position of ``seq`` (all or nothing, §2) while fewer than
        ``max_num_seqs`` run; None: no seat or no room."""
        if len(self._running) >= self.cfg.max_num_seqs:
            return None
        try:
            return self._blocks.allocate(seq.id, seq.tokens, seq.reuse, seq.partition)
        except NoCapacity:
            return None

    def _admit(self, seq: Seq, cached: int) -> None:
        """``seq`` leaves the waiting queue and runs (rank order) after ``cached`` positions."""
        waiting = self._waiting
        if seq is waiting.peek():
            waiting.pop()
        else:
            assert seq.handle is not None
            waiting.remove(seq.handle)
        seq.handle = None
        seq.status = RUNNING
        seq.lora_blocked_at = None
        seq.computed = cached
        if seq.cached is None:
            seq.cached = cached
        bisect.insort(self._running, seq, key=rank_of)

    def _grow(self, seq: Seq, n: int, out: StepPlan, fed: list[tuple[Seq, int]],
              step: StepLimit) -> bool:
        """Room in ``seq``'s block table for ``n`` positions; False when ``seq`` was preempted."""
        try:
            self._blocks.append_slot(seq.id, n)
            return True
        except NoCapacity:
            return self._preempt_for_block(seq, n, out, fed, step)

    def _preempt_for_block(self, seq: Seq, n: int, out: StepPlan, fed: list[tuple[Seq, int]],
                   step: StepLimit) -> bool:
        """The pool has no block for ``seq``'s ``n`` positions: preempt the step's victim
        (``StepLimit.block_victim``; §2's is the lowest-ranked running request) and try again
        until it fits; False when ``seq`` itself was the victim."""
        while True:
            victim = step.block_victim(seq, self._running[-1])
            self._preempt(victim, out, fed)
            if victim is seq:
                return False
            try:
                self._blocks.append_slot(seq.id, n)
                return True
            except NoCapacity:
                pass

    def _preempt(self, victim: Seq, out: StepPlan, fed: list[tuple[Seq, int]]) -> None:
        """Preemption by recompute (docs/scheduler.md §5): out of this step's plan where it is
        in it, its blocks freed now, back in the waiting queue with the same rank."""
        self._unplan(victim, out, fed)
        self._running.remove(victim)
        self._blocks.release(victim.id)
        victim.computed = 0
        victim.status = PREEMPTED
        self._enqueue(victim)
        self._preemptions += 1
        out.preempted.append(victim.id)

    @staticmethod
    def _unplan(victim: Seq, out: StepPlan, fed: list[tuple[Seq, int]]) -> None:
        """Take ``victim`` out of this step's plan, where it is in it."""
        for k, (seq, _) in enumerate(fed):
            if seq is victim:
                del fed[k]
                break
        decodes = out.decodes
        for k, d in enumerate(decodes):
            if d.id == victim.id:
                del decodes[k]
                break
        out.prefill = [c for c in out.prefill if c.id != victim.id]

    def on_step(self, outputs: Sequence[SampledToken]) -> list[RequestEvent]:
        """Advance the last plan: computed positions, sampled tokens, finishes (and their blocks)."""
        blocks = self._blocks
        for seq, n in self._last:
            seq.computed += n
            if seq.status is RUNNING:  # not preempted or aborted since
                blocks.commit(seq.id, seq.tokens, seq.computed)
        self._last = []
        events: list[RequestEvent] = []
        ctx = self.max_model_len
        finished: list[Seq] = []
        seqs = self._seqs
        now = self._clock() if self.cost is not None else 0.0
        for o in outputs:
            got = seqs.get(o.id)
            if got is None or got.status is not RUNNING:
                continue  # aborted (or preempted) between schedule and on_step
            seq = got
            seq.tokens.append(o.token)
            if seq.first_at is None:
                seq.first_at = now
            events.append(TokenEvent(o.id, o.token))
            n = len(seq.tokens)
            if o.stop:
                reason = FinishReason.STOP
            elif n - seq.prompt_len >= seq.max_tokens or n >= ctx:
                reason = FinishReason.LENGTH
            else:
                continue
            events.append(FinishedEvent(o.id, reason))
            finished.append(seq)
        if finished:
            for f in finished:
                f.status = FINISHED
                del seqs[f.id]
                self._untarget(f)
                self._blocks.release(f.id)
            done = {f.id for f in finished}
            self._running = [s for s in self._running if s.id not in done]
        return events

    # ------------------------------------------------------------------ SLO-aware steps (§8)

    def _untarget(self, seq: Seq) -> None:
        t = seq.target
        if t is not None:
            left = self._targets[t] - 1
            if left:
                self._targets[t] = left
            else:
                del self._targets[t]

    def strictest_count(self) -> int:
        """Unfinished requests holding the strictest TPOT target (0 without one)."""
        t = self.strictest_target()
        return self._targets[t] if t is not None else 0

    def strictest_prefill(self) -> int:
        """Prompt positions not yet computed of the unfinished requests holding the strictest
        TPOT target (0 without one): the prefill a new request of that target finds ahead of it
        (a waiting one counts its whole prompt: what its cache holds is known at admission)."""
        t = self.strictest_target()
        if t is None:
            return 0
        ahead = sum(len(s.tokens) - s.computed for s in self._running
                    if s.target == t and len(s.tokens) - s.computed > 1)
        return ahead + sum(len(s.tokens) for s in self._waiting.items() if s.target == t)

    @property
    def slo_steps(self) -> bool:
        """Whether SLO-aware steps are on (§8) under priority scheduling: then a request of the
        strictest target passes the lower tiers' queue (under FCFS a lower tier's head that fits
        the limit is admitted first)."""
        return self.cost is not None and self.policy is SchedPolicy.PRIORITY

    def strictest_target(self) -> float | None:
        """The strictest TPOT target of the unfinished requests (None: none, or steps off)."""
        if self.cost is None or not self._targets:
            return None
        return min(self._targets)

    def step_limit(self) -> float | None:
        """The seconds the next step may take (§8): the strictest TPOT target of the unfinished
        requests times ``slo_headroom``; None without SLO-aware steps or without targets."""
        if self.cost is None or not self._targets:
            return None
        return min(self._targets) * self.cfg.slo_headroom

    def _burst_limit(self, limit: float, strict: float) -> float:
        """How long a step may take for the strictest tier's prompts (§8): past ``limit`` by
        as much as every unfinished request of that tier with a first token (running or
        preempted) can spend and keep its time per output token so far within
        ``slo_prefill_headroom`` of its target, and never past the limit of the next laxer
        target present (the lower tiers' work in the step keeps its own); ``limit`` when
        ``slo_prefill_headroom`` is None."""
        share = self.cfg.slo_prefill_headroom
        if share is None:
            return limit
        now = self._clock()
        # (target, tokens sampled, seconds since the first token) of each such request.
        spent = [(seq.target, len(seq.tokens) - seq.prompt_len, now - seq.first_at)
                 for seq in self._seqs.values()
                 if seq.target is not None and seq.target <= strict and seq.first_at is not None]
        late = self.cfg.slo_prefill_headroom_late
        if spent and late is not None and late > share and self._late(now, strict, limit):
            share = late
        # If its next token comes at the end of this step, its mean gap stays within share *
        # target while the step ends by first + share * target * (tokens it has sampled).
        budget = min((share * target * sampled - elapsed for target, sampled, elapsed in spent),
                     default=math.inf)
        laxer = [t for t in self._targets if t > strict]
        if laxer:
            budget = min(budget, min(laxer) * self.cfg.slo_headroom)
        return max(limit, budget)

    def _late(self, now: float, strict: float, limit: float) -> bool:
        """Whether a prompt of the strictest target still without a first token (a preempted one
        had its first already) would miss its deadline if that target's prompts here were
        prefilled earliest deadline first at the reserve's rate (its positions a step over
        ``limit``, without the block's worth a step ``strictest_prefill_rate`` adds: under load
        the steps that carry the tier's decodes leave its prompts about that; a block's worth
        where the reserve is empty). A prompt already past its deadline delays those after it
        but is not itself a reason: its first token can no longer be on time."""
        due: list[tuple[float, int]] = []
        for seq in self._running:
            left = len(seq.tokens) - seq.computed
            if (seq.deadline is not None and seq.first_at is None and left > 1
                    and seq.target is not None and seq.target <= strict):
                due.append((seq.deadline, left))
        for seq in self._waiting.items():
            if (seq.deadline is not None and seq.first_at is None
                    and seq.target is not None and seq.target <= strict):
                due.append((seq.deadline, len(seq.tokens)))
        if not due:
            return False
        assert self.cost is not None
        cap = reserve_cap(self.cost, limit, self.cfg.max_num_batched_tokens)
        rate = (cap or self._blocks.block_size) / limit
        ahead = 0
        for deadline, positions in sorted(due):
            ahead += positions
            if deadline > now and now + ahead / rate > deadline:
                return True
        return False

    def strictest_prefill_rate(self) -> float:
        """Prompt positions a second the strictest tier's prompts get under the current limit
        (the reserve, at least a block's worth a step, over the limit); 0 without a limit."""
        limit = self.step_limit()
        if limit is None or limit <= 0:
            return 0.0
        assert self.cost is not None
        cap = reserve_cap(self.cost, limit, self.cfg.max_num_batched_tokens)
        return max(cap, self._blocks.block_size) / limit

    def _free_seats(self) -> int:
        """More decoding requests the last step could carry: within its limit, or by
        ``max_num_seqs`` (computed when asked, not every step)."""
        free = max(self.cfg.max_num_seqs - len(self._running), 0)
        last = self._report
        if last.decoding is None or last.limit_s is None:
            return free
        assert self.cost is not None
        return seats_within(self.cost, last.decoding, free, last.limit_s)

    def _target_seats(self) -> int:
        """More decoding requests of the target the last step kept (its strictest) that the
        steps could carry within its limit. Their decodes always run, and a request of another
        target gives way to them (§8, phase 1) unless it ranks above them: so what counts is
        that target's unfinished requests (the waiting ones too: each is admitted whatever the
        limit) and the running requests of other targets that rank above one of that target
        arriving now (aged, or any under fcfs); ``max_num_seqs`` less them. ``_free_seats``
        without a limit or once none of that target is left."""
        limit, strict = self._report.limit_s, self._report.strict
        if limit is None or strict is None:
            return self._free_seats()
        mine = [s for s in self._seqs.values() if s.target is not None and s.target <= strict]
        if not mine:
            return self._free_seats()
        arriving = (self._rank_key(max(s.priority for s in mine)), self._next_id)
        ahead = [s for s in self._running if s.rank < arriving
                 and not (s.target is not None and s.target <= strict)]
        counted = [(s, 1) for s in mine + ahead]
        assert self.cost is not None
        return seats_within(self.cost, decoding(counted),
                            max(self.cfg.max_num_seqs - len(counted), 0), limit)

    # ------------------------------------------------------------------ queries

    def tokens(self, id: RequestId) -> Sequence[int] | None:
        """Prompt plus generated tokens of an unfinished request."""
        seq = self._seqs.get(id)
        return seq.tokens if seq is not None else None

    def prompt_len(self, id: RequestId) -> int | None:
        seq = self._seqs.get(id)
        return seq.prompt_len if seq is not None else None

    def cached_tokens(self, id: RequestId) -> int | None:
        """Prompt positions ``id`` found cached when it was first admitted (None before)."""
        seq = self._seqs.get(id)
        return seq.cached if seq is not None else None

    def computed(self, id: RequestId) -> int | None:
        """Positions of ``id`` whose K/V are in the cache."""
        seq = self._seqs.get(id)
        return seq.computed if seq is not None else None

    def unfinished(self) -> list[RequestId]:
        return list(self._seqs)

    def has_unfinished(self) -> bool:
        return bool(self._seqs)

    def waiting_blocks(self) -> int:
        """Blocks the waiting requests need at admission (their tokens plus the first new one)."""
        b = self._blocks.block_size
        return sum(ceil_div((len(seq.tokens) + 1), b) for seq in self._waiting.items())

    def committed_blocks(self) -> int:
        """Blocks the pool is promised once every unfinished request (running or waiting) has
        generated all of its ``max_tokens`` (capped at the context): the blocks referenced now
        (a block shared by several requests' prompts counts once), each running request's
        growth beyond its table, and every waiting request at its full length."""
        b = self._blocks.block_size
        ctx = self.max_model_len
        blocks = self._blocks
        referenced = blocks.total_blocks - blocks.free_blocks
        growth = 0
        for seq in self._running:
            full = ceil_div(min(seq.prompt_len + seq.max_tokens, ctx), b)
            growth += max(full - len(blocks.block_table(seq.id)), 0)
        waiting = sum(
            ceil_div(min(seq.prompt_len + seq.max_tokens, ctx), b) for seq in self._waiting.items()
        )
        return referenced + growth + waiting

    def is_waiting(self, id: RequestId) -> bool:
        seq = self._seqs.get(id)
        return seq is not None and seq.status.queued

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def stats(self) -> SchedStats:
        return SchedStats(
            running=len(self._running),
            waiting=len(self._waiting),
            free_blocks=self._blocks.free_blocks,
            total_blocks=self._blocks.total_blocks,
            preemptions=self._preemptions,
            rejected=dict(self._rejected),
            step=self._step,
            limit_s=self._report.limit_s,
            paused=self._report.paused,
            seats=self._free_seats(),
            target_seats=self._target_seats(),
        )

    def engine_stats(self, overhead: float = 0.0) -> EngineStats:
        """What a replica reports of this scheduler (``Engine.stats``, whose ``overhead`` is
        the step loop's; the simulations report their schedulers the same way)."""
        s = self.stats()
        target_s = self.strictest_target()
        return EngineStats(
            running=s.running,
            waiting=s.waiting,
            free_blocks=s.free_blocks,
            total_blocks=s.total_blocks,
            block_size=self._blocks.block_size,
            waiting_blocks=self.waiting_blocks() if s.waiting else 0,
            committed_blocks=self.committed_blocks() if s.waiting or s.running else 0,
            preemptions=s.preemptions,
            steps=s.step,
            overhead=overhead,
            cached_blocks=self._blocks.cached_blocks,
            step_limit_s=s.limit_s or 0.0,
            paused=s.paused,
            seats=s.seats,
            target_seats=s.target_seats,
            tpot_target_s=target_s or 0.0,
            target_requests=self.strictest_count(),
            target_prefill=self.strictest_prefill(),
            target_prefill_per_s=self.strictest_prefill_rate(),
            slo_steps=self.slo_steps,
            lora_adapters_running=(len({q.lora for q in self._running if q.lora is not None})
                                   if self.cfg.enable_lora else 0),
        )

    def observe_step(self, shape: StepShape, seconds: float) -> None:
        """Teach the cost model (§8) what a step of ``shape`` took; nothing without one."""
        if self.cost is not None:
            self.cost.observe(shape, seconds)

    @property
    def blocks(self) -> BlockSpace:
        return self._blocks

    @property
    def prefill_policy(self) -> PrefillPolicy:
        return self._policy
