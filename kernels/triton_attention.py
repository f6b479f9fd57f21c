"""Triton paged attention over the flat batch of ``tierserve.kernels.metadata``.

One kernel serves decodes and prefill chunks. A program owns one KV head of one "query block": up
to ``BLOCK_M // group_pad`` consecutive query rows of one sequence times the ``group`` query heads
that share the KV head, flattened into the ``BLOCK_M`` rows of a ``tl.dot`` (so each K/V tile is
loaded once per KV-head group; decodes pad the group up to the 16 rows ``tl.dot`` needs). The
program walks its sequence's keys ``BLOCK_N`` at a time through the block table with an online
softmax (base 2, fp32 accumulation), masking causally by each row's position.

Launch plans (``paged_attention``):
- fast: decodes in one launch tuned for bandwidth, optionally split along the context
  (flash-decoding) with a combine kernel when there are too few programs to fill the GPU; prefill
  chunks in a second launch with large query blocks.
- deterministic: every row, decode or prefill, in one launch of one fixed configuration, no split.
  A row's result then depends only on its own query, position and cached K/V: tiles start at key 0
  in fixed ``BLOCK_N`` steps, keys a row may not see get score ``-inf`` and value 0 through
  ``where`` and masked loads, and a tile with no visible key leaves the row's state untouched.

Attention windows: ``window`` (a runtime argument, 0 = none) limits the row at position ``p`` to
keys ``p - window < j <= p``. A program starts at the tile holding its first row's first visible
key (the tiles wholly before every row's window are never loaded, so a decode reads about
``window`` keys whatever its context; the split decode divides those tiles), and masks the keys
before each row's window in the tiles it reads. In the deterministic launch a row's tiles are
still the fixed ``BLOCK_N`` steps from key 0, and one that holds no key of the row's window leaves
it untouched, so a row's bits stay fixed by its own position and window. Soft-capping (constexpr
``SOFTCAP``, the cap a runtime argument) maps each score ``s`` to ``c * tanh(s / c)`` before the
mask, with tanh from ``exp2`` (portable to every backend and the interpreter); models without it
compile it out.

Compiled variants. Triton compiles one binary per distinct set of compile-time constants and per
specialization of the other arguments (an int equal to 1 becomes a constant, one divisible by 16
gets a divisibility hint, a pointer 16-byte aligned gets one too). Everything that changes from one
batch to the next is a runtime argument excluded from specialization (``do_not_specialize``): the
first sequence of a launch, the block table's row stride, the query group size and its padding,
the context split count, the attention window, and the index tensors' pointers. What is left is fixed by the model and
the deployment (head_dim, block size, dtype, the launch's tile configuration), so a model reaches a
small, known set of variants: ``tierserve.kernels.aot.variants`` lists them and ``tierserve.kernels.aot.warmup``
compiles them at start-up instead of inside the serving loop.

Under ``TRITON_INTERPRET=1`` (CPU) the interpreter's ``tl.dot`` cannot multiply bf16, so the kernel
upcasts its dot operands to fp32 there (constexpr ``UPCAST``); on a GPU the dots run in the input
dtype (fp32 inputs use exact ``ieee`` dots rather than tf32).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from tierserve.kernels.metadata import AttentionMetadata, validate_window

_LOG2E = 1.4426950408889634

# Arguments left out of Triton's specialization (see the module docstring). The strides that stay
# specialized (q/out rows and heads, the caches' blocks/slots/heads) are products of head_dim and
# head counts, fixed for a model, so each takes one specialization per model; their divisibility
# by 16 is what lets the compiler prove a head's row is 16-byte aligned and load K, V and q with
# 128-bit vector loads. The data pointers keep their alignment specialization for the same reason.
# The index tensors are read with scalar or gathered loads, where alignment buys nothing.
ATTN_DO_NOT_SPECIALIZE = (
    "block_tables_ptr",
    "seq_lens_ptr",
    "cu_q_lens_ptr",
    "seq_offset",
    "group",
    "group_pad",
    "num_splits",
    "stride_bt",
    "window",
)
COMBINE_DO_NOT_SPECIALIZE = ("num_splits",)


@triton.jit(do_not_specialize=ATTN_DO_NOT_SPECIALIZE)
def _paged_attn_kernel(  # type: ignore[no-untyped-def]
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    cu_q_lens_ptr,
    seq_offset,
    group,
    group_pad,
    num_splits,
    qk_scale,
    window,
    softcap,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_bt,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    SPLIT: tl.constexpr,
    EXACT_SKIP: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    # group_pad: the group rounded up to a power of two <= BLOCK_M; block_q query rows per program.
    block_q = BLOCK_M // group_pad
    seq = (tl.program_id(0) + seq_offset).to(tl.int64)
    qblock = tl.program_id(1) // num_splits
    split = tl.program_id(1) % num_splits
    kv_head = tl.program_id(2).to(tl.int64)

    q_start = tl.load(cu_q_lens_ptr + seq)
    q_len = tl.load(cu_q_lens_ptr + seq + 1) - q_start
    if qblock * block_q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix = seq_len - q_len  # cached positions before this step's first query

    m_idx = tl.arange(0, BLOCK_M)
    q_local = qblock * block_q + m_idx // group_pad  # row within the sequence's queries
    head_in_group = m_idx % group_pad
    row_ok = (q_local < q_len) & (head_in_group < group)
    row = (q_start + q_local).to(tl.int64)
    head = kv_head * group + head_in_group
    pos = prefix + q_local  # each row sees keys 0..pos, or first..pos with a window
    windowed = window > 0
    first = tl.where(windowed, tl.maximum(pos - window + 1, 0), 0)
    # the program's first row has its smallest first key
    prog_first = tl.where(windowed, tl.maximum(prefix + qblock * block_q - window + 1, 0), 0)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM

    q = tl.load(
        q_ptr + row[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    # Keys this program may need: from its first row's window (key 0 without a window) up to its
    # last row's position; split evenly across num_splits.
    kv_end = prefix + tl.minimum(q_len, (qblock + 1) * block_q)
    num_tiles = tl.cdiv(kv_end, BLOCK_N)
    tile_start = prog_first // BLOCK_N
    tiles_per_split = tl.cdiv(num_tiles - tile_start, num_splits)
    tile_lo = tile_start + split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq * stride_bt
    n_idx = tl.arange(0, BLOCK_N)
    for tile in range(tile_lo, tile_hi):
        n = tile * BLOCK_N + n_idx
        n_ok = n < kv_end
        blk = tl.load(table + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        in_page = (n % BLOCK_SIZE).to(tl.int64)
        k_off = blk * stride_kb + in_page * stride_ks + kv_head * stride_kh
        v_off = blk * stride_vb + in_page * stride_vs + kv_head * stride_vh
        k = tl.load(
            k_cache_ptr + k_off[None, :] + d[:, None],
            mask=n_ok[None, :] & d_ok[:, None],
            other=0.0,
        )
        v = tl.load(
            v_cache_ptr + v_off[:, None] + d[None, :],
            mask=n_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, k, input_precision=PRECISION) * qk_scale
        if SOFTCAP:
            # softcap is the cap in these base-2 units: c * tanh(s / c) = c (1 - 2 / (e^2x + 1))
            e2x = tl.exp2(s * (2.8853900817779268 / softcap))  # 2 log2(e) / c
            s = softcap - 2.0 * softcap / (e2x + 1.0)
        visible = (n[None, :] <= pos[:, None]) & (n[None, :] >= first[:, None]) & n_ok[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_new = l_i * alpha + tl.sum(p, 1)
        acc_new = acc * alpha[:, None]
        acc_new = tl.dot(p.to(v.dtype), v, acc_new, input_precision=PRECISION)
        if EXACT_SKIP:
            # A tile with no key visible to a row must leave that row bit-for-bit unchanged.
            touched = (tile * BLOCK_N <= pos) & (tile * BLOCK_N + BLOCK_N > first)
            m_i = tl.where(touched, m_new, m_i)
            l_i = tl.where(touched, l_new, l_i)
            acc = tl.where(touched[:, None], acc_new, acc)
        else:
            m_i = m_new
            l_i = l_new
            acc = acc_new

    if SPLIT:
        # Partial results [rows, q_heads, num_splits(, HEAD_DIM)], indexed by the row of the batch.
        num_q_heads = tl.num_programs(2) * group
        part = (row * num_q_heads + head) * num_splits + split
        tl.store(part_m_ptr + part, m_i, mask=row_ok)
        tl.store(part_l_ptr + part, l_i, mask=row_ok)
        tl.store(
            part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :],
            acc,
            mask=row_ok[:, None] & d_ok[None, :],
        )
    else:
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        o = acc / l_safe[:, None]
        tl.store(
            out_ptr + row[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )


@triton.jit(do_not_specialize=COMBINE_DO_NOT_SPECIALIZE)
def _combine_splits_kernel(  # type: ignore[no-untyped-def]
    out_ptr,
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    stride_ot,
    stride_oh,
    num_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    base = (row * tl.num_programs(1) + head) * num_splits
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    # Split 0 always holds keys (it starts at key 0); later splits may be empty (m = -inf, l = 0,
    # acc = 0), which weighs them 0.
    m0 = tl.load(part_m_ptr + base)
    m_max = m0
    for s in range(1, num_splits):
        m_max = tl.maximum(m_max, tl.load(part_m_ptr + base + s))
    w = tl.exp2(m0 - m_max)
    total = w * tl.load(part_l_ptr + base)
    acc = w * tl.load(part_acc_ptr + base * HEAD_DIM + d, mask=d_ok, other=0.0)
    for s in range(1, num_splits):
        w = tl.exp2(tl.load(part_m_ptr + base + s) - m_max)
        total += w * tl.load(part_l_ptr + base + s)
        acc += w * tl.load(part_acc_ptr + (base + s) * HEAD_DIM + d, mask=d_ok, other=0.0)
    o = acc / total
    tl.store(
        out_ptr + row * stride_ot + head * stride_oh + d, o.to(out_ptr.dtype.element_ty), mask=d_ok
    )


def _is_interpreted(fn: object) -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(fn, InterpretedFunction)


# ``@triton.jit`` picks interpreter or compiler when the module is imported, once.
_INTERPRETED = _is_interpreted(_paged_attn_kernel)


@dataclass(frozen=True, slots=True)
class KernelConfig:
    """Tile shape and launch parameters of one attention launch."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# Deterministic mode: ONE configuration for every row, decode or prefill (changing it changes bits).
DETERMINISTIC_BLOCK_M = 64
DETERMINISTIC_BLOCK_N = 32
# The most context splits a decode launch uses (``auto_kv_splits``; a forced count is checked).
MAX_KV_SPLITS = 32
# Windows at least this long are passed as this (an int32 argument; no context is that long).
_MAX_WINDOW = 2**31 - 1


def interpreted() -> bool:
    """True when the kernels were built for the Triton CPU interpreter (``TRITON_INTERPRET=1``)."""
    return _INTERPRETED


def decode_config(group_pad: int, head_dim: int) -> KernelConfig:
    """Tile configuration of the fast decode launch."""
    return KernelConfig(max(16, group_pad), 64 if head_dim <= 128 else 32, 4, 3)


def prefill_config(group_pad: int, head_dim: int, arch: int | None = None) -> KernelConfig:
    """Tile configuration of the fast prefill launch on compute capability ``arch`` (e.g. 80, 90;
    ``None``: unknown, e.g. the interpreter).

    Before sm_90 (no wgmma: the query tile of a head_dim 128 block stays in registers) the
    pipelined loop does not fit the 255 registers of a thread and spills, so it is not pipelined.
    """
    if head_dim <= 128:
        stages = 1 if head_dim > 64 and arch is not None and arch < 90 else 2
        return KernelConfig(max(128, group_pad), 64, 8, stages)
    # Larger heads (Gemma's 256): a 64-row tile's accumulator needs 8 warps not to spill.
    return KernelConfig(max(64, group_pad), 32, 8, 2)


def deterministic_config(group_pad: int, head_dim: int = 128) -> KernelConfig:
    """The one tile configuration of the deterministic mode, fixed per head size (beyond 128, 8
    warps, so that the 64-row accumulator does not spill); every row of a model runs on it."""
    warps = 8 if head_dim > 128 else 4
    return KernelConfig(max(DETERMINISTIC_BLOCK_M, group_pad), DETERMINISTIC_BLOCK_N, warps, 2)


_ARCHS: dict[torch.device, int | None] = {}


def device_arch(device: torch.device) -> int | None:
    """The compute capability of ``device`` as ``major * 10 + minor`` (``None`` off CUDA or under
    the interpreter); the launch configurations depend on it."""
    if device not in _ARCHS:
        if device.type != "cuda" or interpreted():
            _ARCHS[device] = None
        else:
            major, minor = torch.cuda.get_device_capability(device)
            _ARCHS[device] = major * 10 + minor
    return _ARCHS[device]


def attention_constexprs(
    cfg: KernelConfig,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    split: bool,
    exact: bool,
    upcast: bool,
    softcap: bool = False,
) -> dict[str, Any]:
    """The compile-time constants of one ``_paged_attn_kernel`` launch (shared with ``aot``);
    ``softcap``: the variant that soft-caps its scores."""
    return {
        "HEAD_DIM": head_dim,
        "BLOCK_M": cfg.block_m,
        "BLOCK_N": cfg.block_n,
        "BLOCK_D": max(16, triton.next_power_of_2(head_dim)),
        "BLOCK_SIZE": block_size,
        "SPLIT": split,
        "EXACT_SKIP": exact,
        "UPCAST": upcast,
        "PRECISION": "ieee" if dtype == torch.float32 else "tf32",
        "SOFTCAP": softcap,
    }


COMBINE_NUM_WARPS = 4
COMBINE_NUM_STAGES = 3


def combine_constexprs(head_dim: int) -> dict[str, Any]:
    """The compile-time constants of one ``_combine_splits_kernel`` launch."""
    return {"HEAD_DIM": head_dim, "BLOCK_D": triton.next_power_of_2(head_dim)}


def auto_kv_splits(device: torch.device, programs: int, max_len: int) -> int:
    """Decode context splits (a power of two) for ``programs`` = decodes x KV heads.

    1 unless the decode grid alone would leave most SMs idle; each split keeps >= 256 keys. The
    count is a runtime argument of the kernels: any value reuses the same compiled binaries.
    """
    if device.type != "cuda" or interpreted():
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if programs >= sms:
        return 1
    want = triton.next_power_of_2(triton.cdiv(2 * sms, programs))
    return max(1, min(want, MAX_KV_SPLITS, triton.next_power_of_2(triton.cdiv(max_len, 256))))


def max_split_rows(device: torch.device, group: int) -> int:
    """An upper bound of ``decodes x q_heads x splits`` over the splits ``auto_kv_splits`` picks.

    A split launch has ``programs = decodes x kv_heads < SMs`` and ``splits <= 2 * cdiv(2 SMs,
    programs)``, so ``programs x splits <= 6 SMs``; each program holds ``group`` query heads.
    """
    if device.type != "cuda":
        return 0
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return 6 * sms * group


# Scratch for the split partials, one growing fp32 buffer per (device, role), reused by every
# layer and step rather than allocated per launch. A launch's partials are read by the combine
# kernel on the same stream before the next launch writes them, so reuse is safe for callers that
# issue their attention calls on one stream per device (the engine does); two threads driving one
# device on different streams would need their own buffers. A CUDA graph captures the buffer's
# address, so a buffer that grows is kept alive (``_RETIRED``), never freed: a graph captured over
# it keeps writing valid memory of its own. ``reserve_split_scratch`` before capturing avoids that.
_SCRATCH: dict[tuple[torch.device, str], torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []


def split_scratch(device: torch.device, role: str, numel: int) -> torch.Tensor:
    """A flat fp32 buffer of at least ``numel`` elements for ``role`` (``m``, ``l`` or ``acc``).

    Grows to the next power of two when too small; otherwise returns the same tensor each time.
    """
    key = (device, role)
    buf = _SCRATCH.get(key)
    if buf is None or buf.numel() < numel:
        if buf is not None:
            _RETIRED.append(buf)
        size = triton.next_power_of_2(max(numel, 1))
        buf = torch.empty(size, dtype=torch.float32, device=device)
        _SCRATCH[key] = buf
    return buf


def reserve_split_scratch(device: torch.device, rows: int, head_dim: int) -> None:
    """Size the split scratch for ``rows`` (decodes x q_heads x splits) up front, e.g. at start-up
    so that no step allocates it (a CUDA graph capture must not see it move)."""
    split_scratch(device, "m", rows)
    split_scratch(device, "l", rows)
    split_scratch(device, "acc", rows * head_dim)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    deterministic: bool = False,
    num_kv_splits: int | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of ``q`` ``[T, q_heads, D]`` over the paged cache -> ``[T, q_heads, D]`` in ``q.dtype``.

    This step's K/V must already be stored. ``q``'s last dimension must be contiguous; the caches
    contiguous. ``num_kv_splits`` forces the decode context split (a power of two up to
    ``MAX_KV_SPLITS``; fast mode only); ``None`` picks one from the GPU size. ``deterministic``
    runs every row through one fixed configuration (see the module docstring). ``window``: each
    row sees its last ``window`` positions (None: all up to its own); ``softcap``: scores ``s``
    become ``softcap * tanh(s / softcap)`` (None: unchanged); both checked as
    ``tierserve.kernels.metadata.validate_window`` does (``ValueError``).
    """
    validate_window(window, softcap)
    t, hq, d = q.shape
    hkv = k_cache.shape[2]
    group = hq // hkv
    group_pad = triton.next_power_of_2(group)
    out = torch.empty_like(q)
    if t == 0:
        return out
    if q.stride(2) != 1:
        raise ValueError("paged_attention needs q with a contiguous last (head_dim) dimension")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("paged_attention needs contiguous K/V caches")
    if num_kv_splits is not None and (
        num_kv_splits < 1 or num_kv_splits & (num_kv_splits - 1) or num_kv_splits > MAX_KV_SPLITS
    ):
        raise ValueError(
            f"num_kv_splits must be a power of two in 1..{MAX_KV_SPLITS}, got {num_kv_splits}"
        )
    launch = _Launcher(
        q,
        k_cache,
        v_cache,
        out,
        meta,
        scale,
        group,
        group_pad,
        0 if window is None else min(int(window), _MAX_WINDOW),
        softcap,
    )
    nd, ns = meta.num_decodes, meta.num_seqs
    if deterministic:
        cfg = deterministic_config(group_pad, d)
        launch(cfg, seq_offset=0, num_seqs=ns, max_q_len=meta.max_q_len, splits=1, exact=True)
        return out
    if nd:
        cfg = decode_config(group_pad, d)
        splits = num_kv_splits
        if splits is None:
            longest = max(meta.seq_lens_host[:nd])
            keys = longest if window is None else min(longest, window)  # what a row reads
            splits = auto_kv_splits(q.device, nd * hkv, keys)
        launch(cfg, seq_offset=0, num_seqs=nd, max_q_len=1, splits=splits, exact=False)
    if ns > nd:
        cfg = prefill_config(group_pad, d, device_arch(q.device))
        max_q = max(meta.q_lens_host[nd:])
        launch(cfg, seq_offset=nd, num_seqs=ns - nd, max_q_len=max_q, splits=1, exact=False)
    return out


@dataclass(slots=True)
class _Launcher:
    """Binds the tensors of one ``paged_attention`` call; each call of it is one kernel launch."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    out: torch.Tensor
    meta: AttentionMetadata
    scale: float
    group: int
    group_pad: int
    window: int  # 0: none
    softcap: float | None

    def __call__(
        self,
        cfg: KernelConfig,
        seq_offset: int,
        num_seqs: int,
        max_q_len: int,
        splits: int,
        exact: bool,
    ) -> None:
        q, kc, vc, out, meta = self.q, self.k_cache, self.v_cache, self.out, self.meta
        hq, d = q.shape[1], q.shape[2]
        hkv = kc.shape[2]
        block_q = cfg.block_m // self.group_pad
        # Partials only when split (decode rows are rows 0..num_seqs-1 of the batch); otherwise
        # the (unused) pointers still point at the fp32 scratch, so the argument types do not
        # change with the split count.
        rows = num_seqs * hq * splits if splits > 1 else 1
        part_m = split_scratch(q.device, "m", rows)
        part_l = split_scratch(q.device, "l", rows)
        part_acc = split_scratch(q.device, "acc", rows * d if splits > 1 else 1)
        grid = (num_seqs, triton.cdiv(max_q_len, block_q) * splits, hkv)
        _paged_attn_kernel[grid](
            q,
            kc,
            vc,
            out,
            part_m,
            part_l,
            part_acc,
            meta.block_tables,
            meta.seq_lens,
            meta.cu_q_lens,
            seq_offset,
            self.group,
            self.group_pad,
            splits,
            self.scale * _LOG2E,
            self.window,
            # the cap in the kernel's base-2 units (its scores are scaled by log2(e)); unused
            # (compiled out) without soft-capping
            0.0 if self.softcap is None else self.softcap * _LOG2E,
            q.stride(0),
            q.stride(1),
            out.stride(0),
            out.stride(1),
            meta.block_tables.stride(0),
            kc.stride(0),
            kc.stride(1),
            kc.stride(2),
            vc.stride(0),
            vc.stride(1),
            vc.stride(2),
            **attention_constexprs(
                cfg,
                d,
                kc.shape[1],
                q.dtype,
                split=splits > 1,
                exact=exact,
                upcast=_INTERPRETED,
                softcap=self.softcap is not None,
            ),
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
        if splits > 1:
            _combine_splits_kernel[(num_seqs, hq)](
                out,
                part_m,
                part_l,
                part_acc,
                out.stride(0),
                out.stride(1),
                splits,
                **combine_constexprs(d),
                num_warps=COMBINE_NUM_WARPS,
                num_stages=COMBINE_NUM_STAGES,
            )
