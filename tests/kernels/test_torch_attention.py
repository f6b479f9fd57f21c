"""The CPU paths (native kernel, plain-torch fast, deterministic) against the reference, through
the dispatch. ``native=False`` switches the native kernel off so the torch fast path runs too;
the deterministic mode runs the native kernel (fp32 only)."""

from __future__ import annotations

import functools

import pytest
import torch

from tests.kernels.common import MIXED, check_against_reference
from tests.kernels.helpers import DEVICES, Shape
from tierserve.kernels.attention import attention


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize(
    ("deterministic", "native"),
    [(False, True), (False, False), (True, True)],
    ids=["fast-native", "fast-torch", "deterministic"],
)
def test_torch_paths_match_reference(
    deterministic: bool,
    native: bool,
    group: int,
    block_size: int,
    dtype: torch.dtype,
    device: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from tierserve.kernels import cpu_native

    monkeypatch.setattr(cpu_native, "enabled", native)
    if deterministic and (device != "cpu" or dtype != torch.float32 or not cpu_native.available()):
        pytest.skip("the deterministic torch path is the native CPU kernel (fp32)")
    attend = functools.partial(attention, backend="torch", deterministic=deterministic)
    shape = Shape(kv_heads=2, group=group, head_dim=32)
    check_against_reference(attend, MIXED, shape, block_size, dtype, device)


@pytest.mark.parametrize(
    ("deterministic", "native"),
    [(False, True), (False, False), (True, True)],
    ids=["fast-native", "fast-torch", "deterministic"],
)
@pytest.mark.parametrize("spec", [[(0, 1)], [(7, 1), (33, 1)], [(0, 5)], [(3, 29), (0, 64)]])
def test_torch_paths_decode_only_or_prefill_only(
    deterministic: bool,
    native: bool,
    spec: list[tuple[int, int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from tierserve.kernels import cpu_native

    monkeypatch.setattr(cpu_native, "enabled", native)
    if deterministic and not cpu_native.available():
        pytest.skip("the deterministic torch path is the native CPU kernel")
    attend = functools.partial(attention, backend="torch", deterministic=deterministic)
    check_against_reference(attend, spec, Shape(1, 4, 16), 16, torch.float32, "cpu")
