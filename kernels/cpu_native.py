"""Native CPU kernels: a small C++ library built at first use and called through ``ctypes``.

``kernels/csrc/cpu_kernels.cpp`` holds the CPU fast path for fp32 (anything else falls back to
plain torch):

- ``paged_attention``: every query row of a flat batch over its sequence's paged K/V *in place*
  (no gather into a padded copy, no mask tensor), with an online softmax, in parallel over
  (sequence, KV head, row tile) under OpenMP; the ``torch`` attention backend's fast path.
- ``linear``: ``x @ W.T (+ b)`` with ``W`` repacked once by ``pack_linear`` into panels of 16
  output features; a register-tiled micro-kernel (12 rows x 32 outputs in AVX-512 registers, 6 x
  16 in AVX2 ones, a portable loop otherwise), threads splitting the panels.
  ``tierserve.replica.models.layers.Linear.pack_for_cpu`` switches a layer to it; in the default mode only
  where it is the faster path on this CPU (``library_rows``: timed per layer shape at pack time).
- ``linear_quantized``: the same, bit for bit, on a weight that ``pack_linear_quantized`` found to
  be an exact Q4_1/Q8_0 dequantization and keeps in that form (1/6.4 or 1/3.8 of the bytes).
- ``rms_norm`` (optionally adding the previous block's output into the residual first),
  ``silu_and_mul`` and ``rope_store`` (rotary embedding of q and k, then k and v into the
  cache): one pass over the rows each, where torch runs several ops with temporaries.

Every kernel computes each value of a row from that row alone, in an order fixed by the row's
own sizes (see the source's header): the deterministic mode (docs/determinism.md) runs on these
kernels only, and ``deterministic_unsupported`` says when it cannot.

Boundary: the library exports a table of its functions' argument kinds generated from their C++
types (``ts_signatures``); loading compares it with ``PROTOTYPES`` and refuses on any difference
(``NativeSignatureMismatch``, raised by every later use), and each call checks its tensors against
their kinds (dtype, CPU, layout) before passing addresses (see "the boundary" below).

Build: the first call compiles the source with the system C++ compiler (``$CXX``, else ``g++``
or ``c++``; ``-O3 -march=native -fopenmp``, two to three seconds) into a cache directory
(``$TIERSERVE_CACHE_DIR``, else ``~/.cache/tierserve``, else a temporary directory), under a name
that hashes the source, the compiler command and this CPU's feature flags, so machines of a Ray
cluster that share a home directory never load each other's builds. Concurrent builders write
to temporary files and rename atomically. No compiler, a failed build, or
``TIERSERVE_NATIVE_KERNELS=0`` in the environment: ``available()`` is False (the reason is in
``unavailable_reason()`` and logged once) and the torch path runs instead.

Threads: the library links ``libgomp.so.1``; loaded after torch, the dynamic loader reuses
torch's copy (same soname), so the kernel's parallel regions run on torch's OpenMP thread pool.
The kernel runs with ``torch.get_num_threads()`` threads and without the GIL (``ctypes``).
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import json
import logging
import os
import platform
import re
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from tierserve.kernels.metadata import AttentionMetadata

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "cpu_kernels.cpp"
ENV_SWITCH = "TIERSERVE_NATIVE_KERNELS"
ENV_CACHE = "TIERSERVE_CACHE_DIR"
FLAGS = (
    "-O3",
    "-march=native",
    "-ffp-contract=off",
    "-fopenmp",
    "-fPIC",
    "-shared",
    "-std=c++17",
)
# Query rows per work item, at most: a prefill chunk's rows (or decode rows sharing a prefix)
# share each key run of the item.
MAX_ROW_TILE = 8

# Switch for tests and benchmarks (the torch path runs when False).
enabled = True

_lock = threading.Lock()
_lib: NativeLib | None = None
_lib_path: Path | None = None  # the built library loaded into _lib
_reason: str | None = None  # why the library is unavailable; None until the first try
# Set when the library and this module's prototypes disagree: raised by every later use too.
_mismatch: NativeSignatureMismatch | None = None
_tried = False
_MAX_VECS = 0  # query vectors per work item, from the library once loaded
_MAX_HEAD_DIM = 0


_ERRORS = {
    -1: "head counts, head_dim or the work split outside the kernel's limits",
    -2: "row tile x query heads per item above the kernel's limit",
    -3: "a sequence's query length is not within 1 .. its context length",
    -4: "a sequence's context is longer than its block table",
    -5: "a block table names a block outside the cache",
}


class NativeKernelError(RuntimeError):
    """The native kernel refused its arguments (a bug in the caller: they are checked first)."""


class DeterministicModeUnavailable(ValueError):
    """The deterministic mode cannot be honoured here (the message says why)."""


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
    if _load() is None:
        return f"the native CPU kernels are unavailable: {_reason}"
    if num_kv_heads <= 0 or num_heads % num_kv_heads:
        return f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads"
    if head_dim > _MAX_HEAD_DIM or num_heads // num_kv_heads > _MAX_VECS:
        return (
            f"head_dim {head_dim} or {num_heads // num_kv_heads} query heads per KV head is "
            f"beyond the native attention's limits ({_MAX_HEAD_DIM}, {_MAX_VECS})"
        )
    return None


def why_not_fused(x: torch.Tensor) -> str | None:
    """Why the native row-wise ops do not take ``x`` (None when ``fused_ok(x)``)."""
    if x.device.type != "cpu" or x.dtype != torch.float32:
        return f"they take float32 on CPU, got {x.dtype} on {x.device}"
    if not enabled:
        return "the native CPU kernels are switched off (tierserve.kernels.cpu_native.enabled)"
    if not available():
        return f"the native CPU kernels are unavailable: {_reason}"
    return None


def why_not_attention(q: torch.Tensor, k_cache: torch.Tensor) -> str:
    """Why ``attention_plan`` refuses these inputs (for error messages)."""
    reason = why_not_fused(q) or why_not_fused(k_cache)
    if reason is not None:
        return reason
    hq, d, hkv = q.shape[1], q.shape[2], k_cache.shape[2]
    return (
        f"{hq} query heads over {hkv} KV heads of head_dim {d}; the kernel takes a multiple of "
        f"the KV heads, at most {_MAX_VECS} per KV head, and head_dim up to {_MAX_HEAD_DIM}"
    )


def require_fused(x: torch.Tensor, what: str) -> None:
    """Raise ``DeterministicModeUnavailable`` unless the native ops take ``x`` (for ``what``)."""
    reason = why_not_fused(x)
    if reason is not None:
        raise DeterministicModeUnavailable(f"deterministic {what} needs the native kernels: {reason}")


def _compiler() -> str | None:
    for cand in (os.environ.get("CXX"), "g++", "c++"):
        if cand and shutil.which(cand):
            return cand
    return None


@functools.cache
def _cpuinfo(*keys: str) -> str:
    """The value of the first ``/proc/cpuinfo`` line starting with one of ``keys``, or what
    ``platform`` says of the CPU where there is none."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(keys):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags() -> str:
    """The CPU's feature flags, space-separated (``/proc/cpuinfo``'s ``flags``, ``Features`` on
    ARM; read once)."""
    return _cpuinfo("flags", "Features")


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
    for part in (source, cxx.encode(), " ".join(FLAGS).encode(), cpu_flags().encode()):
        key.update(part)
        key.update(b"\0")
    name = f"cpu_kernels-{key.hexdigest()[:16]}.so"
    errors = []
    for d in _cache_dirs():
        target = d / name
        if target.exists():
            return target
        try:
            d.mkdir(parents=True, exist_ok=True)
            lock = os.open(d / (name + ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            errors.append(f"{d}: {exc}")
            continue
        try:
            # Of two replicas starting at once on a fresh machine, one compiles and the other
            # waits for it, then loads its build (instead of compiling the same on the same cores).
            fcntl.flock(lock, fcntl.LOCK_EX)
            if target.exists():
                return target
            return _compile(cxx, target, name, d)
        finally:
            os.close(lock)  # releases the lock (the file stays: removing it would race)
    raise RuntimeError("no writable cache directory: " + "; ".join(errors))


def _compile(cxx: str, target: Path, name: str, d: Path) -> Path:
    """Build the library into ``target`` (through a temporary file in ``d``)."""
    fd, tmp = tempfile.mkstemp(prefix=name, suffix=".tmp", dir=d)
    os.close(fd)
    try:
        proc = subprocess.run(
            [cxx, *FLAGS, str(SOURCE), "-o", tmp],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"{cxx} failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _load() -> NativeLib | None:
    global _lib, _reason, _tried
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
    cxx = _compiler()
    if cxx is None:
        _reason = "no C++ compiler found ($CXX, g++ or c++)"
    else:
        try:
            path = _build(cxx)
            lib = _declare(ctypes.CDLL(str(path)))
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
            _reason = f"building {SOURCE.name} failed: {exc}"
    if _lib is None:
        log.warning("native CPU kernels unavailable (%s); using plain torch", _reason)


# ----------------------------------------------------------------------------- the boundary
#
# ctypes calls a C function with whatever it is told the function takes: an argument added,
# dropped or retyped on one side only shifts the arguments after it, and a kernel writes through
# the wrong pointer without a word. So the library exports a table of its functions' argument
# kinds, generated from their C++ types (``ts_signatures``), and the loader compares it with the
# prototypes below, refusing to load on any difference. Each call then goes through a
# checked function (``_checked``), which takes tensors for the pointer arguments and checks each against its
# kind (dtype, CPU, a contiguous last dimension) before passing its address, and the count.

# The library's exports as this module calls them. A pointer kind takes a contiguous CPU tensor
# of its dtype; "strided" before it, rows at any stride whose elements are contiguous (the row
# stride is the next argument); "?" after it, None too (a null pointer). Keep in step with the
# C++ (checked at load: the kinds, not these names or marks, which the C++ types cannot carry).
PROTOTYPES: tuple[str, ...] = (
    "i32 ts_max_vecs()",
    "i32 ts_max_head_dim()",
    "i32 ts_paged_attention_f32(strided const f32* q, i64 q_row_stride, const f32* k_cache, "
    "const f32* v_cache, const i32* tables, i64 table_stride, const i32* seq_lens, "
    "const i32* cu_q_lens, strided f32* out, i64 out_row_stride, i32 num_seqs, i32 hq, i32 hkv, "
    "i32 head_dim, i32 block_size, i32 num_blocks, f32 scale, i32 row_tile, "
    "i32 heads_per_item, i32 num_threads)",
    "i32 ts_rms_norm_f32(strided f32* x, i64 x_stride, strided const f32*? delta, "
    "i64 delta_stride, const f32* weight, strided f32* out, i64 out_stride, i64 rows, "
    "i32 hidden, f32 eps, i32 num_threads)",
    "i32 ts_silu_mul_f32(strided const f32* gate_up, i64 gu_stride, f32* out, i64 rows, "
    "i32 inter, i32 num_threads)",
    "i32 ts_rope_store_f32(strided f32* qkv, i64 qkv_stride, const f32* cos, const f32* sin, "
    "const i64* slots, f32* k_cache, f32* v_cache, i64 num_slots, i64 rows, i32 hq, i32 hkv, "
    "i32 head_dim, i32 num_threads)",
    "i32 ts_pack_linear_f32(const f32* w, i64 n, i64 k, f32* packed, i32 num_threads)",
    "i32 ts_linear_f32(strided const f32* x, i64 x_stride, i64 m, i64 k, const f32* packed, "
    "i64 n, const f32*? bias, strided f32* y, i64 y_stride, i32 num_threads)",
    "i32 ts_pack_linear_q(const f32* w, i64 n, i64 k, i32 bits, u8* packed, i32 num_threads)",
    "i32 ts_unpack_linear_q(const u8* packed, i64 n, i64 k, i32 bits, f32* out, i32 num_threads)",
    "i32 ts_linear_q(strided const f32* x, i64 x_stride, i64 m, i64 k, const u8* packed, "
    "i32 bits, i64 n, const f32*? bias, strided f32* y, i64 y_stride, i32 num_threads)",
)

# kind -> (the ctypes type of the argument, the dtype of the tensor a pointer kind takes)
_KINDS: dict[str, tuple[type, torch.dtype | None]] = {
    "i32": (ctypes.c_int32, None),
    "i64": (ctypes.c_int64, None),
    "f32": (ctypes.c_float, None),
    "f32*": (ctypes.c_void_p, torch.float32),
    "const f32*": (ctypes.c_void_p, torch.float32),
    "const i32*": (ctypes.c_void_p, torch.int32),
    "const i64*": (ctypes.c_void_p, torch.int64),
    "u8*": (ctypes.c_void_p, torch.uint8),
    "const u8*": (ctypes.c_void_p, torch.uint8),
}
_PROTOTYPE = re.compile(r"(?P<ret>\w+) (?P<name>\w+)\((?P<args>[^()]*)\)")


class NativeSignatureMismatch(RuntimeError):
    """The built library's functions do not take what this module declares: a bug in the
    repository (one side changed without the other), never a condition of the machine."""


@dataclass(frozen=True, slots=True)
class Prototype:
    """One declared function: its name, its return kind, and its arguments' kinds and names."""

    name: str
    ret: str
    kinds: tuple[str, ...]
    names: tuple[str, ...]
    nullable: tuple[bool, ...]
    strided: tuple[bool, ...]

    @classmethod
    def parse(cls, text: str) -> Prototype:
        m = _PROTOTYPE.fullmatch(" ".join(text.split()))
        if m is None:
            raise ValueError(f"not a prototype: {text!r}")
        kinds, names, nullable, strided = [], [], [], []
        for arg in filter(None, (a.strip() for a in m["args"].split(","))):
            kind, _, name = arg.rpartition(" ")
            strided.append(kind.startswith("strided "))
            kinds.append(kind.removeprefix("strided ").removesuffix("?"))
            names.append(name)
            nullable.append(kind.endswith("?"))
        for kind in (m["ret"], *kinds):
            if kind not in _KINDS:
                raise ValueError(f"{m['name']}: unknown kind {kind!r} (known: {sorted(_KINDS)})")
        return cls(
            m["name"], m["ret"], tuple(kinds), tuple(names), tuple(nullable), tuple(strided)
        )

    @property
    def signature(self) -> str:
        """The form the library's table uses: ``ret(kind, kind, ...)``."""
        return f"{self.ret}({', '.join(self.kinds)})"


def _refusal(p: Prototype, i: int, t: object) -> str:
    layout = "rows of contiguous elements" if p.strided[i] else "contiguous"
    want = f"a {_KINDS[p.kinds[i]][1]} CPU tensor, {layout}"
    if p.nullable[i]:
        want += ", or None"
    got = (
        f"{t.dtype} on {t.device}, shape {tuple(t.shape)}, strides {t.stride()}"
        if isinstance(t, torch.Tensor)
        else type(t).__name__
    )
    return f"{p.name}: argument {i} ({p.kinds[i]} {p.names[i]}) takes {want}; got {got}"


def _checked(fn: Any, p: Prototype) -> Callable[..., int]:
    """``fn`` (a ctypes function declared by ``p``) taking tensors for its pointer arguments:
    each is checked against its kind before its address is passed, and the count must match
    exactly (ctypes itself passes extra arguments on). A plain closure, not an object with
    ``__call__``: this runs per layer per step, and that indirection alone costs half again."""
    nargs = len(p.kinds)
    # (position, dtype, may be None, rows may be strided) of each pointer argument
    pointers = tuple(
        (i, dtype, p.nullable[i], p.strided[i])
        for i, kind in enumerate(p.kinds)
        if (dtype := _KINDS[kind][1]) is not None
    )

    def call(*args: Any) -> int:
        if len(args) != nargs:
            raise NativeKernelError(f"{p.name} takes {nargs} arguments, got {len(args)}")
        a = list(args)
        i = -1
        try:
            for i, dtype, nullable, strided in pointers:
                t = a[i]
                if t is None:
                    if nullable:
                        continue
                    raise AttributeError
                if (
                    t.dtype is not dtype
                    or not t.is_cpu
                    or not (t.is_contiguous() or (strided and 1 in (t.stride()[-1], t.shape[-1])))
                ):
                    raise AttributeError
                a[i] = t.data_ptr()
        except AttributeError:  # not a tensor, or not the kind: say which argument
            raise NativeKernelError(_refusal(p, i, a[i])) from None
        return int(fn(*a))

    call.__name__ = call.__qualname__ = p.name
    return call


class NativeLib:
    """The loaded library: every export a checked function attribute (``lib.ts_linear_f32``),
    its declaration in ``prototypes``."""

    def __init__(
        self,
        cdll: ctypes.CDLL,
        functions: dict[str, Callable[..., int]],
        prototypes: dict[str, Prototype],
    ) -> None:
        self.cdll = cdll
        self.prototypes = prototypes
        self.__dict__.update(functions)

    def __getattr__(self, name: str) -> Callable[..., int]:  # reached only for unknown names
        raise AttributeError(f"the native library declares no function {name}")


def exported_signatures(lib: ctypes.CDLL) -> dict[str, str]:
    """The library's own table of its exports: name -> ``ret(kind, ...)`` from the C++ types."""
    try:
        table = lib.ts_signatures
    except AttributeError:
        raise NativeSignatureMismatch(
            f"{lib._name} exports no signature table (ts_signatures): not built from this "
            f"version of {SOURCE.name}"
        ) from None
    table.restype = ctypes.c_char_p
    table.argtypes = []
    raw = table()
    out = {}
    for line in (raw or b"").decode().splitlines():
        name, _, sig = line.partition(" ")
        out[name] = sig
    return out


def _declare(lib: ctypes.CDLL, prototypes: Sequence[str] = PROTOTYPES) -> NativeLib:
    """Check ``prototypes`` against the library's table and wrap each function; raises
    ``NativeSignatureMismatch`` naming every function that differs, with both signatures."""
    declared = {p.name: p for p in map(Prototype.parse, prototypes)}
    exported = exported_signatures(lib)
    problems = []
    for name in sorted(declared.keys() | exported.keys()):
        if name not in declared:
            problems.append(f"{name}: the library exports {exported[name]}; not declared here")
        elif name not in exported:
            problems.append(
                f"{name}: declared here as {declared[name].signature}; not in the library"
            )
        elif declared[name].signature != exported[name]:
            problems.append(
                f"{name}: declared here as {declared[name].signature}, "
                f"but the library's is {exported[name]}"
            )
    if problems:
        raise NativeSignatureMismatch(
            f"{lib._name} does not match kernels/cpu_native.py's prototypes; refusing to load "
            "it:\n  " + "\n  ".join(problems)
        )
    functions = {}
    for name, proto in declared.items():
        fn = getattr(lib, name)
        fn.restype = _KINDS[proto.ret][0]
        fn.argtypes = [_KINDS[k][0] for k in proto.kinds]
        functions[name] = _checked(fn, proto)
    return NativeLib(lib, functions, declared)


def load_variant(
    directory: Path, add: Sequence[str] = (), drop: Sequence[str] = ()
) -> NativeLib:
    """The source built with ``FLAGS`` less ``drop`` plus ``add`` (e.g. ``-march=x86-64`` for the
    portable loops, ``-mno-avx512f`` for the AVX2 path of an AVX-512 CPU) into ``directory``,
    loaded and checked like the process's own build; for tests and benchmarks of the paths other
    CPUs take. Raises ``RuntimeError`` when there is no compiler or the build fails."""
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found ($CXX, g++ or c++)")
    flags = [f for f in FLAGS if f not in drop] + list(add)
    tag = hashlib.sha256(SOURCE.read_bytes() + " ".join(flags).encode()).hexdigest()[:12]
    target = Path(directory) / f"cpu_kernels-variant-{tag}.so"
    proc = subprocess.run(
        [cxx, *flags, str(SOURCE), "-o", str(target)], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{cxx} failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return _declare(ctypes.CDLL(str(target)))


def available() -> bool:
    """Whether the native kernel is built and loaded (builds it on the first call)."""
    return _load() is not None


def unavailable_reason() -> str | None:
    """Why ``available()`` is False (None when it is True or has not been asked yet)."""
    return _reason


@dataclass(frozen=True, slots=True)
class AttentionPlan:
    """How the kernel splits a batch into work items: ``row_tile`` query rows (of one prefill
    chunk, or decode rows of sequences whose block tables start with the same block: a shared
    prefix, read once for all of them) and ``heads_per_item`` consecutive KV heads (all of them
    when there are enough items to share the threads: one item then reads each cache position's
    heads in one contiguous run)."""

    row_tile: int
    heads_per_item: int


def attention_plan(q: torch.Tensor, k_cache: torch.Tensor) -> AttentionPlan | None:
    """The work split for these inputs if the kernel takes them (CPU, fp32 queries and caches,
    head counts and size within its limits), else None: then use the torch path."""
    if (
        not enabled
        or not q.is_cpu
        or q.dtype != torch.float32
        or k_cache.dtype != torch.float32
    ):
        return None
    lib = _load()
    if lib is None:
        return None
    t, hq, d = q.shape
    hkv = k_cache.shape[2]
    max_vecs = _MAX_VECS
    if hq % hkv or d > _MAX_HEAD_DIM or hq // hkv > max_vecs:
        return None
    heads = hkv if hq <= max_vecs and t >= 2 * torch.get_num_threads() else 1
    return AttentionPlan(min(MAX_ROW_TILE, max_vecs // (heads * (hq // hkv))), heads)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor,
    num_seqs: int,
    plan: AttentionPlan,
) -> None:
    """Attend the query rows of the first ``num_seqs`` sequences of ``meta`` into ``out``.

    ``q`` ``[T, hq, D]`` (rows may be strided, heads contiguous), ``out`` likewise; caches
    contiguous ``[num_blocks, block_size, hkv, D]``; ``plan`` from ``attention_plan``.
    """
    lib = _load()
    if lib is None:
        raise NativeKernelError(f"native CPU kernels unavailable: {_reason}")
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
        q,
        q.stride(0),
        k_cache,
        v_cache,
        tables,
        tables.stride(0),
        seq_lens,
        cu,
        out,
        out.stride(0),
        num_seqs,
        hq,
        hkv,
        d,
        bs,
        k_cache.shape[0],
        float(scale),
        plan.row_tile,
        plan.heads_per_item,
        torch.get_num_threads(),
    )
    if rc != 0:
        raise NativeKernelError(f"native attention refused its arguments: {_ERRORS.get(rc, rc)}")


# ----------------------------------------------------------------------------- fused row-wise ops


def fused_ok(x: torch.Tensor) -> bool:
    """Whether the fused row-wise ops take ``x``: fp32 on CPU, kernels built and enabled."""
    return enabled and x.is_cpu and x.dtype is torch.float32 and available()


def _lib_or_raise() -> NativeLib:
    lib = _load()
    if lib is None:
        raise NativeKernelError(f"native CPU kernels unavailable: {_reason}")
    return lib


def _check_rows(name: str, t: torch.Tensor, rows: int, width: int) -> None:
    if t.dtype is not torch.float32 or not t.is_cpu:
        raise NativeKernelError(f"{name} must be fp32 on CPU, got {t.dtype} on {t.device}")
    if (
        t.dim() != 2
        or t.shape[0] != rows
        or t.shape[1] != width
        or (width > 1 and t.stride(1) != 1)
    ):
        raise NativeKernelError(
            f"{name} must be [{rows}, {width}] with contiguous rows, got {tuple(t.shape)} "
            f"strides {t.stride()}"
        )


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, delta: torch.Tensor | None = None
) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight`` per row of ``x`` ``[rows, hidden]``; with ``delta``,
    ``x += delta`` in place first (the residual stream), and the norm is of the sum."""
    lib = _lib_or_raise()
    rows, hidden = x.shape
    _check_rows("x", x, rows, hidden)
    if delta is not None:
        _check_rows("delta", delta, rows, hidden)
    if weight.shape != (hidden,) or weight.dtype != torch.float32 or not weight.is_contiguous():
        raise NativeKernelError(f"weight must be fp32 [{hidden}], got {tuple(weight.shape)}")
    out = torch.empty((rows, hidden), dtype=torch.float32)
    rc = lib.ts_rms_norm_f32(
        x,
        x.stride(0),
        delta,
        0 if delta is None else delta.stride(0),
        weight,
        out,
        out.stride(0),
        rows,
        hidden,
        float(eps),
        torch.get_num_threads(),
    )
    if rc != 0:
        raise NativeKernelError(f"rms_norm refused its arguments (code {rc})")
    return out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up`` ``[rows, 2 * inter]`` laid out ``[gate | up]``."""
    lib = _lib_or_raise()
    rows, width = gate_up.shape
    if width % 2:
        raise NativeKernelError(f"gate_up must have an even width, got {width}")
    _check_rows("gate_up", gate_up, rows, width)
    out = torch.empty((rows, width // 2), dtype=torch.float32)
    rc = lib.ts_silu_mul_f32(
        gate_up,
        gate_up.stride(0),
        out,
        rows,
        width // 2,
        torch.get_num_threads(),
    )
    if rc != 0:
        raise NativeKernelError(f"silu_and_mul refused its arguments (code {rc})")
    return out


def rope_store(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    q_heads: int,
) -> None:
    """Rotate the q and k heads of ``qkv`` ``[T, q_heads + 2 * kv_heads, D]`` in place (``cos``,
    ``sin`` ``[T, D // 2]``), then store its k and v heads at ``slot_mapping`` ``[T]`` (int64) in
    the caches ``[num_blocks, block_size, kv_heads, D]``."""
    lib = _lib_or_raise()
    t, heads, d = qkv.shape
    nb, bs, hkv, dc = k_cache.shape
    if heads != q_heads + 2 * hkv or d != dc or d % 2:
        raise NativeKernelError(
            f"qkv {tuple(qkv.shape)} does not hold {q_heads} q heads and {hkv} k and v heads "
            f"of the cache's head_dim {dc} (even)"
        )
    if qkv.dtype != torch.float32 or qkv.stride(2) != 1 or qkv.stride(1) != d:
        raise NativeKernelError(f"qkv must be fp32 with contiguous heads, got {qkv.stride()}")
    for name, tab in (("cos", cos), ("sin", sin)):
        _check_rows(name, tab.reshape(t, d // 2), t, d // 2)
        if not tab.is_contiguous():
            raise NativeKernelError(f"{name} must be contiguous")
    if slot_mapping.dtype != torch.int64 or slot_mapping.shape != (t,):
        raise NativeKernelError(f"slot_mapping must be int64 [{t}]")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.dtype != torch.float32 or not c.is_contiguous() or c.shape != k_cache.shape:
            raise NativeKernelError(f"{name} must be a contiguous fp32 cache like k_cache")
    slots = slot_mapping.contiguous()
    rc = lib.ts_rope_store_f32(
        qkv,
        qkv.stride(0),
        cos,
        sin,
        slots,
        k_cache,
        v_cache,
        nb * bs,
        t,
        q_heads,
        hkv,
        d,
        torch.get_num_threads(),
    )
    if rc == -5:
        raise NativeKernelError("a slot of slot_mapping is outside the cache")
    if rc != 0:
        raise NativeKernelError(f"rope_store refused its arguments (code {rc})")


# ----------------------------------------------------------------------------- linear layers

PANEL = 16  # output features per packed panel (the kernel's kPanel)


def packed_shape(out_features: int, in_features: int) -> tuple[int, int, int]:
    """The shape ``pack_linear`` gives a ``[out_features, in_features]`` weight."""
    return (-(-out_features // PANEL), in_features, PANEL)


def pack_linear(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[out, in]`` (fp32, CPU) in the layout ``linear`` reads: panels of 16 output
    features, ``packed[p, k, j] = weight[16 p + j, k]``, zeros past the last row (a new tensor)."""
    lib = _lib_or_raise()
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
    if width != PANEL or panels != -(-out_features // PANEL):
        raise NativeKernelError(
            f"{tuple(packed.shape)} is not a packed weight of {out_features} outputs"
        )
    return packed.permute(0, 2, 1).reshape(panels * PANEL, k)[:out_features].contiguous()


def linear(
    x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for ``x`` ``[M, in]`` (fp32, CPU) and ``W`` packed by ``pack_linear``."""
    lib = _lib_or_raise()
    # Shapes here; dtypes, device and layout of every tensor at the boundary (``_checked``).
    if x.dim() != 2 or x.dtype is not torch.float32 or not x.is_cpu:
        raise NativeKernelError(
            f"linear takes fp32 CPU x [M, in], got {x.dtype} {tuple(x.shape)} on {x.device}"
        )
    m, k = x.shape
    if packed.shape != packed_shape(out_features, k):
        raise NativeKernelError(
            f"the packed weight {tuple(packed.shape)} is not [{out_features} outputs, {k} inputs] "
            f"(expected {packed_shape(out_features, k)})"
        )
    if bias is not None and bias.shape != (out_features,):
        raise NativeKernelError(f"bias must be fp32 [{out_features}], got {tuple(bias.shape)}")
    if (k > 1 and x.stride(1) != 1) or (m > 1 and x.stride(0) < k):
        x = x.contiguous()
    y = torch.empty((m, out_features), dtype=torch.float32)
    rc = lib.ts_linear_f32(
        x,
        x.stride(0),
        m,
        k,
        packed,
        out_features,
        bias,
        y,
        out_features,
        torch.get_num_threads(),
    )
    if rc != 0:
        raise NativeKernelError(f"linear refused its arguments (code {rc})")
    return y


# ----------------------------------------------------------------------------- quantized weights
#
# A decode step's few rows meet every weight once: its time is the time to stream the weights
# from memory. Most small models ship quantized (a GGUF's Q4_1, Q8_0, ...), and their loader
# dequantizes them to fp32, 3.8-6.4x the bytes. A layer whose fp32 weight is exactly such a
# dequantization (every block of 32 inputs of an output ``fma(d, q, m)``, d and m fp16, q 4-bit;
# or ``d * q``, q 8-bit) keeps it in that form, and the kernel dequantizes as it goes. ``d * q`` is
# exact in fp32, so the weight the kernel uses is the fp32 weight, bit for bit, and each output is
# the same FMA chain over k as on the fp32 panels: the same bits as ``linear`` (the deterministic
# mode and batch invariance hold). ``pack_linear_quantized`` finds d, m and q and checks every
# weight; a layer with any block that is not such a dequantization stays fp32.

ENV_QUANTIZED = "TIERSERVE_QUANTIZED_WEIGHTS"
QUANT_BLOCK = 32  # inputs per block (the kernel's kQBlock)
QUANT_BLOCK_BYTES = {4: 320, 8: 544}  # bytes per block of a panel (16 outputs x 32 inputs)


def quantized_enabled() -> bool:
    """Whether ``pack_for_cpu`` may keep weights quantized: ``TIERSERVE_QUANTIZED_WEIGHTS`` is
    ``auto`` (the default) or ``off`` (always fp32 panels, e.g. to compare the two)."""
    setting = os.environ.get(ENV_QUANTIZED, "auto").strip().lower()
    if setting in ("", "auto", "on", "1"):
        return True
    if setting in ("off", "0", "never"):
        return False
    raise ValueError(f"{ENV_QUANTIZED} must be auto or off, got {setting!r}")


def quantized_shape(out_features: int, in_features: int, bits: int) -> tuple[int, int]:
    """The shape (bytes) ``pack_linear_quantized`` gives an ``[out, in]`` weight at ``bits``."""
    if bits not in QUANT_BLOCK_BYTES:
        raise NativeKernelError(f"quantized weights are 4 or 8 bits, got {bits}")
    return (-(-out_features // PANEL), in_features // QUANT_BLOCK * QUANT_BLOCK_BYTES[bits])


def pack_linear_quantized(
    weight: torch.Tensor, bits_tried: Sequence[int] = (4, 8)
) -> tuple[torch.Tensor, int] | None:
    """``weight`` ``[out, in]`` (fp32, CPU) as quantized panels (``(packed, bits)``, the first of
    ``bits_tried`` that gives back every weight exactly), or None when it is no such
    dequantization (or ``in`` is not a multiple of 32)."""
    lib = _lib_or_raise()
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
        packed = torch.empty(quantized_shape(n, k, bits), dtype=torch.uint8)
        rc = lib.ts_pack_linear_q(w, n, k, bits, packed, torch.get_num_threads())
        if rc == 0:
            return packed, bits
        if rc != 1:
            raise NativeKernelError(f"pack_linear_quantized refused its arguments (code {rc})")
    return None


def _check_quantized(packed: torch.Tensor, bits: int, out_features: int, k: int) -> None:
    if k % QUANT_BLOCK:
        raise NativeKernelError(
            f"quantized weights take inputs in blocks of {QUANT_BLOCK}; {k} inputs is not a "
            "multiple"
        )
    if packed.dtype != torch.uint8 or tuple(packed.shape) != quantized_shape(out_features, k, bits):
        raise NativeKernelError(
            f"the quantized weight {packed.dtype} {tuple(packed.shape)} is not "
            f"[{out_features} outputs, {k} inputs] at {bits} bits (expected uint8 "
            f"{quantized_shape(out_features, k, bits)})"
        )


def unpack_linear_quantized(packed: torch.Tensor, bits: int, out_features: int,
                            in_features: int) -> torch.Tensor:
    """The ``[out_features, in_features]`` fp32 weight back from ``pack_linear_quantized``."""
    lib = _lib_or_raise()
    _check_quantized(packed, bits, out_features, in_features)
    panels = torch.empty(packed_shape(out_features, in_features), dtype=torch.float32)
    rc = lib.ts_unpack_linear_q(
        packed, out_features, in_features, bits, panels, torch.get_num_threads()
    )
    if rc != 0:
        raise NativeKernelError(f"unpack_linear_quantized refused its arguments (code {rc})")
    return unpack_linear(panels, out_features)


def linear_quantized(
    x: torch.Tensor,
    packed: torch.Tensor,
    bits: int,
    out_features: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``linear`` on a weight packed by ``pack_linear_quantized``: the same bits."""
    lib = _lib_or_raise()
    if x.dim() != 2 or x.dtype is not torch.float32 or not x.is_cpu:
        raise NativeKernelError(
            f"linear takes fp32 CPU x [M, in], got {x.dtype} {tuple(x.shape)} on {x.device}"
        )
    m, k = x.shape
    _check_quantized(packed, bits, out_features, k)
    if bias is not None and bias.shape != (out_features,):
        raise NativeKernelError(f"bias must be fp32 [{out_features}], got {tuple(bias.shape)}")
    if (k > 1 and x.stride(1) != 1) or (m > 1 and x.stride(0) < k):
        x = x.contiguous()
    y = torch.empty((m, out_features), dtype=torch.float32)
    rc = lib.ts_linear_q(
        x, x.stride(0), m, k, packed, bits, out_features, bias, y, out_features,
        torch.get_num_threads(),
    )
    if rc != 0:
        raise NativeKernelError(f"linear refused its arguments (code {rc})")
    return y



# ----------------------------------------------------------------------------- native or library
#
# Which is faster, the native kernel or the library's GEMM (``F.linear``: MKL, or whatever BLAS
# torch was built with), depends on the CPU and the row count: measured on SmolLM2-135M shapes,
# the native kernel is faster up to 256 rows on an AVX-512 Xeon and within 3% of it at 512;
# limited to AVX2, the library is 4-9% faster from 256 rows; on an AMD EPYC (AVX2) the native
# kernel measured about 2x at 1-32 rows; and the portable loops of a CPU without AVX2 are far
# slower than any BLAS. So the default mode decides per layer shape, at pack time, by timing
# both on this CPU (``library_rows``); the deterministic mode never asks (native kernel only).

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
    faster than the native kernel (on ``packed``, from ``pack_linear(weight)``, or from
    ``pack_linear_quantized`` with ``bits``) for this shape on this CPU, or None if never. Timed once per shape, bias and thread count on a machine (a
    few seconds for SmolLM2-135M's five shapes, most of it its output head), then kept beside
    the built library (``_calibration_file``);
    ``TIERSERVE_LINEAR_LIBRARY_ROWS`` overrides it: ``never``, a row count, or ``auto`` (the
    default)."""
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
    if _lib_path is None:
        return None
    return _lib_path.with_name(_lib_path.stem + ".calibration.json")


def _calibration_key(key: _ShapeKey) -> str:
    n, k, bias, threads, bits = key
    return (f"{n}x{k}{'+bias' if bias else ''}{'' if bits is None else f'|q{bits}'}"
            f"|threads={threads}|torch={torch.__version__}|cpu={_cpuinfo('model name')}")


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
                return linear_quantized(x, packed, bits, n, bias)
            return linear(x, packed, n, bias)

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
