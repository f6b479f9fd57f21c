"""SLO-aware steps (docs/scheduler.md §8) and the step cost model they use.

The scheduler tests drive the fake model with a cost model that only has its prior (nothing
observed), so every prediction is a known linear function of the step's shape.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from tests.replica.fake_model import VOCAB, FakeModel, drive, expected_output
from tests.replica.scheduler.harness import caps
from tierserve.replica.block_space import FreeListBlocks
from tierserve.replica.config import EngineConfig
from tierserve.replica.prefill_policy import Chunked
from tierserve.replica.scheduler import FinishedEvent, Request, SchedPolicy, Scheduler, TokenEvent
from tierserve.replica.step_cost import CostPrior, StepCostModel, StepShape, chunk_attention

# 10 ms a step plus 1 ms a token: a limit of 80 ms holds 70 tokens.
PRIOR = CostPrior(base_s=0.01, per_token_s=0.001, per_sequence_s=0.0, per_pair_s=0.0)


def make(total_blocks: int = 256, *, slo: bool = True, max_seqs: int = 16, chunk: int = 32,
         budget: int = 256, headroom: float = 0.8, prefill_headroom: float | None = None,
         clock: Callable[[], float] | None = None, policy: SchedPolicy = SchedPolicy.PRIORITY,
         aging_steps: int = 0, late: float | None = None) -> tuple[Scheduler, FakeModel]:
    """A scheduler on the fake model. The TPOT budget of protected prompts
    (``slo_prefill_headroom``) is off unless a test asks for it: the rules of the step limit
    are tested alone, the budget on its own."""
    cfg = caps(max_seqs=max_seqs, max_batch_tokens=budget, policy=policy,
               aging_steps=aging_steps, max_model_len=512).model_copy(
        update={"slo_scheduling": slo, "slo_headroom": headroom,
                "slo_prefill_headroom": prefill_headroom, "slo_prefill_headroom_late": late})
    s = Scheduler(cfg, FreeListBlocks(4, range(total_blocks)), Chunked(chunk),
                  cost=StepCostModel(PRIOR), clock=clock or (lambda: 0.0))
    return s, FakeModel(s)


class Clock:
    """Seconds on a scheduler's clock, set by the test."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def req(prompt_len: int, max_tokens: int, priority: int, target: float | None,
        seed: int, ttft_left: float | None = None) -> Request:
    prompt = [(seed * 7919 + i * 31) % VOCAB for i in range(prompt_len)]
    return Request(prompt, max_tokens, priority, tpot_target_s=target, ttft_left_s=ttft_left)


# ---------------------------------------------------------------------- the cost model


def test_cost_model_learns_a_linear_cost() -> None:
    rng = random.Random(0)
    model = StepCostModel(CostPrior(base_s=0.5, per_token_s=0.05))
    truth = (0.012, 0.0025, 0.0004, 3e-8)
    for _ in range(400):
        shape = StepShape(rng.randint(1, 512), rng.randint(1, 64), rng.uniform(0, 2e5))
        t = truth[0] + truth[1] * shape.tokens + truth[2] * shape.sequences
        t += truth[3] * shape.attention
        model.observe(shape, t * rng.uniform(0.995, 1.005))
    for shape in (StepShape(1, 1, 100), StepShape(64, 64, 2e4), StepShape(512, 3, 1.5e5)):
        expect = truth[0] + truth[1] * shape.tokens + truth[2] * shape.sequences
        expect += truth[3] * shape.attention
        assert model.predict(shape) == pytest.approx(expect, rel=0.06)
    assert all(c >= 0.0 for c in model.coefficients)


def test_cost_model_never_learns_a_negative_cost() -> None:
    model = StepCostModel(refit_every=1)
    for tokens in range(1, 200):  # time falls as tokens grow: no cost can say that
        model.observe(StepShape(tokens, 1, 0.0), max(0.2 - tokens * 0.001, 0.001))
    assert all(c >= 0.0 for c in model.coefficients)
    assert model.predict(StepShape(400, 1, 0.0)) >= model.predict(StepShape(1, 1, 0.0))


def test_one_slow_step_counts_as_at_most_three_predictions() -> None:
    model = StepCostModel(CostPrior(base_s=0.01, per_token_s=0.001), refit_every=1)
    shape = StepShape(10, 2, 100.0)
    for _ in range(64):
        model.observe(shape, 0.02)
    before = model.predict(shape)
    model.observe(shape, 50.0)  # a 50 s stall
    assert model.predict(shape) < 1.2 * before


def test_cost_model_refuses_bad_settings_and_ignores_empty_steps() -> None:
    with pytest.raises(ValueError, match="forget"):
        StepCostModel(forget=0.1)
    with pytest.raises(ValueError, match="refit_every"):
        StepCostModel(refit_every=0)
    model = StepCostModel()
    model.observe(StepShape(0, 0, 0.0), 1.0)
    model.observe(StepShape(3, 1, 3.0), float("nan"))
    assert model.observed == 0


def test_max_tokens_is_the_largest_chunk_within_the_limit() -> None:
    model = StepCostModel(PRIOR)
    base = StepShape(10, 10, 0.0)  # 20 ms
    assert model.max_tokens(base, 0.08, 0, 500, new_sequence=True) == 60
    assert model.max_tokens(base, 0.019, 0, 500, new_sequence=True) == 0
    assert model.max_tokens(base, 1.0, 0, 25, new_sequence=True) == 25
    quad = StepCostModel(CostPrior(base_s=0.0, per_token_s=0.0, per_sequence_s=0.0,
                                   per_pair_s=1e-6))
    fit = quad.max_tokens(StepShape(), 0.01, 100, 1000, new_sequence=True)
    assert chunk_attention(100, fit) * 1e-6 <= 0.01 < chunk_attention(100, fit + 1) * 1e-6


def test_request_refuses_a_bad_target() -> None:
    for bad in (0.0, -1.0, float("inf"), True, "0.1"):
        with pytest.raises(ValueError, match="tpot_target_s"):
            Request([1, 2], 4, tpot_target_s=bad)  # type: ignore[arg-type]
    for bad_left in (float("nan"), float("-inf"), True, "1"):
        with pytest.raises(ValueError, match="ttft_left_s"):
            Request([1, 2], 4, ttft_left_s=bad_left)  # type: ignore[arg-type]
    assert Request([1, 2], 4, ttft_left_s=-0.5).ttft_left_s == -0.5  # late already: allowed


def test_the_late_share_is_a_share_of_the_target() -> None:
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError, match="slo_prefill_headroom_late"):
            EngineConfig(slo_prefill_headroom_late=bad)
    assert EngineConfig().slo_prefill_headroom_late is None  # off unless configured
    assert EngineConfig(slo_prefill_headroom_late=0.95).slo_prefill_headroom_late == 0.95


# ---------------------------------------------------------------------- the step


def test_without_targets_the_plans_are_those_of_section_2() -> None:
    """On and off give the same plans, step by step, when no request carries a target."""
    rng = random.Random(3)
    specs = [(rng.randint(1, 60), rng.randint(1, 30), rng.randint(0, 3)) for _ in range(40)]
    plans = []
    for slo in (True, False):
        s, m = make(48, slo=slo, max_seqs=6, budget=40)
        for i, (p, n, prio) in enumerate(specs):
            s.add(req(p, n, prio, None, i))
        trace = []
        while s.has_unfinished():
            plan, _ = m.step()
            trace.append((plan.decode, plan.prefill, plan.preempted))
            assert plan.limit_s is None and plan.paused == 0
        plans.append(trace)
    assert plans[0] == plans[1]


def test_a_top_tier_request_keeps_every_step_within_its_limit() -> None:
    """Twelve batch requests and one interactive (TPOT target 0.1 s: steps of at most 80 ms,
    70 tokens): every step stays within the limit once the interactive request is there, it
    decodes every step, the batch requests are left out instead, and every output is what the
    request gives alone."""
    s, m = make(slo=True, chunk=64, budget=256)
    prompts = {}
    tokens: dict[int, list[int]] = {}
    for i in range(12):
        r = req(40, 30, 0, None, i)
        prompts[s.add(r)] = r
    for _ in range(3):
        for e in m.step()[1]:
            if isinstance(e, TokenEvent):
                tokens.setdefault(e.id, []).append(e.token)
    top = req(50, 20, 10, 0.1, 99)
    top_id = s.add(top)
    prompts[top_id] = top
    decoded_steps = 0
    first = None
    while s.has_unfinished():
        plan, events = m.step()
        predicted = s.cost.predict(plan.shape) if s.cost else 0.0
        if s.tokens(top_id) is not None or any(
                isinstance(e, FinishedEvent) and e.id == top_id for e in events):
            assert plan.limit_s == pytest.approx(0.08)
            assert predicted <= 0.08 + 1e-9
            if first is not None:
                assert top_id in plan.decode
                decoded_steps += 1
        for e in events:
            if isinstance(e, TokenEvent):
                tokens.setdefault(e.id, []).append(e.token)
                if e.id == top_id and first is None:
                    first = s._step
    assert decoded_steps == 19
    for rid, r in prompts.items():
        assert tokens[rid] == expected_output(list(r.prompt), r.max_tokens, 512)[0]
    assert s.step_limit() is None  # the target left with its request


def test_lower_tiers_are_paused_not_preempted_while_blocks_last() -> None:
    s, m = make(2000, slo=True, max_seqs=64, chunk=64, budget=256, headroom=0.5)
    for i in range(60):
        s.add(req(40, 60, 0, None, i))
    for _ in range(12):  # all 60 decoding: 70 ms a step, past the 50 ms limit to come
        m.step()
    s.add(req(20, 40, 10, 0.1, 99))
    paused = []
    for _ in range(10):
        plan, _ = m.step()
        paused.append(plan.paused)
        assert not plan.preempted
    assert max(paused) > 0
    assert s.stats().preemptions == 0


def test_a_top_tier_request_takes_a_seat_from_a_lower_tier_one() -> None:
    """max_num_seqs full of batch requests: the interactive request preempts the lowest-ranked
    one (recompute later, same output) instead of waiting for a batch request to finish."""
    s, m = make(slo=True, max_seqs=4, chunk=64)
    reqs = {}
    tokens: dict[int, list[int]] = {}
    for i in range(4):
        r = req(10, 50, 0, None, i)
        reqs[s.add(r)] = r
    _, events = m.step()
    top = req(10, 5, 10, 0.1, 50)
    top_id = s.add(top)
    reqs[top_id] = top
    plan, more = m.step()
    assert len(plan.preempted) == 1 and plan.preempted[0] != top_id
    assert any(c.id == top_id for c in plan.prefill)
    rest, _ = drive(s, m)
    for e in events + more:
        if isinstance(e, TokenEvent):
            tokens.setdefault(e.id, []).append(e.token)
    for rid, r in reqs.items():
        got = tokens.get(rid, []) + rest.get(rid, [])
        assert got == expected_output(list(r.prompt), r.max_tokens, 512)[0]


def test_a_top_tier_request_is_never_preempted_for_a_lower_one() -> None:
    """A pool that two interactive requests fill at their full length: neither
    interactive request is preempted for it; blocks run out mid-decode and the batch one, not
    an interactive one, is the victim."""
    s, m = make(14, slo=True, max_seqs=8, chunk=64)
    a = s.add(req(16, 12, 10, 0.1, 1))
    b = s.add(req(16, 12, 10, 0.1, 2))
    c = s.add(req(8, 12, 0, None, 3))
    preempted: list[int] = []
    while s.has_unfinished():
        plan, _ = m.step()
        preempted += plan.preempted
    assert a not in preempted and b not in preempted
    assert preempted and set(preempted) <= {c}


def test_a_lower_tier_request_is_not_admitted_past_the_limit() -> None:
    """With an interactive request running, a batch request is admitted only while a step
    decoding every admitted request still fits the limit."""
    s, m = make(slo=True, max_seqs=64, chunk=64, budget=512)
    s.add(req(8, 200, 10, 0.1, 1))
    m.step()
    for i in range(100):
        s.add(req(4, 200, 0, None, 10 + i))
    for _ in range(20):
        m.step()
    # 10 ms + 1 ms per decode <= 80 ms: at most 70 decoding.
    assert s.stats().running <= 70
    assert s.stats().seats >= 0
    assert s.stats().limit_s == pytest.approx(0.08)


def test_the_strictest_targets_seats_count_only_its_own_decodes() -> None:
    """A step full of lower tiers' decodes has no seat for another of them, but their decodes
    give way to the strictest target's (phase 1): that target's seats count only its own
    running requests. Without a limit both are the seats ``max_num_seqs`` leaves."""
    s, m = make(2000, max_seqs=64, chunk=64, budget=256, headroom=0.5)
    for i in range(50):
        s.add(req(8, 200, 0, None, i))
    for _ in range(3):
        m.step()
    assert s.stats().seats == s.stats().target_seats == 64 - 50
    for i in range(2):
        s.add(req(8, 200, 10, 0.1, 100 + i))
    for _ in range(4):
        plan, _ = m.step()
    # 10 ms + 1 ms a token within 50 ms: about 40 decodes a step, 2 of them the top tier's.
    assert len(plan.decodes) + plan.paused == 52 and len(plan.decodes) >= 39
    assert s.cost is not None
    fit = 0
    while s.cost.predict(StepShape(3 + fit, 3 + fit, 0.0)) <= 0.05:
        fit += 1
    st = s.stats()
    assert st.seats == 0
    assert st.target_seats == fit and fit >= 37
    # Requests of that target still waiting take seats too (each is admitted whatever the
    # limit).
    for i in range(3):
        s.add(req(8, 200, 10, 0.1, 200 + i))
    assert s.stats().target_seats == fit - 3


@pytest.mark.parametrize("policy", ["fcfs", "aged"])
def test_lower_tiers_ranked_above_the_strictest_target_keep_their_seats(policy: str) -> None:
    """Under fcfs, or once aging ranks them above a top-tier request arriving now, the lower
    tiers' decodes run before the top tier's (phase 1 goes by rank): they count against its
    seats, and a step they fill has none for it."""
    if policy == "fcfs":
        s, m = make(2000, max_seqs=64, chunk=64, budget=256, headroom=0.5,
                    policy=SchedPolicy.FCFS)
    else:  # one priority level a step: the batch requests outrank a new top-tier one by step 11
        s, m = make(2000, max_seqs=64, chunk=64, budget=256, headroom=0.5, aging_steps=1)
    for i in range(50):
        s.add(req(8, 200, 0, None, i))
    for _ in range(3):
        m.step()
    for i in range(2):
        s.add(req(8, 200, 10, 0.1, 100 + i))
    m.step()
    if policy == "aged":  # step 4: a top-tier request arriving now still ranks first
        assert s.stats().target_seats >= 37
        for _ in range(8):
            m.step()
    else:
        m.step()
    assert s.stats().target_seats == 0


def test_abort_and_finish_release_the_target() -> None:
    s, m = make(slo=True)
    a = s.add(req(8, 3, 10, 0.1, 1))
    b = s.add(req(8, 3, 5, 0.5, 2))
    assert s.step_limit() == pytest.approx(0.08)
    s.abort(a)
    assert s.step_limit() == pytest.approx(0.4)
    drive(s, m)
    assert s.step_limit() is None and not s.has_unfinished()
    assert s.tokens(b) is None
    assert s.blocks.free_blocks == s.blocks.total_blocks


def test_off_ignores_targets() -> None:
    s, m = make(slo=False)
    s.add(req(8, 3, 10, 0.1, 1))
    assert s.step_limit() is None and s.cost is None
    plan, _ = m.step()
    assert plan.limit_s is None


def test_a_lower_tier_head_refused_by_the_limit_preempts_nothing() -> None:
    """Batch requests left out of a tight step, seats full: a standard request waiting for a
    seat does not preempt a left-out batch request when it could not run within the limit
    anyway (it would only turn "left out" into "preempted")."""
    s, m = make(2000, slo=True, max_seqs=41, chunk=64, budget=256, headroom=0.5)
    for i in range(40):
        s.add(req(40, 200, 0, None, i))
    for _ in range(12):
        m.step()
    s.add(req(20, 100, 10, 0.1, 99))  # takes the last seat; the limit is now 50 ms
    for _ in range(3):
        m.step()
    assert s.stats().running == 41 and s.stats().paused > 0
    for i in range(5):
        s.add(req(20, 50, 5, None, 200 + i))
    for _ in range(10):
        m.step()
    assert s.stats().preemptions == 0


def test_a_top_tier_request_takes_a_seat_from_an_older_lower_tier_one() -> None:
    """Aging ranks a long-running batch request above a new interactive one (500 steps at
    aging 100 outweigh 5 levels): the interactive request still takes its seat."""
    cfg = caps(max_seqs=2, max_batch_tokens=256, policy=SchedPolicy.PRIORITY, aging_steps=1,
               max_model_len=512).model_copy(update={"slo_scheduling": True})
    s = Scheduler(cfg, FreeListBlocks(4, range(256)), Chunked(64), cost=StepCostModel(PRIOR))
    m = FakeModel(s)
    old = [s.add(req(8, 300, 0, None, i)) for i in range(2)]
    for _ in range(40):
        m.step()
    top = s.add(req(8, 4, 10, 0.1, 9))
    plan, _ = m.step()
    assert any(c.id == top for c in plan.prefill)
    assert len(plan.preempted) == 1 and plan.preempted[0] in old


def test_a_top_tier_request_passes_a_head_the_limit_refuses() -> None:
    s, m = make(2000, slo=True, max_seqs=64, chunk=64, budget=256, headroom=0.5)
    for i in range(45):
        s.add(req(8, 300, 0, None, i))
    for _ in range(6):
        m.step()
    s.add(req(8, 300, 5, 0.1, 98))  # an interactive request running sets the 50 ms limit
    m.step()
    m.step()
    blocked = s.add(req(8, 50, 8, None, 100))  # ranks above the next one, but cannot fit
    top = s.add(req(8, 5, 5, 0.1, 101))
    plan, _ = m.step()
    assert any(c.id == top for c in plan.prefill)
    assert s.is_waiting(blocked)


def test_a_target_no_step_can_meet_still_makes_progress() -> None:
    """A 1 ms target where a step costs at least 10 ms: the replica keeps stepping (the
    best-ranked request runs) and everything finishes."""
    s, m = make(slo=True)
    s.add(req(8, 5, 10, 0.001, 1))
    for i in range(3):
        s.add(req(8, 5, 0, None, 2 + i))
    _, reasons = drive(s, m, max_steps=500)
    assert len(reasons) == 4 and s.blocks.free_blocks == s.blocks.total_blocks


def test_lower_tier_prompts_leave_the_reserve_to_a_top_tier_prompt() -> None:
    """Three standard-tier prompts mid-prefill when an interactive prompt arrives (80 ms: 70
    tokens a step): the lower tiers' chunks are cut to what the reserve leaves (3/4 of 70
    tokens kept), so the interactive prompt's first chunk is the reserve's and no step is
    planned past the limit (a lower chunk taking the room, then the interactive prompt a
    block's worth past it, would be)."""
    s, m = make(2000, slo=True, chunk=64, budget=256)
    for i in range(3):
        s.add(req(300, 10, 5, 0.5, i))
    m.step()
    top = s.add(req(120, 5, 10, 0.1, 99))
    first = None
    for _ in range(500):
        if not s.has_unfinished():
            break
        plan, _ = m.step()
        assert s.cost is not None
        if plan.limit_s == pytest.approx(0.08):
            assert s.cost.predict(plan.shape) <= 0.08 + 1e-9
        chunk = next((c for c in plan.prefill if c.id == top), None)
        if first is None and chunk is not None:
            first = len(chunk.tokens)
    assert first == 70 * 3 // 4
    assert s.blocks.free_blocks == s.blocks.total_blocks


def test_only_one_top_tier_prompt_a_step_goes_past_the_limit() -> None:
    """Two interactive prompts at once under a 20 ms limit (10 tokens a step): the first takes
    what fits, the second waits for the next step instead of taking a block's worth past the
    limit (the floor is for a step where no top-tier prompt progresses)."""
    s, m = make(slo=True, headroom=1.0)
    a = s.add(req(40, 4, 10, 0.02, 1))
    b = s.add(req(40, 4, 10, 0.02, 2))
    plan, _ = m.step()
    assert [c.id for c in plan.prefill] == [a]
    started = set()
    for _ in range(500):
        if not s.has_unfinished():
            break
        plan, _ = m.step()
        assert s.cost is not None
        if plan.prefill:
            assert s.cost.predict(plan.shape) <= 0.02 + 1e-9
        started |= {c.id for c in plan.prefill}
    assert b in started and not s.has_unfinished()
    assert s.blocks.free_blocks == s.blocks.total_blocks


def test_strictest_prefill_counts_the_top_tiers_prompts_not_yet_computed() -> None:
    """What a new top-tier request finds ahead of it: the uncomputed prompt positions of the
    requests holding the strictest target, running or waiting, and nothing of lower tiers."""
    s, m = make(slo=True, headroom=1.0)  # 20 ms: 10 tokens a step
    assert s.slo_steps and s.strictest_prefill() == 0
    s.add(req(200, 4, 0, 0.5, 1))
    s.add(req(40, 4, 10, 0.02, 2))
    s.add(req(30, 4, 10, 0.02, 3))
    assert s.strictest_prefill() == 70  # both waiting: their whole prompts
    m.step()
    assert 0 < s.strictest_prefill() < 70
    drive(s, m, max_steps=500)
    assert s.strictest_prefill() == 0
    off, _ = make(slo=False)
    off.add(req(40, 4, 10, 0.02, 4))
    assert not off.slo_steps and off.strictest_prefill() == 0


def test_what_a_top_tier_chunk_took_of_the_reserve_is_free_for_lower_tiers() -> None:
    """An interactive prompt and a standard one both mid-prefill (80 ms: 70 tokens a step; 64
    a chunk): the interactive chunk takes 64 positions, more than the 52 kept for it, so the
    standard chunk after it gets the 6 left, not nothing."""
    s, m = make(2000, slo=True, chunk=64, budget=256)
    low = s.add(req(300, 5, 5, 0.5, 1))
    m.step()  # the standard prompt starts alone (limit 400 ms)
    top = s.add(req(300, 5, 10, 0.1, 2))
    m.step()  # the interactive prompt is admitted
    plan, _ = m.step()
    chunks = {c.id: len(c.tokens) for c in plan.prefill}
    assert chunks == {top: 64, low: 6}
    assert s.cost is not None and s.cost.predict(plan.shape) <= 0.08 + 1e-9


def test_the_reserve_is_what_the_prefill_policy_would_give() -> None:
    """A top-tier prompt cut into 16-position chunks gets 16 a step: the reserve keeps 16 for
    it, not three quarters of the step, and lower tiers' decodes fill the rest."""
    s, m = make(2000, slo=True, max_seqs=64, chunk=16, budget=256)
    for i in range(60):
        s.add(req(8, 200, 0, None, i))
    for _ in range(4):
        m.step()
    s.add(req(300, 5, 10, 0.1, 99))
    m.step()
    plan, _ = m.step()
    assert s.cost is not None
    assert [len(c.tokens) for c in plan.prefill] == [16]
    assert len(plan.decodes) == 70 - 16  # (18 while the reserve kept 52)
    assert s.cost.predict(plan.shape) <= 0.08 + 1e-9


def test_prefill_rate_and_whether_steps_pass_the_lower_tiers() -> None:
    """The rate the router reads: the reserve (3/4 of 70 positions) over the 80 ms limit; none
    without a limit. Steps pass the lower tiers only under priority scheduling."""
    s, _ = make(slo=True)
    assert s.strictest_prefill_rate() == 0.0
    s.add(req(40, 4, 10, 0.1, 1))
    assert s.strictest_prefill_rate() == pytest.approx(52 / 0.08)
    cfg = caps(max_seqs=16, max_batch_tokens=256, policy=SchedPolicy.FCFS, aging_steps=0,
               max_model_len=512).model_copy(update={"slo_scheduling": True})
    fcfs = Scheduler(cfg, FreeListBlocks(4, range(64)), Chunked(32), cost=StepCostModel(PRIOR))
    assert not fcfs.slo_steps and s.slo_steps


# ---------------------------------------------------------------------- the TPOT budget


def timed_run(prefill_headroom: float | None, arrivals: dict[int, list[Request]]
              ) -> tuple[dict[int, tuple[float, float, float, int]], list[int], int, float]:
    """Step a scheduler (chunks of 128 positions: 138 ms and more, past the 80 ms limit) whose
    clock advances by each step's predicted time (the prior's, so exact), adding
    ``arrivals[k]`` before step ``k``. Returns each request's (arrival, first token, last token,
    tokens) on that clock, the ids of those with the 100 ms target, the steps planned past the
    limit (each with a protected chunk in it) and the largest time per output token so far that
    one of those requests had at any of its tokens."""
    now = [0.0]
    s, m = make(4000, slo=True, max_seqs=32, chunk=128, budget=256, headroom=0.8,
                prefill_headroom=prefill_headroom, clock=lambda: now[0])
    assert s.cost is not None
    seen: dict[int, list[float]] = {}
    targets: dict[int, float | None] = {}
    past = 0
    worst = 0.0
    for k in range(5000):
        for r in arrivals.get(k, []):
            rid = s.add(r)
            seen[rid] = [now[0], -1.0, -1.0, 0]
            targets[rid] = r.tpot_target_s
        if k > max(arrivals) and not s.has_unfinished():
            break
        plan = s.schedule()
        took = s.cost.predict(plan.shape) if not plan.is_empty else 0.001
        strict = [c for c in plan.prefill if targets[c.id] == 0.1]
        if plan.limit_s is not None and took > plan.limit_s + 1e-9:
            assert strict, "only a protected prompt's chunk takes a step past the limit"
            past += 1
        now[0] += took
        for e in s.on_step(m.run(plan)):
            if isinstance(e, TokenEvent):
                rec = seen[e.id]
                rec[1] = now[0] if rec[1] < 0 else rec[1]
                rec[2] = now[0]
                rec[3] = int(rec[3]) + 1
                if targets[e.id] == 0.1 and rec[3] >= 2:
                    worst = max(worst, (now[0] - rec[1]) / (rec[3] - 1))
    assert not s.has_unfinished()
    assert s.blocks.free_blocks == s.blocks.total_blocks
    top = [rid for rid, t in targets.items() if t == 0.1]
    return {rid: (a, f, last, int(n)) for rid, (a, f, last, n) in seen.items()}, top, past, worst


def budget_workload() -> dict[int, list[Request]]:
    """Standard-tier requests (500 ms target) with long prompts and answers filling the
    steps, an interactive one (100 ms target) decoding 150 tokens, and an interactive prompt of
    250 tokens every 6 steps (so that the budget binds)."""
    arrivals: dict[int, list[Request]] = {0: [req(300, 120, 5, 0.5, i) for i in range(4)]}
    arrivals[0].append(req(8, 150, 10, 0.1, 50))
    for j in range(16):
        arrivals.setdefault(20 + 6 * j, []).append(req(250, 12, 10, 0.1, 60 + j))
    for j in range(60):  # and more of the standard tier, so that its chunks fill the steps
        arrivals.setdefault(3 * j, []).append(req(200, 40, 5, 0.5, 100 + j))
    return arrivals


def test_the_tpot_budget_lets_top_tier_prompts_past_the_limit_within_each_share() -> None:
    """With ``slo_prefill_headroom`` 0.9 and an 80 ms limit (100 ms target), interactive
    prompts take steps past the limit, and every interactive request keeps its time per output
    token so far within 90 ms at each of its tokens; their first tokens come sooner than with
    the budget off, where no step passes the limit (here by little: a step's base cost is small
    beside its tokens, so longer steps save little of it)."""
    on, top, past_on, worst = timed_run(0.9, budget_workload())
    off, _, past_off, _ = timed_run(None, budget_workload())
    assert past_on > 0 and past_off == 0
    assert all(on[rid][3] >= 2 for rid in top)
    # At every token of every interactive request, its mean so far is within 90 ms, and the
    # budget was spent (past the 80 ms the limit alone would give) but never overspent.
    assert 0.08 < worst <= 0.9 * 0.1 + 1e-9
    ttft_on = sum(on[r][1] - on[r][0] for r in top)
    ttft_off = sum(off[r][1] - off[r][0] for r in top)
    assert ttft_on < ttft_off


def test_a_top_tier_prompt_takes_its_whole_chunk_while_none_of_its_tier_has_a_token() -> None:
    """No interactive request has a first token yet: nothing of that tier's TPOT is at stake,
    so its prompt takes the prefill policy's whole chunk (64) past the 80 ms limit, where with
    the budget off it gets the reserve (3/4 of the 70 tokens an empty step holds)."""
    firsts = []
    for share in (0.85, None):
        s, m = make(2000, slo=True, chunk=64, budget=256, prefill_headroom=share)
        for i in range(3):
            s.add(req(300, 10, 5, 0.5, i))
        m.step()
        top = s.add(req(120, 5, 10, 0.1, 99))
        plan, _ = m.step()
        firsts.append(next(len(c.tokens) for c in plan.prefill if c.id == top))
        drive(s, m, max_steps=2000)
        assert s.blocks.free_blocks == s.blocks.total_blocks
    assert firsts == [64, 70 * 3 // 4]


def test_a_budget_is_what_the_running_request_has_left() -> None:
    """An interactive request decoding, 90 ms a token its share: with 10 tokens in 500 ms it
    has 400 ms left, so a new interactive prompt takes its whole chunk (128) in a step past the
    80 ms limit that ends within them; with one token 200 ms ago it has spent its budget, and
    the prompt is held to the limit."""
    for tokens, elapsed, past in ((10, 0.5, True), (1, 0.2, False)):
        clock = Clock()
        s, m = make(2000, slo=True, chunk=128, budget=256, prefill_headroom=0.9, clock=clock)
        running = s.add(req(8, 50, 10, 0.1, 1))
        m.step()  # its prompt and first token, at t = 0
        for _ in range(tokens - 1):
            m.step()
        clock.t = elapsed
        top = s.add(req(200, 5, 10, 0.1, 2))
        plan, _ = m.step()
        assert s.cost is not None and running in plan.decode
        took = s.cost.predict(plan.shape)
        chunk = next(c for c in plan.prefill if c.id == top)
        if past:
            assert chunk.len == 128 and 0.08 < took <= 0.9 * 0.1 * tokens - elapsed + 1e-9
        else:
            assert took <= 0.08 + 1e-9


def test_preempted_top_tier_requests_bound_the_steps_past_the_limit_too() -> None:
    """Top-tier requests in pools small enough that they preempt one another: every step past
    the 80 ms limit ends within the budget (90 ms a token) of every unfinished top-tier request
    with a first token, those preempted and waiting to be recomputed included (counting only
    the running ones once let a step take a waiting one to 104 ms a token)."""
    rng = random.Random(0)
    past = preempted = 0
    for _ in range(40):
        clock = Clock()
        s, m = make(rng.choice([40, 48, 64]), slo=True, chunk=rng.choice([32, 64, 128]),
                    budget=256, headroom=0.8, prefill_headroom=0.9, clock=clock)
        arrivals: dict[int, list[Request]] = {}
        for i in range(rng.randint(2, 5)):
            arrivals.setdefault(rng.randint(0, 30), []).append(
                req(rng.randint(4, 100), rng.randint(5, 60), rng.randint(10, 12), 0.1, i))
        first: dict[int, float] = {}
        tokens: dict[int, int] = {}
        for k in range(3000):
            for r in arrivals.get(k, []):
                s.add(r)
            if k > max(arrivals) and not s.has_unfinished():
                break
            budgets = [0.9 * 0.1 * tokens[rid] - (clock.t - first[rid]) for rid in first]
            plan = s.schedule()
            assert s.cost is not None
            took = s.cost.predict(plan.shape) if not plan.is_empty else 0.001
            if plan.limit_s is not None and took > plan.limit_s + 1e-9 and plan.prefill:
                assert all(took <= b + 1e-9 for b in budgets)
                past += 1
            clock.t += took
            for e in s.on_step(m.run(plan)):
                if isinstance(e, TokenEvent):
                    first.setdefault(e.id, clock.t)
                    tokens[e.id] = tokens.get(e.id, 0) + 1
                elif isinstance(e, FinishedEvent):
                    del first[e.id]
        assert not s.has_unfinished() and s.blocks.free_blocks == s.blocks.total_blocks
        preempted += s.stats().preemptions
    assert past > 0 and preempted > 0


def test_a_step_past_the_limit_keeps_within_the_next_tiers_limit() -> None:
    """No interactive request has a first token, so its 480-position prompt may take its whole
    chunk (490 ms); with a standard-tier request (500 ms target) present the step is cut to that
    tier's 400 ms limit, whose decode rides in it."""
    taken = []
    for lower in (False, True):
        s, m = make(2000, slo=True, chunk=512, budget=512, prefill_headroom=0.9)
        if lower:
            s.add(req(8, 50, 5, 0.5, 1))
            m.step()
        top = s.add(req(480, 5, 10, 0.1, 2))
        plan, _ = m.step()
        assert s.cost is not None
        taken.append((next(c.len for c in plan.prefill if c.id == top),
                      round(s.cost.predict(plan.shape), 6)))
        drive(s, m, max_steps=2000)
        assert s.blocks.free_blocks == s.blocks.total_blocks
    assert taken[0] == (480, 0.49)
    assert taken[1][0] < 480 and taken[1][1] <= 0.4


def test_a_late_top_tier_prompt_spends_the_late_share() -> None:
    """An interactive request has sampled 10 tokens in 850 ms: at 0.85 of its 100 ms target it
    has no budget left, at the late share (1.0) 150 ms. A new interactive prompt of 200
    positions, at the rate the 80 ms limit guarantees (the reserve, 52 positions a step: 650 a
    second), needs about 310 ms: with 0.2 s left to its first-token target it is late, and its
    chunk (128) runs in a step past the limit that ends within the late share's budget; with
    5 s left, without a late share or one below the budget's own (0.85), or without a
    first-token target, it is held to the limit."""
    for late, left, past in ((1.0, 0.2, True), (1.0, 5.0, False), (None, 0.2, False),
                             (0.8, 0.2, False), (1.0, None, False)):
        clock = Clock()
        s, m = make(2000, slo=True, chunk=128, budget=256, prefill_headroom=0.85,
                    late=late, clock=clock)
        running = s.add(req(8, 50, 10, 0.1, 1))
        m.step()  # its prompt and first token, at t = 0
        for _ in range(9):
            m.step()
        clock.t = 0.85
        top = s.add(req(200, 5, 10, 0.1, 2, ttft_left=left))
        plan, _ = m.step()
        assert s.cost is not None and running in plan.decode
        took = s.cost.predict(plan.shape)
        chunk = next(c for c in plan.prefill if c.id == top)
        if past:
            assert chunk.len == 128 and 0.08 < took <= 1.0 * 0.1 * 10 - 0.85 + 1e-9
        else:
            assert took <= 0.08 + 1e-9, (late, left)
        drive(s, m, max_steps=2000)
        assert s.blocks.free_blocks == s.blocks.total_blocks

    # A late share below the budget's own never lowers it: 10 tokens in 700 ms leave 150 ms at
    # 0.85 (the whole 128-position chunk, 139 ms) and would leave 100 ms at 0.8.
    clock = Clock()
    s, m = make(2000, slo=True, chunk=128, budget=256, prefill_headroom=0.85, late=0.8,
                clock=clock)
    s.add(req(8, 50, 10, 0.1, 1))
    for _ in range(10):
        m.step()
    clock.t = 0.7
    top = s.add(req(200, 5, 10, 0.1, 2, ttft_left=0.2))
    plan, _ = m.step()
    assert s.cost is not None and 0.1 < s.cost.predict(plan.shape) <= 0.15 + 1e-9
    assert next(c.len for c in plan.prefill if c.id == top) == 128


def test_a_prompt_late_behind_others_of_its_tier_counts_their_positions() -> None:
    """Deadlines are met in order: a prompt with 1 s left is on time alone (10 positions), and
    late behind two of its tier that are due first (400 positions each, about 1.2 s at the
    guaranteed rate), and still late once those two are past due, but not once all are (nothing
    is then at stake); one whose first token already came (recomputed after a preemption) is
    not a prompt waiting for it."""
    clock = Clock()
    s, m = make(2000, slo=True, chunk=64, budget=256, prefill_headroom=0.85, late=1.0,
                clock=clock)
    s.add(req(10, 5, 10, 0.1, 1, ttft_left=1.0))
    strict = 0.1

    def limit() -> float:
        got = s.step_limit()
        assert got is not None
        return got

    assert not s._late(clock.t, strict, limit())
    s.add(req(400, 5, 10, 0.1, 2, ttft_left=0.9))
    s.add(req(400, 5, 10, 0.1, 3, ttft_left=0.95))
    assert s._late(clock.t, strict, limit())
    clock.t = 0.96  # two past due; the third is late behind their 800 positions
    assert s._late(clock.t, strict, limit())
    clock.t = 1.5  # all past due: nothing is at stake any more
    assert not s._late(clock.t, strict, limit())
    clock.t = 0.0
    drive(s, m, max_steps=2000)
    assert s.blocks.free_blocks == s.blocks.total_blocks

    # Fourteen blocks of four, each request growing to twelve: the better-ranked request's
    # growth preempts the other after its first token. Waiting to be recomputed, 1 ms before
    # its deadline, it is not late for a first token: that came already.
    s, m = make(14, slo=True, chunk=64, budget=256, prefill_headroom=0.85, late=1.0,
                clock=clock)
    low = s.add(req(8, 40, 10, 0.1, 4, ttft_left=10.001))
    s.add(req(8, 40, 11, 0.1, 5))
    for _ in range(40):
        m.step()
        if s.stats().preemptions:
            break
    assert s.stats().preemptions and s.is_waiting(low)
    clock.t = 10.0
    assert not s._late(clock.t, strict, limit())
    drive(s, m, max_steps=2000)
    assert s.blocks.free_blocks == s.blocks.total_blocks
