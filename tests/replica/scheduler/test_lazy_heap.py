"""LazyHeap: the waiting queue (ds.06), a min-heap with handles and O(1) lazy removal."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierserve.replica.lazy_heap import Handle, LazyHeap


def drain(h: LazyHeap[str]) -> list[str]:
    out = []
    while h:
        out.append(h.pop())
    return out


def test_pops_smallest_key_first_and_peek_does_not_remove() -> None:
    h: LazyHeap[str] = LazyHeap()
    for key, item in [((3, 0), "c"), ((1, 1), "a"), ((2, 2), "b"), ((1, 0), "a0")]:
        h.push(key, item)
    assert len(h) == 4 and h.peek() == "a0" and len(h) == 4
    assert drain(h) == ["a0", "a", "b", "c"]
    assert not h and len(h) == 0 and h.peek() is None
    with pytest.raises(IndexError):
        h.pop()


def test_removed_items_never_pop() -> None:
    h: LazyHeap[str] = LazyHeap()
    handles = {x: h.push((i, i), x) for i, x in enumerate("abcde")}
    assert h.remove(handles["a"]) is True  # the head
    assert h.remove(handles["c"]) is True  # the middle
    assert h.remove(handles["c"]) is False, "a second remove finds nothing"
    assert len(h) == 3 and h.peek() == "b"
    assert sorted(h.items()) == ["b", "d", "e"]
    assert drain(h) == ["b", "d", "e"]


def test_a_popped_handle_cannot_be_removed() -> None:
    h: LazyHeap[str] = LazyHeap()
    first = h.push((0, 0), "x")
    h.push((1, 1), "y")
    assert h.pop() == "x"
    assert h.remove(first) is False and len(h) == 1


def test_remove_is_constant_time_and_compaction_keeps_order() -> None:
    h: LazyHeap[int] = LazyHeap()
    handles = [h.push((k * 7919 % 1000, k), k) for k in range(1000)]
    # Remove all but every tenth: enough dead entries to trigger compaction, several times.
    for k, hd in enumerate(handles):
        if k % 10:
            assert h.remove(hd)
            assert len(h) == 1000 - (k - k // 10)
    assert len(h) == 100
    assert len(h._heap) <= 2 * len(h) + 65, "dead entries are compacted away (memory O(live))"
    assert not any(hd.alive for k, hd in enumerate(handles) if k % 10)
    want = sorted(range(0, 1000, 10), key=lambda k: (k * 7919 % 1000, k))
    out = []
    while h:
        out.append(h.pop())
    assert out == want


def test_handles_compare_by_key_only() -> None:
    assert Handle((1, 2), "z") < Handle((1, 3), "a")
    assert Handle((1, 2), "z") == Handle((1, 2), "a")


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("push"), st.integers(-5, 5)),
            st.tuples(st.just("remove"), st.integers(0, 10_000)),
            st.tuples(st.just("pop"), st.just(0)),
        ),
        max_size=300,
    )
)
def test_matches_a_sorted_list(ops: list[tuple[str, int]]) -> None:
    h: LazyHeap[int] = LazyHeap()
    model: dict[int, tuple[int, int]] = {}  # item -> key, the live ones
    handles: list[Handle[int]] = []
    for seq, (op, arg) in enumerate(ops):
        if op == "push":
            handles.append(h.push((arg, seq), seq))
            model[seq] = (arg, seq)
        elif op == "remove" and handles:
            hd = handles[arg % len(handles)]
            assert h.remove(hd) is (hd.item in model)
            model.pop(hd.item, None)
        elif op == "pop":
            if model:
                best = min(model, key=model.__getitem__)
                assert h.peek() == best
                assert h.pop() == best
                del model[best]
            else:
                assert h.peek() is None
        assert len(h) == len(model) and bool(h) == bool(model)
        assert sorted(h.items()) == sorted(model)
    assert [h.pop() for _ in range(len(model))] == sorted(model, key=model.__getitem__)
