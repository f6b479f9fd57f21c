"""Admission with LoRA adapters (docs/scheduler.md, LoRA): a step holds at most ``max_loras``
adapters; requests of a running adapter (or of the base) pass a waiting request whose adapter has
no slot, or is not loaded yet, for ``lora_bypass_steps`` steps, then admission waits for it. Pure
scheduler, no model: every sampled token is 7 and nothing stops early."""

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


def _flood(bypass: int, steps: int) -> tuple[Scheduler, set[RequestId]]:
    """Two slots; requests of a, b, c, d, e and the base queued, then a flood that never stops:
    every step one more request of a and one of b (the running adapters) and one of the base.
    Returns the scheduler after ``steps`` steps (or once the first requests are done, the
    flood then stopped and drained) and the first requests not finished."""
    s = _scheduler(bypass=bypass, max_loras=2, blocks=400)
    names = [None, "a", "b", "c", "a", "d", None, "c", "b", "d", "e", "a", "a", None, "e"]
    left = {s.add(Request(PROMPT, 3 + i % 5, lora=n)) for i, n in enumerate(names)}
    for _ in range(steps):
        if not left:
            break
        for n in ("a", "b", None):
            s.add(Request(PROMPT, 4, lora=n))
        _, done = _step(s)
        left -= done
        assert len(_running_adapters(s)) <= 2
    return s, left


def test_no_adapter_starves_under_a_flood_that_never_stops() -> None:
    """The flood keeps a and b running for ever: without the bound c, d and e would never get a
    slot (the control below); with it every first request ends, and once the flood stops and
    drains no block is held."""
    s, left = _flood(bypass=3, steps=400)
    assert not left  # every first request ran to its end, the flood going on meanwhile
    for _ in range(200):
        _step(s)
    assert not s._waiting and not s._running
    assert s.stats().free_blocks == s.stats().total_blocks


def test_without_the_bound_the_flood_starves_the_other_adapters() -> None:
    """The control of the test above: a bypass longer than the run lets the flood's requests
    pass c, d and e at every step, so they never start: what the bound prevents."""
    _, left = _flood(bypass=10**6, steps=150)
    assert left


def test_a_request_whose_adapter_is_not_loaded_waits_and_asks_for_it() -> None:
    """``lora_ready`` false (its load under way): the request is set aside as one without a slot
    (the base's requests pass it), asked for at each step, and admitted once it is loaded; past
    the bound admission stops at it."""
    s = _scheduler(bypass=2, max_loras=2)
    loaded: set[str] = set()
    asked: list[str] = []

    def ready(key: str) -> bool:
        asked.append(key)
        return key in loaded

    s.lora_ready = ready
    a1 = s.add(Request(PROMPT, 8, lora="a#1"))
    base = s.add(Request(PROMPT, 8))
    admitted, _ = _step(s)
    assert admitted == {base} and asked == ["a#1"]
    later = s.add(Request(PROMPT, 8))
    admitted, _ = _step(s)
    assert admitted == {later}  # passed a1 (bypass 2)
    stuck = s.add(Request(PROMPT, 8))
    for _ in range(3):
        admitted, _ = _step(s)
        assert a1 not in admitted and stuck not in admitted  # the bound: it waits behind a1
    loaded.add("a#1")
    admitted, _ = _step(s)
    assert admitted == {a1, stuck}
    assert s.running_adapters() == {"a#1"}


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
