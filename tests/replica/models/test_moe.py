"""Mixture-of-experts models (Mixtral, Qwen3-MoE, Qwen2-MoE) against ``transformers``' own, from
tiny random checkpoints written by its classes and from GGUF files written as llama.cpp writes
them; the native expert-batched path against a per-token loop; the deterministic mode's batch
invariance; config and file errors."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from tests.replica.models.gguf_helpers import write_gguf
from tests.replica.models.helpers import (
    MOE_KINDS,
    PagedHarness,
    Work,
    save_checkpoint,
    tiny_hf_model,
)
from tests.replica.models.test_deterministic_contract import DATA_MOVEMENT, _OpRecorder
from tierserve.kernels import cpu_native
from tierserve.replica.models.config import ModelConfig, ModelLoadError
from tierserve.replica.models.llama import LlamaForCausalLM, ModelOptions
from tierserve.replica.models.loader import load_model
from tierserve.replica.models.moe import MoEMLP, route

needs_native = pytest.mark.skipif(
    not cpu_native.available(),
    reason=f"native kernels unavailable: {cpu_native.unavailable_reason()}",
)
LENGTHS = (1, 3, 7, 12, 20, 33)
NEW_TOKENS = 16


def _prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in LENGTHS]


def _hf_greedy(hf: Any, prompts: list[list[int]]) -> list[list[int]]:
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = hf.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
        pad_token_id=0,
    )
    return [row[width:] for row in out.tolist()]


def _expert_hits(model: LlamaForCausalLM, prompts: list[list[int]]) -> dict[int, Counter[int]]:
    """Per sparse layer, how many times each expert was chosen over the prompts' prefill."""
    hits: dict[int, Counter[int]] = {}
    handles = []
    for i, layer in enumerate(model.model.layers):
        mlp = layer.mlp
        if not isinstance(mlp, MoEMLP):
            continue
        hits[i] = Counter()

        def hook(mod: Any, args: tuple[torch.Tensor], _i: int = i) -> None:
            _, ids = route(mod.gate(args[0]), mod.top_k, mod.renormalize)
            hits[_i].update(ids.reshape(-1).tolist())

        handles.append(mlp.register_forward_pre_hook(hook))
    try:
        PagedHarness(model, len(prompts), 64).step([Work(i, 0, p) for i, p in enumerate(prompts)])
    finally:
        for h in handles:
            h.remove()
    return hits


def _check_against_hf(hf: Any, ours: LlamaForCausalLM) -> None:
    """Prefill logits of every row close to ``transformers``', greedy tokens equal to its
    ``generate``, and routing that reaches every expert of every sparse layer."""
    cfg = ours.config
    prompts = _prompts(hf.config.vocab_size)
    hits = _expert_hits(ours, prompts)
    assert sorted(hits) == list(cfg.moe_layers)
    for layer, counts in hits.items():
        assert set(counts) == set(range(cfg.num_experts)), (layer, counts)
    got = PagedHarness(ours, len(prompts), 64).step(
        [Work(i, 0, p) for i, p in enumerate(prompts)], all_rows=True
    )
    for p, logits in zip(prompts, got, strict=True):
        with torch.no_grad():
            want = hf(torch.tensor([p])).logits[0]
        torch.testing.assert_close(logits, want, rtol=0, atol=1e-4)
    greedy = _prompts(hf.config.vocab_size, seed=1)
    assert PagedHarness(ours, len(greedy), 64).greedy(greedy, NEW_TOKENS) == _hf_greedy(
        hf, greedy
    )


@pytest.fixture(scope="module", params=MOE_KINDS)
def hf_model(request: pytest.FixtureRequest) -> Any:
    return tiny_hf_model(request.param)


@pytest.mark.slow
@pytest.mark.parametrize("packed", [False, True], ids=["torch", "native"])
def test_checkpoint_matches_transformers(
    hf_model: Any, packed: bool, tmp_path: Path
) -> None:
    path = save_checkpoint(hf_model, tmp_path / "ckpt")
    ours, _, cfg = load_model(str(path))
    assert cfg.is_moe and cfg.architecture == hf_model.config.architectures[0]
    if packed:
        if not cpu_native.available():
            pytest.skip("native kernels unavailable")
        assert ours.pack_for_cpu() > 0
        assert all(m.experts.packed for m in ours.modules() if isinstance(m, MoEMLP))
    _check_against_hf(hf_model, ours)


@pytest.mark.slow
def test_gguf_file_matches_transformers(
    hf_model: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TIERSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = write_gguf(hf_model, tmp_path / "moe.gguf")
    ours, _, cfg = load_model(str(path))
    assert cfg.architecture == hf_model.config.architectures[0]
    _check_against_hf(hf_model, ours)
    again, _, _ = load_model(str(path))  # from the prepared cache
    assert all(torch.equal(a, b) for a, b in zip(
        ours.state_dict().values(), again.state_dict().values(), strict=True))


def test_stacked_transformers5_tensors_load_like_per_expert_ones(tmp_path: Path) -> None:
    """``transformers`` 5 holds the experts stacked (``mlp.experts.gate_up_proj``); its
    ``save_pretrained`` writes them per expert. A checkpoint of the stacked tensors loads the
    same weights."""
    hf = tiny_hf_model("mixtral", seed=2)
    per_expert = save_checkpoint(hf, tmp_path / "per-expert")
    stacked = save_checkpoint(hf, tmp_path / "stacked")
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    (stacked / "model.safetensors").unlink()
    save_file(state, str(stacked / "model.safetensors"))
    a, _, _ = load_model(str(per_expert))
    b, _, _ = load_model(str(stacked))
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), name


def test_a_missing_expert_is_named(tmp_path: Path) -> None:
    hf = tiny_hf_model("qwen3-moe", seed=3)
    path = save_checkpoint(hf, tmp_path / "ckpt")
    from safetensors.torch import load_file

    state = load_file(str(path / "model.safetensors"))
    del state["model.layers.0.mlp.experts.2.up_proj.weight"]
    save_file(state, str(path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"lacks 1 tensor\(s\): model\.layers\.0\.mlp\.experts"
                       r"\.2\.up_proj\.weight"):
        load_model(str(path))


@needs_native
def test_native_expert_batched_path_equals_a_per_token_loop(tmp_path: Path) -> None:
    """The packed model's MoE MLP (router, routing, grouped experts and sum on the native
    kernels) against the definition run token by token on the unpacked weights."""
    hf = tiny_hf_model("qwen2-moe", seed=4)
    model, _, _ = load_model(str(save_checkpoint(hf, tmp_path / "ckpt")))
    mlp = model.model.layers[0].mlp
    assert isinstance(mlp, MoEMLP) and mlp.shared_expert is not None
    x = torch.randn(23, model.config.hidden_size, generator=torch.Generator().manual_seed(5))
    gate_w = mlp.gate.weight.detach().clone()
    gate_up, down = (w.clone() for w in mlp.experts.dense_weights())
    shared = mlp.shared_expert
    sg, su, sd = (
        shared.gate_up_proj.weight.detach().clone(), None, shared.down_proj.weight.detach().clone()
    )
    shared_gate = mlp.shared_expert_gate.weight.detach().clone()  # type: ignore[union-attr]
    model.pack_for_cpu()
    got = mlp(x)
    inter = model.config.moe_intermediate_size
    sinter = model.config.shared_expert_intermediate_size
    del su
    for r in range(x.shape[0]):
        probs = torch.softmax(gate_w @ x[r], dim=-1)
        w, ids = torch.topk(probs, mlp.top_k)
        want = torch.zeros(x.shape[1])
        for j in range(mlp.top_k):
            e = int(ids[j])
            h = gate_up[e] @ x[r]
            want += w[j] * (down[e] @ (torch.nn.functional.silu(h[:inter]) * h[inter:]))
        hs = sg @ x[r]
        want += torch.sigmoid(shared_gate @ x[r]) * (
            sd @ (torch.nn.functional.silu(hs[:sinter]) * hs[sinter:])
        )
        torch.testing.assert_close(got[r], want, rtol=1e-5, atol=1e-5)


@needs_native
@pytest.mark.parametrize("kind", ["mixtral", "qwen3-moe"])
def test_deterministic_moe_model_is_batch_invariant(kind: str, tmp_path: Path) -> None:
    """A prompt's logits, every row, bit for bit: alone, and in a batch with five others in
    which it sits last (other rows reach the experts in between its own)."""
    hf = tiny_hf_model(kind, seed=6)
    path = save_checkpoint(hf, tmp_path / "ckpt")
    model, _, _ = load_model(str(path), options=ModelOptions(deterministic=True))
    prompts = _prompts(hf.config.vocab_size, seed=7)[:5]
    mine = _prompts(hf.config.vocab_size, seed=8)[4]
    alone = PagedHarness(model, 1, 64).step([Work(0, 0, mine)], all_rows=True)[0]
    work = [Work(i, 0, p) for i, p in enumerate(prompts)] + [Work(5, 0, mine)]
    batched = PagedHarness(model, 6, 64).step(work, all_rows=True)[5]
    assert torch.equal(alone, batched)
    # And decode steps: the same token after the prompt, alone and beside five decodes.
    h1 = PagedHarness(model, 1, 64)
    h1.step([Work(0, 0, mine)])
    one = h1.step([Work(0, len(mine), [11])])[0]
    h6 = PagedHarness(model, 6, 64)
    h6.step(work)
    many = h6.step([Work(i, len(p), [3 + i]) for i, p in enumerate(prompts)]
                   + [Work(5, len(mine), [11])])[5]
    assert torch.equal(one, many)


@needs_native
def test_deterministic_moe_forward_dispatches_only_data_movement(tmp_path: Path) -> None:
    """The deterministic contract (tests/replica/models/test_deterministic_contract.py) holds for
    a mixture of experts: its routing, experts and sum run on the native kernels; torch only
    moves data."""
    hf = tiny_hf_model("qwen2-moe", seed=9)
    model, _, _ = load_model(
        str(save_checkpoint(hf, tmp_path / "ckpt")), options=ModelOptions(deterministic=True)
    )
    harness = PagedHarness(model, 2, 64)
    with _OpRecorder() as rec:
        harness.step([Work(0, 0, [5, 6, 7, 8, 9]), Work(1, 0, [10, 11])])
    # Reading the per-expert group sizes to the host (``tolist``) dispatches conversions that
    # compute nothing: a dtype/device ``to`` and the conj/neg resolutions of an int tensor.
    allowed = DATA_MOVEMENT | {"aten.to", "aten.resolve_conj", "aten.resolve_neg"}
    assert set(rec.ops) <= allowed, set(rec.ops) - allowed


def test_an_unpacked_deterministic_moe_refuses_to_run(tmp_path: Path) -> None:
    hf = tiny_hf_model("mixtral", seed=10)
    cfg = ModelConfig.from_hf(hf.config)
    model = LlamaForCausalLM(cfg, ModelOptions(deterministic=True))
    mlp = model.model.layers[0].mlp
    with pytest.raises(cpu_native.DeterministicModeUnavailable, match="pack_for_cpu"):
        mlp(torch.zeros(2, cfg.hidden_size))


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_config_round_trips_through_json(kind: str) -> None:
    cfg = ModelConfig.from_hf(tiny_hf_model(kind).config)
    assert cfg.is_moe
    assert ModelConfig.from_json(cfg.to_json()) == cfg


def test_config_reads_the_sparse_layers_as_transformers_does() -> None:
    import transformers

    hf = transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=6, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, intermediate_size=48, moe_intermediate_size=16,
        num_experts=4, num_experts_per_tok=2, decoder_sparse_step=2, mlp_only_layers=[3],
    )
    cfg = ModelConfig.from_hf(hf)
    assert cfg.moe_layers == (1, 5)  # (i + 1) % 2 == 0, less layer 3
    assert cfg.qk_norm and not cfg.norm_topk_prob and cfg.moe_intermediate_size == 16
    mixtral = ModelConfig.from_hf(tiny_hf_model("mixtral").config)
    assert mixtral.norm_topk_prob and mixtral.moe_intermediate_size == 48
    assert mixtral.moe_layers == (0, 1)
    dense = ModelConfig.from_hf(tiny_hf_model("llama").config)
    assert not dense.is_moe and dense.num_experts == 0


def test_config_errors_say_what_is_wrong() -> None:
    import transformers

    base = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                intermediate_size=48)
    too_many = transformers.MixtralConfig(**base, num_local_experts=2, num_experts_per_tok=3)
    with pytest.raises(ModelLoadError, match=r"2 experts and 3 per token: it needs 1 <= experts "
                       r"per token <= experts"):
        ModelConfig.from_hf(too_many)
    no_size = transformers.Qwen3MoeConfig(**base, num_experts=4, num_experts_per_tok=2,
                                          moe_intermediate_size=0)
    with pytest.raises(ModelLoadError, match="positive expert intermediate size, got 0"):
        ModelConfig.from_hf(no_size)
    no_shared = transformers.Qwen2MoeConfig(**base, num_experts=4, num_experts_per_tok=2,
                                            moe_intermediate_size=16,
                                            shared_expert_intermediate_size=0)
    with pytest.raises(ModelLoadError, match="a Qwen2-MoE without its shared expert"):
        ModelConfig.from_hf(no_shared)
    cfg = ModelConfig.from_hf(tiny_hf_model("mixtral").config)
    data = cfg.to_json() | {"moe_layers": [1, 0]}
    with pytest.raises(ModelLoadError, match=r"sparse layers \[1, 0\] are not distinct"):
        ModelConfig.from_json(data)


# ----------------------------------------------------------------------------- GGUF errors


def _gguf_refused(path: Path, match: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERSERVE_CACHE_DIR", str(path.parent / "cache"))
    with pytest.raises(ModelLoadError, match=match):
        load_model(str(path))


def test_gguf_moe_variants_are_refused_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import gguf

    hf = tiny_hf_model("qwen3-moe", seed=11)
    qwen2 = write_gguf(hf, tmp_path / "q2.gguf", arch="qwen2")
    _gguf_refused(qwen2, r"mixture-of-experts qwen2 files are not supported", monkeypatch)

    path = write_gguf(hf, tmp_path / "sigmoid.gguf")
    # Rewrite with a gating function other than softmax: copy the file's fields plus one.
    reader = gguf.GGUFReader(str(path))
    w = gguf.GGUFWriter(str(tmp_path / "sigmoid2.gguf"), "qwen3moe")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value, vtype = field.contents(), field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(field.name, value, vtype, sub_type=sub)
    w.add_uint32("qwen3moe.expert_gating_func", 2)
    for t in reader.tensors:
        w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _gguf_refused(tmp_path / "sigmoid2.gguf", r"expert gating function 2 .* only softmax",
                  monkeypatch)

    no_router = write_gguf(hf, tmp_path / "norouter.gguf", skip=("blk.0.ffn_gate_inp.weight",))
    _gguf_refused(no_router, r"no layer has a router", monkeypatch)


@pytest.mark.slow
@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_qwen3_moe_greedy_through_the_engine_in_chunks(deterministic: bool, tmp_path: Path) -> None:
    """The whole engine (``LLM``: the runner packs the experts for the native kernels) on a tiny
    Qwen3-MoE, prompts prefilled in chunks of 7 tokens, a KV pool too small for all of them
    (preemption and recompute): greedy tokens equal to ``transformers``' ``generate``."""
    from tierserve.replica.llm import LLM
    from tierserve.replica.sampler import SamplingParams

    hf = tiny_hf_model("qwen3-moe", seed=12)
    path = save_checkpoint(hf, tmp_path / "ckpt")
    prompts = _prompts(hf.config.vocab_size, seed=13)
    want = _hf_greedy(hf, prompts)
    llm = LLM(str(path), device="cpu", dtype="float32", deterministic=deterministic,
              num_kv_blocks=6, block_size=16, max_num_seqs=6, max_model_len=64,
              prefill_chunk_tokens=7)
    assert llm.engine.model_config.is_moe
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert llm.stats().preemptions > 0
