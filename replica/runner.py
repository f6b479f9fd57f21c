"""Turns one ``ScheduleOutput`` into one flat batch, one forward pass, and the sampled rows' logits.

The batch lays out every decode first (one token at position ``n - 1``), then every prefill chunk
(its tokens in order), each with its own start position and block table. Only the rows that are
sampled (every decode, and the last token of every last chunk) reach the output head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from kernels import cpu_native
from kernels.metadata import AttentionMetadata, SeqSpec, build_metadata
from replica.block_space import RequestId
from replica.kv_pool import KVPool
from replica.scheduler import ScheduleOutput, Scheduler


class CausalLM(Protocol):
    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor: ...


@dataclass(slots=True)
class ForwardBatch:
    """One step's flat batch. ``sampled`` names the request of each row of ``logits_indices``."""

    input_ids: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    sampled: list[RequestId]


@dataclass(slots=True)
class RunnerOutput:
    """``logits[i]`` (fp32) is the next-token distribution of request ``ids[i]``."""

    ids: list[RequestId]
    logits: torch.Tensor


class ModelRunner:
    """Owns the model and the KV pool of one replica; stateless across steps otherwise."""

    def __init__(self, model: CausalLM, pool: KVPool, device: torch.device | str = "cpu") -> None:
        self.model = model
        self.pool = pool
        self.device = torch.device(device)
        if self.device.type == "cpu" and cpu_native.available():
            # The native kernels are built (or loaded) now, not inside the first request's step;
            # the linear layers move to their packed layout (weights are loaded by now).
            pack = getattr(model, "pack_for_cpu", None)
            if pack is not None:
                pack()

    def build_batch(self, plan: ScheduleOutput, scheduler: Scheduler) -> ForwardBatch:
        """The flat batch of ``plan``: decodes, then chunks; raises on an empty plan."""
        blocks = scheduler.blocks
        ids: list[int] = []
        specs: list[SeqSpec] = []
        rows: list[int] = []
        sampled: list[RequestId] = []
        for rid in plan.decode:
            toks = scheduler.tokens(rid)
            if toks is None:
                raise KeyError(f"request {rid} is scheduled but unknown to the scheduler")
            n = len(toks)
            ids.append(toks[n - 1])
            specs.append(SeqSpec(n - 1, 1, blocks.block_table(rid)))
            rows.append(len(ids) - 1)
            sampled.append(rid)
        for c in plan.prefill:
            toks = scheduler.tokens(c.id)
            if toks is None:
                raise KeyError(f"request {c.id} is scheduled but unknown to the scheduler")
            ids.extend(toks[c.start : c.start + c.len])
            specs.append(SeqSpec(c.start, c.len, blocks.block_table(c.id)))
            if c.last:
                rows.append(len(ids) - 1)
                sampled.append(c.id)
        meta = build_metadata(specs, self.pool.block_tokens, self.device)
        return ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64).to(self.device, non_blocking=True),
            meta=meta,
            logits_indices=torch.tensor(rows, dtype=torch.int64).to(self.device, non_blocking=True),
            sampled=sampled,
        )

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> RunnerOutput:
        logits = self.model(
            batch.input_ids,
            batch.meta.positions,
            self.pool.kv_caches,
            batch.meta,
            batch.logits_indices,
        )
        return RunnerOutput(batch.sampled, logits.float())

    def execute(self, plan: ScheduleOutput, scheduler: Scheduler) -> RunnerOutput:
        """Build the batch of ``plan`` and run it; an empty plan gives no rows."""
        if plan.is_empty:
            return RunnerOutput([], torch.empty(0))
        return self.forward(self.build_batch(plan, scheduler))
