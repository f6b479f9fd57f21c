"""Gemma 2 and Gemma 3 (text): the (1 + w) fp32 norms bit for bit, linear rope scaling, the config
fields and their errors, and the whole model against ``transformers``' own Gemma classes, from a
checkpoint directory and from GGUF files written as llama.cpp writes them.

Tests whose prompts run past a sliding window, or whose config soft-caps attention scores (Gemma
2), need ``tierserve.kernels.attention.attention``'s ``window`` / ``softcap``: they are skipped
while this build's ``attention`` lacks them, and run once it has them."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

from tests.replica.models.gguf_helpers import reference_from_file, write_gguf
from tests.replica.models.helpers import PagedHarness, Work, save_checkpoint, tiny_hf_model
from tierserve.kernels import cpu_native
from tierserve.replica.models import gemma
from tierserve.replica.models.config import LinearScaling, ModelConfig, ModelLoadError
from tierserve.replica.models.layers import rope_inv_freq
from tierserve.replica.models.llama import ModelOptions
from tierserve.replica.models.loader import load_model

WINDOW = 32  # the tiny models' sliding window (tests.replica.models.helpers)


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """GGUF tokenizers and prepared weights go to a scratch cache, not the user's."""
    monkeypatch.setenv("TIERSERVE_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))


def _prompts(vocab: int, lengths: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def _hf_greedy(hf: Any, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """``generate`` (greedy) on a left-padded batch."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = hf.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
    )
    return [row[width:] for row in out.tolist()]


def _same_as_transformers(
    ours: Any, hf: Any, prompts: list[list[int]], new_tokens: int, max_len: int
) -> None:
    """Every row's prefill logits close (all prompts in one flat batch), greedy tokens equal."""
    got = PagedHarness(ours, len(prompts), max_len).step(
        [Work(i, 0, p) for i, p in enumerate(prompts)], all_rows=True
    )
    for p, logits in zip(prompts, got, strict=True):
        with torch.no_grad():
            want = hf(torch.tensor([p])).logits[0]
        scale = float(want.abs().max())
        torch.testing.assert_close(logits, want, rtol=0, atol=1e-4 * max(1.0, scale))
    harness = PagedHarness(ours, len(prompts), max_len)
    assert harness.greedy(prompts, new_tokens) == _hf_greedy(hf, prompts, new_tokens)


# -- the norms, the rotary scaling, the config ---------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_folded_norm_has_the_bits_of_transformers(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``GemmaRMSNorm`` holding ``1.0 + w.float()`` gives ``Gemma3RMSNorm``'s bits (torch path:
    the native kernel sums in another order), rows and q/k heads, in fp32, bf16 and fp16."""
    monkeypatch.setattr(cpu_native, "enabled", False)
    gen = torch.Generator().manual_seed(0)
    hidden, heads, head_dim = 48, 6, 16
    x = (torch.randn(5, hidden, generator=gen) * 3).to(dtype)
    hf = Gemma3RMSNorm(hidden, eps=1e-6).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(hidden, generator=gen) * 0.5)
    ours = gemma.GemmaRMSNorm(hidden, 1e-6)
    ((_, folded),) = gemma.fold_norm_offsets(iter([("norm.weight", hf.weight.data)]))
    ours.weight.data.copy_(folded)
    assert ours.weight.dtype == torch.float32
    assert torch.equal(ours.weight, 1.0 + hf.weight.float())
    with torch.no_grad():
        assert torch.equal(ours(x), hf(x))

        q_hf, k_hf = Gemma3RMSNorm(head_dim).to(dtype), Gemma3RMSNorm(head_dim).to(dtype)
        q_ours, k_ours = gemma.GemmaRMSNorm(head_dim, 1e-6), gemma.GemmaRMSNorm(head_dim, 1e-6)
        for h, o in ((q_hf, q_ours), (k_hf, k_ours)):
            h.weight.copy_(torch.randn(head_dim, generator=gen) * 0.5)
            o.weight.copy_(1.0 + h.weight.float())
        qkv = (torch.randn(5, heads + 2 * 2, head_dim, generator=gen) * 2).to(dtype)
        want_q, want_k = q_hf(qkv[:, :heads]), k_hf(qkv[:, heads : heads + 2])
        gemma.gemma_qk_norm_(qkv, q_ours, k_ours, heads)
        assert torch.equal(qkv[:, :heads], want_q) and torch.equal(qkv[:, heads : heads + 2], want_k)


def test_folded_norm_on_the_native_kernel_is_close() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(7, 64, generator=gen)
    w = torch.randn(64, generator=gen) * 0.3
    ours = gemma.GemmaRMSNorm(64, 1e-6)
    ours.weight.data.copy_(1.0 + w)
    hf = Gemma3RMSNorm(64, eps=1e-6)
    hf.weight.data.copy_(w)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf(x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("factor", [2.0, 8.0])
def test_linear_rope_matches_transformers(factor: float) -> None:
    hf = transformers.LlamaConfig(
        hidden_size=256, num_attention_heads=4, num_hidden_layers=1, max_position_embeddings=512,
        rope_parameters={"rope_type": "linear", "factor": factor, "rope_theta": 1e6},
    )
    cfg = ModelConfig.from_hf(hf)
    assert cfg.rope_scaling == LinearScaling(factor)
    want, attention_factor = ROPE_INIT_FUNCTIONS["linear"](hf, "cpu")
    assert attention_factor == 1.0
    assert torch.equal(rope_inv_freq(64, cfg.rope_theta, cfg.rope_scaling), want)
    assert ModelConfig.from_json(cfg.to_json()) == cfg


def _gemma3_270m() -> Any:
    """Gemma 3 270M's text config (no weights)."""
    return transformers.Gemma3TextConfig(
        vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256,
        sliding_window=512, max_position_embeddings=32768, rope_theta=1e6,
        rope_local_base_freq=10000.0,
    )


def test_a_gemma3_config() -> None:
    cfg = ModelConfig.from_hf(_gemma3_270m())
    assert cfg.architecture == "Gemma3ForCausalLM" and cfg.hidden_act == "gelu_pytorch_tanh"
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.q_size) == (4, 1, 256, 1024)
    assert cfg.qk_norm and cfg.tie_word_embeddings and not cfg.qkv_bias
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.rope_scaling) == (1e6, 10000.0, None)
    assert cfg.query_pre_attn_scalar == 256 and cfg.final_logit_softcapping is None
    assert cfg.attn_logit_softcapping is None
    # Every 6th layer global, the rest sliding (transformers' default pattern).
    assert cfg.layer_windows() == ((512,) * 5 + (None,)) * 3
    # As the GGUF prepared cache keeps it: through JSON (lists for tuples).
    assert ModelConfig.from_json(json.loads(json.dumps(cfg.to_json()))) == cfg


def test_gemma3_4b_style_linear_scaling_is_on_the_global_layers() -> None:
    hf = _gemma3_270m()
    hf.rope_parameters["full_attention"].update(rope_type="linear", factor=8.0)
    cfg = ModelConfig.from_hf(hf)
    assert cfg.rope_scaling == LinearScaling(8.0) and cfg.rope_local_theta == 10000.0
    assert ModelConfig.from_json(json.loads(json.dumps(cfg.to_json()))) == cfg


def test_a_gemma2_config() -> None:
    cfg = ModelConfig.from_hf(
        transformers.Gemma2Config(num_hidden_layers=4, hidden_size=256, num_attention_heads=2,
                                  num_key_value_heads=1, head_dim=128, intermediate_size=512)
    )
    assert cfg.architecture == "Gemma2ForCausalLM" and not cfg.qk_norm
    assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (50.0, 30.0)
    assert cfg.rope_local_theta is None and cfg.query_pre_attn_scalar == 256
    assert cfg.layer_windows() == (4096, None, 4096, None)  # alternating, sliding first


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"hidden_activation": "gelu"}, r"hidden_activation 'gelu' is not supported"),
        ({"use_bidirectional_attention": True}, r"use_bidirectional_attention=True"),
        (
            {"rope_parameters": {"full_attention": {"rope_type": "dynamic", "factor": 2.0}}},
            r"rope scaling type 'dynamic' is not supported; supported: default, linear",
        ),
        (
            {"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
            r"rope type 'linear' on the sliding-window layers is not supported",
        ),
        (
            {"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 0.0}}},
            r"linear rope scaling needs a factor > 0",
        ),
    ],
)
def test_unsupported_gemma3_configs_are_named(change: dict[str, Any], message: str) -> None:
    hf = _gemma3_270m()
    for key, value in change.items():
        if key == "rope_parameters":
            for layer_type, params in value.items():
                hf.rope_parameters[layer_type].update(params)
        else:
            setattr(hf, key, value)
    with pytest.raises(ModelLoadError, match=message):
        ModelConfig.from_hf(hf)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"layer_types": ("full_attention",)}, r"layer_types names 1 layers but the model has 2"),
        ({"layer_types": ("full_attention", "chunked_attention")}, r"'chunked_attention'"),
        ({"sliding_window": None}, r"sliding_attention layers but the config names no"),
        ({"hidden_act": "relu"}, r"activation 'relu' is not supported"),
        ({"attn_logit_softcapping": 0.0}, r"attn_logit_softcapping must be > 0"),
    ],
)
def test_inconsistent_gemma_fields_are_named(change: dict[str, Any], message: str) -> None:
    base: dict[str, Any] = dict(
        architecture="Gemma3ForCausalLM", vocab_size=300, hidden_size=64, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=64, rms_norm_eps=1e-6,
        rope_theta=1e6, rope_scaling=None, max_position_embeddings=64, tie_word_embeddings=True,
        sliding_window=16, hidden_act="gelu_pytorch_tanh",
        layer_types=("sliding_attention", "full_attention"),
    )
    ModelConfig(**base)
    with pytest.raises(ModelLoadError, match=message):
        ModelConfig(**{**base, **change})


def _tiny_config(**changes: Any) -> ModelConfig:
    return dataclasses.replace(ModelConfig.from_hf(tiny_hf_model("gemma3").config), **changes)


def test_embeddings_are_scaled_by_sqrt_hidden_in_the_models_dtype() -> None:
    cfg = _tiny_config(hidden_size=640, num_heads=4, head_dim=32)
    model = gemma.GemmaForCausalLM(cfg, ModelOptions(max_model_len=32), dtype=torch.bfloat16)
    assert model.model.embed_scale.dtype == torch.bfloat16
    assert float(model.model.embed_scale) == 25.25  # sqrt(640) = 25.298... in bf16
    assert model.model.norm.weight.dtype == torch.float32  # (1 + w) stays fp32
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert [layer.local for layer in model.model.layers] == [True, False, True]
    assert model.model.rotary_local is not None
    assert not torch.equal(model.model.rotary.cos, model.model.rotary_local.cos)


def test_the_deterministic_mode_refuses_a_final_logit_softcap() -> None:
    """Gemma 3 runs in the deterministic mode (every layer on the native kernels: its GELU too);
    Gemma 2's final soft-cap is a torch tanh, which the mode refuses by name."""
    cfg = _tiny_config()
    det = ModelOptions(deterministic=True, max_model_len=32)
    if cpu_native.available():
        gemma.GemmaForCausalLM(cfg, det)
    capped = dataclasses.replace(cfg, final_logit_softcapping=30.0)
    with pytest.raises(cpu_native.DeterministicModeUnavailable, match="final logit soft-cap"):
        gemma.GemmaForCausalLM(capped, det)


def test_a_context_past_the_window_is_served() -> None:
    model = gemma.GemmaForCausalLM(_tiny_config(), ModelOptions(max_model_len=128))
    assert model.max_model_len == 128
    assert [layer.self_attn.window for layer in model.model.layers] == [
        WINDOW, None, WINDOW]


# -- the whole model against transformers --------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, Path]]:
    out = {}
    for kind in ("gemma3", "gemma2-nocap", "gemma2"):
        hf = tiny_hf_model(kind, seed=2)
        out[kind] = (hf, save_checkpoint(hf, tmp_path_factory.mktemp(kind)))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gemma3", "gemma2-nocap"])
def test_within_the_window_matches_transformers(
    kind: str, checkpoints: dict[str, tuple[Any, Path]]
) -> None:
    """Prompts of 1..20 tokens and 12 greedy tokens: every position within the window."""
    hf, path = checkpoints[kind]
    ours, _, cfg = load_model(str(path))
    assert cfg.architecture == type(hf).__name__
    prompts = _prompts(cfg.vocab_size, (1, 2, 7, 13, 20), seed=3)
    _same_as_transformers(ours, hf, prompts, 12, WINDOW)


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind", ["gemma3", "gemma2", "gemma2-nocap"]
)
def test_past_the_window_matches_transformers(kind: str, tmp_path: Path) -> None:
    """A window of 8 on the sliding layers, prompts up to 40 tokens and 16 greedy tokens: the
    sliding layers see their last 8 positions, the full one every position."""
    hf = tiny_hf_model(kind, seed=4, sliding_window=8)
    ours, _, cfg = load_model(str(save_checkpoint(hf, tmp_path / kind)))
    assert cfg.layer_windows() == (8, None, 8)
    prompts = _prompts(cfg.vocab_size, (1, 5, 9, 17, 40), seed=5)
    _same_as_transformers(ours, hf, prompts, 16, 64)


@pytest.mark.slow
def test_gemma2_with_score_capping_within_the_window(
    checkpoints: dict[str, tuple[Any, Path]],
) -> None:
    hf, path = checkpoints["gemma2"]
    ours, _, cfg = load_model(str(path))
    assert cfg.attn_logit_softcapping == 50.0
    _same_as_transformers(ours, hf, _prompts(cfg.vocab_size, (3, 20), seed=6), 12, WINDOW)


# -- GGUF ---------------------------------------------------------------------------------------

# transformers reads a Gemma file's query_pre_attn_scalar as its config's default, 256, and
# llama.cpp scales by head_dim: only head_dim 256 lets transformers be the reference. Its layer
# pattern is the default one too (every 6th layer global): six layers give one global layer.
GGUF_DIMS: dict[str, Any] = dict(
    hidden_size=256, intermediate_size=512, num_attention_heads=2, num_key_value_heads=1,
    head_dim=256, query_pre_attn_scalar=256, num_hidden_layers=6, layer_types=None,
)


def _hf_from_gguf(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("kind", "qtype"),
    [
        ("gemma3", "F32"),
        ("gemma3", "Q8_0"),
        ("gemma3", "Q4_K"),
        ("gemma2", "F32"),
        ("gemma2", "Q6_K"),
    ],
)
def test_a_gemma_gguf_matches_transformers_on_the_same_file(
    kind: str, qtype: str, tmp_path: Path
) -> None:
    extra: dict[str, Any] = {}
    if kind == "gemma3":  # the rotary bases transformers takes for a gemma3 file
        extra["rope_parameters"] = {
            "full_attention": {"rope_type": "default", "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        }
    src = tiny_hf_model(kind, seed=7, **GGUF_DIMS, **extra)
    path = write_gguf(src, tmp_path / f"{kind}-{qtype}.gguf", qtype)
    names = {t.name for t in gguf.GGUFReader(str(path)).tensors}
    assert {"blk.0.post_attention_norm.weight", "blk.0.post_ffw_norm.weight"} <= names
    ours, _, cfg = load_model(str(path))
    assert cfg.architecture == type(src).__name__ and cfg.tie_word_embeddings
    assert cfg.layer_windows() == (
        (WINDOW,) * 5 + (None,) if kind == "gemma3" else (WINDOW, None) * 3
    )
    assert cfg.query_pre_attn_scalar == 256 and cfg.qk_norm == (kind == "gemma3")
    ref = _hf_from_gguf(path)
    prompts = _prompts(cfg.vocab_size, (4, 13), seed=8)
    _same_as_transformers(ours, ref, prompts, 12, WINDOW)


@pytest.mark.slow
def test_gguf_metadata_beyond_llama_cpps_defaults(tmp_path: Path) -> None:
    """A gemma3 file naming its sliding pattern (a per-layer list), the sliding layers' rotary
    base (20000) and linear scaling of the global layers (factor 8); the reference is
    ``transformers``' Gemma 3 configured so, holding the file's tensors (``transformers`` reads
    none of these keys)."""
    pattern = [False, True, True]
    src = tiny_hf_model(
        "gemma3",
        seed=9,
        intermediate_size=128,  # whole Q8_0 blocks
        query_pre_attn_scalar=32,  # llama.cpp scales by head_dim ** -0.5
        layer_types=["sliding_attention" if p else "full_attention" for p in pattern],
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 20000.0},
        },
    )
    path = write_gguf(
        src,
        tmp_path / "meta.gguf",
        "Q8_0",
        metadata=dict(
            sliding_window_pattern=pattern,
            rope_freq_base_swa=20000.0,
            rope_scaling_type=gguf.RopeScalingType.LINEAR,
            rope_scaling_factor=8.0,
        ),
    )
    ours, _, cfg = load_model(str(path))
    assert cfg.layer_windows() == (None, WINDOW, WINDOW)
    assert cfg.rope_scaling == LinearScaling(8.0) and cfg.rope_local_theta == 20000.0
    assert cfg.query_pre_attn_scalar == 32
    ref = reference_from_file(path, src)
    _same_as_transformers(ours, ref, _prompts(cfg.vocab_size, (5, 18), seed=10), 12, WINDOW)


def _metadata_only(path: Path, arch: str, layers: int, **keys: Any) -> Path:
    """A GGUF file of ``arch`` with the config metadata alone (no tensors, no tokenizer)."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_context_length(8192)
    w.add_embedding_length(keys.pop("hidden", 4608))
    w.add_feed_forward_length(256)
    w.add_head_count(keys.pop("heads", 32))
    w.add_head_count_kv(16)
    w.add_key_length(keys.pop("head_dim", 128))
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(300)
    for key, value in keys.items():
        getattr(w, f"add_{key}")(value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize(
    ("arch", "layers", "scalar"),
    [("gemma2", 46, 144), ("gemma2", 42, 128), ("gemma3", 62, 168), ("gemma3", 34, 128)],
)
def test_gguf_attention_scale_follows_llama_cpp(
    arch: str, layers: int, scalar: int, tmp_path: Path
) -> None:
    """llama.cpp scales the 27B models (Gemma 2: 46 layers, hidden 4608, 32 heads; Gemma 3: 62
    layers, hidden 5376) by (hidden / heads) ** -0.5, the others by head_dim ** -0.5."""
    from tierserve.replica.models.gguf_loader import gguf_config, open_gguf

    hidden = 5376 if arch == "gemma3" else 4608
    path = _metadata_only(tmp_path / "m.gguf", arch, layers, hidden=hidden, sliding_window=4096)
    cfg = gguf_config(open_gguf(path), path)
    assert cfg.query_pre_attn_scalar == scalar and cfg.head_dim == 128
    period = 6 if arch == "gemma3" else 2
    assert cfg.layer_windows() == tuple(
        4096 if i % period < period - 1 else None for i in range(layers)
    )


def test_gguf_gemma_errors_and_defaults(tmp_path: Path) -> None:
    from tierserve.replica.models.gguf_loader import gguf_config, open_gguf

    no_window = _metadata_only(tmp_path / "a.gguf", "gemma3", 4)
    cfg = gguf_config(open_gguf(no_window), no_window)
    assert cfg.layer_windows() == (None,) * 4 and cfg.rope_local_theta == 10000.0

    short = _metadata_only(
        tmp_path / "b.gguf", "gemma3", 4, sliding_window=64, sliding_window_pattern=[True] * 3
    )
    with pytest.raises(ModelLoadError, match=r"sliding_window_pattern names 3 layers; .* has 4"):
        gguf_config(open_gguf(short), short)

    yarn = _metadata_only(
        tmp_path / "c.gguf", "gemma3", 4, rope_scaling_type=gguf.RopeScalingType.YARN
    )
    with pytest.raises(ModelLoadError, match=r"rope scaling 'yarn' is not supported"):
        gguf_config(open_gguf(yarn), yarn)


@pytest.mark.slow
def test_a_gemma_gguf_missing_a_sandwich_norm_names_it(tmp_path: Path) -> None:
    src = tiny_hf_model("gemma3", seed=11)
    path = write_gguf(src, tmp_path / "m.gguf", skip=("blk.1.post_ffw_norm.weight",))
    with pytest.raises(
        ModelLoadError,
        match=r"model\.layers\.1\.post_feedforward_layernorm\.weight "
        r"\(blk\.1\.post_ffw_norm\.weight in the file\)",
    ):
        load_model(str(path))


def test_gemma_sqrt_hidden_is_what_transformers_multiplies_by() -> None:
    """The embedding scale: ``hidden ** 0.5`` in the model's dtype, as ``transformers``' scaled
    embedding casts it."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3TextScaledWordEmbedding

    emb = Gemma3TextScaledWordEmbedding(10, 640, 0, embed_scale=640**0.5).to(torch.bfloat16)
    assert float(emb.embed_scale.to(torch.bfloat16)) == 25.25 != math.sqrt(640)


@pytest.mark.slow
def test_gemma3_through_the_engine_in_chunks_and_across_preemption(
    checkpoints: dict[str, tuple[Any, Path]],
) -> None:
    """The whole engine (``LLM``: linear layers packed for the native kernel, chunked prefill,
    preemption and recompute) on the tiny Gemma 3 checkpoint: greedy tokens equal to
    ``transformers``' ``generate``, every position within the window."""
    from tierserve.replica.llm import LLM
    from tierserve.replica.sampler import SamplingParams

    hf, path = checkpoints["gemma3"]
    prompts = _prompts(hf.config.vocab_size, (3, 9, 14, 20), seed=12)
    want = _hf_greedy(hf, prompts, 12)
    llm = LLM(str(path), device="cpu", dtype="float32", num_kv_blocks=5, block_size=8,
              max_num_seqs=4, max_model_len=WINDOW, prefill_chunk_tokens=7)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert llm.stats().preemptions > 0
