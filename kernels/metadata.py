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


def build_metadata(
    seqs: Sequence[SeqSpec], block_size: int, device: torch.device | str = "cpu"
) -> AttentionMetadata:
    """Build the index tensors of one flat batch; decodes (q_len == 1) must come first."""
    if not seqs:
        raise ValueError("a step needs at least one sequence")
    num_decodes = 0
    while num_decodes < len(seqs) and seqs[num_decodes].q_len == 1:
        num_decodes += 1
    slots: list[int] = []
    positions: list[int] = []
    cu = [0]
    seq_lens: list[int] = []
    q_lens: list[int] = []
    max_blocks = 1
    for s in seqs:
        if s.q_len <= 0 or s.start < 0:
            raise ValueError(f"bad sequence spec {s}: q_len must be > 0 and start >= 0")
        end = s.start + s.q_len
        need = -(-end // block_size)
        if len(s.block_table) < need:
            raise ValueError(
                f"block table has {len(s.block_table)} blocks; {end} positions need {need}"
            )
        table = s.block_table
        for p in range(s.start, end):
            slots.append(table[p // block_size] * block_size + p % block_size)
        positions.extend(range(s.start, end))
        cu.append(cu[-1] + s.q_len)
        seq_lens.append(end)
        q_lens.append(s.q_len)
        max_blocks = max(max_blocks, need)
    tables = torch.zeros((len(seqs), max_blocks), dtype=torch.int32)
    for i, s in enumerate(seqs):
        need = -(-seq_lens[i] // block_size)
        tables[i, :need] = torch.tensor(list(s.block_table[:need]), dtype=torch.int32)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=tables.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        cu_q_lens=torch.tensor(cu, dtype=torch.int32, device=device),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        num_decodes=num_decodes,
        max_q_len=max(q_lens),
        max_seq_len=max(seq_lens),
        block_size=block_size,
        seq_lens_host=seq_lens,
        q_lens_host=q_lens,
    )
