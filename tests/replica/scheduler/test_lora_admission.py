"""Admission with LoRA adapters (docs/scheduler.md, LoRA): a step holds at most ``max_loras``
adapters; requests of a running adapter (or of the base) pass a waiting request whose adapter has
no slot for ``lora_bypass_steps`` steps, then admission waits for its slot. Pure scheduler, no
model: every sampled token is 7 and nothing stops early."""

from __future__ import annotations

import pytest

from tierserve.replica.block_space import FreeListBlocks
from tierserve.replica.config import EngineConfig
from tierserve.replica.scheduler import (
    FinishedEvent,
    Request,
    RequestId,
    SampledToken,
    Scheduler,
)

PROMPT = [1, 2, 3, 4, 5]


def _scheduler(bypass: int, max_loras: int = 1, blocks: int = 200) -> Scheduler:
    cfg = EngineConfig(enable_lora=True, max_loras=max_loras, max_num_seqs=16,
                       max_model_len=256, prefill_chunk_tokens=None, lora_bypass_steps=bypass)
    return Scheduler(cfg, FreeListBlocks(4, range(blocks)))


def _step(s: Scheduler) -> tuple[set[RequestId], set[RequestId]]:
    """One step: (the requests admitted in it, those that finished)."""
    plan = s.schedule()
    admitted = {c.id for c in plan.prefill if c.cached_tokens is not None}
    sampled = [d.id for d in plan.decodes] + [c.id for c in plan.prefill if c.last]
    done = {e.id for e in s.on_step([SampledToken(r, 7) for r in sampled])
            if isinstance(e, FinishedEvent)}
    return admitted, done


def _running_adapters(s: Scheduler) -> set[str]:
    return {seq.lora for seq in s._running if seq.lora is not None}


def test_running_adapters_pass_a_head_without_a_slot() -> None:
    s = _scheduler(bypass=8)
    a1 = s.add(Request(PROMPT, 20, lora="a"))
    b1 = s.add(Request(PROMPT, 4, lora="b"))
    a2 = s.add(Request(PROMPT, 4, lora="a"))
    base = s.add(Request(PROMPT, 4))
    c1 = s.add(Request(PROMPT, 4, lora="c"))
    admitted, _ = _step(s)
    # b1 and c1 wait (one slot, a's), a2 and the base request pass them.
    assert admitted == {a1, a2, base}
    assert _running_adapters(s) == {"a"}
    # The ones passed keep their place: b1 is still first in line.
    head = s._waiting.peek()
    assert head is not None and head.id == b1
    assert {q.id for q in s._waiting.items()} == {b1, c1}


def test_bypass_zero_keeps_strict_rank_order() -> None:
    s = _scheduler(bypass=0)
    a1 = s.add(Request(PROMPT, 3, lora="a"))
    b1 = s.add(Request(PROMPT, 3, lora="b"))
    a2 = s.add(Request(PROMPT, 3, lora="a"))
    base = s.add(Request(PROMPT, 3))
    order: list[set[RequestId]] = []
    for _ in range(30):
        admitted, _ = _step(s)
        if admitted:
            order.append(admitted)
    # Nothing passes b1: it starts once a1 is done; a2 then waits for b's slot, and the base
    # request behind it waits too.
    assert order == [{a1}, {b1}, {a2, base}]


def test_the_bound_stops_the_bypass_and_the_head_gets_its_slot() -> None:
    """Requests of adapter a keep coming: they pass b1 for ``bypass`` steps, then wait behind
    it; a's running requests drain, b1 takes the slot, and only then does a run again."""
    bypass = 5
    s = _scheduler(bypass=bypass)
    s.add(Request(PROMPT, 6, lora="a"))
    b1 = s.add(Request(PROMPT, 3, lora="b"))
    arrivals: dict[RequestId, int] = {}
    admitted_at: dict[RequestId, int] = {}
    finished: set[RequestId] = set()
    for step in range(60):
        arrivals[s.add(Request(PROMPT, 6, lora="a"))] = step
        admitted, done = _step(s)
        for r in admitted:
            admitted_at[r] = step
        finished |= done
        assert len(_running_adapters(s)) <= 1
        if b1 in finished:
            break
    assert b1 in admitted_at, "b1 starved"
    b_start = admitted_at[b1]
    # Requests of a passed b1 during the first ``bypass`` steps, and none past the bound.
    passed = [r for r, t in admitted_at.items() if r in arrivals and t < b_start]
    assert passed and all(arrivals[r] < bypass for r in passed)
    # a's requests that came after the bound waited for b1: none ran beside it or before it.
    late = [r for r, t in arrivals.items() if t >= bypass]
    assert all(admitted_at.get(r, b_start + 1) > b_start for r in late)
    # b1 started once the last a request admitted before the bound had finished.
    assert b_start <= bypass + 6 + 2


def test_no_adapter_starves_and_no_block_leaks_with_the_bypass() -> None:
    s = _scheduler(bypass=3, max_loras=2, blocks=60)
    names = [None, "a", "b", "c", "a", "d", None, "c", "b", "d", "e", "a", "a", None, "e"]
    ids = {s.add(Request(PROMPT, 3 + i % 5, lora=n)): n for i, n in enumerate(names)}
    left = set(ids)
    for step in range(300):
        if not left:
            break
        if step % 2 == 0 and step < 40:  # a steady flow of a's requests
            rid = s.add(Request(PROMPT, 4, lora="a"))
            ids[rid] = "a"
            left.add(rid)
        _, done = _step(s)
        left -= done
        assert len(_running_adapters(s)) <= 2
    assert not left  # every request ran to its end
    assert s.stats().free_blocks == s.stats().total_blocks
    assert not s._waiting and not s._running


def test_aborting_a_passed_request_leaves_nothing_behind() -> None:
    s = _scheduler(bypass=4)
    s.add(Request(PROMPT, 8, lora="a"))
    b1 = s.add(Request(PROMPT, 3, lora="b"))
    s.add(Request(PROMPT, 3, lora="a"))
    _step(s)
    assert s.abort(b1)
    for _ in range(30):
        _step(s)
    assert s.stats().free_blocks == s.stats().total_blocks
    assert not s._waiting and not s._running


def test_bypass_steps_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="lora_bypass_steps"):
        EngineConfig(enable_lora=True, lora_bypass_steps=-1)


def test_the_stats_count_the_running_adapters() -> None:
    s = _scheduler(bypass=4, max_loras=2)
    assert s.engine_stats().lora_adapters_running == 0
    s.add(Request(PROMPT, 5, lora="a"))
    s.add(Request(PROMPT, 5, lora="a"))
    s.add(Request(PROMPT, 5, lora="b"))
    s.add(Request(PROMPT, 5, lora="c"))
    s.add(Request(PROMPT, 5))
    _step(s)
    assert s.engine_stats().lora_adapters_running == 2  # a and b; c waits, the base not counted
    # Without enable_lora the count is not taken (always 0).
    plain = Scheduler(EngineConfig(max_model_len=256, prefill_chunk_tokens=None),
                      FreeListBlocks(4, range(50)))
    plain.add(Request(PROMPT, 5))
    _step(plain)
    assert plain.engine_stats().lora_adapters_running == 0
