"""Fused Triton kernels of the GPU decode path: one launch where the torch ops take several.

- ``rms_norm``: the residual add and the RMSNorm of ``tierserve.replica.models.layers.RMSNorm`` in one pass
  over the rows (``residual += delta`` in place, then ``norm(residual) * weight``).
- ``rope_store``: the rotary embedding of the q and k heads of a fused ``[q | k | v]`` projection
  (the "rotate half" layout of ``tierserve.replica.models.layers.apply_rotary_``), rotated in place, and
  the store of k and v into the paged cache at ``slot_mapping`` (a negative slot stores nothing:
  padding rows). With ``qk_norm`` (Qwen3) each q and k head is first RMS-normalized over
  head_dim by its weight (``tierserve.replica.models.layers.qk_norm_``), in the same pass.

Both round where the torch ops round, so that the fused model stays within a rounding step of
the unfused one in bf16/fp16 and matches it to fp32 accuracy in fp32:
the residual sum is rounded to the residual's dtype before the norm reads it; the normalized row
is rounded to the input's dtype before the weight multiplies it (as ``RMSNorm.forward`` does).
The rotation is computed in fp32 from the stored q/k and the cos/sin tables and rounded once;
a q/k head's norm, like ``RMSNorm``'s, is rounded to the model's dtype before its weight
multiplies it, and the product before the rotation reads it.

On CPU they run only under ``TRITON_INTERPRET=1`` (set before this module is first imported),
for tests; the CPU serving path keeps its native kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    delta_ptr,
    w_ptr,
    out_ptr,
    stride_x,
    stride_d,
    stride_o,
    eps,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_DELTA: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_DELTA:
        d = tl.load(delta_ptr + row * stride_d + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + d.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(x_ptr + row * stride_x + cols, x, mask=mask)
    xf = x.to(tl.float32)
    mean_sq = tl.sum(xf * xf, axis=0) / N
    normed = (xf * tl.rsqrt(mean_sq + eps)).to(out_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    out = normed.to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, delta: torch.Tensor | None = None
) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight`` per row of ``x`` ``[T, N]``, in ``x``'s dtype.

    With ``delta`` (``[T, N]``), ``x += delta`` first, in place (``x`` is then the new residual
    stream), and the norm is of the sum. Rows may be strided; the last dimension contiguous.
    """
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"rms_norm needs [T, N] rows with a contiguous last dimension, got {x.shape}")
    t, n = x.shape
    if weight.shape != (n,) or not weight.is_contiguous():
        raise ValueError(f"rms_norm weight must be a contiguous [{n}], got {tuple(weight.shape)}")
    if delta is not None and (delta.shape != x.shape or delta.stride(1) != 1):
        raise ValueError(f"delta must be {tuple(x.shape)} with a contiguous last dimension")
    out = torch.empty((t, n), dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(t,)](
        x,
        x if delta is None else delta,
        weight,
        out,
        x.stride(0),
        x.stride(0) if delta is None else delta.stride(0),
        out.stride(0),
        float(eps),
        N=n,
        BLOCK=block,
        HAS_DELTA=delta is not None,
        num_warps=max(1, min(16, block // 256)),
    )
    return out


@triton.jit
def _rope_store_kernel(  # type: ignore[no-untyped-def]
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    slot_ptr,
    k_cache_ptr,
    v_cache_ptr,
    q_norm_ptr,
    k_norm_ptr,
    eps,
    stride_t,
    stride_h,
    stride_cos,
    stride_sin,
    stride_cb,
    stride_cs,
    stride_ch,
    Q_HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    QK_NORM: tl.constexpr,
):
    # One token per program: every q, k and v head of it.
    tok = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    j = tl.arange(0, BLOCK_HALF)[None, :]
    j_ok = j < HALF
    cos = tl.load(cos_ptr + tok * stride_cos + j, mask=j_ok, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + tok * stride_sin + j, mask=j_ok, other=0.0).to(tl.float32)
    row = qkv_ptr + tok * stride_t

    # q and k heads (the first Q_HEADS + KV_HEADS): rotated in place.
    rot_mask = (h < Q_HEADS + KV_HEADS) & j_ok
    lo_ptr = row + h * stride_h + j
    x1 = tl.load(lo_ptr, mask=rot_mask, other=0.0)
    x2 = tl.load(lo_ptr + HALF, mask=rot_mask, other=0.0)
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    if QK_NORM:
        # Each head over its 2 * HALF values (masked lanes hold zeros), in fp32; the normalized
        # value rounded to the model's dtype, times the head's weight, rounded again.
        mean_sq = tl.sum(x1f * x1f + x2f * x2f, axis=1) / (2 * HALF)
        inv = tl.rsqrt(mean_sq + eps)[:, None]
        is_q = h < Q_HEADS
        w1 = tl.where(
            is_q,
            tl.load(q_norm_ptr + j, mask=j_ok, other=0.0).to(tl.float32),
            tl.load(k_norm_ptr + j, mask=j_ok, other=0.0).to(tl.float32),
        )
        w2 = tl.where(
            is_q,
            tl.load(q_norm_ptr + HALF + j, mask=j_ok, other=0.0).to(tl.float32),
            tl.load(k_norm_ptr + HALF + j, mask=j_ok, other=0.0).to(tl.float32),
        )
        dt = qkv_ptr.dtype.element_ty
        x1f = ((x1f * inv).to(dt).to(tl.float32) * w1).to(dt).to(tl.float32)
        x2f = ((x2f * inv).to(dt).to(tl.float32) * w2).to(dt).to(tl.float32)
    y1 = (x1f * cos - x2f * sin).to(qkv_ptr.dtype.element_ty)
    y2 = (x2f * cos + x1f * sin).to(qkv_ptr.dtype.element_ty)
    tl.store(lo_ptr, y1, mask=rot_mask)
    tl.store(lo_ptr + HALF, y2, mask=rot_mask)

    # k (rotated, read back from registers) and v into the cache at this token's slot.
    slot = tl.load(slot_ptr + tok)
    if slot >= 0:
        blk = slot // BLOCK_SIZE
        off = slot % BLOCK_SIZE
        base = blk * stride_cb + off * stride_cs
        kh = h - Q_HEADS
        k_mask = (h >= Q_HEADS) & (h < Q_HEADS + KV_HEADS) & j_ok
        dst = base + kh * stride_ch + j
        tl.store(k_cache_ptr + dst, y1.to(k_cache_ptr.dtype.element_ty), mask=k_mask)
        tl.store(k_cache_ptr + dst + HALF, y2.to(k_cache_ptr.dtype.element_ty), mask=k_mask)
        vh = tl.arange(0, BLOCK_H)[:, None]
        v_mask = (vh < KV_HEADS) & j_ok
        v_src = row + (Q_HEADS + KV_HEADS + vh) * stride_h + j
        v1 = tl.load(v_src, mask=v_mask, other=0.0)
        v2 = tl.load(v_src + HALF, mask=v_mask, other=0.0)
        v_dst = base + vh * stride_ch + j
        tl.store(v_cache_ptr + v_dst, v1.to(v_cache_ptr.dtype.element_ty), mask=v_mask)
        tl.store(v_cache_ptr + v_dst + HALF, v2.to(v_cache_ptr.dtype.element_ty), mask=v_mask)


def rope_store(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    q_heads: int,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> None:
    """Rotate the q and k heads of ``qkv`` ``[T, q_heads + 2 * kv_heads, D]`` in place by the
    rows of ``cos``/``sin`` (``[T, D // 2]`` or ``[T, 1, D // 2]``), then store its k and v heads
    at ``slot_mapping`` ``[T]`` in the caches ``[num_blocks, block_size, kv_heads, D]``; a token
    whose slot is negative is rotated but not stored.

    ``qk_norm``: ``(q_weight, k_weight, eps)`` (weights ``[D]``, contiguous): each q and k head is
    RMS-normalized by its weight before it is rotated (and so before k is stored), as
    ``tierserve.replica.models.layers.qk_norm_`` does."""
    t, heads, d = qkv.shape
    _, block_size, hkv, dc = k_cache.shape
    if heads != q_heads + 2 * hkv or d != dc or d % 2:
        raise ValueError(
            f"qkv {tuple(qkv.shape)} does not hold {q_heads} q heads and {hkv} k and v heads of "
            f"the cache's (even) head_dim {dc}"
        )
    if qkv.stride(2) != 1:
        raise ValueError("rope_store needs qkv with a contiguous last (head_dim) dimension")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()) or v_cache.shape != k_cache.shape:
        raise ValueError("rope_store needs contiguous K/V caches of one shape")
    half = d // 2
    cos2 = cos.reshape(t, half)
    sin2 = sin.reshape(t, half)
    if cos2.stride(1) != 1 or sin2.stride(1) != 1:
        raise ValueError("rope_store needs cos/sin with a contiguous last dimension")
    if slot_mapping.shape != (t,):
        raise ValueError(f"slot_mapping must be [{t}], got {tuple(slot_mapping.shape)}")
    if qk_norm is not None:
        q_weight, k_weight, eps = qk_norm
        for name, w in (("q", q_weight), ("k", k_weight)):
            if w.shape != (d,) or not w.is_contiguous():
                raise ValueError(f"the {name} norm weight must be a contiguous [{d}], got "
                                 f"{tuple(w.shape)}")
    else:  # unused: the kernel reads them only with QK_NORM
        q_weight, k_weight, eps = qkv, qkv, 0.0
    if t == 0:
        return
    block_h = triton.next_power_of_2(q_heads + hkv)
    _rope_store_kernel[(t,)](
        qkv,
        cos2,
        sin2,
        slot_mapping.to(torch.int64),
        k_cache,
        v_cache,
        q_weight,
        k_weight,
        float(eps),
        qkv.stride(0),
        qkv.stride(1),
        cos2.stride(0),
        sin2.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        Q_HEADS=q_heads,
        KV_HEADS=hkv,
        HALF=half,
        BLOCK_H=block_h,
        BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_SIZE=block_size,
        QK_NORM=qk_norm is not None,
        num_warps=4,
    )
