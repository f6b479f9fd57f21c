"""Triton kernel that writes this step's K/V into the paged cache.

Cache layout ``[num_blocks, block_size, kv_heads, head_dim]``; token ``t`` goes to slot
``slot_mapping[t] = block_id * block_size + offset``. A negative slot skips the token (padding).
All address math is int64, so block ids near 2**31 / block_size do not overflow.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(  # type: ignore[no-untyped-def]
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    num_tokens,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
):
    # A [BLOCK_T tokens, BLOCK_H heads, BLOCK_D] tile per program.
    tok = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    slot = tl.load(slot_ptr + tok, mask=tok < num_tokens, other=-1)
    tok_ok = slot >= 0
    blk = tl.where(tok_ok, slot, 0) // PAGE
    off = tl.where(tok_ok, slot, 0) % PAGE
    h = tl.arange(0, BLOCK_H)[None, :, None]
    d = tl.arange(0, BLOCK_D)[None, None, :]
    t3 = tok[:, None, None]
    mask = tok_ok[:, None, None] & (h < NUM_HEADS) & (d < HEAD_DIM)
    k = tl.load(key_ptr + t3 * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(value_ptr + t3 * stride_vt + h * stride_vh + d, mask=mask)
    dst = (blk * stride_cb + off * stride_cs)[:, None, None] + h * stride_ch + d
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``key``/``value`` ``[T, kv_heads, head_dim]`` into the caches at ``slot_mapping`` ``[T]``.

    ``key``/``value`` may be strided views (e.g. slices of a fused QKV output) as long as their last
    dimension is contiguous; the caches must be contiguous and of the same shape.
    """
    t, h, d = key.shape
    if t == 0:
        return
    if key.stride(2) != 1 or value.stride(2) != 1:
        raise ValueError("store_kv needs key/value with a contiguous last (head_dim) dimension")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("store_kv needs contiguous K/V caches")
    block_h, block_d = triton.next_power_of_2(h), triton.next_power_of_2(d)
    block_t = max(1, min(16, 4096 // (block_h * block_d)))
    _store_kv_kernel[(triton.cdiv(t, block_t),)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping.to(torch.int64),
        t,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        NUM_HEADS=h,
        HEAD_DIM=d,
        BLOCK_T=block_t,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        PAGE=k_cache.shape[1],
        num_warps=4,
    )
