"""Write GGUF files from tiny ``transformers`` models, the way llama.cpp's converter lays them out:
llama.cpp tensor names, Q/K rows permuted for its rotary layout where it permutes them (files of
architecture ``llama``, which is also how it writes Mistral models; not ``qwen2`` nor ``qwen3``,
whose per-head q/k norms are ``blk.N.attn_q_norm`` / ``blk.N.attn_k_norm``), the metadata
keys of ``general.architecture``, and a tokenizer with a chat template: byte-level BPE (the
embedded model's vocabulary, a few merges; ``tokenizer.ggml.model`` ``gpt2``) or SentencePiece
(a small vocabulary with scores, byte-fallback tokens; ``llama``).

Phi-3 (``phi3``) as llama.cpp's converter writes it: ``blk.N.attn_qkv`` and ``blk.N.ffn_up``
holding the checkpoint's fused ``qkv_proj`` and ``gate_up_proj`` as they are (not permuted),
``phi3.rope.dimension_count`` the rotated dims (no ``attention.key_length``),
``phi3.rope.scaling.original_context_length``, ``phi3.attention.sliding_window`` (0 for none)
and, for LongRoPE, the F32 tensors ``rope_factors_long.weight`` / ``rope_factors_short.weight``
and ``phi3.rope.scaling.attn_factor``.
Gemma (``gemma2``, ``gemma3``; from ``transformers``' ``Gemma2ForCausalLM`` / ``Gemma3ForCausalLM``)
as llama.cpp's converter writes it: every norm weight stored as ``1 + w``, the layer norms named
``attn_norm``, ``post_attention_norm``, ``ffn_norm`` (pre-feedforward), ``post_ffw_norm``, the
metadata ``{arch}.attention.sliding_window`` and, for Gemma 2, both soft-caps.

A file of architecture ``mistral`` keeps Hugging Face's Q/K layout: llama.cpp neither writes nor
reads that architecture (it writes Mistral models as ``llama``), and ``tierserve.replica.models.gguf_loader``
reads such a file's Q/K as stored.

Quantized tensors: ``gguf.quants.quantize`` where the package can quantize (F16, BF16, Q8_0, Q4_0,
Q4_1, ...); for the K-quants, which it can only dequantize, random blocks whose fp16 scales are
set to small finite values (the weights are then whatever those blocks decode to, on both sides
of a comparison).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from tierserve.replica.models.embedded import (
    BOS_ID,
    CHAT_TEMPLATE,
    EOS_ID,
    PAD_ID,
    SPECIAL_TOKENS,
    _byte_chars,
)

ARCH = {
    "LlamaConfig": "llama", "MistralConfig": "llama", "Qwen2Config": "qwen2", "Qwen3Config": "qwen3",
    "Phi3Config": "phi3",
    "MixtralConfig": "llama", "Qwen3MoeConfig": "qwen3moe", "Qwen2MoeConfig": "qwen2moe",
    "Gemma2Config": "gemma2", "Gemma3TextConfig": "gemma3",
}
GEMMA_ARCHS = ("gemma2", "gemma3")
# Gemma's per-layer norms: Hugging Face module -> llama.cpp tensor.
GEMMA_NORMS = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
PERMUTED_ARCHS = ("llama",)  # the architectures whose Q/K rows llama.cpp's converter permutes
QUANTIZABLE = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
# K-quant block layouts (256 weights per block): byte offsets of the fp16 scale fields.
K_SCALES = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
MERGES = ["h e", "l l", "o Ġ"]
# The SentencePiece vocabulary: special tokens, the 256 byte-fallback tokens, then pieces, best
# first (their scores decrease, so the merges derived from them follow this order).
SPM_SPECIAL = ["<unk>", "<s>", "</s>"]
SPM_PIECES = [
    "▁", "e", "l", "o", "h", "w", "r", "d", "t", "a", "s", "i", "n",
    "ll", "▁h", "▁w", "he", "or", "▁he", "▁wor", "ld", "▁the", "▁hell", "▁hello", "▁world",
    "▁a", "▁is", "in", "▁this", "▁t", "th", "▁th", "is", "▁i",
]
SPM_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}[{{ m['role'] | upper }}] {{ m['content'] }}"
    "{{ eos_token }}{% endfor %}"
)


def spm_vocab() -> tuple[list[str], list[float], list[int]]:
    """Tokens, scores and token types of the SentencePiece vocabulary (``llama`` tokenizer)."""
    tokens = SPM_SPECIAL + [f"<0x{b:02X}>" for b in range(256)] + SPM_PIECES
    scores = [0.0] * (len(SPM_SPECIAL) + 256) + [-float(i) for i in range(len(SPM_PIECES))]
    types = (
        [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
        + [gguf.TokenType.BYTE] * 256
        + [gguf.TokenType.NORMAL] * len(SPM_PIECES)
    )
    return tokens, scores, [int(t) for t in types]


def tokenizer_vocab() -> list[str]:
    """The embedded tokenizer's tokens in id order (bytes as the byte-level alphabet), plus the
    tokens the merges make."""
    chars = _byte_chars()
    tokens = [chars[b] for b in range(256)] + list(SPECIAL_TOKENS)
    return tokens + [m.replace(" ", "") for m in MERGES]


def permute_for_gguf(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter's permutation of Q/K rows (per head: the two rotary halves
    interleaved)."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def _k_blocks(shape: tuple[int, int], qtype: str, seed: int) -> np.ndarray:
    bs, ts = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    rows, cols = shape
    assert cols % bs == 0, f"{qtype} needs rows of a multiple of {bs} weights"
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, cols // bs, ts), dtype=np.uint8)
    for off in K_SCALES[qtype]:
        scale = rng.uniform(2e-4, 1e-3, size=(rows, cols // bs)).astype(np.float16)
        raw[:, :, off : off + 2] = scale.view(np.uint8).reshape(rows, cols // bs, 2)
    return raw.reshape(rows, cols // bs * ts)


def encode_tensor(w: torch.Tensor, qtype: str, seed: int) -> tuple[np.ndarray, Any]:
    """``w`` as GGUF data of ``qtype`` (vectors always F32, as llama.cpp writes them)."""
    data = w.detach().float().numpy()
    if data.ndim == 1 or qtype == "F32":
        return data, gguf.GGMLQuantizationType.F32
    if qtype in K_SCALES:
        return _k_blocks(data.shape, qtype, seed), gguf.GGMLQuantizationType[qtype]
    q = gguf.GGMLQuantizationType[qtype]
    return gguf.quants.quantize(data, q), q


def rope_theta(cfg: Any) -> float:
    """The (global) rotary base of a ``transformers`` config, v4 or v5 fields."""
    params = getattr(cfg, "rope_parameters", None) or {}
    params = params.get("full_attention", params)
    return float(params.get("rope_theta") or getattr(cfg, "rope_theta", None) or 10000.0)


def write_gguf(
    model: Any,
    path: Path,
    qtype: str = "F32",
    *,
    arch: str | None = None,
    skip: tuple[str, ...] = (),
    chat_template: str | None = None,
    tokenizer: str = "gpt2",
    metadata: dict[str, Any] | None = None,
) -> Path:
    """Write ``model`` (a tiny ``transformers`` Llama/Mistral/Qwen2/Qwen3/Phi3) to ``path`` in ``qtype``.
    ``arch`` overrides ``general.architecture``; tensors named in ``skip`` are left out; a model
    with tied embeddings gets no ``output.weight`` (as llama.cpp writes one). ``tokenizer``:
    ``gpt2`` (byte-level BPE) or ``llama`` (SentencePiece: the model's vocabulary must be
    ``len(spm_vocab()[0])``). ``metadata``: ``GGUFWriter.add_<key>(value)`` calls to add (e.g.
    ``{"sliding_window_pattern": [True, False]}``)."""
    cfg = model.config
    path.parent.mkdir(parents=True, exist_ok=True)
    arch = arch or ARCH[type(cfg).__name__]
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    permute = arch in PERMUTED_ARCHS
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny-test")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    rope = getattr(cfg, "rope_parameters", None) or {}
    if arch == "phi3":
        _add_phi3_metadata(w, cfg, rope)
    else:
        w.add_rope_dimension_count(head_dim)
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_rope_freq_base(rope_theta(cfg))
    w.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    w.add_vocab_size(cfg.vocab_size)
    gemma = arch in GEMMA_ARCHS
    if gemma:
        if "sliding_attention" in cfg.layer_types:
            w.add_sliding_window(cfg.sliding_window)
        if getattr(cfg, "attn_logit_softcapping", None) is not None:
            w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        if getattr(cfg, "final_logit_softcapping", None) is not None:
            w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    for key, value in (metadata or {}).items():
        getattr(w, f"add_{key}")(value)
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", 0)
    if experts:  # as llama.cpp's converter writes a mixture of experts
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        if arch != "llama":  # Qwen: the experts' own size; Mixtral's is feed_forward_length
            w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        if getattr(cfg, "shared_expert_intermediate_size", 0):
            w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if tokenizer == "gpt2":
        tokens = tokenizer_vocab()[: cfg.vocab_size]
        tokens += [f"<|unused{i}|>" for i in range(cfg.vocab_size - len(tokens))]
        types = [
            gguf.TokenType.CONTROL
            if t in SPECIAL_TOKENS or t.startswith("<|unused")
            else gguf.TokenType.NORMAL
            for t in tokens
        ]
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(MERGES)
        w.add_bos_token_id(BOS_ID)
        w.add_eos_token_id(EOS_ID)
        w.add_pad_token_id(PAD_ID)
        w.add_add_bos_token(True)
        w.add_chat_template(CHAT_TEMPLATE if chat_template is None else chat_template)
    elif tokenizer == "llama":  # as llama.cpp writes a SentencePiece model: no merges, scores
        tokens, scores, ttypes = spm_vocab()
        assert cfg.vocab_size == len(tokens), f"the model's vocabulary must be {len(tokens)}"
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(ttypes)
        w.add_unk_token_id(0)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_add_bos_token(True)
        w.add_add_eos_token(False)
        w.add_add_space_prefix(True)
        w.add_chat_template(SPM_TEMPLATE if chat_template is None else chat_template)
    else:
        raise ValueError(tokenizer)

    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    per_layer = {
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "self_attn.q_norm": "attn_q_norm",
        "self_attn.k_norm": "attn_k_norm",
        "self_attn.qkv_proj": "attn_qkv",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.gate_up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate": "ffn_gate_inp",
        "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
        "mlp.shared_expert.up_proj": "ffn_up_shexp",
        "mlp.shared_expert.down_proj": "ffn_down_shexp",
        "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    }
    if gemma:
        per_layer.update(GEMMA_NORMS)
    state = dict(model.state_dict())
    for name in [n for n in state if n.endswith(".mlp.experts.gate_up_proj")]:
        # transformers 5 holds the experts stacked [E, 2I, hidden]; llama.cpp writes gate and up
        # apart ([E, I, hidden] each), and the shared expert's gate as a vector.
        stem = name.removesuffix(".mlp.experts.gate_up_proj")
        gate, up = state.pop(name).chunk(2, dim=1)
        state[f"{stem}.mlp.experts.gate_exps.weight"] = gate.contiguous()
        state[f"{stem}.mlp.experts.up_exps.weight"] = up.contiguous()
        state[f"{stem}.mlp.experts.down_exps.weight"] = state.pop(f"{stem}.mlp.experts.down_proj")
    if rope.get("rope_type") == "longrope":  # the converter's extra F32 tensors
        for name in ("long_factor", "short_factor"):
            gname = f"rope_factors_{name.split('_')[0]}.weight"
            if gname not in skip:
                w.add_tensor(gname, np.asarray(rope[name], dtype=np.float32))
    seed = 0
    for name, t in state.items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if name.endswith(".mlp.shared_expert_gate.weight"):
            t = t.reshape(-1)
        if ".mlp.experts." in name:  # model.layers.{i}.mlp.experts.{gate,up,down}_exps.weight
            parts = name.split(".")
            gname = f"blk.{parts[2]}.ffn_{parts[5]}.weight"
        elif name in names:
            gname = names[name]
        else:
            parts = name.split(".")  # model.layers.{i}.{module...}.{weight|bias}
            module = ".".join(parts[3:-1])
            gname = f"blk.{parts[2]}.{per_layer[module]}.{parts[-1]}"
        if gname in skip:
            continue
        if permute and (".attn_q." in gname or ".attn_k." in gname):
            t = permute_for_gguf(t, heads if ".attn_q." in gname else kv_heads)
        if gemma and name.endswith("norm.weight"):  # llama.cpp stores Gemma's 1 + w
            t = t.float() + 1
        data, raw = encode_tensor(t, qtype, seed)
        seed += 1
        w.add_tensor(gname, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _add_phi3_metadata(w: Any, cfg: Any, rope: dict[str, Any]) -> None:
    """The rope and window keys llama.cpp's converter writes for a Phi-3 model."""
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    rot = int(rope.get("partial_rotary_factor", 1.0) * cfg.hidden_size) // cfg.num_attention_heads
    assert getattr(cfg, "head_dim", head_dim) == head_dim, "phi3 files carry no key_length"
    orig = cfg.original_max_position_embeddings
    w.add_rope_dimension_count(rot)
    w.add_rope_scaling_orig_ctx_len(orig)
    w.add_sliding_window(cfg.sliding_window or 0)
    if rope.get("rope_type") == "longrope":
        scale = cfg.max_position_embeddings / orig
        w.add_rope_scaling_attn_factors(
            math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1 else 1.0
        )


def reference_from_file(path: Path, like: Any) -> Any:
    """A ``transformers`` model of ``like``'s class and config holding the tensors of GGUF file
    ``path``: dequantized, Q/K un-permuted where the helper permuted them (``PERMUTED_ARCHS``),
    under their Hugging Face names. A reference for files ``transformers`` cannot load itself."""
    cfg = like.config
    reader = gguf.GGUFReader(str(path))
    arch = str(reader.fields["general.architecture"].contents())
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    names = {
        "token_embd": "model.embed_tokens",
        "output_norm": "model.norm",
        "output": "lm_head",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
        "attn_qkv": "self_attn.qkv_proj",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.gate_up_proj" if arch == "phi3" else "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
    }
    gemma = arch in GEMMA_ARCHS
    if gemma:
        names.update({g: hf for hf, g in GEMMA_NORMS.items()})
    state: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        if str(t.name).startswith("rope_factors_"):  # config, not weights: like's config has them
            continue
        arr = gguf.quants.dequantize(t.data, t.tensor_type)
        arr = np.asarray(arr, dtype=np.float32).reshape([int(d) for d in reversed(t.shape)])
        w = torch.from_numpy(arr.copy())
        if gemma and str(t.name).endswith("norm.weight"):
            w = w - 1  # transformers' Gemma norms take the offset from one
        parts = str(t.name).split(".")
        if parts[0] == "blk":  # blk.{i}.{module}.{weight|bias}
            if arch in PERMUTED_ARCHS and parts[2] in ("attn_q", "attn_k"):
                n = heads if parts[2] == "attn_q" else kv_heads
                half = w.shape[0] // n // 2  # the inverse of permute_for_gguf
                w = w.reshape(n, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
            state[f"model.layers.{parts[1]}.{names[parts[2]]}.{parts[3]}"] = w
        else:
            state[f"{names[parts[0]]}.{parts[1]}"] = w
    model = type(like)(cfg).eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    if cfg.tie_word_embeddings:
        model.tie_weights()
    return model


def load_in_child(path: str, cache: str, builds: str, start: Any, out: Any) -> None:
    """The body of a spawned process loading GGUF file ``path`` with the prepared cache in
    ``cache``: it waits at barrier ``start`` for the other process, loads (each tensor written to
    the cache slowed down, so that the two loads overlap), appends a line to ``builds`` for each
    prepared entry it builds, and puts the SHA-256 of every weight of the loaded model on
    ``out``."""
    import hashlib
    import os
    import time

    os.environ["TIERSERVE_CACHE_DIR"] = cache
    from tierserve.replica.models import gguf_loader
    from tierserve.replica.models.loader import load_model

    writer = gguf_loader._PreparedWriter
    real_add, real_start = writer.add, writer.start.__func__  # type: ignore[attr-defined]

    def slow_add(self: Any, name: str, arr: np.ndarray) -> None:
        time.sleep(0.05)
        real_add(self, name, arr)

    def counted_start(cls: Any, final: Path, reader: Any) -> Any:
        started = real_start(cls, final, reader)
        if started is not None:
            with open(builds, "a") as f:
                f.write(f"{os.getpid()}\n")
        return started

    writer.add = slow_add  # type: ignore[method-assign]
    writer.start = classmethod(counted_start)  # type: ignore[assignment,method-assign]
    start.wait()
    model, _, _ = load_model(path)
    out.put({
        name: hashlib.sha256(t.detach().contiguous().numpy().tobytes()).hexdigest()
        for name, t in model.state_dict().items()
    })
