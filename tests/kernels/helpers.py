"""Builders for paged-attention test cases: random sequences in a large pool of KV blocks."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tierserve.kernels import reference
from tierserve.kernels.metadata import AttentionMetadata, SeqSpec, build_metadata

# Devices of the plain-torch paths: CPU always, CUDA when present.
DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


def triton_devices(
    cuda_available: bool | None = None, interpreted: bool | None = None
) -> list[str]:
    """Where the Triton kernels can run in this process: ``cpu`` when they were built for the
    interpreter (``TRITON_INTERPRET=1``), else ``cuda`` when a GPU is present, else nowhere.

    Compiled kernels take GPU tensors only, and the interpreter is the CPU path, so never both.
    The arguments default to this process's state (tests pass them to check every case).
    """
    if cuda_available is None:
        cuda_available = torch.cuda.is_available()
    if interpreted is None:
        interpreted = _triton_interpreted()
    if interpreted:
        return ["cpu"]
    return ["cuda"] if cuda_available else []


def _triton_interpreted() -> bool:
    try:
        from tierserve.kernels import triton_attention
    except ImportError:  # no Triton on this platform
        return False
    return triton_attention.interpreted()


# Devices of the Triton paths (empty: the Triton tests skip).
TRITON_DEVICES = triton_devices()
# (atol, rtol) of a result in this dtype against the fp32-math reference.
TOL: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (5e-3, 5e-3),
    torch.bfloat16: (3e-2, 3e-2),
}


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    """``got`` matches ``want`` within ``dtype``'s tolerance (compared in fp32)."""
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(
        got.float(), want.float(), atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}"
    )


@dataclass(frozen=True, slots=True)
class Shape:
    """Head layout of a test model."""

    kv_heads: int
    group: int
    head_dim: int

    @property
    def q_heads(self) -> int:
        return self.kv_heads * self.group


@dataclass(slots=True)
class Seq:
    """A whole sequence's per-position tensors; a step feeds rows ``start:start + q_len``."""

    q: torch.Tensor  # [L, q_heads, D]
    k: torch.Tensor  # [L, kv_heads, D]
    v: torch.Tensor
    blocks: list[int]


@dataclass(slots=True)
class Step:
    """One flat batch ready for ``attention``: this step's q/k/v rows and its metadata."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    meta: AttentionMetadata


def new_cache(
    num_blocks: int, block_size: int, shape: Shape, dtype: torch.dtype, device: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V caches filled with NaN: any read of a position that was never stored poisons."""
    size = (num_blocks, block_size, shape.kv_heads, shape.head_dim)
    k = torch.full(size, float("nan"), dtype=dtype, device=device)
    return k, k.clone()


def random_blocks(
    count: int, num_blocks: int, gen: torch.Generator, taken: set[int] | None = None
) -> list[int]:
    """``count`` distinct, shuffled block ids from the top of the pool (large ids, non-contiguous)."""
    taken = set() if taken is None else taken
    window = min(num_blocks - 1, 1024)
    top = torch.randperm(window, generator=gen) + (num_blocks - window)
    out = [b for b in top.tolist() if b not in taken][:count]
    assert len(out) == count, "pool too small for the test"
    taken.update(out)
    return out


def new_seq(
    length: int,
    shape: Shape,
    block_size: int,
    num_blocks: int,
    dtype: torch.dtype,
    device: str,
    gen: torch.Generator,
    taken: set[int] | None = None,
) -> Seq:
    """Random q/k/v for ``length`` positions and a random block table covering them."""

    def rnd(heads: int) -> torch.Tensor:
        return torch.randn(length, heads, shape.head_dim, generator=gen).to(dtype).to(device)

    blocks = random_blocks(-(-length // block_size), num_blocks, gen, taken)
    return Seq(rnd(shape.q_heads), rnd(shape.kv_heads), rnd(shape.kv_heads), blocks)


def store_prefix(seq: Seq, upto: int, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Put positions ``0..upto-1`` of ``seq`` in the cache (what earlier steps stored)."""
    if upto == 0:
        return
    bs = k_cache.shape[1]
    meta = build_metadata([SeqSpec(0, upto, seq.blocks)], bs, k_cache.device)
    reference.store_kv(seq.k[:upto], seq.v[:upto], k_cache, v_cache, meta.slot_mapping)


def make_step(
    parts: Sequence[tuple[Seq, int, int]], block_size: int, device: str | torch.device
) -> Step:
    """A flat batch of ``(seq, start, q_len)`` parts; decodes (q_len 1) must come first."""
    specs = [SeqSpec(start, n, s.blocks) for s, start, n in parts]
    meta = build_metadata(specs, block_size, device)
    q = torch.cat([s.q[start : start + n] for s, start, n in parts])
    k = torch.cat([s.k[start : start + n] for s, start, n in parts])
    v = torch.cat([s.v[start : start + n] for s, start, n in parts])
    return Step(q, k, v, meta)


def row_slices(parts: Sequence[tuple[Seq, int, int]]) -> list[slice]:
    """The rows each part occupies in the flat batch."""
    out, row = [], 0
    for _, _, n in parts:
        out.append(slice(row, row + n))
        row += n
    return out
