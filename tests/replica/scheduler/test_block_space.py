"""FreeListBlocks: the simplest BlockSpace (docs/scheduler.md §6): lowest ids first, all or nothing."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierserve.replica.block_space import Allocation, BlockSpace, FreeListBlocks, NoCapacity


def test_is_a_block_space() -> None:
    fl = FreeListBlocks(16, range(8))
    assert isinstance(fl, BlockSpace)
    assert (fl.block_size, fl.total_blocks, fl.free_blocks) == (16, 8, 8)


def test_lowest_ids_first_whatever_the_order_given() -> None:
    fl = FreeListBlocks(2, [40, 7, 12, 3, 99])
    assert fl.allocate(1, [0, 0, 0]) == Allocation(0)
    assert list(fl.block_table(1)) == [3, 7]
    fl.append_slot(1, 5)
    assert list(fl.block_table(1)) == [3, 7, 12]
    fl.allocate(2, [0])
    assert list(fl.block_table(2)) == [40]
    fl.release(1)
    fl.allocate(3, [0] * 4)
    assert list(fl.block_table(3)) == [3, 7]


def test_allocate_is_all_or_nothing() -> None:
    fl = FreeListBlocks(4, range(3))
    with pytest.raises(NoCapacity):
        fl.allocate(1, [0] * 13)  # 4 blocks
    assert fl.free_blocks == 3 and list(fl.block_table(1)) == []
    fl.allocate(1, [0] * 12)  # exactly 3
    assert fl.free_blocks == 0


def test_append_slot_grows_only_what_is_needed_and_is_all_or_nothing() -> None:
    fl = FreeListBlocks(4, range(4))
    fl.allocate(1, [0] * 3)
    fl.append_slot(1, 4)  # still one block
    assert list(fl.block_table(1)) == [0]
    fl.append_slot(1, 5)
    assert list(fl.block_table(1)) == [0, 1]
    fl.allocate(2, [0] * 8)
    with pytest.raises(NoCapacity):
        fl.append_slot(1, 9)
    assert list(fl.block_table(1)) == [0, 1] and fl.free_blocks == 0


def test_release_returns_every_block() -> None:
    fl = FreeListBlocks(4, range(6))
    fl.allocate(1, [0] * 9)
    fl.allocate(2, [0] * 4)
    assert fl.free_blocks == 2
    fl.release(1)
    assert fl.free_blocks == 5 and list(fl.block_table(1)) == []
    fl.release(1)  # unknown now: nothing happens
    fl.release(2)
    assert fl.free_blocks == 6


def test_double_allocate_is_an_error() -> None:
    fl = FreeListBlocks(4, range(6))
    fl.allocate(1, [0])
    with pytest.raises(ValueError, match="already holds blocks"):
        fl.allocate(1, [0])
    assert fl.free_blocks == 5


@pytest.mark.parametrize("bad", [0, -4])
def test_block_size_must_be_positive(bad: int) -> None:
    with pytest.raises(ValueError, match="block_size must be positive"):
        FreeListBlocks(bad, range(4))


@settings(max_examples=150, deadline=None)
@given(
    st.integers(1, 4),
    st.integers(1, 12),
    st.lists(st.tuples(st.sampled_from("agr"), st.integers(0, 3), st.integers(0, 12)), max_size=60),
)
def test_random_use_keeps_tables_disjoint(
    B: int, total: int, ops: list[tuple[str, int, int]]
) -> None:
    fl = FreeListBlocks(B, range(total))
    held: dict[int, int] = {}  # id -> positions
    for op, rid, n in ops:
        free_before = sorted(set(range(total)) - {b for r in held for b in fl.block_table(r)})
        if op == "a" and rid not in held:
            need = -(-n // B)
            if need > len(free_before):
                with pytest.raises(NoCapacity):
                    fl.allocate(rid, [0] * n)
            else:
                fl.allocate(rid, [0] * n)
                assert list(fl.block_table(rid)) == free_before[:need], "lowest ids first"
                held[rid] = n
        elif op == "g" and rid in held:
            before = list(fl.block_table(rid))
            need = max(0, -(-n // B) - len(before))
            if need > len(free_before):
                with pytest.raises(NoCapacity):
                    fl.append_slot(rid, n)
                assert list(fl.block_table(rid)) == before
            else:
                fl.append_slot(rid, n)
                assert list(fl.block_table(rid)) == before + free_before[:need]
        elif op == "r":
            fl.release(rid)
            held.pop(rid, None)
            assert list(fl.block_table(rid)) == []
        tables = [b for r in held for b in fl.block_table(r)]
        assert len(tables) == len(set(tables)), "a block in two tables"
        assert fl.free_blocks + len(tables) == total
