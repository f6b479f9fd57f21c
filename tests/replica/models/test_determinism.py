"""Deterministic mode, bit for bit (``torch.equal``): chunked prefill equals one whole prefill (logits
and cached K/V), and a sequence's logits in a mixed batch equal its logits alone."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from tests.replica.models.helpers import PagedHarness, Work, save_checkpoint, tiny_hf_model
from tierserve.replica.models.embedded import build_model
from tierserve.replica.models.llama import LlamaForCausalLM, ModelOptions
from tierserve.replica.models.loader import load_model

pytestmark = pytest.mark.slow

DET = ModelOptions(deterministic=True)


@pytest.fixture(scope="module")
def embedded_det() -> LlamaForCausalLM:
    return build_model(DET)


@pytest.fixture(scope="module")
def qwen2_det(tmp_path_factory: pytest.TempPathFactory) -> LlamaForCausalLM:
    """A model with q/k/v biases and an odd MLP width (136 -> a 17-wide SIMD tail per row)."""
    path = save_checkpoint(tiny_hf_model("qwen2", seed=5), tmp_path_factory.mktemp("qwen2"))
    return load_model(str(path), options=DET)[0]


@pytest.fixture(scope="module")
def qwen3_det(tmp_path_factory: pytest.TempPathFactory) -> LlamaForCausalLM:
    """Qwen3: a q/k norm per head (its own native pass before the rotary + KV store), head_dim
    32 where hidden / heads is 16."""
    path = save_checkpoint(tiny_hf_model("qwen3", seed=5), tmp_path_factory.mktemp("qwen3"))
    return load_model(str(path), options=DET)[0]


@pytest.fixture(scope="module")
def gemma3_det(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Gemma 3: sliding (window 32) and global layers with their own rotary tables, (1 + w) norms
    in fp32, q/k head norms, the native GELU-tanh MLP; prompts here run past the window."""
    path = save_checkpoint(tiny_hf_model("gemma3", seed=5), tmp_path_factory.mktemp("gemma3"))
    return load_model(str(path), options=DET)[0]


def _tokens(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("model_name", ["embedded_det", "qwen2_det", "qwen3_det", "gemma3_det"])
@pytest.mark.parametrize("chunk", [1, 7, 16])
def test_chunked_prefill_equals_whole_prefill(
    model_name: str, chunk: int, request: pytest.FixtureRequest
) -> None:
    model: LlamaForCausalLM = request.getfixturevalue(model_name)
    prompt = _tokens(45, 256, seed=chunk)
    whole = PagedHarness(model, 1, 64)
    want = whole.step([Work(0, 0, prompt)])[0]
    chunked = PagedHarness(model, 1, 64)
    for start in range(0, len(prompt), chunk):
        got = chunked.step([Work(0, start, prompt[start : start + chunk])])[0]
    assert torch.equal(got, want)
    for (k1, v1), (k2, v2) in zip(chunked.kv(0, 45), whole.kv(0, 45), strict=True):
        assert torch.equal(k1, k2)
        assert torch.equal(v1, v2)


@dataclass
class _Seq:
    """A sequence's script: prefill ``prompt`` in ``chunk``-sized pieces from step ``first_step``,
    then greedy-decode ``decodes`` tokens. ``logits`` records every step's last-row logits."""

    prompt: list[int]
    chunk: int
    first_step: int
    decodes: int = 5
    tokens: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.tokens = list(self.prompt)
        self.done = 0  # prompt tokens computed

    def finished(self) -> bool:
        return len(self.tokens) - len(self.prompt) >= self.decodes

    def next_work(self, seq: int) -> Work:
        if self.done < len(self.prompt):
            piece = self.prompt[self.done : self.done + self.chunk]
            return Work(seq, self.done, piece)
        return Work(seq, len(self.tokens) - 1, [self.tokens[-1]])

    def record(self, work: Work, logits: torch.Tensor) -> None:
        self.logits.append(logits)
        if self.done < len(self.prompt):
            self.done += len(work.tokens)
            if self.done < len(self.prompt):
                return
        self.tokens.append(int(logits.argmax()))


def _script() -> list[_Seq]:
    lengths = (3, 9, 17, 30, 41, 5, 64, 23)
    chunks = (100, 4, 100, 7, 16, 1, 100, 10)
    starts = (0, 0, 1, 1, 2, 3, 3, 4)
    return [
        _Seq(_tokens(n, 263, seed=10 + i), c, s)
        for i, (n, c, s) in enumerate(zip(lengths, chunks, starts, strict=True))
    ]


def _run(model: LlamaForCausalLM, seqs: dict[int, _Seq]) -> list[tuple[int, int]]:
    """Run the scripts together; returns each step's (decode rows, prefill chunks)."""
    harness = PagedHarness(model, 8, 96)
    mix: list[tuple[int, int]] = []
    step = 0
    while not all(s.finished() for s in seqs.values()):
        live = [i for i, s in seqs.items() if step >= s.first_step and not s.finished()]
        work = [seqs[i].next_work(i) for i in live]
        prefills = sum(seqs[i].done < len(seqs[i].prompt) for i in live)
        mix.append((len(live) - prefills, prefills))
        if work:
            for i, w, logits in zip(live, work, harness.step(work), strict=True):
                seqs[i].record(w, logits)
        step += 1
    return mix


@pytest.mark.parametrize("model_name", ["embedded_det", "qwen3_det", "gemma3_det"])
def test_batch_of_eight_equals_each_alone(model_name: str, request: pytest.FixtureRequest) -> None:
    model: LlamaForCausalLM = request.getfixturevalue(model_name)
    batched = dict(enumerate(_script()))
    mix = _run(model, batched)
    assert any(dec >= 2 and pre >= 2 for dec, pre in mix), "batches should mix decodes and chunks"
    assert max(dec + pre for dec, pre in mix) == 8
    for i, script in enumerate(_script()):
        alone = {i: script}
        _run(model, alone)
        assert alone[i].tokens == batched[i].tokens
        assert len(alone[i].logits) == len(batched[i].logits)
        for a, b in zip(alone[i].logits, batched[i].logits, strict=True):
            assert torch.equal(a, b)


def test_default_mode_is_close_to_deterministic_mode(embedded_det: LlamaForCausalLM) -> None:
    fast = build_model()
    prompt = _tokens(33, 256, seed=3)
    a = PagedHarness(fast, 1, 64).step([Work(0, 0, prompt)], all_rows=True)[0]
    b = PagedHarness(embedded_det, 1, 64).step([Work(0, 0, prompt)], all_rows=True)[0]
    torch.testing.assert_close(a, b, rtol=0, atol=1e-4)
