"""How an engine's parts are built from its ``tierserve.replica.config.EngineConfig``: model, KV pool,
scheduler, runner.

The KV pool comes last: on a GPU under ``gpu_memory_utilization`` it takes what the weights and
the activations of the largest step leave, the activations measured by running that step once
(``tierserve.replica.kv_pool.plan_kv_pool``). On ``cuda:N`` the device is made the building thread's
current one (the engine's loop thread makes it its own too): Triton launches its kernels on the
current device, whatever device the tensors are on.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from tierserve.records import static_lora_id
from tierserve.replica.config import EngineConfig, context_length
from tierserve.replica.kv_pool import (
    KVPool,
    KVShape,
    PoolPlan,
    PoolSizing,
    StepBound,
    activation_meter,
    estimate_activation_bytes,
    plan_kv_pool,
)
from tierserve.replica.lora import LoRAError, LoRAManager
from tierserve.replica.models.loader import ModelOptions, load_model
from tierserve.replica.runner import ModelRunner
from tierserve.replica.scheduler import Scheduler

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(cfg: EngineConfig) -> torch.device:
    if cfg.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(cfg.device)


def select_device(device: torch.device) -> None:
    """Make ``device`` the calling thread's current CUDA device when it names one (``cuda:N``);
    anything else (``cpu``, a bare ``cuda``) leaves the thread as it is."""
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)


def step_bound(cfg: EngineConfig, max_model_len: int) -> StepBound:
    """The largest step ``cfg``'s caps allow (``tierserve.replica.kv_pool.StepBound``)."""
    return StepBound.of(
        cfg.max_num_batched_tokens, cfg.max_num_seqs, max_model_len, cfg.prefill_chunk_tokens
    )


@dataclass(slots=True)
class EngineParts:
    model_config: Any
    tokenizer: Any
    scheduler: Scheduler
    runner: ModelRunner
    max_model_len: int
    pool_plan: PoolPlan | None = None


def warm_kernels(cfg: EngineConfig, mcfg: Any, device: torch.device, backend: str,
                 dtype: torch.dtype) -> list[Any]:
    """On a GPU with the Triton kernels: compile every kernel variant this model can reach
    (``tierserve.kernels.aot.warmup``) before anything runs, so that no step of the serving loop (nor the
    start-up profile, nor a CUDA graph capture) compiles; the split scratch is sized then too.
    Returns the variants compiled (none elsewhere)."""
    if device.type != "cuda" or backend != "triton":
        return []
    from tierserve.kernels import aot  # Triton: the GPU path only

    softcap = getattr(mcfg, "attn_logit_softcapping", None) is not None  # Gemma 2
    config = aot.ServingConfig(mcfg.head_dim, mcfg.num_heads // mcfg.num_kv_heads,
                               cfg.block_size, dtype, cfg.deterministic, softcap=softcap)
    t0 = time.perf_counter()
    done = aot.warmup(config, device)
    log.info("compiled %d Triton kernel variants in %.1f s", len(done), time.perf_counter() - t0)
    return done


def base_model_names(model: str) -> tuple[str, ...]:
    """The names an adapter's ``base_model_name_or_path`` may give for the engine's ``model``
    (compared by ``tierserve.replica.lora.model_identity``): the setting itself (a path's last
    component, a hub id's name), and for a packaged model its catalogue name, file and the
    Hugging Face id it quantises."""
    from tierserve.replica.models.catalog import PACKAGED

    names = [model]
    packaged = PACKAGED.get(model)
    if packaged is not None:
        names += [packaged.name, packaged.file, packaged.hf_id]
    return tuple(n for n in names if n)


def build_lora(cfg: EngineConfig, model: Any, device: torch.device,
               dtype: torch.dtype) -> LoRAManager | None:
    """With ``enable_lora``: the adapter slots and hooks on ``model`` and the static adapters of
    ``lora_modules`` loaded (a bad one fails the start, saying which); else None. On a GPU the
    LoRA kernels are compiled here, for the model's shapes (``LoRAManager.warm_up``)."""
    if not cfg.enable_lora:
        return None
    lora = LoRAManager(model, cfg.max_loras, cfg.max_lora_rank, cfg.cpu_loras, device, dtype,
                       deterministic=cfg.deterministic, base_names=base_model_names(cfg.model),
                       base_check=cfg.lora_base_check)
    if lora.use_triton:
        t0 = time.perf_counter()
        lora.warm_up()
        log.info("compiled the LoRA kernels in %.1f s", time.perf_counter() - t0)
    for i, m in enumerate(cfg.lora_modules or (), start=1):
        try:  # the id the ingress's registry gives it too, from its name and path
            lora.load(m.name, m.path, int_id=static_lora_id(m.name, m.path))
        except LoRAError as e:
            lora.close()
            raise LoRAError(f"lora_modules[{i - 1}] ({m.name!r}): {e}") from None
    return lora


def build_engine_parts(cfg: EngineConfig) -> EngineParts:
    """Load the model, size the KV pool, and wire the scheduler and runner over one free list."""
    device = resolve_device(cfg)
    select_device(device)
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
        attention_backend=backend, deterministic=cfg.deterministic, max_model_len=cfg.max_model_len,
        fused_kernels=cfg.fused_kernels,
    )
    model, tokenizer, mcfg = load_model(
        cfg.model,
        dtype=dtype,
        device=device,
        options=options,
        trust_remote_code=cfg.trust_remote_code,
    )
    max_len = context_length(cfg, mcfg.max_position_embeddings)
    mcfg.check_context(max_len)
    shape = KVShape(
        layers=mcfg.num_layers,
        kv_heads=mcfg.num_kv_heads,
        head_dim=mcfg.head_dim,
        block_size=cfg.block_size,
        dtype=dtype,
    )
    warm_kernels(cfg, mcfg, device, backend, dtype)
    # The adapters' slots before the pool is sized: on a GPU they are memory the pool must leave.
    lora = build_lora(cfg, model, device, dtype)
    sizing = PoolSizing(cfg.num_kv_blocks, cfg.kv_cache_memory_bytes, cfg.gpu_memory_utilization)
    step = step_bound(cfg, max_len)
    measure = activation_meter(model, shape, step, device, mcfg.vocab_size, sizing)
    plan = plan_kv_pool(shape, sizing, device, estimate_activation_bytes(mcfg, step, dtype), measure)
    log.info(
        "KV pool: %d blocks (%.2f GiB); the largest step (%d tokens, %d sequences, every row's "
        "logits) needs %.2f GiB of activations (%s%s)",
        plan.num_blocks, plan.num_blocks * shape.block_bytes / 2**30, step.tokens, step.seqs,
        plan.activation_peak_bytes / 2**30, plan.activation_source,
        ", subtracted from the GPU budget" if plan.subtracted else "",
    )
    pool = KVPool(shape, plan.num_blocks, device)
    root = cfg.prefix_root() if cfg.enable_prefix_caching else None
    scheduler = Scheduler(cfg, pool.new_block_space(root), max_model_len=max_len)
    runner = ModelRunner(
        model,
        pool,
        device,
        enforce_eager=cfg.enforce_eager,
        max_model_len=max_len,
        cuda_graph_max_batch=cfg.max_num_seqs,
        lora=lora,
    )
    return EngineParts(mcfg, tokenizer, scheduler, runner, max_len, plan)
