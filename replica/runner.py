"""Turns one ``ScheduleOutput`` into one flat batch, one forward pass, and the sampled rows' logits.

The batch lays out every decode first (one token at position ``n - 1``), then every prefill chunk
(its tokens in order), each with its own start position and block table. Only the rows that are
sampled (every decode, and the last token of every last chunk) reach the output head.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
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


@dataclass(frozen=True, slots=True)
class PromptRows:
    """``count`` rows of a request's prompt whose logits are wanted (prompt log-probabilities):
    positions ``first .. first + count - 1``, each predicting the prompt token after it."""

    id: RequestId
    first: int
    count: int


@dataclass(slots=True)
class ForwardBatch:
    """One step's flat batch. The first ``len(sampled)`` rows of ``logits_indices`` are the
    sampled rows (``sampled`` names each one's request); then the rows of ``prompt_rows``."""

    input_ids: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    sampled: list[RequestId]
    prompt_rows: list[PromptRows] = field(default_factory=list)


@dataclass(slots=True)
class RunnerOutput:
    """``logits[i]`` (fp32) is the next-token distribution of request ``ids[i]``;
    ``prompt_logits`` (fp32) those of the batch's ``prompt_rows``, in order (None: none asked)."""

    ids: list[RequestId]
    logits: torch.Tensor
    prompt_logits: torch.Tensor | None = None


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

    def build_batch(
        self,
        plan: ScheduleOutput,
        scheduler: Scheduler,
        prompt_logits_for: Collection[RequestId] = (),
    ) -> ForwardBatch:
        """The flat batch of ``plan``: decodes, then chunks; raises on an empty plan. For the
        requests in ``prompt_logits_for``, the rows of their prompt tokens in this step's chunks
        reach the output head too (each but the prompt's last, which is sampled)."""
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
        extra: list[int] = []
        prompt_rows: list[PromptRows] = []
        for c in plan.prefill:
            toks = scheduler.tokens(c.id)
            if toks is None:
                raise KeyError(f"request {c.id} is scheduled but unknown to the scheduler")
            base = len(ids)
            ids.extend(toks[c.start : c.start + c.len])
            specs.append(SeqSpec(c.start, c.len, blocks.block_table(c.id)))
            if c.last:
                rows.append(len(ids) - 1)
                sampled.append(c.id)
            if c.id in prompt_logits_for:
                prompt_len = scheduler.prompt_len(c.id) or 0
                count = min(c.start + c.len, prompt_len - 1) - c.start
                if count > 0:
                    extra.extend(range(base, base + count))
                    prompt_rows.append(PromptRows(c.id, c.start, count))
        meta = build_metadata(specs, self.pool.block_tokens, self.device)
        return ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64).to(self.device, non_blocking=True),
            meta=meta,
            logits_indices=torch.tensor(rows + extra, dtype=torch.int64).to(
                self.device, non_blocking=True
            ),
            sampled=sampled,
            prompt_rows=prompt_rows,
        )

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> RunnerOutput:
        logits = self.model(
            batch.input_ids,
            batch.meta.positions,
            self.pool.kv_caches,
            batch.meta,
            batch.logits_indices,
        ).float()
        n = len(batch.sampled)
        if not batch.prompt_rows:
            return RunnerOutput(batch.sampled, logits)
        return RunnerOutput(batch.sampled, logits[:n], logits[n:])
