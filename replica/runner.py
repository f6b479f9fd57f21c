"""Turns one ``StepPlan`` into one flat batch, one forward pass, and the sampled rows' logits.

The batch lays out every decode first (one token at position ``n - 1``), then every prefill chunk
(its tokens in order), each with its own start position and block table. Only the rows that are
sampled (every decode, and the last token of every last chunk) reach the output head.

A step's integer inputs travel to the device in one copy from one pinned buffer
(``tierserve.kernels.metadata.StepPacker``; on CPU, no copy). On CUDA with the triton backend, a
pure-decode step runs as a captured CUDA graph of its bucketed batch size
(``tierserve.replica.cuda_graph``) unless ``enforce_eager``; every other step runs eagerly.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

import torch

from tierserve.kernels import cpu_packing
from tierserve.kernels.metadata import AttentionMetadata, SeqSpec, StepPacker
from tierserve.records import RequestId
from tierserve.replica.config import CONTEXT_CAP
from tierserve.replica.cuda_graph import DecodeGraphs, GraphStep
from tierserve.replica.kv_pool import KVPool, StepModel
from tierserve.replica.lora import LoRABatch, LoRAManager
from tierserve.replica.scheduler import StepPlan

log = logging.getLogger(__name__)


CausalLM = StepModel  # what the runner runs: one forward over a flat batch


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
    # A pure-decode step staged in ``DecodeGraphs``' static buffers (the tensors above are views
    # of them, valid until the next step is built); None: an eager step.
    graph: GraphStep | None = None
    # The rows' LoRA adapters by slot (``tierserve.replica.lora.LoRABatch``); None: every row
    # runs the base model (the model's code runs unchanged).
    lora: LoRABatch | None = None


@dataclass(slots=True)
class StepLogits:
    """What the runner hands the engine after a step's forward: ``logits[i]`` (fp32) is the
    next-token distribution of request ``ids[i]``;
    ``prompt_logits`` (fp32) those of the batch's ``prompt_rows``, in order (None: none asked)."""

    ids: list[RequestId]
    logits: torch.Tensor
    prompt_logits: torch.Tensor | None = None


def default_max_model_len(model: object) -> int | None:
    """The engine's context for ``model`` as the engine computes it: the model's
    ``options.max_model_len`` when set, else its tables' length capped at ``CONTEXT_CAP``."""
    options = getattr(model, "options", None)
    set_len = getattr(options, "max_model_len", None)
    if set_len is not None:
        return int(set_len)
    tables = getattr(model, "max_model_len", None)
    return None if tables is None else min(int(tables), CONTEXT_CAP)


def graphs_supported(model: object, device: torch.device) -> str | None:
    """Why decode steps of ``model`` on ``device`` cannot run as CUDA graphs (None: they can)."""
    if device.type != "cuda":
        return f"CUDA graphs need a CUDA device, not {device.type}"
    options = getattr(model, "options", None)
    if getattr(options, "attention_backend", None) != "triton":
        return "CUDA graphs run the triton backend only (its KV store skips padding rows)"
    if getattr(options, "deterministic", False):
        return "the deterministic mode runs on the CPU"
    return None


class ModelRunner:
    """Owns the model and the KV pool of one replica; stateless across steps otherwise (the
    reused pinned host buffer and the CUDA graphs' static buffers aside).

    ``enforce_eager``: never use CUDA graphs. Otherwise, on CUDA with the triton backend,
    pure-decode steps of up to ``cuda_graph_max_batch`` sequences (default 256) are captured at
    construction for every bucket (``tierserve.replica.cuda_graph.capture_sizes``), over block tables of
    ``max_model_len`` (default: ``default_max_model_len``); a capture that fails is logged and
    the runner stays eager. ``graphs`` hands in ready ``DecodeGraphs`` instead (tests run its
    eager replay on CPU, where graphs are otherwise never used).
    """

    def __init__(
        self,
        model: CausalLM,
        pool: KVPool,
        device: torch.device | str = "cpu",
        *,
        enforce_eager: bool = False,
        max_model_len: int | None = None,
        cuda_graph_max_batch: int | None = None,
        graphs: DecodeGraphs | None = None,
        lora: LoRAManager | None = None,
    ) -> None:
        self.model = model
        self.lora = lora
        self.pool = pool
        self.device = torch.device(device)
        self.packer = StepPacker(self.device)
        self.graphs: DecodeGraphs | None = graphs
        self.graphs_off_reason: str | None = None
        cpu_packing.pack_model(model, self.device)  # weights are loaded by now
        if graphs is None and not enforce_eager:
            self.graphs = self._capture(max_model_len, cuda_graph_max_batch or 256)
        elif enforce_eager and graphs is None:
            self.graphs_off_reason = "enforce_eager"

    def _capture(self, max_model_len: int | None, max_batch: int) -> DecodeGraphs | None:
        why = graphs_supported(self.model, self.device)
        max_len = max_model_len or default_max_model_len(self.model)
        if why is None and max_len is None:
            why = "the model's context length is unknown"
        if why is not None or max_len is None:
            self.graphs_off_reason = why
            return None
        try:
            graphs = DecodeGraphs(
                self.model, self.pool.kv_caches, self.pool.block_size, max_len, max_batch,
                self.device,
            )
            graphs.capture()
            bad = graphs.verify()
        except Exception as e:  # a first GPU run: serve eagerly rather than not at all
            log.warning("CUDA graph capture failed; decode steps run eagerly: %r", e)
            self.graphs_off_reason = f"capture failed: {e!r}"
            with contextlib.suppress(Exception):
                torch.cuda.synchronize(self.device)
            return None
        if bad:
            log.warning("CUDA graphs of decode batches %s disagree with the eager model; decode "
                        "steps run eagerly", bad)
            self.graphs_off_reason = f"graphs of batches {bad} disagree with the eager model"
            return None
        log.info("CUDA graphs captured for decode batches of %s sequences", graphs.sizes)
        return graphs

    def build_batch(
        self,
        plan: StepPlan,
        prompt_logits_for: Collection[RequestId] = (),
        adapters: Mapping[RequestId, str] | None = None,
    ) -> ForwardBatch:
        """The flat batch of ``plan``, from what the plan carries alone: decodes, then chunks;
        raises on an empty plan. For the requests in ``prompt_logits_for``, the rows of their
        prompt tokens in this step's chunks reach the output head too (each but the prompt's
        last, which is sampled). ``adapters``: the LoRA adapter of each request that runs under
        one (the runner's ``lora`` puts them in slots); a step with adapter rows runs eagerly,
        never as a CUDA graph (the graphs hold the base model's step)."""
        decodes = plan.decodes
        chunks = plan.prefill
        if adapters and self.lora is not None:
            # Each adapter's rows side by side (decodes, then chunks, as always; the base's
            # first): the CPU path then applies an adapter to row ranges in place. Rows map
            # back to requests by ``sampled`` and ``prompt_rows``, so their order is free.
            def rank(rid: RequestId) -> tuple[bool, str]:
                name = adapters.get(rid)
                return (name is not None, name or "")

            decodes = sorted(decodes, key=lambda d: rank(d.id))
            chunks = sorted(chunks, key=lambda c: rank(c.id))
        ids = [d.token for d in decodes]
        specs = [SeqSpec(d.position, 1, d.block_table) for d in decodes]
        rows = list(range(len(ids)))
        sampled = [d.id for d in decodes]
        extra: list[int] = []
        prompt_rows: list[PromptRows] = []
        for c in chunks:
            base = len(ids)
            ids.extend(c.tokens)
            specs.append(SeqSpec(c.start, c.len, c.block_table))
            if c.last:
                rows.append(len(ids) - 1)
                sampled.append(c.id)
            if c.id in prompt_logits_for:
                count = min(c.start + c.len, c.prompt_len - 1) - c.start
                if count > 0:
                    extra.extend(range(base, base + count))
                    prompt_rows.append(PromptRows(c.id, c.start, count))
        lora = None
        if adapters and self.lora is not None:
            rows_of: list[str | None] = [adapters.get(d.id) for d in decodes]
            for c in chunks:
                rows_of.extend([adapters.get(c.id)] * c.len)
            lora = self.lora.batch(rows_of)
        if self.graphs is not None and not plan.prefill and lora is None:
            staged = self.graphs.stage(ids, specs)
            if staged is not None:
                packed, step = staged
                return ForwardBatch(
                    packed.input_ids, packed.meta, packed.logits_indices, sampled, graph=step
                )
        packed = self.packer.pack(specs, self.pool.block_size, ids, rows + extra)
        return ForwardBatch(
            input_ids=packed.input_ids,
            meta=packed.meta,
            logits_indices=packed.logits_indices,
            sampled=sampled,
            prompt_rows=prompt_rows,
            lora=lora,
        )

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> StepLogits:
        if batch.graph is not None and self.graphs is not None:
            out = self.graphs.run(batch.graph)
            logits = out.float()
            if logits.data_ptr() == out.data_ptr():
                logits = logits.clone()  # fp32: the graph's output is overwritten next replay
            return StepLogits(batch.sampled, logits)
        if batch.lora is not None and self.lora is not None:
            with self.lora.running(batch.lora):
                logits = self.model(
                    batch.input_ids, batch.meta.positions, self.pool.kv_caches, batch.meta,
                    batch.logits_indices,
                ).float()
        else:
            logits = self.model(
                batch.input_ids,
                batch.meta.positions,
                self.pool.kv_caches,
                batch.meta,
                batch.logits_indices,
            ).float()
        n = len(batch.sampled)
        if not batch.prompt_rows:
            return StepLogits(batch.sampled, logits)
        return StepLogits(batch.sampled, logits[:n], logits[n:])
