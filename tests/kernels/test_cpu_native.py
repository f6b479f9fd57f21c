"""The native CPU attention kernel: against the reference, its fallbacks, and its refusals."""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.kernels.common import LONG_DECODES, MIXED, check_against_reference
from tests.kernels.helpers import Shape
from tierserve.kernels import (
    cpu_abi,
    cpu_build,
    cpu_calibration,
    cpu_native,
    cpu_ops,
    cpu_packing,
    torch_attention,
)
from tierserve.kernels.attention import attention
from tierserve.kernels.metadata import SeqSpec, build_metadata

needs_native = pytest.mark.skipif(
    not cpu_native.available(),
    reason=f"native kernel unavailable: {cpu_native.unavailable_reason()}",
)


@pytest.fixture
def fresh_loader(monkeypatch: pytest.MonkeyPatch, tmp_path: object) -> Iterator[None]:
    """The loader as if nothing had been built yet in this process (restored afterwards)."""
    monkeypatch.setattr(cpu_native, "_tried", False)
    monkeypatch.setattr(cpu_native, "_lib", None)
    monkeypatch.setattr(cpu_native, "_reason", None)
    monkeypatch.setenv(cpu_build.ENV_CACHE, str(tmp_path))
    yield


def _native(q, k, v, kc, vc, meta, scale, row_tile, all_heads):  # type: ignore[no-untyped-def]
    from tierserve.kernels import reference

    reference.store_kv(k, v, kc, vc, meta.slot_mapping)
    out = torch.empty_like(q)
    heads = kc.shape[2] if all_heads else 1
    plan = cpu_ops.AttentionPlan(row_tile, heads)
    cpu_ops.paged_attention(q, kc, vc, meta, scale, out, meta.num_seqs, plan)
    return out


@needs_native
@pytest.mark.parametrize("all_heads", [False, True], ids=["head-items", "seq-items"])
@pytest.mark.parametrize("row_tile", [1, 3, 8])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize(
    "shape",
    [Shape(2, 4, 32), Shape(3, 3, 64), Shape(1, 1, 128), Shape(2, 2, 20), Shape(1, 5, 72)],
    ids=["gqa4-d32", "gqa3-d64", "mha-d128", "d20-portable", "d72"],
)
def test_native_matches_reference(
    shape: Shape, block_size: int, row_tile: int, all_heads: bool
) -> None:
    """Decodes and chunks (with and without a cached prefix), AVX2 and portable head sizes,
    work items of one KV head or of all of them."""
    if all_heads and row_tile * shape.q_heads > 64:
        row_tile = 64 // shape.q_heads
    attend = functools.partial(_native, row_tile=row_tile, all_heads=all_heads)
    check_against_reference(attend, MIXED, shape, block_size, torch.float32, "cpu")


@needs_native
def test_native_long_contexts_and_prompts() -> None:
    """Contexts over many key runs (block edges not aligned with the kernel's runs)."""
    attend = functools.partial(_native, row_tile=8, all_heads=True)
    check_against_reference(
        attend, [*LONG_DECODES, (0, 300), (250, 90)], Shape(2, 4, 32), 16, torch.float32, "cpu"
    )
    check_against_reference(attend, LONG_DECODES, Shape(1, 8, 64), 48, torch.float32, "cpu")


@needs_native
@pytest.mark.parametrize("magnitude", [30.0, 1000.0])
def test_native_softmax_is_stable_with_large_scores(magnitude: float) -> None:
    """Scores far beyond exp's range: the online softmax must neither overflow nor lose keys."""
    torch.manual_seed(1)
    meta = build_metadata([SeqSpec(0, 70, list(range(5))), SeqSpec(99, 1, list(range(5, 12)))], 16)
    hq, hkv, d = 4, 2, 32
    kc = torch.randn(16, 16, hkv, d)
    vc = torch.randn(16, 16, hkv, d)
    q = torch.randn(meta.num_tokens, hq, d) * magnitude
    from tierserve.kernels import reference

    want = reference.paged_attention(q, kc, vc, meta, 0.2)
    got = torch.empty_like(q)
    cpu_ops.paged_attention(
        q, kc, vc, meta, 0.2, got, meta.num_seqs, cpu_ops.AttentionPlan(4, 2)
    )
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@needs_native
def test_dispatch_uses_native_for_fp32_and_torch_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    native = cpu_ops.paged_attention
    fast = torch_attention.paged_attention_fast
    monkeypatch.setattr(
        cpu_ops, "paged_attention", lambda *a, **k: (calls.append("native"), native(*a, **k))[1]
    )
    monkeypatch.setattr(
        torch_attention,
        "paged_attention_fast",
        lambda *a, **k: (calls.append("torch"), fast(*a, **k))[1],
    )
    attend = functools.partial(attention, backend="torch")
    check_against_reference(attend, MIXED, Shape(2, 4, 32), 16, torch.float32, "cpu")
    check_against_reference(attend, MIXED, Shape(2, 4, 32), 16, torch.bfloat16, "cpu")
    monkeypatch.setattr(cpu_native, "enabled", False)
    check_against_reference(attend, MIXED, Shape(2, 4, 32), 16, torch.float32, "cpu")
    assert calls == ["native", "torch", "torch"]


def test_no_compiler_falls_back_to_torch(
    fresh_loader: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CXX", "false")  # a "compiler" that always fails
    assert not cpu_native.available()
    assert "failed" in (cpu_native.unavailable_reason() or "")
    assert "native CPU kernels unavailable" in caplog.text
    q = torch.randn(3, 4, 16)
    assert cpu_ops.attention_plan(q, torch.zeros(4, 16, 2, 16)) is None
    # The dispatch still answers, through torch.
    attend = functools.partial(attention, backend="torch")
    check_against_reference(attend, MIXED, Shape(2, 2, 16), 16, torch.float32, "cpu")


def test_environment_switch_disables_the_kernel(
    fresh_loader: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(cpu_native.ENV_SWITCH, "0")
    assert not cpu_native.available()
    assert cpu_native.unavailable_reason() == f"disabled by {cpu_native.ENV_SWITCH}"
    with pytest.raises(cpu_abi.NativeKernelError, match="unavailable: disabled"):
        cpu_ops.paged_attention(
            torch.zeros(1, 2, 8),
            torch.zeros(2, 16, 2, 8),
            torch.zeros(2, 16, 2, 8),
            build_metadata([SeqSpec(0, 1, [0])], 16),
            1.0,
            torch.zeros(1, 2, 8),
            1,
            cpu_ops.AttentionPlan(1, 1),
        )


def test_build_goes_to_the_cache_and_is_reused(fresh_loader: None, tmp_path: object) -> None:
    if cpu_build.compiler() is None:
        pytest.skip("no C++ compiler")
    assert cpu_native.available(), cpu_native.unavailable_reason()
    from pathlib import Path

    built = sorted(Path(str(tmp_path)).glob("cpu_kernels-*.so"))
    assert len(built) == 1
    assert not list(Path(str(tmp_path)).glob("*.tmp"))  # no leftover of the atomic write
    mtime = built[0].stat().st_mtime_ns
    cpu_native._tried = False
    cpu_native._lib = None
    assert cpu_native.available()
    assert built[0].stat().st_mtime_ns == mtime  # loaded, not rebuilt


def test_two_processes_starting_at_once_compile_once(tmp_path: Path) -> None:
    """Two replicas starting together on a fresh machine: one compiles the library, the other
    waits on the build's lock and loads that build (the compiler runs once)."""
    import os
    import shutil
    import subprocess

    cxx = cpu_build.compiler()
    if cxx is None:
        pytest.skip("no C++ compiler")
    calls = tmp_path / "calls"
    wrapper = tmp_path / "cxx"
    wrapper.write_text(f'#!/bin/sh\necho run >> {calls}\nexec {shutil.which(cxx)} "$@"\n')
    wrapper.chmod(0o755)
    env = {**os.environ, cpu_build.ENV_CACHE: str(tmp_path / "cache"), "CXX": str(wrapper)}
    code = "from tierserve.kernels import cpu_native; print(cpu_native.available())"
    root = Path(__file__).resolve().parents[2]
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=root, env=env,
                              stdout=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300)[0].strip() for p in procs]
    assert outs == ["True", "True"]
    assert calls.read_text().split() == ["run"]
    assert len(list((tmp_path / "cache").glob("cpu_kernels-*.so"))) == 1


@needs_native
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_one_openmp_runtime_in_the_process() -> None:
    """The kernel runs on torch's libgomp thread pool, not a second OpenMP runtime."""
    assert cpu_native.available()
    with open("/proc/self/maps", encoding="utf-8") as f:
        gomps = {line.split()[-1] for line in f if "libgomp" in line}
    assert len(gomps) <= 1, gomps


def _case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, object]:
    meta = build_metadata([SeqSpec(0, 1, [1]), SeqSpec(0, 3, [2])], 16)
    kc = torch.zeros(4, 16, 2, 8)
    return torch.zeros(4, 4, 8), kc, kc.clone(), meta


@needs_native
@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("table_block", "a block table names a block outside the cache"),
        ("negative_block", "a block table names a block outside the cache"),
        ("short_table", "context is longer than its block table"),
        ("row_tile", "too many query vectors|above the kernel's limit"),
        ("heads_per_item", "outside the kernel's limits"),
        ("int64_tables", "must be int32"),
        ("out_shape", "must match the metadata"),
        ("num_seqs", "must match the metadata"),
        ("strided_heads", "contiguous heads"),
        ("bf16", "fp32"),
    ],
)
def test_refusals_say_what_is_wrong(change: str, message: str) -> None:
    """Inconsistent inputs raise before any read out of bounds, and leave ``out`` untouched."""
    q, kc, vc, meta = _case()
    out = torch.full_like(q, 7.0)
    num_seqs, plan = 2, cpu_ops.AttentionPlan(1, 1)
    if change == "table_block":
        meta.block_tables[1, 0] = 4  # the cache has blocks 0..3
    elif change == "negative_block":
        meta.block_tables[0, 0] = -1
    elif change == "short_table":
        meta.seq_lens[1] = 17  # 2 blocks, the table has 1 column
    elif change == "row_tile":
        plan = cpu_ops.AttentionPlan(64, 1)
    elif change == "heads_per_item":
        plan = cpu_ops.AttentionPlan(1, 3)  # not a divisor of the 2 KV heads
    elif change == "int64_tables":
        meta.block_tables = meta.block_tables.long()
    elif change == "out_shape":
        out = torch.zeros(3, 4, 8)
    elif change == "num_seqs":
        num_seqs = 3
    elif change == "strided_heads":
        q = torch.zeros(4, 8, 8)[:, ::2]
    elif change == "bf16":
        q = q.bfloat16()
    with pytest.raises(cpu_abi.NativeKernelError, match=message):
        cpu_ops.paged_attention(q, kc, vc, meta, 1.0, out, num_seqs, plan)  # type: ignore[arg-type]
    if out.shape == q.shape and change != "bf16":
        assert (out == 7.0).all()


@needs_native
def test_plan_takes_all_heads_when_there_is_work_for_every_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    kc = torch.zeros(4, 16, 2, 32)
    assert cpu_ops.attention_plan(torch.zeros(64, 8, 32), kc) == cpu_ops.AttentionPlan(8, 2)
    # A lone decode: one item per KV head, so both threads work.
    assert cpu_ops.attention_plan(torch.zeros(1, 8, 32), kc) == cpu_ops.AttentionPlan(8, 1)
    # 128 query heads never fit one item: per KV head (64 query heads each).
    big = cpu_ops.attention_plan(torch.zeros(64, 128, 32), kc)
    assert big == cpu_ops.AttentionPlan(1, 1)
    assert cpu_ops.attention_plan(torch.zeros(4, 8, 32).bfloat16(), kc) is None


# ----------------------------------------------------------------------------- fused row-wise ops


@needs_native
@pytest.mark.parametrize("rows", [1, 7, 300])
@pytest.mark.parametrize("hidden", [256, 37])
def test_rms_norm_matches_torch(rows: int, hidden: int) -> None:
    from tierserve.replica.models.layers import RMSNorm

    torch.manual_seed(0)
    norm = RMSNorm(hidden, 1e-5)
    norm.weight.data = torch.randn(hidden)
    x = torch.randn(rows, hidden) * 3
    delta = torch.randn(rows, hidden)
    with torch.no_grad():
        cpu_native.enabled = False
        try:
            want = norm(x + delta)
        finally:
            cpu_native.enabled = True
        plain = cpu_ops.rms_norm(x.clone(), norm.weight, 1e-5)
        torch.testing.assert_close(plain, norm.__class__.forward(norm, x), atol=1e-5, rtol=1e-5)
        resid = x.clone()
        got = norm.add_and_norm(resid, delta)  # the native path: adds in place, then norms
    torch.testing.assert_close(resid, x + delta)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@needs_native
@pytest.mark.parametrize("rows", [1, 5, 200])
@pytest.mark.parametrize("inter", [768, 13])
def test_silu_and_mul_matches_torch(rows: int, inter: int) -> None:
    torch.manual_seed(0)
    gate_up = torch.randn(rows, 2 * inter) * 8  # far into both tails of the sigmoid
    gate_up[0, 0], gate_up[0, 1] = -100.0, 100.0
    want = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    torch.testing.assert_close(cpu_ops.silu_and_mul(gate_up), want, atol=1e-5, rtol=1e-5)


@needs_native
@pytest.mark.parametrize("rows", [1, 5, 200])
@pytest.mark.parametrize("inter", [2048, 13])
def test_gelu_tanh_and_mul_matches_torch(rows: int, inter: int) -> None:
    """Gemma's MLP activation: close to torch's tanh-approximated GELU over both tails (where
    exp(2z) overflows and where it vanishes), and a row's bits the same alone as in the batch."""
    torch.manual_seed(0)
    gate_up = torch.randn(rows, 2 * inter) * 6
    gate_up[0, 0], gate_up[0, 1], gate_up[0, 2] = -100.0, 100.0, 0.0
    want = torch.nn.functional.gelu(gate_up[:, :inter], approximate="tanh") * gate_up[:, inter:]
    got = cpu_ops.gelu_tanh_and_mul(gate_up)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    assert got[0, 0] == 0 and got[0, 1] == 100.0 * gate_up[0, inter + 1]
    for r in (0, rows - 1):
        assert torch.equal(cpu_ops.gelu_tanh_and_mul(gate_up[r : r + 1].clone()), got[r : r + 1])
    with pytest.raises(cpu_abi.NativeKernelError, match="even width"):
        cpu_ops.gelu_tanh_and_mul(torch.zeros(2, 7))


@needs_native
@pytest.mark.parametrize("tokens", [1, 9, 150])
def test_rope_store_matches_torch(tokens: int) -> None:
    from tierserve.kernels import reference
    from tierserve.replica.models.layers import RotaryEmbedding, apply_rotary_

    torch.manual_seed(0)
    hq, hkv, d, bs = 8, 2, 32, 16
    rot = RotaryEmbedding(d, 512, 10000.0, None)
    positions = torch.randint(0, 512, (tokens,))
    cos, sin = rot(positions)
    qkv = torch.randn(tokens, hq + 2 * hkv, d)
    slots = torch.randperm(64 * bs)[:tokens]
    kc, vc = torch.zeros(64, bs, hkv, d), torch.zeros(64, bs, hkv, d)
    want = qkv.clone()
    apply_rotary_(want[:, : hq + hkv], cos, sin)
    want_k, want_v = kc.clone(), vc.clone()
    reference.store_kv(want[:, hq : hq + hkv], want[:, hq + hkv :], want_k, want_v, slots)
    cpu_ops.rope_store(qkv, cos, sin, slots, kc, vc, hq)
    torch.testing.assert_close(qkv, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kc, want_k, atol=1e-5, rtol=1e-5)
    assert torch.equal(vc, want_v)  # values are copied, not computed


@needs_native
def test_fused_ops_refuse_bad_inputs() -> None:
    w = torch.ones(8)
    with pytest.raises(cpu_abi.NativeKernelError, match=r"x must be \[4, 8\] with contiguous"):
        cpu_ops.rms_norm(torch.zeros(8, 4).t(), w, 1e-5)
    with pytest.raises(cpu_abi.NativeKernelError, match="weight must be fp32"):
        cpu_ops.rms_norm(torch.zeros(4, 8), torch.ones(7), 1e-5)
    with pytest.raises(cpu_abi.NativeKernelError, match="delta must be fp32"):
        cpu_ops.rms_norm(torch.zeros(4, 8), w, 1e-5, torch.zeros(4, 8).double())
    with pytest.raises(cpu_abi.NativeKernelError, match="even width"):
        cpu_ops.silu_and_mul(torch.zeros(2, 7))
    kc = torch.zeros(4, 16, 2, 8)
    cos = sin = torch.zeros(3, 4)
    qkv = torch.zeros(3, 8, 8)
    with pytest.raises(cpu_abi.NativeKernelError, match="does not hold 3 q heads"):
        cpu_ops.rope_store(qkv, cos, sin, torch.zeros(3, dtype=torch.int64), kc, kc.clone(), 3)
    with pytest.raises(cpu_abi.NativeKernelError, match="slot_mapping must be int64"):
        cpu_ops.rope_store(qkv, cos, sin, torch.zeros(3, dtype=torch.int32), kc, kc.clone(), 4)
    before = qkv.clone()
    with pytest.raises(cpu_abi.NativeKernelError, match="outside the cache"):
        cpu_ops.rope_store(qkv, cos, sin, torch.tensor([0, 64, 1]), kc, kc.clone(), 4)
    assert torch.equal(qkv, before)  # refused before touching anything
    with pytest.raises(cpu_abi.NativeKernelError, match="does not hold 3 q heads"):
        cpu_ops.qk_norm(qkv, w, w, 3, 1e-6)
    with pytest.raises(cpu_abi.NativeKernelError, match="k_weight must be fp32 \\[8\\]"):
        cpu_ops.qk_norm(qkv, w, torch.ones(4), 4, 1e-6)
    with pytest.raises(cpu_abi.NativeKernelError, match="contiguous heads"):
        cpu_ops.qk_norm(torch.zeros(3, 8, 16)[:, :, :8], w, w, 4, 1e-6)
    assert torch.equal(qkv, before)


def _embedded_model_step():  # type: ignore[no-untyped-def]
    """The embedded default model (seed 0) and a step of it on a fixed batch of two sequences
    (fresh zero caches each call) that returns the two sampled rows' logits."""
    from tierserve.replica.models.embedded import build_model
    from tierserve.replica.models.llama import ModelOptions

    torch.manual_seed(0)
    model = build_model(ModelOptions())
    specs = [SeqSpec(0, 40, list(range(3))), SeqSpec(0, 9, [5])]
    meta = build_metadata(specs, 16)
    ids = torch.randint(0, 256, (meta.num_tokens,))
    rows = torch.tensor([39, 48])

    def run() -> torch.Tensor:
        caches = [(torch.zeros(8, 16, 2, 32), torch.zeros(8, 16, 2, 32)) for _ in range(4)]
        return model(ids, meta.positions, caches, meta, rows)

    return model, run


def _on_torch_path(run):  # type: ignore[no-untyped-def]
    """``run()`` with the native kernels switched off (plain torch ops)."""
    cpu_native.enabled = False
    try:
        return run()
    finally:
        cpu_native.enabled = True


@needs_native
def test_model_fast_path_matches_torch_path() -> None:
    """The whole model: native fused ops and attention against plain torch ops, same logits."""
    _, run = _embedded_model_step()
    fast = run()
    plain = _on_torch_path(run)
    torch.testing.assert_close(fast, plain, atol=1e-4, rtol=1e-4)


# ----------------------------------------------------------------------------- linear layers


def _packed_linear(n: int, k: int, bias: bool, seed: int = 0, library_rows: str = "never"):  # type: ignore[no-untyped-def]
    """A default-mode layer packed for the native kernel (by default at every row count: these
    tests are of the kernel, not of the choice between it and the library)."""
    from tierserve.replica.models.layers import Linear

    gen = torch.Generator().manual_seed(seed)
    lin = Linear(k, n, bias)
    lin.weight.data.copy_(torch.randn(n, k, generator=gen))
    if lin.bias is not None:
        lin.bias.data.copy_(torch.randn(n, generator=gen))
    dense = lin.weight.data.clone()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(cpu_calibration.ENV_LIBRARY_ROWS, library_rows)
        assert lin.pack_for_cpu()
    return lin, dense


@needs_native
@pytest.mark.parametrize(
    ("n", "k", "bias"),
    [(40, 24, True), (17, 3, False), (576, 576, False), (960, 64, True), (16, 1, False)],
)
def test_linear_matches_torch(n: int, k: int, bias: bool) -> None:
    """Every row-count remainder (AVX2 tiles of 1..6 rows, AVX-512 ones of 1..12, one and two
    panels), a partial last panel, rows past one row block, a bias, strided rows."""
    lin, dense = _packed_linear(n, k, bias)
    assert lin.weight.shape == (-(-n // 16), k, 16)
    assert torch.equal(lin.dense_weight(), dense)
    gen = torch.Generator().manual_seed(1)
    for m in (0, 1, 2, 3, 4, 5, 6, 7, 11, 12, 13, 23, 24, 25, 97, 200, 500):
        x = torch.randn(m, k, generator=gen)
        got = lin(x)
        assert got.shape == (m, n)
        torch.testing.assert_close(got, F.linear(x, dense, lin.bias), atol=1e-4, rtol=1e-4)
    x = torch.randn(9, 2 * k, generator=gen)[:, ::2]  # rows with a column stride of 2
    torch.testing.assert_close(lin(x), F.linear(x, dense, lin.bias), atol=1e-4, rtol=1e-4)


@needs_native
def test_linear_refuses_bad_inputs() -> None:
    lin, _ = _packed_linear(40, 24, True)
    w = lin.weight.data
    with pytest.raises(cpu_abi.NativeKernelError, match=r"is not \[40 outputs, 23 inputs\]"):
        cpu_ops.linear(torch.zeros(2, 23), w, 40)
    with pytest.raises(cpu_abi.NativeKernelError, match="linear takes fp32 CPU x"):
        cpu_ops.linear(torch.zeros(2, 24, dtype=torch.float64), w, 40)
    with pytest.raises(cpu_abi.NativeKernelError, match=r"bias must be fp32 \[40\]"):
        cpu_ops.linear(torch.zeros(2, 24), w, 40, torch.zeros(39))
    with pytest.raises(cpu_abi.NativeKernelError, match="is not a packed weight of 49"):
        cpu_packing.unpack_linear(w, 49)
    with pytest.raises(cpu_abi.NativeKernelError, match="pack_linear takes an fp32 CPU"):
        cpu_packing.pack_linear(torch.zeros(4, 4, dtype=torch.float16))
    with pytest.raises(cpu_abi.NativeKernelError, match="empty weight"):
        cpu_packing.pack_linear(torch.zeros(0, 4))


def test_linear_packs_only_where_the_kernel_applies(monkeypatch: pytest.MonkeyPatch) -> None:
    from tierserve.replica.models.layers import Linear

    assert Linear(8, 8, deterministic=True).pack_for_cpu()  # the deterministic mode needs it
    assert not Linear(8, 8, dtype=torch.float64).pack_for_cpu()
    with pytest.raises(cpu_native.DeterministicModeUnavailable, match="float32 on CPU"):
        Linear(8, 8, deterministic=True, dtype=torch.float64).pack_for_cpu()
    monkeypatch.setattr(cpu_native, "enabled", False)
    plain = Linear(8, 8)
    assert not plain.pack_for_cpu()
    assert plain.weight.shape == (8, 8) and not plain.packed


@needs_native
def test_linear_portable_build_matches_torch(tmp_path: object) -> None:
    """The kernel's portable loop (CPUs without AVX2/FMA): the source built for plain x86-64."""
    import platform

    if cpu_build.compiler() is None or platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("needs a C++ compiler on x86-64")
    lib = cpu_native.load_variant(
        Path(str(tmp_path)), add=("-march=x86-64",), drop=("-march=native",)
    )
    gen = torch.Generator().manual_seed(2)
    for n, k, m in ((40, 24, 13), (17, 5, 3), (64, 32, 100)):
        w = torch.randn(n, k, generator=gen)
        b = torch.randn(n, generator=gen)
        x = torch.randn(m, k, generator=gen)
        packed = torch.empty(cpu_abi.packed_shape(n, k))
        assert lib.ts_pack_linear_f32(w, n, k, packed, 2) == 0
        assert torch.equal(packed, cpu_packing.pack_linear(w))  # same layout as the vector builds
        y = torch.empty(m, n)
        assert lib.ts_linear_f32(x, k, m, k, packed, n, b, y, n, 2) == 0
        torch.testing.assert_close(y, F.linear(x, w, b), atol=1e-4, rtol=1e-4)
        assert lib.ts_linear_f32(x, k - 1, m, k, packed, n, None, y, n, 2) == -1  # rows overlap


def _has_avx512() -> bool:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return any(line.startswith("flags") and " avx512f" in line for line in f)
    except OSError:
        return False


@needs_native
@pytest.mark.skipif(not _has_avx512(), reason="needs a CPU with AVX-512")
def test_avx512_linear_gives_the_avx2_bits(tmp_path: object) -> None:
    """The AVX-512 micro-kernel (12 rows x 32 outputs) and the AVX2 one (6 x 16) tile
    differently but compute each output as the same FMA chain over k: the same bits, for every
    row remainder, a partial last panel, an odd panel count, a bias, and several row blocks."""
    avx2 = cpu_native.load_variant(Path(str(tmp_path)), add=("-mno-avx512f",))
    gen = torch.Generator().manual_seed(3)
    for n, k, rows in ((40, 24, range(1, 30)), (960, 576, (1, 7, 12, 13, 431, 433, 500))):
        w = torch.randn(n, k, generator=gen)
        b = torch.randn(n, generator=gen)
        packed = cpu_packing.pack_linear(w)
        for m in rows:
            x = torch.randn(m, k, generator=gen)
            want = torch.empty(m, n)
            assert avx2.ts_linear_f32(x, k, m, k, packed, n, b, want, n, 2) == 0
            assert torch.equal(cpu_ops.linear(x, packed, n, b), want), (n, k, m)


@needs_native
@pytest.mark.skipif(not _has_avx512(), reason="needs a CPU with AVX-512")
@pytest.mark.parametrize(
    "shape", [Shape(3, 3, 64), Shape(2, 4, 32), Shape(1, 1, 128), Shape(1, 6, 64)],
    ids=["gqa3-d64", "gqa4-d32", "mha-d128", "gqa6-d64"],
)
def test_attention_avx2_path_on_an_avx512_cpu(tmp_path: object, shape: Shape) -> None:
    """The process's build takes the AVX-512 path (a KV head's query heads together) for these
    head sizes; the same source built without AVX-512 runs the vector-at-a-time AVX2 path that
    AVX2-only CPUs take. Both against the reference, on decodes and chunks, with items of one
    KV head and of all."""
    from tierserve.kernels import reference

    avx2 = cpu_native.load_variant(Path(str(tmp_path)), add=("-mno-avx512f",))

    def run(lib, all_heads):  # type: ignore[no-untyped-def]
        def attend(q, k, v, kc, vc, meta, scale):  # type: ignore[no-untyped-def]
            reference.store_kv(k, v, kc, vc, meta.slot_mapping)
            out = torch.empty_like(q)
            heads = kc.shape[2] if all_heads else 1
            tile = max(1, min(8, 64 // (heads * shape.group)))
            rc = lib.ts_paged_attention_f32(
                q, q.stride(0), kc, vc, meta.block_tables, meta.block_tables.stride(0),
                meta.seq_lens, meta.cu_q_lens, out, out.stride(0), meta.num_seqs,
                shape.q_heads, shape.kv_heads, shape.head_dim, kc.shape[1], kc.shape[0],
                float(scale), 0, 0.0, tile, heads, 2,
            )
            assert rc == 0, rc
            return out

        return attend

    for lib in (avx2, cpu_native.load()):
        for all_heads in (False, True):
            check_against_reference(run(lib, all_heads), MIXED, shape, 16, torch.float32, "cpu")


@needs_native
@pytest.mark.parametrize("k", [576, 4096])
def test_linear_rows_do_not_depend_on_the_row_blocks(k: int) -> None:
    """Rows go in blocks of about 1 MiB of x (432 rows of 576 inputs, 96 of 4096): a row's bits
    do not depend on which block it falls in or how many rows share the call."""
    gen = torch.Generator().manual_seed(4)
    n = 72
    w = torch.randn(n, k, generator=gen) / k**0.5
    packed = cpu_packing.pack_linear(w)
    x = torch.randn(600, k, generator=gen)
    whole = cpu_ops.linear(x, packed, n)
    for start, stop in ((0, 1), (431, 433), (95, 97), (500, 600), (1, 600)):
        assert torch.equal(cpu_ops.linear(x[start:stop], packed, n), whole[start:stop])


@needs_native
def test_packed_model_matches_torch_path(tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """``pack_for_cpu`` on a whole model with tied embeddings: every linear layer packed, the
    LM head its own copy (the embedding keeps its rows), the same logits as plain torch, and a
    packed model refuses to load weights."""
    from tierserve.replica.models.config import ModelLoadError
    from tierserve.replica.models.loader import load_weights

    monkeypatch.setenv(cpu_calibration.ENV_LIBRARY_ROWS, "never")  # the native kernel throughout
    model, run = _embedded_model_step()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    embed = model.model.embed_tokens.weight.data.clone()
    plain = _on_torch_path(run)
    layers = len(model.model.layers)
    assert model.pack_for_cpu() == 4 * layers + 1  # qkv, o, gate_up, down per layer; the head
    assert model.pack_for_cpu() == 0  # already packed
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert torch.equal(model.model.embed_tokens.weight.data, embed)
    assert torch.equal(model.lm_head.dense_weight(), embed)
    torch.testing.assert_close(run(), plain, atol=1e-4, rtol=1e-4)
    with pytest.raises(ModelLoadError, match="packed for the native CPU kernel"):
        load_weights(model, Path(str(tmp_path)))


# ----------------------------------------------------------------------------- native or library


def test_threshold_is_where_the_library_wins_from_then_on() -> None:
    win, lose = cpu_calibration.CLEAR_WIN, cpu_calibration.CLEAR_WIN - 0.01
    rows = cpu_calibration.CALIBRATION_ROWS
    assert len(rows) == 3
    assert cpu_calibration.threshold_from([lose] * 3) is None
    assert cpu_calibration.threshold_from([win] * 3) == rows[0]
    assert cpu_calibration.threshold_from([lose, win, win]) == rows[1]
    # A win below a loss does not count: the library takes every count from its threshold on.
    assert cpu_calibration.threshold_from([win, lose, win]) == rows[2]
    assert cpu_calibration.threshold_from([win, win, lose]) is None


@needs_native
def test_calibration_picks_a_calibrated_count_once_per_shape(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(cpu_calibration, "_library_rows", {})
    w = torch.randn(48, 40)
    packed = cpu_packing.pack_linear(w)
    got = cpu_calibration.library_rows(w, packed)
    assert got is None or got in cpu_calibration.CALIBRATION_ROWS
    monkeypatch.setattr(cpu_calibration, "_calibrate", lambda *a: pytest.fail("timed twice"))
    assert cpu_calibration.library_rows(w, packed) == got  # the same shape: not timed again


@needs_native
def test_calibration_is_kept_for_the_next_start(monkeypatch: pytest.MonkeyPatch,
                                                tmp_path: Path) -> None:
    """A threshold timed once is written beside the library and read back by a later process
    (here: the in-process memo cleared); a damaged or foreign entry is timed again."""
    file = tmp_path / "cpu_kernels.calibration.json"
    monkeypatch.setattr(cpu_calibration, "_calibration_file", lambda: file)
    monkeypatch.setattr(cpu_calibration, "_library_rows", {})
    monkeypatch.setattr(cpu_calibration, "_calibrate", lambda *a: 64)
    w = torch.randn(48, 40)
    packed = cpu_packing.pack_linear(w)
    assert cpu_calibration.library_rows(w, packed) == 64
    stored = json.loads(file.read_text())
    assert list(stored.values()) == [64] and "48x40|threads=" in next(iter(stored))

    monkeypatch.setattr(cpu_calibration, "_library_rows", {})  # a new process
    monkeypatch.setattr(cpu_calibration, "_calibrate", lambda *a: pytest.fail("timed again"))
    assert cpu_calibration.library_rows(w, packed) == 64

    file.write_text(json.dumps({k: 17 for k in stored}))  # not a calibrated row count
    monkeypatch.setattr(cpu_calibration, "_library_rows", {})
    monkeypatch.setattr(cpu_calibration, "_calibrate", lambda *a: None)
    assert cpu_calibration.library_rows(w, packed) is None
    assert list(json.loads(file.read_text()).values()) == [None]
    file.write_text("{not json")
    monkeypatch.setattr(cpu_calibration, "_library_rows", {})
    assert cpu_calibration.library_rows(w, packed) is None  # timed again, the file rewritten
    assert list(json.loads(file.read_text()).values()) == [None]


@needs_native
def test_default_linear_takes_the_library_from_its_threshold(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where the library wins from some row count, the default mode takes it from there on (and
    keeps the [out, in] weight beside the panels); below it, and always in the deterministic
    mode, the native kernel."""
    from tierserve.replica.models.layers import Linear

    calls: list[int] = []
    native = cpu_ops.linear
    monkeypatch.setattr(
        cpu_ops, "linear", lambda x, *a, **k: (calls.append(x.shape[0]), native(x, *a, **k))[1]
    )
    lin, dense = _packed_linear(40, 24, True, library_rows="16")
    assert lin.library is not None and lin.library[0] == 16 and torch.equal(lin.library[1], dense)
    gen = torch.Generator().manual_seed(5)
    for m in (1, 15, 16, 100):
        x = torch.randn(m, 24, generator=gen)
        torch.testing.assert_close(lin(x), F.linear(x, dense, lin.bias), atol=1e-4, rtol=1e-4)
    assert calls == [1, 15]
    det = Linear(24, 40, deterministic=True)
    det.weight.data.normal_()
    assert det.pack_for_cpu() and det.library is None
    det(torch.randn(100, 24))
    assert calls == [1, 15, 100]
    # The library at every row count: the layer stays unpacked (one copy of its weight).
    monkeypatch.setenv(cpu_calibration.ENV_LIBRARY_ROWS, "1")
    plain = Linear(24, 40)
    assert not plain.pack_for_cpu() and not plain.packed and plain.weight.shape == (40, 24)
    monkeypatch.setenv(cpu_calibration.ENV_LIBRARY_ROWS, "sometimes")
    with pytest.raises(ValueError, match="auto, never or a row count"):
        Linear(24, 40).pack_for_cpu()
