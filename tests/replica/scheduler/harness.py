"""A checked simulation around the scheduler and tests/replica/fake_model.py.

``Sim`` drives a ``Scheduler`` with the fake model and, at every step, checks the invariants of
docs/scheduler.md §1 to §5 against its own shadow of the scheduler's state (what is running, how many
positions of each request are computed, each request's rank from docs/scheduler.md §4). It never trusts the
scheduler's own bookkeeping: positions are counted from the plans, ranks from the arrival steps.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from tests.replica.fake_model import FakeModel, expected_output
from tests.replica.prefix_probe import ProbedPrefixCache
from tierserve.replica.block_space import FreeListBlocks
from tierserve.replica.config import EngineConfig
from tierserve.replica.prefill_policy import PrefillPolicy, WholePrompt
from tierserve.replica.scheduler import (
    FinishedEvent,
    FinishReason,
    Request,
    RequestId,
    SchedPolicy,
    Scheduler,
    StepPlan,
    TokenEvent,
)


def caps(
    max_seqs: int = 256,
    max_batch_tokens: int = 2048,
    max_waiting: int = 1024,
    policy: SchedPolicy | str = SchedPolicy.FCFS,
    aging_steps: int = 100,
    max_model_len: int = 2048,
) -> EngineConfig:
    """The scheduler's caps for a test, in the vocabulary of docs/scheduler.md (``max_seqs`` is
    the config's ``max_num_seqs``, ``max_batch_tokens`` its ``max_num_batched_tokens``), with
    whole-prompt prefill unless the test hands the scheduler a prefill policy."""
    return EngineConfig(
        max_num_seqs=max_seqs,
        max_num_batched_tokens=max_batch_tokens,
        max_waiting=max_waiting,
        scheduling_policy=policy.value if isinstance(policy, SchedPolicy) else policy,
        aging_steps=aging_steps,
        max_model_len=max_model_len,
        prefill_chunk_tokens=None,
    )


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks that hold ``tokens`` positions (docs/scheduler.md §3)."""
    return -(-tokens // block_size)


def rank_key(
    policy: SchedPolicy, aging_steps: int, priority: int, arrival: int, rid: RequestId
) -> tuple[int, int]:
    """The order of docs/scheduler.md §4 as an ascending key: smaller runs first."""
    if policy is SchedPolicy.FCFS:
        return (0, rid)
    if aging_steps == 0:
        return (-priority, rid)
    # pi_r > pi_s  <=>  P_r * A - a_r > P_s * A - a_s; equal keys by arrival (request id).
    return (arrival - priority * aging_steps, rid)


@dataclass
class Meta:
    prompt: list[int]
    max_tokens: int
    priority: int
    arrival: int  # schedule() calls before the add


@dataclass
class Sim:
    """A scheduler, a fake model, and the shadow state the invariants are checked against."""

    cfg: EngineConfig
    total_blocks: int
    block_size: int
    policy: PrefillPolicy = field(default_factory=WholePrompt)
    stop_token: int | None = None
    prefix_cache: bool = False  # the prefix cache (ProbedPrefixCache) instead of the free list

    def __post_init__(self) -> None:
        self.blocks: FreeListBlocks | ProbedPrefixCache
        if self.prefix_cache:
            self.blocks = ProbedPrefixCache(self.block_size, range(self.total_blocks), 7)
        else:
            self.blocks = FreeListBlocks(self.block_size, range(self.total_blocks))
        self.s = Scheduler(self.cfg, self.blocks, self.policy)
        self.model = FakeModel(self.s, stop_token=self.stop_token)
        self.meta: dict[RequestId, Meta] = {}
        self.tokens: dict[RequestId, list[int]] = {}
        self.reasons: dict[RequestId, FinishReason] = {}
        self.aborted: set[RequestId] = set()
        self.running: set[RequestId] = set()
        self.computed: dict[RequestId, int] = {}  # shadow c_r of running requests
        self.plans: list[StepPlan] = []
        self.preemptions = 0
        self.steps = 0
        self.abort_kinds: list[str] = []  # "running" or "waiting", per successful abort

    # ------------------------------------------------------------------ inputs

    def add(self, req: Request) -> RequestId:
        arrival = self.s.stats().step
        rid = self.s.add(req)
        assert rid not in self.meta, f"request id {rid} handed out twice"
        self.meta[rid] = Meta(list(req.prompt), req.max_tokens, req.priority, arrival)
        self.tokens[rid] = []
        return rid

    def abort(self, rid: RequestId) -> bool:
        live = rid in self.meta and rid not in self.reasons and rid not in self.aborted
        got = self.s.abort(rid)
        assert got == live, (
            f"abort({rid}) returned {got}; the request is {'live' if live else 'gone'}"
        )
        if got:
            self.abort_kinds.append("running" if rid in self.running else "waiting")
            self.aborted.add(rid)
            self.running.discard(rid)
            self.computed.pop(rid, None)
            assert not self.blocks.block_table(rid), f"aborted request {rid} still holds blocks"
            assert rid not in self.s.unfinished()
        return got

    # ------------------------------------------------------------------ ranks

    def rank(self, rid: RequestId) -> tuple[int, int]:
        m = self.meta[rid]
        return rank_key(SchedPolicy(self.cfg.scheduling_policy), self.cfg.aging_steps, m.priority, m.arrival, rid)

    def live(self) -> list[RequestId]:
        return [r for r in self.meta if r not in self.reasons and r not in self.aborted]

    def waiting(self) -> list[RequestId]:
        return [r for r in self.live() if r not in self.running]

    # ------------------------------------------------------------------ one step

    def step(self, abort_mid: Iterable[RequestId] = ()) -> StepPlan:
        """schedule, check the plan, run the fake, optionally abort, on_step, check again."""
        waiting_before = set(self.waiting())
        plan = self.s.schedule()
        self.plans.append(plan)
        self.steps += 1
        self._check_plan(plan, waiting_before)
        outs = self.model.run(plan)
        for rid in abort_mid:
            self.abort(rid)
        for c in plan.prefill:
            if c.id in self.running:
                self.computed[c.id] = c.start + c.len
        for rid in plan.decode:
            if rid in self.running:
                self.computed[rid] += 1
        events = self.s.on_step(outs)
        self._take_events(events)
        self.check_blocks()
        return plan

    def run(self, max_steps: int = 10_000) -> None:
        """Step until nothing is unfinished."""
        for _ in range(max_steps):
            if not self.s.has_unfinished():
                assert not self.live(), f"scheduler lost requests {self.live()}"
                return
            self.step()
        raise AssertionError(f"unfinished after {max_steps} steps: {self.s.unfinished()}")

    # ------------------------------------------------------------------ checks

    def _check_plan(self, plan: StepPlan, waiting_before: set[RequestId]) -> None:
        cfg, s = self.cfg, self.s
        decode, chunks, preempted = plan.decode, plan.prefill, plan.preempted
        scheduled = list(decode) + [c.id for c in chunks]
        assert len(set(scheduled)) == len(scheduled), f"a request scheduled twice: {plan}"
        assert not set(preempted) & set(scheduled), f"preempted and scheduled at once: {plan}"
        assert len(set(preempted)) == len(preempted)

        # Preemptions: only running requests; they go back to waiting with no blocks.
        for rid in preempted:
            assert rid in self.running, f"preempted {rid}, which was not running"
            assert s.is_waiting(rid), f"preempted {rid} is not waiting"
            assert not self.blocks.block_table(rid), f"preempted {rid} kept its blocks"
            self.running.discard(rid)
            self.computed.pop(rid)
            self.preemptions += 1

        # Admissions: from the waiting queue, prefilled from position 0, or, with the prefix
        # cache, from a block boundary before the last position, whose cached slots hold exactly
        # this request's tokens (a shared block read by the wrong request changes its output).
        admitted = [c.id for c in chunks if c.id not in self.running]
        for rid in admitted:
            assert rid in waiting_before, f"{rid} scheduled without being admitted"
            assert not s.is_waiting(rid)
            self.running.add(rid)
            start = next(c.start for c in chunks if c.id == rid)
            toks = s.tokens(rid) or ()
            if not self.prefix_cache:
                assert start == 0, f"{rid} admitted at {start} without a prefix cache"
            assert start % self.block_size == 0 and start < len(toks), (rid, start)
            for p in range(start):
                assert self.model.read(rid, p) == toks[p], f"{rid}: cached position {p} is stale"
            self.computed[rid] = start

        # Caps (§1).
        assert len(scheduled) <= cfg.max_num_seqs, (
            f"{len(scheduled)} sequences > max_seqs {cfg.max_num_seqs}"
        )
        assert len(self.running) <= cfg.max_num_seqs
        assert s.stats().running == len(self.running)
        assert plan.num_tokens == len(decode) + sum(c.len for c in chunks)
        assert plan.num_tokens <= cfg.max_num_batched_tokens, (
            f"plan has {plan.num_tokens} tokens > max_batch_tokens {cfg.max_num_batched_tokens}"
        )

        # Positions: decodes feed position n - 1, chunks start at the computed positions.
        B = self.block_size
        for rid in decode:
            toks = s.tokens(rid)
            assert toks is not None
            assert self.computed[rid] == len(toks) - 1, f"decode of {rid} is not at n - 1"
            assert len(self.blocks.block_table(rid)) * B >= len(toks), f"table of {rid} too short"
        for c in chunks:
            toks = s.tokens(c.id)
            assert toks is not None
            assert c.len >= 1, f"empty chunk {c}"
            assert c.start == self.computed[c.id], (
                f"chunk {c} does not start at {self.computed[c.id]}"
            )
            assert c.last == (c.start + c.len == len(toks)), f"chunk {c}: wrong last flag"
            assert c.start + c.len <= len(toks)
            assert len(self.blocks.block_table(c.id)) * B >= c.start + c.len
        # What this step writes lands in blocks no other request holds (a shared block is never
        # written: it is another request's cache).
        refs = self.blocks.refs() if isinstance(self.blocks, ProbedPrefixCache) else {}
        writes = [(c.id, p) for c in chunks for p in range(c.start, c.start + c.len)]
        writes += [(r, len(s.tokens(r) or ()) - 1) for r in decode]
        for rid, p in writes:
            b = self.blocks.block_table(rid)[p // B]
            assert refs.get(b, 1) == 1, f"{rid} writes position {p} into shared block {b}"

        # Rank order (§2, §5): decodes best first; victims rank below everything scheduled;
        # admissions are a prefix of the waiting queue (no skipping ahead).
        ranks = [self.rank(r) for r in decode]
        assert ranks == sorted(ranks), f"decodes out of rank order: {decode}"
        if preempted and scheduled:
            assert max(self.rank(r) for r in scheduled) < min(self.rank(r) for r in preempted), (
                f"victims {preempted} outrank scheduled requests {scheduled}"
            )
        still_waiting = self.waiting()
        if admitted and still_waiting:
            assert max(self.rank(r) for r in admitted) < min(self.rank(r) for r in still_waiting), (
                f"admitted {admitted} ahead of better-ranked waiting requests"
            )

        # Nothing left undone that the phases would have done (the plan is maximal).
        budget_left = cfg.max_num_batched_tokens - plan.num_tokens
        idle = [r for r in self.running if r not in scheduled]
        if idle:
            assert budget_left <= 0, f"running {idle} not scheduled with {budget_left} tokens left"
        if still_waiting and len(self.running) < cfg.max_num_seqs and budget_left > 0:
            head = min(still_waiting, key=self.rank)
            toks = s.tokens(head) or ()
            n = len(toks)
            if isinstance(self.blocks, ProbedPrefixCache):
                cached = min(self.blocks.cached_prefix(toks), n - 1)
                fits = self.blocks.fits(toks)
            else:
                cached, fits = 0, blocks_for(n, B) <= self.blocks.free_blocks
            take = self.policy.chunk_len(n - cached, budget_left, plan.is_empty)
            if take > 0 and head not in preempted:  # a victim waits at least one step
                assert not fits, (
                    f"waiting head {head} fits ({blocks_for(n, B)} blocks, {cached} positions "
                    f"cached, {self.blocks.free_blocks} free, {budget_left} tokens left) but was "
                    "not admitted"
                )
        self.check_blocks()

    def check_blocks(self) -> None:
        """Only running requests hold blocks; a block is in two tables only when it is a named
        (cached) block, and then at the same position of both; reference counts equal the
        tables holding each block; free + cached + used = total."""
        holders: dict[int, list[tuple[RequestId, int]]] = {}
        for rid in self.meta:
            table = self.blocks.block_table(rid)
            if rid not in self.running:
                assert not table, f"request {rid} holds {list(table)} but is not running"
            for i, b in enumerate(table):
                assert 0 <= b < self.total_blocks, f"block id {b} out of range"
                holders.setdefault(b, []).append((rid, i))
        if isinstance(self.blocks, ProbedPrefixCache):
            named = self.blocks.named_blocks()
            refs = self.blocks.refs()
            for b, held in holders.items():
                assert refs.get(b) == len(held), f"block {b}: {refs.get(b)} refs, held by {held}"
                if len(held) > 1:
                    assert b in named, f"unnamed block {b} in several tables: {held}"
                    assert len({i for _, i in held}) == 1, f"block {b} at two positions: {held}"
            assert set(refs) == set(holders), "references to blocks no table holds"
            free = self.blocks.free_blocks - self.blocks.cached_blocks
            assert free + self.blocks.cached_blocks + len(holders) == self.total_blocks, (
                f"free {free} + cached {self.blocks.cached_blocks} + used {len(holders)} != "
                f"total {self.total_blocks}"
            )
        else:
            for b, held in holders.items():
                assert len(held) == 1, f"block {b} in two block tables: {held}"
            assert self.blocks.free_blocks + len(holders) == self.total_blocks, (
                f"free {self.blocks.free_blocks} + used {len(holders)} != total {self.total_blocks}"
            )
        assert s_running(self.s) == self.running, "scheduler's running set differs from the plans"

    def _take_events(self, events: Sequence[TokenEvent | FinishedEvent]) -> None:
        for e in events:
            assert e.id not in self.reasons, f"event {e} after {e.id} finished"
            assert e.id not in self.aborted, f"event {e} after {e.id} was aborted"
            if isinstance(e, TokenEvent):
                self.tokens[e.id].append(e.token)
            else:
                self.reasons[e.id] = e.reason
                self.running.discard(e.id)
                self.computed.pop(e.id, None)
                assert not self.blocks.block_table(e.id), f"finished {e.id} kept its blocks"
                assert self.s.tokens(e.id) is None

    def check_outputs(self) -> None:
        """Every request's tokens are exactly the fake model's; aborted ones got a prefix."""
        ctx = self.cfg.max_model_len
        for rid, m in self.meta.items():
            want, reason = expected_output(m.prompt, m.max_tokens, ctx, self.stop_token)
            got = self.tokens[rid]
            if rid in self.aborted:
                assert got == want[: len(got)], f"aborted {rid}: {got} is not a prefix of {want}"
                assert rid not in self.reasons, f"aborted {rid} also finished"
            else:
                assert got == want, f"request {rid}: got {got}, want {want}"
                assert self.reasons.get(rid) == reason, f"request {rid}: {self.reasons.get(rid)}"

    def check_done(self) -> None:
        """Nothing unfinished and every block back in the pool."""
        st = self.s.stats()
        assert not self.s.has_unfinished() and not self.s.unfinished()
        assert st.running == 0 and st.waiting == 0
        assert self.blocks.free_blocks == self.total_blocks, (
            f"{self.total_blocks - self.blocks.free_blocks} blocks leaked"
        )
        assert st.preemptions == self.preemptions
        self.check_outputs()


def s_running(s: Scheduler) -> set[RequestId]:
    """Requests the scheduler holds that are not waiting."""
    return {r for r in s.unfinished() if not s.is_waiting(r)}
