"""Scheduler step cost: one ``schedule()`` plus one ``on_step()``, with a minimal fake model.

Run: ``python -m benchmarks.scheduler`` (about 20 s; ``--profile`` adds a cProfile of one case, ``--json
PATH`` writes the figures). It prints, per case, the median over repetitions of the wall time of
``schedule()`` + ``on_step()`` per step and per running request. Nothing here asserts on time.

What is measured, and what is not:

- R running requests, all decoding, in a steady state: long ``max_tokens`` (nobody finishes), a
  roomy pool (no preemption; each request still takes a new block every ``block_size`` steps,
  as in real serving), ``max_num_seqs = R + 1`` and ``max_num_batched_tokens = R + 1``.
- W waiting requests that stay waiting: the one token of budget the decodes leave is too little for
  their 2-token prompts (WholePrompt, not alone), so every step phase 3 still peeks the head of the
  queue and asks the prefill policy, then stops. (With ``max_num_seqs = R`` instead, phase 3 stops
  before it looks at the queue at all, which measures less.)
- With SLO-aware steps (the ``slo`` rows, docs/scheduler.md §8): the same steady state under
  priority scheduling, every other running request of a tier with a 50 ms TPOT target (protected)
  and the others of a 200 ms one, over a cost model of a GPU-like step (5 ms, 20 us a token), so
  every step has a limit (35 ms) that every decode fits: each step consults its ``StepLimit``
  (each lower tier's decode timed against the limit, the waiting head's fit, the plan's decodes
  for the stats). At ``SLO_WAITING`` waiting only.
- The fake model is minimal on purpose: it emits one fixed token per decode and per last chunk, so
  the figures are the scheduler's. Building its ``SampledToken`` list is outside the timed region.
- A waiting-queue abort at 100k waiting: single aborts (median), and the mean over aborting most
  of the queue, which includes the lazy heap's compaction (one O(W) rebuild when the dead entries
  outnumber the live ones).

Targets: at most 5 us per running request per step at 256 running; a cost that does not grow
with the waiting queue beyond log W.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from tierserve.cluster.measure import machine, percentile
from tierserve.replica.block_space import FreeListBlocks
from tierserve.replica.config import EngineConfig
from tierserve.replica.scheduler import (
    Request,
    SampledToken,
    Scheduler,
    StepPlan,
)
from tierserve.replica.step_cost import CostPrior, StepCostModel

RUNNING = (64, 256, 1024)
WAITING = (1_000, 10_000, 100_000)
BLOCK_TOKENS = 16
CONTEXT = 1 << 16
TOKEN = 7  # what the minimal fake always emits
TARGET_US_PER_REQUEST = 5.0
# SLO-aware steps: two tiers' TPOT targets (every other running request of each) and the step cost
# the limit is predicted with (a GPU-like step: every decode of 1024 fits the 35 ms limit).
SLO_TARGETS = (0.05, 0.2)
SLO_PRIORITIES = (10, 5)
SLO_PRIOR = CostPrior(base_s=0.005, per_token_s=2e-5, per_sequence_s=1e-6, per_pair_s=1e-9)
SLO_WAITING = 10_000


def fake_outputs(plan: StepPlan) -> list[SampledToken]:
    """The minimal fake model: one fixed token per decode and per last chunk."""
    outs = [SampledToken(d.id, TOKEN) for d in plan.decodes]
    outs += [SampledToken(c.id, TOKEN) for c in plan.prefill if c.last]
    return outs


def steps_per_rep(running: int) -> int:
    return max(10, 6400 // running)


def steady_scheduler(running: int, horizon: int, slo: bool = False) -> Scheduler:
    """``running`` requests, all admitted and decoding; the budget leaves one token spare.

    The pool is roomy: every request can grow for ``horizon`` steps without a preemption. With
    ``slo``, the requests alternate between the tiers of ``SLO_TARGETS`` and every step has a
    limit that all of their decodes fit.
    """
    cfg = EngineConfig(
        max_num_seqs=running + 1,
        max_num_batched_tokens=running + 1,
        max_waiting=max(WAITING) + 1,
        max_model_len=CONTEXT,
        scheduling_policy="priority" if slo else "fcfs",
        prefill_chunk_tokens=None,
    )
    blocks = running * (horizon // BLOCK_TOKENS + 2) + CONTEXT // BLOCK_TOKENS
    cost = StepCostModel(SLO_PRIOR) if slo else None
    s = Scheduler(cfg, FreeListBlocks(BLOCK_TOKENS, range(blocks)), cost=cost)
    for i in range(running):
        tier = i % 2
        s.add(Request([i % 1000], max_tokens=10**9,
                      priority=SLO_PRIORITIES[tier] if slo else 0,
                      tpot_target_s=SLO_TARGETS[tier] if slo else None))
    s.on_step(fake_outputs(s.schedule()))  # one-token prompts: all admitted in one step
    plan = s.schedule()
    s.on_step(fake_outputs(plan))
    assert len(plan.decode) == running and not plan.prefill, "not in the steady state"
    assert (plan.limit_s is not None) == slo and plan.paused == 0, plan
    return s


def fill_waiting(s: Scheduler, upto: int) -> None:
    """Add 2-token requests until ``upto`` wait (they can never be admitted here)."""
    for i in range(s.stats().waiting, upto):
        s.add(Request([i % 1000, 1], max_tokens=16))


@dataclass
class Case:
    running: int
    waiting: int
    slo: bool  # SLO-aware steps with a limit (two tiers' targets)
    us_per_step: float  # median over repetitions
    us_per_request: float
    best_us_per_step: float  # the fastest repetition: the least disturbed by other load
    schedule_us: float  # median
    on_step_us: float  # median
    spread: float  # (p90 - p10) / median over repetitions


def one_rep(s: Scheduler, steps: int) -> tuple[float, float]:
    """Mean microseconds per step in ``schedule()`` and in ``on_step()`` over ``steps`` steps."""
    clock = time.perf_counter
    t_sched = t_step = 0.0
    for _ in range(steps):
        t0 = clock()
        plan = s.schedule()
        t1 = clock()
        outs = fake_outputs(plan)
        t2 = clock()
        s.on_step(outs)
        t3 = clock()
        t_sched += t1 - t0
        t_step += t3 - t2
    return t_sched / steps * 1e6, t_step / steps * 1e6


def measure(running: int, reps: int) -> list[Case]:
    """Every waiting size at ``running``, and the SLO case, repetitions interleaved so that
    load hits all alike."""
    steps = steps_per_rep(running)
    horizon = 5 + reps * steps + 10
    scheds = {}
    for waiting, slo in [(w, False) for w in WAITING] + [(SLO_WAITING, True)]:
        s = steady_scheduler(running, horizon, slo)
        fill_waiting(s, waiting)
        for _ in range(5):  # warm up
            s.on_step(fake_outputs(s.schedule()))
        scheds[waiting, slo] = s
    times: dict[tuple[int, bool], list[tuple[float, float]]] = {k: [] for k in scheds}
    for _ in range(reps):
        for key, s in scheds.items():
            times[key].append(one_rep(s, steps))
    cases = []
    for (waiting, slo), s in scheds.items():
        st = s.stats()
        assert st.running == running and st.waiting == waiting and st.preemptions == 0, st
        assert (st.limit_s is not None) == slo and st.paused == 0, st
        totals = [a + b for a, b in times[waiting, slo]]
        med = statistics.median(totals)
        cases.append(
            Case(
                running=running,
                waiting=waiting,
                slo=slo,
                us_per_step=med,
                us_per_request=med / running,
                best_us_per_step=min(totals),
                schedule_us=statistics.median(a for a, _ in times[waiting, slo]),
                on_step_us=statistics.median(b for _, b in times[waiting, slo]),
                spread=(percentile(totals, 90) - percentile(totals, 10)) / med,
            )
        )
    return cases


@dataclass
class AbortCost:
    waiting: int
    single_median_us: float
    single_p99_us: float
    mean_over_most_us: float  # aborting 60% of the queue, compaction included
    add_us: float  # mean cost of one add() while filling the queue


def measure_abort(waiting: int) -> AbortCost:
    s = steady_scheduler(64, horizon=10)
    t0 = time.perf_counter()
    fill_waiting(s, waiting)
    add_us = (time.perf_counter() - t0) / waiting * 1e6
    ids = [r for r in s.unfinished() if s.is_waiting(r)]
    random.Random(0).shuffle(ids)
    clock = time.perf_counter
    single: list[float] = []
    for rid in ids[:2000]:
        t = clock()
        ok = s.abort(rid)
        single.append((clock() - t) * 1e6)
        assert ok
    s.on_step(fake_outputs(s.schedule()))  # the queue still works
    most = ids[2000 : int(waiting * 0.6)]
    t = clock()
    for rid in most:
        s.abort(rid)
    mean_most = (clock() - t) / len(most) * 1e6
    assert s.stats().waiting == waiting - int(waiting * 0.6)
    return AbortCost(
        waiting=waiting,
        single_median_us=statistics.median(single),
        single_p99_us=percentile(single, 99),
        mean_over_most_us=mean_most,
        add_us=add_us,
    )


def profile(running: int, waiting: int, steps: int = 200) -> None:
    s = steady_scheduler(running, horizon=steps + 10)
    fill_waiting(s, waiting)
    prof = cProfile.Profile()

    def loop() -> None:
        for _ in range(steps):
            s.on_step(fake_outputs(s.schedule()))

    prof.runcall(loop)
    print(f"\ncProfile: {steps} steps at {running} running, {waiting} waiting (fake included)")
    pstats.Stats(prof).sort_stats("tottime").print_stats(12)


def run(reps: int, log: Callable[[str], None] = print) -> dict:
    m = machine()
    log("Scheduler step cost: schedule() + on_step(), minimal fake model, median of repetitions")
    log(f"machine: {m['cpu']}, {m['cores_usable']} cores, Python {m['python']}, {m['platform']}")
    log(f"load average before: {m['load_avg_1m_before']:.2f} (other work on the machine adds noise)")
    header = (
        f"{'running':>8} {'waiting':>8} {'slo':>4} {'us/step':>9} {'us/request':>11} {'best':>9} "
        f"{'schedule':>9} {'on_step':>9} {'spread':>7}"
    )
    log(header)
    log("-" * len(header))
    cases: list[Case] = []
    for running in RUNNING:
        for c in measure(running, reps):
            cases.append(c)
            log(
                f"{c.running:>8} {c.waiting:>8} {'on' if c.slo else 'off':>4} "
                f"{c.us_per_step:>9.1f} {c.us_per_request:>11.2f} "
                f"{c.best_us_per_step:>9.1f} {c.schedule_us:>9.1f} {c.on_step_us:>9.1f} "
                f"{c.spread:>7.0%}"
            )
    log("")
    for running in RUNNING:
        med = {c.waiting: c.us_per_step for c in cases if c.running == running and not c.slo}
        best = {c.waiting: c.best_us_per_step for c in cases
                if c.running == running and not c.slo}
        lo, hi = min(WAITING), max(WAITING)
        log(
            f"running {running:>5}: step cost at {hi} waiting / at {lo} waiting = "
            f"{med[hi] / med[lo]:.2f} (median), {best[hi] / best[lo]:.2f} (best)"
        )
    for running in RUNNING:
        on = next(c for c in cases if c.running == running and c.slo)
        off = next(c for c in cases
                   if c.running == running and not c.slo and c.waiting == SLO_WAITING)
        log(
            f"running {running:>5}: with a step limit {on.us_per_request:.2f} us per running "
            f"request, {on.us_per_step / off.us_per_step:.2f} times the step without (median)"
        )
    at256 = [c.us_per_request for c in cases if c.running == 256 and not c.slo]
    verdict = "met" if max(at256) <= TARGET_US_PER_REQUEST else "NOT met"
    log(
        f"target <= {TARGET_US_PER_REQUEST} us per running request at 256 running: {verdict} "
        f"(worst {max(at256):.2f} us)"
    )
    a = measure_abort(max(WAITING))
    log(
        f"abort of a waiting request at {a.waiting} waiting: median {a.single_median_us:.2f} us, "
        f"p99 {a.single_p99_us:.2f} us; mean {a.mean_over_most_us:.2f} us over aborting 60% "
        f"(compaction included); add() {a.add_us:.2f} us"
    )
    return {"machine": m, "cases": [asdict(c) for c in cases], "abort": asdict(a)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=15, help="repetitions per case (median reported)")
    p.add_argument("--profile", action="store_true", help="cProfile 256 running, 10k waiting")
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = p.parse_args(argv)
    result = run(args.reps)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    if args.profile:
        profile(256, 10_000)
    return 0


if __name__ == "__main__":
    sys.exit(main())
