"""What the engine streams besides text: log-probabilities of generated and prompt tokens, the
prompt-only request (``max_tokens`` 0), ``n`` samples of one prompt, and the new sampling fields
through the whole engine (batched, chunked and preempted requests sample the same tokens)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from tests.replica.models.helpers import PagedHarness, Work
from tests.replica.prefix_probe import probe_engine_caches
from tierserve.records import GenerateRequest
from tierserve.replica.config import EngineConfig
from tierserve.replica.engine import Engine, RequestOutput
from tierserve.replica.models.embedded import EMBEDDED_MODEL
from tierserve.replica.sampler import SamplingParams
from tierserve.replica.scheduler import QueueFull

PROMPT = [256, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33, 32, 84, 104, 101]


def engine(**options: Any) -> Engine:
    base: dict[str, Any] = {"model": EMBEDDED_MODEL, "num_kv_blocks": 64, "max_model_len": 256}
    if options.get("deterministic"):
        base["device"] = "cpu"  # the deterministic mode runs on CPU only, also on a GPU host
    return Engine(EngineConfig(**(base | options)))


def run(e: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[RequestOutput]]:
    """Every request's deltas, in order."""
    ids = [e.add_request(GenerateRequest.of(p, sp)) for p, sp in zip(prompts, params, strict=True)]
    got: dict[int, list[RequestOutput]] = {i: [] for i in ids}
    while e.has_unfinished():
        for out in e.step():
            got[out.request_id].append(out)
    return [got[i] for i in ids]


def test_generated_tokens_come_with_their_logprobs() -> None:
    e = engine()
    deltas = run(e, [PROMPT], [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                                              logprobs=5)])[0]
    model = e.runner.model
    tokens = [t for d in deltas for t in d.token_ids]
    lps = [lp for d in deltas for lp in d.logprobs or ()]
    assert len(lps) == len(tokens) == 6
    # The same positions through the model directly.
    logits = PagedHarness(model, 1, 64).step([Work(0, 0, PROMPT + tokens)], all_rows=True)[0]
    want = torch.log_softmax(logits[len(PROMPT) - 1 : -1], -1)
    for i, lp in enumerate(lps):
        assert lp.token == tokens[i]
        assert lp.logprob == pytest.approx(float(want[i, tokens[i]]), abs=1e-4)
        assert lp.top[0] == (tokens[i], pytest.approx(lp.logprob))  # greedy: the top one
        assert len(lp.top) == 5 and [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)


@pytest.mark.parametrize("chunk", [None, 4, 7])
def test_prompt_logprobs_with_max_tokens_zero_score_the_prompt(chunk: int | None) -> None:
    e = engine(deterministic=True, prefill_chunk_tokens=chunk)
    out = run(e, [PROMPT], [SamplingParams(max_tokens=0, prompt_logprobs=2)])[0]
    assert len(out) == 1 and out[0].finished and out[0].finish_reason == "length"
    assert out[0].token_ids == [] and out[0].completion_tokens == 0 and out[0].text == ""
    plp = out[0].prompt_logprobs
    assert plp is not None and len(plp) == len(PROMPT) and plp[0] is None
    logits = PagedHarness(e.runner.model, 1, 64).step([Work(0, 0, PROMPT)], all_rows=True)[0]
    want = torch.log_softmax(logits, -1)
    for pos in range(1, len(PROMPT)):
        lp = plp[pos]
        assert lp is not None and lp.token == PROMPT[pos] and len(lp.top) == 2
        # Deterministic mode: chunked or whole, the very same bits.
        assert lp.logprob == float(want[pos - 1, PROMPT[pos]])
    assert e.stats().free_blocks == e.stats().total_blocks


def test_prompt_scoring_computes_a_prefix_that_the_cache_holds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A prompt scored twice: the second request could start after the cached blocks of the
    first, but its logprobs need every position, so it computes them all (and answers alike)."""
    probe_engine_caches(monkeypatch)  # the engine's cache counts its hits
    e = engine(deterministic=True, block_size=8)
    first, again = (run(e, [PROMPT], [SamplingParams(max_tokens=0, prompt_logprobs=1)])[0][0]
                    for _ in range(2))
    assert e.stats().cached_blocks > 0  # the first request's blocks stayed cached
    assert first.prompt_logprobs is not None and again.prompt_logprobs is not None
    assert all(lp is not None for lp in again.prompt_logprobs[1:])
    assert again.prompt_logprobs == first.prompt_logprobs
    # A plain request of the same prompt does start after the cached prefix.
    run(e, [PROMPT], [SamplingParams(max_tokens=1)])
    counters = e.scheduler.blocks.counters  # type: ignore[attr-defined]
    assert counters.hit_tokens == (len(PROMPT) - 1) // 8 * 8


def test_n_samples_draw_from_seed_plus_index_and_admission_is_all_or_nothing() -> None:
    e = engine(max_waiting=4)
    e.start()
    try:
        params = SamplingParams(max_tokens=5, seed=40, temperature=0.9, ignore_eos=True)

        async def collect(n: int, p: SamplingParams) -> dict[int, list[int]]:
            got: dict[int, list[int]] = {}
            async for out in e.generate(GenerateRequest.of(PROMPT, p, n=n)):
                got.setdefault(out.index, []).extend(out.token_ids)
            return got

        many = asyncio.run(collect(3, params))
        assert sorted(many) == [0, 1, 2] and all(len(v) == 5 for v in many.values())
        for i in range(3):
            alone = asyncio.run(collect(1, SamplingParams(max_tokens=5, seed=40 + i,
                                                          temperature=0.9, ignore_eos=True)))
            assert alone[0] == many[i]
        with pytest.raises(QueueFull):
            asyncio.run(collect(6, params))  # 6 samples, room for 4 waiting
        assert e.stats().waiting == 0 and e.stats().running == 0
        with pytest.raises(ValueError, match="n must be a positive integer"):
            asyncio.run(collect(0, params))
    finally:
        e.shutdown()


def test_new_sampling_fields_are_batch_chunk_and_preemption_invariant() -> None:
    """Seeded sampling with penalties, bias, min-p and min_tokens: alone, in a batch, chunked
    and preempted (deterministic mode), every request draws the same tokens."""
    prompts = [PROMPT, PROMPT[3:14], [256, 65, 66, 67, 68, 69, 70, 71, 72, 73, 74, 75, 76, 77]]

    def params(i: int) -> SamplingParams:
        return SamplingParams(max_tokens=12, seed=7 + i, temperature=0.8, presence_penalty=0.6,
                              frequency_penalty=0.3, repetition_penalty=1.2, min_p=0.02,
                              logit_bias={65: 3.0}, min_tokens=4)

    def tokens(**options: Any) -> tuple[list[list[int]], Engine]:
        e = engine(deterministic=True, **options)
        out = run(e, prompts, [params(i) for i in range(3)])
        return [[t for d in r for t in d.token_ids] for r in out], e

    alone = [tokens()[0][i] for i in range(3)]  # (each run has all three: see below)
    single = []
    for i in range(3):
        e = engine(deterministic=True)
        single.append([t for d in run(e, [prompts[i]], [params(i)])[0] for t in d.token_ids])
    assert alone == single
    chunked, _ = tokens(prefill_chunk_tokens=5)
    assert chunked == single
    tight, e = tokens(num_kv_blocks=4, max_num_seqs=3, prefill_chunk_tokens=5)
    assert e.stats().preemptions > 0
    assert tight == single


def test_the_last_delta_carries_the_engines_one_clock() -> None:
    """TTFT and TPOT are timed once, by the engine, and the last delta carries them: the same
    figures its observer's ``RequestTimes`` get (the replica's report and metrics read these)."""
    seen: list[Any] = []

    class Observer:
        def request_done(self, times: Any) -> None:
            seen.append(times)

        def __getattr__(self, name: str) -> Any:
            return lambda *a, **k: None

    e = engine()
    e.observer = Observer()  # type: ignore[assignment]
    many, one = run(e, [PROMPT, PROMPT[:5]], [SamplingParams(max_tokens=6, ignore_eos=True),
                                              SamplingParams(max_tokens=1, ignore_eos=True)])
    by_tokens = {t.generated_tokens: t for t in seen}  # the one-token request finishes first
    for outs, times in ((many, by_tokens[6]), (one, by_tokens[1])):
        last = outs[-1]
        assert last.finished and not any(o.ttft_s is not None for o in outs[:-1])
        assert last.ttft_s is not None and last.ttft_s >= 0 and last.ttft_s == times.ttft_s
        assert last.tpot_s == times.tpot_s
    assert many[-1].tpot_s is not None and many[-1].tpot_s >= 0
    assert one[-1].tpot_s is None  # one token: no time between tokens
