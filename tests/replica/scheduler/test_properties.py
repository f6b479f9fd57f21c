"""Property tests: random traffic against the invariants of docs/scheduler.md §1 to §5.

Requests arrive while the scheduler steps, with random priorities, max_tokens and stop tokens;
some are aborted while waiting, while running, or between ``schedule`` and ``on_step``; the pool is
small enough to force preemption. Both queue policies (FCFS, PRIORITY with and without aging) and
both prefill policies (WholePrompt, Chunked(k)). ``Sim`` (harness.py) checks at every step: caps
on sequences and tokens, disjoint block tables, free + used = total, decodes and chunks at the
right positions with tables that cover them, rank order of decodes, victims and admissions, and
that the plan leaves nothing undone. At the end every request that was not aborted has exactly the
fake model's tokens, and every block is free.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.replica.fake_model import expected_output, request
from tests.replica.scheduler.harness import Sim, blocks_for, caps
from tierserve.replica.config import EngineConfig
from tierserve.replica.prefill_policy import Chunked, PrefillPolicy, WholePrompt
from tierserve.replica.scheduler import FinishReason, QueueFull, Request, SchedPolicy


@dataclass
class Workload:
    cfg: EngineConfig
    block_size: int
    total_blocks: int
    policy: PrefillPolicy
    requests: list[tuple[int, Request]]  # (arrival step, request)
    aborts: list[tuple[int, int, bool]]  # (step, index into requests, between schedule/on_step)
    stop_token: int | None


@st.composite
def workloads(draw: st.DrawFn) -> Workload:
    B = draw(st.integers(1, 5))
    ctx = draw(st.integers(3, 32))
    chunk = draw(st.one_of(st.none(), st.integers(1, 12)))
    if chunk is None:
        # WholePrompt may exceed the budget only alone; keep the context within the budget so the
        # plan never does (the exception has its own test in test_worked_example.py).
        mbt = draw(st.integers(ctx, ctx + 24))
        policy: PrefillPolicy = WholePrompt()
    else:
        mbt = draw(st.integers(1, 40))
        policy = Chunked(chunk)
    # Under pressure: a burst of short prompts that generate long answers: several are admitted,
    # then they cannot all grow at once in the pool below.
    pressure = draw(st.booleans())
    raw = draw(
        st.lists(
            st.tuples(
                st.integers(0, 3 if pressure else 15),  # arrival step
                st.integers(1, max(1, ctx // 3) if pressure else ctx - 1),  # prompt length
                st.integers(8 if pressure else 1, 24),  # max_tokens
                st.integers(-2, 3),  # priority
            ),
            min_size=3 if pressure else 1,
            max_size=20,
        )
    )
    requests = [(t, request(p, mt, prio, seed=i)) for i, (t, p, mt, prio) in enumerate(raw)]
    need = max(blocks_for(min(len(r.prompt) + r.max_tokens, ctx), B) for _, r in requests)
    stop_token = None
    if draw(st.booleans()):
        # A token that one request really produces, so Stop happens (maybe to others too).
        i = draw(st.integers(0, len(requests) - 1))
        r = requests[i][1]
        out, _ = expected_output(r.prompt, r.max_tokens, ctx)
        stop_token = out[draw(st.integers(0, len(out) - 1))]
    cfg = caps(
        max_seqs=draw(st.integers(2 if pressure else 1, 8)),
        max_batch_tokens=mbt,
        max_waiting=draw(st.one_of(st.just(100), st.integers(1, 6))),
        policy=draw(st.sampled_from(SchedPolicy)),
        aging_steps=draw(st.integers(0, 6)),
        max_model_len=ctx,
    )
    aborts = draw(
        st.lists(
            st.tuples(st.integers(0, 20), st.integers(0, len(requests) - 1), st.booleans()),
            max_size=6,
        )
    )
    return Workload(
        cfg=cfg,
        block_size=B,
        # Small enough to force preemption, often as small as the largest request allows.
        total_blocks=need + draw(st.integers(0, need if pressure else 8)),
        policy=policy,
        requests=requests,
        aborts=aborts,
        stop_token=stop_token,
    )


def play(w: Workload) -> Sim:
    sim = Sim(w.cfg, w.total_blocks, w.block_size, w.policy, w.stop_token)
    rids: dict[int, int] = {}  # index into w.requests -> request id
    horizon = max([t for t, _ in w.requests] + [t for t, _, _ in w.aborts]) + 1
    for t in range(horizon):
        for i, (arrival, req) in enumerate(w.requests):
            if arrival != t:
                continue
            try:
                rids[i] = sim.add(req)
            except QueueFull:
                assert sim.s.stats().waiting >= w.cfg.max_waiting
        mid: list[int] = []
        for step, i, between in w.aborts:
            if step == t and i in rids:
                if between:
                    mid.append(rids[i])
                else:
                    sim.abort(rids[i])
        sim.step(abort_mid=mid)
    sim.run(max_steps=20_000)
    return sim


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_traffic_keeps_every_invariant(w: Workload) -> None:
    sim = play(w)
    sim.check_done()
    event(f"preempted: {sim.preemptions > 0}")
    event(f"policy: {type(w.policy).__name__}, {w.cfg.scheduling_policy}, aging {w.cfg.aging_steps > 0}")
    for kind in set(sim.abort_kinds):
        event(f"aborted a {kind} request")
    event(f"stopped: {FinishReason.STOP in sim.reasons.values()}")
    event(f"queue full: {sim.s.stats().rejected.get('queue_full', 0) > 0}")
    event(f"chunked over several steps: {any(c.start > 0 for p in sim.plans for c in p.prefill)}")
