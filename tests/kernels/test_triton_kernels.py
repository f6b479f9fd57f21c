"""Triton store_kv and paged attention against the plain-torch reference.

On CPU these run under ``TRITON_INTERPRET=1`` (set by this folder's conftest before the kernels are
imported). With a GPU the same tests also run on ``cuda``: interpreted under ``make test`` (which
exports TRITON_INTERPRET=1 by default), compiled with ``TRITON_INTERPRET=0``; the ``gpu`` tests need
the compiled kernels.
"""

from __future__ import annotations

import functools

import pytest
import torch

from kernels import reference, triton_attention, triton_kv
from kernels.attention import attention
from kernels.metadata import AttentionMetadata, SeqSpec, build_metadata
from tests.kernels.common import LONG_DECODES, MIXED, SCALE, check_against_reference
from tests.kernels.helpers import DEVICES, Shape, new_cache

pytestmark = [
    pytest.mark.triton,
    pytest.mark.skipif(
        not (torch.cuda.is_available() or triton_attention.interpreted()),
        reason="Triton needs a CUDA GPU or TRITON_INTERPRET=1",
    ),
]
COMPILED_GPU = torch.cuda.is_available() and not triton_attention.interpreted()
gpu_only = pytest.mark.skipif(not COMPILED_GPU, reason="needs a CUDA GPU with compiled Triton")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32])
def test_store_kv_matches_reference_with_strided_input_and_skipped_slots(
    block_size: int, dtype: torch.dtype, device: str
) -> None:
    gen = torch.Generator().manual_seed(1)
    shape = Shape(kv_heads=3, group=1, head_dim=24)  # odd head count, non-power-of-two head_dim
    k_cache, v_cache = new_cache(4096, block_size, shape, dtype, device)
    t = 45
    # k and v are column slices of one fused projection output, as a model produces them.
    fused = torch.randn(t, 3 * shape.kv_heads * shape.head_dim, generator=gen).to(dtype).to(device)
    width = shape.kv_heads * shape.head_dim
    k = fused[:, width : 2 * width].view(t, shape.kv_heads, shape.head_dim)
    v = fused[:, 2 * width :].view(t, shape.kv_heads, shape.head_dim)
    slots = (torch.randperm(512 * block_size, generator=gen)[:t] + 3584 * block_size).to(device)
    slots[5] = -1  # padding token: skipped
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    keep = slots >= 0
    reference.store_kv(k[keep], v[keep], ref_k, ref_v, slots[keep])
    triton_kv.store_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache.nan_to_num(9.0), ref_k.nan_to_num(9.0))
    assert torch.equal(v_cache.nan_to_num(9.0), ref_v.nan_to_num(9.0))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("deterministic", [False, True], ids=["fast", "deterministic"])
def test_triton_attention_matches_reference(
    deterministic: bool, group: int, block_size: int, dtype: torch.dtype, device: str
) -> None:
    """Mixed decodes and chunks, through the dispatch (Triton store, then Triton attention)."""
    attend = functools.partial(attention, backend="triton", deterministic=deterministic)
    shape = Shape(kv_heads=2, group=group, head_dim=32)
    check_against_reference(attend, MIXED, shape, block_size, dtype, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("splits", [1, 2, 4, 16])
@pytest.mark.parametrize("group", [1, 4])
def test_triton_split_kv_decode_matches_reference(group: int, splits: int, device: str) -> None:
    """Flash-decoding: the context split over programs, including splits that get no keys."""

    def attend(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        triton_kv.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        return triton_attention.paged_attention(
            q, k_cache, v_cache, meta, scale, num_kv_splits=splits
        )

    shape = Shape(kv_heads=2, group=group, head_dim=16)
    check_against_reference(attend, LONG_DECODES, shape, 16, torch.float32, device)


@pytest.mark.parametrize("deterministic", [False, True], ids=["fast", "deterministic"])
@pytest.mark.parametrize("head_dim", [16, 40])
def test_triton_odd_head_dim_and_fp16(deterministic: bool, head_dim: int) -> None:
    attend = functools.partial(attention, backend="triton", deterministic=deterministic)
    shape = Shape(kv_heads=1, group=3, head_dim=head_dim)
    check_against_reference(attend, [(5, 1), (0, 19)], shape, 16, torch.float16, "cpu")


def test_triton_rejects_bad_split_count() -> None:
    meta = build_metadata([SeqSpec(0, 1, [1])], 16)
    k_cache = torch.zeros(4, 16, 1, 16)
    with pytest.raises(ValueError, match="power of two"):
        triton_attention.paged_attention(
            torch.zeros(1, 1, 16), k_cache, k_cache, meta, SCALE, num_kv_splits=3
        )


@gpu_only
@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True], ids=["fast", "deterministic"])
def test_triton_block_ids_past_int32_offsets(deterministic: bool) -> None:
    """Block ids whose element offsets exceed 2**31: catches int32 address overflow.

    Each cache is > 4 GiB (2**31 bf16 elements); with the test's copies the peak is ~26 GiB.
    """
    if torch.cuda.get_device_properties(0).total_memory < 40 * 2**30:
        pytest.skip("needs a GPU with >= 40 GiB")
    shape = Shape(kv_heads=8, group=4, head_dim=128)
    block_size = 16
    stride = block_size * shape.kv_heads * shape.head_dim
    num_blocks = (1 << 31) // stride + 2048
    attend = functools.partial(attention, backend="triton", deterministic=deterministic)
    check_against_reference(
        attend, MIXED, shape, block_size, torch.bfloat16, "cuda", num_blocks=num_blocks
    )
