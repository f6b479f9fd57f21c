"""Native kernel or library GEMM per linear layer shape: timed once on a CPU, kept beside the build.

Which is faster, the native kernel or the library's GEMM (``F.linear``: MKL, or whatever BLAS
torch was built with), depends on the CPU and the row count: measured on SmolLM2-135M shapes,
the native kernel is faster up to 256 rows on an AVX-512 Xeon and within 3% of it at 512;
limited to AVX2, the library is 4-9% faster from 256 rows; on an AMD EPYC (AVX2) the native
kernel measured about 2x at 1-32 rows; and the portable loops of a CPU without AVX2 are far
slower than any BLAS. So the default mode decides per layer shape, at pack time, by timing
both on this CPU (``library_rows``); the deterministic mode never asks (native kernel only).
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from tierserve.kernels import cpu_build, cpu_native, cpu_ops

log = logging.getLogger(__name__)

ENV_LIBRARY_ROWS = "TIERSERVE_LINEAR_LIBRARY_ROWS"
# Row counts timed; the library takes over from one of them, for it and every larger count.
# Not fewer rows: timed on one weight, which sits in the cache, a product of a few rows measures
# the call's overhead, while in a real step the weights stream from memory and both ways wait
# on it (measured on SmolLM2-135M shapes, cached: the library up to 1.7x faster at 1 row on
# 256-wide layers; streaming: the native kernel 1.0-1.7x faster at 1-16 rows).
CALIBRATION_ROWS = (16, 64, 256)
# How much faster the library must be: below this, keeping the [out, in] weight beside the
# panels (memory) and giving up batch invariance is not worth it, and timing noise on a shared
# machine would flip the choice from one start to the next.
CLEAR_WIN = 1.15
_CALIBRATION_MACS = 1 << 23  # multiply-adds per timed sample (repeats small products) ...
_CALIBRATION_REPEATS = 32  # ... at most this many times (a tiny layer is all call overhead)
# (out, in, has a bias, threads, quantized bits or None)
_ShapeKey = tuple[int, int, bool, int, int | None]
_library_rows: dict[_ShapeKey, int | None] = {}


def library_rows(
    weight: torch.Tensor,
    packed: torch.Tensor,
    bias: torch.Tensor | None = None,
    bits: int | None = None,
) -> int | None:
    """From how many rows the library GEMM (``F.linear`` on ``weight`` ``[out, in]``) is clearly
    faster than the native kernel (on ``packed``, from ``cpu_packing.pack_linear(weight)``, or
    from ``cpu_packing.pack_linear_quantized`` with ``bits``) for this shape on this CPU, or None
    if never. Timed once per shape, bias and thread count on a machine (a few seconds for
    SmolLM2-135M's five shapes, most of it its output head), then kept beside the built library
    (``_calibration_file``); ``TIERSERVE_LINEAR_LIBRARY_ROWS`` overrides it: ``never``, a row
    count, or ``auto`` (the default)."""
    setting = os.environ.get(ENV_LIBRARY_ROWS, "auto").strip().lower()
    if setting == "never":
        return None
    if setting not in ("", "auto"):
        try:
            rows = int(setting)
        except ValueError:
            rows = 0
        if rows < 1:
            raise ValueError(
                f"{ENV_LIBRARY_ROWS} must be auto, never or a row count >= 1, got {setting!r}"
            )
        return rows
    n, k = weight.shape
    key = (n, k, bias is not None, torch.get_num_threads(), bits)
    if key not in _library_rows:
        found, threshold = _stored_threshold(key)
        if not found:
            threshold = _calibrate(weight, packed, bias, bits)
            _store_threshold(key, threshold)
        _library_rows[key] = threshold
    return _library_rows[key]


# The thresholds are kept beside the built library (whose name already says which source, flags
# and CPU features built it), keyed by shape, threads, torch version and CPU model: a later start
# on this machine skips the timing (seconds for a model's shapes on a small CPU). Delete the file
# to time again.


def _calibration_file() -> Path | None:
    built = cpu_native.library_path()
    if built is None:
        return None
    return built.with_name(built.stem + ".calibration.json")


def _calibration_key(key: _ShapeKey) -> str:
    n, k, bias, threads, bits = key
    return (f"{n}x{k}{'+bias' if bias else ''}{'' if bits is None else f'|q{bits}'}"
            f"|threads={threads}|torch={torch.__version__}|cpu={cpu_build.cpuinfo('model name')}")


def _stored_threshold(key: _ShapeKey) -> tuple[bool, int | None]:
    """``(True, rows)`` when the calibration file holds a valid threshold for ``key``."""
    file = _calibration_file()
    if file is None:
        return False, None
    try:
        data = json.loads(file.read_text())
        value = data[_calibration_key(key)]
    except (OSError, ValueError, KeyError, TypeError):
        return False, None
    if value is None or (isinstance(value, int) and value in CALIBRATION_ROWS):
        return True, value
    return False, None


def _store_threshold(key: _ShapeKey, rows: int | None) -> None:
    file = _calibration_file()
    if file is None:
        return
    try:
        try:
            data = json.loads(file.read_text())
            if not isinstance(data, dict):
                data = {}
        except (OSError, ValueError):
            data = {}
        data[_calibration_key(key)] = rows
        fd, tmp = tempfile.mkstemp(prefix=file.name, suffix=".tmp", dir=file.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, file)  # a concurrent writer may win: its entries, then ours next time
    except OSError as e:
        log.debug("calibration not kept in %s (%s)", file, e)


def threshold_from(ratios: Sequence[float]) -> int | None:
    """The smallest of ``CALIBRATION_ROWS`` from which the library clearly wins (native time /
    library time at least ``CLEAR_WIN``) at it and every larger count, or None."""
    threshold = None
    for rows, ratio in reversed(list(zip(CALIBRATION_ROWS, ratios, strict=True))):
        if ratio < CLEAR_WIN:
            break
        threshold = rows
    return threshold


def _calibrate(
    weight: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, bits: int | None
) -> int | None:
    n, k = weight.shape
    gen = torch.Generator().manual_seed(0)
    ratios = []
    for rows in CALIBRATION_ROWS:
        x = torch.randn(rows, k, generator=gen)
        reps = max(1, min(_CALIBRATION_REPEATS, _CALIBRATION_MACS // (rows * n * k)))

        def native(x: torch.Tensor = x) -> object:
            if bits is not None:
                return cpu_ops.linear_quantized(x, packed, bits, n, bias)
            return cpu_ops.linear(x, packed, n, bias)

        def library(x: torch.Tensor = x) -> object:
            return F.linear(x, weight, bias)

        times: dict[Callable[[], object], list[float]] = {native: [], library: []}
        for r in range(5):  # alternating, the first round a warm-up
            for fn in (native, library) if r % 2 else (library, native):
                t = time.perf_counter()
                for _ in range(reps):
                    fn()
                if r:
                    times[fn].append(time.perf_counter() - t)
        ratios.append(statistics.median(times[native]) / statistics.median(times[library]))
    threshold = threshold_from(ratios)
    log.info(
        "linear %dx%d: native time / library time %s at %s rows: %s",
        n,
        k,
        " ".join(f"{r:.2f}" for r in ratios),
        ",".join(map(str, CALIBRATION_ROWS)),
        "native kernel throughout" if threshold is None else f"library from {threshold} rows",
    )
    return threshold
