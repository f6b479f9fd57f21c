"""The SLO step on its own (docs/scheduler.md §8): ``StepLimit`` driven directly, no scheduler.

Each test builds the requests' records and the queues a step would see and asks the hooks
what the phases of ``schedule()`` ask. The cost model has only its prior: 10 ms a step plus
1 ms a token, so a limit of 80 ms (a 100 ms target at ``slo_headroom`` 0.8) holds 70 tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from tierserve.replica.lazy_heap import LazyHeap
from tierserve.replica.prefill_policy import Chunked, PrefillPolicy
from tierserve.replica.scheduler import Request
from tierserve.replica.seq import Seq, Status
from tierserve.replica.step_cost import CostPrior, StepCostModel, StepShape, chunk_attention
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

PRIOR = CostPrior(base_s=0.01, per_token_s=0.001, per_sequence_s=0.0, per_pair_s=0.0)
LIMIT = 0.08  # 70 tokens
TOP = 0.1  # the strictest target: its requests are protected
LOW = 0.5
BLOCK = 4


def record(rid: int, prompt: int, *, target: float | None = None, priority: int = 0,
           computed: int | None = None, generated: int = 0,
           status: Status = Status.RUNNING) -> Seq:
    """A request's record: ``prompt`` positions plus ``generated`` tokens, ``computed`` of them
    computed (all but the newest by default: decoding), ranked by priority, then arrival."""
    seq = Seq(rid, Request(list(range(prompt)), 100, priority, tpot_target_s=target),
              (-priority, rid))
    seq.tokens += [7] * generated
    seq.computed = len(seq.tokens) - 1 if computed is None else computed
    seq.status = status
    return seq


def queue(*seqs: Seq) -> LazyHeap[Seq]:
    waiting: LazyHeap[Seq] = LazyHeap()
    for s in seqs:
        s.status = Status.WAITING
        s.computed = 0
        s.handle = waiting.push(s.rank, s)
    return waiting


class Burst:
    """L′ as the scheduler would work it out, counting how often it is asked."""

    def __init__(self, value: float) -> None:
        self.value = value
        self.calls = 0

    def __call__(self, limit: float, strict: float) -> float:
        self.calls += 1
        assert (limit, strict) == (LIMIT, TOP)
        return self.value


def step(running: Sequence[Seq] = (), waiting: LazyHeap[Seq] | None = None, *,
         policy: PrefillPolicy | None = None, burst: Burst | None = None) -> SloLimit:
    """The limit of a step that finds ``running`` (put in rank order) and ``waiting``: 80 ms
    for the 100 ms target, chunks of 64 unless ``policy`` says otherwise, a budget of 256
    tokens, and L′ = L unless ``burst`` says otherwise."""
    return SloLimit(LIMIT, TOP, StepCostModel(PRIOR), sorted(running, key=lambda s: s.rank),
                    waiting if waiting is not None else LazyHeap(), policy or Chunked(64), 256,
                    BLOCK, burst or Burst(LIMIT))


def tokens(n: int, sequences: int = 1) -> StepShape:
    """A step so far of ``n`` prompt positions (attention is free under PRIOR)."""
    return StepShape(n, sequences, 0.0)


# ---------------------------------------------------------------------- no limit


def test_without_a_limit_every_answer_is_section_2s() -> None:
    a, b = record(1, 8), record(2, 8, target=TOP)
    assert isinstance(NO_LIMIT, StepLimit)
    assert not NO_LIMIT.leaves_out(a, tokens(10_000), 9)
    assert NO_LIMIT.block_victim(a, b) is b  # the lowest-ranked running request
    assert NO_LIMIT.prefill_chunk(a, 64, tokens(10_000)) == 64
    assert NO_LIMIT.admissible(a, tokens(10_000), [(b, 1)], [b.id]) is a
    assert NO_LIMIT.seat_victim(a) is None
    assert NO_LIMIT.admit_chunk(a, 0, 64, tokens(10_000), [(b, 1)]) == 64
    assert NO_LIMIT.stalled() is None
    assert NO_LIMIT.close([(a, 1)]) is UNLIMITED
    assert (UNLIMITED.limit_s, UNLIMITED.strict, UNLIMITED.paused, UNLIMITED.decoding) == (
        None, None, 0, None)


# ---------------------------------------------------------------------- the reserve


def test_the_reserve_is_what_the_policy_gives_protected_prompts_at_most_three_quarters() -> None:
    """A protected prompt heading the queue, chunks of 64: 3/4 of the 70 tokens an empty step
    holds are kept (52); with chunks of 16, the 16 the policy would give it."""
    assert reserve_cap(StepCostModel(PRIOR), LIMIT, 256) == 52
    s = step(waiting=queue(record(1, 300, target=TOP)))
    assert s.reserve == StepShape(52, 1, chunk_attention(0, 52)) and s.kept == 52
    s = step(waiting=queue(record(1, 300, target=TOP)), policy=Chunked(16))
    assert s.reserve.tokens == 16 and s.kept == 16


def test_the_reserve_counts_protected_prefills_and_the_protected_head_only() -> None:
    """Two running protected prompts (5 and 6 positions left) and a protected head (3): 14.
    Decodes, lower tiers' prompts and a protected request behind a lower head keep nothing."""
    running = [record(1, 10, target=TOP, computed=5), record(2, 10, target=TOP, computed=4),
               record(3, 10, target=TOP), record(4, 300, target=LOW, computed=0)]
    s = step(running, queue(record(5, 3, target=TOP)))
    assert s.reserve.tokens == 5 + 6 + 3
    s = step(running[2:], queue(record(5, 3, target=TOP, priority=-1), record(6, 50)))
    assert s.reserve == StepShape() and s.kept == 0


# ---------------------------------------------------------------------- what is kept


def test_lower_tiers_are_timed_against_what_the_reserve_still_keeps() -> None:
    """A lower tier's chunk gets what the reserve leaves (70 - 52); once a protected chunk took
    64 positions (more than the 52 kept) nothing is kept, and a lower chunk gets what the step
    itself leaves (6)."""
    top, low = record(1, 300, target=TOP, computed=0), record(2, 300, target=LOW, computed=0)
    s = step([top, low], queue(record(3, 300, target=TOP)))
    assert s.kept == 52
    assert s.prefill_chunk(low, 64, StepShape()) == 18
    assert s.prefill_chunk(top, 64, StepShape()) == 64
    assert s.kept == 52 - 64
    assert s.prefill_chunk(low, 64, tokens(64)) == 6


def test_admitting_a_protected_head_spends_what_is_kept_for_it() -> None:
    head = record(1, 300, target=TOP)
    s = step(waiting=queue(head))
    assert s.kept == 52
    assert s.admit_chunk(head, 0, 64, StepShape(), []) == 64
    assert s.kept == 0


def test_decodes_of_lower_tiers_leave_the_reserve_free() -> None:
    """With 52 kept for a protected prompt a lower tier's decode is left out of a step that
    already carries 18 tokens (10 + 52 + 18 + 1 ms > 80 ms), not of one that carries 17; a
    protected decode never is."""
    low, top = record(1, 8, target=LOW), record(2, 8, target=TOP)
    s = step([low, top], queue(record(3, 300, target=TOP)))
    assert not s.leaves_out(low, tokens(17), 9)
    assert s.leaves_out(low, tokens(18), 9)
    assert not s.leaves_out(top, tokens(1000), 9)
    assert s.close([(top, 1)]).paused == 1


# ---------------------------------------------------------------------- the floor


def test_the_floor_gives_one_protected_prompt_a_blocks_worth_past_the_limit() -> None:
    """A step already at its limit: the first protected prompt gets a block's worth all the
    same, the second nothing (it is left out); a lower tier's prompt never gets the floor."""
    a, b = record(1, 40, target=TOP, computed=0), record(2, 40, target=TOP, computed=0)
    low = record(3, 40, target=LOW, computed=0)
    s = step([a, b, low])
    assert s.prefill_chunk(low, 32, tokens(70)) == 0
    assert s.prefill_chunk(a, 32, tokens(70)) == BLOCK
    assert s.prefill_chunk(b, 32, tokens(70)) == 0
    assert s.close([(a, BLOCK)]).paused == 2  # b and low, left out with their blocks


def test_a_protected_chunk_that_fits_uses_up_the_floor() -> None:
    a, b = record(1, 40, target=TOP, computed=0), record(2, 40, target=TOP, computed=0)
    s = step([a, b])
    assert s.prefill_chunk(a, 32, StepShape()) == 32
    assert s.prefill_chunk(b, 32, tokens(70)) == 0


# ---------------------------------------------------------------------- the burst


def test_protected_chunks_are_timed_against_the_burst_worked_out_once() -> None:
    """L′ = 200.5 ms: a protected chunk of 128 positions runs whole (138 ms) and the next one
    gets what is left of L′ (62); a lower tier's chunk is still held to L and the reserve.
    The burst is worked out once, when the first protected chunk is timed."""
    burst = Burst(0.2005)
    a, b = record(1, 300, target=TOP, computed=0), record(2, 300, target=TOP, computed=0)
    low = record(3, 300, target=LOW, computed=0)
    s = step([a, b, low], burst=burst)
    assert s.prefill_chunk(low, 64, StepShape()) == 70 - 52
    assert burst.calls == 0
    assert s.prefill_chunk(a, 128, StepShape()) == 128
    assert s.prefill_chunk(b, 128, tokens(128)) == 62
    assert burst.calls == 1
    assert s.prefill_chunk(low, 64, tokens(190)) == 0


def test_a_lower_tiers_chunk_never_asks_for_the_burst() -> None:
    burst = Burst(LIMIT)
    low = record(1, 300, target=LOW, computed=0)
    s = step([low], burst=burst)
    assert s.admit_chunk(low, 0, 64, StepShape(), []) == 64
    assert burst.calls == 0


# ---------------------------------------------------------------------- kept out, and victims


def test_left_out_decodes_are_the_first_victims_and_the_one_that_runs_anyway() -> None:
    """Lower tiers' decodes left out by a full step: a protected request that needs a block
    takes the lowest-ranked of them; a lower one only one ranked below it, else the bottom
    unless that is protected (then itself). With nothing planned, the best-ranked left-out
    decode runs anyway and is no longer counted."""
    top = record(1, 8, target=TOP, priority=10)
    hi, mid, lo = (record(i, 8, target=LOW, priority=5 - i) for i in (2, 3, 4))
    s = step([top, hi, mid, lo])
    for seq in (hi, mid, lo):
        assert s.leaves_out(seq, tokens(70), 9)
    assert s.block_victim(top, lo) is lo
    assert s.seat_victim(top) is lo
    assert s.block_victim(hi, top) is lo  # one left out that ranks below it
    assert s.seat_victim(lo) is None  # none ranks below it: it waits
    assert s.block_victim(lo, top) is lo  # the bottom is protected: lo waits itself
    lo.status = Status.PREEMPTED  # a victim of this step is no longer a candidate
    assert s.seat_victim(top) is mid
    assert s.stalled() is hi
    assert s.close([(hi, 1)]).paused == 1  # mid; lo was preempted


def test_a_protected_request_takes_from_the_bottom_not_protected() -> None:
    """Nobody left out: a protected request takes the lowest-ranked request not protected, even
    one ranked above it; another takes §2's bottom, unless that one is protected (then it
    waits itself) and never a seat."""
    old = record(1, 8, target=LOW, priority=20)
    top, other = record(2, 8, target=TOP, priority=10), record(3, 8, target=TOP, priority=9)
    s = step([old, top, other])
    assert s.seat_victim(top) is old and s.block_victim(top, other) is old
    assert s.block_victim(old, other) is old and s.seat_victim(old) is None
    tail = record(4, 8, priority=0)
    s = step([old, top, tail])
    assert s.block_victim(old, tail) is tail


# ---------------------------------------------------------------------- admission


def test_a_protected_request_passes_a_head_the_limit_refuses_once_a_step() -> None:
    """A lower head that does not fit (70 decodes planned): the best-ranked protected waiting
    request passes it, not one preempted this step, and only once a step."""
    plan = [(record(100 + i, 8, target=LOW), 1) for i in range(70)]
    head = record(1, 8, target=LOW, priority=9)
    top_a = record(2, 8, target=TOP, priority=5)
    top_b = record(3, 8, target=TOP, priority=4)
    waiting = queue(head, top_a, top_b)
    s = step([p for p, _ in plan], waiting)
    assert s.admissible(top_a, StepShape(), plan, ()) is top_a  # protected: no question
    assert s.admissible(head, tokens(70, 70), plan, [top_a.id]) is top_b
    assert s.admissible(head, tokens(70, 70), plan, []) is None
    fits = step([p for p, _ in plan[:10]], queue(record(1, 8, target=LOW, priority=9)))
    assert fits.admissible(head, tokens(10, 10), plan[:10], []) is head


def test_a_lower_request_is_admitted_only_if_the_decodes_to_come_fit() -> None:
    """Its chunk fits this step, but a step decoding the plan (69 requests) and it would not:
    it waits; a protected one is admitted all the same."""
    plan = [(record(100 + i, 8, target=LOW), 1) for i in range(69)]
    low, top = record(1, 8, target=LOW), record(2, 8, target=TOP)
    s = step([p for p, _ in plan])
    assert decoding(plan) == StepShape(69, 69, 8.0 * 69)
    assert s.admit_chunk(low, 0, 8, StepShape(), plan) == 8
    plan.append((record(200, 8, target=LOW), 1))
    assert s.admit_chunk(low, 0, 8, StepShape(), plan) == 0
    assert s.admit_chunk(top, 0, 8, StepShape(), plan) == 8


# ---------------------------------------------------------------------- the report


def test_the_report_carries_the_limit_and_the_plan_as_decodes() -> None:
    a, b = record(1, 8, target=TOP, generated=2), record(2, 30, target=LOW, computed=0)
    s = step([a, b])
    assert isinstance(s, StepLimit)
    report = s.close([(a, 1), (b, 16)])
    assert report == StepReport(LIMIT, TOP, 0, StepShape(2, 2, 10.0 + 30.0))
    cost = StepCostModel(PRIOR)
    # 10 ms + 1 ms a decode: 70 decodes fit 80 ms, so 68 more beside these two.
    assert seats_within(cost, report.decoding or StepShape(), 100, LIMIT) == 68
    assert seats_within(cost, report.decoding or StepShape(), 5, LIMIT) == 5


@pytest.mark.parametrize("target", [TOP, TOP / 2])
def test_protected_means_the_strictest_target_present(target: float) -> None:
    s = step()
    assert s.protects(record(1, 8, target=target))
    assert not s.protects(record(2, 8, target=LOW)) and not s.protects(record(3, 8))
