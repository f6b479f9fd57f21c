"""The simulated replica's engine (SimCore), without Ray."""

from __future__ import annotations

import pytest

from router.sim import SimCore, StepModel


def run_to_end(core: SimCore, limit: int = 10_000) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for _ in range(limit):
        if not core.has_work:
            return out
        _, events = core.step()
        for id, token, _done in events:
            out.setdefault(id, []).append(token)
        assert 0 <= core.free_blocks <= core.total_blocks
    raise AssertionError("did not finish")


def test_admission_by_free_blocks_and_stats() -> None:
    core = SimCore(total_blocks=10, block_tokens=16)
    a = core.add(prompt_tokens=63, max_tokens=4)  # 4 blocks at admission
    b = core.add(prompt_tokens=63, max_tokens=4)
    c = core.add(prompt_tokens=63, max_tokens=4)
    _, first = core.step()
    assert [e[0] for e in first] == [a, b]
    s = core.stats(now=5.0)
    assert (s.running, s.waiting, s.free_blocks) == (2, 1, 2)
    assert s.waiting_blocks == 4 and s.report_time == 5.0 and s.total_blocks == 10
    tokens = run_to_end(core)
    assert {k: len(v) for k, v in tokens.items()} == {a: 3, b: 3, c: 4}
    assert core.stats(0).free_blocks == 10


def test_higher_priority_is_admitted_first() -> None:
    core = SimCore(total_blocks=4, block_tokens=16)
    low = core.add(63, 1, priority=0)
    high = core.add(63, 1, priority=5)
    _, events = core.step()
    assert [e[0] for e in events] == [high]
    _, events = core.step()
    assert [e[0] for e in events] == [low]


def test_decodes_out_of_blocks_preempt_the_lowest_ranked() -> None:
    # Two requests fill the pool exactly; the first decode that needs a new block preempts.
    core = SimCore(total_blocks=4, block_tokens=16)
    core.add(30, 8)  # 2 blocks (31 positions), grows past 32
    core.add(30, 8)
    tokens = run_to_end(core)
    assert core.preemptions >= 1
    assert sorted(len(v) for v in tokens.values()) == [8, 8]


def test_step_time_grows_with_tokens() -> None:
    core = SimCore(total_blocks=100, model=StepModel(base_s=0.01, per_token_s=0.001))
    core.add(100, 2)
    prefill, _ = core.step()
    decode, _ = core.step()
    assert prefill == pytest.approx(0.01 + 0.1)
    assert decode == pytest.approx(0.011)


def test_refuses_what_never_fits_and_a_full_queue() -> None:
    core = SimCore(total_blocks=4, block_tokens=16, max_waiting=1)
    with pytest.raises(ValueError, match="needs 5 blocks"):
        core.add(60, 10)
    core.add(10, 1)
    with pytest.raises(ValueError, match="queue is full"):
        core.add(10, 1)


def test_abort_frees_blocks() -> None:
    core = SimCore(total_blocks=8)
    a = core.add(63, 50)
    core.step()
    assert core.free_blocks == 4
    core.abort(a)
    assert core.free_blocks == 8 and not core.has_work
