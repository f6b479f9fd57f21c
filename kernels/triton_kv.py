"""Triton kernel that writes this step's K/V into the paged cache.

Cache layout ``[num_blocks, block_size, kv_heads, head_dim]``; token ``t`` goes to slot
``slot_mapping[t] = block_id * block_size + offset``. A negative slot skips the token (padding).
All address math is int64, so block ids near 2**31 / block_size do not overflow. A program writes
``BLOCK_T`` tokens of one KV head, so the binary depends on head_dim, block size and dtype only
(``tierserve.kernels.aot`` lists the variants), not on the number of heads or tokens.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# ``num_tokens`` changes every step and the slot pointer may be any view of the engine's buffers:
# neither is specialized. The strides stay specialized: they are products of head_dim and head
# counts, fixed for a model, and their divisibility by 16 lets a head's row load and store as
# 128-bit vectors.
STORE_DO_NOT_SPECIALIZE = ("slot_ptr", "num_tokens")
STORE_NUM_WARPS = 4
STORE_NUM_STAGES = 3


@triton.jit(do_not_specialize=STORE_DO_NOT_SPECIALIZE)
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
    HEAD_DIM: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    # A [BLOCK_T tokens, BLOCK_D] tile of one KV head per program.
    tok = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1).to(tl.int64)
    slot = tl.load(slot_ptr + tok, mask=tok < num_tokens, other=-1)
    tok_ok = slot >= 0
    blk = tl.where(tok_ok, slot, 0) // BLOCK_SIZE
    off = tl.where(tok_ok, slot, 0) % BLOCK_SIZE
    d = tl.arange(0, BLOCK_D)[None, :]
    t2 = tok[:, None]
    mask = tok_ok[:, None] & (d < HEAD_DIM)
    k = tl.load(key_ptr + t2 * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(value_ptr + t2 * stride_vt + h * stride_vh + d, mask=mask)
    dst = (blk * stride_cb + off * stride_cs + h * stride_ch)[:, None] + d
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_constexprs(head_dim: int, block_size: int) -> dict[str, int]:
    """The compile-time constants of one ``_store_kv_kernel`` launch (shared with ``aot``)."""
    block_d = triton.next_power_of_2(head_dim)
    return {
        "HEAD_DIM": head_dim,
        "BLOCK_T": max(1, min(16, 2048 // block_d)),
        "BLOCK_D": block_d,
        "BLOCK_SIZE": block_size,
    }


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
    const = store_constexprs(d, k_cache.shape[1])
    _store_kv_kernel[(triton.cdiv(t, const["BLOCK_T"]), h)](
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
        **const,
        num_warps=STORE_NUM_WARPS,
        num_stages=STORE_NUM_STAGES,
    )
