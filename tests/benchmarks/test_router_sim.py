"""The simulated replica's engine (SimCore), without Ray: the replica's own scheduler, timed."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

from benchmarks.router_sim import TOKEN, SimCore, SimEngine, SimOutput, StepModel, sim_config
from tests.replica.scheduler.harness import Sim
from tierserve.records import ErrorRecord, GenerateRequest, SamplingParams
from tierserve.replica.config import EngineConfig
from tierserve.replica.prefill_policy import Chunked
from tierserve.replica.scheduler import NeverFits, QueueFull, Request, Scheduler, TooLong

# A step's "seconds" are its token count: what the scheduler put in it.
TOKENS = StepModel(base_s=0.0, per_token_s=1.0)


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


def test_it_runs_the_replicas_scheduler_as_configured() -> None:
    cfg = sim_config(10, block_size=32, max_num_seqs=3, aging_steps=7, prefill_chunk_tokens=64)
    core = SimCore(cfg, max_model_len=512)
    assert isinstance(core.scheduler, Scheduler) and core.scheduler.cfg is cfg
    assert (core.total_blocks, core.block_size, core.scheduler.max_model_len) == (10, 32, 512)
    assert repr(core.scheduler.prefill_policy) == "Chunked(64)"
    with pytest.raises(ValueError, match="num_kv_blocks"):
        SimCore(EngineConfig())  # no num_kv_blocks


def test_admission_by_free_blocks_and_stats() -> None:
    core = SimCore(sim_config(10, block_size=16))
    a = core.add(63, max_tokens=4)  # 4 blocks at admission
    b = core.add(63, max_tokens=4)
    c = core.add(63, max_tokens=4)
    _, first = core.step()
    assert [e[0] for e in first] == [a, b]
    s = core.stats(now=5.0)
    assert (s.running, s.waiting, s.free_blocks) == (2, 1, 2)
    assert s.waiting_blocks == 4 and s.report_time == 5.0 and s.total_blocks == 10
    assert s.committed_blocks == 3 * 5  # every request at 63 + 4 tokens
    assert s.steps == 1
    tokens = run_to_end(core)
    assert {k: len(v) for k, v in tokens.items()} == {a: 3, b: 3, c: 4}  # a, b: 1 above
    assert all(t == TOKEN for v in tokens.values() for t in v)
    idle = core.stats(0)
    assert (idle.free_blocks, idle.waiting_blocks, idle.committed_blocks) == (10, 0, 0)


def test_higher_priority_is_admitted_first() -> None:
    core = SimCore(sim_config(4, block_size=16))
    low = core.add(63, 1, priority=0)
    high = core.add(63, 1, priority=5)
    _, events = core.step()
    assert [e[0] for e in events] == [high]
    _, events = core.step()
    assert [e[0] for e in events] == [low]


def test_decodes_out_of_blocks_preempt_the_lowest_ranked() -> None:
    # Two requests fill the pool exactly; the first decode that needs a new block preempts the
    # newer one (equal priorities), which is recomputed once the first has finished.
    core = SimCore(sim_config(4, block_size=16), model=TOKENS)
    first = core.add(30, 8)  # 2 blocks (30 positions), grows past 32
    second = core.add(30, 8)
    steps: list[tuple[float, list[int]]] = []
    while core.has_work:
        tokens, events = core.step()
        steps.append((tokens, [e[0] for e in events]))
    assert core.preemptions == 1
    # The first finished alone; the second then prefilled its prompt and its 2 tokens again.
    assert sum(ids == [first] for _, ids in steps) >= 5
    recompute = next(i for i, (_, ids) in enumerate(steps) if ids == [second] and i > 2)
    assert steps[recompute][0] == 30 + 3  # preempted after its third token
    assert sum(second in ids for _, ids in steps) == 8


@pytest.mark.parametrize(("aging_steps", "first"), [(0, "high"), (2, "low"), (100, "high")])
def test_a_waiting_request_ages(aging_steps: int, first: str) -> None:
    # One slot, held by a long request. "low" waits from step 0; "high" (one level above)
    # arrives at step 5. With 2 steps per level "low" has gained more than one level by then;
    # with 100 it has not; without aging priority is strict.
    cfg = sim_config(64, block_size=16, max_num_seqs=1, aging_steps=aging_steps)
    core = SimCore(cfg)
    core.add(8, 10, priority=9)
    ids = {"low": core.add(8, 2, priority=0)}
    for _ in range(5):
        core.step()
    ids["high"] = core.add(8, 2, priority=1)
    order: list[int] = []
    while core.has_work:
        _, events = core.step()
        order += [e[0] for e in events if e[0] in ids.values() and e[0] not in order]
    assert order[0] == ids[first]


def test_fcfs_ignores_priority() -> None:
    core = SimCore(sim_config(4, block_size=16, scheduling_policy="fcfs"))
    early = core.add(63, 1, priority=0)
    core.add(63, 1, priority=9)
    _, events = core.step()
    assert [e[0] for e in events] == [early]


def test_long_prompts_are_prefilled_in_chunks() -> None:
    core = SimCore(sim_config(100, block_size=16, prefill_chunk_tokens=256), model=TOKENS)
    rid = core.add(600, 2)
    steps = [core.step() for _ in range(3)]
    assert [t for t, _ in steps] == [256, 256, 88]
    assert [ev for _, ev in steps] == [[], [], [(rid, TOKEN, False)]]  # first token at the end
    # A decode and a new prompt share a step's token budget (max_num_batched_tokens).
    core = SimCore(
        sim_config(100, block_size=16, prefill_chunk_tokens=256, max_num_batched_tokens=100),
        model=TOKENS,
    )
    a = core.add(10, 5)
    core.step()
    b = core.add(500, 2)
    tokens, events = core.step()
    assert tokens == 100 and [e[0] for e in events] == [a]  # 1 decode + 99 of b's prompt
    assert b in core.scheduler.unfinished() and not core.scheduler.is_waiting(b)
    whole = SimCore(sim_config(100, block_size=16, prefill_chunk_tokens=None), model=TOKENS)
    whole.add(600, 2)
    assert whole.step()[0] == 600


def test_step_time_grows_with_tokens() -> None:
    core = SimCore(sim_config(100), model=StepModel(base_s=0.01, per_token_s=0.001))
    core.add(100, 2)
    prefill, _ = core.step()
    decode, _ = core.step()
    assert prefill == pytest.approx(0.01 + 0.1)
    assert decode == pytest.approx(0.011)


def test_refuses_what_the_replica_refuses() -> None:
    core = SimCore(sim_config(4, block_size=16, max_waiting=1), max_model_len=128)
    with pytest.raises(NeverFits):
        core.add(60, 10)  # 70 tokens: 5 blocks
    with pytest.raises(TooLong):
        core.add(128, 1)
    core.add(10, 1)
    with pytest.raises(QueueFull, match="queue is full"):
        core.add(10, 1)
    assert core.rejections == 3
    with pytest.raises(ValueError, match="max_tokens"):
        core.add(10, 0)


def test_abort_frees_blocks() -> None:
    core = SimCore(sim_config(8))
    a = core.add(63, 50)
    core.step()
    assert core.free_blocks == 4
    core.abort(a)
    assert core.free_blocks == 8 and not core.has_work


def test_every_step_is_the_checked_schedulers() -> None:
    """The same arrivals through SimCore and through the scheduler tests' checked simulation
    (the invariants of every plan checked against its own shadow): the same tokens in every
    step, the same requests served, the same preemptions, under a pool small enough to preempt
    and prompts long enough to chunk."""
    cfg = sim_config(
        24,
        block_size=8,
        max_num_seqs=6,
        max_num_batched_tokens=48,
        max_waiting=64,
        aging_steps=3,
        prefill_chunk_tokens=20,
        max_model_len=192,
    )
    core = SimCore(cfg, model=TOKENS)
    checked = Sim(cfg, 24, 8, Chunked(20))
    rng = random.Random(4)
    arrivals: dict[int, list[tuple[int, int, int]]] = {}
    for _ in range(40):
        request = (rng.randint(1, 70), rng.randint(1, 40), rng.randint(0, 3))
        arrivals.setdefault(rng.randrange(60), []).append(request)
    step = 0
    while step < 60 or core.has_work:
        for prompt, max_tokens, priority in arrivals.get(step, []):
            a = core.add(prompt, max_tokens, priority)
            b = checked.add(Request([TOKEN] * prompt, max_tokens, priority))
            assert a == b
        tokens, events = core.step()
        plan = checked.step()
        assert tokens == plan.num_tokens
        assert [e[0] for e in events] == plan.decode + [c.id for c in plan.prefill if c.last]
        step += 1
        assert step < 5000
    checked.run()
    checked.check_done()
    assert core.preemptions == checked.preemptions > 0
    assert any(c.start > 0 for p in checked.plans for c in p.prefill)  # chunked


def test_the_deployment_takes_the_typed_request_and_streams_typed_outputs() -> None:
    """SimEngine's ``generate`` outside Serve: a ``GenerateRequest`` in, ``RequestOutput``
    deltas out (thinned by ``stream_every``), an ``ErrorRecord`` for what the scheduler
    refuses, as from a real replica."""
    engine_class: Any = SimEngine.func_or_class
    engine = engine_class(pool_blocks=8, step_base_s=0.0, step_per_token_s=0.0, stream_every=2,
                          max_waiting=4)

    async def collect(request: object) -> list[Any]:
        return [item async for item in engine.generate(request)]

    outs = asyncio.run(collect(GenerateRequest((5,) * 20, SamplingParams(max_tokens=5),
                                               priority=2)))
    assert all(isinstance(o, SimOutput) for o in outs)
    assert [o.token_ids for o in outs] == [[TOKEN], [TOKEN], [TOKEN, TOKEN], [TOKEN]]
    assert [o.completion_tokens for o in outs] == [1, 2, 4, 5]
    assert [o.finished for o in outs] == [False, False, False, True]
    assert outs[-1].finish_reason == "length" and outs[0].prompt_tokens == 20
    assert outs[0].cached_tokens == 0 and outs[-1].cached_tokens == 0
    assert outs[0].total_blocks == 8 and outs[0].arrived <= outs[0].at
    (never,) = asyncio.run(collect(GenerateRequest((5,) * 200, SamplingParams(max_tokens=5))))
    assert never == ErrorRecord(400, "never_fits", str(NeverFits(13, 8)), None)
    (empty,) = asyncio.run(collect(GenerateRequest((), SamplingParams(max_tokens=5))))
    assert (empty.status, empty.code, empty.param) == (400, "empty", "prompt")
    (untyped,) = asyncio.run(collect([1, 2, 3]))
    assert isinstance(untyped, ErrorRecord) and untyped.code == "invalid_request"
