"""The engine's options and how its parts are built from them: model, KV pool, scheduler, runner."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Literal

import torch

from replica.kv_pool import KVPool, KVShape, PoolSizing, choose_num_blocks
from replica.models.catalog import DEFAULT_MODEL
from replica.models.loader import ModelOptions, load_model
from replica.prefill_policy import Chunked, PrefillPolicy, WholePrompt
from replica.runner import ModelRunner
from replica.scheduler import SchedPolicy, Scheduler, SchedulerConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class EngineConfig:
    """Everything one replica's engine needs; the names follow vLLM's where they exist.

    model: the embedded default's name, a checkpoint directory or a hub id.
    block_size: positions per KV block. num_kv_blocks / kv_cache_bytes / gpu_memory_utilization:
    the pool's size (see ``PoolSizing``). max_num_seqs, max_batch_tokens, max_waiting: scheduler
    caps. max_model_len: the context (default: the model's, capped at 8192). policy: ``fcfs`` or
    ``priority``; aging_steps: steps per priority level of aging (0: strict). prefill_chunk_tokens:
    chunked prefill's chunk (None: whole prompts). dtype: ``auto`` (fp32 on CPU, bf16 on CUDA) or a
    torch dtype name. device: ``auto``, ``cpu`` or ``cuda[:n]``. deterministic: batch- and
    chunk-invariant results, bit for bit. attention_backend: ``auto`` (triton on CUDA, torch on
    CPU), ``triton`` or ``torch``. num_threads: torch CPU threads for this engine.
    """

    model: str = DEFAULT_MODEL
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_bytes: int | None = 256 * 2**20
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 64
    max_batch_tokens: int = 2048
    max_model_len: int | None = None
    max_waiting: int = 1024
    policy: Literal["fcfs", "priority"] = "fcfs"
    aging_steps: int = 100
    prefill_chunk_tokens: int | None = None
    dtype: str = "auto"
    device: str = "auto"
    deterministic: bool = False
    attention_backend: Literal["auto", "torch", "triton"] = "auto"
    trust_remote_code: bool = False
    num_threads: int | None = None

    def __post_init__(self) -> None:
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {self.policy!r}")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(
                f"attention_backend must be 'auto', 'torch' or 'triton', got {self.attention_backend!r}"
            )
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(
                f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {self.dtype!r}"
            )
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be one of 8, 16, 32, 64, 128, got {self.block_size}")
        if self.prefill_chunk_tokens is not None and self.prefill_chunk_tokens <= 0:
            raise ValueError(
                f"prefill_chunk_tokens must be positive, got {self.prefill_chunk_tokens}"
            )
        if self.num_threads is not None and self.num_threads <= 0:
            raise ValueError(f"num_threads must be positive, got {self.num_threads}")

    @classmethod
    def from_options(cls, model: str, **options: Any) -> EngineConfig:
        """Like the constructor, but an unknown option is a clear ``TypeError``."""
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(
                f"unknown engine option(s) {unknown}; known: {sorted(known - {'model'})}"
            )
        return cls(model=model, **options)

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)


@dataclass(slots=True)
class EngineParts:
    model_config: Any
    tokenizer: Any
    scheduler: Scheduler
    runner: ModelRunner
    max_model_len: int


def build_engine_parts(cfg: EngineConfig) -> EngineParts:
    """Load the model, size the KV pool, and wire the scheduler and runner over one free list."""
    device = cfg.resolve_device()
    if cfg.num_threads is not None:
        torch.set_num_threads(cfg.num_threads)
    elif device.type == "cpu" and "OMP_NUM_THREADS" in os.environ:
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    if cfg.dtype == "auto":
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    else:
        dtype = _DTYPES[cfg.dtype]
    backend = cfg.attention_backend
    if backend == "auto":
        backend = "triton" if device.type == "cuda" else "torch"
    options = ModelOptions(
        attention_backend=backend, deterministic=cfg.deterministic, max_model_len=cfg.max_model_len
    )
    model, tokenizer, mcfg = load_model(
        cfg.model,
        dtype=dtype,
        device=device,
        options=options,
        trust_remote_code=cfg.trust_remote_code,
    )
    max_len = cfg.max_model_len or min(mcfg.max_position_embeddings, 8192)
    mcfg.check_context(max_len)
    shape = KVShape(
        layers=mcfg.num_layers,
        kv_heads=mcfg.num_kv_heads,
        head_dim=mcfg.head_dim,
        block_tokens=cfg.block_size,
        dtype=dtype,
    )
    sizing = PoolSizing(cfg.num_kv_blocks, cfg.kv_cache_bytes, cfg.gpu_memory_utilization)
    pool = KVPool(shape, choose_num_blocks(shape, sizing, device), device)
    prefill: PrefillPolicy = (
        Chunked(cfg.prefill_chunk_tokens) if cfg.prefill_chunk_tokens else WholePrompt()
    )
    sched_cfg = SchedulerConfig(
        max_seqs=cfg.max_num_seqs,
        max_batch_tokens=cfg.max_batch_tokens,
        max_waiting=cfg.max_waiting,
        policy=SchedPolicy(cfg.policy),
        aging_steps=cfg.aging_steps,
        max_model_len=max_len,
    )
    scheduler = Scheduler(sched_cfg, pool.new_block_space(), prefill)
    return EngineParts(mcfg, tokenizer, scheduler, ModelRunner(model, pool, device), max_len)
