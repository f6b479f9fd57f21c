"""The native CPU kernels as torch functions (the library loaded by ``tierserve.kernels.cpu_native``).

- ``paged_attention``: every query row of a flat batch over its sequence's paged K/V *in place*
  (no gather into a padded copy, no mask tensor), with an online softmax, in parallel over
  (sequence, KV head, row tile) under OpenMP; the ``torch`` attention backend's fast path, where
  ``attention_plan`` takes the inputs.
- ``linear``: ``x @ W.T (+ b)`` with ``W`` repacked once by ``cpu_packing.pack_linear`` into
  panels of 16 output features; a register-tiled micro-kernel (12 rows x 32 outputs in AVX-512
  registers, 6 x 16 in AVX2 ones, a portable loop otherwise), threads splitting the panels.
  ``tierserve.replica.models.layers.Linear.pack_for_cpu`` switches a layer to it; in the default
  mode only where it is the faster path on this CPU (``cpu_calibration.library_rows``).
- ``linear_quantized``: the same, bit for bit, on a weight that
  ``cpu_packing.pack_linear_quantized`` found to be an exact Q4_1/Q8_0 dequantization and keeps
  in that form (1/6.4 or 1/3.8 of the bytes).
- ``rms_norm`` (optionally adding the previous block's output into the residual first),
  ``silu_and_mul``, ``gelu_tanh_and_mul`` (Gemma's), ``qk_norm`` (RMSNorm of each q and k head, in place: Qwen3's) and
  ``rope_store`` (rotary embedding of q and k, then k and v into the cache): one pass over the
  rows each, where torch runs several ops with temporaries.
- ``moe_route`` and ``moe_combine``: a mixture-of-experts layer's router choice (softmax, top k,
  the pairs grouped by expert) and the weighted sum of the chosen experts' outputs, per row in a
  fixed order (``tierserve.replica.models.moe`` runs the experts between them on ``linear``).

Each checks its tensors' shapes here; the library's checked functions (``tierserve.kernels.cpu_abi``)
check their dtypes, device and layout before passing addresses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tierserve.kernels import cpu_native
from tierserve.kernels.cpu_abi import NativeKernelError, check_quantized, packed_shape
from tierserve.kernels.metadata import AttentionMetadata

# Query rows per work item, at most: a prefill chunk's rows (or decode rows sharing a prefix)
# share each key run of the item.
MAX_ROW_TILE = 8

_ERRORS = {
    -1: "head counts, head_dim or the work split outside the kernel's limits",
    -2: "row tile x query heads per item above the kernel's limit",
    -3: "a sequence's query length is not within 1 .. its context length",
    -4: "a sequence's context is longer than its block table",
    -5: "a block table names a block outside the cache",
    -6: "a negative window, or a softcap that is negative or not finite",
}


@dataclass(frozen=True, slots=True)
class AttentionPlan:
    """How the kernel splits a batch into work items: ``row_tile`` query rows (of one prefill
    chunk, or decode rows of sequences whose block tables start with the same block: a shared
    prefix, read once for all of them) and ``heads_per_item`` consecutive KV heads (all of them
    when there are enough items to share the threads: one item then reads each cache position's
    heads in one contiguous run)."""

    row_tile: int
    heads_per_item: int


def attention_plan(q: torch.Tensor, k_cache: torch.Tensor) -> AttentionPlan | None:
    """The work split for these inputs if the kernel takes them (CPU, fp32 queries and caches,
    head counts and size within its limits), else None: then use the torch path."""
    if (
        not cpu_native.enabled
        or not q.is_cpu
        or q.dtype != torch.float32
        or k_cache.dtype != torch.float32
    ):
        return None
    lib = cpu_native.load()
    if lib is None:
        return None
    t, hq, d = q.shape
    hkv = k_cache.shape[2]
    max_vecs, max_head_dim = cpu_native.attention_limits()
    if hq % hkv or d > max_head_dim or hq // hkv > max_vecs:
        return None
    heads = hkv if hq <= max_vecs and t >= 2 * torch.get_num_threads() else 1
    return AttentionPlan(min(MAX_ROW_TILE, max_vecs // (heads * (hq // hkv))), heads)


def why_not_attention(q: torch.Tensor, k_cache: torch.Tensor) -> str:
    """Why ``attention_plan`` refuses these inputs (for error messages)."""
    reason = cpu_native.why_not_fused(q) or cpu_native.why_not_fused(k_cache)
    if reason is not None:
        return reason
    hq, d, hkv = q.shape[1], q.shape[2], k_cache.shape[2]
    max_vecs, max_head_dim = cpu_native.attention_limits()
    return (
        f"{hq} query heads over {hkv} KV heads of head_dim {d}; the kernel takes a multiple of "
        f"the KV heads, at most {max_vecs} per KV head, and head_dim up to {max_head_dim}"
    )


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor,
    num_seqs: int,
    plan: AttentionPlan,
    window: int | None = None,
    softcap: float | None = None,
) -> None:
    """Attend the query rows of the first ``num_seqs`` sequences of ``meta`` into ``out``.

    ``q`` ``[T, hq, D]`` (rows may be strided, heads contiguous), ``out`` likewise; caches
    contiguous ``[num_blocks, block_size, hkv, D]``; ``plan`` from ``attention_plan``.
    ``window``: each row sees its last ``window`` positions only (None: all up to its own; the
    kernel skips the key runs before a row's window). ``softcap``: scores ``s`` become
    ``softcap * tanh(s / softcap)`` (None: unchanged).
    """
    lib = cpu_native.lib_or_raise()
    hq, d = q.shape[1], q.shape[2]
    _, bs, hkv, _ = k_cache.shape
    if out.shape != q.shape or q.shape[0] != meta.num_tokens or not 0 < num_seqs <= meta.num_seqs:
        raise NativeKernelError(
            f"q {tuple(q.shape)} and out {tuple(out.shape)} must match the metadata's "
            f"{meta.num_tokens} tokens, and num_seqs ({num_seqs}) its {meta.num_seqs} sequences"
        )
    if q.dtype != torch.float32 or out.dtype != torch.float32 or k_cache.dtype != torch.float32:
        raise NativeKernelError("the native kernel takes fp32 q, out and caches")
    for name, t in (("q", q), ("out", out)):
        if t.stride(2) != 1 or t.stride(1) != d:
            raise NativeKernelError(f"{name} must have contiguous heads, got strides {t.stride()}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise NativeKernelError("the KV caches must be contiguous")
    tables = meta.block_tables
    seq_lens = meta.seq_lens
    cu = meta.cu_q_lens
    if tables.dtype != torch.int32 or seq_lens.dtype != torch.int32 or cu.dtype != torch.int32:
        raise NativeKernelError("block_tables, seq_lens and cu_q_lens must be int32")
    if not tables.is_contiguous():
        tables = tables.contiguous()
    rc = lib.ts_paged_attention_f32(
        q,
        q.stride(0),
        k_cache,
        v_cache,
        tables,
        tables.stride(0),
        seq_lens,
        cu,
        out,
        out.stride(0),
        num_seqs,
        hq,
        hkv,
        d,
        bs,
        k_cache.shape[0],
        float(scale),
        0 if window is None else min(int(window), 2**31 - 1),
        0.0 if softcap is None else float(softcap),
        plan.row_tile,
        plan.heads_per_item,
        torch.get_num_threads(),
    )
    if rc != 0:
        raise NativeKernelError(f"native attention refused its arguments: {_ERRORS.get(rc, rc)}")


# ----------------------------------------------------------------------------- fused row-wise ops


def _check_rows(name: str, t: torch.Tensor, rows: int, width: int) -> None:
    if t.dtype is not torch.float32 or not t.is_cpu:
        raise NativeKernelError(f"{name} must be fp32 on CPU, got {t.dtype} on {t.device}")
    if (
        t.dim() != 2
        or t.shape[0] != rows
        or t.shape[1] != width
        or (width > 1 and t.stride(1) != 1)
    ):
        raise NativeKernelError(
            f"{name} must be [{rows}, {width}] with contiguous rows, got {tuple(t.shape)} "
            f"strides {t.stride()}"
        )


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, delta: torch.Tensor | None = None
) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight`` per row of ``x`` ``[rows, hidden]``; with ``delta``,
    ``x += delta`` in place first (the residual stream), and the norm is of the sum."""
    lib = cpu_native.lib_or_raise()
    rows, hidden = x.shape
    _check_rows("x", x, rows, hidden)
    if delta is not None:
        _check_rows("delta", delta, rows, hidden)
    if weight.shape != (hidden,) or weight.dtype != torch.float32 or not weight.is_contiguous():
        raise NativeKernelError(f"weight must be fp32 [{hidden}], got {tuple(weight.shape)}")
    out = torch.empty((rows, hidden), dtype=torch.float32)
    rc = lib.ts_rms_norm_f32(
        x,
        x.stride(0),
        delta,
        0 if delta is None else delta.stride(0),
        weight,
        out,
        out.stride(0),
        rows,
        hidden,
        float(eps),
        torch.get_num_threads(),
    )
    if rc != 0:
        raise NativeKernelError(f"rms_norm refused its arguments (code {rc})")
    return out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up`` ``[rows, 2 * inter]`` laid out ``[gate | up]``."""
    return _gated("silu_and_mul", cpu_native.lib_or_raise().ts_silu_mul_f32, gate_up)


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(gate) * up`` (``transformers``' ``gelu_pytorch_tanh``, Gemma's MLP) for
    ``gate_up`` ``[rows, 2 * inter]`` laid out ``[gate | up]``."""
    return _gated("gelu_tanh_and_mul", cpu_native.lib_or_raise().ts_gelu_tanh_mul_f32, gate_up)


def _gated(name: str, fn: Any, gate_up: torch.Tensor) -> torch.Tensor:
    """``act(gate) * up`` through the native function ``fn`` (``ts_*_mul_f32``'s signature)."""
    rows, width = gate_up.shape
    if width % 2:
        raise NativeKernelError(f"gate_up must have an even width, got {width}")
    _check_rows("gate_up", gate_up, rows, width)
    out = torch.empty((rows, width // 2), dtype=torch.float32)
    rc = fn(gate_up, gate_up.stride(0), out, rows, width // 2, torch.get_num_threads())
    if rc != 0:
        raise NativeKernelError(f"{name} refused its arguments (code {rc})")
    return out


def qk_norm(
    qkv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    q_heads: int,
    eps: float,
) -> None:
    """RMS-normalize each q head of ``qkv`` ``[T, q_heads + 2 * kv_heads, D]`` by ``q_weight``
    and each k head by ``k_weight`` (both ``[D]``) over ``D``, in place; v is left alone."""
    lib = cpu_native.lib_or_raise()
    t, heads, d = qkv.shape
    if heads <= q_heads or (heads - q_heads) % 2:
        raise NativeKernelError(
            f"qkv {tuple(qkv.shape)} does not hold {q_heads} q heads and as many k as v heads"
        )
    if qkv.dtype != torch.float32 or qkv.stride(2) != 1 or qkv.stride(1) != d:
        raise NativeKernelError(f"qkv must be fp32 with contiguous heads, got {qkv.stride()}")
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if w.shape != (d,) or w.dtype != torch.float32 or not w.is_contiguous():
            raise NativeKernelError(f"{name} must be fp32 [{d}], got {tuple(w.shape)}")
    rc = lib.ts_qk_norm_f32(
        qkv,
        qkv.stride(0),
        q_weight,
        k_weight,
        t,
        q_heads,
        (heads - q_heads) // 2,
        d,
        float(eps),
        torch.get_num_threads(),
    )
    if rc != 0:
        raise NativeKernelError(f"qk_norm refused its arguments (code {rc})")


def rope_store(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    q_heads: int,
) -> None:
    """Rotate the q and k heads of ``qkv`` ``[T, q_heads + 2 * kv_heads, D]`` in place (``cos``,
    ``sin`` ``[T, D // 2]``), then store its k and v heads at ``slot_mapping`` ``[T]`` (int64) in
    the caches ``[num_blocks, block_size, kv_heads, D]``."""
    lib = cpu_native.lib_or_raise()
    t, heads, d = qkv.shape
    nb, bs, hkv, dc = k_cache.shape
    if heads != q_heads + 2 * hkv or d != dc or d % 2:
        raise NativeKernelError(
            f"qkv {tuple(qkv.shape)} does not hold {q_heads} q heads and {hkv} k and v heads "
            f"of the cache's head_dim {dc} (even)"
        )
    if qkv.dtype != torch.float32 or qkv.stride(2) != 1 or qkv.stride(1) != d:
        raise NativeKernelError(f"qkv must be fp32 with contiguous heads, got {qkv.stride()}")
    for name, tab in (("cos", cos), ("sin", sin)):
        _check_rows(name, tab.reshape(t, d // 2), t, d // 2)
        if not tab.is_contiguous():
            raise NativeKernelError(f"{name} must be contiguous")
    if slot_mapping.dtype != torch.int64 or slot_mapping.shape != (t,):
        raise NativeKernelError(f"slot_mapping must be int64 [{t}]")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.dtype != torch.float32 or not c.is_contiguous() or c.shape != k_cache.shape:
            raise NativeKernelError(f"{name} must be a contiguous fp32 cache like k_cache")
    slots = slot_mapping.contiguous()
    rc = lib.ts_rope_store_f32(
        qkv,
        qkv.stride(0),
        cos,
        sin,
        slots,
        k_cache,
        v_cache,
        nb * bs,
        t,
        q_heads,
        hkv,
        d,
        torch.get_num_threads(),
    )
    if rc == -5:
        raise NativeKernelError("a slot of slot_mapping is outside the cache")
    if rc != 0:
        raise NativeKernelError(f"rope_store refused its arguments (code {rc})")


# ----------------------------------------------------------------------------- linear layers


def linear(
    x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for ``x`` ``[M, in]`` (fp32, CPU) and ``W`` packed by
    ``cpu_packing.pack_linear``."""
    lib = cpu_native.lib_or_raise()
    # Shapes here; dtypes, device and layout of every tensor at the boundary (``cpu_abi``).
    if x.dim() != 2 or x.dtype is not torch.float32 or not x.is_cpu:
        raise NativeKernelError(
            f"linear takes fp32 CPU x [M, in], got {x.dtype} {tuple(x.shape)} on {x.device}"
        )
    m, k = x.shape
    if packed.shape != packed_shape(out_features, k):
        raise NativeKernelError(
            f"the packed weight {tuple(packed.shape)} is not [{out_features} outputs, {k} inputs] "
            f"(expected {packed_shape(out_features, k)})"
        )
    if bias is not None and bias.shape != (out_features,):
        raise NativeKernelError(f"bias must be fp32 [{out_features}], got {tuple(bias.shape)}")
    if (k > 1 and x.stride(1) != 1) or (m > 1 and x.stride(0) < k):
        x = x.contiguous()
    y = torch.empty((m, out_features), dtype=torch.float32)
    rc = lib.ts_linear_f32(
        x,
        x.stride(0),
        m,
        k,
        packed,
        out_features,
        bias,
        y,
        out_features,
        torch.get_num_threads(),
    )
    if rc != 0:
        raise NativeKernelError(f"linear refused its arguments (code {rc})")
    return y


def linear_quantized(
    x: torch.Tensor,
    packed: torch.Tensor,
    bits: int,
    out_features: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``linear`` on a weight packed by ``cpu_packing.pack_linear_quantized``: the same bits."""
    lib = cpu_native.lib_or_raise()
    if x.dim() != 2 or x.dtype is not torch.float32 or not x.is_cpu:
        raise NativeKernelError(
            f"linear takes fp32 CPU x [M, in], got {x.dtype} {tuple(x.shape)} on {x.device}"
        )
    m, k = x.shape
    check_quantized(packed, bits, out_features, k)
    if bias is not None and bias.shape != (out_features,):
        raise NativeKernelError(f"bias must be fp32 [{out_features}], got {tuple(bias.shape)}")
    if (k > 1 and x.stride(1) != 1) or (m > 1 and x.stride(0) < k):
        x = x.contiguous()
    y = torch.empty((m, out_features), dtype=torch.float32)
    rc = lib.ts_linear_q(
        x, x.stride(0), m, k, packed, bits, out_features, bias, y, out_features,
        torch.get_num_threads(),
    )
    if rc != 0:
        raise NativeKernelError(f"linear refused its arguments (code {rc})")
    return y



# ----------------------------------------------------------------------------- mixture of experts


@dataclass(frozen=True, slots=True)
class MoeRouting:
    """The router's choice for ``rows`` rows, ``top_k`` experts each (``moe_route``).

    ``weights`` ``[rows, top_k]`` fp32 and ``ids`` ``[rows, top_k]`` int64, in rank order.
    The pairs (row r, rank j), pair id ``r * top_k + j``, sorted by expert then pair id:
    ``sorted_rows`` ``[rows * top_k]`` the row of each sorted pair, ``pair_pos``
    ``[rows * top_k]`` where each pair id landed, ``counts`` ``[experts]`` pairs per expert
    (expert e's pairs are the sorted positions ``sum(counts[:e]) ..``)."""

    weights: torch.Tensor
    ids: torch.Tensor
    sorted_rows: torch.Tensor
    pair_pos: torch.Tensor
    counts: torch.Tensor


def moe_route(logits: torch.Tensor, top_k: int, renormalize: bool) -> MoeRouting:
    """Per row of ``logits`` ``[rows, experts]`` (fp32, CPU): the softmax over the experts, its
    ``top_k`` largest in rank order (ties: the lower expert), divided by their sum when
    ``renormalize``; and the pairs grouped by expert. Each row's result depends on that row
    alone."""
    lib = cpu_native.lib_or_raise()
    rows, experts = logits.shape
    _check_rows("logits", logits, rows, experts)
    if not 0 < top_k <= experts:
        raise NativeKernelError(f"top_k must be within 1 .. {experts} experts, got {top_k}")
    weights = torch.empty((rows, top_k), dtype=torch.float32)
    ids = torch.empty((rows, top_k), dtype=torch.int64)
    sorted_rows = torch.empty(rows * top_k, dtype=torch.int64)
    pair_pos = torch.empty(rows * top_k, dtype=torch.int64)
    counts = torch.empty(experts, dtype=torch.int64)
    rc = lib.ts_moe_route_f32(
        logits, logits.stride(0), rows, experts, top_k, int(renormalize), weights, ids,
        sorted_rows, pair_pos, counts, torch.get_num_threads(),
    )
    if rc != 0:
        raise NativeKernelError(f"moe_route refused its arguments (code {rc})")
    return MoeRouting(weights, ids, sorted_rows, pair_pos, counts)


def moe_combine(
    ys: torch.Tensor,
    routing: MoeRouting,
    shared: torch.Tensor | None = None,
    shared_gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out[r] = sum_j weights[r, j] * ys[pair_pos[r * k + j]]`` over the ranks in order, for
    ``ys`` ``[rows * k, hidden]`` the experts' outputs in sorted-pair order (``routing``'s); with
    ``shared`` ``[rows, hidden]`` and ``shared_gate`` ``[rows, 1]``, plus
    ``sigmoid(shared_gate[r]) * shared[r]``. A new ``[rows, hidden]`` tensor."""
    lib = cpu_native.lib_or_raise()
    rows, top_k = routing.weights.shape
    pairs = rows * top_k
    if ys.dim() != 2 or ys.shape[0] != pairs or not ys.is_contiguous():
        raise NativeKernelError(
            f"ys must be a contiguous [{pairs}, hidden] tensor, got {tuple(ys.shape)}"
        )
    hidden = ys.shape[1]
    if (shared is None) != (shared_gate is None):
        raise NativeKernelError("the shared expert's output and its gate come together")
    if shared is not None and shared_gate is not None:
        _check_rows("shared", shared, rows, hidden)
        if shared_gate.shape != (rows, 1) or not shared_gate.is_contiguous():
            raise NativeKernelError(
                f"shared_gate must be contiguous [{rows}, 1], got {tuple(shared_gate.shape)}"
            )
    out = torch.empty((rows, hidden), dtype=torch.float32)
    rc = lib.ts_moe_combine_f32(
        ys, routing.pair_pos, routing.weights, rows, top_k, hidden, shared,
        0 if shared is None else shared.stride(0), shared_gate, out, torch.get_num_threads(),
    )
    if rc == -5:
        raise NativeKernelError("a pair position is outside ys")
    if rc != 0:
        raise NativeKernelError(f"moe_combine refused its arguments (code {rc})")
    return out
