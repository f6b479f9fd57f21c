"""Plain-torch references for the paged-attention kernels: gather through the block table, mask, softmax.

Cache layout: ``k_cache`` and ``v_cache`` are ``[num_blocks, block_size, kv_heads, head_dim]``;
slot ``s`` is block ``s // block_size``, offset ``s % block_size``.
"""

from __future__ import annotations

import torch

from tierserve.arith import ceil_div
from tierserve.kernels.metadata import AttentionMetadata


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``key``/``value`` ``[T, kv_heads, head_dim]`` into the caches at ``slot_mapping``."""
    nb, bs, h, d = k_cache.shape
    k_cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def gather_seq(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` positions of one sequence, ``[length, kv_heads, head_dim]``."""
    _, bs, h, d = cache.shape
    blocks = ceil_div(length, bs)
    return cache[block_table[:blocks].long()].reshape(blocks * bs, h, d)[:length]


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of every query row over its sequence's cached positions (fp32 math).

    ``window``: the query at position ``i`` sees only keys ``j`` with ``i - window < j <= i``
    (None: every key up to ``i``). ``softcap``: the scaled scores ``s`` become
    ``softcap * tanh(s / softcap)`` before the softmax (None: unchanged).
    """
    out = torch.empty_like(q)
    hq = q.shape[1]
    for s in range(meta.num_seqs):
        lo, hi = int(meta.cu_q_lens[s]), int(meta.cu_q_lens[s + 1])
        ctx = meta.seq_lens_host[s]
        k = gather_seq(k_cache, meta.block_tables[s], ctx).float()
        v = gather_seq(v_cache, meta.block_tables[s], ctx).float()
        group = hq // k.shape[1]
        k = k.repeat_interleave(group, dim=1)  # [ctx, hq, d]
        v = v.repeat_interleave(group, dim=1)
        qs = q[lo:hi].float()  # [n, hq, d]
        scores = torch.einsum("nhd,chd->hnc", qs, k) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        qpos = torch.arange(ctx - (hi - lo), ctx).view(1, -1, 1)
        kpos = torch.arange(ctx).view(1, 1, -1)
        hidden = kpos > qpos
        if window is not None:
            hidden = hidden | (kpos <= qpos - window)
        scores = scores.masked_fill(hidden, float("-inf"))
        probs = scores.softmax(dim=-1)
        out[lo:hi] = torch.einsum("hnc,chd->nhd", probs, v).to(q.dtype)
    return out
