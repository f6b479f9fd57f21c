"""Deterministic mode through the whole engine: a request's logits, bit for bit, do not depend on
the batch it shares, on how its prompt was chunked, or on preemption and recompute."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from tierserve.records import GenerateRequest
from tierserve.replica.config import EngineConfig
from tierserve.replica.engine import Engine
from tierserve.replica.models.embedded import EMBEDDED_MODEL
from tierserve.replica.runner import ForwardBatch, StepLogits
from tierserve.replica.sampler import SamplingParams

pytestmark = pytest.mark.slow

PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def prompts(n: int, seed: int) -> list[list[int]]:
    """Lengths 13, 15, 29, 31, ...: each request's answer crosses a 16-token block boundary."""
    rng = random.Random(seed)
    lengths = [13, 15, 29, 31, 14, 30][:n]
    return [[rng.randrange(3, 259) for _ in range(k)] for k in lengths]


def run(ps: list[list[int]], **options: Any) -> tuple[list[list[torch.Tensor]], Engine]:
    """Every sampled row's logits per request (in order), from an engine with ``options``."""
    engine = Engine(EngineConfig(model=EMBEDDED_MODEL, deterministic=True, device="cpu", max_model_len=256,
                                 **options))
    seen: dict[int, list[torch.Tensor]] = {}
    forward = engine.runner.forward

    def recording(batch: ForwardBatch) -> StepLogits:
        out = forward(batch)
        for rid, row in zip(out.ids, out.logits, strict=True):
            seen.setdefault(rid, []).append(row.clone())
        return out

    engine.runner.forward = recording  # type: ignore[method-assign]
    ids = [engine.add_request(GenerateRequest.of(p, PARAMS)) for p in ps]
    while engine.has_unfinished():
        engine.step()
    return [seen[i] for i in ids], engine


def same(a: list[list[torch.Tensor]], b: list[list[torch.Tensor]]) -> bool:
    return len(a) == len(b) and all(
        len(x) == len(y) and all(torch.equal(u, v) for u, v in zip(x, y, strict=True))
        for x, y in zip(a, b, strict=True)
    )


def test_batch_chunking_and_preemption_do_not_change_a_single_bit() -> None:
    ps = prompts(4, seed=11)
    alone = [run([p], num_kv_blocks=64)[0][0] for p in ps]
    batched, _ = run(ps, num_kv_blocks=64, max_num_seqs=8)
    assert same(batched, alone)
    for chunk in (1, 7, 16):
        chunked, _ = run(ps, num_kv_blocks=64, max_num_seqs=8, prefill_chunk_tokens=chunk)
        assert same(chunked, alone), f"chunks of {chunk} changed the logits"
    tight, engine = run(ps, num_kv_blocks=4, max_num_seqs=4, prefill_chunk_tokens=7)
    assert engine.stats().preemptions > 0
    assert same(tight, alone)


def test_batched_greedy_equals_alone_in_the_default_mode() -> None:
    ps = prompts(4, seed=12)
    engine_alone = Engine(EngineConfig(model=EMBEDDED_MODEL, max_model_len=256, num_kv_blocks=64))
    engine_batch = Engine(EngineConfig(model=EMBEDDED_MODEL, max_model_len=256, num_kv_blocks=64, max_num_seqs=8))
    a = [o.token_ids for o in _greedy(engine_alone, ps[:1])]
    b = [o.token_ids for o in _greedy(engine_batch, ps)][:1]
    assert a == b


def _greedy(engine: Engine, ps: list[list[int]]) -> list[Any]:
    from tierserve.replica.engine import RequestOutput

    outs: dict[int, RequestOutput] = {}
    ids = [engine.add_request(GenerateRequest.of(p, PARAMS)) for p in ps]
    while engine.has_unfinished():
        for o in engine.step():
            prev = outs.get(o.request_id)
            if prev is not None:
                o.token_ids = prev.token_ids + o.token_ids
            outs[o.request_id] = o
    return [outs[i] for i in ids]
