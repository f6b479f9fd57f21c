"""Native CPU paged attention: a small C++ kernel built at first use and called through ``ctypes``.

``kernels/csrc/cpu_attention.cpp`` attends every query row of a flat batch over its sequence's
paged K/V *in place* (no gather into a padded copy, no mask tensor), with an online softmax, in
parallel over (sequence, KV head, row tile) under OpenMP. It is the CPU fast path of the
``torch`` attention backend for fp32 caches; everything else falls back to plain torch.

Build: the first call compiles the source with the system C++ compiler (``$CXX``, else ``g++``
or ``c++``; ``-O3 -march=native -fopenmp``, about a second) into a cache directory
(``$TIERSERVE_CACHE_DIR``, else ``~/.cache/tierserve``, else a temporary directory), under a name
that hashes the source, the compiler command and this CPU's feature flags, so machines of a Ray
cluster that share a home directory never load each other's builds. Concurrent builders write
to temporary files and rename atomically. No compiler, a failed build, or
``TIERSERVE_NATIVE_ATTENTION=0`` in the environment: ``available()`` is False (the reason is in
``unavailable_reason()`` and logged once) and the torch path runs instead.

Threads: the library links ``libgomp.so.1``; loaded after torch, the dynamic loader reuses
torch's copy (same soname), so the kernel's parallel regions run on torch's OpenMP thread pool.
The kernel runs with ``torch.get_num_threads()`` threads and without the GIL (``ctypes``).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from kernels.metadata import AttentionMetadata

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "cpu_attention.cpp"
ENV_SWITCH = "TIERSERVE_NATIVE_ATTENTION"
ENV_CACHE = "TIERSERVE_CACHE_DIR"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c++17")
# Query rows per work item, at most: a prefill chunk's rows share each key run of the item.
MAX_ROW_TILE = 8

# Switch for tests and benchmarks (the torch path runs when False).
enabled = True

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_reason: str | None = None  # why the library is unavailable; None until the first try
_tried = False


_ERRORS = {
    -1: "head counts or head_dim outside the kernel's limits",
    -2: "row tile too large for the query heads per KV head",
    -3: "a sequence's query length is not within 1 .. its context length",
    -4: "a sequence's context is longer than its block table",
    -5: "a block table names a block outside the cache",
}


class NativeKernelError(RuntimeError):
    """The native kernel refused its arguments (a bug in the caller: they are checked first)."""


def _compiler() -> str | None:
    for cand in (os.environ.get("CXX"), "g++", "c++"):
        if cand and shutil.which(cand):
            return cand
    return None


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cache_dirs() -> list[Path]:
    dirs = []
    if os.environ.get(ENV_CACHE):
        dirs.append(Path(os.environ[ENV_CACHE]))
    dirs.append(Path.home() / ".cache" / "tierserve")
    dirs.append(Path(tempfile.gettempdir()) / f"tierserve-{os.getuid()}")
    return dirs


def _build(cxx: str) -> Path:
    source = SOURCE.read_bytes()
    key = hashlib.sha256()
    for part in (source, cxx.encode(), " ".join(FLAGS).encode(), _cpu_flags().encode()):
        key.update(part)
        key.update(b"\0")
    name = f"cpu_attention-{key.hexdigest()[:16]}.so"
    errors = []
    for d in _cache_dirs():
        target = d / name
        if target.exists():
            return target
        try:
            d.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=name, suffix=".tmp", dir=d)
            os.close(fd)
        except OSError as exc:
            errors.append(f"{d}: {exc}")
            continue
        try:
            proc = subprocess.run(
                [cxx, *FLAGS, str(SOURCE), "-o", tmp],
                capture_output=True,
                text=True,
                timeout=300,
                check=False,
            )
            if proc.returncode != 0:
                raise RuntimeError(
                    f"{cxx} failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}"
                )
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return target
    raise RuntimeError("no writable cache directory: " + "; ".join(errors))


def _load() -> ctypes.CDLL | None:
    global _lib, _reason, _tried
    with _lock:
        if _tried:
            return _lib
        _tried = True
        if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "no", "off"):
            _reason = f"disabled by {ENV_SWITCH}"
            return None
        cxx = _compiler()
        if cxx is None:
            _reason = "no C++ compiler found ($CXX, g++ or c++)"
        else:
            try:
                lib = ctypes.CDLL(str(_build(cxx)))
                _declare(lib)
                _lib = lib
            except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                _reason = f"building {SOURCE.name} failed: {exc}"
        if _lib is None:
            log.warning("native CPU attention unavailable (%s); using plain torch", _reason)
        return _lib


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    fn = lib.ts_paged_attention_f32
    fn.restype = i32
    fn.argtypes = [p, i64, p, p, p, i64, p, p, p, i64, i32, i32, i32, i32, i32, i32, f32, i32, i32]
    lib.ts_max_vecs.restype = i32
    lib.ts_max_head_dim.restype = i32


def available() -> bool:
    """Whether the native kernel is built and loaded (builds it on the first call)."""
    return _load() is not None


def unavailable_reason() -> str | None:
    """Why ``available()`` is False (None when it is True or has not been asked yet)."""
    return _reason


def row_tile(q: torch.Tensor, k_cache: torch.Tensor) -> int:
    """Query rows per work item if the kernel takes these inputs (CPU, fp32 queries and caches,
    head counts and size within its limits), else 0: then use the torch path."""
    if (
        not enabled
        or q.device.type != "cpu"
        or q.dtype != torch.float32
        or k_cache.dtype != torch.float32
    ):
        return 0
    lib = _load()
    if lib is None:
        return 0
    hq, d = q.shape[1], q.shape[2]
    hkv = k_cache.shape[2]
    if hq % hkv or d > lib.ts_max_head_dim():
        return 0
    return min(MAX_ROW_TILE, lib.ts_max_vecs() // (hq // hkv))


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor,
    num_seqs: int,
    row_tile: int,
) -> None:
    """Attend the query rows of the first ``num_seqs`` sequences of ``meta`` into ``out``.

    ``q`` ``[T, hq, D]`` (rows may be strided, heads contiguous), ``out`` likewise; caches
    contiguous ``[num_blocks, block_size, hkv, D]``. ``row_tile`` from ``row_tile()``.
    """
    lib = _load()
    if lib is None:
        raise NativeKernelError(f"native CPU attention unavailable: {_reason}")
    hq, d = q.shape[1], q.shape[2]
    _, bs, hkv, _ = k_cache.shape
    if out.shape != q.shape or q.shape[0] != meta.num_tokens or not 0 < num_seqs <= meta.num_seqs:
        raise NativeKernelError(
            f"q {tuple(q.shape)} and out {tuple(out.shape)} must match the metadata's "
            f"{meta.num_tokens} tokens, and num_seqs ({num_seqs}) its {meta.num_seqs} sequences"
        )
    if q.dtype != torch.float32 or out.dtype != torch.float32 or k_cache.dtype != torch.float32:
        raise NativeKernelError("the native kernel takes fp32 q, out and caches")
    for name, t in (("q", q), ("out", out)):
        if t.stride(2) != 1 or t.stride(1) != d:
            raise NativeKernelError(f"{name} must have contiguous heads, got strides {t.stride()}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise NativeKernelError("the KV caches must be contiguous")
    tables = meta.block_tables
    seq_lens = meta.seq_lens
    cu = meta.cu_q_lens
    if tables.dtype != torch.int32 or seq_lens.dtype != torch.int32 or cu.dtype != torch.int32:
        raise NativeKernelError("block_tables, seq_lens and cu_q_lens must be int32")
    if not tables.is_contiguous():
        tables = tables.contiguous()
    rc = lib.ts_paged_attention_f32(
        q.data_ptr(),
        q.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        tables.data_ptr(),
        tables.stride(0),
        seq_lens.data_ptr(),
        cu.data_ptr(),
        out.data_ptr(),
        out.stride(0),
        num_seqs,
        hq,
        hkv,
        d,
        bs,
        k_cache.shape[0],
        float(scale),
        row_tile,
        torch.get_num_threads(),
    )
    if rc != 0:
        raise NativeKernelError(f"native attention refused its arguments: {_ERRORS.get(rc, rc)}")
