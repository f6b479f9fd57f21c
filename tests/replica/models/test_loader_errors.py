"""The loader's errors: each a ``ModelLoadError`` (a ``ValueError``) naming what was wrong."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from tests.replica.models.helpers import save_checkpoint, tiny_hf_model
from tierserve.replica.models.config import ModelConfig
from tierserve.replica.models.embedded import build_tokenizer
from tierserve.replica.models.llama import ModelOptions
from tierserve.replica.models.loader import ModelLoadError, load_model, load_tokenizer, read_config


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_checkpoint(tiny_hf_model("llama-gqa"), tmp_path_factory.mktemp("ckpt"))


def _copy(src: Path, dst: Path, skip: tuple[str, ...] = ()) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        if f.name not in skip:
            (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _edit_config(path: Path, **changes: Any) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_model_load_error_is_a_value_error() -> None:
    assert issubclass(ModelLoadError, ValueError)


SUPPORTED = (
    "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Phi3ForCausalLM, "
    "Gemma2ForCausalLM, Gemma3ForCausalLM, MixtralForCausalLM, Qwen2MoeForCausalLM, "
    "Qwen3MoeForCausalLM"
)


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=300)
    cfg.architectures = ["GPT2LMHeadModel"]
    cfg.save_pretrained(str(tmp_path))
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel") as err:
        load_model(str(tmp_path))
    assert str(err.value).endswith(f"; supported: {SUPPORTED}")  # the supported ones are listed


def test_a_qwen3_relative_without_its_layers_is_refused_by_name(tmp_path: Path) -> None:
    """Qwen3's mixture-of-experts sibling shares its config fields but not its layers: a dense
    Qwen3 checkpoint labelled Qwen3-MoE lacks the router and experts, and says so."""
    path = save_checkpoint(tiny_hf_model("qwen3"), tmp_path / "c")
    _edit_config(path, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe")
    with pytest.raises(
        ModelLoadError,
        match=r"lacks \d+ tensor\(s\): model\.layers\.0\.mlp\.gate\.weight, "
        r"model\.layers\.0\.mlp\.experts\.0\.gate_proj\.weight",
    ):
        load_model(str(path))


@pytest.mark.parametrize(
    ("cls", "arch"),
    [(transformers.LlamaConfig, "LlamaForCausalLM"), (transformers.Qwen3Config, "Qwen3ForCausalLM")],
)
def test_architecture_falls_back_to_model_type(cls: Any, arch: str) -> None:
    cfg = cls(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=1)
    assert cfg.architectures is None
    assert ModelConfig.from_hf(cfg).architecture == arch


def test_a_qwen3_config_reads_its_head_dim_norms_and_biases() -> None:
    """Qwen3: head_dim as the config says (not hidden / heads), q/k norms, no biases unless
    ``attention_bias`` (then on q, k, v and o alike), its window only where its layers use it."""
    base: dict[str, Any] = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                head_dim=32, num_hidden_layers=2, max_position_embeddings=512)
    cfg = ModelConfig.from_hf(transformers.Qwen3Config(**base))
    assert (cfg.head_dim, cfg.q_size, cfg.kv_size) == (32, 128, 64)
    assert cfg.qk_norm and not cfg.qkv_bias and not cfg.o_bias and cfg.sliding_window is None
    biased = ModelConfig.from_hf(transformers.Qwen3Config(**base, attention_bias=True))
    assert biased.qkv_bias and biased.o_bias
    windowed = transformers.Qwen3Config(
        **base, use_sliding_window=True, sliding_window=128, max_window_layers=1
    )
    assert ModelConfig.from_hf(windowed).sliding_window == 128
    assert not ModelConfig.from_hf(transformers.Qwen2Config(**base)).qk_norm


def test_a_qwen3_checkpoint_without_its_q_norm_names_it(tmp_path: Path) -> None:
    path = save_checkpoint(tiny_hf_model("qwen3"), tmp_path / "c")
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.1.self_attn.q_norm.weight"]
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(
        ModelLoadError, match=r"lacks 1 tensor\(s\): model\.layers\.1\.self_attn\.q_norm\.weight$"
    ):
        load_model(str(path))


def test_missing_config(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"config\.json"):
        load_model(str(tmp_path))


def test_missing_weight_files(checkpoint: Path, tmp_path: Path) -> None:
    path = _copy(checkpoint, tmp_path / "c", skip=("model.safetensors",))
    with pytest.raises(ModelLoadError, match="no weight files"):
        load_model(str(path))


def test_missing_shard_named_in_the_index(tmp_path: Path) -> None:
    path = save_checkpoint(tiny_hf_model("llama"), tmp_path / "c", max_shard_size="40KB")
    shard = sorted(path.glob("model-*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(ModelLoadError, match=shard.name):
        load_model(str(path))


def test_missing_tensor_is_named(checkpoint: Path, tmp_path: Path) -> None:
    path = _copy(checkpoint, tmp_path / "c")
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(str(path))


def test_shape_mismatch_names_tensor_and_shapes(checkpoint: Path, tmp_path: Path) -> None:
    path = _copy(checkpoint, tmp_path / "c")
    _edit_config(path, intermediate_size=128)
    with pytest.raises(ModelLoadError, match=r"mlp\.\w+_proj\.weight .*136.*implies.*128"):
        load_model(str(path))


def test_missing_tokenizer(checkpoint: Path, tmp_path: Path) -> None:
    path = _copy(checkpoint, tmp_path / "c", skip=("tokenizer.json", "tokenizer_config.json"))
    with pytest.raises(ModelLoadError, match="tokenizer"):
        load_model(str(path))


def test_unsupported_rope_type_is_named(checkpoint: Path, tmp_path: Path) -> None:
    path = _copy(checkpoint, tmp_path / "c")
    rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    _edit_config(path, rope_parameters=rope, rope_scaling=rope)
    with pytest.raises(
        ModelLoadError, match=r"'dynamic'.*supported: default, linear, llama3, yarn, longrope$"
    ):
        load_model(str(path))


def test_sliding_window_shorter_than_the_context_is_served(tmp_path: Path) -> None:
    """The window is applied per layer (tests/replica/models/test_sliding_windows.py checks the
    tokens); only a context beyond max_position_embeddings is refused."""
    hf = tiny_hf_model("mistral", sliding_window=128, max_position_embeddings=512)
    path = save_checkpoint(hf, tmp_path / "c")
    model, _, _ = load_model(str(path))
    assert model.max_model_len == 512
    assert [layer.self_attn.window for layer in model.model.layers] == [128, 128]
    with pytest.raises(ModelLoadError, match="exceeds the model's max_position_embeddings 512"):
        load_model(str(path), options=ModelOptions(max_model_len=1024))


def test_not_a_directory_nor_a_hub_id(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="not a checkpoint directory"):
        load_model(str(tmp_path / "nothing" / "here"))
    with pytest.raises(ModelLoadError):
        load_tokenizer("./no-such-dir")


def test_generation_config_adds_end_of_sequence_ids(checkpoint: Path, tmp_path: Path) -> None:
    path = _copy(checkpoint, tmp_path / "c")
    _edit_config(path, eos_token_id=2)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2, 9]}))
    assert read_config(path).eos_token_ids == (2, 7, 9)


def test_dtype_and_tokenizer_of_a_checkpoint(checkpoint: Path) -> None:
    model, tok, cfg = load_model(str(checkpoint), dtype=torch.bfloat16)
    assert model.lm_head.weight.dtype == torch.bfloat16
    assert model.model.rotary.cos.dtype == torch.bfloat16
    assert cfg.num_kv_heads == 2 and cfg.head_dim == 16
    assert tok.encode("abc") == build_tokenizer().encode("abc")
    assert load_tokenizer(str(checkpoint)).decode([104, 105]) == "hi"
