"""The worked example of docs/scheduler.md §7, step by step, plus the two admission rules it
leans on (§2).

Blocks of 4 (ids 0 to 5), budget 8, max_seqs 2, FCFS. A: 5-token prompt, max_tokens 3; B: 3 and 2;
C: 2 and 1.
"""

from __future__ import annotations

from dataclasses import dataclass

from tests.replica.fake_model import FakeModel, expected_output, request
from tests.replica.scheduler.harness import caps
from tierserve.replica.block_space import FreeListBlocks
from tierserve.replica.prefill_policy import Chunked
from tierserve.replica.scheduler import (
    Chunk,
    FinishedEvent,
    FinishReason,
    RequestEvent,
    Scheduler,
    StepPlan,
    TokenEvent,
)

CTX = 64


@dataclass
class Example:
    s: Scheduler
    m: FakeModel
    a: int
    b: int
    c: int
    want: dict[int, list[int]]


def example(max_seqs: int = 2) -> Example:
    cfg = caps(max_seqs=max_seqs, max_batch_tokens=8, max_waiting=8, max_model_len=CTX)
    s = Scheduler(cfg, FreeListBlocks(4, range(6)))
    reqs = [request(5, 3, seed=1), request(3, 2, seed=2), request(2, 1, seed=3)]
    a, b, c = (s.add(r) for r in reqs)
    want = {
        rid: expected_output(r.prompt, r.max_tokens, CTX)[0]
        for rid, r in zip((a, b, c), reqs, strict=True)
    }
    return Example(s, FakeModel(s), a, b, c, want)


def tokens_of(events: list[RequestEvent]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for e in events:
        if isinstance(e, TokenEvent):
            out.setdefault(e.id, []).append(e.token)
    return out


def finishes(events: list[RequestEvent]) -> set[FinishedEvent]:
    return {e for e in events if isinstance(e, FinishedEvent)}


def step(ex: Example) -> tuple[StepPlan, list[RequestEvent]]:
    return ex.m.step()


def test_step1_admits_a_and_b_whole_and_max_seqs_holds_c_back() -> None:
    ex = example()
    plan, events = step(ex)
    # A needs ceil(5/4) = 2 blocks (0, 1), budget 8 -> 3; B needs 1 block (2), budget 3 -> 0.
    assert plan.prefill == [Chunk(ex.a, 0, 5, True), Chunk(ex.b, 0, 3, True)]
    assert plan.decode == [] and plan.preempted == [] and plan.num_tokens == 8
    t = ex.s.blocks.block_table
    assert (list(t(ex.a)), list(t(ex.b)), list(t(ex.c))) == ([0, 1], [2], [])
    assert ex.s.is_waiting(ex.c) and ex.s.stats().running == 2
    # Both last chunks are sampled: A has 6 tokens, B has 4.
    assert tokens_of(events) == {ex.a: ex.want[ex.a][:1], ex.b: ex.want[ex.b][:1]}
    assert (len(ex.s.tokens(ex.a) or ()), len(ex.s.tokens(ex.b) or ())) == (6, 4)
    assert (ex.s.computed(ex.a), ex.s.computed(ex.b)) == (5, 3)
    assert finishes(events) == set()


def test_step2_decodes_a_then_b_and_b_ends_with_length() -> None:
    ex = example()
    step(ex)
    plan, events = step(ex)
    # A needs room for 6 positions (its 2 blocks), B for 4 (its 1 block): no new block.
    assert plan.decode == [ex.a, ex.b] and plan.prefill == [] and plan.num_tokens == 2
    # 6 tokens of budget are left and C fits a free block, but max_seqs = 2 holds it back.
    assert ex.s.is_waiting(ex.c)
    assert tokens_of(events) == {ex.a: ex.want[ex.a][1:2], ex.b: ex.want[ex.b][1:2]}
    assert finishes(events) == {FinishedEvent(ex.b, FinishReason.LENGTH)}
    assert list(ex.s.blocks.block_table(ex.b)) == [] and ex.s.tokens(ex.b) is None
    assert list(ex.s.blocks.block_table(ex.a)) == [0, 1]
    assert ex.s.blocks.free_blocks == 4  # 2, 3, 4, 5


def test_step3_c_takes_block_2_and_everything_ends() -> None:
    ex = example()
    step(ex)
    step(ex)
    plan = ex.s.schedule()
    assert plan.decode == [ex.a] and plan.prefill == [Chunk(ex.c, 0, 2, True)]
    assert list(ex.s.blocks.block_table(ex.a)) == [0, 1], "7 positions still fit 2 blocks"
    assert list(ex.s.blocks.block_table(ex.c)) == [2], "C gets B's freed block, the lowest id"
    events = ex.s.on_step(ex.m.run(plan))
    assert tokens_of(events) == {ex.a: ex.want[ex.a][2:3], ex.c: ex.want[ex.c]}
    assert finishes(events) == {
        FinishedEvent(ex.a, FinishReason.LENGTH),
        FinishedEvent(ex.c, FinishReason.LENGTH),
    }
    st = ex.s.stats()
    assert (st.running, st.waiting, st.free_blocks, st.preemptions) == (0, 0, 6, 0)
    assert not ex.s.has_unfinished()
    assert ex.s.schedule().is_empty


def test_with_three_seqs_c_runs_at_step_2() -> None:
    """The contrast: it is max_seqs, not the budget or the pool, that holds C back at step 2."""
    ex = example(max_seqs=3)
    step(ex)
    assert ex.s.is_waiting(ex.c), "step 1: the budget (0 left) holds C back"
    plan = ex.s.schedule()
    assert plan.decode == [ex.a, ex.b] and plan.prefill == [Chunk(ex.c, 0, 2, True)]
    assert list(ex.s.blocks.block_table(ex.c)) == [3]  # block 2 is still B's


def test_head_that_does_not_fit_the_pool_stops_admission() -> None:
    """No skipping ahead: a small request behind a head that does not fit waits too (§2)."""
    cfg = caps(max_seqs=8, max_batch_tokens=64, max_waiting=8, max_model_len=CTX)
    s = Scheduler(cfg, FreeListBlocks(4, range(6)))
    m = FakeModel(s)
    x = s.add(request(12, 3, seed=1))  # 3 blocks, then a 4th for positions 13..
    m.step()
    big = s.add(request(13, 1, seed=2))  # 4 blocks: only 2 free
    small = s.add(request(2, 1, seed=3))  # 1 block: would fit
    plan, _ = m.step()
    assert plan.decode == [x] and plan.prefill == []
    assert s.is_waiting(big) and s.is_waiting(small), "the small one must not overtake the head"
    while s.is_waiting(big):
        plan, _ = m.step()
        assert not s.is_waiting(big) or s.is_waiting(small)
    assert big in [c.id for c in plan.prefill]


def test_head_that_does_not_fit_the_budget_stops_admission() -> None:
    cfg = caps(max_seqs=8, max_batch_tokens=8, max_waiting=8, max_model_len=CTX)
    s = Scheduler(cfg, FreeListBlocks(4, range(32)))
    m = FakeModel(s)
    for i in range(3):
        s.add(request(2, 3, seed=i))
    m.step()
    head = s.add(request(6, 1, seed=7))  # 3 decodes leave 5 tokens
    small = s.add(request(1, 1, seed=8))
    plan, _ = m.step()
    assert len(plan.decode) == 3 and plan.prefill == []
    assert s.is_waiting(head) and s.is_waiting(small)


def test_whole_prompt_alone_may_exceed_the_budget() -> None:
    """WholePrompt's exception: a prompt longer than the budget runs when the step is empty."""
    cfg = caps(max_seqs=4, max_batch_tokens=4, max_waiting=8, max_model_len=CTX)
    s = Scheduler(cfg, FreeListBlocks(4, range(32)))
    m = FakeModel(s)
    first = s.add(request(3, 2, seed=1))
    m.step()
    long = s.add(request(10, 1, seed=2))
    plan, _ = m.step()
    assert plan.decode == [first] and plan.prefill == [], "not alone: it waits"
    plan, _ = m.step()
    assert plan.prefill == [Chunk(long, 0, 10, True)] and plan.num_tokens == 10 > 4, "alone: runs"

    # Chunked prefill never needs the exception.
    s2 = Scheduler(cfg, FreeListBlocks(4, range(32)), Chunked(16))
    m2 = FakeModel(s2)
    s2.add(request(10, 1, seed=2))
    plan, _ = m2.step()
    assert plan.num_tokens == 4 and plan.prefill[0].len == 4
