"""Phi-3 and Phi-4-mini (``Phi3ForCausalLM``): the config (partial rotary, LongRoPE, the sliding
window), the head-dim permutation that runs partial rotary on the whole-head rotary kernels, the
LongRoPE tables against ``transformers``' own, both checkpoint layouts (fused and split), the
errors, and the whole engine against ``transformers``' ``generate``. The model against
``transformers`` logit by logit is ``test_vs_transformers.py``'s ``phi3*`` kinds; GGUF files are
in ``test_gguf.py``."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding, apply_rotary_pos_emb

from tests.replica.models.helpers import (
    PHI3_LONG_FACTOR,
    PHI3_LONGROPE_ORIGINAL,
    PHI3_SHORT_FACTOR,
    save_checkpoint,
    tiny_hf_model,
)
from tierserve.replica.models.config import LongRopeScaling, ModelConfig, ModelLoadError
from tierserve.replica.models.layers import (
    RotaryEmbedding,
    apply_rotary_,
    permute_rotary_rows_,
    rope_inv_freq,
    rotary_permutation,
)
from tierserve.replica.models.loader import load_model

# Phi-4-mini's shape: head_dim 128 of which 96 rotate, LongRoPE from 4096 to 131072 positions
# (48 factors each; these are made up, increasing as the real ones do).
PHI4_MINI: dict[str, Any] = dict(
    vocab_size=300, hidden_size=3072, num_attention_heads=24, num_key_value_heads=8,
    intermediate_size=64, num_hidden_layers=1, max_position_embeddings=131072,
    original_max_position_embeddings=4096, tie_word_embeddings=True, sliding_window=262144,
    partial_rotary_factor=0.75, pad_token_id=None, bos_token_id=None, eos_token_id=None,
    rope_scaling=dict(
        type="longrope",
        short_factor=[1.0 + 0.05 * i for i in range(48)],
        long_factor=[1.0 + 1.5 * i for i in range(48)],
    ),
)


def _phi4_mini(**changes: Any) -> Any:
    return transformers.Phi3Config(**{**PHI4_MINI, **changes})


# ----------------------------------------------------------------------------- the permutation


def test_rotary_permutation_puts_each_rotated_pair_a_half_head_apart() -> None:
    # head_dim 8, 4 rotate: pairs (0, 2), (1, 3) -> (0, 4), (1, 5); 4..7 pass through
    assert rotary_permutation(8, 4).tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
    assert rotary_permutation(8, 8).tolist() == list(range(8))  # whole-head rotary: identity
    perm = rotary_permutation(128, 96)
    assert sorted(perm.tolist()) == list(range(128))
    for i in range(48):  # Phi-4-mini: pair (i, i + 48) lands on (i, i + 64)
        assert (perm[i].item(), perm[i + 64].item()) == (i, i + 48)
    assert set(perm[48:64].tolist()) | set(perm[112:].tolist()) == set(range(96, 128))
    for bad in ((8, 3), (8, 10), (8, 0), (7, 4)):
        with pytest.raises(ValueError, match="rotary_dim must be even"):
            rotary_permutation(*bad)


def test_permute_rotary_rows_reorders_each_head_and_checks_its_rows() -> None:
    perm = rotary_permutation(8, 4)
    w = torch.arange(2 * 8 * 3, dtype=torch.float32).view(16, 3)
    want = torch.cat([w[:8][perm], w[8:][perm]])
    permute_rotary_rows_(w, 2, perm)
    assert torch.equal(w, want)
    bias = torch.arange(16.0)
    permute_rotary_rows_(bias, 2, perm)
    assert bias[:8].tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
    with pytest.raises(ValueError, match=r"12 rows are not 2 heads of 8 dims"):
        permute_rotary_rows_(torch.zeros(12, 3), 2, perm)


@pytest.mark.parametrize("longrope", [False, True], ids=["default", "longrope"])
def test_partial_rotary_on_permuted_heads_is_transformers_partial_rotary(longrope: bool) -> None:
    """Each q/k head permuted, rotated over the whole head by our tables, permuted back, is what
    ``transformers``' Phi-3 rotary makes of it (the rotated dims turned, the rest as they were,
    not scaled by LongRoPE's attention factor); so every q.k is the same."""
    hf = _phi4_mini(
        hidden_size=24 * 32, max_position_embeddings=512, original_max_position_embeddings=128,
        rope_scaling=dict(type="longrope", short_factor=[1.0 + 0.1 * i for i in range(12)],
                          long_factor=[2.0 + i for i in range(12)]) if longrope else None,
    )
    cfg = ModelConfig.from_hf(hf)
    head_dim, rot = 32, 24
    assert (cfg.head_dim, cfg.rotary_dim) == (head_dim, rot)
    assert isinstance(cfg.rope_scaling, LongRopeScaling) == longrope
    gen = torch.Generator().manual_seed(0)
    positions = torch.tensor([0, 1, 5, 77, 127])
    q = torch.randn(len(positions), 3, head_dim, generator=gen)
    k = torch.randn(len(positions), 3, head_dim, generator=gen)

    cos, sin = Phi3RotaryEmbedding(hf)(q, positions[None])
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    want_q, want_k = want_q[0].transpose(0, 1), want_k[0].transpose(0, 1)

    rotary = RotaryEmbedding(head_dim, 128, cfg.rope_theta, cfg.rope_scaling, rotary_dim=rot)
    assert torch.equal(rotary.cos[:, rot // 2 :], torch.ones(128, (head_dim - rot) // 2))
    assert torch.equal(rotary.sin[:, rot // 2 :], torch.zeros(128, (head_dim - rot) // 2))
    perm = rotary_permutation(head_dim, rot)
    got_q, got_k = q[:, :, perm], k[:, :, perm]
    ours_cos, ours_sin = rotary(positions)
    apply_rotary_(got_q, ours_cos, ours_sin)
    apply_rotary_(got_k, ours_cos, ours_sin)
    inverse = torch.argsort(perm)
    torch.testing.assert_close(got_q[:, :, inverse], want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_k[:, :, inverse], want_k, rtol=1e-5, atol=1e-5)
    # The pass-through dims are the inputs' own bits.
    assert torch.equal(got_q[:, :, inverse][..., rot:], q[..., rot:])
    torch.testing.assert_close(
        torch.einsum("thd,shd->hts", got_q, got_k),
        torch.einsum("thd,shd->hts", want_q, want_k),
        rtol=1e-5, atol=1e-4,
    )


# ----------------------------------------------------------------------------- LongRoPE tables


def _hf_tables(hf: Any, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``transformers``' Phi-3 cos/sin of ``positions`` (one sequence), first half of each."""
    cos, sin = Phi3RotaryEmbedding(hf)(torch.zeros(1), positions[None])
    half = cos.shape[-1] // 2
    return cos[0, :, :half], sin[0, :, :half]


def test_longrope_short_factors_within_the_original_context_match_transformers() -> None:
    hf = _phi4_mini()
    cfg = ModelConfig.from_hf(hf)
    scaling = cfg.rope_scaling
    assert isinstance(scaling, LongRopeScaling) and cfg.rotary_dim == 96
    want_inv, want_factor = ROPE_INIT_FUNCTIONS["longrope"](hf, "cpu")
    assert scaling.attention_factor == pytest.approx(want_factor, rel=1e-12)
    assert scaling.attention_factor == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)))
    assert scaling.factors(4096) == scaling.short_factor
    torch.testing.assert_close(rope_inv_freq(96, cfg.rope_theta, scaling, 4096), want_inv,
                               rtol=1e-6, atol=0)
    rotary = RotaryEmbedding(128, 4096, cfg.rope_theta, scaling, rotary_dim=96)
    positions = torch.tensor([0, 1, 17, 1000, 4095])
    hf_cos, hf_sin = _hf_tables(hf, positions)
    cos, sin = rotary(positions)
    torch.testing.assert_close(cos[:, 0, :48], hf_cos, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sin[:, 0, :48], hf_sin, rtol=1e-5, atol=1e-5)
    assert torch.equal(cos[:, 0, 48:], torch.ones(5, 16))  # pass-through: not scaled
    assert torch.equal(sin[:, 0, 48:], torch.zeros(5, 16))


def test_longrope_long_factors_past_the_original_context_match_transformers() -> None:
    """An engine serving more than ``original_max_position_embeddings`` positions takes the long
    factors for every position: ``transformers``' tables for a sequence that long (its rope init
    at ``seq_len`` past the original context, and its rotary embedding once a position passes
    it), at early positions too."""
    hf = _phi4_mini()
    cfg = ModelConfig.from_hf(hf)
    scaling = cfg.rope_scaling
    assert isinstance(scaling, LongRopeScaling)
    max_len = 4096 + 64
    assert scaling.factors(max_len) == scaling.long_factor != scaling.short_factor
    want_inv, want_factor = ROPE_INIT_FUNCTIONS["longrope"](hf, "cpu", seq_len=max_len)
    got_inv = rope_inv_freq(96, cfg.rope_theta, scaling, max_len)
    torch.testing.assert_close(got_inv, want_inv, rtol=1e-6, atol=0)
    assert not torch.allclose(got_inv, rope_inv_freq(96, cfg.rope_theta, scaling, 4096))
    rotary = RotaryEmbedding(128, max_len, cfg.rope_theta, scaling, rotary_dim=96)
    positions = torch.tensor([0, 3, 2000, 4095, 4096, max_len - 1])
    hf_cos, hf_sin = _hf_tables(hf, positions)  # max position > original: the long factors
    cos, sin = rotary(positions)
    torch.testing.assert_close(cos[:, 0, :48], hf_cos, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sin[:, 0, :48], hf_sin, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        cos[:, 0, :48] / want_factor, (positions[:, None].float() * want_inv).cos(),
        rtol=1e-5, atol=1e-5,
    )


# ----------------------------------------------------------------------------- config


def test_a_phi4_mini_config() -> None:
    """Phi-4-mini's config.json form: ``partial_rotary_factor`` on the config, LongRoPE in the
    legacy ``rope_scaling`` with ``type``, ``original_max_position_embeddings`` on the config, a
    tied head, no biases; it survives ``to_json``/``from_json`` (the GGUF prepared cache)."""
    cfg = ModelConfig.from_hf(_phi4_mini())
    assert cfg.architecture == "Phi3ForCausalLM"
    assert (cfg.head_dim, cfg.rotary_dim, cfg.rope_dim, cfg.num_kv_heads) == (128, 96, 96, 8)
    assert cfg.tie_word_embeddings and not (cfg.qkv_bias or cfg.o_bias or cfg.qk_norm)
    assert cfg.sliding_window == 262144
    scaling = cfg.rope_scaling
    assert isinstance(scaling, LongRopeScaling)
    assert scaling.original_max_position_embeddings == 4096
    assert scaling.short_factor == tuple(PHI4_MINI["rope_scaling"]["short_factor"])
    assert ModelConfig.from_json(cfg.to_json()) == cfg
    # An explicit attention_factor, or factor, wins over max / original.
    given = ModelConfig.from_hf(_phi4_mini(rope_scaling={
        **PHI4_MINI["rope_scaling"], "attention_factor": 1.5}))
    assert isinstance(given.rope_scaling, LongRopeScaling)
    assert given.rope_scaling.attention_factor == 1.5
    by_factor = ModelConfig.from_hf(_phi4_mini(rope_scaling={
        **PHI4_MINI["rope_scaling"], "factor": 4.0}))
    assert isinstance(by_factor.rope_scaling, LongRopeScaling)
    assert by_factor.rope_scaling.attention_factor == pytest.approx(
        math.sqrt(1 + math.log(4) / math.log(4096)))


def test_a_phi3_mini_4k_config_slides_its_window_over_every_layer() -> None:
    """Phi-3-mini-4k: full rotary, no rope scaling, a window of 2047 on every layer (no
    ``layer_types`` to consult), so a context past the window is served with it."""
    hf = transformers.Phi3Config(
        vocab_size=300, hidden_size=64, num_attention_heads=4, num_hidden_layers=2,
        intermediate_size=64, max_position_embeddings=4096, sliding_window=2047,
        pad_token_id=None, bos_token_id=None, eos_token_id=None,
    )
    cfg = ModelConfig.from_hf(hf)
    assert (cfg.rotary_dim, cfg.rope_scaling, cfg.sliding_window) == (None, None, 2047)
    assert cfg.num_kv_heads == 4 and cfg.rope_dim == cfg.head_dim == 16
    assert cfg.layer_types is None and cfg.layer_windows() == (2047, 2047)
    cfg.check_context(4096)
    fallback = transformers.Phi3Config(hidden_size=64, num_attention_heads=4, num_hidden_layers=1)
    assert fallback.architectures is None
    assert ModelConfig.from_hf(fallback).architecture == "Phi3ForCausalLM"


def _raw(**changes: Any) -> SimpleNamespace:
    """A config as an object of plain attributes (``transformers`` would rewrite some fields)."""
    base: dict[str, Any] = dict(
        architectures=["Phi3ForCausalLM"], vocab_size=300, hidden_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, intermediate_size=64, rms_norm_eps=1e-5,
        max_position_embeddings=512, original_max_position_embeddings=128, rope_theta=1e4,
        rope_scaling=None,
    )
    return SimpleNamespace(**{**base, **changes})


def test_the_legacy_su_rope_type_is_longrope() -> None:
    cfg = ModelConfig.from_hf(_raw(rope_scaling=dict(
        type="su", short_factor=[1.0] * 8, long_factor=[2.0] * 8)))
    factor = math.sqrt(1 + math.log(4) / math.log(128))
    assert cfg.rope_scaling == LongRopeScaling(
        short_factor=(1.0,) * 8, long_factor=(2.0,) * 8, original_max_position_embeddings=128,
        attention_factor=factor,
    )


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        (dict(architectures=["LlamaForCausalLM"], partial_rotary_factor=0.5),
         r"LlamaForCausalLM: partial rotary embeddings \(partial_rotary_factor 0\.5\) are "
         r"supported for Phi3ForCausalLM only"),
        (dict(partial_rotary_factor=0.3125),
         r"partial_rotary_factor 0\.3125 of head_dim 16 gives 5 rotary dims; it must be in "
         r"\(0, 1\] and give an even number"),
        (dict(partial_rotary_factor=1.5), r"partial_rotary_factor 1\.5 of head_dim 16 gives 24"),
        (dict(rope_scaling=dict(type="longrope", long_factor=[1.0] * 8)),
         r"longrope rope scaling lacks the field 'short_factor'"),
        (dict(rope_scaling=dict(type="longrope", short_factor="1.0", long_factor=[1.0] * 8)),
         r"longrope short_factor must be a list of numbers, got '1\.0'"),
        (dict(rope_scaling=dict(type="longrope", short_factor=[1.0] * 8, long_factor=[1.0] * 6)),
         r"longrope long_factor has 6 entries; the rotary dims \(16\) need 8, one per frequency"),
        (dict(partial_rotary_factor=0.75,
              rope_scaling=dict(type="longrope", short_factor=[1.0] * 8, long_factor=[1.0] * 8)),
         r"longrope short_factor has 8 entries; the rotary dims \(12\) need 6"),
        (dict(rope_scaling=dict(type="longrope", short_factor=[1.0] * 7 + [0.0],
                                long_factor=[1.0] * 8)),
         r"longrope short_factor must hold positive numbers"),
        (dict(rope_scaling=dict(type="longrope", short_factor=[1.0] * 8, long_factor=[1.0] * 8,
                                attention_factor=-1.0)),
         r"longrope needs a positive original_max_position_embeddings and attention_factor"),
        (dict(original_max_position_embeddings=0,
              rope_scaling=dict(type="longrope", short_factor=[1.0] * 8, long_factor=[1.0] * 8)),
         r"longrope needs a positive original_max_position_embeddings, got 0"),
    ],
    ids=["llama-partial", "odd-dims", "over-one", "no-short", "not-a-list", "long-length",
         "partial-length", "zero-factor", "negative-attention", "zero-original"],
)
def test_unsupported_phi3_settings_are_refused_by_name(changes: dict[str, Any], match: str) -> None:
    with pytest.raises(ModelLoadError, match=match):
        ModelConfig.from_hf(_raw(**changes))


def test_a_rotary_dim_outside_the_head_is_refused() -> None:
    cfg = ModelConfig.from_hf(_raw())
    fields = cfg.to_json()
    for bad in (0, 18, 7):
        with pytest.raises(ModelLoadError, match=rf"at most head_dim 16; got rotary_dim {bad}$"):
            ModelConfig.from_json({**fields, "rotary_dim": bad})


# ----------------------------------------------------------------------------- checkpoints


def _split(path: Path) -> None:
    """Rewrite a Phi-3 checkpoint's fused tensors as split q/k/v and gate/up ones."""
    cfg = transformers.AutoConfig.from_pretrained(str(path))
    q = cfg.num_attention_heads * (cfg.hidden_size // cfg.num_attention_heads)
    kv = cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads)
    tensors = load_file(str(path / "model.safetensors"))
    for name in [n for n in tensors if n.endswith(("qkv_proj.weight", "gate_up_proj.weight"))]:
        t = tensors.pop(name)
        stem = name.rsplit(".", 2)[0]
        if name.endswith("qkv_proj.weight"):
            parts = {"q_proj": t[:q], "k_proj": t[q : q + kv], "v_proj": t[q + kv :]}
        else:
            half = t.shape[0] // 2
            parts = {"gate_proj": t[:half], "up_proj": t[half:]}
        for part, value in parts.items():
            tensors[f"{stem}.{part}.weight"] = value.contiguous()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def test_a_phi3_checkpoint_loads_fused_or_split_alike(tmp_path: Path) -> None:
    """The fused tensors Phi-3 checkpoints hold, and the same weights split as Llama's are:
    the same model, bit for bit (the partial-rotary permutation applied once either way)."""
    hf = tiny_hf_model("phi3-partial", seed=5)
    fused = save_checkpoint(hf, tmp_path / "fused")
    split = save_checkpoint(hf, tmp_path / "split")
    _split(split)
    assert "model.layers.0.self_attn.q_proj.weight" in load_file(str(split / "model.safetensors"))
    a, _, cfg = load_model(str(fused))
    b, _, _ = load_model(str(split))
    assert cfg.rotary_dim == 12
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    perm = rotary_permutation(16, 12)
    w = hf.model.layers[0].self_attn.qkv_proj.weight.detach()
    want = w.clone()
    for h in range(cfg.num_heads + cfg.num_kv_heads):  # q and k heads permuted; v as it was
        want[h * 16 : (h + 1) * 16] = w[h * 16 : (h + 1) * 16][perm]
    assert torch.equal(sa["model.layers.0.self_attn.qkv_proj.weight"], want)
    assert torch.equal(sa["model.layers.0.mlp.gate_up_proj.weight"],
                       hf.model.layers[0].mlp.gate_up_proj.weight.detach())


def test_a_phi3_checkpoint_without_a_fused_tensor_names_it(tmp_path: Path) -> None:
    path = save_checkpoint(tiny_hf_model("phi3"), tmp_path / "c")
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.1.self_attn.qkv_proj.weight"]
    del tensors["model.layers.0.mlp.gate_up_proj.weight"]
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(
        ModelLoadError,
        match=r"lacks 2 tensor\(s\): model\.layers\.0\.mlp\.gate_up_proj\.weight, "
        r"model\.layers\.1\.self_attn\.qkv_proj\.weight$",
    ):
        load_model(str(path))


def test_a_misshapen_fused_tensor_is_named_with_both_shapes(tmp_path: Path) -> None:
    path = save_checkpoint(tiny_hf_model("phi3"), tmp_path / "c")
    tensors = load_file(str(path / "model.safetensors"))
    name = "model.layers.0.self_attn.qkv_proj.weight"
    tensors[name] = tensors[name][:-16].contiguous()  # one v head short
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"tensor model\.layers\.0\.self_attn\.qkv_proj\."
                                             r"weight has shape \(112, 64\); the config implies "
                                             r"\(128, 64\)"):
        load_model(str(path))


# ----------------------------------------------------------------------------- the engine


@pytest.mark.slow
@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_phi4_mini_style_greedy_through_the_engine(deterministic: bool, tmp_path: Path) -> None:
    """The whole engine (``LLM``) on the tiny partial-rotary LongRoPE Phi-3 (as Phi-4-mini:
    12 of 16 dims rotate, tied head), served within its original 128 positions: prompts
    prefilled in chunks of 7 in a KV pool too small for all (preempted, recomputed), greedy
    tokens equal to ``transformers``' ``generate``, in the default and the deterministic mode
    (the native kernels read the same permuted heads and identity columns)."""
    from tierserve.replica.llm import LLM
    from tierserve.replica.sampler import SamplingParams

    hf = tiny_hf_model("phi3-longrope", seed=7)
    assert hf.config.rope_parameters["short_factor"] == list(PHI3_SHORT_FACTOR)
    assert hf.config.rope_parameters["long_factor"] == list(PHI3_LONG_FACTOR)
    path = save_checkpoint(hf, tmp_path / "phi3")
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 300, (n,), generator=gen).tolist() for n in (1, 5, 12, 33, 50)]
    new_tokens = 24
    want = []
    for p in prompts:
        with torch.no_grad():
            out = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p)),
                              max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                              pad_token_id=0)  # the mask: token 0 may be in a prompt
        want.append(out[0, len(p) :].tolist())
    llm = LLM(
        str(path), device="cpu", dtype="float32", deterministic=deterministic, num_kv_blocks=8,
        block_size=16, max_num_seqs=5, max_model_len=PHI3_LONGROPE_ORIGINAL,
        prefill_chunk_tokens=7,
    )
    cfg = llm.engine.model_config
    assert cfg.rotary_dim == 12 and isinstance(cfg.rope_scaling, LongRopeScaling)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert llm.stats().preemptions > 0
