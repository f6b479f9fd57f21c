"""Ahead-of-time compilation of every Triton kernel variant for sm_80 and sm_90, on CPU.

No GPU needed: ``tierserve.kernels.aot`` compiles each variant the CI configurations can reach (head_dim 64,
128 and 256, 1 to 8 query heads per KV head, blocks of 16 and 32, bf16 and fp16, fast and
deterministic, and with soft-capped scores at head_dim 128 and 256) to a cubin with Triton's bundled ``ptxas``, in subprocesses without
``TRITON_INTERPRET`` (this test process has it on). A variant fails on a compile error, on any
register spill, or on more shared memory per block than the architecture allows.
"""

from __future__ import annotations

import inspect
import os

import pytest
import torch

from tierserve.kernels import aot, fused, triton_attention, triton_kv
from tierserve.kernels import lora as tlora
from tierserve.kernels import moe as tmoe

CAN_COMPILE, WHY_NOT = aot.can_compile()
pytestmark = [
    pytest.mark.triton,
    pytest.mark.skipif(not CAN_COMPILE, reason=f"cannot compile for CUDA here: {WHY_NOT}"),
]
JOBS = max(1, min(4, os.cpu_count() or 1))


def _assert_clean(reports: list[aot.CompileReport]) -> None:
    problems = [p for r in reports for p in r.problems()]
    assert not problems, f"{len(problems)} problem(s):\n" + "\n".join(problems)


def test_matrix_covers_every_kernel_of_the_gpu_path() -> None:
    """Each ``@triton.jit`` kernel of triton_attention, triton_kv and fused is in
    ``aot.KERNELS`` and in the CI work (a new kernel cannot skip the compile check)."""
    defined = {
        obj
        for module in (triton_attention, triton_kv, fused, tmoe, tlora)
        for _, obj in inspect.getmembers(module)
        if type(obj).__name__ in ("JITFunction", "InterpretedFunction")
    }
    registered = set(aot.KERNELS.values())
    assert defined == registered, f"kernels missing from aot.KERNELS: {defined - registered}"
    attention = {"paged_attn", "combine_splits", "store_kv"}
    for arch in aot.CI_ARCHS:
        ci = aot.variants_for(aot.ci_configs(), arch)
        assert {v.kernel for v in ci} == attention
        # Small: 5 binaries per (head_dim, block, dtype) plus a combine per (head_dim, dtype);
        # soft-capping adds its 4 attention binaries per (head_dim, block, dtype) where on.
        dims, capped = len(aot.CI_HEAD_DIMS), len(aot.CI_SOFTCAP_HEAD_DIMS)
        assert len(ci) == dims * 2 * 2 * 5 + dims * 2 + capped * 2 * 2 * 4
        assert {dict(v.constexprs)["HEAD_DIM"] for v in ci if v.kernel == "paged_attn"} >= {
            64,
            128,
            256,
        }
        assert any(dict(v.constexprs).get("SOFTCAP") for v in ci)
    assert {v.kernel for v, _ in aot.ci_work()} == set(aot.KERNELS)
    # The fused kernels: two norms per (hidden, dtype), a rope+store per (shape, block, dtype),
    # with the q/k norm (Qwen3) at the shapes that have one.
    shapes = aot.CI_MODEL_SHAPES
    hiddens = {s[0] for s in shapes}
    fused_ci = aot.ci_fused_variants()
    assert len(fused_ci) == 2 * len(hiddens) * 2 + len(shapes) * 2 * 2
    normed = [v for v in fused_ci if v.kernel == "rope_store" and dict(v.constexprs)["QK_NORM"]]
    assert len(normed) == sum(s[4] for s in shapes) * 2 * 2 > 0
    # The mixture-of-experts kernels: gate/up and down, in two tilings, per dtype.
    assert len(aot.ci_moe_variants()) == 2 * 2 * len(aot.CI_DTYPES)
    # The batched LoRA kernels: shrink and expand per rank block, per dtype.
    assert len(aot.ci_lora_variants()) == 2 * len(tlora.CI_RANK_BLOCKS) * len(aot.CI_DTYPES)


def test_the_lora_kernels_compile_cleanly_for_sm90_and_sm80() -> None:
    """Shrink and expand at both CI rank blocks, bf16, on both CI architectures: no spills."""
    work = [v for r in tlora.CI_RANK_BLOCKS for v in aot.lora_variants(torch.bfloat16, r)]
    reports = aot.compile_all(work, list(aot.CI_ARCHS), jobs=JOBS)
    print("\n" + aot.summarize(reports))
    _assert_clean(reports)


def test_the_moe_kernels_compile_cleanly_for_sm90_and_sm80() -> None:
    """Both mixture-of-experts kernels in both tilings, bf16, on both CI architectures."""
    reports = aot.compile_all(aot.moe_variants(torch.bfloat16), list(aot.CI_ARCHS), jobs=JOBS)
    print("\n" + aot.summarize(reports))
    _assert_clean(reports)


def test_reports_flag_spills_and_shared_memory_over_the_limit() -> None:
    variant = aot.variants(aot.ServingConfig(64, 1, 16, torch.bfloat16, True))[0]
    ok = aot.CompileReport(variant, 90, n_regs=40, n_spills=0, spill_loads=0, stack=0, shared=0)
    assert ok.problems() == []
    spilled = aot.CompileReport(variant, 90, n_regs=255, n_spills=8, spill_loads=8, shared=0)
    assert "spills" in spilled.problems()[0]
    big = aot.CompileReport(variant, 80, n_regs=64, n_spills=0, spill_loads=0, shared=200_000)
    assert "shared memory" in big.problems()[0]
    assert not aot.CompileReport(
        variant, 90, n_regs=64, n_spills=0, spill_loads=0, shared=200_000
    ).problems()
    failed = aot.CompileReport(variant, 90, error="CompilationError: boom")
    assert "compile error" in failed.problems()[0]


def test_one_configuration_compiles_cleanly_for_sm90() -> None:
    """The quick subset: SmolLM2's shape (head_dim 64, 3 query heads per KV head), every path."""
    config = aot.ServingConfig(64, 3, 16, torch.bfloat16, deterministic=False)
    reports = aot.compile_all(aot.variants(config, 90), [90], jobs=JOBS)
    _assert_clean(reports)
    assert all(r.n_regs > 0 and r.seconds > 0 for r in reports)


@pytest.fixture(scope="module")
def matrix() -> list[aot.CompileReport]:
    return aot.compile_pairs(aot.ci_work(), jobs=JOBS)


@pytest.mark.slow
@pytest.mark.parametrize("arch", aot.CI_ARCHS)
def test_every_variant_compiles_without_spills_within_shared_memory(
    arch: int, matrix: list[aot.CompileReport]
) -> None:
    reports = [r for r in matrix if r.arch == arch]
    assert len(reports) == len(aot.variants_for(aot.ci_configs(), arch)) + len(
        aot.ci_fused_variants()) + len(aot.ci_moe_variants()) + len(aot.ci_lora_variants())
    print("\n" + aot.summarize(reports))
    _assert_clean(reports)
