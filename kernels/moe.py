"""Triton grouped GEMMs of a mixture-of-experts MLP (``tierserve.replica.models.moe`` on the GPU).

A step's ``T`` rows each chose ``k`` experts (``ids`` ``[T, k]``, weights ``[T, k]``): ``T * k``
(row, rank) pairs, pair id ``r * k + j``. ``align_by_expert`` sorts the pairs by expert on the
device and pads each expert's run to a multiple of ``BLOCK_M``, so that every block of
``BLOCK_M`` sorted pairs belongs to one expert (``block_expert``; -1 past the last run). The
bounds are static (``T * k + E * (BLOCK_M - 1)`` sorted slots): no host sync, and the launches
replay from a CUDA graph. Then two kernels, one program per (block of sorted pairs, tile of
output features), each reading only its expert's weights:

- ``_moe_gate_up_kernel``: the gate and up products of the block's rows of ``x`` with the
  expert's ``[gate | up]`` weight (two accumulators over the same loads of ``x``), and
  ``silu(gate) * up``, stored per pair in ``act`` ``[T * k, I]``;
- ``_moe_down_kernel``: ``act`` of the block's pairs times the expert's down weight, times each
  pair's routing weight, stored per pair in ``out`` ``[T * k, hidden]``.

``fused_experts`` runs both and sums each row's ``k`` outputs by rank, in order. Rounding follows
the torch path (``tierserve.replica.models.moe.experts_torch``): gate and up are rounded to the
model's dtype before SiLU, the activation after it and after the product, the down product
before the routing weight multiplies it (in fp32), the weighted output once more. Padding slots
(pair id ``T * k``) load zeros and store nothing.

On CPU these run only under ``TRITON_INTERPRET=1`` (set before the first import), for tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True, slots=True)
class MoeKernelConfig:
    """The tiles of both kernels: ``block_m`` sorted pairs x ``block_n`` output features,
    ``block_k`` inputs per step of the product loop."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# Few pairs (decode steps): small blocks, so that an expert's run wastes little padding.
DECODE_CONFIG = MoeKernelConfig(16, 64, 64, 4, 3)
# Many pairs (prefill): larger blocks reuse each weight tile over more rows.
PREFILL_CONFIG = MoeKernelConfig(64, 64, 64, 4, 3)
CONFIGS = (DECODE_CONFIG, PREFILL_CONFIG)


def kernel_config(num_pairs: int, num_experts: int) -> MoeKernelConfig:
    """The tiles for ``num_pairs`` (row, expert) pairs over ``num_experts`` experts: the small
    blocks while the pairs average fewer than 32 per expert."""
    return DECODE_CONFIG if num_pairs < 32 * num_experts else PREFILL_CONFIG


def align_by_expert(
    ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sorted_pairs, block_expert)`` for ``ids`` ``[T, k]`` (int64 expert ids): the pair ids
    sorted by expert (stable), each expert's run padded with ``T * k`` to a multiple of
    ``block_m`` (int32 ``[ceil((T * k + E * (block_m - 1)) / block_m) * block_m]``), and the
    expert of each block of ``block_m`` slots (int32, -1 for blocks past the last run). All on
    ``ids``' device, without a host sync."""
    flat = ids.reshape(-1)
    pairs = flat.numel()
    dev = flat.device
    slots = triton.cdiv(pairs + num_experts * (block_m - 1), block_m) * block_m
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    first = torch.cumsum(counts, 0) - counts
    rank = torch.arange(pairs, device=dev) - first[sorted_experts]
    dest = (ends - padded)[sorted_experts] + rank
    sorted_pairs = torch.full((slots,), pairs, dtype=torch.int32, device=dev)
    sorted_pairs[dest] = order.to(torch.int32)
    starts = torch.arange(0, slots, block_m, device=dev)
    block_expert = torch.searchsorted(ends, starts, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_pairs, block_expert


@triton.jit(do_not_specialize=["num_pairs", "top_k"])
def _moe_gate_up_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    w_ptr,
    act_ptr,
    sorted_ptr,
    block_expert_ptr,
    num_pairs,
    top_k,
    K,
    N,
    stride_x,
    stride_we,
    stride_wn,
    stride_a,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    pair = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pair < num_pairs
    row = (pair // top_k).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    w_gate = w_ptr + expert * stride_we + cols[None, :].to(tl.int64) * stride_wn
    w_up = w_gate + N * stride_wn
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(
            x_ptr + row[:, None] * stride_x + ks[None, :],
            mask=valid[:, None] & k_ok[None, :],
            other=0.0,
        )
        w_mask = k_ok[:, None] & col_ok[None, :]
        g = tl.load(w_gate + ks[:, None], mask=w_mask, other=0.0)
        u = tl.load(w_up + ks[:, None], mask=w_mask, other=0.0)
        if UPCAST:
            a, g, u = a.to(tl.float32), g.to(tl.float32), u.to(tl.float32)
        acc_gate = tl.dot(a, g, acc_gate, input_precision=PRECISION)
        acc_up = tl.dot(a, u, acc_up, input_precision=PRECISION)
    dtype = act_ptr.dtype.element_ty
    gate = acc_gate.to(dtype).to(tl.float32)
    up = acc_up.to(dtype).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    act = (silu * up).to(dtype)
    tl.store(
        act_ptr + pair[:, None].to(tl.int64) * stride_a + cols[None, :],
        act,
        mask=valid[:, None] & col_ok[None, :],
    )


@triton.jit(do_not_specialize=["num_pairs"])
def _moe_down_kernel(  # type: ignore[no-untyped-def]
    act_ptr,
    w_ptr,
    weight_ptr,
    out_ptr,
    sorted_ptr,
    block_expert_ptr,
    num_pairs,
    K,
    N,
    stride_a,
    stride_we,
    stride_wn,
    stride_o,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    pair = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pair < num_pairs
    prow = pair.to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    w_base = w_ptr + expert * stride_we + cols[None, :].to(tl.int64) * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(
            act_ptr + prow[:, None] * stride_a + ks[None, :],
            mask=valid[:, None] & k_ok[None, :],
            other=0.0,
        )
        w = tl.load(w_base + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if UPCAST:
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    dtype = out_ptr.dtype.element_ty
    routing = tl.load(weight_ptr + prow, mask=valid, other=0.0)
    out = acc.to(dtype).to(tl.float32) * routing[:, None]
    tl.store(
        out_ptr + prow[:, None] * stride_o + cols[None, :],
        out.to(dtype),
        mask=valid[:, None] & col_ok[None, :],
    )


def kernel_constexprs(
    cfg: MoeKernelConfig, dtype: torch.dtype, interpreter: bool = False
) -> dict[str, object]:
    """Both kernels' compile-time constants for ``cfg`` in ``dtype``: exact (``ieee``) dots for
    fp32 rather than tf32; under the interpreter, whose ``tl.dot`` cannot multiply bf16, the dot
    operands upcast to fp32 (``UPCAST``)."""
    return {
        "BLOCK_M": cfg.block_m,
        "BLOCK_N": cfg.block_n,
        "BLOCK_K": cfg.block_k,
        "PRECISION": "ieee" if dtype == torch.float32 else "tf32",
        "UPCAST": interpreter,
    }


def fused_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    config: MoeKernelConfig | None = None,
) -> torch.Tensor:
    """The chosen experts of each row of ``x`` ``[T, hidden]``, weighted and summed by rank:
    ``gate_up`` ``[E, 2 * I, hidden]`` (rows ``[gate | up]``), ``down`` ``[E, hidden, I]``,
    ``weights`` ``[T, k]`` (fp32) and ``ids`` ``[T, k]`` (int64) from the router. Returns
    ``[T, hidden]`` in ``x``'s dtype. ``config`` None picks by the batch (``kernel_config``)."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [T, hidden] with contiguous rows, got {tuple(x.shape)}")
    t, hidden = x.shape
    experts, two_inter, w_hidden = gate_up.shape
    inter = two_inter // 2
    if w_hidden != hidden or two_inter % 2 or down.shape != (experts, hidden, inter):
        raise ValueError(
            f"expert weights gate_up {tuple(gate_up.shape)} and down {tuple(down.shape)} do not "
            f"fit hidden size {hidden}: expected [E, 2 * I, {hidden}] and [E, {hidden}, I]"
        )
    if not (gate_up.is_contiguous() and down.is_contiguous()):
        raise ValueError("the expert weights must be contiguous")
    if ids.shape != weights.shape or ids.dim() != 2 or ids.shape[0] != t:
        raise ValueError(
            f"ids {tuple(ids.shape)} and weights {tuple(weights.shape)} must both be [{t}, k]"
        )
    top_k = ids.shape[1]
    pairs = t * top_k
    out = torch.empty((pairs, hidden), dtype=x.dtype, device=x.device)
    if t == 0:
        return out.view(t, top_k, hidden).sum(dim=1)
    cfg = config or kernel_config(pairs, experts)
    sorted_pairs, block_expert = align_by_expert(ids, experts, cfg.block_m)
    act = torch.empty((pairs, inter), dtype=x.dtype, device=x.device)
    const = kernel_constexprs(cfg, x.dtype, _INTERPRETED)
    blocks = block_expert.numel()
    _moe_gate_up_kernel[(blocks, triton.cdiv(inter, cfg.block_n))](
        x, gate_up, act, sorted_pairs, block_expert, pairs, top_k, hidden, inter,
        x.stride(0), gate_up.stride(0), gate_up.stride(1), act.stride(0),
        **const, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    routing = weights.reshape(-1).to(torch.float32).contiguous()
    _moe_down_kernel[(blocks, triton.cdiv(hidden, cfg.block_n))](
        act, down, routing, out, sorted_pairs, block_expert, pairs, inter, hidden,
        act.stride(0), down.stride(0), down.stride(1), out.stride(0),
        **const, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    per_rank = out.view(t, top_k, hidden)
    total = per_rank[:, 0].clone()
    for j in range(1, top_k):
        total += per_rank[:, j]
    return total


def _is_interpreted(kernel: object) -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)


# ``@triton.jit`` picks interpreter or compiler when the module is imported, once.

_INTERPRETED = _is_interpreted(_moe_down_kernel)
