"""The GPU path checked in one command on an NVIDIA GPU, every figure written to one JSON file.

    python -m benchmarks.gpu_check --out gpu_check.json [--wheels DIR] [--model MODEL]
    python -m benchmarks.gpu_check --dry-run --out dry.json     (CPU: TRITON_INTERPRET=1, tiny shapes)

Sections, each with its ``status`` (``ok``, ``failed`` or ``skipped`` with a ``reason``), its
``seconds`` and its figures; one failing does not stop the others, and the file is rewritten
after each (what was measured survives a kill):

- ``environment``: the device (name, memory, SMs, compute capability), torch, Triton, CUDA and
  Python versions, the device's peak memory bandwidth from a table of known GPUs
  (``benchmarks.kernels_gpu.PEAK_BANDWIDTH``) and the bandwidth of a measured device-to-device copy.
- ``kernels_real_shapes``: the Triton store and paged attention (fast and deterministic) against
  the torch reference on a batch of decodes and prefill chunks, at head_dim 64 with 3 query heads
  per KV head (SmolLM2-135M) and head_dim 128 with 4 (Llama-3-8B); the largest error and, on a
  GPU, the time of one call.
- ``model_step``: a model of SmolLM2-135M's shape (random bf16 weights) decoding batches of 1, 64
  and 256 sequences at one context: time per step (the forward, and the forward with the batch's
  metadata built), kernels launched per step (``torch.profiler``), and the KV bytes a step reads
  per second against the peak and the measured copy bandwidth; then the same step staged and
  replayed from the runner's CUDA graphs (``tierserve.replica.cuda_graph``): its time, launches, and
  difference from the eager step.
- ``sampler``: ``tierserve.replica.sampler.sample`` on device logits with logit bias, penalties,
  ``min_tokens``, top-k/top-p/min-p and seeds: each processor's effect checked, time per call.
- ``engine_e2e``: the offline engine (``tierserve.replica.llm.LLM``) end to end on the device: the packaged
  model where its package is installed (else ``--model``, else the embedded ``tierserve-tiny``,
  and the file says which), greedy generation of a batch, then prompt log-probabilities, logprobs
  and a penalised, biased sampled request; the KV pool's size and profiled activation peak.
- ``kernel_tests``: ``pytest tests/kernels/test_triton_kernels.py`` with compiled kernels
  (``TRITON_INTERPRET=0``) in a subprocess; its counts (a dry run runs its store tests only).

The whole check is bounded by ``--budget-s`` (450 s by default: under 8 minutes with the start),
and nothing is downloaded: the model is local (the hub is switched to offline mode) and wheels
install with ``--no-index``.

A machine without pydantic (the GPU image here has torch, Triton and transformers, no pydantic
and no Ray): every section but ``engine_e2e`` runs without it (the engine's config is a pydantic
model). Carry these wheels (for CPython 3.12, manylinux x86-64) in a folder and pass it as
``--wheels DIR``; they are installed with pip ``--no-index --no-deps`` into a temporary folder
put first on ``sys.path``: ``pydantic``, ``pydantic_core`` (compiled, about 2 MB),
``annotated_types``, ``typing_inspection`` and ``typing_extensions``, at the versions of the
project's environment; add ``gguf`` (pure Python) to load a ``.gguf`` model with ``--model``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tierserve.arith import ceil_div

SECTIONS = (
    "environment",
    "kernels_real_shapes",
    "model_step",
    "sampler",
    "engine_e2e",
    "kernel_tests",
)
ROOT = Path(__file__).resolve().parents[1]
KERNEL_TESTS = "tests/kernels/test_triton_kernels.py"
WHEELS = ("pydantic", "pydantic_core", "annotated_types", "typing_inspection", "typing_extensions")

Figures = dict[str, Any]


@dataclass(frozen=True, slots=True)
class Plan:
    """The sizes of one run: the GPU's, or the dry run's tiny ones."""

    dry_run: bool
    device: str
    # kernels_real_shapes: decode contexts, then (start, length) of prefill chunks
    decode_contexts: tuple[int, ...]
    chunks: tuple[tuple[int, int], ...]
    # model_step
    batches: tuple[int, ...]
    context: int
    warmup: int
    iters: int
    profiled_steps: int
    # engine_e2e
    prompts: int
    max_tokens: int
    # kernel_tests: a pytest -k expression (None: every test)
    test_filter: str | None
    copy_bytes: int

    @classmethod
    def for_run(cls, dry_run: bool, device: str) -> Plan:
        if dry_run:
            return cls(
                dry_run=True, device="cpu", decode_contexts=(1, 17, 40), chunks=((0, 9), (5, 7)),
                batches=(1, 2, 4), context=24, warmup=0, iters=1, profiled_steps=1, prompts=4,
                max_tokens=8, test_filter="store_kv and cpu", copy_bytes=8 << 20)
        return cls(
            dry_run=False, device=device, decode_contexts=(1, 16, 17, 300, 1000, 2048, 4000),
            chunks=((0, 512), (100, 77), (2000, 300)), batches=(1, 64, 256), context=1024,
            warmup=5, iters=30, profiled_steps=3, prompts=64, max_tokens=128, test_filter=None,
            copy_bytes=1 << 30)


# ------------------------------------------------------------------ helpers


def is_cuda(device: str) -> bool:
    return device.startswith("cuda")


def sync(device: str) -> None:
    import torch

    if is_cuda(device):
        torch.cuda.synchronize(device)


def times_ms(fn: Callable[[], object], device: str, warmup: int, iters: int) -> list[float]:
    """Milliseconds of ``iters`` calls of ``fn`` after ``warmup`` (CUDA events on a GPU)."""
    import torch

    for _ in range(warmup):
        fn()
    sync(device)
    out: list[float] = []
    for _ in range(iters):
        if is_cuda(device):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            out.append(float(start.elapsed_time(end)))
        else:
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
    return out


def summary(ms: list[float]) -> Figures:
    return {"median_ms": statistics.median(ms), "min_ms": min(ms), "samples": len(ms)}


def count_launches(fn: Callable[[], object], device: str, steps: int = 3) -> Figures:
    """Per call of ``fn``: kernels that ran on the GPU, the host's kernel-launch calls (runtime
    and driver API: Triton launches through the driver), copies and memsets, and the top-level
    aten operators (the host's work), from ``torch.profiler``."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if is_cuda(device):
        activities.append(ProfilerActivity.CUDA)
    fn()  # compiled and warm
    sync(device)
    with profile(activities=activities) as prof:
        for _ in range(steps):
            fn()
        sync(device)
    kernels = copies = launches = graphs = ops = 0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            if e.name.startswith(("Memcpy", "Memset")):
                copies += 1
            else:
                kernels += 1
        elif "LaunchKernel" in e.name:
            launches += 1
        elif "GraphLaunch" in e.name:
            graphs += 1
        elif e.name.startswith("aten::") and e.cpu_parent is None:
            ops += 1
    return {
        "gpu_kernels_per_step": kernels / steps,
        "launch_calls_per_step": launches / steps,
        "graph_launches_per_step": graphs / steps,
        "gpu_copies_per_step": copies / steps,
        "aten_ops_per_step": ops / steps,
    }


def clean(x: Any) -> Any:
    """JSON-ready: NaN and infinities become None, tuples lists, unknown objects strings."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [clean(v) for v in x]
    if x is None or isinstance(x, (bool, int, str)):
        return x
    return str(x)


def vendor_wheels(folder: Path) -> Figures:
    """Install the wheels of ``folder`` (no index, no dependencies: nothing is downloaded) into a
    temporary folder first on ``sys.path`` (and on ``PYTHONPATH`` for subprocesses)."""
    wheels = sorted(folder.glob("*.whl"))
    if not wheels:
        raise FileNotFoundError(f"no .whl files in {folder}")
    target = Path(tempfile.mkdtemp(prefix="tierserve-gpu-check-site-"))
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
         "--no-cache-dir", "--target", str(target), *map(str, wheels)],
        check=True, timeout=300,
    )
    sys.path.insert(0, str(target))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(target), os.environ.get("PYTHONPATH", "")) if p)
    importlib.invalidate_caches()
    return {"folder": str(folder), "wheels": [w.name for w in wheels], "site": str(target)}


# ------------------------------------------------------------------ sections


def environment(plan: Plan) -> Figures:
    import torch
    import triton

    from benchmarks.kernels_gpu import peak_bandwidth

    info: Figures = {
        "device": plan.device,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "triton_interpret": os.environ.get("TRITON_INTERPRET", ""),
    }
    n = plan.copy_bytes
    if is_cuda(plan.device):
        props = torch.cuda.get_device_properties(plan.device)
        info.update(
            device_name=props.name,
            total_memory_bytes=props.total_memory,
            sm_count=props.multi_processor_count,
            compute_capability=f"{props.major}.{props.minor}",
            driver_free_total_bytes=list(torch.cuda.mem_get_info(plan.device)),
        )
        peak = peak_bandwidth(props.name)
    else:
        info["device_name"] = platform.processor() or platform.machine()
        peak = None
    src = torch.empty(n, dtype=torch.uint8, device=plan.device)
    dst = torch.empty_like(src)
    ms = times_ms(lambda: dst.copy_(src), plan.device, 3, 10 if is_cuda(plan.device) else 3)
    copy_bps = 2 * n / (statistics.median(ms) * 1e-3)  # each byte read once and written once
    info.update(
        peak_bandwidth_bytes_per_s=peak,
        peak_bandwidth_source="table (benchmarks.kernels_gpu.PEAK_BANDWIDTH)" if peak else "unknown",
        copy_bytes=n,
        copy_bandwidth_bytes_per_s=copy_bps,
    )
    return info


def _attention_case(
    plan: Plan, kv_heads: int, group: int, head_dim: int, block: int = 16
) -> Figures:
    import torch

    from tierserve.kernels import reference
    from tierserve.kernels.attention import attention
    from tierserve.kernels.metadata import SeqSpec, build_metadata

    dev = plan.device
    dtype = torch.bfloat16 if is_cuda(dev) else torch.float32
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
    parts = [(c - 1, 1) for c in plan.decode_contexts] + list(plan.chunks)
    need = [ceil_div((s + n), block) for s, n in parts]
    num_blocks = sum(need) + 64
    gen = torch.Generator().manual_seed(0)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    specs, at = [], 0
    for (start, n), count in zip(parts, need, strict=True):
        specs.append(SeqSpec(start, n, perm[at : at + count]))
        at += count
    meta = build_metadata(specs, block, dev)
    tokens = sum(n for _, n in parts)
    q_heads = kv_heads * group

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(dtype).to(dev)

    cache_k = randn(num_blocks, block, kv_heads, head_dim)
    cache_v = randn(num_blocks, block, kv_heads, head_dim)
    q, k, v = randn(tokens, q_heads, head_dim), randn(tokens, kv_heads, head_dim), randn(
        tokens, kv_heads, head_dim)
    scale = head_dim**-0.5
    ref_k, ref_v = cache_k.clone(), cache_v.clone()
    reference.store_kv(k, v, ref_k, ref_v, meta.slot_mapping)
    want = reference.paged_attention(q, ref_k, ref_v, meta, scale).float()
    out: Figures = {"kv_heads": kv_heads, "q_heads": q_heads, "head_dim": head_dim,
                    "dtype": str(dtype).removeprefix("torch."), "tokens": tokens,
                    "sequences": len(parts), "max_context": max(s + n for s, n in parts),
                    "tolerance": tol}
    ok = True
    for mode, det in (("fast", False), ("deterministic", True)):
        kc, vc = cache_k.clone(), cache_v.clone()
        got = attention(q, k, v, kc, vc, meta, scale, backend="triton", deterministic=det)
        err = (got.float() - want).abs().max().item()
        stored = bool(torch.equal(kc, ref_k) and torch.equal(vc, ref_v))
        entry: Figures = {"max_abs_err": err, "kv_stored_as_reference": stored}
        ok = ok and stored and err <= tol
        if is_cuda(dev):
            def call(det: bool = det, kc: torch.Tensor = kc, vc: torch.Tensor = vc) -> object:
                return attention(q, k, v, kc, vc, meta, scale, backend="triton",
                                 deterministic=det)

            entry.update(summary(times_ms(call, dev, 3, 20)))
        out[mode] = entry
    out["ok"] = ok
    return out


def kernels_real_shapes(plan: Plan) -> Figures:
    cases = {
        "head_dim64_gqa3": _attention_case(plan, kv_heads=3, group=3, head_dim=64),
        "head_dim128_gqa4": _attention_case(plan, kv_heads=8, group=4, head_dim=128),
    }
    status = "ok" if all(c["ok"] for c in cases.values()) else "failed"
    return {"status": status, "cases": cases}


def smollm2_config(dry_run: bool) -> Any:
    """SmolLM2-135M's shape (a tiny model of the same layout in a dry run)."""
    from tierserve.replica.models.config import ModelConfig

    if dry_run:
        return ModelConfig(
            architecture="LlamaForCausalLM", vocab_size=512, hidden_size=64, num_layers=2,
            num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128, rms_norm_eps=1e-5,
            rope_theta=10000.0, rope_scaling=None, max_position_embeddings=256,
            tie_word_embeddings=True)
    return ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576, num_layers=30,
        num_heads=9, num_kv_heads=3, head_dim=64, intermediate_size=1536, rms_norm_eps=1e-5,
        rope_theta=100000.0, rope_scaling=None, max_position_embeddings=8192,
        tie_word_embeddings=True)


def model_step(plan: Plan, peak: float | None, copy_bps: float | None) -> Figures:
    import torch

    from tierserve.kernels.metadata import SeqSpec, build_metadata
    from tierserve.replica.kv_pool import KVPool, KVShape
    from tierserve.replica.models.llama import LlamaForCausalLM, ModelOptions

    dev = torch.device(plan.device)
    dtype = torch.bfloat16 if is_cuda(plan.device) else torch.float32
    cfg = smollm2_config(plan.dry_run)
    model = LlamaForCausalLM(cfg, ModelOptions(attention_backend="triton"), dev, dtype)
    with torch.no_grad():
        gen = torch.Generator(device="cpu").manual_seed(0)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_((torch.randn(p.shape, generator=gen) * 0.02).to(dtype))
    model.eval()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    block = 16
    shape = KVShape(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block, dtype)
    per_seq = ceil_div(plan.context, block)
    pool = KVPool(shape, max(plan.batches) * per_seq + 1, dev)
    order = (torch.randperm(pool.num_blocks - 1, generator=gen) + 1).tolist()
    graphs, graphs_error = None, None
    try:  # the runner's decode graphs (on CPU their eager replay of the same static buffers)
        from tierserve.replica.cuda_graph import DecodeGraphs

        graphs = DecodeGraphs(model, pool.kv_caches, block, plan.context, max(plan.batches), dev)
        if is_cuda(plan.device):
            graphs.capture()
    except Exception as e:
        graphs, graphs_error = None, f"{type(e).__name__}: {e}"
    rows: list[Figures] = []
    for batch in plan.batches:
        specs = [SeqSpec(plan.context - 1, 1, order[b * per_seq : (b + 1) * per_seq])
                 for b in range(batch)]
        ids = torch.randint(0, cfg.vocab_size, (batch,), generator=gen).to(dev)
        logits_rows = torch.arange(batch, device=dev)
        meta = build_metadata(specs, block, dev)

        def forward(meta: Any = meta, ids: torch.Tensor = ids,
                    logits_rows: torch.Tensor = logits_rows) -> torch.Tensor:
            return model(ids, meta.positions, pool.kv_caches, meta, logits_rows).float()

        def with_metadata(specs: list[SeqSpec] = specs, ids: torch.Tensor = ids,
                          logits_rows: torch.Tensor = logits_rows) -> torch.Tensor:
            m = build_metadata(specs, block, dev)
            return model(ids, m.positions, pool.kv_caches, m, logits_rows).float()

        logits = forward()
        finite = bool(torch.isfinite(logits).all().item())
        step = summary(times_ms(forward, plan.device, plan.warmup, plan.iters))
        host = summary(times_ms(with_metadata, plan.device, min(1, plan.warmup), plan.iters))
        kv_bytes = batch * plan.context * shape.block_bytes // block
        seconds = step["median_ms"] * 1e-3
        row: Figures = {
            "batch": batch,
            "context": plan.context,
            "logits_finite": finite,
            "forward": step,
            "forward_with_metadata": host,
            "launches": count_launches(forward, plan.device, plan.profiled_steps),
            "kv_bytes_read": kv_bytes,
            "weight_bytes_read": weight_bytes,
            "kv_bytes_per_s": kv_bytes / seconds,
            "total_bytes_per_s": (kv_bytes + weight_bytes) / seconds,
            "kv_fraction_of_peak": kv_bytes / seconds / peak if peak else None,
            "total_fraction_of_peak": (kv_bytes + weight_bytes) / seconds / peak if peak else None,
            "total_fraction_of_copy": (kv_bytes + weight_bytes) / seconds / copy_bps
            if copy_bps else None,
            "tokens_per_s": batch / seconds,
        }
        if graphs is not None:
            row["graph"] = _graph_step(graphs, plan, ids.tolist(), specs, logits)
        rows.append(row)
    status = "ok" if all(r["logits_finite"] for r in rows) else "failed"
    return {"status": status, "model": "SmolLM2-135M shape, random weights"
            if not plan.dry_run else "tiny", "dtype": str(dtype).removeprefix("torch."),
            "layers": cfg.num_layers, "vocab": cfg.vocab_size, "rows": rows,
            "graphs": {"captured": bool(graphs is not None and graphs.captured),
                       "error": graphs_error}}


def _graph_step(graphs: Any, plan: Plan, ids: list[int], specs: list[Any], eager: Any) -> Figures:
    """One decode step through ``tierserve.replica.cuda_graph.DecodeGraphs``: staged (the host's packing
    and its one copy) and replayed; its time, launches and difference from the eager step."""
    def replay() -> Any:
        staged = graphs.stage(ids, specs)
        if staged is None:
            raise RuntimeError("the step does not fit a captured bucket")
        return graphs.run(staged[1]).float()

    try:
        diff = (replay() - eager).abs().max().item()
        return {"max_abs_diff_vs_eager": diff,
                **summary(times_ms(replay, plan.device, plan.warmup, plan.iters)),
                "launches": count_launches(replay, plan.device, plan.profiled_steps)}
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}


def sampler(plan: Plan) -> Figures:
    import torch

    from tierserve.records import SamplingParams
    from tierserve.replica.sampler import SamplerState, sample

    dev = torch.device(plan.device)
    vocab = 49152 if not plan.dry_run else 512
    gen = torch.Generator().manual_seed(0)
    greedy: Figures = {"temperature": 0.0, "max_tokens": 8}

    def one(row: torch.Tensor, state: SamplerState) -> int:
        return sample(row.unsqueeze(0).to(dev), [state])[0]

    def peaks(*pairs: tuple[int, float]) -> torch.Tensor:
        row = torch.zeros(vocab)
        for token, value in pairs:
            row[token] = value
        return row

    base = torch.randn(vocab, generator=gen)
    low, high = int(base.argmin()), int(base.argmax())

    def bias_raises() -> bool:
        return one(base, SamplerState(SamplingParams(**greedy, logit_bias={low: 100.0}))) == low

    def bias_bans() -> bool:
        return one(base, SamplerState(SamplingParams(**greedy, logit_bias={high: -100.0}))) != high

    def repetition() -> bool:  # a prompt token's positive logit divided by 10: 5 -> 0.5 < 4
        state = SamplerState(SamplingParams(**greedy, repetition_penalty=10.0), prompt=[3])
        return one(peaks((3, 5.0), (5, 4.0)), state) == 5

    def frequency_presence() -> bool:  # once drawn, 5 - 2 - 2 = 1 < 2
        state = SamplerState(SamplingParams(**greedy, frequency_penalty=2.0,
                                            presence_penalty=2.0))
        row = peaks((7, 5.0), (11, 2.0))
        return (one(row, state), one(row, state)) == (7, 11)

    def min_tokens() -> bool:  # the stop id is held back for the first two tokens only
        state = SamplerState(SamplingParams(**greedy, min_tokens=2), stop_ids=[13])
        row = peaks((13, 10.0), (17, 1.0))
        return [one(row, state) for _ in range(3)] == [17, 17, 13]

    checks: Figures = {}
    for name, check in (("logit_bias_raises_a_token", bias_raises),
                        ("logit_bias_bans_a_token", bias_bans),
                        ("repetition_penalty_on_prompt_tokens", repetition),
                        ("frequency_and_presence_penalties", frequency_presence),
                        ("min_tokens_holds_back_stop_ids", min_tokens)):
        try:
            checks[name] = bool(check())
        except Exception as e:  # a processor that cannot run on this device
            checks[name] = f"{type(e).__name__}: {e}"

    batch = 64 if not plan.dry_run else 8
    logits = torch.randn(batch, vocab, generator=gen).to(dev)

    def states(seed: int) -> list[SamplerState]:
        out = []
        for i in range(batch):
            p = SamplingParams(
                max_tokens=64, temperature=0.8, top_k=50 if i % 2 else 0,
                top_p=0.9 if i % 3 else 1.0, min_p=0.05 if i % 5 == 0 else 0.0, seed=seed + i,
                presence_penalty=0.5 if i % 4 == 0 else 0.0,
                frequency_penalty=0.3 if i % 4 == 1 else 0.0,
                repetition_penalty=1.2 if i % 4 == 2 else 1.0,
                logit_bias={i: 2.0} if i % 4 == 3 else None)
            out.append(SamplerState(p, prompt=list(range(i, i + 16))))
        return out

    out: Figures = {"batch": batch, "vocab": vocab, "device": str(dev), "checks": checks}
    try:
        first_draw = sample(logits, states(1))
        checks["seeded_draws_repeat"] = sample(logits, states(1)) == first_draw
        checks["draws_in_vocabulary"] = all(0 <= t < vocab for t in first_draw)
        reused = states(2)
        out["sample_call"] = summary(
            times_ms(lambda: sample(logits, reused), plan.device, 2, 3 if plan.dry_run else 10))
    except Exception as e:
        checks["mixed_batch"] = f"{type(e).__name__}: {e}"
    out["status"] = "ok" if all(v is True for v in checks.values()) else "failed"
    return out


@contextlib.contextmanager
def recorded_pool_plans() -> Iterator[list[Any]]:
    """The KV pool plans (``tierserve.replica.kv_pool.PoolPlan``) engines build meanwhile."""
    from tierserve.replica import engine_config

    plans: list[Any] = []
    original = engine_config.plan_kv_pool

    def recording(*args: Any, **kwargs: Any) -> Any:
        plan = original(*args, **kwargs)
        plans.append(plan)
        return plan

    engine_config.plan_kv_pool = recording
    try:
        yield plans
    finally:
        engine_config.plan_kv_pool = original


def choose_model(plan: Plan, model: str | None) -> tuple[str, str]:
    """The model to serve end to end and why that one."""
    from tierserve.replica.models.catalog import DEFAULT_MODEL, packaged_file
    from tierserve.replica.models.config import ModelLoadError
    from tierserve.replica.models.embedded import EMBEDDED_MODEL

    if model:
        return model, "--model"
    if plan.dry_run:
        return EMBEDDED_MODEL, "dry run: the embedded model"
    try:
        packaged_file(DEFAULT_MODEL)
    except ModelLoadError as e:
        return EMBEDDED_MODEL, f"the packaged model is not installed here ({e})"
    return DEFAULT_MODEL, "the packaged model"


def engine_e2e(plan: Plan, model: str | None) -> Figures:
    try:
        import pydantic  # noqa: F401  (the engine's config is a pydantic model)
    except ImportError as e:
        return {"status": "skipped", "reason": f"pydantic does not import ({e}): carry its "
                "wheels and pass --wheels DIR (see the module docstring)"}
    import torch

    from tierserve.records import GenerateRequest, SamplingParams
    from tierserve.replica.llm import LLM

    name, why = choose_model(plan, model)
    options: dict[str, Any] = {"device": plan.device, "max_num_seqs": 64}
    if plan.dry_run:
        options.update(num_kv_blocks=64, max_model_len=256, max_num_batched_tokens=512)
    else:
        options.update(dtype="bfloat16", attention_backend="triton", gpu_memory_utilization=0.5,
                       max_model_len=2048, max_num_batched_tokens=4096)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(plan.device)
    t0 = time.perf_counter()
    with recorded_pool_plans() as plans:
        llm = LLM(name, **options)
    load_s = time.perf_counter() - t0
    runner = llm.engine.runner
    pool = runner.pool
    out: Figures = {"model": name, "model_choice": why, "options": options, "load_s": load_s,
                    "kv_blocks": pool.num_blocks, "kv_pool_bytes": pool.nbytes,
                    "cuda_graphs": getattr(runner, "graphs", None) is not None,
                    "cuda_graphs_off": getattr(runner, "graphs_off_reason", None)}
    if plans:
        p = plans[-1]
        out.update(activation_peak_bytes=p.activation_peak_bytes,
                   activation_source=p.activation_source, activation_subtracted=p.subtracted)
    prompts = [f"Question {i}: name a colour, a number and an animal." for i in range(plan.prompts)]
    greedy = SamplingParams(max_tokens=plan.max_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    results = llm.generate(prompts, greedy, use_tqdm=False)
    gen_s = time.perf_counter() - t0
    tokens = sum(len(r.outputs[0].token_ids) for r in results)
    again = llm.generate(prompts[:1], greedy, use_tqdm=False)[0]
    out.update(
        generate_s=gen_s, prompts=len(prompts), output_tokens=tokens,
        output_tokens_per_s=tokens / gen_s,
        all_full_length=all(len(r.outputs[0].token_ids) == plan.max_tokens for r in results),
        greedy_alone_equals_in_batch=again.outputs[0].token_ids == results[0].outputs[0].token_ids,
        sample_text=results[0].outputs[0].text[:200],
    )
    checks: Figures = {}
    scored = llm.engine
    rid = None
    try:
        long_prompt = " ".join(f"word{i}" for i in range(30 if plan.dry_run else 150))
        rid_out: list[Any] = []
        rid = scored.add_request(
            GenerateRequest.of(scored.encode(long_prompt),
                               SamplingParams(max_tokens=4, temperature=0.0, logprobs=2,
                                              prompt_logprobs=5)),
            sink=rid_out.append)
        while scored.has_unfinished():
            scored.step()
        first = next(o for o in rid_out if o.request_id == rid)
        lps = first.prompt_logprobs or []
        checks["prompt_logprobs"] = bool(lps) and lps[0] is None and all(
            lp is not None and math.isfinite(lp.logprob) for lp in lps[1:])
        checks["logprobs"] = all(o.logprobs for o in rid_out if o.token_ids)
    except Exception as e:
        checks["prompt_logprobs"] = f"{type(e).__name__}: {e}"
        if rid is not None:
            scored.abort(rid)  # the engine stays usable for the next check
    try:
        params = SamplingParams(max_tokens=16, temperature=0.7, top_p=0.9, top_k=40, seed=7,
                                repetition_penalty=1.3, presence_penalty=0.5,
                                frequency_penalty=0.5, logit_bias={0: -100.0, 1: 5.0})
        r = llm.generate(prompts[:4], params, use_tqdm=False)
        checks["penalised_biased_sampling"] = all(len(x.outputs[0].token_ids) > 0 for x in r)
    except Exception as e:
        checks["penalised_biased_sampling"] = f"{type(e).__name__}: {e}"
    out["checks"] = checks
    if is_cuda(plan.device):
        out["max_memory_allocated_bytes"] = torch.cuda.max_memory_allocated(plan.device)
    llm.engine.shutdown()
    del llm
    if is_cuda(plan.device):
        torch.cuda.empty_cache()
    fine = all(v is True for v in checks.values()) and out["all_full_length"]
    out["status"] = "ok" if fine else "failed"
    return out


def kernel_tests(plan: Plan, timeout_s: float) -> Figures:
    env = dict(os.environ)
    env["TRITON_INTERPRET"] = "1" if plan.dry_run else "0"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", KERNEL_TESTS]
    if plan.test_filter:
        cmd += ["-k", plan.test_filter]
    try:
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        tail = (e.stdout or b"")
        text = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
        return {"status": "failed", "reason": f"timed out after {timeout_s:.0f} s",
                "command": cmd, "output_tail": text[-3000:]}
    text = done.stdout + done.stderr
    counts = {k: int(n) for n, k in re.findall(
        r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|xpassed)", text)}
    return {"status": "ok" if done.returncode == 0 else "failed", "returncode": done.returncode,
            "command": cmd, "counts": counts, "output_tail": text[-3000:]}


# ------------------------------------------------------------------ the run


class Report:
    """The JSON file, rewritten after every section."""

    def __init__(self, path: Path, plan: Plan) -> None:
        self.path = path
        self.data: Figures = {
            "tool": "benchmarks.gpu_check", "dry_run": plan.dry_run, "device": plan.device,
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "sections": {},
        }
        self.started = time.perf_counter()

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def run(self, name: str, fn: Callable[[], Figures]) -> Figures:
        print(f"[gpu_check] {name} ...", flush=True)
        t0 = time.perf_counter()
        try:
            entry = {"status": "ok", **fn()}
        except Exception as e:
            entry = {"status": "failed", "error": f"{type(e).__name__}: {e}",
                     "traceback": traceback.format_exc(limit=12)}
        entry["seconds"] = time.perf_counter() - t0
        print(f"[gpu_check] {name}: {entry['status']} ({entry['seconds']:.1f} s)"
              + (f": {entry.get('error') or entry.get('reason')}"
                 if entry["status"] != "ok" else ""), flush=True)
        self.record(name, entry)
        return entry

    def record(self, name: str, entry: Figures) -> None:
        self.data["sections"][name] = entry
        self.write()

    def write(self) -> None:
        self.data["elapsed_s"] = self.elapsed
        self.data["ok"] = all(s.get("status") != "failed" for s in self.data["sections"].values())
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(self.path.suffix + ".tmp")
        tmp.write_text(json.dumps(clean(self.data), indent=2) + "\n")
        tmp.replace(self.path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="the JSON file to write")
    parser.add_argument("--dry-run", action="store_true",
                        help="on CPU, Triton interpreted (TRITON_INTERPRET=1), tiny shapes")
    parser.add_argument("--device", default="cuda", help="cuda or cuda:N (default cuda)")
    parser.add_argument("--wheels", type=Path,
                        help="a folder of wheels to install first (no index): pydantic's")
    parser.add_argument("--model", help="the model of engine_e2e (default: the packaged one)")
    parser.add_argument("--skip", default="", help=f"sections to skip, of {','.join(SECTIONS)}")
    parser.add_argument("--budget-s", type=float, default=450.0,
                        help="the whole check's time; later sections are skipped past it")
    args = parser.parse_args(argv)
    skip = {s for s in args.skip.split(",") if s}
    unknown = skip - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}")
    # Nothing is downloaded: a hub id given as --model fails instead of fetching.
    os.environ["HF_HUB_OFFLINE"] = os.environ["TRANSFORMERS_OFFLINE"] = "1"
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before any Triton kernel is defined
    else:
        os.environ.setdefault("TRITON_INTERPRET", "0")
    sys.path.insert(0, str(ROOT))
    import torch

    plan = Plan.for_run(args.dry_run, "cpu" if args.dry_run else args.device)
    report = Report(args.out, plan)
    if args.wheels is not None:
        try:
            report.data["wheels"] = vendor_wheels(args.wheels)
        except (OSError, subprocess.SubprocessError) as e:
            report.data["wheels"] = {"error": f"{type(e).__name__}: {e}"}
    if not args.dry_run and not torch.cuda.is_available():
        print("benchmarks.gpu_check needs a CUDA GPU (torch.cuda.is_available() is False); "
              "--dry-run runs it on CPU with tiny shapes", file=sys.stderr)
        for name in SECTIONS:
            report.record(name, {"status": "skipped", "reason": "no CUDA GPU"})
        return 2
    if is_cuda(plan.device) and torch.device(plan.device).index is not None:
        torch.cuda.set_device(plan.device)  # Triton launches on the current device
    torch.manual_seed(0)

    figures: dict[str, Figures] = {}
    runs: dict[str, Callable[[], Figures]] = {
        "environment": lambda: environment(plan),
        "kernels_real_shapes": lambda: kernels_real_shapes(plan),
        "model_step": lambda: model_step(
            plan, figures.get("environment", {}).get("peak_bandwidth_bytes_per_s"),
            figures.get("environment", {}).get("copy_bandwidth_bytes_per_s")),
        "sampler": lambda: sampler(plan),
        "engine_e2e": lambda: engine_e2e(plan, args.model),
        "kernel_tests": lambda: kernel_tests(
            plan, max(30.0, min(300.0, args.budget_s - report.elapsed))),
    }
    for name in SECTIONS:
        if name in skip:
            report.record(name, {"status": "skipped", "reason": "--skip"})
        elif report.elapsed > args.budget_s:
            report.record(name, {"status": "skipped",
                                 "reason": f"the time budget ({args.budget_s:.0f} s) was spent"})
        else:
            figures[name] = report.run(name, runs[name])
        gc.collect()  # what a section built (its pool, its graphs) goes back before the next
        if is_cuda(plan.device):
            torch.cuda.empty_cache()
    report.write()
    print(f"[gpu_check] wrote {args.out}: {'ok' if report.data['ok'] else 'FAILED'} "
          f"in {report.elapsed:.0f} s", flush=True)
    return 0 if report.data["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
