"""Triton store_kv and paged attention against the plain-torch reference.

The kernels run where ``helpers.triton_devices`` says: on CPU under ``TRITON_INTERPRET=1`` (set by
this folder's conftest before the kernels are imported when there is no GPU), on ``cuda`` when the
kernels are compiled (a GPU host with ``TRITON_INTERPRET=0``); the ``gpu`` tests need the compiled
kernels. The variant tests record launches instead of running them, so they run anywhere.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from tests.kernels.common import LONG_DECODES, MIXED, SCALE, check_against_reference
from tests.kernels.helpers import TRITON_DEVICES, Shape, new_cache, triton_devices
from tierserve.kernels import aot, metadata, reference, triton_attention, triton_kv
from tierserve.kernels.attention import attention
from tierserve.kernels.metadata import AttentionMetadata, SeqSpec, build_metadata

pytestmark = [
    pytest.mark.triton,
    pytest.mark.skipif(
        not (torch.cuda.is_available() or triton_attention.interpreted()),
        reason="Triton needs a CUDA GPU or TRITON_INTERPRET=1",
    ),
]
COMPILED_GPU = torch.cuda.is_available() and not triton_attention.interpreted()
gpu_only = pytest.mark.skipif(not COMPILED_GPU, reason="needs a CUDA GPU with compiled Triton")


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32])
def test_store_kv_matches_reference_with_strided_input_and_skipped_slots(
    block_size: int, dtype: torch.dtype, device: str
) -> None:
    gen = torch.Generator().manual_seed(1)
    shape = Shape(kv_heads=3, group=1, head_dim=24)  # odd head count, non-power-of-two head_dim
    k_cache, v_cache = new_cache(4096, block_size, shape, dtype, device)
    t = 45
    # k and v are column slices of one fused projection output, as a model produces them.
    fused = torch.randn(t, 3 * shape.kv_heads * shape.head_dim, generator=gen).to(dtype).to(device)
    width = shape.kv_heads * shape.head_dim
    k = fused[:, width : 2 * width].view(t, shape.kv_heads, shape.head_dim)
    v = fused[:, 2 * width :].view(t, shape.kv_heads, shape.head_dim)
    slots = (torch.randperm(512 * block_size, generator=gen)[:t] + 3584 * block_size).to(device)
    slots[5] = -1  # padding token: skipped
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    keep = slots >= 0
    reference.store_kv(k[keep], v[keep], ref_k, ref_v, slots[keep])
    triton_kv.store_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache.nan_to_num(9.0), ref_k.nan_to_num(9.0))
    assert torch.equal(v_cache.nan_to_num(9.0), ref_v.nan_to_num(9.0))


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("deterministic", [False, True], ids=["fast", "deterministic"])
def test_triton_attention_matches_reference(
    deterministic: bool, group: int, block_size: int, dtype: torch.dtype, device: str
) -> None:
    """Mixed decodes and chunks, through the dispatch (Triton store, then Triton attention)."""
    attend = functools.partial(attention, backend="triton", deterministic=deterministic)
    shape = Shape(kv_heads=2, group=group, head_dim=32)
    check_against_reference(attend, MIXED, shape, block_size, dtype, device)


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("splits", [1, 2, 4, 16])
@pytest.mark.parametrize("group", [1, 4])
def test_triton_split_kv_decode_matches_reference(group: int, splits: int, device: str) -> None:
    """Flash-decoding: the context split over programs, including splits that get no keys."""

    def attend(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        triton_kv.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        return triton_attention.paged_attention(
            q, k_cache, v_cache, meta, scale, num_kv_splits=splits
        )

    shape = Shape(kv_heads=2, group=group, head_dim=16)
    check_against_reference(attend, LONG_DECODES, shape, 16, torch.float32, device)


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("deterministic", [False, True], ids=["fast", "deterministic"])
@pytest.mark.parametrize("head_dim", [16, 40])
def test_triton_odd_head_dim_and_fp16(deterministic: bool, head_dim: int, device: str) -> None:
    attend = functools.partial(attention, backend="triton", deterministic=deterministic)
    shape = Shape(kv_heads=1, group=3, head_dim=head_dim)
    check_against_reference(attend, [(5, 1), (0, 19)], shape, 16, torch.float16, device)


# Decodes whose contexts span several decode tiles (64 keys), so that a forced split gives each
# split keys and leaves the last one empty, and a prefill chunk after a cached prefix.
REAL_SHAPE_PARTS = [(300, 1), (70, 1), (40, 9)]


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("mode", ["split-4", "deterministic"], ids=["fast-split4", "deterministic"])
@pytest.mark.parametrize(
    ("head_dim", "group"),
    [(64, 3), (128, 4)],
    ids=["smollm2-d64-g3", "d128-g4"],
)
def test_triton_at_real_model_shapes(head_dim: int, group: int, mode: str, device: str) -> None:
    """The GPU configurations' head_dim and grouping (one KV head, few rows) in bf16: the split
    decode path with its combine kernel, the prefill path, the deterministic path."""

    def attend(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        triton_kv.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if mode == "deterministic":
            return triton_attention.paged_attention(
                q, k_cache, v_cache, meta, scale, deterministic=True
            )
        return triton_attention.paged_attention(q, k_cache, v_cache, meta, scale, num_kv_splits=4)

    shape = Shape(kv_heads=1, group=group, head_dim=head_dim)
    check_against_reference(
        attend, REAL_SHAPE_PARTS, shape, 16, torch.bfloat16, device, num_blocks=64
    )


@pytest.mark.parametrize(
    ("cuda", "interpreted", "want"),
    [
        (False, True, ["cpu"]),
        (True, True, ["cpu"]),
        (True, False, ["cuda"]),
        (False, False, []),
    ],
)
def test_triton_devices_never_mix_compiled_kernels_and_cpu_tensors(
    cuda: bool, interpreted: bool, want: list[str]
) -> None:
    assert triton_devices(cuda_available=cuda, interpreted=interpreted) == want


def test_triton_devices_of_this_process() -> None:
    if triton_attention.interpreted():
        assert TRITON_DEVICES == ["cpu"]
    else:
        assert (["cuda"] if torch.cuda.is_available() else []) == TRITON_DEVICES


@pytest.mark.parametrize("splits", [0, 3, 2 * triton_attention.MAX_KV_SPLITS])
def test_triton_rejects_bad_split_count(splits: int) -> None:
    meta = build_metadata([SeqSpec(0, 1, [1])], 16)
    k_cache = torch.zeros(4, 16, 1, 16)
    with pytest.raises(ValueError, match="power of two"):
        triton_attention.paged_attention(
            torch.zeros(1, 1, 16), k_cache, k_cache, meta, SCALE, num_kv_splits=splits
        )


@gpu_only
@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True], ids=["fast", "deterministic"])
def test_triton_block_ids_past_int32_offsets(deterministic: bool) -> None:
    """Block ids whose element offsets exceed 2**31: catches int32 address overflow.

    Each cache is > 4 GiB (2**31 bf16 elements); with the test's copies the peak is ~26 GiB.
    """
    if torch.cuda.get_device_properties(0).total_memory < 40 * 2**30:
        pytest.skip("needs a GPU with >= 40 GiB")
    shape = Shape(kv_heads=8, group=4, head_dim=128)
    block_size = 16
    stride = block_size * shape.kv_heads * shape.head_dim
    num_blocks = (1 << 31) // stride + 2048
    attend = functools.partial(attention, backend="triton", deterministic=deterministic)
    check_against_reference(
        attend, MIXED, shape, block_size, torch.bfloat16, "cuda", num_blocks=num_blocks
    )


# -- compiled variants ------------------------------------------------------------------------


class _Recorder:
    """Stands in for a Triton kernel: records each launch's arguments instead of running it."""

    def __init__(self, name: str, log: list[tuple[str, tuple[Any, ...], dict[str, Any]]]) -> None:
        self.name, self.log = name, log

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
        assert all(g >= 1 for g in grid), f"{self.name}: empty grid {grid}"

        def launch(*args: Any, **kwargs: Any) -> None:
            self.log.append((self.name, args, kwargs))

        return launch


LaunchLog = list[tuple[str, tuple[Any, ...], dict[str, Any]]]


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> Iterator[LaunchLog]:
    log: LaunchLog = []
    monkeypatch.setattr(triton_attention, "_paged_attn_kernel", _Recorder("paged_attn", log))
    monkeypatch.setattr(
        triton_attention, "_combine_splits_kernel", _Recorder("combine_splits", log)
    )
    monkeypatch.setattr(triton_kv, "_store_kv_kernel", _Recorder("store_kv", log))
    yield log


VARIANT_CONFIGS = [
    aot.ServingConfig(64, 3, 16, torch.bfloat16, deterministic=False),  # SmolLM2
    aot.ServingConfig(64, 3, 16, torch.bfloat16, deterministic=True),
    aot.ServingConfig(128, 4, 32, torch.float16, deterministic=False),
    aot.ServingConfig(128, 1, 16, torch.bfloat16, deterministic=False),
    aot.ServingConfig(128, 8, 32, torch.bfloat16, deterministic=True),
    # Gemma 2 (soft-capped, head_dim 256) and a deterministic soft-capped one.
    aot.ServingConfig(256, 2, 16, torch.bfloat16, deterministic=False, softcap=True),
    aot.ServingConfig(128, 2, 16, torch.bfloat16, deterministic=True, softcap=True),
]


def _sweep_batches(block_size: int) -> Iterator[tuple[list[tuple[int, int]], bool]]:
    """(start, q_len) batches of every kind serving makes, and whether q/k/v are fused views.

    Decode counts 0, 1, 2, 16, 17 (the prefill launch's first sequence, 1 and 16 among them);
    contexts from 1 to past several blocks (block tables one block wide, 16 wide, other widths);
    chunks of 2 to 300 tokens at offsets inside and at block edges.
    """
    contexts = [1, 15, block_size, block_size + 1, 255, 1000]
    chunks = [(0, 2), (5, 16), (block_size, 17), (33, 64), (0, 300)]
    for nd in (0, 1, 2, 16, 17):
        for i, ctx in enumerate(contexts):
            decodes = [(max(0, ctx - 1 - j % 3), 1) for j in range(nd)]
            prefills = [chunks[(i + k) % len(chunks)] for k in range(i % 3)]
            if decodes or prefills:
                yield decodes + prefills, (nd + i) % 2 == 1


_STEP_PACKER = getattr(metadata, "StepPacker", None)


# Windows the sweep cycles through (a runtime argument: none of them may add a binary).
_SWEEP_WINDOWS = (None, 1, 7, 16, 300)


def _sweep(config: aot.ServingConfig, device: str = "cpu") -> None:
    """Run ``attention`` (store + attend) over ``_sweep_batches`` on zeros, with and without
    windows, soft-capped where the config says."""
    d, bs, g, dt = config.head_dim, config.block_size, config.group, config.dtype
    hkv, blocks = 2, 128  # 128 blocks hold the longest sweep sequence (1300 positions)
    k_cache = torch.zeros((blocks, bs, hkv, d), dtype=dt, device=device)
    v_cache = torch.zeros_like(k_cache)
    cap = 30.0 if config.softcap else None
    for i, (parts, fused) in enumerate(_sweep_batches(bs)):
        window = _SWEEP_WINDOWS[i % len(_SWEEP_WINDOWS)]
        specs = [SeqSpec(s, n, list(range(blocks))) for s, n in parts]
        meta = build_metadata(specs, bs, device)
        if fused and _STEP_PACKER is not None:
            # The engine's packed step: every index tensor a view into one buffer.
            t = sum(n for _, n in parts)
            meta = _STEP_PACKER(device).pack(specs, bs, [0] * t, list(range(len(specs)))).meta
        t, hq = meta.num_tokens, hkv * g
        if fused:  # column slices of one QKV projection output
            qkv = torch.zeros((t, (hq + 2 * hkv) * d), dtype=dt, device=device)
            q = qkv[:, : hq * d].view(t, hq, d)
            k = qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
            v = qkv[:, (hq + hkv) * d :].view(t, hkv, d)
        else:
            q = torch.zeros((t, hq, d), dtype=dt, device=device)
            k, v = torch.zeros_like(q[:, :hkv]), torch.zeros_like(q[:, :hkv])
        attention(
            q,
            k,
            v,
            k_cache,
            v_cache,
            meta,
            SCALE,
            backend="triton",
            deterministic=config.deterministic,
            window=window,
            softcap=cap,
        )
        if not config.deterministic and meta.num_decodes:
            for splits in (2, 8, triton_attention.MAX_KV_SPLITS):
                triton_attention.paged_attention(
                    q, k_cache, v_cache, meta, SCALE, num_kv_splits=splits, window=window,
                    softcap=cap,
                )


def _config_id(c: aot.ServingConfig) -> str:
    mode = ("det" if c.deterministic else "fast") + ("-softcap" if c.softcap else "")
    return f"d{c.head_dim}-g{c.group}-b{c.block_size}-{str(c.dtype).removeprefix('torch.')}-{mode}"


@pytest.mark.parametrize("arch", [None, 80, 90], ids=["arch-unknown", "sm80", "sm90"])
@pytest.mark.parametrize("config", VARIANT_CONFIGS, ids=_config_id)
def test_batch_shapes_reach_only_the_enumerated_variants(
    config: aot.ServingConfig,
    arch: int | None,
    launches: LaunchLog,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every launch of a sweep of batch shapes maps to a variant ``aot.variants`` lists, so
    ``aot.warmup`` compiles everything serving can launch and nothing compiles in the loop."""
    monkeypatch.setattr(triton_attention, "device_arch", lambda device: arch)
    _sweep(config)
    seen = {aot.launch_key(name, args, kwargs) for name, args, kwargs in launches}
    interpreted = triton_attention.interpreted()
    enumerated = {v.key() for v in aot.variants(config, arch, interpreter=interpreted)}
    unexpected = seen - enumerated
    assert not unexpected, f"{len(unexpected)} launch(es) outside the enumerated variants: " + (
        "; ".join(_diff(k, enumerated) for k in unexpected)
    )
    assert len(launches) > 50
    assert len(seen) <= len(enumerated) == (2 if config.deterministic else 5)
    assert seen == enumerated, "the sweep covers every path"


def _diff(key: tuple[Any, ...], enumerated: set[tuple[Any, ...]]) -> str:
    """Where ``key`` differs from the closest enumerated key of its kernel (for the message)."""
    same = [k for k in enumerated if k[0] == key[0]]
    if not same:
        return f"{key[0]}: no variant of this kernel"
    best = min(same, key=lambda k: sum(a != b for a, b in zip(k[1], key[1], strict=True)))
    names = aot.arg_names(key[0])
    diffs = [
        f"{names[i]}: {b} (enumerated {a})"
        for i, (a, b) in enumerate(zip(best[1], key[1], strict=True))
        if a != b
    ]
    if best[2:] != key[2:]:
        diffs.append(f"options {key[2:]} (enumerated {best[2:]})")
    return f"{key[0]}: " + ", ".join(diffs)


@pytest.mark.parametrize("config", VARIANT_CONFIGS, ids=_config_id)
def test_warmup_launches_every_enumerated_variant(
    config: aot.ServingConfig, launches: LaunchLog
) -> None:
    aot.run_warmup_launches(config, "cpu")
    seen = {aot.launch_key(name, args, kwargs) for name, args, kwargs in launches}
    assert seen == {
        v.key() for v in aot.variants(config, interpreter=triton_attention.interpreted())
    }


def test_warmup_on_cpu_is_a_no_op(launches: LaunchLog) -> None:
    assert aot.warmup(VARIANT_CONFIGS[0], "cpu") == []
    assert launches == []


def test_group_and_split_count_do_not_change_the_variants() -> None:
    """Groups 3 and 4 (one padded size) and any split count share binaries: runtime arguments."""
    base = aot.ServingConfig(128, 3, 16, torch.bfloat16, deterministic=False)
    same = aot.ServingConfig(128, 4, 16, torch.bfloat16, deterministic=False)
    other = aot.ServingConfig(128, 4, 32, torch.bfloat16, deterministic=False)
    keys = [{v.key() for v in aot.variants(c)} for c in (base, same, other)]
    assert keys[0] == keys[1]
    assert len(keys[0] & keys[2]) == 1  # only the combine kernel does not depend on the block size


def test_split_scratch_is_reused_not_reallocated() -> None:
    dev = torch.device("cpu")
    a = triton_attention.split_scratch(dev, "acc", 1000)
    assert triton_attention.split_scratch(dev, "acc", 10) is a
    b = triton_attention.split_scratch(dev, "acc", a.numel() + 1)
    assert b.numel() > a.numel() and triton_attention.split_scratch(dev, "acc", 1000) is b


def _jit_cache_sizes() -> dict[str, int]:
    """How many binaries each kernel's JIT cache holds, over all devices."""
    return {
        name: sum(len(caches[0]) for caches in kernel.device_caches.values())
        for name, kernel in aot.KERNELS.items()
    }


@gpu_only
@pytest.mark.gpu
@pytest.mark.parametrize("config", VARIANT_CONFIGS[:3], ids=_config_id)
def test_nothing_compiles_after_warmup_on_the_gpu(config: aot.ServingConfig) -> None:
    """On a GPU: after ``aot.warmup`` the sweep of batch shapes adds no binary to Triton's cache."""
    assert len(aot.warmup(config, "cuda")) == (2 if config.deterministic else 5)
    before = _jit_cache_sizes()
    _sweep(config, "cuda")
    torch.cuda.synchronize()
    assert _jit_cache_sizes() == before
