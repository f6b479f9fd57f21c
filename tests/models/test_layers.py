"""Layers: the deterministic Linear, SiLU and RMSNorm give a row the same bits wherever it sits in
a batch of any size; rotary embeddings and Llama 3 frequencies match ``transformers``."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from replica.models.config import RopeScaling
from replica.models.layers import (
    RMSNorm,
    RotaryEmbedding,
    apply_rotary_,
    by_row_tiles,
    invariant_linear,
    linear_invariance_mismatches,
    rope_inv_freq,
    silu_and_mul,
)

# (in, out): the embedded model's projections and head, SmolLM2-135M's, odd sizes; and
# SmolLM2-135M's vocabulary head.
SHAPES = [(256, 384), (256, 1536), (768, 256), (256, 263), (576, 960), (1536, 576), (97, 67)]
HEAD = (576, 49152)
SIZES = (*range(1, 20), 31, 32, 33, 64, 100, 127, 128, 129, 255, 256, 257, 300)


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def _row_mismatches(
    fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, sizes: tuple[int, ...]
) -> list[tuple[int, int]]:
    """Cases (size, offset) where ``fn`` of a slice of ``x`` differs from the same rows of ``fn(x)``."""
    rng = random.Random(0)
    full = fn(x)
    bad = []
    for m in sizes:
        for off in {0, x.shape[0] - m, rng.randrange(x.shape[0] - m + 1)}:
            if not torch.equal(fn(x[off : off + m]), full[off : off + m]):
                bad.append((m, off))
    return bad


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_invariant_linear_rows_do_not_depend_on_the_batch(
    shape: tuple[int, int], threads: int
) -> None:
    k, n = shape
    gen = torch.Generator().manual_seed(k * n)
    w = torch.randn(n, k, generator=gen) / k**0.5
    b = torch.randn(n, generator=gen)
    x = torch.randn(520, k, generator=gen)
    assert _row_mismatches(lambda t: invariant_linear(t, w), x, SIZES) == []
    assert _row_mismatches(lambda t: invariant_linear(t, w, b), x, SIZES[:24]) == []
    torch.testing.assert_close(invariant_linear(x, w, b), torch.nn.functional.linear(x, w, b))


def test_invariant_linear_on_a_vocab_head(threads: int) -> None:
    k, n = HEAD
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(1)) / k**0.5
    assert linear_invariance_mismatches(w, sizes=(1, 2, 3, 5, 8, 13, 64)) == []


def test_row_tiles_give_the_same_rows_and_one_shape_per_call(threads: int) -> None:
    """The non-CPU deterministic path (fixed tiles of zero-padded rows), exercised on CPU."""
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(300, 200, generator=gen) / 200**0.5
    x = torch.randn(150, 200, generator=gen)
    shapes: set[tuple[int, ...]] = set()

    def linear(t: torch.Tensor) -> torch.Tensor:
        shapes.add(tuple(t.shape))
        return torch.nn.functional.linear(t, w)

    sizes = tuple(m for m in SIZES if m <= 150)
    assert _row_mismatches(lambda t: by_row_tiles(linear, t, 16), x, sizes) == []
    assert shapes == {(16, 200)}
    torch.testing.assert_close(by_row_tiles(linear, x, 16), x @ w.T)


@pytest.mark.parametrize("width", [64, 97, 136, 768])
def test_deterministic_silu_rows_do_not_depend_on_the_batch(width: int, threads: int) -> None:
    gate_up = torch.randn(300, 2 * width, generator=torch.Generator().manual_seed(width)) * 4
    assert _row_mismatches(lambda t: silu_and_mul(t, deterministic=True), gate_up, SIZES) == []
    torch.testing.assert_close(
        silu_and_mul(gate_up, deterministic=True),
        torch.nn.functional.silu(gate_up[:, :width]) * gate_up[:, width:],
    )


@pytest.mark.parametrize("width", [64, 97, 576, 4096])
def test_rmsnorm_rows_do_not_depend_on_the_batch(width: int, threads: int) -> None:
    gen = torch.Generator().manual_seed(width)
    norm = RMSNorm(width, 1e-5)
    norm.weight.data = torch.randn(width, generator=gen)
    x = torch.randn(300, width, generator=gen) * 3
    assert _row_mismatches(norm, x, SIZES) == []


def test_llama3_inverse_frequencies_match_transformers() -> None:
    scaling = RopeScaling(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=256
    )
    cfg = transformers.LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        rope_parameters=dict(
            rope_type="llama3",
            rope_theta=10000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=256,
        ),
    )
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    got = rope_inv_freq(16, 10000.0, scaling)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    plain = rope_inv_freq(16, 10000.0, None)
    assert not torch.allclose(got, plain)  # the scaling does change some frequencies
    assert got[0] == plain[0]  # ... but not the highest


def test_rotary_matches_transformers_and_rotates_strided_views_in_place() -> None:
    heads, kv_heads, d = 4, 2, 16
    rotary = RotaryEmbedding(d, 128, 10000.0, None)
    positions = torch.tensor([0, 1, 5, 77, 127, 3])
    qkv = torch.randn(6, heads + 2 * kv_heads, d)
    q, k, v = qkv[:, :heads].clone(), qkv[:, heads : heads + kv_heads].clone(), qkv[:, -2:].clone()
    apply_rotary_(qkv[:, : heads + kv_heads], *rotary(positions))
    freqs = positions[:, None].float() * rope_inv_freq(d, 10000.0, None)[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    want_q, want_k = apply_rotary_pos_emb(
        q.transpose(0, 1), k.transpose(0, 1), emb.cos(), emb.sin(), unsqueeze_dim=0
    )
    torch.testing.assert_close(qkv[:, :heads], want_q.transpose(0, 1), rtol=0, atol=1e-6)
    torch.testing.assert_close(
        qkv[:, heads : heads + kv_heads], want_k.transpose(0, 1), rtol=0, atol=1e-6
    )
    assert torch.equal(qkv[:, -2:], v)  # values are not rotated
