"""The GPU path's start-up, checked on CPU: the KV pool sized with the activations of the largest
step, the engine thread on the runner's CUDA device, and the GPU config serving the packaged
model without network."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
import yaml

from tierserve.kernels.metadata import AttentionMetadata
from tierserve.records import GenerateRequest, RequestOutput, SamplingParams
from tierserve.replica.config import EngineConfig
from tierserve.replica.engine import Engine
from tierserve.replica.engine_config import build_engine_parts, select_device, step_bound
from tierserve.replica.kv_pool import (
    KVShape,
    PoolSizing,
    StepBound,
    estimate_activation_bytes,
    plan_kv_pool,
    profile_step,
)
from tierserve.replica.models.config import ModelConfig
from tierserve.replica.models.embedded import EMBEDDED_MODEL, build_model, embedded_config

GiB = 2**30
GPU_YAML = Path(__file__).resolve().parents[2] / "configs" / "cluster-gpu.yaml"
CUDA = torch.device("cuda", 0)  # a value only: nothing here touches a GPU

# SmolLM2-135M-Instruct, the packaged model: a 49k vocabulary over a small model.
SMOLLM2 = ModelConfig(
    architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576, num_layers=30,
    num_heads=9, num_kv_heads=3, head_dim=64, intermediate_size=1536, rms_norm_eps=1e-5,
    rope_theta=100000.0, rope_scaling=None, max_position_embeddings=8192,
    tie_word_embeddings=True,
)


def smollm2_shape(dtype: torch.dtype = torch.bfloat16) -> KVShape:
    return KVShape(layers=30, kv_heads=3, head_dim=64, block_size=16, dtype=dtype)


# ------------------------------------------------------------------ KV sizing by profiling


def test_the_profiled_activation_peak_comes_off_the_gpu_budget() -> None:
    shape = smollm2_shape()
    sizing = PoolSizing(num_kv_blocks=None, gpu_memory_utilization=0.9)
    memory = (70 * GiB, 80 * GiB)  # 10 GiB in use (weights, context), 72 GiB the budget
    peak = 4 * GiB + 12345
    calls: list[int] = []

    def measure(value: int) -> int:
        calls.append(value)
        return value

    without = plan_kv_pool(shape, sizing, CUDA, 0, lambda: measure(0), memory)
    with_peak = plan_kv_pool(shape, sizing, CUDA, 0, lambda: measure(peak), memory)
    assert calls == [0, peak]  # profiled once each
    assert with_peak.activation_source == "profiled" and with_peak.subtracted
    assert with_peak.activation_peak_bytes == peak
    budget = int(80 * GiB * 0.9) - 10 * GiB
    assert without.num_blocks == budget // shape.block_bytes
    assert with_peak.num_blocks == (budget - peak) // shape.block_bytes
    freed = (without.num_blocks - with_peak.num_blocks) * shape.block_bytes
    assert peak <= freed < peak + shape.block_bytes


def test_without_a_profile_the_estimate_comes_off_the_gpu_budget() -> None:
    shape = smollm2_shape()
    sizing = PoolSizing(num_kv_blocks=None, gpu_memory_utilization=0.9)
    memory = (70 * GiB, 80 * GiB)
    plan = plan_kv_pool(shape, sizing, CUDA, 3 * GiB, None, memory)
    assert plan.activation_source == "estimated" and plan.subtracted
    assert plan.num_blocks == (int(72 * GiB) - 10 * GiB - 3 * GiB) // shape.block_bytes


def test_an_explicit_size_is_not_profiled_and_the_cpu_budget_is_the_pools_own() -> None:
    shape = smollm2_shape(torch.float32)

    def never() -> int:
        raise AssertionError("profiled although the pool's size is explicit")

    plan = plan_kv_pool(shape, PoolSizing(num_kv_blocks=100), CUDA, GiB, never, (GiB, 80 * GiB))
    assert plan.num_blocks == 100 and not plan.subtracted
    budget = 256 * 2**20
    plan = plan_kv_pool(shape, PoolSizing(kv_cache_memory_bytes=budget), torch.device("cpu"),
                        GiB, never)
    assert plan.num_blocks == budget // shape.block_bytes and not plan.subtracted
    assert plan.activation_source == "estimated" and plan.activation_peak_bytes == GiB


def test_a_budget_the_activations_exhaust_is_refused() -> None:
    sizing = PoolSizing(num_kv_blocks=None, gpu_memory_utilization=0.5)
    with pytest.raises(ValueError, match="room for no block"):
        plan_kv_pool(smollm2_shape(), sizing, CUDA, 0, lambda: 30 * GiB, (60 * GiB, 80 * GiB))


@pytest.mark.parametrize("engine", [
    # configs/cluster-gpu.yaml's caps, and the defaults
    {"max_num_batched_tokens": 8192, "max_num_seqs": 256, "prefill_chunk_tokens": 2048},
    {},
], ids=["gpu-config", "defaults"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_estimate_covers_the_fp32_logits_of_a_full_step_of_scored_prompts(
    engine: dict[str, int], dtype: torch.dtype
) -> None:
    cfg = EngineConfig(**engine)
    step = step_bound(cfg, 8192)
    assert step.tokens == cfg.max_num_batched_tokens and step.logit_rows == step.tokens
    estimate = estimate_activation_bytes(SMOLLM2, step, dtype)
    logits_fp32 = step.tokens * SMOLLM2.vocab_size * 4  # tokens x vocab x 4 bytes
    assert estimate >= logits_fp32
    # ... and their log-softmax, and the model dtype's logits they were cast from
    item = torch.empty((), dtype=dtype).element_size()
    assert estimate >= 2 * logits_fp32 + step.tokens * SMOLLM2.vocab_size * item


@pytest.mark.parametrize(("tokens", "seqs", "max_len", "chunk"), [
    (8192, 256, 8192, 2048), (2048, 64, 256, 256), (2048, 4, 256, 128), (100, 3, 40, None),
    (5, 8, 64, None), (4096, 2, 1024, 512),
])
def test_the_largest_step_uses_every_token_within_the_caps(
    tokens: int, seqs: int, max_len: int, chunk: int | None
) -> None:
    step = StepBound.of(tokens, seqs, max_len, chunk)
    lens = step.chunk_lens()
    assert sum(lens) == step.tokens == min(tokens, seqs * max_len)
    assert 1 <= len(lens) <= seqs and max(lens) <= max_len
    specs = step.specs(16)
    assert [s.q_len for s in specs] == lens
    assert all(s.start + s.q_len == max_len for s in specs)  # every context at the longest


def test_the_profiled_step_runs_the_model_over_every_token_with_every_rows_logits() -> None:
    """The forward that start-up profiles, on CPU: the model gets the whole step and returns the
    logits of all its rows (what the measured peak covers)."""
    cfg = embedded_config()
    model = build_model()
    shape = KVShape(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 16, torch.float32)
    step = StepBound.of(96, 4, 64, 32)
    seen: list[tuple[int, int, tuple[int, ...]]] = []

    def recording(ids: torch.Tensor, positions: torch.Tensor, kv: list[tuple[torch.Tensor,
                  torch.Tensor]], meta: AttentionMetadata, rows: torch.Tensor) -> torch.Tensor:
        out = model(ids, positions, kv, meta, rows)
        seen.append((ids.shape[0], rows.shape[0], tuple(out.shape)))
        assert kv[0][0].shape[0] == 1  # a pool of one block, not the real one
        return out

    run = profile_step(recording, shape, step, torch.device("cpu"), cfg.vocab_size)

    def measure() -> int:
        run()
        return 1

    plan = plan_kv_pool(shape, PoolSizing(), torch.device("cpu"), 0, measure)
    assert seen == []  # nothing is profiled on CPU: its pool has a budget of its own
    assert plan.activation_source == "estimated"
    run()
    assert seen == [(96, 96, (96, cfg.vocab_size))]


def test_on_cuda_the_meter_profiles_the_largest_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """``activation_meter`` (what ``build_engine_parts`` hands ``plan_kv_pool``): on CUDA under
    ``gpu_memory_utilization`` it builds the step's forward and measures its peak; the device's
    calls are faked (this machine has no GPU)."""
    from tierserve.replica import kv_pool

    shape = smollm2_shape()
    step = StepBound.of(8192, 256, 8192, 2048)
    model = object()
    built: list[tuple[object, StepBound, torch.device, int]] = []

    def fake_profile(m: object, sh: KVShape, st: StepBound, dev: torch.device,
                     vocab: int) -> object:
        assert sh == shape
        built.append((m, st, dev, vocab))
        return "the step's forward"

    def fake_measure(run: object, dev: torch.device) -> int:
        assert run == "the step's forward" and dev == CUDA
        return 5 * GiB

    monkeypatch.setattr(kv_pool, "profile_step", fake_profile)
    monkeypatch.setattr(kv_pool, "measure_cuda_peak", fake_measure)
    sizing = PoolSizing(num_kv_blocks=None)
    meter = kv_pool.activation_meter(model, shape, step, CUDA, 49152, sizing)  # type: ignore[arg-type]
    assert meter is not None and built == []  # nothing runs until the pool is planned
    plan = plan_kv_pool(shape, sizing, CUDA, GiB, meter, (70 * GiB, 80 * GiB))
    assert built == [(model, step, CUDA, 49152)]
    assert plan.activation_peak_bytes == 5 * GiB and plan.activation_source == "profiled"
    for device, blocks in ((CUDA, 100), (torch.device("cpu"), None)):
        assert kv_pool.activation_meter(model, shape, step, device, 49152,  # type: ignore[arg-type]
                                        PoolSizing(num_kv_blocks=blocks)) is None


def test_the_engine_parts_carry_the_pools_plan() -> None:
    parts = build_engine_parts(EngineConfig(model=EMBEDDED_MODEL, num_kv_blocks=24, max_model_len=128,
                                            max_num_batched_tokens=64, max_num_seqs=4))
    plan = parts.pool_plan
    assert plan is not None and plan.num_blocks == 24 == parts.runner.pool.num_blocks
    assert plan.activation_source == "estimated" and not plan.subtracted
    assert plan.activation_peak_bytes >= 64 * parts.model_config.vocab_size * 4


# ------------------------------------------------------------------ the CUDA device of the thread


def test_select_device_sets_only_an_indexed_cuda_device(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    for device in ("cpu", "cuda", "cuda:1", "cuda:0"):
        select_device(torch.device(device))
    assert calls == [torch.device("cuda", 1), torch.device("cuda", 0)]


def test_the_engine_thread_makes_the_runners_cuda_device_current(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An engine whose runner is on ``cuda:1`` (the device faked on the built runner: this
    machine has no GPU) sets it in the loop thread before any step."""
    engine = Engine(EngineConfig(model=EMBEDDED_MODEL, num_kv_blocks=16, max_model_len=128))
    engine.runner.device = torch.device("cuda", 1)
    calls: list[tuple[torch.device, str]] = []
    called = threading.Event()

    def set_device(device: torch.device) -> None:
        calls.append((torch.device(device), threading.current_thread().name))
        called.set()

    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    engine.start()
    try:
        assert called.wait(timeout=30)
        assert engine.alive
    finally:
        engine.shutdown()
    assert calls == [(torch.device("cuda", 1), "tierserve-engine")]


def test_the_engine_thread_leaves_a_cpu_runners_thread_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine = Engine(EngineConfig(model=EMBEDDED_MODEL, num_kv_blocks=16, max_model_len=128))
    calls: list[object] = []
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    done = threading.Event()

    def sink(out: RequestOutput) -> None:
        if out.finished:
            done.set()

    engine.start()
    try:
        engine.add_request(GenerateRequest.of([1, 2, 3], SamplingParams(max_tokens=2)), sink=sink)
        assert done.wait(timeout=60)  # the loop ran a request through
    finally:
        engine.shutdown()
    assert calls == []


# ------------------------------------------------------------------ the GPU config


def test_the_gpu_config_serves_the_packaged_model_in_bf16_without_network() -> None:
    from tierserve.cluster.config import ClusterConfig
    from tierserve.replica.models.catalog import PACKAGED
    from tierserve.replica.models.gguf_loader import gguf_model_config
    from tierserve.replica.models.meta import gguf_file

    text = GPU_YAML.read_text()
    raw = yaml.safe_load(text)
    cfg = ClusterConfig(**raw["applications"][0]["args"])
    engine = cfg.engine
    assert engine.model in PACKAGED and "/" not in engine.model  # no hub id
    assert engine.dtype == "bfloat16" and engine.device == "cuda"
    assert engine.attention_backend == "triton"
    path = gguf_file(engine.model)  # installed with the project: a local file, no download
    assert path is not None and path.is_file()
    assert engine.max_model_len is not None
    gguf_model_config(path).check_context(engine.max_model_len)
    # the hub id stays as the documented alternative, in a comment only
    assert "#   model: HuggingFaceTB/SmolLM2-135M-Instruct" in text


def test_kernels_are_warmed_for_the_models_shape_on_a_gpu_only(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``build_engine_parts`` compiles every Triton variant of the model's shape before the
    profile and the graph capture, on CUDA with the Triton backend only."""
    import types

    from tierserve.kernels import aot
    from tierserve.replica.engine_config import warm_kernels

    seen: list[tuple[aot.ServingConfig, torch.device]] = []
    monkeypatch.setattr(aot, "warmup", lambda c, d: seen.append((c, d)) or ["v"])
    mcfg = types.SimpleNamespace(head_dim=64, num_heads=9, num_kv_heads=3)
    cfg = EngineConfig(block_size=32)
    cuda = torch.device("cuda", 1)
    assert warm_kernels(cfg, mcfg, cuda, "triton", torch.bfloat16) == ["v"]
    assert seen == [(aot.ServingConfig(64, 3, 32, torch.bfloat16, False), cuda)]
    assert warm_kernels(cfg, mcfg, torch.device("cpu"), "torch", torch.float32) == []
    assert warm_kernels(cfg, mcfg, cuda, "torch", torch.bfloat16) == []
    assert len(seen) == 1


@pytest.mark.parametrize("fused", [True, False])
def test_fused_kernels_switch_reaches_the_model(fused: bool) -> None:
    parts = build_engine_parts(EngineConfig(model="tierserve-tiny", num_kv_blocks=8,
                                            fused_kernels=fused))
    assert parts.runner.model.options.fused_kernels is fused  # type: ignore[attr-defined]
