"""Plain-torch paged attention: the CPU's fallback where the native kernel does not run.

It reads the cache layout of ``tierserve.kernels.reference`` (``[num_blocks, block_size, kv_heads, head_dim]``)
and the flat batch of ``tierserve.kernels.metadata`` (decodes first, then prefill chunks), and assume this
step's K/V are already stored.

``paged_attention_fast`` sorts the decodes by context length into a few groups (up to
``_MAX_GROUPS``, when fewer padded positions pay for another call); each group is one gather of its
rows' cache slots, padded to the group's longest context, plus one ``scaled_dot_product_attention``
call. Each prefill chunk runs through SDPA with a causal mask offset by the cached prefix. An
attention window only adds to the masks (the positions before a row's window are still gathered:
this fallback's cost stays that of the whole context); soft-capping replaces SDPA by the same math
in plain ops (scores, cap, mask, softmax, values), as SDPA has no hook between scores and
softmax. What
depends only on the step's metadata (slot indices, masks, groups) is computed once per step and
reused by every layer; the gathered K/V land in a per-thread buffer that is reused (no fresh
allocation, so no page faults, per layer). Its rounding depends on the batch (grouping, padding
length, SDPA kernel choice); the deterministic mode never runs it (see ``tierserve.kernels.attention``).
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tierserve.arith import ceil_div, round_up
from tierserve.kernels.metadata import AttentionMetadata

# Decode grouping: at most this many groups, each of at least this many rows; one more group
# (one more gather and SDPA call) must save at least this many padded positions.
_MAX_GROUPS = 4
_MIN_GROUP_ROWS = 8
_GROUP_COST = 512

_local = threading.local()  # per thread: the last step's plan and the gather buffers


def paged_attention_fast(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of ``q`` ``[T, q_heads, D]`` over the paged cache -> ``[T, q_heads, D]`` in ``q.dtype``.

    ``window`` and ``softcap`` as in ``tierserve.kernels.attention.attention`` (None: off).
    Not batch invariant.
    """
    out = torch.empty_like(q)
    nd = meta.num_decodes
    dt = _math_dtype(q)
    plan = _plan(meta, k_cache.shape[1], dt, q.device)
    if nd:
        _decode(q, k_cache, v_cache, plan, scale, dt, out, window, softcap)
    group = q.shape[1] // k_cache.shape[2]
    row = nd
    for s in range(nd, meta.num_seqs):
        n, ctx = meta.q_lens_host[s], meta.seq_lens_host[s]
        k = _gather(k_cache, meta.block_tables[s], ctx).to(dt).transpose(0, 1).unsqueeze(0)
        v = _gather(v_cache, meta.block_tables[s], ctx).to(dt).transpose(0, 1).unsqueeze(0)
        qs = q[row : row + n].to(dt).transpose(0, 1).unsqueeze(0)  # [1, hq, n, D]
        if softcap is not None:
            mask = plan.chunk_mask(s, n, ctx, window)
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
            o = _capped_attention(qs, k, v, mask, scale, softcap)
        elif n == ctx and (window is None or window >= ctx):
            o = F.scaled_dot_product_attention(
                qs, k, v, is_causal=True, scale=scale, enable_gqa=group > 1
            )
        else:
            o = F.scaled_dot_product_attention(
                qs,
                k,
                v,
                attn_mask=plan.chunk_mask(s, n, ctx, window),
                scale=scale,
                enable_gqa=group > 1,
            )
        out[row : row + n] = o[0].transpose(0, 1)
        row += n
    return out


def _capped_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float,
) -> torch.Tensor:
    """SDPA's math with the scores soft-capped: ``q`` ``[..., n, D]``, ``k``/``v`` ``[..., c, D]``
    (as many heads as ``q``), ``mask`` additive, broadcast to ``[..., n, c]``."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap + mask
    return torch.matmul(scores.softmax(dim=-1), v)


def _gather(cache: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` positions of one sequence, ``[length, kv_heads, D]``."""
    _, bs, h, d = cache.shape
    blocks = ceil_div(length, bs)
    return cache[table[:blocks].long()].reshape(blocks * bs, h, d)[:length]


@dataclass(slots=True)
class _Group:
    """Decode rows of similar context length, attended in one padded SDPA call.

    rows: the rows' indices in the flat batch (None: rows ``0 .. n - 1`` in order).
    slots: ``[n * length]`` cache slots of every row's positions ``0 .. length - 1``; positions
    past a row's context repeat its last slot (written this step, so never uninitialized memory).
    mask: ``[n, 1, 1, length]`` additive mask, 0 where visible and -inf past the context.
    last: ``[n, 1]`` each row's position (its context length - 1), for the windowed masks.
    windowed: the masks with a window (per window; built by the first layer that has it).
    """

    rows: torch.Tensor | None
    n: int
    length: int
    slots: torch.Tensor
    mask: torch.Tensor
    last: torch.Tensor
    windowed: dict[int, torch.Tensor] = field(default_factory=dict)

    def mask_for(self, window: int | None) -> torch.Tensor:
        """The additive mask of the rows with ``window`` (None: ``mask``): also -inf at the
        positions before a row's last ``window``."""
        if window is None:
            return self.mask
        mask = self.windowed.get(window)
        if mask is None:
            pos = torch.arange(self.length, device=self.mask.device)[None, :]
            before = (pos <= self.last - window)[:, None, None, :]
            mask = self.mask.masked_fill(before, float("-inf"))
            self.windowed[window] = mask
        return mask


@dataclass(slots=True)
class _Plan:
    """What every layer of one step shares: the decode groups and the chunk masks."""

    key: tuple[object, ...]
    groups: list[_Group]
    positions: int  # sum of n * length over the groups
    dtype: torch.dtype
    device: torch.device
    masks: dict[tuple[int, int | None], torch.Tensor] = field(default_factory=dict)

    def chunk_mask(self, s: int, n: int, ctx: int, window: int | None = None) -> torch.Tensor:
        """Additive causal mask ``[n, ctx]`` of a chunk whose queries sit at ``ctx - n .. ctx - 1``,
        hiding too the keys before each query's last ``window`` positions (None: none)."""
        mask = self.masks.get((s, window))
        if mask is None:
            qpos = torch.arange(ctx - n, ctx, device=self.device)[:, None]
            kpos = torch.arange(ctx, device=self.device)[None, :]
            hidden = kpos > qpos
            if window is not None:
                hidden |= kpos <= qpos - window
            mask = torch.zeros((n, ctx), dtype=self.dtype, device=self.device)
            mask.masked_fill_(hidden, float("-inf"))
            self.masks[(s, window)] = mask
        return mask


def _plan_key(meta: AttentionMetadata, block_size: int, dtype: torch.dtype) -> tuple[object, ...]:
    # A step's metadata is rebuilt, not mutated; the key still holds the tensors' identities and
    # version counters (inference tensors have none) and the host lengths, so that an in-place
    # change is seen.
    return (
        meta,
        meta.block_tables,
        _version(meta.block_tables),
        meta.seq_lens,
        _version(meta.seq_lens),
        tuple(meta.seq_lens_host),
        meta.num_decodes,
        block_size,
        dtype,
    )


def _version(t: torch.Tensor) -> int:
    return -1 if t.is_inference() else t._version


def _plan(
    meta: AttentionMetadata, block_size: int, dtype: torch.dtype, device: torch.device
) -> _Plan:
    """This step's plan, built by the first layer and reused by the others (same thread)."""
    key = _plan_key(meta, block_size, dtype)
    plan: _Plan | None = getattr(_local, "plan", None)
    if (
        plan is not None
        and len(plan.key) == len(key)
        and all(
            a is b or (type(a) in (int, tuple) and a == b)
            for a, b in zip(plan.key, key, strict=True)
        )
    ):
        return plan
    plan = _build_plan(meta, block_size, dtype, device, key)
    _local.plan = plan
    return plan


def _build_plan(
    meta: AttentionMetadata,
    bs: int,
    dtype: torch.dtype,
    device: torch.device,
    key: tuple[object, ...],
) -> _Plan:
    nd = meta.num_decodes
    groups: list[_Group] = []
    positions = 0
    for rows in _decode_groups(meta.seq_lens_host[:nd], bs):
        n = len(rows)
        length = round_up(max(meta.seq_lens_host[i] for i in rows), bs)
        if n == nd:  # one group: every decode row, in order
            idx = None
            lens = meta.seq_lens[:nd].long()
            tables = meta.block_tables[:nd, : length // bs].long()
        else:
            idx = torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True)
            lens = meta.seq_lens.index_select(0, idx).long()
            tables = meta.block_tables.index_select(0, idx)[:, : length // bs].long()
        last = (lens - 1)[:, None]
        pos = torch.arange(length, device=device)[None, :]
        hidden = pos > last
        pos = torch.minimum(pos, last)
        slots = (tables.gather(1, pos // bs) * bs + pos % bs).view(-1)
        mask = torch.zeros((n, 1, 1, length), dtype=dtype, device=device)
        mask.masked_fill_(hidden[:, None, None, :], float("-inf"))
        groups.append(_Group(idx, n, length, slots, mask, last))
        positions += n * length
    return _Plan(key, groups, positions, dtype, device)


def _decode_groups(lens: list[int], bs: int) -> list[list[int]]:
    """Decode rows (indices into ``lens``) split into runs of similar context length.

    The rows are sorted by length and cut into ``k`` runs of equal count; ``k`` (1 to
    ``_MAX_GROUPS``) minimises the padded positions plus ``_GROUP_COST`` per run.
    """
    nd = len(lens)
    if not nd:
        return []
    kmax = max(1, min(_MAX_GROUPS, nd // _MIN_GROUP_ROWS))
    order = sorted(range(nd), key=lens.__getitem__)
    padded = [round_up(lens[i], bs) for i in order]
    best: list[int] = [0, nd]
    best_cost = nd * padded[-1] + _GROUP_COST
    for k in range(2, kmax + 1):
        cuts = [round(j * nd / k) for j in range(k + 1)]
        cost = sum((b - a) * padded[b - 1] for a, b in itertools.pairwise(cuts)) + k * _GROUP_COST
        if cost < best_cost:
            best, best_cost = cuts, cost
    if len(best) == 2:
        return [list(range(nd))]
    return [order[a:b] for a, b in itertools.pairwise(best)]


def _buffer(name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A reusable flat buffer of this thread (grown by a quarter when too small; never shrunk).

    A fresh tensor of tens of MB per layer costs page faults that outweigh the copy into it.
    """
    bufs: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = _local.__dict__.setdefault(
        "buffers", {}
    )
    buf = bufs.get((name, dtype, device))
    if buf is None or buf.numel() < numel:
        size = max(numel, int(1.25 * buf.numel()) if buf is not None else 0)
        # A normal tensor (not an inference tensor), so that it can be written outside
        # inference mode too.
        with torch.inference_mode(False):
            buf = torch.empty(size, dtype=dtype, device=device)
        bufs[(name, dtype, device)] = buf
    return buf[:numel]


def _decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: _Plan,
    scale: float,
    dt: torch.dtype,
    out: torch.Tensor,
    window: int | None = None,
    softcap: float | None = None,
) -> None:
    """Every decode row, one gather and one SDPA call per group, into ``out[:num_decodes]``.

    A decode row's query heads that share a KV head attend as ``group`` query positions of that
    KV head (one mask for all of them): SDPA then reads each KV head once, not once per query head.
    """
    nb, bs, h, d = k_cache.shape
    g = q.shape[1] // h
    width = h * d
    kbuf = _buffer("k", plan.positions * width, k_cache.dtype, k_cache.device)
    vbuf = _buffer("v", plan.positions * width, v_cache.dtype, v_cache.device)
    k_flat = k_cache.view(nb * bs, h, d)
    v_flat = v_cache.view(nb * bs, h, d)
    off = 0
    for grp in plan.groups:
        n, length = grp.n, grp.length
        size = n * length
        kg = kbuf[off * width : (off + size) * width].view(size, h, d)
        vg = vbuf[off * width : (off + size) * width].view(size, h, d)
        off += size
        torch.index_select(k_flat, 0, grp.slots, out=kg)
        torch.index_select(v_flat, 0, grp.slots, out=vg)
        k = kg.view(n, length, h, d).to(dt).transpose(1, 2)
        v = vg.view(n, length, h, d).to(dt).transpose(1, 2)
        qg = q[:n] if grp.rows is None else q.index_select(0, grp.rows)
        qg = qg.to(dt).reshape(n, h, g, d)
        mask = grp.mask_for(window)
        if softcap is None:
            o = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)
        else:
            o = _capped_attention(qg, k, v, mask, scale, softcap)
        o = o.reshape(n, h * g, d)
        if grp.rows is None:
            out[:n] = o
        else:
            out.index_copy_(0, grp.rows, o.to(out.dtype))


def _math_dtype(q: torch.Tensor) -> torch.dtype:
    """fp32 on CPU (half-precision SDPA is emulated and slower there), else ``q.dtype``."""
    return torch.float32 if q.device.type == "cpu" else q.dtype
