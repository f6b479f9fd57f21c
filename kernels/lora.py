"""Triton kernels of batched LoRA (``tierserve.replica.lora`` on the GPU): rows of many adapters in
one step, each row's product with its own adapter's weights.

A step's adapter rows are grouped by adapter slot into segments: ``rows`` (int32, the rows of
segment 0, then of segment 1, ...), ``seg_start`` (int32 ``[S + 1]``: where each segment's rows
start in ``rows``) and ``seg_slot`` (int32 ``[S]``: each segment's slot). The base model's rows
are in no segment and cost nothing. Two kernels, one program per (block of a segment's rows,
segment[, tile of output features]); a program past its segment's end returns at once, so the
grid is bounded by what the host knows (rows and segments in all) without a host sync:

- ``_lora_shrink_kernel``: ``h = x[rows] @ A_slot^T`` ``[n, rank]`` into ``buf`` (the model's
  dtype, as PEFT rounds ``lora_A``'s output), by position in ``rows``;
- ``_lora_expand_kernel``: ``out[rows, offset:offset + N] += h @ B_slot^T`` (the scaling is
  folded into ``B``), rounded to the model's dtype before the add, as PEFT adds its output.

``A`` is ``[slots, R, K]``, ``B`` ``[slots, N, R]`` with ``R`` the slots' rank (``max_lora_rank``);
``rank`` masks what lies past it, so ``R_BLOCK`` (a power of two, at least 16 for ``tl.dot``)
is the only constant the rank sets.

On CPU these run only under ``TRITON_INTERPRET=1`` (set before the first import), for tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 16
BLOCK_K = 64
BLOCK_N = 64
NUM_WARPS = 4
NUM_STAGES = 2
# The ranks the compile matrix covers: R_BLOCK 16 (max_lora_rank up to 16, the default) and 64.
CI_RANK_BLOCKS = (16, 64)


def rank_block(max_rank: int) -> int:
    """``R_BLOCK`` for slots of rank ``max_rank``: a power of two, at least 16."""
    return max(16, triton.next_power_of_2(max_rank))


@triton.jit(do_not_specialize=["rank"])
def _lora_shrink_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    a_ptr,
    buf_ptr,
    rows_ptr,
    seg_start_ptr,
    seg_slot_ptr,
    K,
    rank,
    stride_x,
    stride_as,
    stride_ar,
    stride_buf,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    R_BLOCK: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid_m = tl.program_id(0)
    seg = tl.program_id(1)
    start = tl.load(seg_start_ptr + seg)
    end = tl.load(seg_start_ptr + seg + 1)
    m0 = start + pid_m * BLOCK_M
    if m0 >= end:
        return
    idx = m0 + tl.arange(0, BLOCK_M)
    ok = idx < end
    row = tl.load(rows_ptr + idx, mask=ok, other=0).to(tl.int64)
    slot = tl.load(seg_slot_ptr + seg).to(tl.int64)
    r = tl.arange(0, R_BLOCK)
    r_ok = r < rank
    a_base = a_ptr + slot * stride_as + r[None, :].to(tl.int64) * stride_ar
    acc = tl.zeros((BLOCK_M, R_BLOCK), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        xa = tl.load(x_ptr + row[:, None] * stride_x + ks[None, :],
                     mask=ok[:, None] & k_ok[None, :], other=0.0)
        a = tl.load(a_base + ks[:, None], mask=k_ok[:, None] & r_ok[None, :], other=0.0)
        if UPCAST:
            xa, a = xa.to(tl.float32), a.to(tl.float32)
        acc = tl.dot(xa, a, acc, input_precision=PRECISION)
    dtype = buf_ptr.dtype.element_ty
    tl.store(buf_ptr + idx[:, None].to(tl.int64) * stride_buf + r[None, :], acc.to(dtype),
             mask=ok[:, None])


@triton.jit(do_not_specialize=["rank", "offset"])
def _lora_expand_kernel(  # type: ignore[no-untyped-def]
    buf_ptr,
    b_ptr,
    out_ptr,
    rows_ptr,
    seg_start_ptr,
    seg_slot_ptr,
    N,
    rank,
    offset,
    stride_buf,
    stride_bs,
    stride_bn,
    stride_out,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    R_BLOCK: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid_m = tl.program_id(0)
    seg = tl.program_id(1)
    pid_n = tl.program_id(2)
    start = tl.load(seg_start_ptr + seg)
    end = tl.load(seg_start_ptr + seg + 1)
    m0 = start + pid_m * BLOCK_M
    if m0 >= end:
        return
    idx = m0 + tl.arange(0, BLOCK_M)
    ok = idx < end
    row = tl.load(rows_ptr + idx, mask=ok, other=0).to(tl.int64)
    slot = tl.load(seg_slot_ptr + seg).to(tl.int64)
    r = tl.arange(0, R_BLOCK)
    r_ok = r < rank
    h = tl.load(buf_ptr + idx[:, None].to(tl.int64) * stride_buf + r[None, :],
                mask=ok[:, None] & r_ok[None, :], other=0.0)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    c_ok = cols < N
    b = tl.load(b_ptr + slot * stride_bs + cols[None, :].to(tl.int64) * stride_bn + r[:, None],
                mask=r_ok[:, None] & c_ok[None, :], other=0.0)
    if UPCAST:
        h, b = h.to(tl.float32), b.to(tl.float32)
    acc = tl.dot(h, b, input_precision=PRECISION)
    dtype = out_ptr.dtype.element_ty
    o_ptrs = out_ptr + row[:, None] * stride_out + offset + cols[None, :]
    mask = ok[:, None] & c_ok[None, :]
    o = tl.load(o_ptrs, mask=mask, other=0.0)
    tl.store(o_ptrs, (o.to(tl.float32) + acc.to(dtype).to(tl.float32)).to(dtype), mask=mask)


def kernel_constexprs(kernel: str, rank_blk: int, dtype: torch.dtype,
                      interpreter: bool = False) -> dict[str, object]:
    """The compile-time constants of ``kernel`` (``"shrink"`` or ``"expand"``) for slots of
    ``R_BLOCK`` ``rank_blk`` in ``dtype``: exact dots in fp32; under the interpreter, whose
    ``tl.dot`` cannot multiply bf16, the operands upcast to fp32 (``UPCAST``)."""
    tile = {"BLOCK_K": BLOCK_K} if kernel == "shrink" else {"BLOCK_N": BLOCK_N}
    return {"BLOCK_M": BLOCK_M, **tile, "R_BLOCK": rank_blk,
            "PRECISION": "ieee" if dtype == torch.float32 else "tf32", "UPCAST": interpreter}


def lora_add(
    x: torch.Tensor,
    out: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    offset: int,
    rows: torch.Tensor,
    seg_start: torch.Tensor,
    seg_slot: torch.Tensor,
) -> None:
    """``out[rows_s, offset:offset + N] += (x[rows_s] @ a[slot_s]^T) @ b[slot_s]^T`` for every
    segment ``s`` (see the module docstring), in place. ``x`` ``[T, K]``, ``out`` ``[T, >= offset
    + N]`` (rows contiguous), ``a`` ``[slots, R, K]``, ``b`` ``[slots, N, R]`` (contiguous),
    ``rows``/``seg_start``/``seg_slot`` int32 on ``x``'s device."""
    if x.dim() != 2 or x.stride(1) != 1 or out.dim() != 2 or out.stride(1) != 1:
        raise ValueError("x and out must be 2-D with contiguous rows")
    k = x.shape[1]
    slots, rank, ka = a.shape
    n = b.shape[1]
    if ka != k or b.shape != (slots, n, rank) or offset + n > out.shape[1]:
        raise ValueError(
            f"LoRA weights A {tuple(a.shape)} and B {tuple(b.shape)} do not fit x "
            f"{tuple(x.shape)} and out {tuple(out.shape)} at offset {offset}")
    if not (a.is_contiguous() and b.is_contiguous()):
        raise ValueError("the LoRA slot weights must be contiguous")
    total = rows.numel()
    segments = seg_slot.numel()
    if total == 0 or segments == 0:
        return
    blk = rank_block(rank)
    buf = torch.empty((total, blk), dtype=out.dtype, device=x.device)
    m_blocks = triton.cdiv(total, BLOCK_M)
    _lora_shrink_kernel[(m_blocks, segments)](
        x, a, buf, rows, seg_start, seg_slot, k, rank, x.stride(0), a.stride(0), a.stride(1),
        buf.stride(0), **kernel_constexprs("shrink", blk, x.dtype, _INTERPRETED),
        num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )
    _lora_expand_kernel[(m_blocks, segments, triton.cdiv(n, BLOCK_N))](
        buf, b, out, rows, seg_start, seg_slot, n, rank, offset, buf.stride(0), b.stride(0),
        b.stride(1), out.stride(0), **kernel_constexprs("expand", blk, x.dtype, _INTERPRETED),
        num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )


def _is_interpreted(kernel: object) -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)


# ``@triton.jit`` picks interpreter or compiler when the module is imported, once.
_INTERPRETED = _is_interpreted(_lora_expand_kernel)
