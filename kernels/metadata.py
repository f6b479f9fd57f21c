"""The seam between the runner and the attention kernels: one flat batch of sequences.

The runner lays a step out as one flat token batch: every decode first (one query token each),
then every prefill chunk (its tokens in order). Sequence ``s`` owns query rows
``cu_q_lens[s]:cu_q_lens[s + 1]``; its cache holds ``seq_lens[s]`` positions once this step's K
and V are stored, so its queries sit at positions ``seq_lens[s] - q_len .. seq_lens[s] - 1`` and
each attends causally to every position up to its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


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
    slots: list[int] = []
    positions: list[int] = []
    cu = [0]
    seq_lens: list[int] = []
    q_lens: list[int] = []
    tables: list[list[int]] = []
    for s in seqs:
        if s.q_len <= 0 or s.start < 0:
            raise ValueError(f"bad sequence spec {s}: q_len must be > 0 and start >= 0")
        end = s.start + s.q_len
        need = -(-end // bs)
        table = list(s.block_table[:need])
        if len(table) < need:
            raise ValueError(f"block table has {len(table)} blocks; {end} positions need {need}")
        if s.q_len == 1:
            p = s.start
            slots.append(table[p // bs] * bs + p % bs)
            positions.append(p)
        else:
            slots.extend(slots_for(table, s.start, end, bs))
            positions.extend(range(s.start, end))
        cu.append(cu[-1] + s.q_len)
        seq_lens.append(end)
        q_lens.append(s.q_len)
        tables.append(table)
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
