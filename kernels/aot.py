"""Every Triton kernel variant a model can reach: enumerate them, compile them ahead of time.

A variant is one binary Triton would build: a kernel, its compile-time constants, the type and
specialization of each other argument, and its launch options (``num_warps``, ``num_stages``).
``tierserve.kernels.triton_attention`` and ``tierserve.kernels.triton_kv`` keep everything that changes between
batches out of the specialization, so what a model reaches depends only on its ``ServingConfig``
(head_dim, query heads per KV head, block size, dtype, deterministic or not, soft-capped scores or
not; an attention window is a runtime argument and adds none):

- ``variants(config)``: that set (5 variants in the fast mode, 2 in the deterministic one);
  ``fused_variants(hidden, q_heads, kv_heads, head_dim, block, dtype, qk_norm)``: the fused
  kernels' (``tierserve.kernels.fused``: two RMSNorms and a rotary + KV store, with the q/k
  norm where the model has one, per model shape).
- ``moe_variants(dtype)``: the mixture-of-experts grouped GEMMs' (``tierserve.kernels.moe``:
  gate/up with SiLU and down with the routing weight, in a decode and a prefill tiling).
- ``lora_variants(dtype, rank_block)``: the batched LoRA kernels' (``tierserve.kernels.lora``:
  shrink and expand over the rows grouped by adapter).
- ``launch_key(kernel, args, kwargs)``: the key Triton's launcher computes for one launch, in the
  same form as ``Variant.key()``, so a test can check that real launches stay inside the set.
- ``warmup(config, device)``: at start-up on a GPU, compiles the whole set into Triton's in-memory
  cache by launching each path once on a tiny batch (no-op on CPU).
- ``compile_variant(variant, target)`` / ``compile_all(variants, targets, jobs)``: compile for a GPU
  architecture without a GPU (``GPUTarget("cuda", 90, 32)``) and report registers, spills and
  shared memory from ``ptxas``; ``CompileReport.problems()`` says what exceeds the target.

Triton's interpreter (``TRITON_INTERPRET=1``) replaces ``tl`` builtins at import, so a process
that has it on cannot compile; ``compile_all`` (and ``compile_variant`` there) compile in
subprocesses started without it. ``python -m tierserve.kernels.aot`` compiles the CI matrix and prints it.

The set assumes what the engine passes: tensors 16-byte aligned and strides multiples of 16
elements (products of a head_dim divisible by 16). A caller that passes something else gets a
correct result from an extra variant compiled on first use.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import io
import itertools
import os
import pickle
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import triton

from tierserve.kernels import fused
from tierserve.kernels import lora as tlora
from tierserve.kernels import moe as tmoe
from tierserve.kernels import triton_attention as ta
from tierserve.kernels import triton_kv as tkv
from tierserve.kernels.metadata import SeqSpec, build_metadata

# The kernels by name, with each one's non-constexpr arguments' types. "model" stands for the
# model's dtype; any name not listed is an int32 scalar.
KERNELS: dict[str, Any] = {
    "paged_attn": ta._paged_attn_kernel,
    "combine_splits": ta._combine_splits_kernel,
    "store_kv": tkv._store_kv_kernel,
    "rms_norm": fused._rms_norm_kernel,
    "rope_store": fused._rope_store_kernel,
    "moe_gate_up": tmoe._moe_gate_up_kernel,
    "moe_down": tmoe._moe_down_kernel,
    "lora_shrink": tlora._lora_shrink_kernel,
    "lora_expand": tlora._lora_expand_kernel,
}
_ARG_TYPES: dict[str, dict[str, str]] = {
    "paged_attn": {
        "q_ptr": "*model",
        "k_cache_ptr": "*model",
        "v_cache_ptr": "*model",
        "out_ptr": "*model",
        "part_m_ptr": "*fp32",
        "part_l_ptr": "*fp32",
        "part_acc_ptr": "*fp32",
        "block_tables_ptr": "*i32",
        "seq_lens_ptr": "*i32",
        "cu_q_lens_ptr": "*i32",
        "qk_scale": "fp32",
        "softcap": "fp32",
    },
    "combine_splits": {
        "out_ptr": "*model",
        "part_m_ptr": "*fp32",
        "part_l_ptr": "*fp32",
        "part_acc_ptr": "*fp32",
    },
    "store_kv": {
        "key_ptr": "*model",
        "value_ptr": "*model",
        "k_cache_ptr": "*model",
        "v_cache_ptr": "*model",
        "slot_ptr": "*i64",
    },
    "rms_norm": {
        "x_ptr": "*model",
        "delta_ptr": "*model",
        "w_ptr": "*model",
        "out_ptr": "*model",
        "eps": "fp32",
    },
    "rope_store": {
        "qkv_ptr": "*model",
        "cos_ptr": "*model",
        "sin_ptr": "*model",
        "slot_ptr": "*i64",
        "k_cache_ptr": "*model",
        "v_cache_ptr": "*model",
        "q_norm_ptr": "*model",
        "k_norm_ptr": "*model",
        "eps": "fp32",
    },
    "moe_gate_up": {
        "x_ptr": "*model",
        "w_ptr": "*model",
        "act_ptr": "*model",
        "sorted_ptr": "*i32",
        "block_expert_ptr": "*i32",
    },
    "moe_down": {
        "act_ptr": "*model",
        "w_ptr": "*model",
        "weight_ptr": "*fp32",
        "out_ptr": "*model",
        "sorted_ptr": "*i32",
        "block_expert_ptr": "*i32",
    },
}
_ARG_TYPES["lora_shrink"] = {
    "x_ptr": "*model",
    "a_ptr": "*model",
    "buf_ptr": "*model",
    "rows_ptr": "*i32",
    "seg_start_ptr": "*i32",
    "seg_slot_ptr": "*i32",
}
_ARG_TYPES["lora_expand"] = {
    "buf_ptr": "*model",
    "b_ptr": "*model",
    "out_ptr": "*model",
    "rows_ptr": "*i32",
    "seg_start_ptr": "*i32",
    "seg_slot_ptr": "*i32",
}
# The fused kernels' shapes: (hidden size, query heads, KV heads, head_dim, q/k norm) of models
# the GPU configs serve or name (SmolLM2-135M, Qwen2.5-0.5B, Llama-3.2-1B, Llama-3-8B), and of
# two with a q/k norm (Qwen3-0.6B, Qwen3-8B).
CI_MODEL_SHAPES: tuple[tuple[int, int, int, int, bool], ...] = (
    (576, 9, 3, 64, False), (896, 14, 2, 64, False), (2048, 32, 8, 64, False),
    (4096, 32, 8, 128, False), (1024, 16, 8, 128, True), (4096, 32, 8, 128, True),
)
# Triton's launch default where a launch names none.
DEFAULT_NUM_STAGES = 3
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}

# Shared memory a block may opt in to, per CUDA compute capability (bytes).
SHARED_MEMORY_LIMIT: dict[int, int] = {
    80: 166912,
    86: 101376,
    87: 166912,
    89: 101376,
    90: 232448,
    100: 232448,
    120: 101376,
}
# The CI matrix: architectures and configurations every variant of which must compile cleanly.
CI_ARCHS: tuple[int, ...] = (80, 90)
CI_HEAD_DIMS: tuple[int, ...] = (64, 128, 256)  # 256: Gemma's
# The head sizes compiled with soft-capped scores too (Gemma 2's: 256, and 128 for the 27B).
CI_SOFTCAP_HEAD_DIMS: tuple[int, ...] = (128, 256)
CI_GROUPS: tuple[int, ...] = (1, 2, 3, 4, 8)
CI_BLOCK_SIZES: tuple[int, ...] = (16, 32)
CI_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16)


@dataclass(frozen=True, slots=True)
class ServingConfig:
    """What fixes a model's kernel variants."""

    head_dim: int
    group: int  # query heads per KV head
    block_size: int  # positions per KV cache block
    dtype: torch.dtype  # activations and KV cache
    deterministic: bool
    softcap: bool = False  # attention logits soft-capped (Gemma 2)


@dataclass(frozen=True, slots=True)
class Variant:
    """One binary of one kernel (see the module docstring).

    ``signature`` maps every argument to its Triton type (``"constexpr"`` for compile-time
    constants); ``aligned`` lists the arguments specialized as divisible by 16 (pointers: 16-byte
    aligned); ``unspecialized`` those Triton does not specialize (``do_not_specialize``).
    """

    kernel: str
    role: str
    signature: tuple[tuple[str, str], ...]
    constexprs: tuple[tuple[str, Any], ...]
    aligned: tuple[str, ...]
    unspecialized: tuple[str, ...]
    num_warps: int
    num_stages: int

    def key(self) -> tuple[Any, ...]:
        """The variant's identity, comparable with ``launch_key`` of a launch."""
        const = dict(self.constexprs)
        spec: list[tuple[str, Any]] = []
        for name, ty in self.signature:
            if ty == "constexpr":
                spec.append(("constexpr", const[name]))
            elif name in self.unspecialized or ty.startswith("fp"):
                spec.append((ty, None))  # floats are never specialized
            else:
                spec.append((ty, "D" if name in self.aligned else ""))
        return (self.kernel, tuple(spec), self.num_warps, self.num_stages)

    def describe(self) -> str:
        """A one-line summary: kernel, role, dtype and the constants that shape the tiles."""
        const = dict(self.constexprs)
        dtype = dict(self.signature).get(_first_model_arg(self.kernel), "?")
        shown = ", ".join(f"{k}={v}" for k, v in const.items() if k not in ("UPCAST",))
        return (
            f"{self.kernel}[{self.role}] {dtype} {shown} "
            f"warps={self.num_warps} stages={self.num_stages}"
        )


def _first_model_arg(kernel: str) -> str:
    return next(n for n, t in _ARG_TYPES[kernel].items() if t == "*model")


def arg_names(kernel: str) -> list[str]:
    """The argument names of ``KERNELS[kernel]``, in order (the order of a key's entries)."""
    return list(inspect.signature(_raw_fn(KERNELS[kernel])).parameters)


def _raw_fn(kernel: Any) -> Any:
    """The undecorated Python function of a ``JITFunction`` or ``InterpretedFunction``."""
    return kernel.fn


def _do_not_specialize(kernel: Any) -> tuple[str, ...]:
    """The kernel's ``do_not_specialize`` argument names, whichever way it was decorated."""
    names = getattr(kernel, "do_not_specialize", None)
    if names is None:  # an InterpretedFunction keeps the decorator's keywords
        names = getattr(kernel, "kwargs", {}).get("do_not_specialize") or ()
    params = list(inspect.signature(_raw_fn(kernel)).parameters)
    return tuple(params[n] if isinstance(n, int) else n for n in names)


def _variant(
    kernel: str,
    role: str,
    dtype: torch.dtype,
    constexprs: dict[str, Any],
    num_warps: int,
    num_stages: int,
) -> Variant:
    fn = KERNELS[kernel]
    types = _ARG_TYPES[kernel]
    dns = _do_not_specialize(fn)
    model = _DTYPE_NAMES[dtype]
    signature: list[tuple[str, str]] = []
    aligned: list[str] = []
    for name in inspect.signature(_raw_fn(fn)).parameters:
        if name in constexprs:
            signature.append((name, "constexpr"))
            continue
        ty = types.get(name, "i32").replace("model", model)
        signature.append((name, ty))
        if name not in dns and not ty.startswith("fp"):
            aligned.append(name)
    missing = set(constexprs) - {n for n, t in signature if t == "constexpr"}
    if missing:
        raise ValueError(f"{kernel} has no constexpr arguments {sorted(missing)}")
    return Variant(
        kernel=kernel,
        role=role,
        signature=tuple(signature),
        constexprs=tuple(constexprs.items()),
        aligned=tuple(aligned),
        unspecialized=tuple(n for n, t in signature if n in dns),
        num_warps=num_warps,
        num_stages=num_stages,
    )


def variants(
    config: ServingConfig, arch: int | None = None, interpreter: bool = False
) -> list[Variant]:
    """Every kernel variant serving ``config`` on a GPU of compute capability ``arch`` (80, 90,
    ...) can launch, whatever the batch.

    ``arch=None`` gives the launches of a device whose capability is unknown (the interpreter).
    ``interpreter`` gives the variants as the interpreter's launches describe them (``UPCAST``
    on), for tests that compare with recorded launches; compile the default ones.
    """
    d, block_size, dtype = config.head_dim, config.block_size, config.dtype
    if d % 16:
        raise ValueError(
            f"head_dim {d}: the variant set assumes strides divisible by 16 (head_dim % 16 == 0)"
        )
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"unsupported dtype {dtype}")
    group_pad = triton.next_power_of_2(config.group)
    store = _variant(
        "store_kv",
        "store",
        dtype,
        tkv.store_constexprs(d, block_size),
        tkv.STORE_NUM_WARPS,
        tkv.STORE_NUM_STAGES,
    )

    def attn(role: str, cfg: ta.KernelConfig, split: bool, exact: bool) -> Variant:
        const = ta.attention_constexprs(
            cfg, d, block_size, dtype, split, exact, interpreter, config.softcap
        )
        return _variant("paged_attn", role, dtype, const, cfg.num_warps, cfg.num_stages)

    if config.deterministic:
        return [store, attn("deterministic", ta.deterministic_config(group_pad, d), False, True)]
    decode = ta.decode_config(group_pad, d)
    combine = _variant(
        "combine_splits",
        "combine",
        dtype,
        ta.combine_constexprs(d),
        ta.COMBINE_NUM_WARPS,
        ta.COMBINE_NUM_STAGES,
    )
    return [
        store,
        attn("decode", decode, False, False),
        attn("decode-split", decode, True, False),
        combine,
        attn("prefill", ta.prefill_config(group_pad, d, arch), False, False),
    ]


def fused_variants(hidden: int, q_heads: int, kv_heads: int, head_dim: int, block_size: int,
                   dtype: torch.dtype, qk_norm: bool = False) -> list[Variant]:
    """The fused kernels' variants (``tierserve.kernels.fused``) of a model of that shape: RMSNorm alone
    and with its residual add, and rotary + KV store (their tiles follow the model's sizes),
    normalizing each q and k head first where ``qk_norm`` (Qwen3)."""
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"unsupported dtype {dtype}")
    block = triton.next_power_of_2(hidden)
    warps = max(1, min(16, block // 256))
    norms = [_variant("rms_norm", "norm+residual" if delta else "norm", dtype,
                      {"N": hidden, "BLOCK": block, "HAS_DELTA": delta}, warps,
                      DEFAULT_NUM_STAGES) for delta in (False, True)]
    half = head_dim // 2
    rope = _variant("rope_store", "qk-norm+rope+store" if qk_norm else "rope+store", dtype, {
        "Q_HEADS": q_heads, "KV_HEADS": kv_heads, "HALF": half,
        "BLOCK_H": triton.next_power_of_2(q_heads + kv_heads),
        "BLOCK_HALF": triton.next_power_of_2(half), "BLOCK_SIZE": block_size,
        "QK_NORM": qk_norm}, 4, DEFAULT_NUM_STAGES)
    return [*norms, rope]


def moe_variants(dtype: torch.dtype) -> list[Variant]:
    """The mixture-of-experts kernels' variants (``tierserve.kernels.moe``) in ``dtype``: the
    gate/up and the down kernel in each tile configuration. Their tiles do not follow the model's
    sizes (those are runtime arguments), so a dtype fixes the set."""
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"unsupported dtype {dtype}")
    return [
        _variant(kernel, f"{role} {'decode' if cfg == tmoe.DECODE_CONFIG else 'prefill'}", dtype,
                 tmoe.kernel_constexprs(cfg, dtype), cfg.num_warps, cfg.num_stages)
        for cfg in tmoe.CONFIGS
        for kernel, role in (("moe_gate_up", "gate/up+silu"), ("moe_down", "down*weight"))
    ]


def lora_variants(dtype: torch.dtype, rank_block: int) -> list[Variant]:
    """The batched LoRA kernels' variants (``tierserve.kernels.lora``) in ``dtype`` for slots of
    ``R_BLOCK`` ``rank_block`` (``tlora.rank_block(max_lora_rank)``): the shrink and the expand.
    The model's sizes, the rank and the output offset are runtime arguments."""
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"unsupported dtype {dtype}")
    return [
        _variant(f"lora_{kernel}", f"lora {kernel} r{rank_block}", dtype,
                 tlora.kernel_constexprs(kernel, rank_block, dtype), tlora.NUM_WARPS,
                 tlora.NUM_STAGES)
        for kernel in ("shrink", "expand")
    ]


def ci_lora_variants() -> list[Variant]:
    """The batched LoRA kernels' variants of the CI dtypes and ``tlora.CI_RANK_BLOCKS``."""
    return [v for dtype in CI_DTYPES for r in tlora.CI_RANK_BLOCKS
            for v in lora_variants(dtype, r)]


def ci_moe_variants() -> list[Variant]:
    """The mixture-of-experts kernels' variants of the CI dtypes."""
    return [v for dtype in CI_DTYPES for v in moe_variants(dtype)]


def variants_for(
    configs: Iterable[ServingConfig], arch: int | None = None, interpreter: bool = False
) -> list[Variant]:
    """The union of ``variants`` over ``configs``, without duplicates, in first-seen order."""
    seen: dict[tuple[Any, ...], Variant] = {}
    for config in configs:
        for v in variants(config, arch, interpreter):
            seen.setdefault(v.key(), v)
    return list(seen.values())


def ci_configs() -> list[ServingConfig]:
    """The configurations the CPU CI compiles for every architecture of ``CI_ARCHS``: without
    soft-capping at ``CI_HEAD_DIMS``, with it at ``CI_SOFTCAP_HEAD_DIMS``."""
    return [
        ServingConfig(d, g, b, dt, det, cap)
        for cap, dims in ((False, CI_HEAD_DIMS), (True, CI_SOFTCAP_HEAD_DIMS))
        for d, g, b, dt, det in itertools.product(
            dims, CI_GROUPS, CI_BLOCK_SIZES, CI_DTYPES, (False, True)
        )
    ]


def ci_fused_variants() -> list[Variant]:
    """The fused kernels' variants of ``CI_MODEL_SHAPES`` x blocks x dtypes, without duplicates."""
    seen: dict[tuple[Any, ...], Variant] = {}
    for (hidden, hq, hkv, d, qk_norm), block_size, dtype in itertools.product(
            CI_MODEL_SHAPES, CI_BLOCK_SIZES, CI_DTYPES):
        for v in fused_variants(hidden, hq, hkv, d, block_size, dtype, qk_norm):
            seen.setdefault(v.key(), v)
    return list(seen.values())


def ci_work() -> list[tuple[Variant, int]]:
    """Every (variant, arch) the CPU CI compiles: the CI configurations' variants per arch, the
    fused kernels' of the CI model shapes, and the mixture-of-experts kernels' per dtype."""
    return [(v, arch) for arch in CI_ARCHS
            for v in [*variants_for(ci_configs(), arch), *ci_fused_variants(),
                      *ci_moe_variants(), *ci_lora_variants()]]


# -- launch keys ------------------------------------------------------------------------------

_BINDERS: dict[str, Any] = {}


def _binder(kernel: str) -> Any:
    """Triton's own argument binder for ``kernel`` (what its launcher runs to build the key)."""
    if kernel not in _BINDERS:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend
        from triton.runtime.jit import JITFunction, create_function_from_signature

        fn = KERNELS[kernel]
        jit = JITFunction(_raw_fn(fn), do_not_specialize=list(_do_not_specialize(fn)))
        backend = make_backend(GPUTarget("cuda", 90, 32))
        _BINDERS[kernel] = create_function_from_signature(jit.signature, jit.params, backend)
    return _BINDERS[kernel]


def launch_key(kernel: str, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """The specialization key Triton computes for ``KERNELS[kernel][grid](*args, **kwargs)``.

    Same form as ``Variant.key()``. Uses Triton's binder (its rules: an int equal to 1 becomes a
    constant, one divisible by 16 or a 16-byte-aligned pointer gets a divisibility hint, unless
    the argument is in ``do_not_specialize``); works on CPU tensors, no GPU needed.
    """
    from triton.backends.nvidia.compiler import CUDAOptions

    options = dict(kwargs)
    num_warps = options.pop("num_warps", CUDAOptions.num_warps)
    num_stages = options.pop("num_stages", CUDAOptions.num_stages)
    _, specialization, _ = _binder(kernel)(*args, **options)
    spec = tuple((str(ty), sp) for ty, sp in specialization)
    return (kernel, spec, num_warps, num_stages)


# -- warm-up ----------------------------------------------------------------------------------


def run_warmup_launches(config: ServingConfig, device: torch.device | str) -> None:
    """Launch every path of ``config`` once on a tiny batch (one KV head, zeros; with a window,
    which selects no other binary, and soft-capped where ``config.softcap``).

    On a GPU this compiles each variant into Triton's cache for ``device``; under the
    interpreter it runs them on CPU (used by tests to check it reaches the whole set).
    """
    dev = torch.device(device)
    d, bs, g, dt = config.head_dim, config.block_size, config.group, config.dtype
    k_cache = torch.zeros((4, bs, 1, d), dtype=dt, device=dev)
    v_cache = torch.zeros_like(k_cache)
    # Two decodes (one past a block edge) and a two-token prefill chunk.
    meta = build_metadata([SeqSpec(bs, 1, [0, 1]), SeqSpec(1, 1, [2]), SeqSpec(0, 2, [3])], bs, dev)
    q = torch.zeros((4, g, d), dtype=dt, device=dev)
    kv = torch.zeros((4, 1, d), dtype=dt, device=dev)
    tkv.store_kv(kv, kv, k_cache, v_cache, meta.slot_mapping)
    scale = d**-0.5
    cap = 30.0 if config.softcap else None
    if config.deterministic:
        ta.paged_attention(
            q, k_cache, v_cache, meta, scale, deterministic=True, window=bs, softcap=cap
        )
        return
    ta.paged_attention(q, k_cache, v_cache, meta, scale, num_kv_splits=1, window=bs, softcap=cap)
    ta.paged_attention(q, k_cache, v_cache, meta, scale, num_kv_splits=2, softcap=cap)


def warmup(config: ServingConfig, device: torch.device | str = "cuda") -> list[Variant]:
    """Compile every variant of ``config`` on ``device`` and size the split scratch; call once at
    start-up so that no step of the serving loop compiles. Returns the variants (empty, and does
    nothing, unless ``device`` is a CUDA device with compiled, not interpreted, kernels)."""
    dev = torch.device(device)
    if dev.type != "cuda" or ta.interpreted() or not torch.cuda.is_available():
        return []
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    ta.reserve_split_scratch(dev, ta.max_split_rows(dev, config.group), config.head_dim)
    run_warmup_launches(config, dev)
    torch.cuda.synchronize(dev)
    return variants(config, ta.device_arch(dev))


# -- ahead-of-time compilation ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CompileReport:
    """The result of compiling one variant for one architecture (``error`` set when it failed)."""

    variant: Variant
    arch: int
    n_regs: int = -1
    n_spills: int = -1  # bytes of spill stores
    spill_loads: int = -1  # bytes
    stack: int = -1  # bytes of stack frame
    shared: int = -1  # bytes of shared memory per block
    seconds: float = 0.0
    error: str | None = None
    ptxas_log: str = field(default="", repr=False)

    def problems(self) -> list[str]:
        """What is wrong: a compile error, a register spill, shared memory over the limit."""
        where = f"{self.variant.describe()} on sm_{self.arch}"
        if self.error is not None:
            return [f"{where}: compile error: {self.error}"]
        out = []
        if self.n_spills != 0 or self.spill_loads != 0:
            out.append(f"{where}: spills {self.n_spills} B stores, {self.spill_loads} B loads")
        limit = SHARED_MEMORY_LIMIT.get(self.arch)
        if limit is None:
            out.append(f"{where}: no known shared memory limit for sm_{self.arch}")
        elif self.shared > limit:
            out.append(f"{where}: {self.shared} B shared memory > {limit} B")
        return out


def can_compile() -> tuple[bool, str]:
    """Whether this machine can compile for CUDA targets (Triton's NVIDIA backend and ptxas)."""
    try:
        from triton import knobs
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend

        make_backend(GPUTarget("cuda", 90, 32))
        ptxas = knobs.nvidia.ptxas.path
    except Exception as e:
        return False, f"Triton cannot target CUDA here: {e!r}"
    return True, ptxas


_PTXAS_REGS = re.compile(r"Used (\d+) registers")
_PTXAS_SPILLS = re.compile(
    r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads"
)


def _interpreting() -> bool:
    from triton import knobs

    return bool(knobs.runtime.interpret)


def compile_variant(variant: Variant, arch: int) -> CompileReport:
    """Compile ``variant`` for ``GPUTarget("cuda", arch, 32)``; never raises on a compile error.

    In a process under ``TRITON_INTERPRET=1`` it compiles in a subprocess.
    """
    if _interpreting():
        return compile_pairs([(variant, arch)], jobs=1)[0]
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    fn = KERNELS[variant.kernel]
    jit = fn if isinstance(fn, JITFunction) else JITFunction(_raw_fn(fn))
    names = [n for n, _ in variant.signature]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in variant.aligned}
    src = ASTSource(
        fn=jit,
        signature=dict(variant.signature),
        constexprs=dict(variant.constexprs),
        attrs=attrs,
    )
    options = {"num_warps": variant.num_warps, "num_stages": variant.num_stages}
    log = io.StringIO()
    start = time.perf_counter()
    old = (knobs.nvidia.dump_ptxas_log, knobs.compilation.always_compile)
    try:
        # ptxas's report (registers, spills) is printed only on a real compile, not a cache hit.
        knobs.nvidia.dump_ptxas_log = True
        knobs.compilation.always_compile = True
        with contextlib.redirect_stdout(log):
            kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    except Exception as e:
        message = str(e).strip().splitlines()
        return CompileReport(
            variant,
            arch,
            seconds=time.perf_counter() - start,
            error=f"{type(e).__name__}: {' | '.join(message[-12:])}",
        )
    finally:
        knobs.nvidia.dump_ptxas_log, knobs.compilation.always_compile = old
    seconds = time.perf_counter() - start
    text = log.getvalue()
    regs, spills = _PTXAS_REGS.search(text), _PTXAS_SPILLS.search(text)
    if regs is None or spills is None:
        return CompileReport(
            variant,
            arch,
            seconds=seconds,
            error="no ptxas report in the compile output",
            ptxas_log=text,
        )
    return CompileReport(
        variant,
        arch,
        n_regs=int(regs.group(1)),
        n_spills=int(spills.group(2)),
        spill_loads=int(spills.group(3)),
        stack=int(spills.group(1)),
        shared=int(kernel.metadata.shared),
        seconds=seconds,
        ptxas_log=text,
    )


def compile_all(
    variants: Sequence[Variant], archs: Sequence[int], jobs: int | None = None
) -> list[CompileReport]:
    """``compile_pairs`` of every variant with every arch (``variants`` enumerated for them)."""
    return compile_pairs([(v, a) for v in variants for a in archs], jobs)


def compile_pairs(
    work: Sequence[tuple[Variant, int]], jobs: int | None = None
) -> list[CompileReport]:
    """Compile each (variant, arch) in ``jobs`` subprocesses (default: the CPU count).

    The subprocesses run without ``TRITON_INTERPRET``, so this works from a test process that has
    it. Reports come back in the order of ``work``.
    """
    if not work:
        return []
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(work)))
    # Round-robin, so that every process gets a mix of heavy and light kernels.
    chunks = [work[i::jobs] for i in range(jobs)]
    env = dict(os.environ)
    env["TRITON_INTERPRET"] = "0"
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    results: dict[tuple[Any, ...], CompileReport] = {}
    with tempfile.TemporaryDirectory(prefix="tierserve-aot-") as tmp:
        env["TRITON_CACHE_DIR"] = str(Path(tmp, "cache"))  # every compile is fresh anyway
        procs = []
        for i, chunk in enumerate(chunks):
            src, dst = Path(tmp, f"in{i}.pkl"), Path(tmp, f"out{i}.pkl")
            src.write_bytes(pickle.dumps(chunk))
            cmd = [sys.executable, "-c", _WORKER, str(src), str(dst)]
            proc = subprocess.Popen(
                cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
            )
            procs.append((proc, dst))
        for proc, dst in procs:
            output, _ = proc.communicate()
            if proc.returncode != 0 or not dst.exists():
                text = output.decode(errors="replace")[-4000:]
                raise RuntimeError(f"AOT compile worker failed ({proc.returncode}):\n{text}")
            for report in pickle.loads(dst.read_bytes()):
                results[(report.variant.key(), report.arch)] = report
    return [results[(v.key(), a)] for v, a in work]


# Run as ``-c`` rather than ``-m tierserve.kernels.aot`` so that the reports pickle as ``tierserve.kernels.aot`` classes.
_WORKER = "import sys; from tierserve.kernels.aot import _worker; _worker(sys.argv[1], sys.argv[2])"


def _worker(src: str, dst: str) -> None:
    work: list[tuple[Variant, int]] = pickle.loads(Path(src).read_bytes())
    reports = [compile_variant(v, a) for v, a in work]
    Path(dst).write_bytes(pickle.dumps(reports))


def summarize(reports: Sequence[CompileReport]) -> str:
    """A per-architecture table: variants, worst registers and shared memory, spills, time."""
    lines = []
    for arch in sorted({r.arch for r in reports}):
        rs = [r for r in reports if r.arch == arch]
        ok = [r for r in rs if r.error is None]
        worst_regs = max(ok, key=lambda r: r.n_regs, default=None)
        worst_shared = max(ok, key=lambda r: r.shared, default=None)
        lines.append(
            f"sm_{arch}: {len(rs)} variants, {len(rs) - len(ok)} failed, "
            f"{sum(r.n_spills > 0 for r in ok)} spilling, "
            f"max regs {worst_regs.n_regs if worst_regs else '-'}, "
            f"max shared {worst_shared.shared if worst_shared else '-'} B "
            f"(limit {SHARED_MEMORY_LIMIT.get(arch, '?')}), "
            f"compile {sum(r.seconds for r in rs):.0f} s"
        )
        if worst_regs:
            lines.append(f"  most registers: {worst_regs.variant.describe()}")
        if worst_shared:
            lines.append(f"  most shared:    {worst_shared.variant.describe()}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m tierserve.kernels.aot [--arch 80 90] [--jobs N] [--verbose]``: compile the CI matrix."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--arch", type=int, nargs="+", default=list(CI_ARCHS))
    parser.add_argument("--jobs", type=int, default=None)
    parser.add_argument("--verbose", action="store_true", help="one line per variant")
    args = parser.parse_args(argv)
    work = [(v, arch) for arch in args.arch for v in variants_for(ci_configs(), arch)]
    reports = compile_pairs(work, args.jobs)
    if args.verbose:
        for r in reports:
            print(
                f"sm_{r.arch} regs={r.n_regs:4d} spills={r.n_spills} shared={r.shared:7d} "
                f"{r.seconds:5.1f}s {r.variant.describe()}"
            )
    print(summarize(reports))
    problems = [p for r in reports for p in r.problems()]
    for p in problems:
        print("PROBLEM:", p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
