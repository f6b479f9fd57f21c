"""How an engine's parts are built from its ``replica.config.EngineConfig``: model, KV pool,
scheduler, runner."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from replica.config import CONTEXT_CAP, EngineConfig
from replica.kv_pool import KVPool, KVShape, PoolSizing, choose_num_blocks
from replica.models.loader import ModelOptions, load_model
from replica.runner import ModelRunner
from replica.scheduler import Scheduler

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(cfg: EngineConfig) -> torch.device:
    if cfg.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(cfg.device)


@dataclass(slots=True)
class EngineParts:
    model_config: Any
    tokenizer: Any
    scheduler: Scheduler
    runner: ModelRunner
    max_model_len: int


def build_engine_parts(cfg: EngineConfig) -> EngineParts:
    """Load the model, size the KV pool, and wire the scheduler and runner over one free list."""
    device = resolve_device(cfg)
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
    max_len = cfg.max_model_len or min(mcfg.max_position_embeddings, CONTEXT_CAP)
    mcfg.check_context(max_len)
    shape = KVShape(
        layers=mcfg.num_layers,
        kv_heads=mcfg.num_kv_heads,
        head_dim=mcfg.head_dim,
        block_tokens=cfg.block_size,
        dtype=dtype,
    )
    sizing = PoolSizing(cfg.num_kv_blocks, cfg.kv_cache_memory_bytes, cfg.gpu_memory_utilization)
    pool = KVPool(shape, choose_num_blocks(shape, sizing, device), device)
    root = cfg.prefix_root() if cfg.enable_prefix_caching else None
    scheduler = Scheduler(cfg, pool.new_block_space(root), max_model_len=max_len)
    return EngineParts(mcfg, tokenizer, scheduler, ModelRunner(model, pool, device), max_len)
