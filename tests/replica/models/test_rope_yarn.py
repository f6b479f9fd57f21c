"""YaRN rotary scaling: the parsed parameters, the inverse frequencies and the attention factor on
the cos/sin tables match ``transformers``' own ``ROPE_INIT_FUNCTIONS["yarn"]`` and rotary
embedding, for the ``rope_parameters`` (transformers 5) and legacy ``rope_scaling`` forms. The
whole model against ``transformers`` is ``test_vs_transformers.py``'s ``qwen2-yarn`` kind."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

from tierserve.replica.models.config import ModelConfig, ModelLoadError, YarnScaling
from tierserve.replica.models.layers import RotaryEmbedding, rope_inv_freq

# (head_dim, theta, max_position_embeddings, yarn parameters)
CASES: list[tuple[int, float, int, dict[str, Any]]] = [
    (16, 10000.0, 512, dict(factor=4.0, original_max_position_embeddings=32)),
    (128, 1e6, 131072, dict(factor=4.0, original_max_position_embeddings=32768)),  # Qwen2.5
    (64, 10000.0, 4096, dict(factor=8.0, original_max_position_embeddings=512,
                             beta_fast=16, beta_slow=2, truncate=False)),
    (32, 500000.0, 8192, dict(factor=2.0, original_max_position_embeddings=4096,
                              attention_factor=0.9)),
    (64, 10000.0, 163840, dict(factor=40.0, original_max_position_embeddings=4096,
                               mscale=1.0, mscale_all_dim=0.707)),  # DeepSeek-style
    (64, 10000.0, 163840, dict(factor=40.0, original_max_position_embeddings=4096,
                               mscale=0.707, mscale_all_dim=0.707)),  # ratio 1
]


def _hf_config(head_dim: int, theta: float, max_pos: int, yarn: dict[str, Any]) -> Any:
    return transformers.Qwen2Config(
        vocab_size=300, hidden_size=4 * head_dim, num_attention_heads=4, num_key_value_heads=2,
        head_dim=head_dim, intermediate_size=64, num_hidden_layers=1,
        max_position_embeddings=max_pos,
        rope_parameters=dict(rope_type="yarn", rope_theta=theta, **yarn),
    )


@pytest.mark.parametrize("case", CASES, ids=range(len(CASES)))
def test_frequencies_and_attention_factor_match_transformers(
    case: tuple[int, float, int, dict[str, Any]],
) -> None:
    head_dim, theta, max_pos, yarn = case
    hf = _hf_config(head_dim, theta, max_pos, yarn)
    cfg = ModelConfig.from_hf(hf)
    scaling = cfg.rope_scaling
    assert isinstance(scaling, YarnScaling) and cfg.rope_theta == theta
    want_inv, want_factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    assert scaling.attention_factor == pytest.approx(want_factor, rel=1e-12)
    got_inv = rope_inv_freq(head_dim, theta, scaling)
    torch.testing.assert_close(got_inv, want_inv, rtol=1e-6, atol=0)
    assert not torch.allclose(got_inv, rope_inv_freq(head_dim, theta, None))
    # The tables carry the factor, as transformers' cos/sin do.
    positions = torch.tensor([0, 1, 31, 32, 33, 100, 511])
    rotary = RotaryEmbedding(head_dim, 512, theta, scaling)
    cos, sin = rotary(positions)
    hf_cos, hf_sin = Qwen2RotaryEmbedding(hf)(torch.zeros(1), positions[None])
    half = head_dim // 2
    torch.testing.assert_close(cos[:, 0], hf_cos[0, :, :half], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sin[:, 0], hf_sin[0, :, :half], rtol=1e-5, atol=1e-5)
    assert ModelConfig.from_json(cfg.to_json()) == cfg


def _legacy(**rope: Any) -> SimpleNamespace:
    return SimpleNamespace(
        architectures=["Qwen2ForCausalLM"], vocab_size=300, hidden_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, intermediate_size=64, rms_norm_eps=1e-6,
        max_position_embeddings=131072, rope_theta=1e6, rope_scaling=rope,
    )


def test_legacy_rope_scaling_form() -> None:
    """Qwen2.5's documented form (``type``, no ``rope_type``), and a missing
    ``original_max_position_embeddings`` taken from ``max_position_embeddings``."""
    cfg = ModelConfig.from_hf(
        _legacy(type="yarn", factor=4.0, original_max_position_embeddings=32768)
    )
    assert cfg.rope_theta == 1e6
    assert cfg.rope_scaling == YarnScaling(
        factor=4.0, original_max_position_embeddings=32768,
        attention_factor=pytest.approx(0.1 * torch.log(torch.tensor(4.0)).item() + 1),
    )
    bare = ModelConfig.from_hf(_legacy(rope_type="yarn", factor=2.0)).rope_scaling
    assert isinstance(bare, YarnScaling) and bare.original_max_position_embeddings == 131072
    with pytest.raises(ModelLoadError, match="yarn"):
        ModelConfig.from_hf(_legacy(rope_type="yarn", factor=2.0, attention_factor=-1.0))
