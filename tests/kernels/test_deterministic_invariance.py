"""Bit-exact invariances of the deterministic paths (the torch backend's native kernel on CPU in
fp32, Triton in the interpreter/GPU).

A request's attention output must not change by one bit with what else shares its batch, where its
blocks sit in the pool, how its prompt was cut into chunks, or whether a token ran as a decode row
or inside a prefill chunk (recompute after preemption). Each scenario starts from a NaN-filled
cache, so a masked key that leaks in would also show up.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.kernels.common import SCALE
from tests.kernels.helpers import (
    DEVICES,
    TRITON_DEVICES,
    Seq,
    Shape,
    assert_close,
    make_step,
    new_cache,
    new_seq,
    random_blocks,
    row_slices,
    store_prefix,
)
from tierserve.kernels import cpu_native, reference
from tierserve.kernels.attention import Backend, attention


def _triton_available() -> bool:
    if torch.cuda.is_available():
        return True
    from tierserve.kernels import triton_attention

    return triton_attention.interpreted()


TRITON_MARKS = [
    pytest.mark.triton,
    pytest.mark.skipif(not _triton_available(), reason="needs CUDA or TRITON_INTERPRET=1"),
]
NATIVE_MARKS = [
    pytest.mark.skipif(
        not cpu_native.available(),
        reason=f"native kernels unavailable: {cpu_native.unavailable_reason()}",
    )
]
CPU = f"CPU capability {torch.backends.cpu.get_cpu_capability()}"
# The deterministic torch backend is the native kernel: fp32 only.
BACKEND_DTYPES = [
    pytest.param("torch", torch.float32, marks=NATIVE_MARKS, id="torch-fp32"),
    pytest.param("triton", torch.float32, marks=TRITON_MARKS, id="triton-fp32"),
    pytest.param("triton", torch.bfloat16, marks=TRITON_MARKS, id="triton-bf16"),
]
NUM_BLOCKS = 4096
SHAPE = Shape(kv_heads=2, group=3, head_dim=16)
# The native kernel's AVX-512 path takes head sizes 32, 64 and 128, a KV head's query heads at a
# time; other head sizes (SHAPE's 16) and AVX2-only CPUs run its vector-at-a-time path.
NATIVE_SHAPES = [
    pytest.param(SHAPE, id="d16", marks=NATIVE_MARKS),
    pytest.param(Shape(kv_heads=3, group=3, head_dim=64), id="gqa3-d64", marks=NATIVE_MARKS),
]


def _run(
    backend: Backend,
    batches: list[list[tuple[Seq, int, int]]],
    block_size: int,
    dtype: torch.dtype,
    device: str,
    shape: Shape = SHAPE,
    window: int | None = None,
    softcap: float | None = None,
) -> list[list[torch.Tensor]]:
    """Run steps in order on one fresh cache (each part's prefix stored first); rows per part."""
    if backend == "torch" and device != "cpu":
        pytest.skip("the deterministic torch path is CPU-only (the GPU's is the Triton kernel)")
    k_cache, v_cache = new_cache(NUM_BLOCKS, block_size, shape, dtype, device)
    stored: set[int] = set()
    outs = []
    for parts in batches:
        for seq, start, _ in parts:
            if id(seq) not in stored:
                store_prefix(seq, start, k_cache, v_cache)
                stored.add(id(seq))
        step = make_step(parts, block_size, device)
        out = attention(
            step.q,
            step.k,
            step.v,
            k_cache,
            v_cache,
            step.meta,
            SCALE,
            backend,
            deterministic=True,
            window=window,
            softcap=softcap,
        )
        outs.append([out[rows] for rows in row_slices(parts)])
    return outs


def _runs_here(backend: Backend, device: str) -> None:
    """The Triton kernels run on ``TRITON_DEVICES`` only (compiled ones never get CPU tensors,
    the interpreter never gets CUDA ones); the native deterministic kernel on the CPU only."""
    if backend == "triton" and device not in TRITON_DEVICES:
        pytest.skip(f"the Triton kernels do not run on {device} in this process")
    if backend == "torch" and device != "cpu":
        pytest.skip("the deterministic torch path is the native CPU kernel")


def _moved(seq: Seq, block_size: int, gen: torch.Generator, taken: set[int]) -> Seq:
    """The same request with its blocks somewhere else in the pool."""
    return dataclasses.replace(seq, blocks=random_blocks(len(seq.blocks), NUM_BLOCKS, gen, taken))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("backend", "dtype"), BACKEND_DTYPES)
def test_alone_vs_in_a_batch_of_eight(backend: Backend, dtype: torch.dtype, device: str) -> None:
    _runs_here(backend, device)
    block_size = 16
    gen = torch.Generator().manual_seed(7)
    taken: set[int] = set()

    def seq(length: int) -> Seq:
        return new_seq(length, SHAPE, block_size, NUM_BLOCKS, dtype, device, gen, taken)

    dec, chunk = seq(41), seq(33)  # the requests under test: a decode at 40, a chunk 20..32
    others = [seq(n) for n in (17, 64, 3, 50, 29, 70)]
    alone = _run(backend, [[(dec, 40, 1)], [(chunk, 20, 13)]], block_size, dtype, device)
    dec2, chunk2 = _moved(dec, block_size, gen, taken), _moved(chunk, block_size, gen, taken)
    batch = [
        (others[0], 16, 1),
        (others[1], 63, 1),
        (dec2, 40, 1),
        (others[2], 2, 1),
        (others[3], 0, 50),
        (chunk2, 20, 13),
        (others[4], 9, 20),
        (others[5], 35, 35),
    ]
    together = _run(backend, [batch], block_size, dtype, device)[0]
    assert torch.equal(alone[0][0], together[2]), f"decode row changed with its batch ({CPU})"
    assert torch.equal(alone[1][0], together[5]), f"chunk rows changed with their batch ({CPU})"
    # And they are right, not just stable.
    k_cache, v_cache = new_cache(NUM_BLOCKS, block_size, SHAPE, dtype, device)
    for s, start, n in batch:
        store_prefix(s, start + n, k_cache, v_cache)
    step = make_step(batch, block_size, device)
    want = reference.paged_attention(step.q, k_cache, v_cache, step.meta, SCALE)
    assert_close(torch.cat(together), want, dtype, "batched rows vs reference")


def _chunked(seq: Seq, length: int, plan: str, companion: Seq) -> list[list[tuple[Seq, int, int]]]:
    """Steps that feed ``seq``'s prompt per ``plan``; a companion request decodes alongside."""
    if plan == "whole":
        cuts = [length]
    elif plan.startswith("chunks-"):
        size = int(plan.removeprefix("chunks-"))
        cuts = [*range(size, length, size), length]
    else:  # "prefill-then-decode": a 20-token chunk, then one decode row per token
        cuts = [20, *range(21, length + 1)]
    steps, start = [], 0
    for i, end in enumerate(cuts):
        n = end - start
        mine = (seq, start, n)
        other = (companion, 10 + i, 1)
        steps.append([mine, other] if n == 1 else [other, mine])
        start = end
    return steps


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("backend", "block_size"),
    # The torch path's tile is the block, so both sizes; the Triton tile is fixed (32 keys), so
    # block 16 (a tile spanning two blocks) is its harder case under the slow interpreter.
    [
        pytest.param("torch", 16, marks=NATIVE_MARKS),
        pytest.param("torch", 32, marks=NATIVE_MARKS),
        pytest.param("triton", 16, marks=TRITON_MARKS),
    ],
)
def test_chunking_and_decode_rows_do_not_change_bits(
    backend: Backend, block_size: int, device: str
) -> None:
    """Whole prompt == chunks of 1 (decode rows), 7, 16 == a chunk then decodes, bit for bit."""
    _runs_here(backend, device)
    _check_chunking(backend, block_size, device, SHAPE)


@pytest.mark.parametrize("block_size", [16, 32])
def test_native_chunking_on_the_grouped_heads_path(block_size: int) -> None:
    """The same on SmolLM2's head layout (3 KV heads of 3 query heads, head_dim 64): on an
    AVX-512 CPU, the kernel's path that runs a KV head's query heads together."""
    if not cpu_native.available():
        pytest.skip(f"native kernels unavailable: {cpu_native.unavailable_reason()}")
    _check_chunking("torch", block_size, "cpu", Shape(kv_heads=3, group=3, head_dim=64))


def _check_chunking(
    backend: Backend,
    block_size: int,
    device: str,
    shape: Shape,
    window: int | None = None,
    softcap: float | None = None,
) -> None:
    dtype = torch.float32 if backend == "torch" else torch.bfloat16
    length = 45
    gen = torch.Generator().manual_seed(3)
    seq = new_seq(length, shape, block_size, NUM_BLOCKS, dtype, device, gen)
    companion = new_seq(
        length + 10, shape, block_size, NUM_BLOCKS, dtype, device, gen, set(seq.blocks)
    )

    def rows(plan: str) -> torch.Tensor:
        steps = _chunked(seq, length, plan, companion)
        outs = _run(backend, steps, block_size, dtype, device, shape, window, softcap)
        mine = [
            next(o for p, o in zip(s, out, strict=True) if p[0] is seq)
            for s, out in zip(steps, outs, strict=True)
        ]
        return torch.cat(mine)

    whole = rows("whole")
    for plan in ("chunks-1", "chunks-7", "chunks-16", "prefill-then-decode"):
        got = rows(plan)
        assert got.shape == whole.shape
        assert torch.equal(got, whole), f"{plan}: rows differ from the whole prefill ({CPU})"
    step = make_step([(seq, 0, length)], block_size, device)
    k_cache, v_cache = new_cache(NUM_BLOCKS, block_size, shape, dtype, device)
    store_prefix(seq, length, k_cache, v_cache)
    want = reference.paged_attention(step.q, k_cache, v_cache, step.meta, SCALE, window, softcap)
    assert_close(whole, want, dtype, "whole prompt vs reference")


def _sharing(base: Seq, blocks: int, own: Seq, block_size: int) -> Seq:
    """``own`` with ``base``'s first ``blocks`` blocks and their K/V: a prompt prefix that the
    prefix cache shares (whole blocks, the same ids in both tables)."""
    n = blocks * block_size
    return Seq(
        own.q,
        torch.cat([base.k[:n], own.k[n:]]),
        torch.cat([base.v[:n], own.v[n:]]),
        base.blocks[:blocks] + own.blocks[blocks:],
    )


@pytest.mark.parametrize("shape", NATIVE_SHAPES)
def test_decode_rows_sharing_a_prefix_do_not_change_bits(shape: Shape) -> None:
    """The native kernel groups the decode rows of sequences whose tables start with the same
    block, to read the shared keys once for all of them: a row's bits are the same alone, with
    its group (nine sharing 5 blocks, more than one item holds), and with other requests and a
    prefill chunk in the batch, and they match the reference."""
    block_size, dtype = 16, torch.float32
    gen = torch.Generator().manual_seed(11)
    taken: set[int] = set()

    def seq(length: int) -> Seq:
        return new_seq(length, shape, block_size, NUM_BLOCKS, dtype, "cpu", gen, taken)

    base = seq(80)
    group = [_sharing(base, 5, seq(80 + 3 * i + (i % 2) * 17), block_size) for i in range(9)]
    alone = [
        _run("torch", [[(s, s.q.shape[0] - 1, 1)]], block_size, dtype, "cpu", shape)[0][0]
        for s in group
    ]
    decodes = [(s, s.q.shape[0] - 1, 1) for s in group]
    together = _run("torch", [decodes], block_size, dtype, "cpu", shape)[0]
    other, chunk = seq(40), seq(60)
    mixed_parts = [decodes[4], (other, 39, 1), *decodes[:4], *decodes[5:], (chunk, 20, 40)]
    mixed = _run("torch", [mixed_parts], block_size, dtype, "cpu", shape)[0]
    for i, want in enumerate(alone):
        assert torch.equal(together[i], want), f"row {i} changed with its group ({CPU})"
    order = [4, 0, 1, 2, 3, 5, 6, 7, 8]
    for pos, i in enumerate(order):
        row = mixed[pos if pos == 0 else pos + 1]
        assert torch.equal(row, alone[i]), f"row {i} changed in a mixed batch ({CPU})"
    k_cache, v_cache = new_cache(NUM_BLOCKS, block_size, shape, dtype, "cpu")
    for s, start, n in mixed_parts:
        store_prefix(s, start + n, k_cache, v_cache)
    step = make_step(mixed_parts, block_size, "cpu")
    want = reference.paged_attention(step.q, k_cache, v_cache, step.meta, SCALE)
    assert_close(torch.cat(mixed), want, dtype, "rows sharing a prefix vs reference")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_deterministic_torch_backend_refuses_what_the_native_kernel_does_not_take(
    dtype: torch.dtype,
) -> None:
    """No silent fallback to a library path: half-precision caches are refused, saying why."""
    gen = torch.Generator().manual_seed(1)
    seq = new_seq(9, SHAPE, 16, 64, dtype, "cpu", gen)
    k_cache, v_cache = new_cache(64, 16, SHAPE, dtype, "cpu")
    step = make_step([(seq, 0, 9)], 16, "cpu")
    with pytest.raises(cpu_native.DeterministicModeUnavailable, match="float32 on CPU"):
        attention(step.q, step.k, step.v, k_cache, v_cache, step.meta, SCALE, deterministic=True)


# -- attention windows ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("window", "softcap"), [(5, None), (20, 4.0)], ids=["w5", "w20-softcap"]
)
@pytest.mark.parametrize(
    ("backend", "shape"),
    [
        pytest.param("torch", SHAPE, marks=NATIVE_MARKS, id="native-d16"),
        pytest.param("torch", Shape(3, 3, 64), marks=NATIVE_MARKS, id="native-gqa3-d64"),
        pytest.param("triton", SHAPE, marks=TRITON_MARKS, id="triton-d16"),
    ],
)
def test_windowed_rows_do_not_change_with_chunking(
    backend: Backend, shape: Shape, window: int, softcap: float | None
) -> None:
    """With a window (inside a block, across blocks) a row's bits are the same whole, in chunks
    of 1, 7 and 16 and as a chunk then decodes: the key runs or tiles a row reads, and its own
    part of each, are fixed by its position and the window alone."""
    device = TRITON_DEVICES[0] if backend == "triton" else "cpu"
    _check_chunking(backend, 16, device, shape, window, softcap)


@pytest.mark.parametrize(
    ("backend", "dtype"),
    [
        pytest.param("torch", torch.float32, marks=NATIVE_MARKS, id="native-fp32"),
        pytest.param("triton", torch.bfloat16, marks=TRITON_MARKS, id="triton-bf16"),
    ],
)
def test_windowed_rows_alone_vs_in_a_batch(backend: Backend, dtype: torch.dtype) -> None:
    """A decode and a chunk with a window of 12: the same bits alone and beside other requests
    (decodes sharing a prefix with it, and chunks whose windows start elsewhere)."""
    device = TRITON_DEVICES[0] if backend == "triton" else "cpu"
    _runs_here(backend, device)
    block_size, window = 16, 12
    gen = torch.Generator().manual_seed(17)
    taken: set[int] = set()

    def seq(length: int) -> Seq:
        return new_seq(length, SHAPE, block_size, NUM_BLOCKS, dtype, device, gen, taken)

    dec, chunk = seq(71), seq(50)
    sharers = [_sharing(dec, 3, seq(60 + 5 * i), block_size) for i in range(3)]
    others = [seq(n) for n in (9, 64, 40)]

    def run(parts: list[tuple[Seq, int, int]]) -> list[torch.Tensor]:
        return _run(backend, [parts], block_size, dtype, device, window=window)[0]

    alone_dec = run([(dec, 70, 1)])[0]
    alone_chunk = run([(chunk, 21, 29)])[0]
    batch = [
        (sharers[0], 59, 1),
        (dec, 70, 1),
        (sharers[1], 64, 1),
        (others[0], 8, 1),
        (sharers[2], 69, 1),
        (others[1], 0, 64),
        (chunk, 21, 29),
        (others[2], 33, 7),
    ]
    together = run(batch)
    assert torch.equal(together[1], alone_dec), f"windowed decode changed with its batch ({CPU})"
    assert torch.equal(together[6], alone_chunk), f"windowed chunk changed with its batch ({CPU})"
    k_cache, v_cache = new_cache(NUM_BLOCKS, block_size, SHAPE, dtype, device)
    for s, start, n in batch:
        store_prefix(s, start + n, k_cache, v_cache)
    step = make_step(batch, block_size, device)
    want = reference.paged_attention(step.q, k_cache, v_cache, step.meta, SCALE, window)
    assert_close(torch.cat(together), want, dtype, "windowed batch vs reference")
