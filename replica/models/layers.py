"""Building blocks of the Llama family: Linear, RMSNorm, rotary embeddings, SwiGLU.

Every op works on one flat batch of rows ``[T, ...]`` and is row-wise: a row's result depends
only on that row. In the deterministic mode each op also gives a row the same *bits* whatever
else is in the batch and wherever the row sits in it:

- ``Linear``: a CPU matmul picks its kernel by the number of rows (a 1-row product goes through
  a matrix-vector path that sums in another order). Padding the rows with zeros to a multiple of
  ``CPU_ROW_QUANTUM`` keeps every call on the same blocked GEMM path, whose per-element sum order
  depends neither on M nor on the row's position (checked for M = 1..1024, many shapes, 1 and 2
  threads, MKL on AVX2; ``linear_invariance_mismatches`` re-checks it on any machine).
- SiLU: ``F.silu`` gives different bits in the scalar tail of a vectorised loop; the
  deterministic path composes it from ``exp`` and IEEE arithmetic, which agree on both paths.
- RMSNorm reduces each row on its own on CPU; rotary embeddings are element-wise products and
  sums (no fused multiply-add): both are invariant as they are on CPU.
- Other devices (unverified here: no GPU on the development machine): a GPU picks its GEMM and
  reduction strategies from the tensor's size, so deterministic matmuls and RMSNorm reductions
  run on fixed tiles of ``DEVICE_ROW_TILE`` zero-padded rows, every call of one shape.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kernels import cpu_native
from replica.models.config import RopeScaling

CPU_ROW_QUANTUM = 4
DEVICE_ROW_TILE = 64


class Linear(nn.Module):
    """``y = x @ W.T (+ b)`` for ``x`` ``[M, in_features]``; ``weight`` is ``[out, in]``."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        deterministic: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.deterministic = deterministic
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, device=device, dtype=dtype), requires_grad=False
        )
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = nn.Parameter(
                torch.empty(out_features, device=device, dtype=dtype), requires_grad=False
            )

        # True once ``pack_for_cpu`` has replaced ``weight`` by the native kernel's layout.
        self.packed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return cpu_native.linear(x, self.weight, self.out_features, self.bias)
        if not self.deterministic:
            return F.linear(x, self.weight, self.bias)
        return invariant_linear(x, self.weight, self.bias)

    def pack_for_cpu(self) -> bool:
        """Repack ``weight`` for the native CPU kernel (``cpu_native.linear``) when it takes this
        layer (fp32 on CPU, not deterministic, kernels built); returns whether it did.

        The packed weight replaces the original (``weight`` becomes ``[out / 16, in, 16]``; no
        second copy is kept), so load weights first; ``dense_weight()`` gives the ``[out, in]``
        matrix back. A weight shared with another module (tied embeddings) is copied: this
        layer stops sharing it.
        """
        # fused_ok: fp32 on CPU, kernels built and enabled.
        if self.packed or self.deterministic or not cpu_native.fused_ok(self.weight):
            return False
        self.weight = nn.Parameter(cpu_native.pack_linear(self.weight.data), requires_grad=False)
        self.packed = True
        return True

    def dense_weight(self) -> torch.Tensor:
        """The weight as ``[out_features, in_features]`` (a copy when packed)."""
        if self.packed:
            return cpu_native.unpack_linear(self.weight.data, self.out_features)
        return self.weight.data

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, deterministic={self.deterministic}, "
            f"packed={self.packed}"
        )


def invariant_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear`` on ``x`` ``[M, K]`` whose row bits do not depend on M or on the row's place."""
    m = x.shape[0]
    if x.device.type == "cpu":
        rows = -(-max(m, 1) // CPU_ROW_QUANTUM) * CPU_ROW_QUANTUM
        if rows != m:
            x = F.pad(x, (0, 0, 0, rows - m))
        out = F.linear(x, weight)[:m]
    else:
        out = by_row_tiles(lambda t: F.linear(t, weight), x, DEVICE_ROW_TILE)
    if bias is not None:
        out.add_(bias)
    return out


def by_row_tiles(
    fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, tile: int
) -> torch.Tensor:
    """``fn`` (row-wise) on ``x`` ``[M, ...]`` as consecutive tiles of exactly ``tile`` rows (the
    last padded with zeros), so that every call has one shape; returns the first M rows."""
    m = x.shape[0]
    rows = -(-max(m, 1) // tile) * tile
    if rows != m:
        x = F.pad(x, (0,) * (2 * x.dim() - 1) + (rows - m,))
    out = torch.cat([fn(x[lo : lo + tile]) for lo in range(0, rows, tile)])
    return out[:m]


def linear_invariance_mismatches(
    weight: torch.Tensor,
    sizes: tuple[int, ...] = (1, 2, 3, 5, 7, 8, 13, 31, 64, 100),
    seed: int = 0,
) -> list[str]:
    """Check ``invariant_linear`` on this machine: each row of a batch against the same row computed
    at another place in a larger batch. Returns the failing cases (empty when invariant)."""
    gen = torch.Generator().manual_seed(seed)
    total = max(sizes) + 37
    x = torch.randn(total, weight.shape[1], generator=gen).to(weight.device, weight.dtype)
    full = invariant_linear(x, weight)
    bad = []
    for m in sizes:
        for off in {0, 1, total - m, (total - m) // 2}:
            if not torch.equal(invariant_linear(x[off : off + m], weight), full[off : off + m]):
                bad.append(f"{m} rows at offset {off}")
    return bad


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight``, computed in fp32, returned in ``x``'s dtype."""

    def __init__(
        self,
        hidden_size: int,
        eps: float,
        deterministic: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.eps = eps
        self.deterministic = deterministic
        self.weight = nn.Parameter(
            torch.ones(hidden_size, device=device, dtype=dtype), requires_grad=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.deterministic and cpu_native.fused_ok(x):
            return cpu_native.rms_norm(x, self.weight, self.eps)
        xf = x.float()
        if self.deterministic and x.device.type != "cpu":
            mean_sq = by_row_tiles(_mean_square, xf, DEVICE_ROW_TILE)
        else:
            mean_sq = _mean_square(xf)
        out = xf * mean_sq.add_(self.eps).rsqrt_()
        if out.dtype != x.dtype:
            out = out.to(x.dtype)
        return out.mul_(self.weight)

    def add_and_norm(self, residual: torch.Tensor, delta: torch.Tensor | None) -> torch.Tensor:
        """``residual += delta`` in place (skipped when ``delta`` is None), then the norm of it;
        one pass over the rows on the native CPU path."""
        if delta is None:
            return self(residual)
        if not self.deterministic and cpu_native.fused_ok(residual):
            return cpu_native.rms_norm(residual, self.weight, self.eps, delta)
        residual.add_(delta)
        return self(residual)


def _mean_square(x: torch.Tensor) -> torch.Tensor:
    return x.pow(2).mean(-1, keepdim=True)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse rotary frequencies ``[head_dim // 2]`` (fp32), with Llama 3 scaling if given.

    Llama 3 scaling keeps high frequencies (wavelength below ``original / high_freq_factor``),
    divides low ones (wavelength above ``original / low_freq_factor``) by ``factor``, and blends
    linearly between the two in the band between.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    orig = scaling.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    slow = inv_freq / scaling.factor
    blend = (orig / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    mixed = (1 - blend) * inv_freq / scaling.factor + blend * inv_freq
    out = torch.where(wavelen > orig / scaling.low_freq_factor, slow, inv_freq)
    band = (wavelen >= orig / scaling.high_freq_factor) & (
        wavelen <= orig / scaling.low_freq_factor
    )
    return torch.where(band, mixed, out)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding tables (the "rotate half" layout).

    ``cos``/``sin`` ``[max_positions, head_dim // 2]`` are computed once in fp32 and follow the
    module's dtype; a position past the tables is an indexing error.
    """

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: RopeScaling | None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", freqs.cos().to(device=device, dtype=dtype), persistent=False)
        self.register_buffer("sin", freqs.sin().to(device=device, dtype=dtype), persistent=False)

    @property
    def max_positions(self) -> int:
        return int(self.cos.shape[0])

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos``, ``sin`` ``[T, 1, head_dim // 2]`` of ``positions`` ``[T]``, for ``apply_rotary_``."""
        cos = self.cos.index_select(0, positions).unsqueeze(1)
        sin = self.sin.index_select(0, positions).unsqueeze(1)
        return cos, sin


def apply_rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate ``x`` ``[T, heads, head_dim]`` (any row/head strides) in place: the first half
    becomes ``x1 cos - x2 sin``, the second ``x2 cos + x1 sin``."""
    half = x.shape[-1] // 2
    x1 = x[..., :half]
    x2 = x[..., half:]
    x1_sin = x1 * sin
    x2_sin = x2 * sin
    x1.mul_(cos).sub_(x2_sin)
    x2.mul_(cos).add_(x1_sin)


def silu_and_mul(gate_up: torch.Tensor, deterministic: bool = False) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up`` ``[T, 2 * I]`` laid out ``[gate | up]`` -> ``[T, I]``."""
    if not deterministic and gate_up.dim() == 2 and cpu_native.fused_ok(gate_up):
        return cpu_native.silu_and_mul(gate_up)
    inter = gate_up.shape[-1] // 2
    gate = gate_up[..., :inter]
    up = gate_up[..., inter:]
    if not deterministic:
        return F.silu(gate).mul_(up)
    denom = torch.neg(gate).exp_().add_(1.0)
    return torch.div(gate, denom, out=denom).mul_(up)


class SwiGLU(nn.Module):
    """The Llama MLP: ``down(silu(gate(x)) * up(x))`` with gate and up fused in one weight."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        deterministic: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.deterministic = deterministic
        self.gate_up_proj = Linear(
            hidden_size, 2 * intermediate_size, False, deterministic, device, dtype
        )
        self.down_proj = Linear(intermediate_size, hidden_size, False, deterministic, device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x), self.deterministic))


class VocabEmbedding(nn.Module):
    """Token id -> row of ``weight`` ``[vocab, hidden]``."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(vocab_size, hidden_size, device=device, dtype=dtype), requires_grad=False
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)
