"""The seam between the runner and the attention kernels: one flat batch of sequences.

The runner lays a step out as one flat token batch: every decode first (one query token each),
then every prefill chunk (its tokens in order). Sequence ``s`` owns query rows
``cu_q_lens[s]:cu_q_lens[s + 1]``; its cache holds ``seq_lens[s]`` positions once this step's K
and V are stored, so its queries sit at positions ``seq_lens[s] - q_len .. seq_lens[s] - 1`` and
each attends causally to every position up to its own.

``build_metadata`` builds the tensors one by one (the reference, and what tests use);
``StepPacker`` builds the same fields, plus the step's token ids and logits rows, as views of one
buffer that reaches the device in one copy from pinned memory (the runner's path).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tierserve.arith import ceil_div, round_up


@dataclass(frozen=True, slots=True)
class SeqSpec:
    """One sequence of a step: ``q_len`` new tokens starting at position ``start``."""

    start: int
    q_len: int
    block_table: Sequence[int]


@dataclass(slots=True)
class AttentionMetadata:
    """Index tensors for one step (all on the batch's device).

    slot_mapping: [T] int64, cache slot (block_id * block_size + offset) of each query token.
    block_tables: [S, max_blocks] int32, each sequence's blocks, padded with 0.
    seq_lens:     [S] int32, positions in the cache after this step's store (start + q_len).
    cu_q_lens:    [S + 1] int32, prefix sums of the query lengths.
    positions:    [T] int64, the position of every query token (for rotary embeddings).
    num_decodes:  the first ``num_decodes`` sequences have exactly one query token each.
    max_q_len, max_seq_len: largest query length and context length (kernel grid sizing).
    block_size:   positions per KV block.
    Host copies (``*_host``) keep the small per-sequence lists for Python-side loops.
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    cu_q_lens: torch.Tensor
    positions: torch.Tensor
    num_decodes: int
    max_q_len: int
    max_seq_len: int
    block_size: int
    seq_lens_host: list[int]
    q_lens_host: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])


def slots_for(block_table: Sequence[int], start: int, end: int, block_size: int) -> list[int]:
    """Cache slots (``block_id * block_size + offset``) of positions ``start .. end``."""
    bs = block_size
    return [block_table[p // bs] * bs + p % bs for p in range(start, end)]


@dataclass(slots=True)
class Layout:
    """A flat batch's per-token cache slots and positions, and per sequence its length, its
    query rows and the block-table prefix its positions use."""

    slots: list[int]
    positions: list[int]
    seq_lens: list[int]
    q_lens: list[int]
    tables: list[Sequence[int]]


def lay_out(seqs: Sequence[SeqSpec], block_size: int) -> Layout:
    """The ``Layout`` of ``seqs``; raises ``ValueError`` on a bad spec or a short block table."""
    bs = block_size
    out = Layout([], [], [], [], [])
    for s in seqs:
        if s.q_len <= 0 or s.start < 0:
            raise ValueError(f"bad sequence spec {s}: q_len must be > 0 and start >= 0")
        end = s.start + s.q_len
        need = ceil_div(end, bs)
        table = s.block_table[:need]
        if len(table) < need:
            raise ValueError(f"block table has {len(table)} blocks; {end} positions need {need}")
        if s.q_len == 1:
            p = s.start
            out.slots.append(table[p // bs] * bs + p % bs)
            out.positions.append(p)
        else:
            out.slots.extend(slots_for(table, s.start, end, bs))
            out.positions.extend(range(s.start, end))
        out.seq_lens.append(end)
        out.q_lens.append(s.q_len)
        out.tables.append(table)
    return out


def build_metadata(
    seqs: Sequence[SeqSpec], block_size: int, device: torch.device | str = "cpu"
) -> AttentionMetadata:
    """Build the index tensors of one flat batch; decodes (q_len == 1) must come first."""
    if not seqs:
        raise ValueError("a step needs at least one sequence")
    num_decodes = 0
    while num_decodes < len(seqs) and seqs[num_decodes].q_len == 1:
        num_decodes += 1
    bs = block_size
    lay = lay_out(seqs, bs)
    slots, positions, seq_lens, q_lens = lay.slots, lay.positions, lay.seq_lens, lay.q_lens
    tables = [list(t) for t in lay.tables]
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    width = max(len(t) for t in tables)
    padded = [t + [0] * (width - len(t)) for t in tables]
    dev = torch.device(device)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64).to(dev, non_blocking=True),
        block_tables=torch.tensor(padded, dtype=torch.int32).to(dev, non_blocking=True),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(dev, non_blocking=True),
        cu_q_lens=torch.tensor(cu, dtype=torch.int32).to(dev, non_blocking=True),
        positions=torch.tensor(positions, dtype=torch.int64).to(dev, non_blocking=True),
        num_decodes=num_decodes,
        max_q_len=max(q_lens),
        max_seq_len=max(seq_lens),
        block_size=block_size,
        seq_lens_host=seq_lens,
        q_lens_host=q_lens,
    )


@dataclass(slots=True)
class PackedStep:
    """One step's integer tensors, every one a view of one buffer (one host-to-device copy)."""

    input_ids: torch.Tensor
    logits_indices: torch.Tensor
    meta: AttentionMetadata


Upload = Callable[[torch.Tensor], torch.Tensor]


class StepPacker:
    """Lays one step's integer inputs (token ids, positions, slot mapping, logits rows, sequence
    lengths, query offsets, block tables) out in one int64 host buffer and moves it to the device
    in one copy; the tensors of the step are views of the copy.

    On CPU (and without ``upload``) the host buffer is the step's own fresh tensor: no copy. On an
    accelerator the host buffer is pinned, kept and grown across steps, and copied with
    ``non_blocking``; before it is rewritten the previous copy is waited for (an event), so a
    step's bytes are never overwritten in flight. ``upload`` replaces that copy (tests count
    transfers with it): it gets the filled host buffer and returns the device tensor.

    Layout, in int64 words: ids ``[T]``, positions ``[T]``, slots ``[T]``, logits rows ``[R]``,
    then int32 pairs: seq_lens ``[S]``, cu_q_lens ``[S + 1]``, block tables ``[S, W]``; every
    section starts on 16 bytes.
    """

    def __init__(self, device: torch.device | str = "cpu", upload: Upload | None = None) -> None:
        self.device = torch.device(device)
        self._upload = upload
        self._copy = upload is not None or self.device.type != "cpu"
        self._host: torch.Tensor | None = None
        self._event: Any = None
        self.transfers = 0

    def _host_buffer(self, words: int) -> torch.Tensor:
        if not self._copy:
            return torch.empty(words, dtype=torch.int64)
        if self._event is not None:
            self._event.synchronize()  # the previous step's copy has read the buffer
            self._event = None
        if self._host is None or self._host.numel() < words:
            size = max(words, 2 * (self._host.numel() if self._host is not None else 0), 1024)
            pin = self._upload is None and self.device.type == "cuda" and torch.cuda.is_available()
            self._host = torch.empty(size, dtype=torch.int64, pin_memory=pin)
        return self._host[:words]

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        if not self._copy:
            return host
        self.transfers += 1
        if self._upload is not None:
            return self._upload(host)
        dev = host.to(self.device, non_blocking=True)
        if self.device.type == "cuda":
            self._event = torch.cuda.Event()
            self._event.record()
        return dev

    def pack(
        self,
        seqs: Sequence[SeqSpec],
        block_size: int,
        input_ids: Sequence[int],
        logits_indices: Sequence[int],
    ) -> PackedStep:
        """The step of ``seqs`` (decodes first, as ``build_metadata`` wants) with its token ids
        ``[T]`` and logits rows ``[R]``; the metadata equals ``build_metadata``'s field by field
        (block tables padded with 0 to the widest sequence)."""
        if not seqs:
            raise ValueError("a step needs at least one sequence")
        bs = block_size
        num_decodes = 0
        while num_decodes < len(seqs) and seqs[num_decodes].q_len == 1:
            num_decodes += 1
        lay = lay_out(seqs, bs)
        slots, positions, seq_lens, q_lens = lay.slots, lay.positions, lay.seq_lens, lay.q_lens
        tables: list[Sequence[int]] = lay.tables
        t, r, n = len(slots), len(logits_indices), len(seqs)
        if len(input_ids) != t:
            raise ValueError(f"{len(input_ids)} token ids for a step of {t} tokens")
        width = max(len(tb) for tb in tables)
        # Every section starts 16-byte aligned: the kernels see the same pointer alignment
        # every step (Triton specializes on it) and may vectorize.
        o_pos, o_slot, o_rows = round_up(t, 2), 2 * round_up(t, 2), 3 * round_up(t, 2)
        base = o_rows + round_up(r, 2)
        o_cu = round_up(n, 4)
        o_tab = o_cu + round_up(n + 1, 4)
        words = base + round_up(o_tab + n * width, 4) // 2
        host = self._host_buffer(words)
        a = host.numpy()
        a[0:t] = input_ids
        a[o_pos : o_pos + t] = positions
        a[o_slot : o_slot + t] = slots
        a[o_rows : o_rows + r] = logits_indices
        i32 = a[base:words].view(np.int32)
        i32[0:n] = seq_lens
        cu = i32[o_cu : o_cu + n + 1]
        cu[0] = 0
        np.cumsum(q_lens, out=cu[1:])
        grid = i32[o_tab : o_tab + n * width].reshape(n, width)
        for i, tb in enumerate(tables):
            k = len(tb)
            grid[i, :k] = tb
            if k < width:
                grid[i, k:] = 0
        dev = self._to_device(host)
        d32 = dev[base:words].view(torch.int32)
        meta = AttentionMetadata(
            slot_mapping=dev[o_slot : o_slot + t],
            block_tables=d32[o_tab : o_tab + n * width].view(n, width),
            seq_lens=d32[0:n],
            cu_q_lens=d32[o_cu : o_cu + n + 1],
            positions=dev[o_pos : o_pos + t],
            num_decodes=num_decodes,
            max_q_len=max(q_lens),
            max_seq_len=max(seq_lens),
            block_size=block_size,
            seq_lens_host=seq_lens,
            q_lens_host=q_lens,
        )
        return PackedStep(dev[0:t], dev[o_rows : o_rows + r], meta)


def validate_window(window: int | None, softcap: float | None) -> None:
    """Raise ``ValueError`` unless ``window`` is None or a positive int and ``softcap`` None or
    a positive finite number."""
    if window is not None and (
        isinstance(window, bool) or not isinstance(window, int) or window < 1
    ):
        raise ValueError(
            f"window must be None (full causal attention) or an int >= 1 (the positions a "
            f"query sees, itself included), got {window!r}"
        )
    if softcap is not None and (
        isinstance(softcap, bool)
        or not isinstance(softcap, (int, float))
        or not math.isfinite(softcap)
        or softcap <= 0
    ):
        raise ValueError(
            f"softcap must be None (no capping) or a finite number > 0, got {softcap!r}"
        )
