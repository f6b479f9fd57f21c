"""Structured outputs in the engine, on the embedded model (random weights: its free text is
gibberish, so every output that matches its grammar does so because of the mask).

What the mask must hold with: batches that mix constrained and free rows, ``n`` samples, seeds,
penalties and biases, chunked prefill, prefix-cache hits, preemption by recompute, the
deterministic mode; compilation once per spec, off the step loop; clear errors that leave
nothing behind.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from dataclasses import replace
from typing import Any

import jsonschema
import pytest

from tests.replica.test_grammar_queue import Hold
from tierserve.records import (
    GenerateRequest,
    InvalidSamplingParam,
    SamplingParams,
    StructuredOutput,
)
from tierserve.replica.config import EngineConfig
from tierserve.replica.engine import Engine, RequestOutput
from tierserve.replica.llm import LLM
from tierserve.replica.models.embedded import EMBEDDED_MODEL
from tierserve.replica.scheduler import AdmitError, QueueFull
from tierserve.replica.structured import GrammarError, plan

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "colour": {"enum": ["red", "green", "blue"]},
        "size": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["colour", "size", "ok", "tags"],
    "additionalProperties": False,
}
JSON = StructuredOutput("json", json.dumps(SCHEMA), any_whitespace=False)
REGEX = StructuredOutput("regex", r"[a-c]{2,5}-[0-9]{1,3}")
CHOICE = StructuredOutput("choice", json.dumps(["alpha", "beta", "gamma δ"]))
GRAMMAR = StructuredOutput(
    "grammar", 'root ::= "(" item ("," item)? ("," item)? ")"\nitem ::= [xyz] [xyz]? [xyz]?')


def matches(spec: StructuredOutput, text: str) -> bool:
    if spec.kind == "json":
        try:
            jsonschema.validate(json.loads(text), json.loads(spec.spec))
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    if spec.kind == "regex":
        return re.fullmatch(spec.spec, text) is not None
    if spec.kind == "choice":
        return text in json.loads(spec.spec)
    return re.fullmatch(r"\([xyz]{1,3}(,[xyz]{1,3}){0,2}\)", text) is not None


def params(spec: StructuredOutput | None, **kw: Any) -> SamplingParams:
    base: dict[str, Any] = {"max_tokens": 120, "temperature": 0.8, "seed": 7}
    return SamplingParams(**(base | kw), structured=spec)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(EMBEDDED_MODEL, num_kv_blocks=512, block_size=16, max_num_seqs=64,
               max_model_len=512)


@pytest.mark.parametrize("spec", [JSON, REGEX, CHOICE, GRAMMAR], ids=lambda s: s.kind)
@pytest.mark.parametrize("temperature", [0.0, 1.0, 1.8])
def test_every_output_matches_its_grammar_and_ends_there(llm: LLM, spec: StructuredOutput,
                                                        temperature: float) -> None:
    outs = llm.generate(["hello", "a longer prompt of several words", "x"],
                        params(spec, temperature=temperature), use_tqdm=False)
    for o in (r.outputs[0] for r in outs):
        assert o.finish_reason == "stop", o
        assert matches(spec, o.text), o.text


def test_free_rows_are_untouched_by_constrained_rows_in_their_batch(llm: LLM) -> None:
    free = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(["abc", "defgh"], free, use_tqdm=False)]
    mixed = llm.generate(["abc", "q1", "defgh", "q2"], [free, params(JSON), free, params(REGEX)],
                         use_tqdm=False)
    assert [mixed[0].outputs[0].token_ids, mixed[2].outputs[0].token_ids] == alone
    assert matches(JSON, mixed[1].outputs[0].text) and matches(REGEX, mixed[3].outputs[0].text)


def test_seeded_constrained_sampling_is_the_same_alone_and_batched(llm: LLM) -> None:
    p = params(JSON, temperature=1.2, seed=11)
    alone = llm.generate(["seeded"], p, use_tqdm=False)[0].outputs[0].token_ids
    noise = [params(REGEX, seed=s) for s in range(5)]
    batched = llm.generate(["r0", "seeded", "r1", "r2", "r3", "r4"],
                           [noise[0], p, *noise[1:]], use_tqdm=False)
    assert batched[1].outputs[0].token_ids == alone


def test_penalties_and_biases_apply_inside_the_grammar(llm: LLM) -> None:
    # A bias that would pick "beta"'s first token every time cannot take the output outside the
    # grammar; penalties too.
    p = params(CHOICE, temperature=0.0, repetition_penalty=1.5, presence_penalty=1.0,
               frequency_penalty=0.5, logit_bias={ord("z"): 100.0})
    outs = llm.generate(["pen", "alties"], p, use_tqdm=False)
    assert all(matches(CHOICE, o.text) and o.finish_reason == "stop"
               for o in (r.outputs[0] for r in outs))


def test_ignore_eos_still_ends_where_the_grammar_does(llm: LLM) -> None:
    outs = llm.generate(["e"], params(REGEX, ignore_eos=True, temperature=0.0), use_tqdm=False)
    out = outs[0].outputs[0]
    assert out.finish_reason == "stop" and matches(REGEX, out.text)


def test_max_tokens_cuts_a_constrained_output_as_any_other(llm: LLM) -> None:
    out = llm.generate(["cut"], params(JSON, max_tokens=5), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    assert out.text.startswith("{")


def test_n_samples_each_follow_the_grammar_with_a_matcher_of_their_own() -> None:
    engine = Engine(EngineConfig(model=EMBEDDED_MODEL, num_kv_blocks=256, max_num_seqs=16))

    async def run() -> dict[int, str]:
        texts: dict[int, str] = {}
        async for out in engine.generate(GenerateRequest.of([5, 6, 7], params(GRAMMAR, temperature=1.5), n=4)):
            texts[out.index] = texts.get(out.index, "") + out.text
        return texts

    engine.start()
    try:
        texts = asyncio.run(run())
    finally:
        engine.shutdown()
    assert sorted(texts) == [0, 1, 2, 3]
    assert all(matches(GRAMMAR, t) for t in texts.values()), texts
    assert len(set(texts.values())) > 1  # seeds seed + i: not one matcher shared
    assert engine.grammars.compiled == 1


def test_preemption_by_recompute_continues_each_matcher(llm: LLM) -> None:
    prompts = [[3 + (i * 7 + j) % 200 for j in range(30 + i)] for i in range(10)]
    p = params(JSON, temperature=0.0, max_tokens=80)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, p, use_tqdm=False)]
    tight = LLM(EMBEDDED_MODEL, num_kv_blocks=12, block_size=16, max_num_seqs=10,
                max_model_len=512)
    got = [r.outputs[0] for r in tight.generate(prompts, p, use_tqdm=False)]
    assert tight.stats().preemptions > 0
    assert [o.token_ids for o in got] == want
    assert all(matches(JSON, o.text) for o in got if o.finish_reason == "stop")
    assert tight.stats().free_blocks == tight.stats().total_blocks


def test_chunked_prefill_and_prefix_cache_hits_keep_the_output() -> None:
    long_prompt = [3 + i % 250 for i in range(200)]
    p = params(REGEX, temperature=0.0)
    whole = LLM(EMBEDDED_MODEL, num_kv_blocks=256, block_size=16, max_num_batched_tokens=512,
                enable_prefix_caching=False)
    chunked = LLM(EMBEDDED_MODEL, num_kv_blocks=256, block_size=16, max_num_batched_tokens=32,
                  enable_prefix_caching=True)
    want = whole.generate([long_prompt], p, use_tqdm=False)[0].outputs[0]
    first = chunked.generate([long_prompt], p, use_tqdm=False)[0].outputs[0]
    repeated = chunked.generate([long_prompt], p, use_tqdm=False)[0]
    again = repeated.outputs[0]
    assert first.token_ids == want.token_ids == again.token_ids
    assert (repeated.num_cached_tokens or 0) > 0
    assert matches(REGEX, want.text)


def test_deterministic_mode_gives_the_same_bits_alone_and_batched() -> None:
    det = LLM(EMBEDDED_MODEL, num_kv_blocks=256, block_size=16, max_num_seqs=16,
              deterministic=True)
    p = params(JSON, temperature=0.9, seed=5)
    alone = det.generate(["det"], p, use_tqdm=False)[0].outputs[0].token_ids
    batched = det.generate(["other", "det", "more text here"],
                           [params(None, seed=1), p, params(CHOICE)], use_tqdm=False)
    assert batched[1].outputs[0].token_ids == alone


def test_the_same_spec_compiles_once_and_a_new_one_again(llm: LLM) -> None:
    grammars = llm.engine.grammars
    spec = StructuredOutput("regex", "[0-9]{4}")
    before = grammars.compiled
    for _ in range(3):
        llm.generate(["once"], params(spec), use_tqdm=False)
    assert grammars.compiled == before + 1
    llm.generate(["twice"], params(replace(spec, spec="[0-9]{5}")), use_tqdm=False)
    assert grammars.compiled == before + 2


def test_a_compiling_grammar_does_not_block_the_step_loop() -> None:
    """A request whose grammar compiles waits for it; the step loop serves the others meanwhile
    (the compilation is held open here until a free request has finished)."""
    engine = Engine(EngineConfig(model=EMBEDDED_MODEL, num_kv_blocks=128, max_num_seqs=8))
    gate = threading.Event()
    compile_job = engine.grammars._compile_job

    def slow_compile(job: Any) -> Any:
        assert gate.wait(60)
        return compile_job(job)

    engine.grammars._compile_job = slow_compile  # type: ignore[method-assign]

    async def run() -> tuple[list[str], str]:
        order: list[str] = []

        async def constrained() -> str:
            text = ""
            async for out in engine.generate(GenerateRequest.of([4, 5], params(REGEX))):
                text += out.text
            order.append("constrained")
            return text

        async def free() -> None:
            outs: list[RequestOutput] = []
            async for out in engine.generate(GenerateRequest.of([6, 7], SamplingParams(max_tokens=8, ignore_eos=True))):
                outs.append(out)
            order.append("free")
            assert len(outs) == 8
            gate.set()

        text, _ = await asyncio.gather(constrained(), free())
        return order, text

    engine.start()
    try:
        order, text = asyncio.run(run())
    finally:
        gate.set()
        engine.shutdown()
    assert order == ["free", "constrained"]
    assert matches(REGEX, text)


@pytest.mark.parametrize(
    ("spec", "said"),
    [
        (StructuredOutput("regex", "(", "guided_regex"), "parenthesis"),
        (StructuredOutput("grammar", "root ::= undefined_rule", "structured_outputs.grammar"),
         "undefined_rule"),
        (StructuredOutput("json", '{"type": "objekt"}', "guided_json"), "objekt"),
    ],
)
def test_a_spec_that_does_not_compile_is_refused_with_its_field_and_leaves_nothing(
        llm: LLM, spec: StructuredOutput, said: str) -> None:
    start = llm.stats()
    with pytest.raises(GrammarError) as e:
        llm.generate(["bad"], params(spec), use_tqdm=False)
    assert e.value.param == spec.param and said in str(e.value)
    assert f"{spec.param}: the {spec.kind} does not compile" in str(e.value)
    with pytest.raises(GrammarError):  # not cached: the same spec fails the same way again
        llm.engine.add_request(GenerateRequest.of([1, 2], params(spec)))
    stats = llm.stats()
    assert stats.free_blocks == start.free_blocks and stats.running == stats.waiting == 0


def test_the_async_path_refuses_before_admission() -> None:
    engine = Engine(EngineConfig(model=EMBEDDED_MODEL, num_kv_blocks=64))

    async def run() -> None:
        async for _ in engine.generate(GenerateRequest.of([1, 2, 3], params(StructuredOutput("regex", "[", "r")))):
            pass

    engine.start()
    try:
        with pytest.raises(GrammarError):
            asyncio.run(run())
        assert not engine.has_unfinished()
    finally:
        engine.shutdown()


@pytest.mark.parametrize(
    ("kw", "param"),
    [({"min_tokens": 3}, "min_tokens"), ({"max_tokens": 0}, "structured_outputs")],
)
def test_sampling_params_refuse_what_a_grammar_cannot_take(kw: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidSamplingParam) as e:
        SamplingParams(**({"max_tokens": 8} | kw), structured=REGEX)
    assert e.value.param == param


@pytest.mark.parametrize(
    ("kw", "said"),
    [({"kind": "yaml", "spec": "x"}, "kind must be one of"),
     ({"kind": "regex", "spec": ""}, "needs its spec"),
     ({"kind": "regex", "spec": "a", "prefix": "<"}, "prefix and suffix")],
)
def test_a_structured_output_record_checks_itself(kw: dict[str, Any], said: str) -> None:
    with pytest.raises(InvalidSamplingParam, match=said):
        StructuredOutput(**kw)


# ---------------------------------------------------------------- compiles and the engine


def new_schema(tag: str) -> StructuredOutput:
    return StructuredOutput("json", json.dumps(
        {"type": "object", "properties": {tag: {"type": "integer", "minimum": 0, "maximum": 999}},
         "required": [tag]}),
        any_whitespace=False)


def test_a_request_the_engine_would_refuse_is_refused_before_its_grammar_compiles() -> None:
    engine = Engine(EngineConfig(model=EMBEDDED_MODEL, num_kv_blocks=64, max_model_len=32))
    too_long = list(range(3, 43))

    async def run() -> None:
        async for _ in engine.generate(GenerateRequest.of(too_long, params(new_schema("too_long"), max_tokens=4))):
            pass

    engine.start()
    try:
        with pytest.raises(AdmitError) as e:
            asyncio.run(run())
        assert e.value.reason == "too_long"
        with pytest.raises(AdmitError):
            engine.validate(GenerateRequest.of(too_long, params(new_schema("validate"), max_tokens=4)))
        with pytest.raises(AdmitError):
            engine.add_request(GenerateRequest.of(too_long, params(new_schema("add"), max_tokens=4)))
        assert engine.grammars.compiled == 0 and engine.grammars.cache_entries == 0
        assert not engine.has_unfinished() and engine.num_waiting() == 0
    finally:
        engine.shutdown()


def test_requests_waiting_for_their_grammar_count_as_waiting_and_in_a_full_queue() -> None:
    engine = Engine(EngineConfig(model=EMBEDDED_MODEL, num_kv_blocks=64, max_waiting=2))
    hold = Hold(engine.grammars)

    async def one(spec: StructuredOutput) -> str:
        text = ""
        async for out in engine.generate(GenerateRequest.of([4, 5], params(spec, max_tokens=40))):
            text += out.text
        return text

    async def run() -> None:
        first = asyncio.ensure_future(one(new_schema("first")))
        await hold.first_reached()
        second = asyncio.ensure_future(one(new_schema("second")))
        await asyncio.sleep(0)
        assert engine.num_waiting() == 2 and engine.stats().waiting == 2
        # The queue is full, counting them: refused before a third compile is queued.
        with pytest.raises(QueueFull):
            await one(new_schema("third"))
        hold.release()
        await asyncio.gather(first, second)
        assert hold.order == [plan(new_schema(t)).key[1] for t in ("first", "second")]

    engine.start()
    try:
        asyncio.run(run())
    finally:
        engine.shutdown()
    assert engine.num_waiting() == 0 and engine.stats().waiting == 0


def test_a_client_that_leaves_while_its_grammar_compiles_leaves_nothing_behind() -> None:
    engine = Engine(EngineConfig(model=EMBEDDED_MODEL, num_kv_blocks=64))
    hold = Hold(engine.grammars)
    spec = new_schema("left")

    async def one(s: StructuredOutput) -> str:
        text = ""
        async for out in engine.generate(GenerateRequest.of([4, 5], params(s, max_tokens=40))):
            text += out.text
        return text

    async def run() -> None:
        ahead = asyncio.ensure_future(one(new_schema("ahead")))
        await hold.first_reached()
        leaving = asyncio.ensure_future(one(spec))
        staying = asyncio.ensure_future(one(spec))
        await asyncio.sleep(0)
        leaving.cancel()  # the client hung up while the compile was queued
        await asyncio.sleep(0)
        hold.release()
        assert matches(spec, await staying)
        await ahead
        with pytest.raises(asyncio.CancelledError):
            await leaving
        assert matches(spec, await one(spec))  # and the next request with it is served

    engine.start()
    try:
        asyncio.run(run())
    finally:
        engine.shutdown()
    assert engine.grammars.compiled == 2 and engine.grammars.waiting == 0
    assert not engine.has_unfinished()
