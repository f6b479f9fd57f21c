"""The paged KV pool: per-layer K and V tensors addressed by block id and offset.

One block holds ``block_tokens`` positions of K and V for every layer and KV head:
``2 * layers * kv_heads * block_tokens * head_dim * dtype_bytes`` bytes (docs/scheduler.md §3). The number of
blocks comes from ``num_kv_blocks`` outright, from a byte budget (CPU), or from a fraction of the
GPU's memory minus what the weights and a profiled forward already hold (like vLLM's
``gpu_memory_utilization``). The pool builds the scheduler's ``FreeListBlocks`` over exactly its
own block ids: one source of truth for how many blocks exist.
"""

from __future__ import annotations

import contextlib
import math
import mmap
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kernels.metadata import slots_for
from replica.block_space import BlockSpace, FreeListBlocks
from replica.prefix_cache import PrefixCachingBlocks


@dataclass(frozen=True, slots=True)
class KVShape:
    """What one position of K/V costs: the model's layers, KV heads and head size, and the dtype."""

    layers: int
    kv_heads: int
    head_dim: int
    block_tokens: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        for name in ("layers", "kv_heads", "head_dim", "block_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KVShape.{name} must be positive, got {getattr(self, name)}")

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across every layer, K and V."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.layers * self.kv_heads * self.block_tokens * self.head_dim * itemsize

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
    shape: KVShape, sizing: PoolSizing, device: torch.device, activation_peak_bytes: int = 0
) -> int:
    """The pool's block count under ``sizing`` on ``device``; raises when not even one block fits."""
    if sizing.num_kv_blocks is not None:
        n = sizing.num_kv_blocks
        how = f"num_kv_blocks={n}"
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
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
    """Per-layer ``(k_cache, v_cache)``, each ``[num_blocks, block_tokens, kv_heads, head_dim]``."""

    def __init__(self, shape: KVShape, num_blocks: int, device: torch.device | str = "cpu") -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.shape = shape
        self.num_blocks = num_blocks
        self.device = torch.device(device)
        dims = (num_blocks, shape.block_tokens, shape.kv_heads, shape.head_dim)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = [
            (zeroed(dims, shape.dtype, self.device), zeroed(dims, shape.dtype, self.device))
            for _ in range(shape.layers)
        ]

    @property
    def block_tokens(self) -> int:
        return self.shape.block_tokens

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.shape.block_bytes

    def new_block_space(self, prefix_root: int | None = None) -> BlockSpace:
        """A ``BlockSpace`` over exactly this pool's block ids: with ``prefix_root`` (the model's
        ``prefix_cache.model_key``) a prefix cache, else a plain free list."""
        if prefix_root is None:
            return FreeListBlocks(self.shape.block_tokens, range(self.num_blocks))
        return PrefixCachingBlocks(self.shape.block_tokens, range(self.num_blocks), prefix_root)

    def slot_mapping(self, block_table: Sequence[int], start: int, end: int) -> list[int]:
        """Slots of positions ``start .. end`` through ``block_table``."""
        return slots_for(block_table, start, end, self.shape.block_tokens)
