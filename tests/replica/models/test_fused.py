"""The fused Triton kernels (``tierserve.kernels.fused``) against the torch ops they replace, and the model on
the triton backend with them on against the same model with them off.

Without a GPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set here before
the kernels are first imported; a run that imported them compiled for a GPU first skips)."""

from __future__ import annotations

import dataclasses
import itertools
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.replica.models.helpers import randomize_
from tierserve.kernels import fused, reference, triton_attention
from tierserve.kernels.metadata import SeqSpec, build_metadata
from tierserve.replica.models.config import (
    LongRopeScaling,
    ModelConfig,
    YarnScaling,
    yarn_mscale,
)
from tierserve.replica.models.layers import RMSNorm, apply_rotary_, qk_norm_
from tierserve.replica.models.llama import LlamaForCausalLM, ModelOptions

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _interpreted() -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return triton_attention.interpreted() and isinstance(fused._rms_norm_kernel, InterpretedFunction)


pytestmark = [
    pytest.mark.triton,
    pytest.mark.skipif(
        DEVICE == "cpu" and not _interpreted(),
        reason="no GPU, and the Triton kernels were imported before TRITON_INTERPRET=1 was set",
    ),
]

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (atol, rtol) of a result that may differ by a rounding step of its dtype.
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows, width", [(1, 64), (3, 96), (5, 576)])
@pytest.mark.parametrize("with_delta", [False, True], ids=["norm", "add-norm"])
def test_rms_norm_matches_the_torch_norm(
    dtype: torch.dtype, rows: int, width: int, with_delta: bool
) -> None:
    g = _gen(rows * width)
    x = (torch.randn(rows, width, generator=g) * 3).to(dtype).to(DEVICE)
    delta = torch.randn(rows, width, generator=g).to(dtype).to(DEVICE) if with_delta else None
    ref_norm = RMSNorm(width, 1e-5, dtype=dtype, device=DEVICE)
    with torch.no_grad():
        ref_norm.weight.copy_(1 + 0.1 * torch.randn(width, generator=g))
    ref_x = x.clone()
    want = ref_norm.add_and_norm(ref_x, delta)
    got_x = x.clone()
    got = fused.rms_norm(got_x, ref_norm.weight, 1e-5, delta)
    assert got.dtype == dtype and got.shape == (rows, width)
    atol, rtol = TOL[dtype]
    if dtype == torch.bfloat16 and DEVICE == "cpu":
        # The interpreter's float -> bf16 conversion truncates where a GPU rounds to nearest.
        torch.testing.assert_close(got_x, ref_x, atol=0, rtol=1e-2)
    else:
        assert torch.equal(got_x, ref_x)  # the new residual: the same sum, rounded alike
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)


def test_rms_norm_takes_strided_rows_and_leaves_the_input_alone_without_delta() -> None:
    x = torch.randn(4, 2 * 64, generator=_gen(1)).to(DEVICE)[:, :64]
    w = torch.rand(64, generator=_gen(2)).to(DEVICE)
    before = x.clone()
    got = fused.rms_norm(x, w, 1e-6)
    want = RMSNorm(64, 1e-6, device=DEVICE)
    with torch.no_grad():
        want.weight.copy_(w)
    torch.testing.assert_close(got, want(x.contiguous()), atol=1e-5, rtol=1e-5)
    assert torch.equal(x, before)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hq, hkv, head_dim", [(4, 2, 64), (3, 1, 64), (2, 2, 16), (3, 1, 48)])
@pytest.mark.parametrize("qk_norm", [False, True], ids=["rope", "qk-norm"])
def test_rope_store_matches_rotary_then_store(
    dtype: torch.dtype, hq: int, hkv: int, head_dim: int, qk_norm: bool
) -> None:
    """With ``qk_norm`` (Qwen3) each q and k head is normalized first (``qk_norm_``, its torch
    ops here), so the cache gets normalized, rotated keys. head_dim 48: a half (24) narrower
    than its power-of-two tile."""
    g = _gen(hq * 100 + head_dim)
    t, blocks, block_size = 5, 6, 4
    qkv = torch.randn(t, hq + 2 * hkv, head_dim, generator=g).to(dtype).to(DEVICE)
    positions = torch.tensor([0, 7, 3, 19, 11])
    inv = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = positions.float()[:, None] * inv[None, :]
    cos = freqs.cos().to(dtype).to(DEVICE).unsqueeze(1)
    sin = freqs.sin().to(dtype).to(DEVICE).unsqueeze(1)
    # Distinct slots; the third token is padding (negative slot: stored nowhere).
    slots = torch.tensor([5, 22, -1, 0, 13], dtype=torch.int64, device=DEVICE)
    shape = (blocks, block_size, hkv, head_dim)
    k_ref = torch.randn(shape, generator=g).to(dtype).to(DEVICE)
    v_ref = torch.randn(shape, generator=g).to(dtype).to(DEVICE)
    k_got, v_got = k_ref.clone(), v_ref.clone()

    norm = None
    if qk_norm:
        qkv[:, 0] *= 30  # heads of very different scales
        qw = (1 + 0.1 * torch.randn(head_dim, generator=g)).to(dtype).to(DEVICE)
        kw = (1 + 0.1 * torch.randn(head_dim, generator=g)).to(dtype).to(DEVICE)
        norm = (qw, kw, 1e-6)
    want = qkv.clone()
    if norm is not None:
        qk_norm_(want, norm[0], norm[1], hq, 1e-6)
    apply_rotary_(want[:, : hq + hkv], cos, sin)
    keep = slots >= 0
    reference.store_kv(
        want[keep, hq : hq + hkv], want[keep, hq + hkv :], k_ref, v_ref, slots[keep]
    )
    got = qkv.clone()
    fused.rope_store(got, cos, sin, slots, k_got, v_got, hq, qk_norm=norm)

    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)
    torch.testing.assert_close(k_got.float(), k_ref.float(), atol=atol, rtol=rtol)
    assert torch.equal(v_got, v_ref)  # v is copied, not computed
    # Nothing but the four stored slots changed.
    flat_k = k_got.view(-1, hkv, head_dim)
    untouched = torch.ones(blocks * block_size, dtype=torch.bool)
    untouched[slots[keep].cpu()] = False
    assert torch.equal(flat_k[untouched.to(DEVICE)], k_ref.view(-1, hkv, head_dim)[untouched.to(DEVICE)])


def _tiny_config(qk_norm: bool = False, yarn: bool = False) -> ModelConfig:
    """A tiny Llama, or with ``qk_norm`` a tiny Qwen3 (per-head q/k norms); with ``yarn``, YaRN
    rope scaling from 8 positions (the prompts pass it), its attention factor in the tables."""
    return ModelConfig(
        architecture="Qwen3ForCausalLM" if qk_norm else "LlamaForCausalLM",
        vocab_size=97,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        intermediate_size=96,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_scaling=YarnScaling(
            factor=4.0, original_max_position_embeddings=8, attention_factor=yarn_mscale(4.0)
        ) if yarn else None,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        qk_norm=qk_norm,
    )


def _pair(
    dtype: torch.dtype, qk_norm: bool = False, yarn: bool = False
) -> tuple[LlamaForCausalLM, LlamaForCausalLM]:
    cfg = _tiny_config(qk_norm, yarn)
    on = LlamaForCausalLM(cfg, ModelOptions(attention_backend="triton", fused_kernels=True))
    randomize_(on, seed=3)
    off = LlamaForCausalLM(cfg, ModelOptions(attention_backend="triton", fused_kernels=False))
    off.load_state_dict(on.state_dict())
    return on.to(DEVICE, dtype).eval(), off.to(DEVICE, dtype).eval()


def _step(
    model: LlamaForCausalLM,
    caches: list[tuple[torch.Tensor, torch.Tensor]],
    work: list[tuple[list[int], int, list[int]]],
    block_size: int,
) -> torch.Tensor:
    """One flat batch of (block table, start, tokens), decodes first; the last rows' logits."""
    work = sorted(work, key=lambda w: len(w[2]) != 1)
    specs = [SeqSpec(start, len(toks), table) for table, start, toks in work]
    ids = [t for _, _, toks in work for t in toks]
    rows = torch.tensor(list(itertools.accumulate(len(toks) for _, _, toks in work))) - 1
    meta = build_metadata(specs, block_size, DEVICE)
    return model(torch.tensor(ids, device=DEVICE), meta.positions, caches, meta, rows.to(DEVICE))


def _run(model: LlamaForCausalLM, dtype: torch.dtype) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Two prompts prefilled in one step, then two steps of two decodes: the last logits, and
    every layer's caches."""
    cfg = model.config
    bs = 8
    tables = [[1, 2, 3], [4, 5, 6]]
    prompts = [[5, 9, 14, 2, 77, 31, 8, 60, 1, 3], [40, 41, 42]]
    shape = (7, bs, cfg.num_kv_heads, cfg.head_dim)
    caches = [
        (torch.zeros(shape, dtype=dtype, device=DEVICE), torch.zeros(shape, dtype=dtype, device=DEVICE))
        for _ in range(cfg.num_layers)
    ]
    logits = _step(model, caches, [(tables[i], 0, p) for i, p in enumerate(prompts)], bs)
    lens = [len(p) for p in prompts]
    for step, picks in enumerate([[11, 12], [13, 14]]):
        work = [(tables[i], lens[i] + step, [picks[i]]) for i in range(2)]
        logits = _step(model, caches, work, bs)
    return logits.float(), [c.float() for pair in caches for c in pair]


@pytest.mark.parametrize(
    "qk_norm, yarn", [(False, False), (True, False), (True, True)], ids=["llama", "qwen3", "yarn"]
)
def test_the_model_gives_the_same_logits_with_fused_kernels_on_and_off_fp32(
    qk_norm: bool, yarn: bool
) -> None:
    """The fused rope kernel reads the same cos/sin tables as the torch ops (with ``yarn``,
    tables scaled by the attention factor: a kernel that recomputed them would differ)."""
    on, off = _pair(torch.float32, qk_norm, yarn)
    assert on.model.layers[0].self_attn.fused and on.model.norm.fused
    assert (on.model.layers[0].self_attn.q_norm is not None) == qk_norm
    assert not off.model.layers[0].self_attn.fused and not off.model.norm.fused
    (got, got_kv), (want, want_kv) = _run(on, torch.float32), _run(off, torch.float32)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    for a, b in zip(got_kv, want_kv, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("qk_norm", [False, True], ids=["llama", "qwen3"])
def test_the_fused_model_in_bf16_is_as_close_to_fp32_as_the_unfused_one(qk_norm: bool) -> None:
    """bf16 rounds differently in the fused kernels (once, in fp32) than in the chain of torch
    ops (after each op), so the two bf16 models differ by bf16 noise: each is held to the fp32
    model's logits, the fused one within twice the unfused one's error."""
    exact = _pair(torch.float32, qk_norm)[1]
    on, off = _pair(torch.bfloat16, qk_norm)
    want = _run(exact, torch.float32)[0]
    err_on = (_run(on, torch.bfloat16)[0] - want).abs().max().item()
    err_off = (_run(off, torch.bfloat16)[0] - want).abs().max().item()
    scale = want.abs().max().item()
    assert err_off < 0.05 * scale  # the bf16 model itself is sane
    assert err_on <= 2 * err_off + 0.01 * scale, (err_on, err_off, scale)


def test_a_phi3_model_gives_the_same_logits_with_fused_kernels_on_and_off() -> None:
    """Phi-3-style partial rotary (24 of 32 dims rotate: the heads' rows permuted at load, the
    tables' pass-through columns cos 1, sin 0) with LongRoPE (the long factors: the model serves
    128 positions of an original 8; its attention factor on the rotated columns only): the fused
    rope kernel turns the whole head by the same tables as the torch ops."""
    cfg = dataclasses.replace(
        _tiny_config(),
        architecture="Phi3ForCausalLM",
        rotary_dim=24,
        rope_scaling=LongRopeScaling(
            short_factor=tuple(1.0 + 0.1 * i for i in range(12)),
            long_factor=tuple(1.0 + i for i in range(12)),
            original_max_position_embeddings=8,
            attention_factor=1.2,
        ),
    )
    on = LlamaForCausalLM(cfg, ModelOptions(attention_backend="triton", fused_kernels=True))
    randomize_(on, seed=5)
    off = LlamaForCausalLM(cfg, ModelOptions(attention_backend="triton", fused_kernels=False))
    off.load_state_dict(on.state_dict())
    on, off = on.to(DEVICE).eval(), off.to(DEVICE).eval()
    assert torch.equal(on.model.rotary.cos[:, 12:].cpu(), torch.ones(128, 4))
    (got, got_kv), (want, want_kv) = _run(on, torch.float32), _run(off, torch.float32)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    for a, b in zip(got_kv, want_kv, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
