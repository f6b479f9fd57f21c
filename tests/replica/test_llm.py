"""The offline ``LLM.generate`` in vLLM's shape, on the embedded tiny model (CPU, no download):
one ``RequestOutput`` per prompt, its ``n`` samples as ``CompletionOutput``s, log-probabilities
as ``Logprob``s by token id; bad input a ``ValueError`` before any work, the engine usable after.
The shaping of the log-probabilities is tested on records alone first."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from tierserve.records import GenerateRequest, SamplingParams, TokenLogprob
from tierserve.records import RequestOutput as EngineOutput
from tierserve.replica.llm import LLM, CompletionOutput, Logprob, RequestOutput, logprob_entry
from tierserve.replica.models.embedded import EMBEDDED_MODEL

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def name(token_id: int) -> str:
    return f"<{token_id}>"


def test_a_position_lists_the_drawn_token_first_with_its_rank_then_the_top_ones() -> None:
    outside = logprob_entry(TokenLogprob(7, -3.0, ((1, -0.5), (2, -1.0)), rank=9), name)
    assert list(outside) == [7, 1, 2]
    assert outside[7] == Logprob(-3.0, 9, "<7>")
    assert outside[1] == Logprob(-0.5, 1, "<1>") and outside[2] == Logprob(-1.0, 2, "<2>")
    inside = logprob_entry(TokenLogprob(2, -1.0, ((1, -0.5), (2, -1.0)), rank=2), name)
    assert list(inside) == [2, 1] and inside[2].rank == 2
    # A record without a rank (made elsewhere): its place among the top ones, else unknown.
    assert logprob_entry(TokenLogprob(1, -0.5, ((1, -0.5),)), name)[1].rank == 1
    assert logprob_entry(TokenLogprob(4, -2.0), name) == {4: Logprob(-2.0, None, "<4>")}


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(EMBEDDED_MODEL, num_kv_blocks=128, block_size=16, max_num_seqs=16,
               max_model_len=256)


def test_generate_answers_each_prompt_as_vllm_does(llm: LLM) -> None:
    text, ids = "Hello there", [5, 6, 7]
    prompts: list[str | list[int]] = [text, ids]
    a, b = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert isinstance(a, RequestOutput) and isinstance(a.outputs[0], CompletionOutput)
    assert a.request_id != b.request_id
    assert a.prompt == text and a.prompt_token_ids == llm.engine.encode(text)
    assert b.prompt is None and b.prompt_token_ids == ids
    for r in (a, b):
        assert r.finished and r.prompt_logprobs is None and r.num_cached_tokens is not None
        (out,) = r.outputs
        assert out.index == 0 and len(out.token_ids) == 4 and out.finished()
        assert out.finish_reason == "length" and out.stop_reason is None
        assert out.logprobs is None and out.cumulative_logprob is None
        assert out.text == llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    # One prompt alone (a string or one list of ids) is a list of one answer too.
    (alone,) = llm.generate(ids, GREEDY, use_tqdm=False)
    assert alone.outputs[0].token_ids == b.outputs[0].token_ids
    # vLLM's dict forms of a prompt.
    forms: list[dict[str, Any]] = [{"prompt": text}, {"prompt_token_ids": ids}]
    c, d = llm.generate(forms, GREEDY, use_tqdm=False)
    assert c.prompt == text and c.outputs[0].token_ids == a.outputs[0].token_ids
    assert d.prompt is None and d.outputs[0].token_ids == b.outputs[0].token_ids


def test_n_samples_share_the_prompt_and_draw_from_seeds_derived_from_its_seed(llm: LLM) -> None:
    p = SamplingParams(n=3, max_tokens=6, temperature=1.5, seed=41, ignore_eos=True)
    (r,) = llm.generate([[9, 10, 11, 12]], p, use_tqdm=False)
    assert [o.index for o in r.outputs] == [0, 1, 2] and r.finished
    got = [o.token_ids for o in r.outputs]
    assert len({tuple(t) for t in got}) > 1  # the samples differ
    # Sample i is what seed + i draws alone: reproducible.
    for i, tokens in enumerate(got):
        (one,) = llm.generate([[9, 10, 11, 12]], replace(p, n=1, seed=41 + i), use_tqdm=False)
        assert one.outputs[0].token_ids == tokens
    again = llm.generate([[9, 10, 11, 12]], p, use_tqdm=False)[0]
    assert [o.token_ids for o in again.outputs] == got


def test_logprobs_hold_the_drawn_token_and_the_top_ones(llm: LLM) -> None:
    p = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=3,
                       prompt_logprobs=2)
    (r,) = llm.generate([[20, 21, 22, 23, 24]], p, use_tqdm=False)
    (out,) = r.outputs
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids) == 5
    for tok, entry in zip(out.token_ids, out.logprobs, strict=True):
        assert next(iter(entry)) == tok and entry[tok].rank == 1  # greedy: the most likely
        assert len(entry) == 3 and sorted(lp.rank or 0 for lp in entry.values()) == [1, 2, 3]
        assert entry[tok].decoded_token == llm.tokenizer.decode([tok])
    assert out.cumulative_logprob == pytest.approx(
        sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs, strict=True)))
    lps = r.prompt_logprobs
    assert lps is not None and len(lps) == 5 and lps[0] is None
    for tok, scored in zip(r.prompt_token_ids[1:], lps[1:], strict=True):
        assert scored is not None and next(iter(scored)) == tok
        assert 2 <= len(scored) <= 3 and (scored[tok].rank or 0) >= 1


def test_stop_reason_names_the_stop_token_drawn(llm: LLM) -> None:
    (free,) = llm.generate([[30, 31]], replace(GREEDY, max_tokens=6), use_tqdm=False)
    stop = free.outputs[0].token_ids[2]
    (r,) = llm.generate([[30, 31]], replace(GREEDY, max_tokens=6, stop_token_ids=[stop]),
                        use_tqdm=False)
    out = r.outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.token_ids == free.outputs[0].token_ids[: free.outputs[0].token_ids.index(stop) + 1]


def test_bad_words_as_words_are_tokenized_as_the_ingress_does(llm: LLM) -> None:
    (free,) = llm.generate([[40, 41, 42]], replace(GREEDY, max_tokens=8), use_tqdm=False)
    drawn = free.outputs[0].token_ids
    tok = next(t for t in drawn if llm.tokenizer.decode([t]).strip()
               and list(llm.tokenizer.encode(llm.tokenizer.decode([t]).lstrip(),
                                             add_special_tokens=False)) == [t])
    word = llm.tokenizer.decode([tok]).lstrip()
    (r,) = llm.generate([[40, 41, 42]], replace(GREEDY, max_tokens=8, bad_words=[word]),
                        use_tqdm=False)
    assert tok not in r.outputs[0].token_ids
    # The engine takes token ids only: a record that still has words is refused, clearly.
    with pytest.raises(ValueError, match="bad_words reach the engine as token ids"):
        llm.engine.add_request(GenerateRequest.of([5, 6], SamplingParams(bad_words=[word])))


@pytest.mark.parametrize("call, match", [
    (lambda llm: llm.generate([], GREEDY), "no prompts"),
    (lambda llm: llm.generate([[5, 6], 3.5], GREEDY), "prompt 1 must be a string or a list"),
    (lambda llm: llm.generate({"prompt": "a", "x": 1}, GREEDY),
     r"prompt 0: a prompt dict is .* got the keys \['prompt', 'x'\]"),
    (lambda llm: llm.generate([{"prompt_token_ids": "ab"}], GREEDY), "prompt 0 must be"),
    (lambda llm: llm.generate([[5], [6]], [GREEDY]), "1 sampling params for 2 prompts"),
    (lambda llm: llm.generate([[5]], [None]), "sampling params 0 must be a SamplingParams"),
    (lambda llm: llm.generate([[5]], SamplingParams(n=0)), "n must be an integer of at least 1"),
    (lambda llm: llm.generate([[5]], SamplingParams(logprobs=21)), r"logprobs must be .* \[0, 20\]"),
    (lambda llm: llm.generate([[5]], SamplingParams(prompt_logprobs=-1)), "prompt_logprobs"),
    (lambda llm: llm.generate([[5]], SamplingParams(bad_words=[""])), "bad_words must be"),
    (lambda llm: llm.generate([[5]], SamplingParams(bad_words=["x" * 40])),
     "bad_words.0: a bad word is 1 to 16 tokens"),
])
def test_bad_input_is_a_value_error_before_any_work(llm: LLM, call: object, match: str) -> None:
    before = llm.stats()
    with pytest.raises(ValueError, match=match):
        call(llm)  # type: ignore[operator]
    after = llm.stats()
    assert after.waiting == after.running == 0 and after.free_blocks == before.free_blocks
    (ok,) = llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)  # the engine still serves
    assert len(ok.outputs[0].token_ids) == 4


def test_an_error_during_the_run_aborts_every_sample_and_the_engine_serves_on(
        llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    real = llm.engine.step
    calls = 0

    def failing() -> list[EngineOutput]:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise KeyboardInterrupt
        return real()

    monkeypatch.setattr(llm.engine, "step", failing)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([[5, 6, 7], [8, 9]], replace(GREEDY, n=2, max_tokens=8), use_tqdm=False)
    monkeypatch.undo()
    stats = llm.stats()
    assert stats.running == stats.waiting == 0 and stats.free_blocks == stats.total_blocks
    (ok,) = llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
    assert ok.finished
