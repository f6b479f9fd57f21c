"""Plain-torch paged attention for CPU serving: a fast path and a deterministic path.

Both read the cache layout of ``kernels.reference`` (``[num_blocks, block_size, kv_heads, head_dim]``)
and the flat batch of ``kernels.metadata`` (decodes first, then prefill chunks), and assume this
step's K/V are already stored.

``paged_attention_fast`` batches every decode into one padded gather plus one
``scaled_dot_product_attention`` call, and runs each prefill chunk through SDPA with a causal mask
offset by the cached prefix. Its rounding depends on the batch (padding length, SDPA kernel choice).

``paged_attention_deterministic`` (CPU) gives every query row the same computation whatever else is in
the batch and however the prompt was chunked: the row walks its keys one KV block at a time, in
order, with an online softmax; each block is reduced along the last dimension only (so a row's
sums never depend on how many rows there are); masked keys are removed with ``where`` (never by
multiplying possibly-garbage data) and a block with no visible key leaves the row's state untouched.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.metadata import AttentionMetadata

# Largest number of fp32 elements in one temporary product of the deterministic path.
_DET_MAX_PRODUCT = 1 << 24


def paged_attention_fast(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Attention of ``q`` ``[T, q_heads, D]`` over the paged cache -> ``[T, q_heads, D]`` in ``q.dtype``.

    Not batch invariant; use ``paged_attention_deterministic`` where bit-exactness matters.
    """
    out = torch.empty_like(q)
    nd = meta.num_decodes
    gqa = q.shape[1] != k_cache.shape[2]
    dt = _math_dtype(q)
    if nd:
        out[:nd] = _decode_sdpa(q[:nd], k_cache, v_cache, meta, scale, gqa)
    row = nd
    for s in range(nd, meta.num_seqs):
        n, ctx = meta.q_lens_host[s], meta.seq_lens_host[s]
        k = _gather(k_cache, meta.block_tables[s], ctx).to(dt).transpose(0, 1).unsqueeze(0)
        v = _gather(v_cache, meta.block_tables[s], ctx).to(dt).transpose(0, 1).unsqueeze(0)
        qs = q[row : row + n].to(dt).transpose(0, 1).unsqueeze(0)  # [1, hq, n, D]
        if n == ctx:
            o = F.scaled_dot_product_attention(
                qs, k, v, is_causal=True, scale=scale, enable_gqa=gqa
            )
        else:
            qpos = torch.arange(ctx - n, ctx, device=q.device)
            mask = torch.arange(ctx, device=q.device)[None, :] <= qpos[:, None]
            o = F.scaled_dot_product_attention(
                qs, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa
            )
        out[row : row + n] = o[0].transpose(0, 1)
        row += n
    return out


def _gather(cache: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` positions of one sequence, ``[length, kv_heads, D]``."""
    _, bs, h, d = cache.shape
    blocks = -(-length // bs)
    return cache[table[:blocks].long()].reshape(blocks * bs, h, d)[:length]


def _decode_sdpa(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    gqa: bool,
) -> torch.Tensor:
    """All decode rows at once: one padded gather, positions past each length masked and zeroed."""
    nd = q.shape[0]
    _, bs, h, d = k_cache.shape
    nblk = -(-max(meta.seq_lens_host[:nd]) // bs)
    tables = meta.block_tables[:nd, :nblk].long()
    length = nblk * bs
    valid = torch.arange(length, device=q.device)[None, :] < meta.seq_lens[:nd, None]
    # Padding may hold stale or uninitialized data (even NaN): zero it before SDPA sees it.
    pad = ~valid[:, :, None, None]
    dt = _math_dtype(q)
    # Gathering copies, so the in-place fill touches no cache memory.
    k = k_cache[tables].view(nd, length, h, d).to(dt).masked_fill_(pad, 0)
    v = v_cache[tables].view(nd, length, h, d).to(dt).masked_fill_(pad, 0)
    o = F.scaled_dot_product_attention(
        q.to(dt).unsqueeze(2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=valid[:, None, None, :],
        scale=scale,
        enable_gqa=gqa,
    )
    return o.squeeze(2)


def _math_dtype(q: torch.Tensor) -> torch.dtype:
    """fp32 on CPU (half-precision SDPA is emulated and slower there), else ``q.dtype``."""
    return torch.float32 if q.device.type == "cpu" else q.dtype


def paged_attention_deterministic(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Batch- and chunking-invariant attention: ``[T, q_heads, D]`` -> ``[T, q_heads, D]``.

    A row's result depends only on its own query, its position, its sequence's cached K/V and the
    block size: decode rows and prefill rows take the identical path (fp32 math throughout).
    CPU only: CUDA reductions pick their thread split from the tensor's size, which would make a
    row's sums depend on the batch (the GPU's deterministic path is the Triton kernel).
    """
    if q.device.type != "cpu":
        raise ValueError(
            f"the deterministic torch attention runs on CPU only (got {q.device}); on a GPU use "
            "backend='triton' with deterministic=True"
        )
    t, hq, d = q.shape
    _, bs, hkv, _ = k_cache.shape
    g = hq // hkv
    dev = q.device
    row_seq = torch.repeat_interleave(
        torch.arange(meta.num_seqs, device=dev),
        torch.tensor(meta.q_lens_host, device=dev),
        output_size=t,
    )
    tables = meta.block_tables.long()[row_seq]  # [T, max_blocks]
    visible = meta.positions.to(dev) + 1  # keys each row may see: positions 0..pos
    out = torch.empty_like(q)
    # Rows are independent, so a bounded slab of rows at a time only limits memory.
    per_row = hq * bs * d
    slab = max(1, _DET_MAX_PRODUCT // per_row)
    for lo in range(0, t, slab):
        hi = min(t, lo + slab)
        out[lo:hi] = _deterministic_rows(
            q[lo:hi].float().reshape(hi - lo, hkv, g, d),
            tables[lo:hi],
            visible[lo:hi],
            k_cache,
            v_cache,
            scale,
        ).view(hi - lo, hq, d)
    return out


def _deterministic_rows(
    q: torch.Tensor,
    tables: torch.Tensor,
    visible: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Online softmax over KV blocks for rows ``q`` ``[R, hkv, g, D]`` -> ``[R, hkv, g, D]`` fp32."""
    r, hkv, g, d = q.shape
    bs = k_cache.shape[1]
    m = torch.full((r, hkv, g), float("-inf"), device=q.device)
    denom = torch.zeros((r, hkv, g), device=q.device)
    acc = torch.zeros((r, hkv, g, d), device=q.device)
    offsets = torch.arange(bs, device=q.device)
    num_tiles = -(-int(visible.max()) // bs)
    for tile in range(num_tiles):
        # Only rows that see at least one key of this block are touched: for the others the
        # block would be an exact no-op, so skipping them is the same computation.
        rows = torch.nonzero(visible > tile * bs).squeeze(1)
        blk = tables[rows, tile]
        valid = (tile * bs + offsets)[None, :] < visible[rows, None]  # [A, bs]
        k = k_cache[blk].float().permute(0, 2, 1, 3).contiguous()  # [A, hkv, bs, D]
        v = v_cache[blk].float().permute(0, 2, 3, 1).contiguous()  # [A, hkv, D, bs]
        v = torch.where(valid[:, None, None, :], v, 0.0)
        qa = q[rows]
        s = (qa.unsqueeze(3) * k.unsqueeze(2)).sum(-1) * scale  # [A, hkv, g, bs]
        s = torch.where(valid[:, None, None, :], s, float("-inf"))
        m_old = m[rows]
        m_new = torch.maximum(m_old, s.amax(-1))
        alpha = torch.exp(m_old - m_new)
        p = torch.exp(s - m_new.unsqueeze(-1))
        pv = (p.unsqueeze(3) * v.unsqueeze(2)).sum(-1)  # [A, hkv, g, D]
        m[rows] = m_new
        denom[rows] = denom[rows] * alpha + p.sum(-1)
        acc[rows] = acc[rows] * alpha.unsqueeze(-1) + pv
    return acc / denom.unsqueeze(-1)
