"""Linear weights in the layouts the native CPU kernel reads, and the packing a layer asks for.

- ``pack_linear``: an fp32 ``[out, in]`` weight as panels of 16 output features, the layout
  ``cpu_ops.linear`` reads (``unpack_linear`` gives it back);
- ``pack_linear_quantized``: a weight that is exactly a Q4_1/Q8_0 or Q4_K/Q5_K/Q6_K
  dequantization as quantized panels, read by ``cpu_ops.linear_quantized`` (see below);
- ``pack_weight``: what ``tierserve.replica.models.layers.Linear.pack_for_cpu`` asks for: a
  layer's weight in whichever of the two forms fits it, and in the default mode from which row
  count the library GEMM takes over (``cpu_calibration.library_rows``), or None where it stays
  as it is;
- ``pack_model``: what the runner asks for at start-up: a model's layers packed where it runs on
  CPU and the kernels are built.

The shapes of both layouts are ``cpu_abi``'s (``packed_shape``, ``quantized_shape``), agreed
with the C++.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tierserve.arith import ceil_div
from tierserve.kernels import cpu_calibration, cpu_native
from tierserve.kernels.cpu_abi import (
    PANEL,
    QUANT_BLOCK,
    QUANT_K4,
    QUANT_K5,
    QUANT_K6,
    NativeKernelError,
    check_quantized,
    packed_shape,
    quantized_shape,
)


def pack_linear(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[out, in]`` (fp32, CPU) in the layout ``cpu_ops.linear`` reads: panels of 16
    output features, ``packed[p, k, j] = weight[16 p + j, k]``, zeros past the last row (a new
    tensor)."""
    lib = cpu_native.lib_or_raise()
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
        raise NativeKernelError(
            f"pack_linear takes an fp32 CPU [out, in] weight, got {weight.dtype} "
            f"{tuple(weight.shape)} on {weight.device}"
        )
    n, k = weight.shape
    if n == 0 or k == 0:
        raise NativeKernelError(f"pack_linear got an empty weight {tuple(weight.shape)}")
    w = weight.contiguous()
    packed = torch.empty(packed_shape(n, k), dtype=torch.float32)
    rc = lib.ts_pack_linear_f32(w, n, k, packed, torch.get_num_threads())
    if rc != 0:
        raise NativeKernelError(f"pack_linear refused its arguments (code {rc})")
    return packed


def unpack_linear(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """The ``[out_features, in]`` weight back from ``pack_linear``'s layout (a new tensor)."""
    panels, k, width = packed.shape
    if width != PANEL or panels != ceil_div(out_features, PANEL):
        raise NativeKernelError(
            f"{tuple(packed.shape)} is not a packed weight of {out_features} outputs"
        )
    return packed.permute(0, 2, 1).reshape(panels * PANEL, k)[:out_features].contiguous()


# ----------------------------------------------------------------------------- quantized weights
#
# A decode step's few rows meet every weight once: its time is the time to stream the weights
# from memory. Most small models ship quantized (a GGUF's Q4_1, Q8_0, ...), and their loader
# dequantizes them to fp32, 3.8-6.4x the bytes. A layer whose fp32 weight is exactly such a
# dequantization (every block of 32 inputs of an output ``fma(d, q, m)``, d and m fp16, q 4-bit;
# or ``d * q``, q 8-bit) keeps it in that form, and the kernel dequantizes as it goes. ``d * q`` is
# exact in fp32, so the weight the kernel uses is the fp32 weight, bit for bit, and each output is
# the same FMA chain over k as on the fp32 panels: the same bits as ``cpu_ops.linear`` (the
# deterministic mode and batch invariance hold). ``pack_linear_quantized`` finds d, m and q and
# checks every weight; a layer with any block that is not such a dequantization stays fp32.
#
# GGUF's K-quants have their own forms (codes ``QUANT_K4``, ``QUANT_K5``, ``QUANT_K6`` where Q4/Q8
# pass 4 or 8): per sub-block an fp32 scale S (and offset O), w = fma(S, q, O) for Q4_K and Q5_K
# (the loader's S * q - M: S * q is exact, so one rounding either way) and w = S * q for Q6_K
# (exact), the same fp32 weights again. The packer finds S and O from the fp32 weight alone (the
# prepared cache keeps no GGUF types) and checks every weight, as for Q4/Q8.

# The forms ``pack_weight`` tries, fewest bytes first (320, 384, 544, 640, 640 per 16 x 32
# block, against 2,048 in fp32). Each is faster than fp32 panels at decode row counts here
# (docs/models.md has the figures); where the library GEMM is faster at more rows,
# ``cpu_calibration.library_rows`` hands those over as for fp32 panels.
QUANT_FORMS = (4, QUANT_K4, 8, QUANT_K5, QUANT_K6)

ENV_QUANTIZED = "TIERSERVE_QUANTIZED_WEIGHTS"


def quantized_enabled() -> bool:
    """Whether ``pack_weight`` may keep weights quantized: ``TIERSERVE_QUANTIZED_WEIGHTS`` is
    ``auto`` (the default) or ``off`` (always fp32 panels, e.g. to compare the two)."""
    setting = os.environ.get(ENV_QUANTIZED, "auto").strip().lower()
    if setting in ("", "auto", "on", "1"):
        return True
    if setting in ("off", "0", "never"):
        return False
    raise ValueError(f"{ENV_QUANTIZED} must be auto or off, got {setting!r}")


def pack_linear_quantized(
    weight: torch.Tensor, bits_tried: Sequence[int] = QUANT_FORMS
) -> tuple[torch.Tensor, int] | None:
    """``weight`` ``[out, in]`` (fp32, CPU) as quantized panels (``(packed, bits)``, the first of
    ``bits_tried`` that gives back every weight exactly: 4, 8 or a K-quant form's code), or None
    when it is no such dequantization (or ``in`` is not a multiple of 32)."""
    lib = cpu_native.lib_or_raise()
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
        raise NativeKernelError(
            f"pack_linear_quantized takes an fp32 CPU [out, in] weight, got {weight.dtype} "
            f"{tuple(weight.shape)} on {weight.device}"
        )
    n, k = weight.shape
    if n == 0 or k == 0 or k % QUANT_BLOCK:
        return None
    w = weight.contiguous()
    for bits in bits_tried:
        quantized_shape(n, k, bits)  # an unknown form: refused before anything is packed
    for bits in bits_tried:
        packed = torch.empty(quantized_shape(n, k, bits), dtype=torch.uint8)
        rc = lib.ts_pack_linear_q(w, n, k, bits, packed, torch.get_num_threads())
        if rc == 0:
            return packed, bits
        if rc != 1:
            raise NativeKernelError(f"pack_linear_quantized refused its arguments (code {rc})")
    return None


def unpack_linear_quantized(packed: torch.Tensor, bits: int, out_features: int,
                            in_features: int) -> torch.Tensor:
    """The ``[out_features, in_features]`` fp32 weight back from ``pack_linear_quantized``."""
    lib = cpu_native.lib_or_raise()
    check_quantized(packed, bits, out_features, in_features)
    panels = torch.empty(packed_shape(out_features, in_features), dtype=torch.float32)
    rc = lib.ts_unpack_linear_q(
        packed, out_features, in_features, bits, panels, torch.get_num_threads()
    )
    if rc != 0:
        raise NativeKernelError(f"unpack_linear_quantized refused its arguments (code {rc})")
    return unpack_linear(panels, out_features)


def unpack_weight(
    weight: torch.Tensor, bits: int | None, out_features: int, in_features: int
) -> torch.Tensor:
    """The ``[out_features, in_features]`` fp32 weight back from ``PackedLinear.weight``: the
    quantized panels at ``bits``, or the fp32 panels where ``bits`` is None (a new tensor)."""
    if bits is not None:
        return unpack_linear_quantized(weight, bits, out_features, in_features)
    return unpack_linear(weight, out_features)


# ----------------------------------------------------------------------------- what layers ask for


@dataclass(frozen=True, slots=True)
class PackedLinear:
    """A linear layer's weight as the native kernel reads it: ``weight`` the fp32 panels of
    ``pack_linear`` (``bits`` None) or the quantized panels of ``pack_linear_quantized``
    (``bits`` 4, 8 or a K-quant form's code, ``cpu_abi.QUANT_K4`` ...); ``library``
    ``(rows, [out, in] weight)`` where the library GEMM takes over from ``rows`` rows on (the
    default mode, where it is clearly faster here), else None."""

    weight: torch.Tensor
    bits: int | None
    library: tuple[int, torch.Tensor] | None


def pack_weight(
    weight: torch.Tensor, bias: torch.Tensor | None = None, deterministic: bool = False
) -> PackedLinear | None:
    """``weight`` ``[out, in]`` (with ``bias``) packed for the native linear where the kernel
    takes it (fp32 on CPU, kernels built and enabled): as quantized panels where it is an exact
    dequantization and ``TIERSERVE_QUANTIZED_WEIGHTS`` allows, else as fp32 panels. None where
    the layer stays as it is: the kernel does not take it, or (default mode) the library GEMM is
    clearly faster at every row count (``cpu_calibration.library_rows``). ``deterministic``: the
    native kernel at every row count, never the library; raises ``DeterministicModeUnavailable``
    where it cannot run."""
    if deterministic:
        cpu_native.require_fused(weight, "Linear")
    elif not cpu_native.fused_ok(weight):  # fp32 on CPU, kernels built and enabled
        return None
    quantized = pack_linear_quantized(weight) if quantized_enabled() else None
    packed, bits = quantized if quantized is not None else (pack_linear(weight), None)
    library = None
    if not deterministic:
        rows = cpu_calibration.library_rows(weight, packed, bias, bits)
        if rows is not None and rows <= 1:  # the library at every row count: stay as is
            return None
        if rows is not None:
            library = (rows, weight)
    return PackedLinear(packed, bits, library)


def pack_model(model: object, device: torch.device) -> None:
    """Have ``model`` move its linear layers to their packed weights (its ``pack_for_cpu``) when
    it runs on CPU and the native kernels are available; the kernels are built (or loaded) now,
    not inside the first request's step. A model without ``pack_for_cpu`` stays as it is. Call
    once its weights are loaded."""
    if device.type == "cpu" and cpu_native.available():
        pack = getattr(model, "pack_for_cpu", None)
        if pack is not None:
            pack()
