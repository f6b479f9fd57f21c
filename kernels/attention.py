"""Attention dispatch: store this step's K/V into the paged cache, then attend.

``backend`` is ``"torch"`` (plain torch, the CPU default) or ``"triton"`` (the GPU path; on CPU it
runs only under ``TRITON_INTERPRET=1``, set before the Triton kernels are first imported).
``deterministic`` selects code paths whose result for a row does not depend on the other rows of
the batch, on how a prompt was cut into chunks, or on whether a token is a decode or prefill row.

- torch:  on CPU with fp32 queries and caches, ``cpu_ops.paged_attention`` (a C++ kernel built
  at first use that reads the paged cache in place); otherwise, or when it cannot be built,
  ``torch_attention.paged_attention_fast`` (padded-gather SDPA for decodes, SDPA per chunk).
  Deterministic: the native kernel only (its every row is computed in an order fixed by the row
  alone); where it cannot run, ``DeterministicModeUnavailable`` says why.
- triton: ``triton_attention.paged_attention``: a decode launch (split-KV when the grid is small)
  plus a prefill launch, or, deterministic, one fixed-configuration launch for every row. The
  binaries these launches need depend on the model only (``tierserve.kernels.aot.variants``); a GPU server
  compiles them at start-up with ``tierserve.kernels.aot.warmup`` rather than on a step's first launch.

The two deterministic paths are each invariant; they are not bit-equal to each other.

Attention windows and soft-capping are per call (a model passes its layer's): ``window`` W lets
the query at position ``i`` see only keys ``i - W < j <= i`` (the last W positions, itself
included); ``softcap`` c maps each scaled score ``s`` to ``c * tanh(s / c)`` before the softmax.
Every path implements both; the native and Triton kernels skip the key tiles that lie wholly
before a row's window, so a decode row's cost is bounded by W rather than by its context. The
cache is not windowed: the blocks of positions a window has left stay allocated (the scheduler
frees a sequence's blocks only when it finishes or is preempted), so prefix caching, chunked
prefill and preemption see the same cache as without a window and stay exact. The price is
memory: a windowed layer keeps its whole context's K/V although it reads only the last W.
"""

from __future__ import annotations

from typing import Literal

import torch

from tierserve.kernels import cpu_native, cpu_ops, reference, torch_attention
from tierserve.kernels.metadata import AttentionMetadata, validate_window

Backend = Literal["torch", "triton"]
BACKENDS: tuple[str, ...] = ("torch", "triton")


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    backend: Backend = "torch",
    deterministic: bool = False,
    kv_stored: bool = False,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """``q`` ``[T, q_heads, D]``, ``k``/``v`` ``[T, kv_heads, D]`` -> ``[T, q_heads, D]`` in ``q.dtype``.

    Stores ``k``/``v`` at ``meta.slot_mapping`` in ``k_cache``/``v_cache``
    (``[num_blocks, block_size, kv_heads, D]``, mutated; skipped when ``kv_stored`` says the
    caller already did, e.g. ``cpu_ops.rope_store``), then attends every query row causally
    over its sequence's cached positions: all of them up to its own (``window`` None), or the
    last ``window`` of them, its own included. ``softcap`` caps the scaled scores (None: no
    capping; see the module docstring). Raises ``ValueError`` on inconsistent shapes, an
    unknown backend, a window below 1 or a softcap not above 0.
    """
    validate(q, k, v, k_cache, v_cache, meta, backend)
    validate_window(window, softcap)
    if backend == "triton":
        from tierserve.kernels import triton_attention, triton_kv

        _check_triton_device(q)
        if not kv_stored:
            triton_kv.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        return triton_attention.paged_attention(
            q,
            k_cache,
            v_cache,
            meta,
            scale,
            deterministic=deterministic,
            window=window,
            softcap=softcap,
        )
    if not kv_stored:
        reference.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    plan = cpu_ops.attention_plan(q, k_cache)
    if plan is None and deterministic:
        raise cpu_native.DeterministicModeUnavailable(
            "deterministic attention on the torch backend runs on the native CPU kernel, which "
            f"does not take these inputs: {cpu_ops.why_not_attention(q, k_cache)}"
        )
    if plan is not None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        cpu_ops.paged_attention(
            q, k_cache, v_cache, meta, scale, out, meta.num_seqs, plan, window, softcap
        )
        return out
    return torch_attention.paged_attention_fast(q, k_cache, v_cache, meta, scale, window, softcap)


def validate(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    backend: str = "torch",
) -> None:
    """Raise ``ValueError`` with what is wrong if the inputs of ``attention`` do not fit together."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; use one of {', '.join(BACKENDS)}")
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(
            f"q, k, v must be [tokens, heads, head_dim]; got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            "k_cache and v_cache must both be [num_blocks, block_size, kv_heads, head_dim]; got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    t, hq, d = q.shape
    _, bs, hkv, dc = k_cache.shape
    if k.shape != (t, hkv, dc) or v.shape != (t, hkv, dc):
        raise ValueError(
            f"k and v must be [{t}, {hkv}, {dc}] to match q's tokens and the cache; got "
            f"{tuple(k.shape)} and {tuple(v.shape)}"
        )
    if d != dc:
        raise ValueError(f"q has head_dim {d} but the cache has head_dim {dc}")
    if hq % hkv:
        raise ValueError(f"q has {hq} heads, not a multiple of the {hkv} KV heads")
    if bs != meta.block_size:
        raise ValueError(
            f"cache blocks hold {bs} positions but the metadata says {meta.block_size}"
        )
    if t != meta.num_tokens:
        raise ValueError(f"q has {t} tokens but the metadata describes {meta.num_tokens}")
    if not (q.device == k_cache.device == meta.slot_mapping.device):
        raise ValueError(
            f"q ({q.device}), the cache ({k_cache.device}) and the metadata "
            f"({meta.slot_mapping.device}) must be on one device"
        )


def _check_triton_device(q: torch.Tensor) -> None:
    from tierserve.kernels import triton_attention

    if q.device.type == "cpu" and not triton_attention.interpreted():
        raise RuntimeError(
            "the triton backend got CPU tensors but the kernels were compiled for a GPU; set "
            "TRITON_INTERPRET=1 before tierserve.kernels.triton_attention is first imported, or use "
            "backend='torch' on CPU"
        )
