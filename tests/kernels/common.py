"""The mixed-batch scenario every attention path is checked on against the reference."""

from __future__ import annotations

from collections.abc import Callable

import torch

from tests.kernels.helpers import Shape, assert_close, make_step, new_cache, new_seq, store_prefix
from tierserve.kernels import reference

# (q, k, v, k_cache, v_cache, meta, scale, [window=, softcap=]) -> out
AttendFn = Callable[..., torch.Tensor]

# (start, q_len): decodes first (a 1-token prompt, contexts inside, at and across block edges),
# then prefill chunks (a whole prompt, a chunk starting and ending inside blocks, a long one).
MIXED = [(0, 1), (16, 1), (40, 1), (130, 1), (0, 37), (20, 13), (45, 30)]
LONG_DECODES = [(299, 1), (64, 1), (511, 1), (2, 1)]
SCALE = 0.37
# Windowed batches (decodes first): windows cut through cached prefixes and chunks that start
# mid-sequence; with WINDOWS, a window inside one block, one spanning blocks, one longer than
# every context here.
WINDOWED = [(0, 1), (5, 1), (40, 1), (130, 1), (0, 23), (20, 13), (45, 30)]
WINDOWS = (3, 20, 1000)


def check_against_reference(
    attend: AttendFn,
    parts_spec: list[tuple[int, int]],
    shape: Shape,
    block_size: int,
    dtype: torch.dtype,
    device: str,
    num_blocks: int = 4096,
    seed: int = 0,
    window: int | None = None,
    softcap: float | None = None,
) -> None:
    """Store prefixes, run ``attend`` (which stores this step's K/V), compare with the reference.

    A ``window`` or ``softcap`` is passed to ``attend`` as a keyword (only when set) and to the
    reference."""
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache = new_cache(num_blocks, block_size, shape, dtype, device)
    taken: set[int] = set()
    parts = []
    for start, n in parts_spec:
        seq = new_seq(start + n, shape, block_size, num_blocks, dtype, device, gen, taken)
        store_prefix(seq, start, k_cache, v_cache)
        parts.append((seq, start, n))
    step = make_step(parts, block_size, device)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    extra = {name: x for name, x in (("window", window), ("softcap", softcap)) if x is not None}
    out = attend(step.q, step.k, step.v, k_cache, v_cache, step.meta, SCALE, **extra)
    reference.store_kv(step.k, step.v, ref_k, ref_v, step.meta.slot_mapping)
    want = reference.paged_attention(step.q, ref_k, ref_v, step.meta, SCALE, window, softcap)
    assert out.dtype == dtype and out.shape == step.q.shape
    assert not out.isnan().any(), "a masked or never-written key leaked into the result"
    assert_close(out, want, dtype, "vs reference")
    # The step's K/V landed where the reference puts them (NaN elsewhere compares equal too).
    assert torch.equal(k_cache.nan_to_num(123.0), ref_k.nan_to_num(123.0))
    assert torch.equal(v_cache.nan_to_num(123.0), ref_v.nan_to_num(123.0))
