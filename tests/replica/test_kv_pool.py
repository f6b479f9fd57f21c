"""The KV pool's memory: zeroed, aligned, one tensor per layer and per K/V, and refused when empty."""

from __future__ import annotations

import pytest
import torch

from tierserve.replica.kv_pool import ALIGN_BYTES, KVPool, KVShape, zeroed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_zeroed_is_zero_aligned_and_writable(dtype: torch.dtype) -> None:
    dims = (7, 16, 3, 64)
    t = zeroed(dims, dtype, torch.device("cpu"))
    assert t.shape == dims and t.dtype == dtype and t.is_contiguous()
    assert t.data_ptr() % ALIGN_BYTES == 0
    assert not t.any()
    t[3, 5] = 1.5
    assert t.sum().item() == pytest.approx(1.5 * 3 * 64)
    assert not t[:3].any() and not t[4:].any()  # nothing beyond the written rows changed


def test_the_pool_holds_separate_zeroed_tensors_per_layer_and_kind() -> None:
    shape = KVShape(layers=3, kv_heads=2, head_dim=8, block_size=4, dtype=torch.float32)
    pool = KVPool(shape, num_blocks=5)
    assert len(pool.kv_caches) == 3
    tensors = [t for pair in pool.kv_caches for t in pair]
    assert len({t.data_ptr() for t in tensors}) == 6
    for t in tensors:
        assert t.shape == (5, 4, 2, 8) and not t.any() and t.data_ptr() % ALIGN_BYTES == 0
    pool.kv_caches[0][0].fill_(2.0)
    assert all(not t.any() for t in tensors[1:])
    assert pool.nbytes == 5 * shape.block_bytes == sum(t.numel() * 4 for t in tensors)


def test_a_pool_without_blocks_is_refused() -> None:
    shape = KVShape(layers=1, kv_heads=1, head_dim=8, block_size=4, dtype=torch.float32)
    with pytest.raises(ValueError, match="num_blocks must be positive, got 0"):
        KVPool(shape, num_blocks=0)


def _rss_bytes() -> int:
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Rss:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no Rss line in /proc/self/smaps_rollup")


def test_zeroed_reserves_its_memory_at_once_unless_told_not_to() -> None:
    dims = (512, 16, 4, 64)  # 8 MiB of fp32
    nbytes = 512 * 16 * 4 * 64 * 4
    before = _rss_bytes()
    lazy = zeroed(dims, torch.float32, torch.device("cpu"), populate=False)
    assert _rss_bytes() - before < nbytes // 2  # mapped, not yet resident
    before = _rss_bytes()
    eager = zeroed(dims, torch.float32, torch.device("cpu"))
    assert _rss_bytes() - before >= nbytes * 9 // 10  # resident before the first write
    for t in (lazy, eager):
        assert not t.any() and t.data_ptr() % ALIGN_BYTES == 0
        t[-1] = 3.0  # the last element of the mapping is writable
        assert t.sum().item() == pytest.approx(3.0 * 16 * 4 * 64)


def test_zeroed_of_no_elements_is_an_empty_tensor() -> None:
    t = zeroed((0, 16, 2, 8), torch.float32, torch.device("cpu"))
    assert t.shape == (0, 16, 2, 8) and t.numel() == 0


def test_zeroed_touches_every_page_where_the_kernel_cannot_populate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import tierserve.replica.kv_pool as kv_pool

    monkeypatch.setattr(kv_pool, "_MADV_POPULATE_WRITE", -1)  # refused with EINVAL, as by an old kernel
    dims = (512, 16, 4, 64)
    nbytes = 512 * 16 * 4 * 64 * 4
    before = _rss_bytes()
    t = zeroed(dims, torch.float32, torch.device("cpu"))
    assert _rss_bytes() - before >= nbytes * 9 // 10
    assert not t.any()
