"""Prefix caching through the whole engine, on the embedded model.

Requests share prefixes (a few "system prompts", short user suffixes), arrive over several steps,
are sometimes aborted and, in a tight pool, preempted. With the cache, later requests start
after their cached prefix; every request's answer is what it gets without the cache, and in the
deterministic mode every logit bit of every sampled row is the same: cached K/V were computed in
other chunks of other batches, and chunk and batch invariance make them identical.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.replica.prefix_probe import probe_engine_caches
from tierserve.records import GenerateRequest
from tierserve.replica.config import EngineConfig
from tierserve.replica.engine import Engine
from tierserve.replica.models.embedded import EMBEDDED_MODEL
from tierserve.replica.runner import ForwardBatch, StepLogits
from tierserve.replica.sampler import SamplingParams

pytestmark = pytest.mark.slow


@dataclass
class Plan:
    prompts: list[list[int]]
    arrivals: list[int]  # step at which each is added
    aborts: dict[int, int]  # request index -> step at which it is aborted
    max_tokens: list[int]
    num_kv_blocks: int
    chunk: int | None


@st.composite
def plans(draw: st.DrawFn) -> Plan:
    rng = random.Random(draw(st.integers(0, 2**16)))
    systems = [[rng.randrange(3, 250) for _ in range(draw(st.integers(16, 56)))]
               for _ in range(draw(st.integers(1, 3)))]
    n = draw(st.integers(2, 7))
    prompts = [rng.choice(systems) + [rng.randrange(3, 250) for _ in range(rng.randrange(1, 9))]
               for _ in range(n)]
    aborts = {i: draw(st.integers(0, 12)) for i in draw(st.sets(st.integers(0, n - 1), max_size=2))}
    return Plan(
        prompts=prompts,
        arrivals=sorted(draw(st.integers(0, 6)) for _ in range(n)),
        aborts=aborts,
        max_tokens=[draw(st.integers(1, 8)) for _ in range(n)],
        num_kv_blocks=draw(st.sampled_from([12, 64])),  # 12: preemptions
        chunk=draw(st.sampled_from([None, 7, 16])),
    )


def run(plan: Plan, cache: bool, **options: Any) -> tuple[dict[int, list[torch.Tensor]],
                                                         dict[int, list[int]], Engine]:
    engine = Engine(EngineConfig(model=EMBEDDED_MODEL, max_model_len=256, max_num_seqs=8,
                                 num_kv_blocks=plan.num_kv_blocks, enable_prefix_caching=cache,
                                 prefill_chunk_tokens=plan.chunk,
                                 **({"device": "cpu"} if options.get("deterministic") else {}),
                                 **options))
    logits: dict[int, list[torch.Tensor]] = {}
    forward = engine.runner.forward

    def recording(batch: ForwardBatch) -> StepLogits:
        out = forward(batch)
        for rid, row in zip(out.ids, out.logits, strict=True):
            logits.setdefault(rid, []).append(row.clone())
        return out

    engine.runner.forward = recording  # type: ignore[method-assign]
    ids: dict[int, int] = {}
    tokens: dict[int, list[int]] = {}
    step = 0
    while step < 400 and (len(ids) < len(plan.prompts) or engine.has_unfinished()):
        for i, t in enumerate(plan.arrivals):
            if t == step:
                params = SamplingParams(max_tokens=plan.max_tokens[i], temperature=0.0,
                                        ignore_eos=True)
                ids[i] = engine.add_request(GenerateRequest.of(plan.prompts[i], params))
        for i, t in plan.aborts.items():
            if t == step and i in ids:
                engine.abort(ids[i])
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
        step += 1
    assert not engine.has_unfinished()
    stats = engine.stats()
    assert stats.free_blocks == stats.total_blocks  # nothing leaked (cached blocks count free)
    done = {i: tokens.get(ids[i], []) for i in ids if i not in plan.aborts}
    return {i: logits.get(ids[i], []) for i in done}, done, engine


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plans())
def test_deterministic_logits_are_bit_identical_with_and_without_cache_hits(plan: Plan) -> None:
    with_cache, tokens_a, _engine = run(plan, True, deterministic=True)
    without, tokens_b, _ = run(plan, False, deterministic=True)
    assert tokens_a == tokens_b
    for i in with_cache:
        assert len(with_cache[i]) == len(without[i])
        for a, b in zip(with_cache[i], without[i], strict=True):
            assert torch.equal(a, b), f"request {i}: a logit bit changed with the cache"


def test_the_cache_is_hit_and_answers_do_not_change_in_the_default_mode(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    probe_engine_caches(monkeypatch)  # the engine's cache counts its hits
    rng = random.Random(3)
    system = [rng.randrange(3, 250) for _ in range(80)]
    prompts = [system + [rng.randrange(3, 250) for _ in range(4)] for _ in range(5)]
    plan = Plan(prompts, [0, 3, 3, 5, 6], {}, [6] * 5, 64, 32)
    _, with_cache, engine = run(plan, True)
    _, without, _ = run(plan, False)
    assert with_cache == without
    blocks = engine.scheduler.blocks
    counters = blocks.counters  # type: ignore[attr-defined]
    # The first request computes the 80-token prefix (5 blocks); the others find it.
    assert counters.hit_tokens == 4 * 80 and counters.queried_tokens == 5 * 84
    assert engine.stats().cached_blocks > 0
