"""The dispatch validates its inputs and says what is wrong."""

from __future__ import annotations

import pytest
import torch

from tierserve.kernels import reference
from tierserve.kernels.attention import Backend, attention
from tierserve.kernels.metadata import SeqSpec, build_metadata


def _inputs(
    tokens: int = 3, q_heads: int = 4, kv_heads: int = 2, head_dim: int = 16, block_size: int = 16
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    q = torch.randn(tokens, q_heads, head_dim)
    k = torch.randn(tokens, kv_heads, head_dim)
    v = torch.randn(tokens, kv_heads, head_dim)
    cache = torch.zeros(8, block_size, kv_heads, head_dim)
    return q, k, v, cache, cache.clone()


META = build_metadata([SeqSpec(0, 3, [5])], 16)


def test_unknown_backend_names_the_choices() -> None:
    with pytest.raises(
        ValueError, match="unknown attention backend 'cuda'; use one of torch, triton"
    ):
        attention(*_inputs(), META, 0.25, backend="cuda")  # type: ignore[arg-type]


def test_q_heads_must_be_a_multiple_of_kv_heads() -> None:
    q, k, v, kc, vc = _inputs(q_heads=3, kv_heads=2)
    with pytest.raises(ValueError, match="q has 3 heads, not a multiple of the 2 KV heads"):
        attention(q, k, v, kc, vc, META, 0.25)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("k_heads", r"k and v must be \[3, 2, 16\]"),
        ("q_dim", "q has head_dim 8 but the cache has head_dim 16"),
        ("block_size", "cache blocks hold 32 positions but the metadata says 16"),
        ("tokens", "q has 4 tokens but the metadata describes 3"),
        ("cache_shape", "k_cache and v_cache must both be"),
        ("q_rank", r"q, k, v must be \[tokens, heads, head_dim\]"),
    ],
)
def test_inconsistent_shapes_are_rejected(change: str, message: str) -> None:
    q, k, v, kc, vc = _inputs()
    if change == "k_heads":
        k = torch.randn(3, 1, 16)
    elif change == "q_dim":
        q = torch.randn(3, 4, 8)
    elif change == "block_size":
        kc, vc = (torch.zeros(8, 32, 2, 16) for _ in range(2))
    elif change == "tokens":
        q, k, v = (torch.randn(4, h, 16) for h in (4, 2, 2))
    elif change == "cache_shape":
        vc = torch.zeros(9, 16, 2, 16)
    elif change == "q_rank":
        q = q.reshape(3, 64)
    with pytest.raises(ValueError, match=message):
        attention(q, k, v, kc, vc, META, 0.25)
    assert torch.equal(kc, torch.zeros_like(kc)), "nothing is stored when the inputs are rejected"


def test_triton_on_cpu_without_the_interpreter_says_how_to_fix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("triton")
    from tierserve.kernels import triton_attention

    monkeypatch.setattr(triton_attention, "interpreted", lambda: False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        attention(*_inputs(), META, 0.25, backend="triton")


@pytest.mark.parametrize("deterministic", [False, True])
def test_torch_backend_stores_then_attends(deterministic: bool) -> None:
    """A one-token prompt attends only to itself: the output is its own value row."""
    q, k, v, kc, vc = _inputs(tokens=1, q_heads=2, kv_heads=1)
    meta = build_metadata([SeqSpec(0, 1, [7])], 16)
    out = attention(q, k, v, kc, vc, meta, 0.25, deterministic=deterministic)
    assert torch.equal(kc[7, 0], k[0]) and torch.equal(vc[7, 0], v[0])
    torch.testing.assert_close(out, v.expand(1, 2, 16))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_deterministic_torch_refuses_cuda() -> None:
    q, k, v, kc, vc = (x.cuda() for x in _inputs())
    meta = build_metadata([SeqSpec(0, 3, [5])], 16, "cuda")
    with pytest.raises(ValueError, match="float32 on CPU"):
        attention(q, k, v, kc, vc, meta, 0.25, deterministic=True)


@pytest.mark.parametrize(
    ("backend", "deterministic"),
    [
        ("torch", False),
        ("torch", True),
        pytest.param("triton", False, marks=pytest.mark.triton),
        pytest.param("triton", True, marks=pytest.mark.triton),
    ],
)
def test_strided_views_of_a_fused_projection(backend: Backend, deterministic: bool) -> None:
    """q/k/v as column slices of one QKV matmul output (not contiguous) work on every path."""
    if backend == "triton":
        from tierserve.kernels import triton_attention

        if not triton_attention.interpreted():
            pytest.skip("Triton on CPU needs TRITON_INTERPRET=1")
    meta = build_metadata([SeqSpec(3, 1, [9]), SeqSpec(0, 5, [4])], 16)
    fused = torch.randn(6, (4 + 2 + 2) * 16)
    q = fused[:, :64].view(6, 4, 16)
    k = fused[:, 64:96].view(6, 2, 16)
    v = fused[:, 96:].view(6, 2, 16)
    k_cache = torch.randn(16, 16, 2, 16)
    v_cache = torch.randn_like(k_cache)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    out = attention(q, k, v, k_cache, v_cache, meta, 0.25, backend, deterministic)
    reference.store_kv(k, v, ref_k, ref_v, meta.slot_mapping)
    want = reference.paged_attention(q, ref_k, ref_v, meta, 0.25)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
