"""The typed boundary between kernels/cpu_abi.py and the C++ library: a declaration that does
not match what the library was compiled with is refused at load (naming the function and both
signatures), every exported function is covered by that check, and every call checks its tensor
arguments against their kinds before passing an address."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tierserve.kernels import cpu_abi, cpu_build, cpu_native, cpu_packing

needs_native = pytest.mark.skipif(
    not cpu_native.available(),
    reason=f"native kernels unavailable: {cpu_native.unavailable_reason()}",
)
Mismatch = cpu_abi.NativeSignatureMismatch


def _lib() -> cpu_abi.NativeLib:
    lib = cpu_native.load()
    assert lib is not None
    return lib


def _with(name: str, prototype: str) -> list[str]:
    """PROTOTYPES with ``name``'s replaced by ``prototype``."""
    out = [p for p in cpu_abi.PROTOTYPES if cpu_abi.Prototype.parse(p).name != name]
    assert len(out) == len(cpu_abi.PROTOTYPES) - 1
    return [*out, prototype]


def _compile(source: Path, target: Path) -> Path:
    cxx = cpu_build.compiler()
    if cxx is None:
        pytest.skip("no C++ compiler")
    subprocess.run([cxx, *cpu_build.FLAGS, str(source), "-o", str(target)], check=True)
    return target


@pytest.fixture
def fresh_loader(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """The loader as if nothing had been loaded yet in this process (restored afterwards)."""
    monkeypatch.setattr(cpu_native, "_tried", False)
    monkeypatch.setattr(cpu_native, "_lib", None)
    monkeypatch.setattr(cpu_native, "_reason", None)
    monkeypatch.setattr(cpu_native, "_mismatch", None)
    monkeypatch.setenv(cpu_build.ENV_CACHE, str(tmp_path / "cache"))
    yield


@pytest.fixture(scope="module")
def changed_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The source with one argument's C++ type changed (``int inter`` -> ``int64_t inter``)."""
    text = cpu_build.SOURCE.read_text()
    old = "float* out, int64_t rows, int inter,"
    assert text.count(old) == 1, "the test's anchor moved: update it"
    path = Path(tmp_path_factory.mktemp("changed")) / "cpu_kernels.cpp"
    path.write_text(text.replace(old, "float* out, int64_t rows, int64_t inter,"))
    return path


# ----------------------------------------------------------------------------- the declarations


def test_prototypes_parse_and_name_known_kinds() -> None:
    protos = [cpu_abi.Prototype.parse(p) for p in cpu_abi.PROTOTYPES]
    assert len({p.name for p in protos}) == len(protos)
    lin = next(p for p in protos if p.name == "ts_linear_f32")
    assert lin.signature == "i32(const f32*, i64, i64, i64, const f32*, i64, const f32*, f32*, i64, i32)"
    assert lin.names[0] == "x" and lin.strided[0] and not lin.nullable[0]
    assert lin.nullable[6] and not lin.strided[6]  # bias may be None
    with pytest.raises(ValueError, match="unknown kind 'f64'"):
        cpu_abi.Prototype.parse("i32 ts_f(f64 x)")
    with pytest.raises(ValueError, match="not a prototype"):
        cpu_abi.Prototype.parse("ts_f(i32 x")


@needs_native
def test_the_library_table_matches_every_declaration() -> None:
    """What the loaded build says of itself (from its C++ types) is what this module declares."""
    table = cpu_abi.exported_signatures(_lib().cdll)
    declared = {p.name: p.signature for p in map(cpu_abi.Prototype.parse, cpu_abi.PROTOTYPES)}
    assert table == declared


@needs_native
@pytest.mark.skipif(shutil.which("nm") is None, reason="needs nm (binutils)")
def test_every_exported_function_is_in_the_table() -> None:
    """No C function leaves the library unchecked: its dynamic symbol table (C++ symbols are
    mangled, ``_Z...``) holds exactly the table's functions and the table itself."""
    path = _lib().cdll._name
    out = subprocess.run(
        ["nm", "-D", "--defined-only", path], capture_output=True, text=True, check=True
    ).stdout
    c_functions = {
        parts[2]
        for parts in (line.split() for line in out.splitlines())
        if len(parts) == 3 and parts[1] in "TW" and not parts[2].startswith(("_Z", "_init", "_fini"))
    }
    table = cpu_abi.exported_signatures(_lib().cdll)
    assert c_functions == {*table, "ts_signatures"}


# ----------------------------------------------------------------------------- refusals at load


@needs_native
@pytest.mark.parametrize(
    ("prototype", "declared"),
    [
        (  # the last argument (num_threads) forgotten
            "i32 ts_linear_f32(strided const f32* x, i64 x_stride, i64 m, i64 k, "
            "const f32* packed, i64 n, const f32*? bias, strided f32* y, i64 y_stride)",
            "i32(const f32*, i64, i64, i64, const f32*, i64, const f32*, f32*, i64)",
        ),
        (  # m declared 32-bit where the C++ takes int64_t
            "i32 ts_linear_f32(strided const f32* x, i64 x_stride, i32 m, i64 k, "
            "const f32* packed, i64 n, const f32*? bias, strided f32* y, i64 y_stride, "
            "i32 num_threads)",
            "i32(const f32*, i64, i32, i64, const f32*, i64, const f32*, f32*, i64, i32)",
        ),
        (  # two pointers swapped: an output where an input is
            "i32 ts_linear_f32(strided f32* y, i64 y_stride, i64 m, i64 k, "
            "const f32* packed, i64 n, const f32*? bias, strided const f32* x, i64 x_stride, "
            "i32 num_threads)",
            "i32(f32*, i64, i64, i64, const f32*, i64, const f32*, const f32*, i64, i32)",
        ),
    ],
    ids=["argument-missing", "wrong-width", "const-swapped"],
)
def test_a_mismatched_declaration_is_refused(prototype: str, declared: str) -> None:
    lib = _lib().cdll
    exported = cpu_abi.exported_signatures(lib)["ts_linear_f32"]
    with pytest.raises(Mismatch, match="refusing to load") as err:
        cpu_abi.declare(lib, _with("ts_linear_f32", prototype))
    msg = str(err.value)
    assert f"ts_linear_f32: declared here as {declared}, but the library's is {exported}" in msg


@needs_native
def test_undeclared_and_unexported_functions_are_refused() -> None:
    lib = _lib().cdll
    protos = [p for p in cpu_abi.PROTOTYPES if "ts_silu_mul_f32" not in p]
    protos.append("i32 ts_gelu_f32(const f32* x, i64 rows)")
    with pytest.raises(Mismatch) as err:
        cpu_abi.declare(lib, protos)
    msg = str(err.value)
    assert "ts_silu_mul_f32: the library exports i32(const f32*, i64, f32*, i64, i32, i32)" in msg
    assert "ts_gelu_f32: declared here as i32(const f32*, i64); not in the library" in msg


def test_a_build_with_a_changed_signature_is_refused(changed_source: Path, tmp_path: Path) -> None:
    """The other side: the C++ changed, this module not. Its table says so, from the types."""
    lib = ctypes.CDLL(str(_compile(changed_source, tmp_path / "changed.so")))
    with pytest.raises(Mismatch) as err:
        cpu_abi.declare(lib)
    assert (
        "ts_silu_mul_f32: declared here as i32(const f32*, i64, f32*, i64, i32, i32), "
        "but the library's is i32(const f32*, i64, f32*, i64, i64, i32)"
    ) in str(err.value)
    assert "ts_linear_f32" not in str(err.value)  # only what differs


def test_a_library_without_a_table_is_refused(tmp_path: Path) -> None:
    src = tmp_path / "old.cpp"
    src.write_text('extern "C" int ts_max_vecs() { return 64; }\n')
    lib = ctypes.CDLL(str(_compile(src, tmp_path / "old.so")))
    with pytest.raises(Mismatch, match=r"exports no signature table \(ts_signatures\)"):
        cpu_abi.declare(lib)


def test_the_loader_refuses_loudly_and_keeps_refusing(
    fresh_loader: None, changed_source: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not a quiet fallback to torch: a mismatch is a bug of the repository, so every use of the
    kernels raises it (the deterministic mode's checks and the dispatch included)."""
    if cpu_build.compiler() is None:
        pytest.skip("no C++ compiler")
    monkeypatch.setattr(cpu_build, "SOURCE", changed_source)
    for _ in range(2):
        with pytest.raises(Mismatch, match="ts_silu_mul_f32: declared here"):
            cpu_native.available()
    with pytest.raises(Mismatch):
        cpu_native.fused_ok(torch.zeros(2, 2))
    with pytest.raises(Mismatch):
        cpu_native.deterministic_unsupported("cpu", torch.float32, 4, 2, 32)
    assert "ts_silu_mul_f32" in (cpu_native.unavailable_reason() or "")


# ----------------------------------------------------------------------------- checks per call


@needs_native
def test_calls_check_their_tensors_and_count() -> None:
    fn = _lib().ts_silu_mul_f32
    gate_up, out = torch.randn(3, 8), torch.empty(3, 4)
    assert fn(gate_up, 8, out, 3, 4, 1) == 0
    torch.testing.assert_close(out, torch.nn.functional.silu(gate_up[:, :4]) * gate_up[:, 4:])
    cases = [
        ((gate_up.double(), 8, out, 3, 4, 1), r"argument 0 \(const f32\* gate_up\).*got torch.float64"),
        ((gate_up, 8, out.t(), 3, 4, 1), r"argument 2 \(f32\* out\) takes a torch.float32 CPU tensor, contiguous"),
        ((gate_up, 8, None, 3, 4, 1), r"argument 2 \(f32\* out\).*got NoneType"),
        ((gate_up, 8, out.data_ptr(), 3, 4, 1), r"argument 2 \(f32\* out\).*got int"),
        ((gate_up, 8, out, 3, 4), "takes 6 arguments, got 5"),
        ((gate_up, 8, out, 3, 4, 1, 0), "takes 6 arguments, got 7"),
    ]
    for args, message in cases:
        with pytest.raises(cpu_abi.NativeKernelError, match=message):
            fn(*args)
    # A strided argument takes rows at a stride (elements contiguous), never strided elements.
    wide = torch.randn(3, 16)
    assert fn(wide[:, :8], 16, out, 3, 4, 1) == 0
    with pytest.raises(cpu_abi.NativeKernelError, match="rows of contiguous elements"):
        fn(wide[:, ::2], 16, out, 3, 4, 1)


@needs_native
def test_nullable_pointers_take_none_and_others_do_not() -> None:
    lib = _lib()
    x, w = torch.randn(2, 8), torch.randn(16, 8)
    packed = cpu_packing.pack_linear(w)
    y = torch.empty(2, 16)
    assert lib.ts_linear_f32(x, 8, 2, 8, packed, 16, None, y, 16, 1) == 0  # no bias: null
    torch.testing.assert_close(y, x @ w.T)
    with pytest.raises(cpu_abi.NativeKernelError, match=r"argument 4 \(const f32\* packed\)"):
        lib.ts_linear_f32(x, 8, 2, 8, None, 16, None, y, 16, 1)


@needs_native
def test_every_declared_function_is_checked() -> None:
    """Each export is wrapped (none reaches ctypes unchecked): a wrong count is refused by all."""
    lib = _lib()
    for name, proto in lib.prototypes.items():
        with pytest.raises(cpu_abi.NativeKernelError, match=f"{name} takes {len(proto.kinds)}"):
            getattr(lib, name)(*range(len(proto.kinds) + 1))
