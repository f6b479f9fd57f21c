"""The paged KV pool: per-layer K and V tensors addressed by block id and offset.

One block holds ``block_size`` positions of K and V for every layer and KV head:
``2 * layers * kv_heads * block_size * head_dim * dtype_bytes`` bytes (docs/scheduler.md §3). The number of
blocks comes from ``num_kv_blocks`` outright, from a byte budget (CPU), or from a fraction of the
GPU's memory minus what the weights and a profiled forward already hold (like vLLM's
``gpu_memory_utilization``). The pool builds the scheduler's ``FreeListBlocks`` over exactly its
own block ids: one source of truth for how many blocks exist.

The activations a step needs come off the GPU budget before the pool takes the rest
(``plan_kv_pool``). ``StepBound`` is the largest step the engine's caps allow: every batched
token, over as many sequences as the chunking needs, each context at the longest, and every
row's logits wanted (prompt log-probabilities score each token of a prompt). On CUDA one forward
of that step runs at start-up, before the pool exists, on a pool of one block
(``profile_step``), and its peak is measured (``measure_cuda_peak``); elsewhere
``estimate_activation_bytes`` gives an upper estimate (the CPU pool has a byte budget of its own,
so the estimate is reported, not subtracted).
"""

from __future__ import annotations

import contextlib
import math
import mmap
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

import numpy as np
import torch

from tierserve.arith import ceil_div
from tierserve.kernels.metadata import AttentionMetadata, SeqSpec, build_metadata
from tierserve.records import MAX_LOGPROBS
from tierserve.replica.block_space import BlockSpace, FreeListBlocks
from tierserve.replica.models.config import ModelConfig
from tierserve.replica.prefix_cache import PrefixCachingBlocks


@dataclass(frozen=True, slots=True)
class KVShape:
    """What one position of K/V costs: the model's layers, KV heads and head size, and the dtype."""

    layers: int
    kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        for name in ("layers", "kv_heads", "head_dim", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KVShape.{name} must be positive, got {getattr(self, name)}")

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across every layer, K and V."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.layers * self.kv_heads * self.block_size * self.head_dim * itemsize

    def blocks_for_budget(self, budget_bytes: int) -> int:
        """How many whole blocks fit ``budget_bytes``."""
        return max(0, int(budget_bytes) // self.block_bytes)


@dataclass(frozen=True, slots=True)
class PoolSizing:
    """How the pool's size is chosen; the first that is set wins.

    num_kv_blocks: exactly this many blocks. kv_cache_memory_bytes: a byte budget (the CPU default).
    gpu_memory_utilization: on CUDA, the fraction of the GPU's total memory the process may use in
    all; the pool gets what is left of it after the weights and the profiled activation peak.
    """

    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = 256 * 2**20
    gpu_memory_utilization: float = 0.9

    def __post_init__(self) -> None:
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise ValueError(f"num_kv_blocks must be positive, got {self.num_kv_blocks}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be positive, got {self.kv_cache_memory_bytes}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )


def choose_num_blocks(
    shape: KVShape,
    sizing: PoolSizing,
    device: torch.device,
    activation_peak_bytes: int = 0,
    memory: tuple[int, int] | None = None,
) -> int:
    """The pool's block count under ``sizing`` on ``device``; raises when not even one block fits.

    On CUDA the budget is ``gpu_memory_utilization`` of the device's total memory, less what is
    in use now (weights, the CUDA context, other processes) and ``activation_peak_bytes``.
    ``memory``: the device's ``(free, total)`` bytes where the caller has them (default: asked of
    ``torch.cuda.mem_get_info``)."""
    if sizing.num_kv_blocks is not None:
        n = sizing.num_kv_blocks
        how = f"num_kv_blocks={n}"
    elif device.type == "cuda":
        free, total = memory if memory is not None else torch.cuda.mem_get_info(device)
        used = total - free
        budget = int(total * sizing.gpu_memory_utilization) - used - activation_peak_bytes
        n = shape.blocks_for_budget(budget)
        how = (
            f"gpu_memory_utilization={sizing.gpu_memory_utilization} of {total / 2**30:.1f} GiB "
            f"with {used / 2**30:.2f} GiB in use and a {activation_peak_bytes / 2**30:.2f} GiB "
            "activation peak"
        )
    else:
        budget = sizing.kv_cache_memory_bytes or 0
        n = shape.blocks_for_budget(budget)
        how = f"kv_cache_memory_bytes={budget}"
    if n < 1:
        raise ValueError(
            f"the KV pool has room for no block ({how}; one block is {shape.block_bytes} bytes): "
            "raise the budget or lower block_size"
        )
    return n


ALIGN_BYTES = 64  # a cache line, and one AVX-512 register
HUGE_PAGE_BYTES = 2 << 20  # x86-64's transparent huge page
_MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault every page of a range in, writable, now


def zeroed(
    dims: tuple[int, ...], dtype: torch.dtype, device: torch.device, *, populate: bool = True
) -> torch.Tensor:
    """A zeroed tensor. On the CPU its memory is an anonymous mapping of its own (the OS's zeroed
    pages), aligned to a huge page and advised for transparent huge pages (used where the kernel
    runs them in ``madvise`` mode, as is common; elsewhere the advice is ignored).

    ``populate`` (the default) faults every page in now: a page touched for the first time costs a
    fault and its zeroing, some microseconds per 4 KiB page, and a lazily mapped pool would pay
    that inside the serving steps that first write each block (measured at 6% of an offline run
    on the real model). Reserving the pool at start-up also means a machine without the memory
    fails then, not under load. ``populate=False`` leaves the pages to the first touch."""
    if device.type != "cpu":
        return torch.zeros(dims, dtype=dtype, device=device)
    nbytes = math.prod(dims) * dtype.itemsize
    region = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = np.frombuffer(region, dtype=np.uint8)  # keeps the mapping alive with the tensor
    start = -raw.ctypes.data % HUGE_PAGE_BYTES
    body = raw[start:start + nbytes]
    if nbytes:
        with contextlib.suppress(OSError):  # a kernel built without transparent huge pages
            region.madvise(mmap.MADV_HUGEPAGE, start, nbytes)
        if populate:
            try:
                region.madvise(_MADV_POPULATE_WRITE, start, nbytes)
            except OSError:  # a kernel older than 5.14
                body[:: mmap.PAGESIZE] = 0  # touch one byte per page
    return torch.from_numpy(body).view(dtype).view(dims)


class KVPool:
    """Per-layer ``(k_cache, v_cache)``, each ``[num_blocks, block_size, kv_heads, head_dim]``."""

    def __init__(self, shape: KVShape, num_blocks: int, device: torch.device | str = "cpu") -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.shape = shape
        self.num_blocks = num_blocks
        self.device = torch.device(device)
        dims = (num_blocks, shape.block_size, shape.kv_heads, shape.head_dim)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = [
            (zeroed(dims, shape.dtype, self.device), zeroed(dims, shape.dtype, self.device))
            for _ in range(shape.layers)
        ]

    @property
    def block_size(self) -> int:
        return self.shape.block_size

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.shape.block_bytes

    def new_block_space(self, prefix_root: int | None = None) -> BlockSpace:
        """A ``BlockSpace`` over exactly this pool's block ids: with ``prefix_root`` (the model's
        ``prefix_cache.model_key``) a prefix cache, else a plain free list."""
        if prefix_root is None:
            return FreeListBlocks(self.shape.block_size, range(self.num_blocks))
        return PrefixCachingBlocks(self.shape.block_size, range(self.num_blocks), prefix_root)


# ---------------------------------------------------------------- activations and the pool's size


class StepModel(Protocol):
    """A causal LM as the runner runs it (``tierserve.replica.runner.CausalLM``): one forward over a
    flat batch, the logits of its ``logits_indices`` rows."""

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor: ...


@dataclass(frozen=True, slots=True)
class StepBound:
    """The largest step an engine's caps allow, as ``profile_step`` lays it out.

    ``tokens`` query tokens (``max_num_batched_tokens``, at most ``seqs * max_len``) cut into
    chunks of ``chunk`` tokens (the last shorter), one sequence each, at most ``seqs`` of them;
    every chunk ends at position ``max_len`` (the longest context attention reads), and every
    token's logits are wanted (a step of prompts scored for their log-probabilities)."""

    tokens: int
    seqs: int
    max_len: int
    chunk: int

    @classmethod
    def of(
        cls,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        prefill_chunk_tokens: int | None = None,
    ) -> StepBound:
        tokens = min(max_num_batched_tokens, max_num_seqs * max_model_len)
        chunk = min(prefill_chunk_tokens or tokens, tokens, max_model_len)
        if ceil_div(tokens, chunk) > max_num_seqs:  # too few sequences for chunks that short
            chunk = ceil_div(tokens, max_num_seqs)
        return cls(tokens, max_num_seqs, max_model_len, chunk)

    @property
    def logit_rows(self) -> int:
        """Rows of logits of the step: every token's."""
        return self.tokens

    def chunk_lens(self) -> list[int]:
        full, rest = divmod(self.tokens, self.chunk)
        return [self.chunk] * full + ([rest] if rest else [])

    def specs(self, block_size: int) -> list[SeqSpec]:
        """The step's sequences, every block table naming block 0 only (the profile's pool has
        one block: what is written there is thrown away)."""
        table = [0] * ceil_div(self.max_len, block_size)
        return [SeqSpec(self.max_len - n, n, table) for n in self.chunk_lens()]


def estimate_activation_bytes(model: ModelConfig, step: StepBound, dtype: torch.dtype) -> int:
    """An upper estimate of the memory one step of ``step`` needs beyond the weights and the KV.

    The logits dominate with a large vocabulary: ``[rows, vocab]`` in the model's dtype, their
    fp32 copy (``StepLogits``), and the fp32 log-softmax of the prompt log-probabilities, all
    alive at once at worst. Then one layer's activations at a time (the residual stream and the
    MLP's input kept, the fused QKV and gate/up outputs and the attention output) and the
    attention's per-sequence work (scores of a chunk against its context, fp32)."""
    item = torch.empty((), dtype=dtype).element_size()
    t, v = step.tokens, model.vocab_size
    logits = step.logit_rows * v * (item + 4 + 4)
    per_token = (
        4 * model.hidden_size  # residual, delta, the norm's output, the layer's output
        + model.q_size + 2 * model.kv_size  # fused QKV
        + model.q_size  # attention output
        + 3 * model.intermediate_size  # gate/up, then the activation
    )
    if model.is_moe:  # per (token, expert) pair: its input row, gate/up, activation, output
        per_token += model.num_experts_per_tok * (
            2 * model.hidden_size + 3 * model.moe_intermediate_size
        ) + model.num_experts + 3 * model.shared_expert_intermediate_size
    layer = t * per_token * item
    attention = step.chunk * step.max_len * model.num_heads * 4
    return int(logits + layer + attention)


def profile_step(
    model: StepModel, shape: KVShape, step: StepBound, device: torch.device, vocab_size: int
) -> Callable[[], None]:
    """The forward of ``step`` as the engine runs it, ready to run: inputs built now (on a KV pool
    of one block), then model, the logits in fp32, and their log-softmax and top
    log-probabilities (what prompt log-probabilities compute) when called."""
    pool = KVPool(shape, 1, device)
    meta = build_metadata(step.specs(shape.block_size), shape.block_size, device)
    gen = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, vocab_size, (step.tokens,), generator=gen).to(device)
    rows = torch.arange(step.logit_rows, dtype=torch.int64, device=device)
    k = min(MAX_LOGPROBS, vocab_size)

    @torch.inference_mode()
    def run() -> None:
        logits = model(ids, meta.positions, pool.kv_caches, meta, rows).float()
        logp = torch.log_softmax(logits, dim=-1)
        logp.topk(k, dim=-1)

    return run


def measure_cuda_peak(run: Callable[[], object], device: torch.device) -> int:
    """Bytes ``run()`` allocated on ``device`` at its peak beyond what was allocated before it;
    the memory it freed goes back to the device (``empty_cache``) for the pool to take."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    run()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    torch.cuda.empty_cache()
    return max(0, int(peak))


def activation_meter(
    model: StepModel,
    shape: KVShape,
    step: StepBound,
    device: torch.device,
    vocab_size: int,
    sizing: PoolSizing,
) -> Callable[[], int] | None:
    """How ``plan_kv_pool`` measures the activation peak of ``step``: on CUDA, when the pool is
    sized by ``gpu_memory_utilization``, a call builds the step's inputs (``profile_step``) and
    measures its forward (``measure_cuda_peak``); None where nothing is measured."""
    if device.type != "cuda" or sizing.num_kv_blocks is not None:
        return None

    def measure() -> int:
        return measure_cuda_peak(profile_step(model, shape, step, device, vocab_size), device)

    return measure


@dataclass(frozen=True, slots=True)
class PoolPlan:
    """The pool's size and the activation peak it was sized with: ``profiled`` (measured on the
    device) or ``estimated`` (``estimate_activation_bytes``). Only the CUDA budget of
    ``gpu_memory_utilization`` subtracts it (``subtracted``)."""

    num_blocks: int
    activation_peak_bytes: int
    activation_source: Literal["profiled", "estimated"]
    subtracted: bool


def plan_kv_pool(
    shape: KVShape,
    sizing: PoolSizing,
    device: torch.device,
    estimate_bytes: int,
    measure_peak: Callable[[], int] | None = None,
    memory: tuple[int, int] | None = None,
) -> PoolPlan:
    """Size the pool: on CUDA under ``gpu_memory_utilization`` (no ``num_kv_blocks``), the
    activation peak is ``measure_peak()`` (a profiled forward, see ``profile_step``) or, without
    it, ``estimate_bytes``, and comes off the budget; elsewhere the pool's size is explicit
    (``num_kv_blocks``, or the CPU's ``kv_cache_memory_bytes``) and nothing is profiled.
    ``memory``: the device's ``(free, total)``, as ``choose_num_blocks`` takes it."""
    budgeted = sizing.num_kv_blocks is None and device.type == "cuda"
    source: Literal["profiled", "estimated"] = "estimated"
    peak = int(estimate_bytes)
    if budgeted and measure_peak is not None:
        peak, source = int(measure_peak()), "profiled"
    n = choose_num_blocks(shape, sizing, device, peak if budgeted else 0, memory)
    return PoolPlan(n, peak, source, budgeted)
