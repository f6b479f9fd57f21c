"""The engine and the offline LLM API on the embedded default model (CPU, torch backend)."""

from __future__ import annotations

import asyncio
import random
import threading
from dataclasses import replace

import pytest

from tierserve.records import GenerateRequest
from tierserve.replica.config import EngineConfig
from tierserve.replica.engine import Engine, EngineDead, RequestOutput
from tierserve.replica.llm import LLM
from tierserve.replica.models.embedded import EMBEDDED_MODEL
from tierserve.replica.sampler import SamplingParams
from tierserve.replica.scheduler import EmptyPrompt, NeverFits, QueueFull, TooLong

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 259) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@pytest.fixture(scope="module")
def roomy() -> LLM:
    return LLM(EMBEDDED_MODEL, num_kv_blocks=512, block_size=16, max_num_seqs=64, max_model_len=512)


def drain(engine: Engine) -> dict[int, list[RequestOutput]]:
    seen: dict[int, list[RequestOutput]] = {}
    for _ in range(10_000):
        if not engine.has_unfinished():
            return seen
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out)
    raise AssertionError("engine did not finish")


def test_64_concurrent_requests_complete_and_blocks_return(roomy: LLM) -> None:
    start = roomy.stats().free_blocks
    rng = random.Random(1)
    ps = prompts(64, seed=1, hi=120)
    params = [SamplingParams(max_tokens=rng.randint(1, 24), temperature=0.0, ignore_eos=True)
              for _ in ps]
    outs = [r.outputs[0] for r in roomy.generate(ps, params,
                                                 priority=[rng.randint(0, 5) for _ in ps],
                                                 use_tqdm=False)]
    assert [len(o.token_ids) for o in outs] == [p.max_tokens for p in params]
    assert all(o.finish_reason == "length" for o in outs)
    stats = roomy.stats()
    assert stats.free_blocks == start == stats.total_blocks
    assert stats.running == stats.waiting == 0


def test_preemption_keeps_greedy_outputs(roomy: LLM) -> None:
    ps = prompts(12, seed=2, lo=20, hi=40)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in roomy.generate(ps, params, use_tqdm=False)]
    tight = LLM(EMBEDDED_MODEL, num_kv_blocks=14, block_size=16, max_num_seqs=12, max_model_len=512)
    got = tight.generate(ps, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == want
    assert tight.stats().preemptions > 0
    assert tight.stats().free_blocks == 14


def test_seeded_sampling_alone_batched_and_across_preemption(roomy: LLM) -> None:
    ps = prompts(8, seed=3, lo=20, hi=40)
    params = [SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=100 + i,
                             ignore_eos=True) for i in range(8)]
    alone = [roomy.generate([p], [sp], use_tqdm=False)[0].outputs[0].token_ids
             for p, sp in zip(ps, params, strict=True)]
    batched = [o.outputs[0].token_ids for o in roomy.generate(ps, params, use_tqdm=False)]
    tight = LLM(EMBEDDED_MODEL, num_kv_blocks=12, block_size=16, max_num_seqs=8, max_model_len=512)
    preempted = [o.outputs[0].token_ids for o in tight.generate(ps, params, use_tqdm=False)]
    assert tight.stats().preemptions > 0
    assert alone == batched == preempted
    other = roomy.generate([ps[0]], [SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95,
                                                    seed=999, ignore_eos=True)], use_tqdm=False)
    assert other[0].outputs[0].token_ids != alone[0]


def _text_window(roomy: LLM, prompt: list[int]) -> tuple[str, int, str]:
    """The greedy text of ``prompt`` and a 2-character stop string inside it (not at the start)."""
    full = roomy.generate([prompt], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0]
    text = full.text
    for k in range(2, len(text) - 2):
        cand = text[k : k + 2]
        if "\ufffd" not in cand and text.find(cand) == k:
            return text, k, cand
    pytest.skip("the greedy text has no clean 2-character window")


def test_stop_string_across_tokens(roomy: LLM) -> None:
    prompt = [ord(c) for c in "Once upon a time"]
    text, k, stop = _text_window(roomy, prompt)
    out = roomy.generate([prompt], SamplingParams(max_tokens=30, temperature=0.0, stop=[stop],
                                                  ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.text == text[:k]
    assert stop not in out.text


def test_eos_stops_and_ignore_eos_continues() -> None:
    llm = LLM(EMBEDDED_MODEL, num_kv_blocks=64, max_model_len=256)
    prompt = prompts(1, seed=4)[0]
    free = llm.generate([prompt], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    eos = free.token_ids[3]
    first = free.token_ids.index(eos)
    llm.engine.eos_ids = frozenset({eos})
    stopped = llm.generate([prompt], SamplingParams(max_tokens=10, temperature=0.0),
                           use_tqdm=False)[0].outputs[0]
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free.token_ids[: first + 1]
    again = llm.generate([prompt], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0]
    assert again.token_ids == free.token_ids and again.finish_reason == "length"
    by_id = llm.generate([prompt], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True,
                                                  stop_token_ids=[eos]), use_tqdm=False)[0].outputs[0]
    assert by_id.token_ids == stopped.token_ids and by_id.finish_reason == "stop"
    assert stopped.stop_reason is None and by_id.stop_reason == eos  # EOS is no stop_reason
    # A stop token's own text is not output (its id is), unless include_stop_str_in_output;
    # whether special tokens are skipped or not (an EOS would otherwise show as "</s>").
    tok = llm.tokenizer
    for skip in (True, False):
        base = SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=[eos],
                              skip_special_tokens=skip)
        out = llm.generate([prompt], base, use_tqdm=False)[0].outputs[0]
        assert out.text == tok.decode(free.token_ids[:first], skip_special_tokens=skip)
        kept = llm.generate([prompt], replace(base, include_stop_str_in_output=True),
                            use_tqdm=False)[0].outputs[0]
        assert kept.token_ids == out.token_ids
        assert kept.text == tok.decode(free.token_ids[: first + 1], skip_special_tokens=skip)


def test_max_tokens_and_the_context_limit() -> None:
    llm = LLM(EMBEDDED_MODEL, num_kv_blocks=64, max_model_len=64)
    out = llm.generate([list(range(3, 63))], SamplingParams(max_tokens=100, temperature=0.0,
                                                             ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 4
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5


def test_priority_under_a_full_pool_runs_high_first() -> None:
    engine = Engine(EngineConfig(model=EMBEDDED_MODEL, num_kv_blocks=16, max_num_seqs=2, max_model_len=256,
                                 scheduling_policy="priority", aging_steps=0))
    ps = prompts(8, seed=5, lo=10, hi=20)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    low = [engine.add_request(GenerateRequest.of(p, params, priority=0)) for p in ps[:4]]
    high = [engine.add_request(GenerateRequest.of(p, params, priority=9)) for p in ps[4:]]
    order: list[int] = []
    while engine.has_unfinished():
        order += [o.request_id for o in engine.step() if o.finished]
    assert set(order[:4]) == set(high)
    assert set(order[4:]) == set(low)


def test_aging_lets_a_low_priority_request_through() -> None:
    engine = Engine(EngineConfig(model=EMBEDDED_MODEL, num_kv_blocks=32, max_num_seqs=1, max_model_len=256,
                                 scheduling_policy="priority", aging_steps=4))
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    low = engine.add_request(GenerateRequest.of([10, 11, 12], params, priority=0))
    done_at = None
    for step in range(400):
        engine.add_request(GenerateRequest.of([20, 21, 22], params, priority=3))  # a steady high-priority stream
        if any(o.request_id == low and o.finished for o in engine.step()):
            done_at = step
            break
    assert done_at is not None, "the low-priority request starved"
    assert done_at <= 3 * 4 * 2 + 8  # about P * A steps of waiting, plus its own service


def test_abort_of_running_and_waiting_returns_every_block() -> None:
    engine = Engine(EngineConfig(model=EMBEDDED_MODEL, num_kv_blocks=40, max_num_seqs=2, max_model_len=256))
    total = engine.stats().total_blocks
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(GenerateRequest.of(p, params)) for p in prompts(5, seed=6, lo=20, hi=40)]
    engine.step()
    engine.step()
    assert engine.stats().running == 2 and engine.stats().waiting == 3
    for rid in ids:
        assert engine.abort(rid)
    assert engine.stats().free_blocks == total
    assert not engine.has_unfinished()
    assert not engine.abort(ids[0])


@pytest.mark.parametrize(
    ("prompt", "params", "error", "match"),
    [
        ([], SamplingParams(max_tokens=4), EmptyPrompt, "empty"),
        (list(range(3, 200)), SamplingParams(max_tokens=4), TooLong, "context is 128"),
        ([5] * 20, SamplingParams(max_tokens=100), NeverFits, "pool holds only 4"),
        ([5, 6], None, ValueError, "max_tokens"),
        ([5, 99999], SamplingParams(max_tokens=4), ValueError, "out of range"),
    ],
)
def test_bad_input_is_refused_and_the_engine_serves_the_rest(
    prompt: list[int], params: SamplingParams | None, error: type[Exception], match: str
) -> None:
    llm = LLM(EMBEDDED_MODEL, num_kv_blocks=4, block_size=16, max_model_len=128)
    with pytest.raises(error, match=match):
        if params is None:
            SamplingParams(max_tokens=-1)
        llm.generate([[5, 6, 7], prompt], params, use_tqdm=False)
    assert llm.stats().free_blocks == 4 and llm.stats().waiting == 0
    ok = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)
    assert len(ok[0].outputs[0].token_ids) == 3


def test_queue_full_is_refused_by_the_engine_but_llm_generate_feeds_progressively() -> None:
    llm = LLM(EMBEDDED_MODEL, num_kv_blocks=64, max_num_seqs=2, max_waiting=2, max_model_len=128)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts(9, seed=7, hi=20), params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 3 for o in outs)
    for p in prompts(2, seed=8):
        llm.engine.add_request(GenerateRequest.of(p, params))
    with pytest.raises(QueueFull, match="full"):
        llm.engine.add_request(GenerateRequest.of([5, 6], params))
    drain(llm.engine)


def test_unknown_option_is_a_clear_error() -> None:
    with pytest.raises(TypeError, match="unknown engine option"):
        LLM(EMBEDDED_MODEL, num_kv_blokcs=4)


def test_background_loop_streams_and_abort_from_another_thread() -> None:
    engine = Engine(EngineConfig(model=EMBEDDED_MODEL, num_kv_blocks=64, max_num_seqs=8, max_model_len=256))
    engine.start()
    try:
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

        async def run() -> tuple[list[list[int]], int]:
            async def one(p: list[int]) -> list[int]:
                toks: list[int] = []
                async for out in engine.generate(GenerateRequest.of(p, params)):
                    toks += out.token_ids
                return toks

            async def leave_early(p: list[int]) -> int:
                n = 0
                async for _ in engine.generate(GenerateRequest.of(p, SamplingParams(max_tokens=200, temperature=0.0,
                                                                 ignore_eos=True))):
                    n += 1
                    if n == 2:
                        break
                return n

            results = await asyncio.gather(*(one(p) for p in prompts(6, seed=9)),
                                           leave_early([7, 8, 9]))
            return list(results[:-1]), results[-1]

        got, left = asyncio.run(run())
        assert all(len(t) == 8 for t in got) and left == 2
        # adds and aborts from plain threads while the loop runs
        ids: list[int] = []

        def add() -> None:
            ids.append(engine.add_request(GenerateRequest.of([5, 6, 7], SamplingParams(max_tokens=500, ignore_eos=True))))

        threads = [threading.Thread(target=add) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for rid in ids:
            engine.abort(rid)
        for _ in range(200):
            if engine.stats().free_blocks == engine.stats().total_blocks:
                break
            threading.Event().wait(0.01)
        assert engine.stats().free_blocks == engine.stats().total_blocks
        assert engine.alive
    finally:
        engine.shutdown()


def test_a_failing_step_fails_every_request_and_marks_the_engine_dead() -> None:
    engine = Engine(EngineConfig(model=EMBEDDED_MODEL, num_kv_blocks=64, max_model_len=256))

    def broken(*_: object, **__: object) -> None:
        raise RuntimeError("injected runner fault")

    engine.runner.forward = broken  # type: ignore[method-assign]
    engine.start()
    try:
        async def run() -> RequestOutput:
            last = None
            async for out in engine.generate(GenerateRequest.of([5, 6, 7], SamplingParams(max_tokens=4))):
                last = out
            assert last is not None
            return last

        last = asyncio.run(asyncio.wait_for(run(), timeout=60))
        assert last.finish_reason == "error" and "injected runner fault" in (last.failure or "")
        assert not engine.alive
        assert engine.stats().free_blocks == engine.stats().total_blocks
        with pytest.raises(EngineDead):
            engine.add_request(GenerateRequest.of([5, 6], SamplingParams(max_tokens=2)))
    finally:
        engine.shutdown()


def test_text_decoded_at_the_finish_equals_the_streamed_text(roomy: LLM) -> None:
    """``stream_text=False`` (what ``LLM.generate`` uses) defers decoding to the finish: the final
    text is the one the streamed deltas add up to, multi-byte characters included."""
    eng = roomy.engine
    ps = prompts(6, seed=11)
    ps.append([0xE2, 0x82])  # a prompt ending inside a UTF-8 character
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=3, ignore_eos=True)
    texts: dict[bool, list[str]] = {}
    for stream in (True, False):
        rids = [eng.add_request(GenerateRequest.of(p, params), stream_text=stream) for p in ps]
        seen = drain(eng)
        if not stream:  # nothing but the final output carries text
            assert all(o.text == "" for r in rids for o in seen[r][:-1])
        texts[stream] = ["".join(o.text for o in seen[r]) for r in rids]
        assert all(seen[r][-1].finished for r in rids)
    assert texts[False] == texts[True]
    assert any(t for t in texts[True])
    # With stop strings, text must be matched as it arrives: no deferral (the stop-string tests
    # above go through LLM.generate, i.e. stream_text=False).
    with pytest.raises(ValueError, match="feed\\(\\) skips stop-string matching"):
        from tierserve.replica.detokenizer import IncrementalDetokenizer

        IncrementalDetokenizer(eng.tokenizer, [1, 2], stop=["ab"]).feed([3])



def test_warm_up_runs_a_step_and_leaves_nothing_behind() -> None:
    """A replica warms up before serving: one small request through the step path, after
    which the pool is whole, nothing is queued, the step times and the SLO cost model are as
    before and the observer saw nothing; not once the loop runs."""
    seen: list[str] = []

    class Observer:
        def request_done(self, times: object) -> None:
            seen.append("request")

        def step_done(self, duration_s: float, tokens: int, preempted: int) -> None:
            seen.append("step")

        def rejected(self, reason: str, tier: str) -> None:
            seen.append("rejected")

        def grammar_compiled(self, kind: str, seconds: float) -> None:
            pass

        def grammar_lookup(self, hit: bool) -> None:
            pass

    engine = Engine(EngineConfig(model=EMBEDDED_MODEL, num_kv_blocks=16,
                                 kv_cache_memory_bytes=None, slo_scheduling=True),
                    observer=Observer())
    assert engine.scheduler.cost is not None
    before = engine.scheduler.cost.coefficients
    steps = engine.stats().steps
    assert engine.warm_up() > 0.0
    stats = engine.stats()
    assert stats.steps > steps  # it ran
    assert (stats.running, stats.waiting, stats.free_blocks) == (0, 0, 16)
    assert engine.scheduler.cost.coefficients == before and engine.scheduler.cost.observed == 0
    assert engine.times.steps == 0 and seen == []
    engine.start()
    try:
        with pytest.raises(RuntimeError, match="before start"):
            engine.warm_up()
    finally:
        engine.shutdown()
