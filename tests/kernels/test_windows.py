"""Attention windows and soft-capping on every path against the plain-torch reference.

A window W lets the query at position ``i`` see keys ``i - W < j <= i``; soft-capping maps the
scaled scores ``s`` to ``c * tanh(s / c)``. The batches mix decodes and prefill chunks that start
mid-sequence, so windows cut through cached prefixes; the windows lie inside one block, span
blocks, and exceed every context.
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path

import pytest
import torch

from tests.kernels.common import WINDOWED, WINDOWS, check_against_reference
from tests.kernels.helpers import DEVICES, TRITON_DEVICES, Shape, make_step, new_cache, new_seq
from tierserve.kernels import cpu_abi, cpu_build, cpu_native, cpu_ops, reference
from tierserve.kernels.attention import attention
from tierserve.kernels.metadata import AttentionMetadata

NATIVE = pytest.mark.skipif(
    not cpu_native.available(),
    reason=f"native kernels unavailable: {cpu_native.unavailable_reason()}",
)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("window", [None, *WINDOWS])
@pytest.mark.parametrize(
    ("deterministic", "native", "dtype"),
    [
        pytest.param(False, True, torch.float32, marks=NATIVE, id="native"),
        pytest.param(True, True, torch.float32, marks=NATIVE, id="deterministic"),
        pytest.param(False, False, torch.float32, id="torch-fp32"),
        pytest.param(False, False, torch.bfloat16, id="torch-bf16"),
    ],
)
def test_torch_backend_paths_with_windows_and_softcap(
    deterministic: bool,
    native: bool,
    dtype: torch.dtype,
    window: int | None,
    softcap: float | None,
    device: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(cpu_native, "enabled", native)
    if native and device != "cpu":
        pytest.skip("the native kernel is CPU-only")
    attend = functools.partial(attention, backend="torch", deterministic=deterministic)
    shape = Shape(kv_heads=2, group=3, head_dim=32)
    check_against_reference(
        attend, WINDOWED, shape, 16, dtype, device, window=window, softcap=softcap
    )


def test_reference_window_is_the_last_w_positions() -> None:
    """The reference's rule itself, on one row by hand: window 3 at position 5 sees keys 3, 4, 5."""
    gen = torch.Generator().manual_seed(0)
    shape = Shape(kv_heads=1, group=1, head_dim=8)
    seq = new_seq(6, shape, 4, 8, torch.float32, "cpu", gen)
    k_cache, v_cache = new_cache(8, 4, shape, torch.float32, "cpu")
    step = make_step([(seq, 0, 6)], 4, "cpu")
    reference.store_kv(step.k, step.v, k_cache, v_cache, step.meta.slot_mapping)
    got = reference.paged_attention(step.q, k_cache, v_cache, step.meta, 0.5, window=3)
    scores = (seq.q[5, 0] @ seq.k[3:6, 0].T) * 0.5
    want = scores.softmax(-1) @ seq.v[3:6, 0]
    torch.testing.assert_close(got[5, 0], want)
    capped = reference.paged_attention(step.q, k_cache, v_cache, step.meta, 0.5, softcap=0.1)
    scores = torch.tanh((seq.q[5, 0] @ seq.k[:6, 0].T) * 0.5 / 0.1) * 0.1
    torch.testing.assert_close(capped[5, 0], scores.softmax(-1) @ seq.v[:6, 0])


@pytest.mark.parametrize(
    ("window", "softcap", "message"),
    [
        (0, None, "window must be"),
        (-4, None, "window must be"),
        (2.5, None, "window must be"),
        (True, None, "window must be"),
        (None, 0.0, "softcap must be"),
        (None, -1.0, "softcap must be"),
        (None, float("inf"), "softcap must be"),
        (None, float("nan"), "softcap must be"),
    ],
)
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_bad_window_or_softcap_is_refused(
    window: object, softcap: object, message: str, backend: str
) -> None:
    gen = torch.Generator().manual_seed(0)
    shape = Shape(kv_heads=1, group=2, head_dim=16)
    seq = new_seq(5, shape, 16, 8, torch.float32, "cpu", gen)
    k_cache, v_cache = new_cache(8, 16, shape, torch.float32, "cpu")
    step = make_step([(seq, 0, 5)], 16, "cpu")
    with pytest.raises(ValueError, match=message):
        attention(
            step.q,
            step.k,
            step.v,
            k_cache,
            v_cache,
            step.meta,
            0.25,
            backend=backend,  # type: ignore[arg-type]
            window=window,  # type: ignore[arg-type]
            softcap=softcap,  # type: ignore[arg-type]
        )


def _native_attend(lib: cpu_abi.NativeLib | None, row_tile: int, all_heads: bool) -> object:
    """The native kernel with a fixed work split (``lib``: a build variant; None: the process's)."""

    def attend(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kc: torch.Tensor,
        vc: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        reference.store_kv(k, v, kc, vc, meta.slot_mapping)
        out = torch.empty_like(q)
        heads = kc.shape[2] if all_heads else 1
        if lib is None:
            plan = cpu_ops.AttentionPlan(row_tile, heads)
            cpu_ops.paged_attention(
                q, kc, vc, meta, scale, out, meta.num_seqs, plan, window, softcap
            )
            return out
        rc = lib.ts_paged_attention_f32(
            q,
            q.stride(0),
            kc,
            vc,
            meta.block_tables,
            meta.block_tables.stride(0),
            meta.seq_lens,
            meta.cu_q_lens,
            out,
            out.stride(0),
            meta.num_seqs,
            q.shape[1],
            kc.shape[2],
            q.shape[2],
            kc.shape[1],
            kc.shape[0],
            float(scale),
            window or 0,
            softcap or 0.0,
            row_tile,
            heads,
            2,
        )
        assert rc == 0, rc
        return out

    return attend


# The native kernel's paths: AVX-512 with a KV head's query heads together (head_dim 32, 64), the
# vector-at-a-time AVX2 loop (72; and 256, Gemma 3's, at a runtime head_dim), the portable loop
# (20, not a multiple of 8).
NATIVE_SHAPES = [
    Shape(2, 4, 32),
    Shape(3, 3, 64),
    Shape(1, 5, 72),
    Shape(1, 2, 256),
    Shape(2, 2, 20),
]


@NATIVE
@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("window", [3, 20])
@pytest.mark.parametrize(("row_tile", "all_heads"), [(1, False), (8, True)], ids=["1x1", "8xall"])
@pytest.mark.parametrize("shape", NATIVE_SHAPES, ids=lambda s: f"g{s.group}-d{s.head_dim}")
def test_native_paths_with_windows(
    shape: Shape, row_tile: int, all_heads: bool, window: int, softcap: float | None
) -> None:
    attend = _native_attend(
        None, min(row_tile, 64 // (shape.group * (shape.kv_heads if all_heads else 1))), all_heads
    )
    check_against_reference(
        attend,
        WINDOWED,
        shape,
        16,
        torch.float32,
        "cpu",
        window=window,
        softcap=softcap,  # type: ignore[arg-type]
    )


def test_native_refuses_a_negative_window() -> None:
    if not cpu_native.available():
        pytest.skip(f"native kernels unavailable: {cpu_native.unavailable_reason()}")
    gen = torch.Generator().manual_seed(0)
    shape = Shape(kv_heads=1, group=2, head_dim=16)
    seq = new_seq(5, shape, 16, 8, torch.float32, "cpu", gen)
    k_cache, v_cache = new_cache(8, 16, shape, torch.float32, "cpu")
    step = make_step([(seq, 0, 5)], 16, "cpu")
    out = torch.empty_like(step.q)
    plan = cpu_ops.AttentionPlan(1, 1)
    for window, softcap in ((-1, None), (None, -2.0), (None, float("nan"))):
        with pytest.raises(cpu_abi.NativeKernelError, match="negative window, or a softcap"):
            cpu_ops.paged_attention(
                step.q, k_cache, v_cache, step.meta, 0.3, out, 1, plan, window, softcap
            )


@pytest.mark.slow
@pytest.mark.skipif(
    cpu_build.compiler() is None or platform.machine() not in ("x86_64", "AMD64"),
    reason="needs a C++ compiler on x86-64",
)
@pytest.mark.parametrize(
    "flags",
    [(("-mno-avx512f",), ()), (("-march=x86-64",), ("-march=native",))],
    ids=["avx2", "portable"],
)
def test_other_builds_with_windows(
    flags: tuple[tuple[str, ...], tuple[str, ...]], tmp_path: Path
) -> None:
    """The loops other CPUs take (the AVX2 one of an AVX-512 build, the portable one), built from
    the same source, against the reference with windows and soft-capping."""
    lib = cpu_native.load_variant(tmp_path, add=flags[0], drop=flags[1])
    for shape in (Shape(2, 3, 32), Shape(1, 2, 256)):
        for window, softcap in ((3, None), (20, 5.0)):
            attend = _native_attend(lib, 4, False)
            check_against_reference(
                attend,
                WINDOWED,
                shape,
                16,
                torch.float32,
                "cpu",
                window=window,
                softcap=softcap,  # type: ignore[arg-type]
            )


# -- Triton -----------------------------------------------------------------------------------

TRITON = [
    pytest.mark.triton,
    pytest.mark.skipif(not TRITON_DEVICES, reason="Triton needs a CUDA GPU or TRITON_INTERPRET=1"),
]


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("mode", ["fast", "split-4", "deterministic"])
def test_triton_with_windows(mode: str, window: int, softcap: float | None, device: str) -> None:
    """Decode (one launch, and split over 4 programs whose later ones may get no tile of the
    window) and prefill launches, and the deterministic one."""
    from tierserve.kernels import triton_attention, triton_kv

    def attend(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        **kw: object,
    ) -> torch.Tensor:
        triton_kv.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        return triton_attention.paged_attention(
            q,
            k_cache,
            v_cache,
            meta,
            scale,
            deterministic=mode == "deterministic",
            num_kv_splits=4 if mode == "split-4" else None,
            **kw,  # type: ignore[arg-type]
        )

    shape = Shape(kv_heads=2, group=2, head_dim=16)
    check_against_reference(
        attend, WINDOWED, shape, 16, torch.float32, device, window=window, softcap=softcap
    )


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize(("window", "softcap"), [(5, None), (20, 30.0)], ids=["w5", "w20-cap30"])
@pytest.mark.parametrize("mode", ["split-2", "deterministic"])
@pytest.mark.parametrize(
    ("head_dim", "group"), [(64, 3), (128, 4), (256, 2)], ids=["d64-g3", "d128-g4", "d256-g2"]
)
def test_triton_windows_at_model_head_dims(
    head_dim: int, group: int, mode: str, window: int, softcap: float | None, device: str
) -> None:
    """bf16 at the head sizes of the models with windows (Gemma 3's 256 among them): the decode
    launch split in two, the prefill launch after a cached prefix, and the deterministic one."""
    from tierserve.kernels import triton_attention, triton_kv

    def attend(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        **kw: object,
    ) -> torch.Tensor:
        triton_kv.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        det = mode == "deterministic"
        splits = None if det else 2
        return triton_attention.paged_attention(
            q,
            k_cache,
            v_cache,
            meta,
            scale,
            deterministic=det,
            num_kv_splits=splits,
            **kw,  # type: ignore[arg-type]
        )

    shape = Shape(kv_heads=1, group=group, head_dim=head_dim)
    parts = [(70, 1), (33, 1), (30, 9)]
    check_against_reference(
        attend,
        parts,
        shape,
        16,
        torch.bfloat16,
        device,
        num_blocks=64,
        window=window,
        softcap=softcap,
    )


def _poisoned_before_windows(window: int, device: str) -> tuple[object, ...]:
    """A decode at 200 and a chunk at 150..169 whose cache holds NaN at positions 0..127 (whole
    64-key tiles before both windows): a kernel that read those tiles, even masked, would turn
    0 x NaN into NaN."""
    gen = torch.Generator().manual_seed(4)
    shape = Shape(kv_heads=2, group=2, head_dim=32)
    k_cache, v_cache = new_cache(256, 16, shape, torch.float32, device)
    taken: set[int] = set()
    parts = []
    for start, n in ((200, 1), (150, 20)):
        seq = new_seq(start + n, shape, 16, 256, torch.float32, device, gen, taken)
        seq.k[:128] = float("nan")
        seq.v[:128] = float("nan")
        parts.append((seq, start, n))
        meta = make_step([(seq, 0, start)], 16, device).meta
        reference.store_kv(seq.k[:start], seq.v[:start], k_cache, v_cache, meta.slot_mapping)
    step = make_step(parts, 16, device)
    reference.store_kv(step.k, step.v, k_cache, v_cache, step.meta.slot_mapping)
    clean_k, clean_v = k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0)
    want = reference.paged_attention(step.q, clean_k, clean_v, step.meta, 0.3, window)
    return step, k_cache, v_cache, want


@pytest.mark.parametrize(
    ("backend", "mode"),
    [
        pytest.param("torch", "fast", marks=NATIVE, id="native"),
        pytest.param("torch", "deterministic", marks=NATIVE, id="native-deterministic"),
        pytest.param("triton", "fast", marks=TRITON, id="triton"),
        pytest.param("triton", "split-4", marks=TRITON, id="triton-split4"),
        pytest.param("triton", "deterministic", marks=TRITON, id="triton-deterministic"),
    ],
)
def test_tiles_before_the_window_are_not_read(backend: str, mode: str) -> None:
    device = TRITON_DEVICES[0] if backend == "triton" else "cpu"
    window = 20
    step, k_cache, v_cache, want = _poisoned_before_windows(window, device)  # type: ignore[misc]
    if mode == "split-4":
        from tierserve.kernels import triton_attention

        got = triton_attention.paged_attention(
            step.q, k_cache, v_cache, step.meta, 0.3, num_kv_splits=4, window=window
        )
    else:
        got = attention(
            step.q,
            step.k,
            step.v,
            k_cache,
            v_cache,
            step.meta,
            0.3,
            backend=backend,  # type: ignore[arg-type]
            deterministic=mode == "deterministic",
            kv_stored=True,
            window=window,
        )
    assert not got.isnan().any(), "a tile wholly before the window was read"
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.triton
@pytest.mark.skipif(not TRITON_DEVICES, reason="Triton needs a CUDA GPU or TRITON_INTERPRET=1")
def test_triton_paged_attention_checks_its_window_and_softcap() -> None:
    """Called directly (as the benchmarks do), not only through ``attention``."""
    from tierserve.kernels import triton_attention

    gen = torch.Generator().manual_seed(0)
    shape = Shape(kv_heads=1, group=2, head_dim=16)
    seq = new_seq(5, shape, 16, 8, torch.float32, "cpu", gen)
    k_cache, v_cache = new_cache(8, 16, shape, torch.float32, "cpu")
    step = make_step([(seq, 0, 5)], 16, "cpu")
    with pytest.raises(ValueError, match="window must be"):
        triton_attention.paged_attention(step.q, k_cache, v_cache, step.meta, 0.3, window=-2)
    with pytest.raises(ValueError, match="softcap must be"):
        triton_attention.paged_attention(step.q, k_cache, v_cache, step.meta, 0.3, softcap=0.0)
