"""The deterministic mode's contract, checked on whatever CPU runs the suite.

1. Its forward pass calls no library GEMM and no library reduction: every aten op it dispatches
   is data movement, indexing or allocation, and every linear layer, norm, SiLU, rotary embedding
   and attention runs on the native kernels (whose row independence is by construction; see
   kernels/csrc/cpu_kernels.cpp). So no library's CPU-dependent blocking can reach its bits.
2. Where the mode cannot be honoured it refuses, saying why, instead of running without it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.replica.models.helpers import PagedHarness, Work, save_checkpoint, tiny_hf_model
from tierserve.kernels import cpu_native, cpu_ops
from tierserve.kernels.metadata import SeqSpec, build_metadata
from tierserve.replica.config import EngineConfig
from tierserve.replica.engine import Engine
from tierserve.replica.models.embedded import EMBEDDED_MODEL, build_model, embedded_config
from tierserve.replica.models.layers import Linear
from tierserve.replica.models.llama import LlamaForCausalLM, ModelOptions
from tierserve.replica.models.loader import load_model

needs_native = pytest.mark.skipif(
    not cpu_native.available(),
    reason=f"native kernels unavailable: {cpu_native.unavailable_reason()}",
)
DET = ModelOptions(deterministic=True)
Unavailable = cpu_native.DeterministicModeUnavailable

# What the deterministic forward may dispatch to torch: views, copies, indexing, allocation.
# None of these sums anything (an embedding and index_select copy rows).
DATA_MOVEMENT = {
    "aten._to_copy",
    "aten._unsafe_view",
    "aten.alias",
    "aten.as_strided",
    "aten.clone",
    "aten.contiguous",
    "aten.copy_",
    "aten.detach",
    "aten.embedding",
    "aten.empty",
    "aten.empty_strided",
    "aten.expand",
    "aten.index_select",
    "aten.lift_fresh",
    "aten.new_empty",
    "aten.permute",
    "aten.reshape",
    "aten.select",
    "aten.slice",
    "aten.squeeze",
    "aten.t",
    "aten.transpose",
    "aten.unbind",
    "aten.unsqueeze",
    "aten.view",
}
NATIVE_OPS = ("linear", "rms_norm", "silu_and_mul", "qk_norm", "rope_store", "paged_attention")


class _OpRecorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture
def native_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counter[str]]:
    """Counts the calls of each native op (wrapped where the model's layers look them up)."""
    calls: Counter[str] = Counter()
    for name in NATIVE_OPS:
        fn: Callable[..., Any] = getattr(cpu_ops, name)

        def counted(*args: Any, _fn: Callable[..., Any] = fn, _name: str = name, **kw: Any) -> Any:
            calls[_name] += 1
            return _fn(*args, **kw)

        monkeypatch.setattr(cpu_ops, name, counted)
    yield calls


def _mixed_step(
    model: LlamaForCausalLM, native_calls: Counter[str]
) -> tuple[Counter[str], torch.Tensor]:
    """One forward over two decodes and two prefill chunks (after a step that cached the
    decodes' prefixes), under the recorder; returns its aten ops and logits, and leaves its
    native calls (only) in ``native_calls``."""
    harness = PagedHarness(model, 4, 64)
    harness.step([Work(0, 0, list(range(3, 23))), Work(1, 0, [7, 8, 9])])
    specs = [
        SeqSpec(20, 1, harness.table(0)),
        SeqSpec(3, 1, harness.table(1)),
        SeqSpec(0, 11, harness.table(2)),
        SeqSpec(0, 5, harness.table(3)),
    ]
    meta = build_metadata(specs, harness.block_size)
    ids = torch.tensor([5, 6, *range(30, 41), *range(50, 55)])
    rows = torch.tensor([0, 1, 12, 17])
    native_calls.clear()
    with _OpRecorder() as rec:
        logits = model(ids, meta.positions, harness.caches, meta, rows)
    return rec.ops, logits


@needs_native
@pytest.mark.parametrize("which", ["embedded", "qwen2", "qwen3"])
def test_deterministic_forward_calls_no_library_gemm_or_reduction(
    which: str, native_calls: Counter[str], tmp_path: Any
) -> None:
    if which == "embedded":
        model = build_model(DET)
    else:  # qwen2: q/k/v biases, an untied head, an odd MLP width; qwen3: per-head q/k norms
        path = save_checkpoint(tiny_hf_model(which, seed=5), tmp_path)
        model = load_model(str(path), options=DET)[0]
    ops, logits = _mixed_step(model, native_calls)
    layers = model.config.num_layers
    foreign = sorted(set(ops) - DATA_MOVEMENT)
    assert foreign == [], (
        f"the deterministic forward dispatched {foreign} to torch "
        f"(CPU capability {torch.backends.cpu.get_cpu_capability()})"
    )
    want = {
        "linear": 4 * layers + 1,  # qkv, o, gate_up, down; the output head
        "rms_norm": 2 * layers + 1,
        "silu_and_mul": layers,
        "rope_store": layers,
        "paged_attention": layers,
    }
    if model.config.qk_norm:
        want["qk_norm"] = layers
    assert dict(native_calls) == want
    assert logits.shape == (4, model.config.vocab_size) and bool(logits.isfinite().all())


def test_the_recorder_does_see_library_ops() -> None:
    """The check above would catch a library path: the default mode's torch fallbacks show up."""
    with _OpRecorder() as rec:
        x = torch.randn(3, 8)
        torch.nn.functional.linear(x, torch.randn(4, 8))
        x.pow(2).mean(-1)
    assert {"aten.mm", "aten.mean"} <= set(rec.ops) - DATA_MOVEMENT


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dtype": torch.bfloat16}, "float32 only"),
        ({"dtype": torch.float16}, "float32 only"),
        ({"device": "meta"}, "CPU only"),
    ],
)
def test_deterministic_model_refuses_a_dtype_or_device_it_does_not_cover(
    kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(Unavailable, match=message):
        build_model(DET, **kwargs)
    with pytest.raises(Unavailable, match=message):
        LlamaForCausalLM(embedded_config(), DET, **kwargs)


def test_deterministic_model_refuses_another_attention_backend() -> None:
    opts = ModelOptions(attention_backend="triton", deterministic=True)
    with pytest.raises(Unavailable, match="torch backend's native kernels, not 'triton'"):
        LlamaForCausalLM(embedded_config(), opts)


def test_deterministic_model_refuses_without_the_native_kernels(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(cpu_native, "_tried", True)
    monkeypatch.setattr(cpu_native, "_lib", None)
    monkeypatch.setattr(cpu_native, "_reason", "no C++ compiler found ($CXX, g++ or c++)")
    with pytest.raises(Unavailable, match=r"unavailable: no C\+\+ compiler found"):
        build_model(DET)
    monkeypatch.setattr(cpu_native, "_tried", False)
    monkeypatch.setattr(cpu_native, "enabled", False)
    with pytest.raises(Unavailable, match="switched off"):
        build_model(DET)


@needs_native
def test_deterministic_refuses_heads_beyond_the_kernel() -> None:
    reason = cpu_native.deterministic_unsupported("cpu", torch.float32, 8, 2, 512)
    assert reason is not None and "head_dim 512" in reason
    assert cpu_native.deterministic_unsupported("cpu", torch.float32, 9, 3, 64) is None


@needs_native
def test_deterministic_layers_refuse_to_run_off_the_native_path() -> None:
    layer = Linear(8, 8, deterministic=True)
    with pytest.raises(Unavailable, match=r"call pack_for_cpu\(\)"):
        layer(torch.randn(2, 8))
    from tierserve.replica.models.layers import RMSNorm, silu_and_mul

    with pytest.raises(Unavailable, match="RMSNorm needs the native kernels"):
        RMSNorm(8, 1e-5, deterministic=True)(torch.randn(2, 8, dtype=torch.float64))
    with pytest.raises(Unavailable, match="SiLU needs the native kernels"):
        silu_and_mul(torch.randn(2, 8, dtype=torch.bfloat16), deterministic=True)


@pytest.mark.parametrize(
    ("options", "message"),
    [({"dtype": "bfloat16"}, "float32 only"), ({"attention_backend": "triton"}, "not 'triton'")],
)
def test_engine_refuses_to_start_in_a_deterministic_mode_it_cannot_honour(
    options: dict[str, Any], message: str
) -> None:
    with pytest.raises(Unavailable, match=f"deterministic mode cannot run here: .*{message}"):
        Engine(EngineConfig(model=EMBEDDED_MODEL, deterministic=True, device="cpu", num_kv_blocks=16,
                            **options))


def test_engine_refuses_to_start_without_the_native_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_native, "_tried", True)
    monkeypatch.setattr(cpu_native, "_lib", None)
    monkeypatch.setattr(cpu_native, "_reason", "no C++ compiler found ($CXX, g++ or c++)")
    with pytest.raises(Unavailable, match=r"deterministic mode cannot run here: .*no C\+\+ compiler"):
        Engine(EngineConfig(model=EMBEDDED_MODEL, deterministic=True, device="cpu", num_kv_blocks=16))


def test_a_replica_configured_for_a_deterministic_mode_it_cannot_honour_does_not_start() -> None:
    """The deployment's constructor (what Serve calls to start a replica) raises the refusal, so
    Serve reports the replica as failed to start with that message."""
    from tierserve.replica.deployment import LLMServer

    with pytest.raises(Unavailable, match=r"deterministic mode cannot run here: .*float32 only"):
        LLMServer(engine={"model": EMBEDDED_MODEL, "deterministic": True, "device": "cpu",
                          "dtype": "bfloat16", "num_kv_blocks": 16})
