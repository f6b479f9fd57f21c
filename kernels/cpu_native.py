"""Native CPU kernels: a small C++ library built at first use and called through ``ctypes``.

``kernels/csrc/cpu_kernels.cpp`` holds the CPU fast path for fp32 (anything else falls back to
plain torch):

- ``paged_attention``: every query row of a flat batch over its sequence's paged K/V *in place*
  (no gather into a padded copy, no mask tensor), with an online softmax, in parallel over
  (sequence, KV head, row tile) under OpenMP; the ``torch`` attention backend's fast path.
- ``linear``: ``x @ W.T (+ b)`` with ``W`` repacked once by ``pack_linear`` into panels of 16
  output features; a register-tiled micro-kernel (6 rows x 16 outputs in AVX2 registers), threads
  splitting the panels. ``replica.models.layers.Linear.pack_for_cpu`` switches a layer to it.
- ``rms_norm`` (optionally adding the previous block's output into the residual first),
  ``silu_and_mul`` and ``rope_store`` (rotary embedding of q and k, then k and v into the
  cache): one pass over the rows each, where torch runs several ops with temporaries.

Every kernel computes each value of a row from that row alone, in an order fixed by the row's
own sizes (see the source's header): the deterministic mode (docs/determinism.md) runs on these
kernels only, and ``deterministic_unsupported`` says when it cannot.

Build: the first call compiles the source with the system C++ compiler (``$CXX``, else ``g++``
or ``c++``; ``-O3 -march=native -fopenmp``, about a second) into a cache directory
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
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels.metadata import AttentionMetadata

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
# Query rows per work item, at most: a prefill chunk's rows share each key run of the item.
MAX_ROW_TILE = 8

# Switch for tests and benchmarks (the torch path runs when False).
enabled = True

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_reason: str | None = None  # why the library is unavailable; None until the first try
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
        return "the native CPU kernels are switched off (kernels.cpu_native.enabled)"
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
        return "the native CPU kernels are switched off (kernels.cpu_native.enabled)"
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
    name = f"cpu_kernels-{key.hexdigest()[:16]}.so"
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
    if _tried:  # the step loop's path: no lock once the library is loaded (or refused)
        return _lib
    with _lock:
        if _tried:
            return _lib
        try:
            _try_load()
        finally:
            _tried = True  # last: the lock-free check above must not see a half-done load
        return _lib


def _try_load() -> None:
    global _lib, _reason, _MAX_VECS, _MAX_HEAD_DIM
    if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "no", "off"):
        _reason = f"disabled by {ENV_SWITCH}"
        return
    cxx = _compiler()
    if cxx is None:
        _reason = "no C++ compiler found ($CXX, g++ or c++)"
    else:
        try:
            lib = ctypes.CDLL(str(_build(cxx)))
            _declare(lib)
            # The kernel's limits, read once (attention_plan runs per layer per step).
            _MAX_VECS, _MAX_HEAD_DIM = lib.ts_max_vecs(), lib.ts_max_head_dim()
            _lib = lib
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            _reason = f"building {SOURCE.name} failed: {exc}"
    if _lib is None:
        log.warning("native CPU kernels unavailable (%s); using plain torch", _reason)


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    fn = lib.ts_paged_attention_f32
    fn.restype = i32
    fn.argtypes = [
        p,
        i64,
        p,
        p,
        p,
        i64,
        p,
        p,
        p,
        i64,
        i32,
        i32,
        i32,
        i32,
        i32,
        i32,
        f32,
        i32,
        i32,
        i32,
    ]
    lib.ts_max_vecs.restype = i32
    lib.ts_max_head_dim.restype = i32
    lib.ts_rms_norm_f32.restype = i32
    lib.ts_rms_norm_f32.argtypes = [p, i64, p, i64, p, p, i64, i64, i32, f32, i32]
    lib.ts_silu_mul_f32.restype = i32
    lib.ts_silu_mul_f32.argtypes = [p, i64, p, i64, i32, i32]
    lib.ts_rope_store_f32.restype = i32
    lib.ts_rope_store_f32.argtypes = [p, i64, p, p, p, p, p, i64, i64, i32, i32, i32, i32]
    lib.ts_pack_linear_f32.restype = i32
    lib.ts_pack_linear_f32.argtypes = [p, i64, i64, p, i32]
    lib.ts_linear_f32.restype = i32
    lib.ts_linear_f32.argtypes = [p, i64, i64, i64, p, i64, p, p, i64, i32]


def available() -> bool:
    """Whether the native kernel is built and loaded (builds it on the first call)."""
    return _load() is not None


def unavailable_reason() -> str | None:
    """Why ``available()`` is False (None when it is True or has not been asked yet)."""
    return _reason


@dataclass(frozen=True, slots=True)
class AttentionPlan:
    """How the kernel splits a batch into work items: ``row_tile`` query rows of one sequence and
    ``heads_per_item`` consecutive KV heads (all of them when there are enough items to share
    the threads: one item then reads each cache position's heads in one contiguous run)."""

    row_tile: int
    heads_per_item: int


def attention_plan(q: torch.Tensor, k_cache: torch.Tensor) -> AttentionPlan | None:
    """The work split for these inputs if the kernel takes them (CPU, fp32 queries and caches,
    head counts and size within its limits), else None: then use the torch path."""
    if (
        not enabled
        or q.device.type != "cpu"
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
        plan.row_tile,
        plan.heads_per_item,
        torch.get_num_threads(),
    )
    if rc != 0:
        raise NativeKernelError(f"native attention refused its arguments: {_ERRORS.get(rc, rc)}")


# ----------------------------------------------------------------------------- fused row-wise ops


def fused_ok(x: torch.Tensor) -> bool:
    """Whether the fused row-wise ops take ``x``: fp32 on CPU, kernels built and enabled."""
    return enabled and x.device.type == "cpu" and x.dtype == torch.float32 and available()


def _lib_or_raise() -> ctypes.CDLL:
    lib = _load()
    if lib is None:
        raise NativeKernelError(f"native CPU kernels unavailable: {_reason}")
    return lib


def _check_rows(name: str, t: torch.Tensor, rows: int, width: int) -> None:
    if t.dtype != torch.float32 or t.device.type != "cpu":
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
        x.data_ptr(),
        x.stride(0),
        None if delta is None else delta.data_ptr(),
        0 if delta is None else delta.stride(0),
        weight.data_ptr(),
        out.data_ptr(),
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
        gate_up.data_ptr(),
        gate_up.stride(0),
        out.data_ptr(),
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
        qkv.data_ptr(),
        qkv.stride(0),
        cos.data_ptr(),
        sin.data_ptr(),
        slots.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
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
    rc = lib.ts_pack_linear_f32(w.data_ptr(), n, k, packed.data_ptr(), torch.get_num_threads())
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
    if x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu":
        raise NativeKernelError(
            f"linear takes fp32 CPU x [M, in], got {x.dtype} {tuple(x.shape)} on {x.device}"
        )
    m, k = x.shape
    if packed.dtype != torch.float32 or packed.shape != packed_shape(out_features, k):
        raise NativeKernelError(
            f"the packed weight {tuple(packed.shape)} is not [{out_features} outputs, {k} inputs] "
            f"(expected {packed_shape(out_features, k)})"
        )
    if not packed.is_contiguous():
        raise NativeKernelError("the packed weight must be contiguous")
    if bias is not None and (
        bias.shape != (out_features,) or bias.dtype != torch.float32 or not bias.is_contiguous()
    ):
        raise NativeKernelError(f"bias must be fp32 [{out_features}], got {tuple(bias.shape)}")
    if (k > 1 and x.stride(1) != 1) or (m > 1 and x.stride(0) < k):
        x = x.contiguous()
    y = torch.empty((m, out_features), dtype=torch.float32)
    rc = lib.ts_linear_f32(
        x.data_ptr(),
        x.stride(0),
        m,
        k,
        packed.data_ptr(),
        out_features,
        None if bias is None else bias.data_ptr(),
        y.data_ptr(),
        out_features,
        torch.get_num_threads(),
    )
    if rc != 0:
        raise NativeKernelError(f"linear refused its arguments (code {rc})")
    return y
