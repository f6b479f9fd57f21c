"""Building blocks of the Llama family: Linear, RMSNorm (and Qwen3's per-head q/k norm), rotary
embeddings, SwiGLU.

Every op works on one flat batch of rows ``[T, ...]`` and is row-wise: a row's result depends
only on that row. On CPU in fp32 the linear layers, the norms and SiLU run on the native kernels
(``tierserve.kernels.cpu_ops``) when they are built; elsewhere on plain torch.

The deterministic mode (``deterministic=True``; docs/determinism.md) promises more: a row gets the
same *bits* whatever else is in the batch and wherever it sits. It runs on the native kernels
only, whose sums run in an order fixed by the row alone; it never falls back to a library GEMM or
reduction (those pick their blocking from the batch's shape and the CPU). Where the native
kernels cannot run, a deterministic layer raises ``DeterministicModeUnavailable`` instead of
running without the guarantee. Rotary embeddings and the residual add are element-wise.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tierserve.kernels import cpu_native, cpu_ops, cpu_packing
from tierserve.kernels.cpu_abi import QUANT_NAMES
from tierserve.replica.models.config import (
    LinearScaling,
    LongRopeScaling,
    RopeScaling,
    YarnScaling,
)


class Linear(nn.Module):
    """``y = x @ W.T (+ b)`` for ``x`` ``[M, in_features]``; ``weight`` is ``[out, in]``.

    On CPU in fp32, ``pack_for_cpu`` moves it to the native kernel. The deterministic mode runs
    every row count there. The default mode keeps whichever of the native kernel and the
    library's GEMM is clearly faster on this CPU for the layer's shape, per row count
    (``cpu_calibration.library_rows``, timed once per shape at pack time): the native kernel up
    to a row count, the library from it on when it wins there (then the layer keeps its
    ``[out, in]`` weight beside the packed one: ``out x in`` floats more), or the library
    throughout (the layer then stays unpacked: one copy).

    A weight that is exactly the dequantization of a quantized checkpoint (a GGUF's Q4_1 or
    Q8_0: ``cpu_packing.pack_linear_quantized``) is packed in that form instead (``bits`` 4 or
    8): 1/6.4 (Q4) or 1/3.8 (Q8) of the bytes for a decode step to stream, the same output
    bits; likewise a K-quant's (Q4_K, Q5_K, Q6_K: ``bits`` ``cpu_abi.QUANT_K4`` ..., 1/5.3 or
    1/3.2).
    """

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
        # (rows, [out, in] weight): from this many rows forward runs the library's GEMM on that
        # weight instead (default mode, where it is clearly faster here); None: never. A plain
        # attribute, not a parameter: the weights as loaded are ``weight`` alone.
        self.library: tuple[int, torch.Tensor] | None = None
        # 4, 8 or a K-quant form's code once packed as quantized panels (``weight`` then uint8),
        # else None.
        self.bits: int | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            lib = self.library
            if lib is not None and x.shape[0] >= lib[0]:
                return F.linear(x, lib[1], self.bias)
            if self.bits is not None:
                return cpu_ops.linear_quantized(
                    x, self.weight, self.bits, self.out_features, self.bias
                )
            return cpu_ops.linear(x, self.weight, self.out_features, self.bias)
        if self.deterministic:
            raise cpu_native.DeterministicModeUnavailable(
                "a deterministic Linear runs on the native kernel's packed weights: call "
                "pack_for_cpu() once its weights are loaded (the model loaders do)"
            )
        return F.linear(x, self.weight, self.bias)

    def pack_for_cpu(self) -> bool:
        """Repack ``weight`` for the native CPU kernel (``cpu_ops.linear``) when it takes this
        layer (fp32 on CPU, kernels built) and, in the default mode, is the faster path here at
        some row count (``cpu_packing.pack_weight`` decides); returns whether it did. A
        deterministic layer that the kernel cannot take raises ``DeterministicModeUnavailable``.

        The packed weight replaces the original (``weight`` becomes ``[out / 16, in, 16]``, or
        the quantized panels' bytes), so load weights first; ``dense_weight()`` gives the
        ``[out, in]`` matrix back. A second copy
        is kept only where the library takes over from some row count (see the class). A weight
        shared with another module (tied embeddings) is copied: this layer stops sharing it.
        """
        if self.packed:
            return False
        packed = cpu_packing.pack_weight(self.weight.data, self.bias, self.deterministic)
        if packed is None:
            return False
        self.library = packed.library
        self.weight = nn.Parameter(packed.weight, requires_grad=False)
        self.packed = True
        self.bits = packed.bits
        return True

    def dense_weight(self) -> torch.Tensor:
        """The weight as ``[out_features, in_features]`` (a copy when packed)."""
        if self.packed:
            return cpu_packing.unpack_weight(
                self.weight.data, self.bits, self.out_features, self.in_features
            )
        return self.weight.data

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, deterministic={self.deterministic}, "
            f"packed={self.packed}"
            + ("" if self.bits is None else f", quantized={QUANT_NAMES[self.bits]}")
            + ("" if self.library is None else f", library_from_rows={self.library[0]}")
        )


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight``, computed in fp32, returned in ``x``'s dtype.

    ``fused`` (the model's triton backend): the norm, with its residual add, is one Triton kernel
    (``tierserve.kernels.fused.rms_norm``) that rounds where these torch ops do.
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float,
        deterministic: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        fused: bool = False,
    ) -> None:
        super().__init__()
        self.eps = eps
        self.deterministic = deterministic
        self.fused = fused
        self.weight = nn.Parameter(
            torch.ones(hidden_size, device=device, dtype=dtype), requires_grad=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused and x.dim() == 2:
            from tierserve.kernels import (
                fused,  # imported late: Triton reads TRITON_INTERPRET at import
            )

            return fused.rms_norm(x, self.weight, self.eps)
        if self.deterministic:
            cpu_native.require_fused(x, "RMSNorm")
        if cpu_native.fused_ok(x):
            return cpu_ops.rms_norm(x, self.weight, self.eps)
        xf = x.float()
        out = xf * xf.pow(2).mean(-1, keepdim=True).add_(self.eps).rsqrt_()
        if out.dtype != x.dtype:
            out = out.to(x.dtype)
        return out.mul_(self.weight)

    def add_and_norm(self, residual: torch.Tensor, delta: torch.Tensor | None) -> torch.Tensor:
        """``residual += delta`` in place (skipped when ``delta`` is None), then the norm of it;
        one pass over the rows on the native CPU path."""
        if delta is None:
            return self(residual)
        if self.fused and residual.dim() == 2:
            from tierserve.kernels import fused

            return fused.rms_norm(residual, self.weight, self.eps, delta)
        if self.deterministic:
            cpu_native.require_fused(residual, "RMSNorm")
        if cpu_native.fused_ok(residual):
            return cpu_ops.rms_norm(residual, self.weight, self.eps, delta)
        residual.add_(delta)
        return self(residual)


def qk_norm_(
    qkv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    q_heads: int,
    eps: float,
    deterministic: bool = False,
) -> None:
    """Qwen3's q/k norm: RMS-normalize each q head of ``qkv`` ``[T, q_heads + 2 * kv_heads, D]``
    over ``D`` by ``q_weight`` and each k head by ``k_weight`` (both ``[D]``), in place, as
    ``RMSNorm.forward`` does a row (fp32, rounded to ``qkv``'s dtype before the weight multiplies
    it); v is left alone. On the native kernel (``cpu_ops.qk_norm``) where it takes ``qkv``;
    the deterministic mode runs there only. A head's result depends on that head alone."""
    if deterministic:
        cpu_native.require_fused(qkv, "q/k RMSNorm")
    if cpu_native.fused_ok(qkv):
        cpu_ops.qk_norm(qkv, q_weight, k_weight, q_heads, eps)
        return
    kv_heads = (qkv.shape[1] - q_heads) // 2
    qk = qkv[:, : q_heads + kv_heads]
    xf = qk.float()
    normed = xf * xf.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()
    if normed.dtype != qkv.dtype:
        normed = normed.to(qkv.dtype)
    qk[:, :q_heads] = normed[:, :q_heads] * q_weight
    qk[:, q_heads:] = normed[:, q_heads:] * k_weight


def rope_inv_freq(
    head_dim: int,
    theta: float,
    scaling: RopeScaling | YarnScaling | LongRopeScaling | LinearScaling | None,
    max_positions: int | None = None,
) -> torch.Tensor:
    """Inverse rotary frequencies ``[head_dim // 2]`` (fp32), with Llama 3, YaRN, LongRoPE or
    linear scaling if given (their ``attention_factor`` is not here: ``RotaryEmbedding`` applies
    it to its tables). ``head_dim`` is the rotated dims (``ModelConfig.rope_dim``). Linear
    scaling divides every frequency by ``factor`` (positions / factor).

    Llama 3 scaling keeps high frequencies (wavelength below ``original / high_freq_factor``),
    divides low ones (wavelength above ``original / low_freq_factor``) by ``factor``, and blends
    linearly between the two in the band between. LongRoPE divides each frequency by its own
    factor, the short or the long ones by ``max_positions`` (``LongRopeScaling.factors``; None:
    the short ones, as ``transformers`` starts).
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    if isinstance(scaling, YarnScaling):
        return _yarn_inv_freq(head_dim, theta, scaling)
    if isinstance(scaling, LongRopeScaling):
        chosen = scaling.factors(max_positions or scaling.original_max_position_embeddings)
        return 1.0 / (torch.tensor(chosen, dtype=torch.float32) * theta**exponents)
    if isinstance(scaling, LinearScaling):
        return inv_freq / scaling.factor
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


def _yarn_inv_freq(head_dim: int, theta: float, scaling: YarnScaling) -> torch.Tensor:
    """YaRN: per frequency pair, a blend of the original frequency (kept where it turns often
    over the original context) and the frequency divided by ``factor`` (where it turns rarely)."""
    orig = scaling.original_max_position_embeddings

    def dim_of(rotations: float) -> float:  # the head dimension turning ``rotations`` times
        return head_dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(scaling.beta_fast), dim_of(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: the original frequency, 0: divided by factor
    base = theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    return (1.0 / (scaling.factor * base)) * (1 - keep) + (1.0 / base) * keep


def rotary_permutation(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """The order of a head's dims (``new[j] = old[perm[j]]``, int64 ``[head_dim]``) that lets a
    rotary embedding over the first ``rotary_dim`` dims (pairs ``(i, i + rotary_dim / 2)``, the
    rest passing through) run as one over the whole head (pairs ``(j, j + head_dim / 2)``).

    Pair ``i < rotary_dim / 2`` lands on ``(i, i + head_dim / 2)``; the pass-through dims fill
    the slots ``rotary_dim / 2 .. head_dim / 2`` of each half, where ``RotaryEmbedding``'s
    tables hold cos 1 and sin 0 (an exact identity). Applied to the rows of each q and k head
    alike it leaves every q.k, so attention, unchanged; v and the output projection are not
    touched. ``rotary_dim == head_dim`` gives the identity."""
    if not 0 < rotary_dim <= head_dim or rotary_dim % 2 or head_dim % 2:
        raise ValueError(
            f"rotary_dim must be even and in (0, head_dim], head_dim even; got rotary_dim "
            f"{rotary_dim} of head_dim {head_dim}"
        )
    half, rot_half = head_dim // 2, rotary_dim // 2
    rotated = torch.arange(rotary_dim)
    passed = torch.arange(rotary_dim, head_dim)
    pad = half - rot_half  # pass-through dims in each half
    return torch.cat([rotated[:rot_half], passed[:pad], rotated[rot_half:], passed[pad:]])


def permute_rotary_rows_(w: torch.Tensor, heads: int, perm: torch.Tensor) -> None:
    """Reorder in place the rows of ``w`` (``[heads * head_dim, ...]``: a q or k projection's
    weight or bias) within each head by ``rotary_permutation``'s ``perm``."""
    head_dim = perm.numel()
    if w.shape[0] != heads * head_dim:
        raise ValueError(
            f"{w.shape[0]} rows are not {heads} heads of {head_dim} dims to permute"
        )
    view = w.view(heads, head_dim, -1)
    view.copy_(view.index_select(1, perm.to(w.device)))


class RotaryEmbedding(nn.Module):
    """Rotary position embedding tables (the "rotate half" layout).

    ``cos``/``sin`` ``[max_positions, head_dim // 2]`` are computed once in fp32 (times YaRN's or
    LongRoPE's ``attention_factor``) and follow the module's dtype; a position past the tables
    is an indexing error. Every path (torch, the native CPU ``rope_store``, the fused Triton
    kernel) reads these tables, so the factor reaches all of them.

    ``rotary_dim`` < ``head_dim`` (partial rotary): the first ``rotary_dim // 2`` columns hold the
    frequencies of the rotated dims; the others cos 1 and sin 0, unscaled by the attention
    factor, so that the dims ``rotary_permutation`` puts there pass through exactly. LongRoPE
    picks its short or long factors by ``max_positions`` (``LongRopeScaling.factors``).
    """

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: RopeScaling | YarnScaling | LongRopeScaling | LinearScaling | None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        rotary_dim: int | None = None,
    ) -> None:
        super().__init__()
        rot = head_dim if rotary_dim is None else rotary_dim
        inv_freq = rope_inv_freq(rot, theta, scaling, max_positions)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        cos, sin = freqs.cos(), freqs.sin()
        if isinstance(scaling, (YarnScaling, LongRopeScaling)):
            cos, sin = cos * scaling.attention_factor, sin * scaling.attention_factor
        if rot < head_dim:  # the pass-through columns: an exact identity
            pad = (max_positions, (head_dim - rot) // 2)
            cos = torch.cat([cos, torch.ones(pad)], dim=1)
            sin = torch.cat([sin, torch.zeros(pad)], dim=1)
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", cos.to(device=device, dtype=dtype), persistent=False)
        self.register_buffer("sin", sin.to(device=device, dtype=dtype), persistent=False)

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
    if deterministic:
        cpu_native.require_fused(gate_up, "SiLU")
    if gate_up.dim() == 2 and cpu_native.fused_ok(gate_up):
        return cpu_ops.silu_and_mul(gate_up)
    inter = gate_up.shape[-1] // 2
    return F.silu(gate_up[..., :inter]).mul_(gate_up[..., inter:])


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
