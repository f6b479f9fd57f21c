"""Native CPU kernels: a small C++ library built at first use and called through ``ctypes``;
this module loads it, once per process, and says whether it runs here.

``kernels/csrc/cpu_kernels.cpp`` holds the CPU fast path for fp32 (anything else falls back to
plain torch): paged attention, the linear layers (on fp32 or quantized panels), RMSNorm, SiLU
and rotary embeddings with the KV store. The parts, lowest first:

- ``tierserve.kernels.cpu_build``: compiling the source into a cache (file lock, one build per
  source, compiler and CPU);
- ``tierserve.kernels.cpu_abi``: the boundary (the prototypes checked against the library's
  own table at load, checked calls, the weights' layouts);
- this module: the one loaded library and the switches (``enabled``,
  ``TIERSERVE_NATIVE_KERNELS``), ``available``, and whether the fused ops and the deterministic
  mode can run;
- ``tierserve.kernels.cpu_ops``: the kernels as torch functions (``paged_attention``,
  ``linear``, ``rms_norm``, ...);
- ``tierserve.kernels.cpu_calibration``: per layer shape, whether the library GEMM is clearly
  faster than the native linear from some row count (timed once, kept beside the build);
- ``tierserve.kernels.cpu_packing``: linear weights in the kernel's layouts, and the packing a
  layer or a runner asks for.

Every kernel computes each value of a row from that row alone, in an order fixed by the row's
own sizes (see the source's header): the deterministic mode (docs/determinism.md) runs on these
kernels only, and ``deterministic_unsupported`` says when it cannot.

Loading: the first ``load`` builds (or finds) the library, checks its exports against
``cpu_abi.PROTOTYPES`` and keeps it. No compiler, a failed build, or
``TIERSERVE_NATIVE_KERNELS=0`` in the environment: ``available()`` is False (the reason is in
``unavailable_reason()`` and logged once) and the torch path runs instead. A library that does
not match the prototypes is refused loudly: ``NativeSignatureMismatch``, raised by every later
use too.

Threads: the library links ``libgomp.so.1``; loaded after torch, the dynamic loader reuses
torch's copy (same soname), so the kernel's parallel regions run on torch's OpenMP thread pool.
The kernel runs with ``torch.get_num_threads()`` threads and without the GIL (``ctypes``).
"""

from __future__ import annotations

import ctypes
import logging
import os
import subprocess
import threading
from collections.abc import Sequence
from pathlib import Path

import torch

from tierserve.kernels import cpu_abi, cpu_build
from tierserve.kernels.cpu_abi import NativeKernelError, NativeLib, NativeSignatureMismatch

log = logging.getLogger(__name__)

ENV_SWITCH = "TIERSERVE_NATIVE_KERNELS"

# Switch for tests and benchmarks (the torch path runs when False).
enabled = True

_lock = threading.Lock()
_lib: NativeLib | None = None
_lib_path: Path | None = None  # the built library loaded into _lib
_reason: str | None = None  # why the library is unavailable; None until the first try
# Set when the library and the prototypes disagree: raised by every later use too.
_mismatch: NativeSignatureMismatch | None = None
_tried = False
_MAX_VECS = 0  # query vectors per work item, from the library once loaded
_MAX_HEAD_DIM = 0


class DeterministicModeUnavailable(ValueError):
    """The deterministic mode cannot be honoured here (the message says why)."""


def load() -> NativeLib | None:
    """The loaded library (built, loaded and checked on the first call), None where it is
    unavailable; raises ``NativeSignatureMismatch`` where it was refused."""
    global _tried
    if _tried:  # the step loop's path: no lock once the library is loaded (or refused)
        if _mismatch is not None:
            raise _mismatch
        return _lib
    with _lock:
        if not _tried:
            try:
                _try_load()
            finally:
                _tried = True  # last: the lock-free check above must not see a half-done load
        if _mismatch is not None:
            raise _mismatch
        return _lib


def _try_load() -> None:
    global _lib, _lib_path, _reason, _mismatch, _MAX_VECS, _MAX_HEAD_DIM
    if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "no", "off"):
        _reason = f"disabled by {ENV_SWITCH}"
        return
    cxx = cpu_build.compiler()
    if cxx is None:
        _reason = "no C++ compiler found ($CXX, g++ or c++)"
    else:
        try:
            path = cpu_build.build(cxx)
            lib = cpu_abi.declare(ctypes.CDLL(str(path)))
            _lib_path = path
            # The kernel's limits, read once (attention_plan runs per layer per step).
            _MAX_VECS, _MAX_HEAD_DIM = lib.ts_max_vecs(), lib.ts_max_head_dim()
            _lib = lib
        except NativeSignatureMismatch as exc:
            # Not a machine without a compiler: the repository contradicts itself. Falling back
            # to torch would hide it, so every use of the kernels raises this from now on.
            _reason = str(exc)
            _mismatch = exc
            log.error("native CPU kernels refused: %s", exc)
            return
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            _reason = f"building {cpu_build.SOURCE.name} failed: {exc}"
    if _lib is None:
        log.warning("native CPU kernels unavailable (%s); using plain torch", _reason)


def lib_or_raise() -> NativeLib:
    """The loaded library; raises ``NativeKernelError`` where it is unavailable."""
    lib = load()
    if lib is None:
        raise NativeKernelError(f"native CPU kernels unavailable: {_reason}")
    return lib


def library_path() -> Path | None:
    """The file of the loaded library (None until one is loaded)."""
    return _lib_path


def attention_limits() -> tuple[int, int]:
    """The native attention's limits, ``(query vectors per work item, head_dim)``, as the loaded
    library reports them (0, 0 until one is loaded)."""
    return _MAX_VECS, _MAX_HEAD_DIM


def load_variant(
    directory: Path, add: Sequence[str] = (), drop: Sequence[str] = ()
) -> NativeLib:
    """The source built with ``cpu_build.FLAGS`` less ``drop`` plus ``add`` (e.g.
    ``-march=x86-64`` for the portable loops, ``-mno-avx512f`` for the AVX2 path of an AVX-512
    CPU) into ``directory``, loaded and checked like the process's own build; for tests and
    benchmarks of the paths other CPUs take. Raises ``RuntimeError`` when there is no compiler or
    the build fails."""
    return cpu_abi.declare(ctypes.CDLL(str(cpu_build.build_variant(directory, add, drop))))


def available() -> bool:
    """Whether the native kernel is built and loaded (builds it on the first call)."""
    return load() is not None


def unavailable_reason() -> str | None:
    """Why ``available()`` is False (None when it is True or has not been asked yet)."""
    return _reason


def fused_ok(x: torch.Tensor) -> bool:
    """Whether the fused row-wise ops take ``x``: fp32 on CPU, kernels built and enabled."""
    return enabled and x.is_cpu and x.dtype is torch.float32 and available()


def why_not_fused(x: torch.Tensor) -> str | None:
    """Why the native row-wise ops do not take ``x`` (None when ``fused_ok(x)``)."""
    if x.device.type != "cpu" or x.dtype != torch.float32:
        return f"they take float32 on CPU, got {x.dtype} on {x.device}"
    if not enabled:
        return "the native CPU kernels are switched off (tierserve.kernels.cpu_native.enabled)"
    if not available():
        return f"the native CPU kernels are unavailable: {_reason}"
    return None


def require_fused(x: torch.Tensor, what: str) -> None:
    """Raise ``DeterministicModeUnavailable`` unless the native ops take ``x`` (for ``what``)."""
    reason = why_not_fused(x)
    if reason is not None:
        raise DeterministicModeUnavailable(f"deterministic {what} needs the native kernels: {reason}")


def deterministic_unsupported(
    device: torch.device | str, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int
) -> str | None:
    """Why the deterministic mode cannot run a model of these heads on ``device`` in ``dtype``
    (None when it can). It runs on the native kernels only, whose every output for a row is
    computed in an order fixed by that row alone; there is no fallback to a library path."""
    dev = torch.device(device)
    if dev.type != "cpu":
        return (
            f"it runs on CPU only (got device {dev}): its row-independent kernels are the native "
            "CPU ones; run without deterministic on a GPU"
        )
    if dtype != torch.float32:
        return f"it runs in float32 only (got {dtype}); set dtype to float32"
    if not enabled:
        return "the native CPU kernels are switched off (tierserve.kernels.cpu_native.enabled)"
    if load() is None:
        return f"the native CPU kernels are unavailable: {_reason}"
    if num_kv_heads <= 0 or num_heads % num_kv_heads:
        return f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads"
    if head_dim > _MAX_HEAD_DIM or num_heads // num_kv_heads > _MAX_VECS:
        return (
            f"head_dim {head_dim} or {num_heads // num_kv_heads} query heads per KV head is "
            f"beyond the native attention's limits ({_MAX_HEAD_DIM}, {_MAX_VECS})"
        )
    return None
