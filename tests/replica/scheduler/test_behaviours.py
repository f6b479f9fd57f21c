"""The scheduler's behaviours (docs/scheduler.md), one test each.

Driven by tests/replica/fake_model.py: every output is known in advance (``expected_output``), and a wrong
block table, a shared block or a wrong recompute changes it.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.replica.fake_model import FakeModel, drive, expected_output, request
from tests.replica.scheduler.harness import Sim, blocks_for, caps
from tierserve.replica.block_space import FreeListBlocks, NoCapacity
from tierserve.replica.scheduler import (
    AdmitError,
    Chunk,
    EmptyPrompt,
    FinishedEvent,
    FinishReason,
    NeverFits,
    QueueFull,
    Request,
    SchedPolicy,
    Scheduler,
    TokenEvent,
    TooLong,
)

PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def make(
    total_blocks: int,
    block_size: int = 4,
    *,
    max_seqs: int = 8,
    max_batch_tokens: int = 64,
    max_waiting: int = 64,
    policy: SchedPolicy = SchedPolicy.FCFS,
    aging_steps: int = 0,
    max_model_len: int = 64,
    stop_token: int | None = None,
) -> tuple[Scheduler, FakeModel]:
    """A scheduler over a free list of ``total_blocks`` blocks, and the fake model that runs it."""
    cfg = caps(
        max_seqs=max_seqs,
        max_batch_tokens=max_batch_tokens,
        max_waiting=max_waiting,
        policy=policy,
        aging_steps=aging_steps,
        max_model_len=max_model_len,
    )
    s = Scheduler(cfg, FreeListBlocks(block_size, range(total_blocks)))
    return s, FakeModel(s, stop_token=stop_token)


# ---------------------------------------------------------------------- hand_example_schedule


def test_hand_example_schedule() -> None:
    """docs/scheduler.md §7: B = 4, six blocks, budget 8, max_seqs 2, FCFS; A 5+3, B 3+2, C 2+1."""
    s, m = make(6, 4, max_seqs=2, max_batch_tokens=8)
    reqs = {"A": request(5, 3, seed=1), "B": request(3, 2, seed=2), "C": request(2, 1, seed=3)}
    a, b, c = (s.add(r) for r in reqs.values())
    table = s.blocks.block_table

    # Step 1: A (blocks 0, 1) and B (block 2) admitted whole; max_seqs holds C back.
    plan, ev = m.step()
    assert plan.prefill == [Chunk(a, 0, 5, True), Chunk(b, 0, 3, True)]
    assert plan.decode == [] and plan.preempted == []
    assert list(table(a)) == [0, 1] and list(table(b)) == [2] and list(table(c)) == []
    assert s.is_waiting(c)
    assert [len(s.tokens(r) or ()) for r in (a, b)] == [6, 4]
    assert not [e for e in ev if isinstance(e, FinishedEvent)]

    # Step 2: A and B decode; 6 tokens of budget left but max_seqs = 2 holds C back; B ends.
    plan, ev = m.step()
    assert plan.decode == [a, b] and plan.prefill == []
    assert s.is_waiting(c) and s.stats().running == 1
    assert FinishedEvent(b, FinishReason.LENGTH) in ev
    assert list(table(b)) == [] and s.blocks.free_blocks == 4

    # Step 3: A decodes, C is admitted into block 2 (B's); A and C both end; all is free.
    plan = s.schedule()
    assert plan.decode == [a] and plan.prefill == [Chunk(c, 0, 2, True)]
    assert list(table(a)) == [0, 1] and list(table(c)) == [2]
    ev = s.on_step(m.run(plan))
    assert {e for e in ev if isinstance(e, FinishedEvent)} == {
        FinishedEvent(a, FinishReason.LENGTH),
        FinishedEvent(c, FinishReason.LENGTH),
    }
    assert not s.has_unfinished() and s.blocks.free_blocks == 6

    # Later, same pool (§2: no skipping ahead): a head that does not fit stops
    # admission; a smaller request behind it that would fit waits too.
    e = s.add(request(8, 16, seed=4))  # grows to 24 positions: all six blocks
    while len(table(e)) < 5:
        m.step()
    d = s.add(request(5, 1, seed=5))  # 2 blocks, 1 free
    f = s.add(request(2, 1, seed=6))  # 1 block: it would fit
    plan, _ = m.step()
    assert plan.decode == [e] and plan.prefill == []
    assert s.is_waiting(d) and s.is_waiting(f), "no skipping ahead"
    while s.is_waiting(d):
        plan, _ = m.step()
        assert not s.is_waiting(d) or s.is_waiting(f)
    drive(s, m)
    assert s.blocks.free_blocks == 6


# ---------------------------------------------------------------------- free_list_is_all_or_nothing


def test_free_list_is_all_or_nothing() -> None:
    fl = FreeListBlocks(4, [5, 0, 3, 1, 4, 2])
    fl.allocate(1, [7] * 5)  # 2 blocks
    assert list(fl.block_table(1)) == [0, 1], "lowest ids first"
    with pytest.raises(NoCapacity):
        fl.allocate(2, [7] * 17)  # 5 blocks, 4 free
    assert fl.free_blocks == 4 and list(fl.block_table(2)) == [], "no partial allocation"
    fl.allocate(2, [7] * 13)  # 4 blocks
    assert list(fl.block_table(2)) == [2, 3, 4, 5]
    with pytest.raises(NoCapacity):
        fl.append_slot(1, 9)  # a third block, none free
    assert list(fl.block_table(1)) == [0, 1], "append_slot changes nothing when it fails"
    fl.release(1)
    fl.allocate(3, [7])
    assert list(fl.block_table(3)) == [0], "released ids come back lowest first"

    # Through the scheduler: a request that does not fit holds nothing while it waits.
    s, m = make(3, 4, max_model_len=16)
    big_running = s.add(request(5, 4))  # 2 blocks now
    m.step()
    waiting = s.add(request(6, 1))  # needs 2 blocks, 1 free
    m.step()
    assert s.is_waiting(waiting) and list(s.blocks.block_table(waiting)) == []
    assert s.blocks.free_blocks == 3 - len(s.blocks.block_table(big_running))


# ---------------------------------------------------------------------- every_request_finishes...


@st.composite
def seed_workloads(draw: st.DrawFn) -> dict[str, Any]:
    B = draw(st.integers(1, 4))
    ctx = draw(st.integers(4, 24))
    reqs = draw(
        st.lists(
            st.tuples(
                st.integers(0, 8),  # arrival step
                st.integers(1, ctx - 1),  # prompt length
                st.integers(1, 12),  # max_tokens
                st.integers(0, 3),  # priority
            ),
            min_size=1,
            max_size=12,
        )
    )
    need = max(blocks_for(min(p + m, ctx), B) for _, p, m, _ in reqs)
    return {
        "B": B,
        "ctx": ctx,
        "reqs": reqs,
        "total": draw(st.integers(need, need + 3)),  # small: forces preemption
        "max_seqs": draw(st.integers(1, 6)),
        "mbt": draw(st.integers(ctx, ctx + 12)),  # WholePrompt: a prompt always fits alone
        "policy": draw(st.sampled_from(SchedPolicy)),
        "aging": draw(st.integers(0, 5)),
    }


@PROPERTY
@given(seed_workloads())
def test_every_request_finishes_and_no_block_leaks(w: dict[str, Any]) -> None:
    cfg = caps(
        max_seqs=w["max_seqs"],
        max_batch_tokens=w["mbt"],
        max_waiting=100,
        policy=w["policy"],
        aging_steps=w["aging"],
        max_model_len=w["ctx"],
    )
    sim = Sim(cfg, w["total"], w["B"])
    last = max(r[0] for r in w["reqs"])
    for t in range(last + 1):
        for i, (arrival, p, mt, prio) in enumerate(w["reqs"]):
            if arrival == t:
                sim.add(request(p, mt, prio, seed=i))
        sim.step()  # checks caps, tables and positions every step
    sim.run()
    sim.check_done()  # exact outputs, nothing unfinished, every block free


# ---------------------------------------------------------------------- priority_runs_first


@pytest.mark.parametrize("aging", [0, 50])
def test_priority_runs_first(aging: int) -> None:
    prios = [1, 5, 3, 5, 0]

    def admission_order(policy: SchedPolicy) -> list[int]:
        s, m = make(64, max_seqs=1, policy=policy, aging_steps=aging)
        ids = [s.add(request(3, 1, p, seed=i)) for i, p in enumerate(prios)]
        order = []
        while s.has_unfinished():
            plan, _ = m.step()
            order += [ids.index(c.id) for c in plan.prefill]
        return order

    assert admission_order(SchedPolicy.PRIORITY) == [1, 3, 2, 0, 4], "higher priority first"
    assert admission_order(SchedPolicy.FCFS) == [0, 1, 2, 3, 4], "FCFS: arrival order"


# ---------------------------------------------------------------------- aging_bounds_the_wait


def _low_priority_wait(
    P: int, A: int, low_prio: int, m: int, lead: int, horizon: int
) -> int | None:
    """Steps a priority-``low_prio`` request waits under a steady stream of ``low_prio + P`` ones.

    One high-priority arrival per step, each running ``m`` steps, ``max_seqs = m``: in the steady
    state exactly one slot frees per step, so the stream alone keeps the batch full.
    """
    s, model = make(
        256,
        max_seqs=m,
        max_waiting=10_000,
        policy=SchedPolicy.PRIORITY,
        aging_steps=A,
    )
    low = None
    for t in range(horizon):
        if t == lead:
            low = s.add(request(3, 1, low_prio, seed=999))
        s.add(request(2, m, low_prio + P, seed=t))
        plan, _ = model.step()
        if low is not None and low in [c.id for c in plan.prefill]:
            return t - lead
    return None


@PROPERTY
@given(
    P=st.integers(1, 6),
    A=st.integers(1, 8),
    low_prio=st.integers(-3, 3),
    m=st.integers(1, 3),
    extra_lead=st.integers(0, 5),
)
def test_aging_bounds_the_wait(P: int, A: int, low_prio: int, m: int, extra_lead: int) -> None:
    lead = m + extra_lead  # the stream has filled the batch before the low request arrives
    wait = _low_priority_wait(P, A, low_prio, m, lead, horizon=lead + P * A + 10)
    assert wait is not None, f"with aging {A}, priority gap {P}: the low request starved"
    assert P * A - 1 <= wait <= P * A + 1, f"waited {wait} steps, expected about P*A = {P * A}"

    # Strict priority (aging_steps = 0): the same stream starves it.
    s_wait = _low_priority_wait(P, 0, low_prio, m, lead, horizon=lead + 3 * P * A + 20)
    assert s_wait is None, f"without aging the low request ran after {s_wait} steps"


# ---------------------------------------------------------------------- preemption_recomputes...


def test_preemption_recomputes_and_keeps_outputs() -> None:
    reqs = [request(8, 14, seed=i) for i in range(4)]  # each grows to 22 positions: 6 blocks

    def run(total: int) -> tuple[dict[int, list[int]], Sim]:
        cfg = caps(max_seqs=4, max_batch_tokens=64, max_waiting=8, max_model_len=64)
        sim = Sim(cfg, total, 4)
        ids = [sim.add(r) for r in reqs]
        sim.run()
        sim.check_done()
        return {i: sim.tokens[r] for i, r in enumerate(ids)}, sim

    roomy, roomy_sim = run(64)
    tight, tight_sim = run(14)
    assert roomy_sim.preemptions == 0
    assert tight_sim.s.stats().preemptions > 0, "a 14-block pool must force preemption"
    assert tight == roomy
    for i, r in enumerate(reqs):
        assert tight[i] == expected_output(r.prompt, r.max_tokens, 64)[0]

    # The recompute prefills the prompt and every token generated before the preemption.
    recomputes = 0
    gen: dict[int, int] = {}
    preempted: set[int] = set()
    for plan in tight_sim.plans:
        for c in plan.prefill:
            if c.id in preempted:
                assert c.start == 0 and c.len == 8 + gen[c.id], "recompute prompt + generated"
                preempted.discard(c.id)
                recomputes += 1
            if c.last:
                gen[c.id] = gen.get(c.id, 0) + 1
        for rid in plan.decode:
            gen[rid] += 1
        preempted |= set(plan.preempted)
    assert recomputes > 0


# ---------------------------------------------------------------------- batched_greedy_equals...


def test_batched_greedy_equals_single_request() -> None:
    reqs = [
        request(3, 9, seed=1),
        request(7, 4, seed=2),
        request(1, 12, seed=3),
        request(5, 6, seed=4),
    ]

    def alone(r: Request) -> list[int]:
        s, m = make(32)
        rid = s.add(r)
        tokens, reasons = drive(s, m)
        assert reasons[rid] is FinishReason.LENGTH
        return tokens[rid]

    s, m = make(32)
    ids = [s.add(r) for r in reqs]
    tokens: dict[int, list[int]] = {rid: [] for rid in ids}
    batch: list[int] = []
    while s.has_unfinished():
        plan, events = m.step()
        batch.append(len(plan.decode) + len(plan.prefill))
        for e in events:
            if isinstance(e, TokenEvent):
                tokens[e.id].append(e.token)
    assert batch[:4] == [4, 4, 4, 4], "the four run batched"
    for rid, r in zip(ids, reqs, strict=True):
        assert tokens[rid] == alone(r) == expected_output(r.prompt, r.max_tokens, 64)[0]


# ---------------------------------------------------------------------- abort_frees_blocks...


def test_abort_frees_blocks_and_drops_waiting() -> None:
    s, m = make(8, 4, max_seqs=2)
    r0, r1, r2, r3 = (s.add(request(6, 20, seed=i)) for i in range(4))  # 2 blocks each
    m.step()
    assert s.stats().running == 2 and s.stats().waiting == 2
    assert s.blocks.free_blocks == 4

    # A running request: its blocks come back at once.
    assert s.abort(r0) is True
    assert list(s.blocks.block_table(r0)) == [] and s.blocks.free_blocks == 6
    # A waiting request: dropped from the queue, never scheduled.
    assert s.abort(r3) is True
    assert s.stats().waiting == 1 and r3 not in s.unfinished()
    assert s.abort(r0) is False and s.abort(r3) is False, "a second abort finds nothing"
    assert s.tokens(r0) is None and s.tokens(r3) is None

    # Between schedule and on_step (a client gone mid-step): no event, blocks back.
    plan = s.schedule()
    assert r1 in plan.decode and r2 in [c.id for c in plan.prefill]
    outs = m.run(plan)
    assert s.abort(r1) is True
    events = s.on_step(outs)
    assert all(e.id != r1 for e in events)
    assert list(s.blocks.block_table(r1)) == []

    _, reasons = drive(s, m)
    assert set(reasons) == {r2}
    assert s.blocks.free_blocks == 8 and not s.has_unfinished()


# ---------------------------------------------------------------------- decodes_count_against...


@pytest.mark.parametrize("prompt_len,admitted_now", [(6, False), (5, True)])
def test_decodes_count_against_the_budget(prompt_len: int, admitted_now: bool) -> None:
    s, m = make(64, max_seqs=8, max_batch_tokens=8)
    running = [s.add(request(2, 10, seed=i)) for i in range(3)]
    m.step()  # 3 prompts of 2 tokens: all three now decode
    new = s.add(request(prompt_len, 1, seed=9))
    plan, _ = m.step()
    assert plan.decode == running
    if admitted_now:
        assert plan.prefill == [Chunk(new, 0, 5, True)] and plan.num_tokens == 8
    else:
        assert plan.prefill == [], "3 decodes leave 5 tokens: a 6-token prompt waits"
        assert s.is_waiting(new) and plan.num_tokens == 3


# ---------------------------------------------------------------------- stop_finishes_with_stop


def test_stop_finishes_with_stop() -> None:
    r = request(4, 10, seed=5)
    free_run, _ = expected_output(r.prompt, 10, 64)
    other = request(3, 10, seed=6)
    for k in (0, 2):  # stop on the first token (from the prefill) and on a decode
        stop = free_run[k]
        assert stop not in free_run[:k]
        s, m = make(16, stop_token=stop)
        rid, oid = s.add(r), s.add(other)
        finished_at = None
        tokens: dict[int, list[int]] = {rid: [], oid: []}
        for step in range(20):
            if not s.has_unfinished():
                break
            plan, ev = m.step()
            assert finished_at is None or rid not in plan.decode, "scheduled after it stopped"
            for e in ev:
                if isinstance(e, TokenEvent):
                    tokens[e.id].append(e.token)
                elif e.id == rid:
                    assert e.reason is FinishReason.STOP
                    finished_at = step
                    assert s.tokens(rid) is None and list(s.blocks.block_table(rid)) == []
        assert finished_at == k, "finishes with Stop at once"
        assert tokens[rid] == free_run[: k + 1]
        assert tokens[oid] == expected_output(other.prompt, 10, 64, stop)[0], "others unaffected"
        assert s.blocks.free_blocks == 16

    # Stop wins over Length when both end on the same token.
    s, m = make(16, stop_token=free_run[2])
    rid = s.add(Request(r.prompt, 3))
    _, reasons = drive(s, m)
    assert reasons[rid] is FinishReason.STOP


# ---------------------------------------------------------------------- admission_refuses...


def test_admission_refuses_what_can_never_run() -> None:
    # Context 16, blocks of 4, a pool of 3 blocks (12 positions), at most 2 waiting.
    s, m = make(3, 4, max_model_len=16, max_waiting=2, max_seqs=1)

    with pytest.raises(EmptyPrompt) as e:
        s.add(Request([], 4))
    assert "empty" in str(e.value) and "at least one token" in str(e.value)

    with pytest.raises(TooLong) as e2:
        s.add(request(16, 1))
    assert (e2.value.tokens, e2.value.limit) == (16, 16)
    assert "16 tokens" in str(e2.value) and "context is 16" in str(e2.value)

    with pytest.raises(NeverFits) as e3:
        s.add(request(11, 2))  # could grow to 13 positions: 4 blocks > 3
    assert (e3.value.blocks, e3.value.total) == (4, 3)
    assert "4 KV blocks" in str(e3.value) and "holds only 3" in str(e3.value)
    with pytest.raises(NeverFits):
        s.add(request(15, 1))  # a legal prompt, but 16 positions need 4 blocks
    s.add(request(11, 1))  # exactly 12 positions: 3 blocks, fits

    # The longest sequence is capped by the context: huge max_tokens still fit a small context.
    s8, _ = make(2, 4, max_model_len=8)
    s8.add(request(4, 10_000))

    s.add(request(2, 1))  # the queue now holds 2
    with pytest.raises(QueueFull) as e4:
        s.add(request(2, 1))
    assert e4.value.limit == 2 and "full (2 requests)" in str(e4.value)
    assert isinstance(e4.value, AdmitError) and e4.value.reason == "queue_full"

    assert s.stats().rejected == {"empty": 1, "too_long": 1, "never_fits": 2, "queue_full": 1}
    assert s.stats().waiting == 2 and len(s.unfinished()) == 2, "refused requests are not queued"

    m.step()  # one admitted: the queue has room again
    s.add(request(2, 1))
    assert s.stats().waiting == 2
