"""Layers: the deterministic Linear, SiLU, RMSNorm and Qwen3's per-head q/k norm give a row the
same bits wherever it sits in a batch of any size (on the native kernels, on whatever CPU this
is: the failure messages name it); the deterministic Linear stays within fp32 rounding of a
float64 reference; the q/k norm, rotary embeddings and Llama 3 frequencies match
``transformers``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from tests.replica.models.helpers import row_mismatches
from tierserve.kernels import cpu_native
from tierserve.replica.models.config import RopeScaling
from tierserve.replica.models.layers import (
    Linear,
    RMSNorm,
    RotaryEmbedding,
    apply_rotary_,
    qk_norm_,
    rope_inv_freq,
    silu_and_mul,
)

pytestmark = pytest.mark.skipif(
    not cpu_native.available(),
    reason=f"native kernels unavailable: {cpu_native.unavailable_reason()}",
)

CPU = f"CPU capability {torch.backends.cpu.get_cpu_capability()}"
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


def _det_linear(w: torch.Tensor, b: torch.Tensor | None = None) -> Linear:
    layer = Linear(w.shape[1], w.shape[0], b is not None, deterministic=True)
    layer.weight.data.copy_(w)
    if b is not None:
        assert layer.bias is not None
        layer.bias.data.copy_(b)
    assert layer.pack_for_cpu()
    return layer


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_deterministic_linear_rows_do_not_depend_on_the_batch(
    shape: tuple[int, int], threads: int
) -> None:
    k, n = shape
    gen = torch.Generator().manual_seed(k * n)
    w = torch.randn(n, k, generator=gen) / k**0.5
    b = torch.randn(n, generator=gen)
    x = torch.randn(520, k, generator=gen)
    plain, biased = _det_linear(w), _det_linear(w, b)
    assert row_mismatches(plain, x, SIZES) == [], CPU
    assert row_mismatches(biased, x, SIZES[:24]) == [], CPU
    assert_within_fp32_bound(biased(x[:64]), x[:64], w, b)


def test_deterministic_linear_on_a_vocab_head(threads: int) -> None:
    k, n = HEAD
    gen = torch.Generator().manual_seed(1)
    head = _det_linear(torch.randn(n, k, generator=gen) / k**0.5)
    x = torch.randn(100, k, generator=gen)
    assert row_mismatches(head, x, (1, 2, 3, 5, 8, 13, 64)) == [], CPU


@pytest.mark.parametrize("shape", [(576, 960), (1536, 576), (97, 67), (4096, 40)])
def test_deterministic_linear_is_within_fp32_rounding_of_float64(shape: tuple[int, int]) -> None:
    """Whatever order the kernel sums in, each output is within the forward-error bound of any
    fp32 summation of k products and the bias: |y - y64| <= gamma(k + 1) (sum |x w| + |b|),
    gamma(n) = n u / (1 - n u), u = 2^-24. A kernel that computed in lower precision (bf16, a
    reduced-precision mode) or dropped terms would fail it."""
    k, n = shape
    gen = torch.Generator().manual_seed(k + n)
    w = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen)
    x = torch.randn(37, k, generator=gen) * 3
    assert_within_fp32_bound(_det_linear(w, b)(x), x, w, b)


def assert_within_fp32_bound(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> None:
    """``y`` is within gamma(k + 1) (sum |x w| + |b|) of ``x w^T + b`` computed in float64."""
    k = x.shape[1]
    want = x.double() @ w.double().T + b.double()
    u = 2.0**-24
    gamma = (k + 1) * u / (1 - (k + 1) * u)
    bound = gamma * (x.double().abs() @ w.double().abs().T + b.double().abs())
    err = (y.double() - want).abs()
    assert bool((err <= bound).all()), f"{CPU}: worst error / bound {float((err / bound).max()):.3f}"
    assert float((err / bound).max()) > 0  # the comparison is not vacuous: fp32 does round


@pytest.mark.parametrize("width", [64, 97, 136, 768])
def test_deterministic_silu_rows_do_not_depend_on_the_batch(width: int, threads: int) -> None:
    gate_up = torch.randn(300, 2 * width, generator=torch.Generator().manual_seed(width)) * 4
    assert row_mismatches(lambda t: silu_and_mul(t, deterministic=True), gate_up, SIZES) == [], CPU
    torch.testing.assert_close(
        silu_and_mul(gate_up, deterministic=True),
        torch.nn.functional.silu(gate_up[:, :width]) * gate_up[:, width:],
    )


@pytest.mark.parametrize("width", [64, 97, 576, 4096])
def test_deterministic_rmsnorm_rows_do_not_depend_on_the_batch(width: int, threads: int) -> None:
    gen = torch.Generator().manual_seed(width)
    norm = RMSNorm(width, 1e-5, deterministic=True)
    norm.weight.data = torch.randn(width, generator=gen)
    x = torch.randn(300, width, generator=gen) * 3
    assert row_mismatches(norm, x, SIZES) == [], CPU
    delta = torch.randn(300, width, generator=gen)

    def add_and_norm(pair: torch.Tensor) -> torch.Tensor:
        """Rows of ``[residual | delta]``: the residual stream += delta, then its norm."""
        return norm.add_and_norm(pair[:, :width].clone(), pair[:, width:].clone())

    pairs = torch.cat([x, delta], dim=1)
    assert row_mismatches(add_and_norm, pairs, SIZES[:20]) == [], CPU
    want = (x + delta) * torch.rsqrt((x + delta).pow(2).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(add_and_norm(pairs), want * norm.weight)


def _qk_normed(
    t: torch.Tensor, q_heads: int, kv_heads: int, qw: torch.Tensor, kw: torch.Tensor, det: bool
) -> torch.Tensor:
    """Rows ``[q | k | v]`` of ``t`` ``[rows, heads * D]`` after ``qk_norm_`` (in place, on a copy
    at the same offset from a 64-byte boundary as ``t``, so that an alignment shows through)."""
    heads, d = q_heads + 2 * kv_heads, qw.shape[0]
    lead = (t.data_ptr() // t.element_size()) % 16
    buf = torch.empty(t.numel() + 16)[lead : lead + t.numel()].view(t.shape).copy_(t)
    qk_norm_(buf.view(t.shape[0], heads, d), qw, kw, q_heads, 1e-6, deterministic=det)
    return buf


@pytest.mark.parametrize("head_dim", [32, 64, 80, 128])
def test_deterministic_qk_norm_heads_do_not_depend_on_the_batch_and_match_transformers(
    head_dim: int, threads: int
) -> None:
    """Qwen3's norm of each q and k head (over head_dim, its own weight for q and for k): a row's
    bits alone or in any batch; close to ``transformers``' Qwen3RMSNorm; v untouched."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    hq, hkv = 4, 2
    gen = torch.Generator().manual_seed(head_dim)
    qw = 1 + 0.1 * torch.randn(head_dim, generator=gen)
    kw = 1 + 0.1 * torch.randn(head_dim, generator=gen)
    x = torch.randn(300, (hq + 2 * hkv) * head_dim, generator=gen) * 3
    x[:, :head_dim] *= 40  # heads of very different scales in one row

    def det(t: torch.Tensor) -> torch.Tensor:
        return _qk_normed(t, hq, hkv, qw, kw, det=True)

    assert row_mismatches(det, x, SIZES) == [], CPU
    got = det(x).view(300, hq + 2 * hkv, head_dim)
    heads = x.view(300, hq + 2 * hkv, head_dim)
    with torch.no_grad():
        q_ref, k_ref = Qwen3RMSNorm(head_dim, eps=1e-6), Qwen3RMSNorm(head_dim, eps=1e-6)
        q_ref.weight.copy_(qw)
        k_ref.weight.copy_(kw)
        want_q, want_k = q_ref(heads[:, :hq]), k_ref(heads[:, hq : hq + hkv])
    torch.testing.assert_close(got[:, :hq], want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[:, hq : hq + hkv], want_k, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[:, hq + hkv :], heads[:, hq + hkv :])
    cpu_native.enabled = False  # the torch ops (the GPU's unfused path) agree
    try:
        plain = _qk_normed(x, hq, hkv, qw, kw, det=False)
    finally:
        cpu_native.enabled = True
    torch.testing.assert_close(plain, det(x), rtol=1e-5, atol=1e-5)


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
