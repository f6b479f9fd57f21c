"""Chunked prefill as a PrefillPolicy (docs/scheduler.md §2, phase 2)."""

from __future__ import annotations

import pytest

from tests.replica.fake_model import expected_output, request
from tests.replica.scheduler.harness import Sim, caps
from tierserve.replica.prefill_policy import Chunked, PrefillPolicy, WholePrompt
from tierserve.replica.scheduler import Chunk, Request

CTX = 128


def sim(
    policy: PrefillPolicy,
    *,
    total: int = 64,
    block_size: int = 4,
    max_seqs: int = 8,
    max_batch_tokens: int = 64,
) -> Sim:
    cfg = caps(
        max_seqs=max_seqs, max_batch_tokens=max_batch_tokens, max_waiting=64, max_model_len=CTX
    )
    return Sim(cfg, total, block_size, policy)


def chunks_of(s: Sim, rid: int) -> list[Chunk]:
    return [c for plan in s.plans for c in plan.prefill if c.id == rid]


@pytest.mark.parametrize("k", [1, 3, 4, 7, 18, 40])
def test_long_prompt_is_cut_into_chunks_of_at_most_chunk_tokens(k: int) -> None:
    s = sim(Chunked(k))
    rid = s.add(request(18, 2, seed=1))
    s.run()
    s.check_done()
    chunks = chunks_of(s, rid)
    assert all(1 <= c.len <= k for c in chunks)
    # Contiguous from 0. The prompt's last position is fed as a decode when only one is left
    # (§1: a request with n - c = 1 is decoding), else by a last chunk.
    assert [c.start for c in chunks] == [sum(c.len for c in chunks[:i]) for i in range(len(chunks))]
    fed = sum(c.len for c in chunks)
    assert fed in (17, 18)
    assert [c.last for c in chunks] == [False] * (len(chunks) - 1) + [fed == 18]
    assert len(chunks) == -(-17 // k)  # chunks go on while more than one position is left
    assert s.tokens[rid] == expected_output(request(18, 2, seed=1).prompt, 2, CTX)[0]


def test_running_decode_keeps_running_every_step_while_a_long_prompt_prefills() -> None:
    s = sim(Chunked(8), max_batch_tokens=9)
    d = s.add(request(2, 30, seed=1))
    s.step()  # d prefilled, decoding from now on
    long = s.add(request(60, 3, seed=2))
    prefill_steps = 0
    while s.s.tokens(long) is not None and not s.tokens[long]:
        plan = s.step()
        assert plan.decode == [d], "the decode runs every step: its TPOT is not stalled"
        assert [c.id for c in plan.prefill] == [long] and plan.prefill[0].len <= 8
        assert plan.num_tokens <= 9
        prefill_steps += 1
    assert prefill_steps == 8  # 60 tokens, 8 at a time
    s.run()
    s.check_done()


@pytest.mark.parametrize("k", [1, 2, 5, 16])
def test_chunked_outputs_equal_whole_prompt(k: int) -> None:
    reqs = [request(p, mt, seed=i) for i, (p, mt) in enumerate([(17, 5), (3, 9), (30, 2), (8, 8)])]

    def outputs(policy: PrefillPolicy, mbt: int) -> list[list[int]]:
        s = sim(policy, max_batch_tokens=mbt, total=48)
        ids = [s.add(r) for r in reqs]
        s.run()
        s.check_done()
        return [s.tokens[r] for r in ids]

    whole = outputs(WholePrompt(), 64)
    assert outputs(Chunked(k), 12) == whole
    assert whole == [expected_output(r.prompt, r.max_tokens, CTX)[0] for r in reqs]


def test_chunked_respects_the_remaining_budget() -> None:
    s = sim(Chunked(16), max_batch_tokens=10)
    running = [s.add(request(2, 20, seed=i)) for i in range(3)]
    s.step()
    a = s.add(request(20, 1, seed=7))
    b = s.add(request(20, 1, seed=8))
    plan = s.step()
    assert plan.decode == running
    assert plan.prefill == [Chunk(a, 0, 7, False)], "3 decodes leave 7 of 10; b gets nothing"
    plan = s.step()
    # Phase 2 first (a's next chunk from what is left), then phase 3 (b) from the remainder.
    assert plan.prefill == [Chunk(a, 7, 7, False)]
    assert s.s.is_waiting(b)
    plan = s.step()
    assert plan.prefill == [Chunk(a, 14, 6, True), Chunk(b, 0, 1, False)]
    assert plan.num_tokens == 10
    s.run()
    s.check_done()


def test_chunk_of_a_preempted_request_restarts_at_zero() -> None:
    # 6 blocks of 4. A (3 + 14) outranks V (10 + 12); when A needs its third block, V goes.
    s = sim(Chunked(4), total=6, max_seqs=2, max_batch_tokens=16)
    a = s.add(request(3, 14, seed=1))
    v = s.add(Request(request(10, 12, seed=2).prompt, 12))
    preempted_at = None
    while s.s.has_unfinished():
        plan = s.step()
        if v in plan.preempted:
            preempted_at = len(s.plans)
            generated = len(s.tokens[v])
            assert generated > 0, "it was preempted after it had generated tokens"
            break
    assert preempted_at is not None, "the pool must force a preemption"
    assert a not in plan.preempted
    s.run()
    s.check_done()
    after = [c for plan in s.plans[preempted_at:] for c in plan.prefill if c.id == v]
    assert after[0].start == 0, "the recompute starts at position 0"
    assert all(c.len <= 4 for c in after)
    # The recompute covers the prompt and every token generated before the preemption.
    fed = sum(c.len for c in after[: next(i for i, c in enumerate(after) if c.last) + 1])
    assert fed == 10 + generated
