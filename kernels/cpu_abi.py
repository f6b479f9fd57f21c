"""The boundary between Python and the native CPU library: what both sides must agree on.

ctypes calls a C function with whatever it is told the function takes: an argument added,
dropped or retyped on one side only shifts the arguments after it, and a kernel writes through
the wrong pointer without a word. So the library exports a table of its functions' argument
kinds, generated from their C++ types (``ts_signatures``), and ``declare`` compares it with
``PROTOTYPES``, refusing the library on any difference (``NativeSignatureMismatch``). Each call
then goes through a checked function (``_checked``), which takes tensors for the pointer
arguments and checks each against its kind (dtype, CPU, a contiguous last dimension) before
passing its address, and the count (``NativeKernelError``).

The layouts of the linear weights the library reads are agreed here too: fp32 panels of
``PANEL`` output features (``packed_shape``) and quantized panels in blocks of ``QUANT_BLOCK``
inputs (``quantized_shape``); ``tierserve.kernels.cpu_packing`` packs them,
``tierserve.kernels.cpu_ops`` multiplies by them.
"""

from __future__ import annotations

import ctypes
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tierserve.arith import ceil_div
from tierserve.kernels import cpu_build


class NativeKernelError(RuntimeError):
    """The native kernel refused its arguments (a bug in the caller: they are checked first)."""


class NativeSignatureMismatch(RuntimeError):
    """The built library's functions do not take what this module declares: a bug in the
    repository (one side changed without the other), never a condition of the machine."""


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
    "i32 head_dim, i32 block_size, i32 num_blocks, f32 scale, i32 window, f32 softcap, "
    "i32 row_tile, i32 heads_per_item, i32 num_threads)",
    "i32 ts_rms_norm_f32(strided f32* x, i64 x_stride, strided const f32*? delta, "
    "i64 delta_stride, const f32* weight, strided f32* out, i64 out_stride, i64 rows, "
    "i32 hidden, f32 eps, i32 num_threads)",
    "i32 ts_silu_mul_f32(strided const f32* gate_up, i64 gu_stride, f32* out, i64 rows, "
    "i32 inter, i32 num_threads)",
    "i32 ts_gelu_tanh_mul_f32(strided const f32* gate_up, i64 gu_stride, f32* out, i64 rows, "
    "i32 inter, i32 num_threads)",
    "i32 ts_qk_norm_f32(strided f32* qkv, i64 qkv_stride, const f32* q_weight, "
    "const f32* k_weight, i64 rows, i32 hq, i32 hkv, i32 head_dim, f32 eps, i32 num_threads)",
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
    "i32 ts_moe_route_f32(strided const f32* logits, i64 logits_stride, i64 rows, i32 experts, "
    "i32 top_k, i32 renorm, f32* weights, i64* ids, i64* sorted_rows, i64* pair_pos, "
    "i64* counts, i32 num_threads)",
    "i32 ts_moe_combine_f32(const f32* ys, const i64* pair_pos, const f32* weights, i64 rows, "
    "i32 top_k, i32 hidden, strided const f32*? shared, i64 shared_stride, "
    "const f32*? shared_gate, f32* out, i32 num_threads)",
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
    "i64*": (ctypes.c_void_p, torch.int64),
    "u8*": (ctypes.c_void_p, torch.uint8),
    "const u8*": (ctypes.c_void_p, torch.uint8),
}
_PROTOTYPE = re.compile(r"(?P<ret>\w+) (?P<name>\w+)\((?P<args>[^()]*)\)")


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
            f"version of {cpu_build.SOURCE.name}"
        ) from None
    table.restype = ctypes.c_char_p
    table.argtypes = []
    raw = table()
    out = {}
    for line in (raw or b"").decode().splitlines():
        name, _, sig = line.partition(" ")
        out[name] = sig
    return out


def declare(lib: ctypes.CDLL, prototypes: Sequence[str] = PROTOTYPES) -> NativeLib:
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
            f"{lib._name} does not match kernels/cpu_abi.py's prototypes; refusing to load "
            "it:\n  " + "\n  ".join(problems)
        )
    functions = {}
    for name, proto in declared.items():
        fn = getattr(lib, name)
        fn.restype = _KINDS[proto.ret][0]
        fn.argtypes = [_KINDS[k][0] for k in proto.kinds]
        functions[name] = _checked(fn, proto)
    return NativeLib(lib, functions, declared)


# ----------------------------------------------------------------------------- the weights' layouts

PANEL = 16  # output features per packed panel (the kernel's kPanel)


def packed_shape(out_features: int, in_features: int) -> tuple[int, int, int]:
    """The shape ``pack_linear`` gives a ``[out_features, in_features]`` weight."""
    return (ceil_div(out_features, PANEL), in_features, PANEL)


QUANT_BLOCK = 32  # inputs per block (the kernel's kQBlock)
# The K-quant forms' codes (the kernel's kFormK4 ...: 100 + the GGUF type's bits), passed where
# Q4/Q8 pass 4 or 8: GGUF Q4_K's and Q5_K's w = fma(S, q, O), Q6_K's w = S * q, with fp32 S and O
# per sub-block (see "K-quant forms" in the C++).
QUANT_K4, QUANT_K5, QUANT_K6 = 104, 105, 106
# bytes per block of a panel (16 outputs x 32 inputs), by form
QUANT_BLOCK_BYTES = {4: 320, 8: 544, QUANT_K4: 384, QUANT_K5: 640, QUANT_K6: 640}
QUANT_NAMES = {4: "4-bit", 8: "8-bit", QUANT_K4: "Q4_K", QUANT_K5: "Q5_K", QUANT_K6: "Q6_K"}


def quantized_shape(out_features: int, in_features: int, bits: int) -> tuple[int, int]:
    """The shape (bytes) ``pack_linear_quantized`` gives an ``[out, in]`` weight at ``bits``."""
    if bits not in QUANT_BLOCK_BYTES:
        raise NativeKernelError(
            f"quantized weights are 4 or 8 bits or a K-quant form ({QUANT_K4}, {QUANT_K5}, "
            f"{QUANT_K6}), got {bits}"
        )
    return (ceil_div(out_features, PANEL), in_features // QUANT_BLOCK * QUANT_BLOCK_BYTES[bits])


def _form(bits: int) -> str:
    return f"{bits} bits" if bits in (4, 8) else f"the {QUANT_NAMES.get(bits, '?')} form ({bits})"


def check_quantized(packed: torch.Tensor, bits: int, out_features: int, k: int) -> None:
    """Raise ``NativeKernelError`` unless ``packed`` is ``quantized_shape``'s uint8 bytes of an
    ``[out_features, k]`` weight at ``bits`` (``k`` a multiple of ``QUANT_BLOCK``)."""
    if k % QUANT_BLOCK:
        raise NativeKernelError(
            f"quantized weights take inputs in blocks of {QUANT_BLOCK}; {k} inputs is not a "
            "multiple"
        )
    if packed.dtype != torch.uint8 or tuple(packed.shape) != quantized_shape(out_features, k, bits):
        raise NativeKernelError(
            f"the quantized weight {packed.dtype} {tuple(packed.shape)} is not "
            f"[{out_features} outputs, {k} inputs] at {_form(bits)} (expected uint8 "
            f"{quantized_shape(out_features, k, bits)})"
        )

