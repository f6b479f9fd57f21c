"""GGUF checkpoints (llama.cpp's format): config, tokenizer and weights of a Llama-family or Gemma
model.

``engine.model`` may name a ``.gguf`` file, a folder holding exactly one, or a packaged model
(``tierserve.replica.models.catalog``). Supported: ``general.architecture`` ``llama`` (which is also how
llama.cpp writes Mistral models, and Mixtral: ``llama`` with experts), ``mistral`` (see below),
``qwen2``, ``qwen3``, ``qwen2moe``, ``qwen3moe``, ``phi3`` (see below), ``gemma2`` and ``gemma3``
(``tierserve.replica.models.gemma``); tensors in every type
the ``gguf`` package can dequantize (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, the K-quants
Q2_K to Q6_K, the IQ types, ...), dequantized once at load into the engine's dtype.

- Gemma: ``gemma2`` and ``gemma3`` files (llama.cpp writes Gemma 3's text model as ``gemma3``). Its
  converter stores every norm weight as ``1 + w`` already (``transformers`` subtracts the one when
  it reads such a file; tierserve's Gemma norms take ``1 + w``, so it is read as stored). Per layer,
  ``attn_norm`` is the input norm, ``post_attention_norm`` the attention output's, ``ffn_norm`` the
  pre-feedforward and ``post_ffw_norm`` the post-feedforward norm. The metadata holds what
  llama.cpp does not take as given: ``{arch}.attention.sliding_window`` (none or 0: every layer
  global), optionally ``attention.sliding_window_pattern`` (a period, or a per-layer list where
  true is sliding), ``rope.freq_base_swa`` and the soft-caps; lacking them, llama.cpp's own
  rules: every 2nd (Gemma 2) or all but every 6th (Gemma 3) layer sliding, Gemma 3's sliding
  layers on base 10000 (unscaled: a ``linear`` ``rope.scaling`` applies to its global layers
  only), and attention scaled by ``head_dim ** -0.5``, except ``(hidden / heads) ** -0.5`` for
  the 27B models (46 layers in Gemma 2, 62 in Gemma 3), as llama.cpp scales them.
  ``<end_of_turn>``, where the vocabulary has it, ends a sequence too.
- Config: from the metadata keys of the architecture (``llama.block_count``, ...). Floats are
  stored as float32, so ``rms_norm_eps`` 1e-5 reads 9.99999975e-06: they are rounded back to the
  shortest decimal that gives the same float32. The head is tied when there is no
  ``output.weight``.
- Weights: streamed one tensor at a time from the memory-mapped file (dequantize, un-permute,
  cast, copy into the model, drop), so the peak is about one tensor above the model. In the
  files llama.cpp writes as ``llama`` (Llama and Mistral models alike) the Q and K rows are in
  its rotary layout (the two halves of each head interleaved); they are permuted back. Its
  ``qwen2`` and ``qwen3`` files keep the Hugging Face layout (its rotary for them takes the
  halves as they are; its converter writes Qwen3 as Qwen2 plus the per-head q/k norms,
  ``blk.N.attn_q_norm.weight`` and ``blk.N.attn_k_norm.weight``, and ``qwen3.attention.key_length``
  for a head_dim that need not be hidden / heads). llama.cpp has no ``mistral`` architecture: it neither writes nor loads such a file, so
  nothing permuted its Q/K; they are read as stored (``transformers`` registers its Q/K
  un-permutation for ``llama`` files only).
- ``phi3`` (Phi-3, Phi-4-mini), as llama.cpp's converter writes it: Q/K/V fused in
  ``blk.N.attn_qkv`` (rows ``[q | k | v]``, not permuted: its rotary for phi3 takes the halves
  as they are) and gate/up in ``blk.N.ffn_up`` (rows ``[gate | up]``; no ``ffn_gate``), both read
  whole; head_dim hidden / heads unless ``phi3.attention.key_length`` says otherwise, and
  ``phi3.rope.dimension_count`` the rotated dims of each head (partial rotary: Phi-4-mini's 96
  of 128). LongRoPE models carry their factors as the tensors ``rope_factors_short.weight`` and
  ``rope_factors_long.weight``, with ``phi3.rope.scaling.original_context_length`` and
  ``phi3.rope.scaling.attn_factor`` (``config.LongRopeScaling``). ``phi3.attention.sliding_window``
  0 (what the converter writes when the model has none: Phi-4-mini) means no window; another
  value (Phi-3-mini-4k's 2047) is kept, as ``transformers`` applies it (llama.cpp ignores it).
- Mixture of experts: ``{arch}.expert_count`` experts, ``{arch}.expert_used_count`` per token,
  the experts' size ``{arch}.expert_feed_forward_length`` (a ``llama`` file's is its
  ``feed_forward_length``), renormalized top-k weights as llama.cpp computes them
  (``{arch}.expert_weights_norm`` where the file says; else Mixtral and Qwen3-MoE yes, Qwen2-MoE
  no); the router ``blk.N.ffn_gate_inp`` and the experts stacked ``[E, ...]``
  (``blk.N.ffn_gate_exps``, ``ffn_up_exps``, ``ffn_down_exps``), Qwen2-MoE's shared expert
  ``blk.N.ffn_{gate,up,down}_shexp`` and its gate ``ffn_gate_inp_shexp``. Other gating
  functions, weight scales, shared experts elsewhere, and the older one-tensor-per-expert
  layout raise ``ModelLoadError``.
- Tokenizer and chat template: ``transformers`` builds a fast tokenizer from the file's metadata
  (a few seconds for a 49k vocabulary); it is saved under the cache directory
  (``$TIERSERVE_CACHE_DIR``, else ``~/.cache/tierserve``) keyed by the file's SHA-256, so later
  starts load it in a fraction of a second.
- The prepared cache: the first load also writes the config and the dequantized fp32 weights
  (one ``.npy`` per tensor, as they stream) under ``gguf-prepared/`` in the same directory,
  keyed by the file's SHA-256; later starts read the config from it and memory-map the weights
  instead of parsing the GGUF metadata and dequantizing (seconds each on a small CPU). Files
  whose fp32 weights exceed ``$TIERSERVE_GGUF_CACHE_GIB`` (default 4; 0 turns the cache off)
  are not cached. A damaged entry is removed and rebuilt. An entry is built under an exclusive
  ``flock`` on ``<entry>.lock`` beside it: of two replicas starting at once on a fresh machine,
  one builds and the other waits, then reads the finished entry. ``make install`` builds the
  default model's entry (``python -m tierserve.replica.models.prepare``), so that even its first start
  reads the cache.

Every failure is a ``ModelLoadError`` that names the file and what is wrong: not a GGUF (magic),
truncated or corrupt, an unsupported architecture or tensor type, missing or misshapen tensors.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from tierserve.replica.models.cache_dir import cache_root
from tierserve.replica.models.config import (
    LinearScaling,
    LongRopeScaling,
    ModelConfig,
    ModelLoadError,
    longrope_attention_factor,
)

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

MAGIC = b"GGUF"
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
}
# A ``llama`` file with experts (``llama.expert_count`` > 0) is llama.cpp's Mixtral.
MIXTRAL = "MixtralForCausalLM"
_GEMMA = ("gemma2", "gemma3")
ARCHITECTURES_GEMMA = tuple(ARCHITECTURES[a] for a in _GEMMA)
# llama.cpp's sliding-window period of a Gemma file that does not name one.
_GEMMA_SWA_PERIOD = {"gemma2": 2, "gemma3": 6}
# Layer counts of the 27B models, whose attention llama.cpp scales by (hidden / heads) ** -0.5.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# The architectures whose files hold Q/K rows in llama.cpp's rotary layout: ``llama`` (its
# converter permutes Hugging Face Llama and Mistral checkpoints into it; Mistral's own checkpoint
# format already has it). qwen2 and qwen3 it leaves as they are; ``mistral`` it never writes (nor
# loads), so such a file's Q/K are taken as stored.
_PERMUTED = ("llama",)
# The architectures whose layers normalize each q and k head (attn_q_norm, attn_k_norm).
_QK_NORM = ("qwen3", "qwen3moe", "gemma3")
# The architectures whose ``ffn_up`` holds gate and up together (rows [gate | up], no ffn_gate),
# whose ``rope.dimension_count`` is the rotated part of a head (not a head_dim), and whose
# LongRoPE factors are the rope_factors_short / rope_factors_long tensors: phi3.
_PHI3_LAYOUT = ("phi3",)
_ROPE_FACTORS = ("rope_factors_short.weight", "rope_factors_long.weight")
# Mixture of experts: the architectures that may have experts, whether llama.cpp renormalizes
# the top-k weights when the file does not say (``{arch}.expert_weights_norm``): Mixtral (as
# ``llama``) and Qwen3-MoE do, Qwen2-MoE does not; and which have a shared expert.
_MOE_RENORM = {"llama": True, "qwen3moe": True, "qwen2moe": False}
_MOE_SHARED = ("qwen2moe",)
_GLOBAL = {
    "token_embd.weight": "embed",
    "output_norm.weight": "norm",
    "output.weight": "head",
}
_PER_LAYER = {
    "attn_norm.weight": "input_norm",
    "ffn_norm.weight": "post_norm",
    "attn_q.weight": "q",
    "attn_k.weight": "k",
    "attn_v.weight": "v",
    "attn_qkv.weight": "qkv",
    "attn_q.bias": "q_bias",
    "attn_k.bias": "k_bias",
    "attn_v.bias": "v_bias",
    "attn_output.weight": "o",
    "attn_output.bias": "o_bias",
    "attn_q_norm.weight": "q_norm",
    "attn_k_norm.weight": "k_norm",
    "ffn_gate.weight": "gate",
    "ffn_up.weight": "up",
    "ffn_down.weight": "down",
    "post_attention_norm.weight": "attn_post_norm",  # Gemma's sandwich norms
    "post_ffw_norm.weight": "ffn_post_norm",
    "ffn_gate_inp.weight": "router",
    "ffn_gate_exps.weight": "gate_exps",
    "ffn_up_exps.weight": "up_exps",
    "ffn_down_exps.weight": "down_exps",
    "ffn_gate_shexp.weight": "shared_gate",
    "ffn_up_shexp.weight": "shared_up",
    "ffn_down_shexp.weight": "shared_down",
    "ffn_gate_inp_shexp.weight": "shared_expert_gate",
}
_tokenizer_lock = threading.Lock()
_digest_lock = threading.Lock()
_digests: dict[tuple[str, int, int], str] = {}
# The prepared cache (``gguf_model_config``, ``gguf_weights``): a file's config and its weights
# dequantized to fp32, so that a start after the first reads neither the GGUF metadata (parsing
# it takes seconds: ``gguf.GGUFReader`` builds an array per tokenizer entry) nor dequantizes.
PREPARED_FORMAT = 1  # part of the entry's name: bump it when the way a file is read changes
ENV_PREPARED_GIB = "TIERSERVE_GGUF_CACHE_GIB"
DEFAULT_PREPARED_GIB = 4.0


def find_gguf(model: str) -> Path | None:
    """The GGUF file ``model`` names (a ``.gguf`` file, or a folder holding exactly one), or None
    when it names something else. A folder with several is a ``ModelLoadError`` listing them."""
    path = Path(model).expanduser()
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ModelLoadError(f"GGUF file {path} does not exist")
        return path
    if path.is_dir() and not (path / "config.json").is_file():
        found = sorted(p for p in path.iterdir() if p.suffix.lower() == ".gguf")
        if len(found) == 1:
            return found[0]
        if len(found) > 1:
            raise ModelLoadError(
                f"{path} holds {len(found)} GGUF files ({', '.join(p.name for p in found)}); "
                "name one of them as the model"
            )
    return None


def open_gguf(path: Path) -> Any:
    """A ``gguf.GGUFReader`` over ``path`` (memory-mapped); raises ``ModelLoadError`` for a file
    that is not GGUF, is truncated, or cannot be parsed."""
    try:
        import gguf
    except ImportError as e:  # a dependency of the project: only a broken install lacks it
        raise ModelLoadError("reading GGUF files needs the gguf package: pip install gguf") from e
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError as e:
        raise ModelLoadError(f"cannot read {path}: {e.strerror}") from None
    if head != MAGIC:
        raise ModelLoadError(f"{path} is not a GGUF file: it starts with {head!r}, not {MAGIC!r}")
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:
        raise ModelLoadError(
            f"{path} is truncated or corrupt: its GGUF header or tensor table cannot be parsed "
            f"({type(e).__name__}: {e})"
        ) from None
    size = path.stat().st_size
    for t in reader.tensors:
        if int(t.data_offset) + int(t.n_bytes) > size:
            raise ModelLoadError(
                f"{path} is truncated: tensor {t.name} ends at byte "
                f"{int(t.data_offset) + int(t.n_bytes)} of a {size}-byte file"
            )
    return reader


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def _float32_value(x: float) -> float:
    """The shortest decimal with the same float32 value (1e-5, not 9.99999975e-06)."""
    return float(str(np.float32(x)))


def gguf_architecture(reader: Any, path: Path) -> str:
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: unsupported GGUF architecture {arch!r}; supported: "
            f"{', '.join(ARCHITECTURES)} (Llama, Mistral, Mixtral, Qwen2, Qwen3, Qwen2-MoE, "
            "Qwen3-MoE, Phi-3, Gemma 2 and Gemma 3 models)"
        )
    return str(arch)


def gguf_config(reader: Any, path: Path) -> ModelConfig:
    """The ``ModelConfig`` of the GGUF metadata. Raises ``ModelLoadError``."""
    arch = gguf_architecture(reader, path)

    def need(key: str) -> Any:
        value = _field(reader, f"{arch}.{key}")
        if value is None:
            raise ModelLoadError(f"{path}: the GGUF metadata lacks {arch}.{key}")
        return value

    moe = _gguf_moe(reader, path, arch)
    scaling = _field(reader, f"{arch}.rope.scaling.type")
    rope_scaling = None
    if scaling == "linear":
        factor = _field(reader, f"{arch}.rope.scaling.factor")
        if factor is None or not float(factor) > 0:
            raise ModelLoadError(
                f"{path}: linear rope scaling needs {arch}.rope.scaling.factor > 0, got {factor}"
            )
        rope_scaling = LinearScaling(_float32_value(factor))
    elif scaling not in (None, "none"):
        raise ModelLoadError(
            f"{path}: rope scaling {scaling!r} is not supported (only linear, or none)"
        )
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ModelLoadError(
            f"{path}: per-frequency rope factors (rope_freqs, Llama 3.1-style scaling) are not "
            "supported for GGUF checkpoints yet; use the Hugging Face checkpoint"
        )
    heads = int(need("attention.head_count"))
    hidden = int(need("embedding_length"))
    head_dim = int(
        _field(reader, f"{arch}.attention.key_length")
        or (None if arch in _PHI3_LAYOUT else _field(reader, f"{arch}.rope.dimension_count"))
        or hidden // heads
    )
    rotary_dim, longrope = _phi3_rope(reader, path, arch, head_dim)
    tokens = _field(reader, "tokenizer.ggml.tokens")
    vocab = _field(reader, f"{arch}.vocab_size") or (len(tokens) if tokens else None)
    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if vocab is None and embed is not None:
        vocab = int(embed.shape[-1])
    if vocab is None:
        raise ModelLoadError(f"{path}: the GGUF file says nothing of its vocabulary size")
    eos = [
        int(v)
        for v in (
            _field(reader, "tokenizer.ggml.eos_token_id"),
            _field(reader, "tokenizer.ggml.eot_token_id"),
            _field(reader, "tokenizer.ggml.eom_token_id"),
        )
        if v is not None
    ]
    window = _field(reader, f"{arch}.attention.sliding_window")
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    pad = _field(reader, "tokenizer.ggml.padding_token_id")
    layers = int(need("block_count"))
    gemma: dict[str, Any] = {}
    if arch in _GEMMA:
        gemma = _gemma_fields(reader, path, arch, layers, hidden, heads, head_dim)
        window = gemma.pop("sliding_window")
        if tokens and "<end_of_turn>" in tokens:  # its chat turns end with it
            eos.append(tokens.index("<end_of_turn>"))
    return ModelConfig(
        architecture=MIXTRAL if arch == "llama" and moe else ARCHITECTURES[arch],
        vocab_size=int(vocab),
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv") or heads),
        head_dim=head_dim,
        intermediate_size=int(need("feed_forward_length")),
        rms_norm_eps=_float32_value(need("attention.layer_norm_rms_epsilon")),
        rope_theta=_float32_value(_field(reader, f"{arch}.rope.freq_base") or 10000.0),
        rope_scaling=longrope or rope_scaling,
        max_position_embeddings=int(need("context_length")),
        tie_word_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names,
        o_bias="blk.0.attn_output.bias" in names,
        qk_norm=arch in _QK_NORM,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(dict.fromkeys(eos)),
        pad_token_id=None if pad is None else int(pad),
        sliding_window=None if not window else int(window),  # phi3 writes 0 for none
        rotary_dim=rotary_dim,
        **gemma,
        **moe,
    )


def _gguf_moe(reader: Any, path: Path, arch: str) -> dict[str, Any]:
    """The mixture-of-experts fields of ``ModelConfig`` from a GGUF file (none without experts):
    llama.cpp's Mixtral (``llama``), Qwen2-MoE (``qwen2moe``) and Qwen3-MoE (``qwen3moe``), whose
    experts are stacked per layer (``blk.N.ffn_gate_exps`` ...) beside the router
    (``blk.N.ffn_gate_inp``). The sparse layers are those with a router. Anything else with
    experts raises ``ModelLoadError`` naming what is unsupported."""
    experts = int(_field(reader, f"{arch}.expert_count") or 0)
    if experts <= 0:
        if arch in _MOE_RENORM and arch != "llama":
            raise ModelLoadError(f"{path}: a {arch} file without {arch}.expert_count")
        return {}
    if arch not in _MOE_RENORM:
        raise ModelLoadError(
            f"{path}: mixture-of-experts {arch} files are not supported (experts are supported "
            f"in {', '.join(_MOE_RENORM)} files: Mixtral, Qwen3-MoE and Qwen2-MoE)"
        )
    names = {str(t.name) for t in reader.tensors}
    if any(n.startswith("blk.") and n.split(".")[2] in ("ffn_gate", "ffn_up", "ffn_down")
           and n.split(".")[3].isdigit() for n in names):
        raise ModelLoadError(
            f"{path}: its experts are stored one tensor each (blk.N.ffn_gate.E.weight, an older "
            "llama.cpp layout), which is not supported; convert the model again with a current "
            "llama.cpp (stacked blk.N.ffn_gate_exps)"
        )
    gating = _field(reader, f"{arch}.expert_gating_func")
    if gating not in (None, 1):  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX
        raise ModelLoadError(
            f"{path}: expert gating function {gating} ({arch}.expert_gating_func) is not "
            "supported; only softmax (1)"
        )
    scale = _field(reader, f"{arch}.expert_weights_scale")
    if scale not in (None, 0.0, 1.0):
        raise ModelLoadError(f"{path}: expert weights scale {scale} is not supported (only 1)")
    shared_count = int(_field(reader, f"{arch}.expert_shared_count") or 0)
    shared = int(_field(reader, f"{arch}.expert_shared_feed_forward_length") or 0)
    if arch in _MOE_SHARED:
        if shared <= 0:
            raise ModelLoadError(f"{path}: lacks {arch}.expert_shared_feed_forward_length")
    elif shared_count > 0 or shared > 0:
        raise ModelLoadError(f"{path}: shared experts in a {arch} file are not supported")
    inter = _field(reader, f"{arch}.expert_feed_forward_length")
    if inter is None:
        if arch != "llama":
            raise ModelLoadError(f"{path}: the GGUF metadata lacks {arch}.expert_feed_forward_length")
        inter = _field(reader, f"{arch}.feed_forward_length")
    norm = _field(reader, f"{arch}.expert_weights_norm")
    layers = tuple(
        sorted(int(n.split(".")[1]) for n in names
               if n.startswith("blk.") and n.endswith(".ffn_gate_inp.weight"))
    )
    if not layers:
        raise ModelLoadError(
            f"{path}: {arch}.expert_count is {experts} but no layer has a router "
            "(blk.N.ffn_gate_inp.weight)"
        )
    return dict(
        num_experts=experts,
        num_experts_per_tok=int(_field(reader, f"{arch}.expert_used_count") or 0),
        moe_intermediate_size=int(inter),
        norm_topk_prob=_MOE_RENORM[arch] if norm is None else bool(norm),
        moe_layers=layers,
        shared_expert_intermediate_size=shared if arch in _MOE_SHARED else 0,
    )


def _gemma_fields(
    reader: Any, path: Path, arch: str, layers: int, hidden: int, heads: int, head_dim: int
) -> dict[str, Any]:
    """The ``ModelConfig`` fields of a Gemma file beyond the Llama family's (and its
    ``sliding_window``), with llama.cpp's defaults where the metadata says nothing (module
    docstring)."""
    window = _field(reader, f"{arch}.attention.sliding_window")
    window = int(window) if window else None
    pattern = _field(reader, f"{arch}.attention.sliding_window_pattern")
    if window is None:
        sliding = [False] * layers
    elif isinstance(pattern, list):
        if len(pattern) != layers:
            raise ModelLoadError(
                f"{path}: {arch}.attention.sliding_window_pattern names {len(pattern)} layers; "
                f"the model has {layers}"
            )
        sliding = [bool(p) for p in pattern]
    else:
        period = int(pattern) if pattern is not None else _GEMMA_SWA_PERIOD[arch]
        sliding = [period == 0 or i % period < period - 1 for i in range(layers)]
    scalar = hidden // heads if layers == _GEMMA_27B_LAYERS[arch] else head_dim
    local_theta = None
    if arch == "gemma3":
        local_theta = _float32_value(_field(reader, f"{arch}.rope.freq_base_swa") or 10000.0)
    caps = {}
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        value = _field(reader, f"{arch}.{key}")
        caps[key] = None if not value else _float32_value(value)
    return dict(
        sliding_window=window,
        hidden_act="gelu_pytorch_tanh",
        layer_types=tuple("sliding_attention" if s else "full_attention" for s in sliding),
        rope_local_theta=local_theta,
        query_pre_attn_scalar=float(scalar),
        **caps,
    )


def _phi3_rope(
    reader: Any, path: Path, arch: str, head_dim: int
) -> tuple[int | None, LongRopeScaling | None]:
    """A phi3 file's rotated dims per head (None: all of head_dim) and its LongRoPE scaling
    (None without the factor tensors); (None, None) for the other architectures."""
    if arch not in _PHI3_LAYOUT:
        return None, None
    rot = int(_field(reader, f"{arch}.rope.dimension_count") or head_dim)
    found = {str(t.name): t for t in reader.tensors if str(t.name) in _ROPE_FACTORS}
    if not found:
        return (None if rot == head_dim else rot), None
    if len(found) != len(_ROPE_FACTORS):
        raise ModelLoadError(
            f"{path}: LongRoPE needs both {' and '.join(_ROPE_FACTORS)}; the file holds "
            f"{', '.join(found)} only"
        )
    key = f"{arch}.rope.scaling.original_context_length"
    orig = _field(reader, key)
    if not orig:
        raise ModelLoadError(f"{path}: the file has LongRoPE factors but lacks {key}")
    attn = _field(reader, f"{arch}.rope.scaling.attn_factor")
    if attn is None:  # the converter writes it; else the default of its max / original length
        ctx = int(_field(reader, f"{arch}.context_length") or orig)
        attn = longrope_attention_factor(ctx / int(orig), int(orig))
    short, long = (
        tuple(_float32_value(f) for f in _dequantized(found[n], path).reshape(-1))
        for n in _ROPE_FACTORS
    )
    scaling = LongRopeScaling(
        short_factor=short,
        long_factor=long,
        original_max_position_embeddings=int(orig),
        attention_factor=_float32_value(attn),
    )
    return (None if rot == head_dim else rot), scaling


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (rows or a bias of ``heads`` heads)."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _dequantized(t: Any, path: Path) -> np.ndarray:
    """Tensor ``t`` as float32 in its logical shape (rows first), a writable array."""
    from gguf import GGMLQuantizationType, quants

    qtype = GGMLQuantizationType(int(t.tensor_type))
    try:
        arr = quants.dequantize(t.data, qtype)
    except NotImplementedError:
        raise ModelLoadError(
            f"{path}: tensor {t.name} is of type {qtype.name}, which the gguf package cannot "
            "dequantize; use a file in F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 or a K-quant"
        ) from None
    except Exception as e:
        raise ModelLoadError(f"{path}: tensor {t.name} ({qtype.name}) is corrupt: {e}") from None
    want = tuple(int(d) for d in reversed(t.shape))  # GGUF lists the innermost dimension first
    if tuple(arr.shape) != want:
        arr = arr.reshape(want)
    arr = np.asarray(arr, dtype=np.float32)
    return arr if arr.flags.writeable else arr.copy()


_HF_GLOBAL = {"embed": "model.embed_tokens.weight", "norm": "model.norm.weight", "head": "lm_head.weight"}
_HF_LAYER = {
    "input_norm": "input_layernorm.weight",
    "post_norm": "post_attention_layernorm.weight",
    "q": "self_attn.q_proj.weight",
    "k": "self_attn.k_proj.weight",
    "v": "self_attn.v_proj.weight",
    "qkv": "self_attn.qkv_proj.weight",
    "gate_up": "mlp.gate_up_proj.weight",
    "q_bias": "self_attn.q_proj.bias",
    "k_bias": "self_attn.k_proj.bias",
    "v_bias": "self_attn.v_proj.bias",
    "o": "self_attn.o_proj.weight",
    "o_bias": "self_attn.o_proj.bias",
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
    "gate": "mlp.gate_proj.weight",
    "up": "mlp.up_proj.weight",
    "down": "mlp.down_proj.weight",
    # Mixture of experts. The experts' gate and up weights are stacked per layer in the file
    # (``[E, I, hidden]`` each); the loader takes them as halves of ``mlp.experts.gate_up_proj``.
    "router": "mlp.gate.weight",
    "gate_exps": "mlp.experts.gate_proj",
    "up_exps": "mlp.experts.up_proj",
    "down_exps": "mlp.experts.down_proj",
    "shared_gate": "mlp.shared_expert.gate_proj.weight",
    "shared_up": "mlp.shared_expert.up_proj.weight",
    "shared_down": "mlp.shared_expert.down_proj.weight",
    "shared_expert_gate": "mlp.shared_expert_gate.weight",
}


# Gemma's layers: ``ffn_norm`` is the pre-feedforward norm, and two more norms follow the blocks.
_HF_LAYER_GEMMA = {
    **_HF_LAYER,
    "post_norm": "pre_feedforward_layernorm.weight",
    "attn_post_norm": "post_attention_layernorm.weight",
    "ffn_post_norm": "post_feedforward_layernorm.weight",
}


def _hf_layer_names(architecture: str) -> dict[str, str]:
    """Role -> Hugging Face name (within a layer) for a model of ``architecture``."""
    return _HF_LAYER_GEMMA if architecture in ARCHITECTURES_GEMMA else _HF_LAYER

_GGUF_GLOBAL = {role: name for name, role in _GLOBAL.items()}
_GGUF_LAYER = {role: rest for rest, role in _PER_LAYER.items()}
_GGUF_LAYER["gate_up"] = "ffn_up.weight"  # phi3's ffn_up holds gate and up
_FROM_HF_GLOBAL = {hf: role for role, hf in _HF_GLOBAL.items()}
_FROM_HF_LAYER = {hf: role for role, hf in _HF_LAYER.items()}


def gguf_tensor_name(hf_name: str) -> str | None:
    """The GGUF name of the tensor a Hugging Face name stands for
    (``model.layers.1.mlp.up_proj.weight`` -> ``blk.1.ffn_up.weight``), or None."""
    role = _FROM_HF_GLOBAL.get(hf_name)
    if role is not None:
        return _GGUF_GLOBAL[role]
    hf_name = hf_name.replace(".block_sparse_moe.", ".mlp.", 1)  # Mixtral's router
    parts = hf_name.split(".", 3)  # model, layers, {i}, rest
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[2].isdigit():
        role = _FROM_HF_LAYER.get(parts[3])
        if role is not None:
            return f"blk.{parts[2]}.{_GGUF_LAYER[role]}"
    return None


def gguf_tensor_namer(architecture: str) -> Callable[[str], str | None]:
    """``gguf_tensor_name`` for a model of ``architecture`` (``ModelConfig.architecture``): Gemma's
    layers name their norms otherwise."""
    if architecture not in ARCHITECTURES_GEMMA:
        return gguf_tensor_name
    from_hf = {hf: role for role, hf in _HF_LAYER_GEMMA.items()}

    def name(hf_name: str) -> str | None:
        parts = hf_name.split(".", 3)
        if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[2].isdigit():
            role = from_hf.get(parts[3])
            return None if role is None else f"blk.{parts[2]}.{_GGUF_LAYER[role]}"
        return gguf_tensor_name(hf_name)

    return name


def prepared_dir(path: Path) -> Path:
    """The prepared-cache entry of GGUF file ``path``: named by its SHA-256 and the format."""
    return cache_root() / "gguf-prepared" / f"{file_digest(path)[:32]}-v{PREPARED_FORMAT}"


def gguf_model_config(path: Path) -> ModelConfig:
    """The ``ModelConfig`` of GGUF file ``path``: from the prepared cache, else from the file's
    metadata (and then written to the cache, under the entry's lock). Raises ``ModelLoadError``."""
    entry = prepared_dir(path) / "config.json"
    config = _cached_config(entry)
    if config is not None:
        return config
    with _entry_lock(path):
        config = _cached_config(entry)  # written by another process while this one waited
        if config is not None:
            return config
        config = gguf_config(open_gguf(path), path)
        try:
            entry.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".config-", dir=entry.parent)
            with os.fdopen(fd, "w") as f:
                json.dump(config.to_json(), f, indent=1)
            os.replace(tmp, entry)
        except OSError as e:  # no writable cache: every start reads the metadata
            log.warning("cannot cache the GGUF config under %s (%s)", entry.parent, e)
    return config


def _cached_config(entry: Path) -> ModelConfig | None:
    try:
        return ModelConfig.from_json(json.loads(entry.read_text()))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:  # damaged: read the file again
        log.warning("ignoring the cached config at %s (%s)", entry, e)
        return None


@contextlib.contextmanager
def _entry_lock(path: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``<entry>.lock`` beside the prepared entry of ``path``, held
    while the entry is built: of two processes starting at once on a fresh machine, one builds
    and the other waits, then reads what the first built. Without a writable cache there is
    nothing to build and no lock: the body runs unlocked."""
    entry = prepared_dir(path)
    lock = entry.with_name(entry.name + ".lock")
    fd: int | None = None
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        log.warning("cannot lock %s (%s): going on without the lock", lock, e)
    try:
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                log.info("another process is preparing %s: waiting for it", entry)
                fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        if fd is not None:
            os.close(fd)  # releases the lock (the file stays: removing it would race)


def gguf_weights(path: Path, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's tensors under Hugging Face names (fp32, CPU), one at a time: from the
    prepared cache when it holds them (memory-mapped), else dequantized from the file and, when
    they take at most ``$TIERSERVE_GGUF_CACHE_GIB`` (default 4; 0 turns the cache off) in fp32,
    written to the cache on the way, under the entry's lock (another process loading the same
    file meanwhile waits, then reads the cache). Raises ``ModelLoadError``."""
    folder = prepared_dir(path) / "weights"
    index = _prepared_index(folder)
    with contextlib.ExitStack() as held:
        if index is None and prepared_limit_gib() > 0:
            held.enter_context(_entry_lock(path))
            index = _prepared_index(folder)  # built by another process while this one waited
            if index is not None:
                held.close()
        if index is not None:
            yield from _prepared_tensors(path, folder, index)
            return
        reader = open_gguf(path)
        writer = _PreparedWriter.start(folder, reader)
        if writer is None:
            held.close()  # nothing will be built: let another process go
        yield from _written_through(reader, writer, path, config)


def _written_through(
    reader: Any, writer: _PreparedWriter | None, path: Path, config: ModelConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    """The file's tensors, each also given to ``writer`` (when there is one), which is committed
    once the last was taken and else discarded."""
    try:
        for name, tensor in gguf_tensors(reader, path, config):
            if writer is not None:
                writer.add(name, tensor.numpy())
            yield name, tensor
        if writer is not None:
            writer.commit()
    finally:
        if writer is not None:
            writer.discard()


def weights_prepared(path: Path) -> bool:
    """Whether the prepared cache holds the complete weights of GGUF file ``path``."""
    return _prepared_index(prepared_dir(path) / "weights") is not None


def prepare_weights(path: Path, config: ModelConfig) -> str:
    """Build the prepared weights of GGUF file ``path`` (no model needed: the dequantized tensors
    go to the cache alone), as a load would, under the entry's lock. Returns what happened:
    ``built``, ``present`` (already there), ``off`` (``$TIERSERVE_GGUF_CACHE_GIB`` 0),
    ``too large`` (over it) or ``failed`` (the cache could not be written: logged). Raises
    ``ModelLoadError``."""
    if prepared_limit_gib() <= 0:
        return "off"
    if weights_prepared(path):
        return "present"
    with _entry_lock(path):
        if weights_prepared(path):  # built by another process while this one waited
            return "present"
        reader = open_gguf(path)
        writer = _PreparedWriter.start(prepared_dir(path) / "weights", reader)
        if writer is None:
            return "too large" if fp32_bytes(reader) > prepared_limit_gib() * 2**30 else "failed"
        for _ in _written_through(reader, writer, path, config):
            pass
    return "built" if weights_prepared(path) else "failed"


def _prepared_tensors(
    path: Path, folder: Path, index: list[tuple[str, str]]
) -> Iterator[tuple[str, torch.Tensor]]:
    import torch

    for name, file in index:
        try:
            arr = np.load(folder / file, mmap_mode="c", allow_pickle=False)
        except (OSError, ValueError) as e:
            shutil.rmtree(folder, ignore_errors=True)  # the next start rebuilds it
            raise ModelLoadError(
                f"the prepared weights of {path} at {folder} are damaged ({file}: {e}); "
                "they were removed: start again to rebuild them from the file"
            ) from None
        yield name, torch.from_numpy(arr)


def _prepared_index(folder: Path) -> list[tuple[str, str]] | None:
    """``(name, file)`` of a complete prepared-weights folder, or None (absent, or damaged:
    then removed)."""
    index = folder / "index.json"
    if not index.is_file():
        return None
    try:
        entries = json.loads(index.read_text())
        out = []
        for e in entries:
            need = 4 * int(np.prod(e["shape"], dtype=np.int64))
            if (folder / e["file"]).stat().st_size < need:
                raise ValueError(f"{e['file']} is shorter than its {need} bytes")
            out.append((str(e["name"]), str(e["file"])))
        return out
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("ignoring the prepared weights at %s (%s)", folder, e)
        shutil.rmtree(folder, ignore_errors=True)
        return None


def prepared_limit_gib() -> float:
    """``$TIERSERVE_GGUF_CACHE_GIB``: the largest fp32 weights the prepared cache keeps."""
    raw = os.environ.get(ENV_PREPARED_GIB, "").strip()
    if not raw:
        return DEFAULT_PREPARED_GIB
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise ModelLoadError(
            f"{ENV_PREPARED_GIB} must be a size in GiB >= 0 (0 turns the cache off), got {raw!r}"
        )
    return value


def fp32_bytes(reader: Any) -> int:
    """The size of a GGUF file's tensors in fp32: what its prepared weights take."""
    return 4 * sum(int(t.n_elements) for t in reader.tensors)


class _PreparedWriter:
    """Writes the weights streamed from a GGUF file into a scratch folder beside the entry, one
    ``.npy`` per tensor, and moves it into place only once every tensor was taken."""

    def __init__(self, final: Path, tmp: Path) -> None:
        self.final, self.tmp = final, tmp
        self.index: list[dict[str, Any]] = []
        self.failed = False

    @classmethod
    def start(cls, final: Path, reader: Any) -> _PreparedWriter | None:
        limit = prepared_limit_gib()
        size = fp32_bytes(reader)
        if size > limit * 2**30:
            log.info("not caching %.1f GiB of fp32 weights (%s=%g)", size / 2**30,
                     ENV_PREPARED_GIB, limit)
            return None
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=".weights-", dir=final.parent))
        except OSError as e:
            log.warning("cannot cache the GGUF weights under %s (%s)", final.parent, e)
            return None
        return cls(final, tmp)

    def add(self, name: str, arr: np.ndarray) -> None:
        if self.failed:
            return
        file = f"{len(self.index):04d}.npy"
        try:
            np.save(self.tmp / file, arr, allow_pickle=False)
        except OSError as e:  # a full disk: this start goes on without the cache
            log.warning("cannot cache the GGUF weights under %s (%s)", self.tmp, e)
            self.failed = True
            return
        self.index.append({"name": name, "file": file, "shape": list(arr.shape)})

    def commit(self) -> None:
        if self.failed:
            return
        try:
            (self.tmp / "index.json").write_text(json.dumps(self.index))
            os.replace(self.tmp, self.final)
        except OSError as e:  # a full disk, or a process that went on without the lock
            log.warning("prepared weights not moved to %s (%s)", self.final, e)
            return
        log.info("prepared weights written to %s", self.final)

    def discard(self) -> None:
        if self.tmp.exists():
            shutil.rmtree(self.tmp, ignore_errors=True)


def gguf_tensors(reader: Any, path: Path, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's tensors under Hugging Face names (fp32, CPU), one at a time."""
    import torch  # here, not at the top: the ingress reads configs and tokenizers without torch

    layer_names = _hf_layer_names(config.architecture)
    for role, layer, arr in iter_gguf_weights(reader, path, config):
        if layer is not None and role not in layer_names:
            continue  # a Gemma norm in a file of another architecture: not the model's
        name = _HF_GLOBAL[role] if layer is None else f"model.layers.{layer}.{layer_names[role]}"
        yield name, torch.from_numpy(arr)


def iter_gguf_weights(
    reader: Any, path: Path, config: ModelConfig
) -> Iterator[tuple[str, int | None, np.ndarray]]:
    """``(role, layer, float32 array)`` for every tensor the model needs, one at a time, Q/K
    un-permuted. Roles: ``embed``, ``norm``, ``head`` (layer None) and those of ``_PER_LAYER``
    (phi3's ``ffn_up`` as ``gate_up``). Raises ``ModelLoadError`` for an unknown or unreadable
    tensor type."""
    arch = gguf_architecture(reader, path)
    permute = arch in _PERMUTED
    fused_up = arch in _PHI3_LAYOUT
    for t in reader.tensors:
        name = str(t.name)
        if name in _GLOBAL:
            role, layer = _GLOBAL[name], None
        elif name.startswith("blk."):
            _, index, rest = name.split(".", 2)
            if rest not in _PER_LAYER:
                continue  # e.g. an unused rotary cache; missing roles are found by the caller
            role, layer = _PER_LAYER[rest], int(index)
            if fused_up and role == "up":
                role = "gate_up"
        else:
            continue
        arr = _dequantized(t, path)
        if permute and role in ("q", "q_bias"):
            arr = _unpermute(arr, config.num_heads)
        elif permute and role in ("k", "k_bias"):
            arr = _unpermute(arr, config.num_kv_heads)
        elif role == "shared_expert_gate" and arr.ndim == 1:  # llama.cpp keeps it a vector
            arr = arr.reshape(1, -1)
        yield role, layer, arr


def file_digest(path: Path) -> str:
    """SHA-256 of the file, hex (about a tenth of a second per 100 MB); computed once per
    process for a file of the same path, size and modification time."""
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    with _digest_lock:
        known = _digests.get(key)
    if known is not None:
        return known
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    digest = h.hexdigest()
    with _digest_lock:
        _digests[key] = digest
    return digest


def _tokenizer_dir(path: Path) -> Path:
    return cache_root() / "gguf-tokenizers" / file_digest(path)[:32]


def tokenizer_prepared(path: Path) -> bool:
    """Whether the cache holds the tokenizer built from GGUF file ``path``."""
    return (_tokenizer_dir(path) / "tokenizer_config.json").is_file()


def gguf_tokenizer(path: Path) -> Any:
    """The file's tokenizer (with its chat template), built by ``transformers`` from the GGUF
    metadata once and then loaded from the cache. Raises ``ModelLoadError``.

    The cache holds a fast tokenizer (``tokenizer.json``), read back as one: ``AutoTokenizer``
    would import torch first (1.5 s of the ingress's start, which has no other use for it)."""
    cached = _tokenizer_dir(path)
    with _tokenizer_lock:
        if (cached / "tokenizer_config.json").is_file() and (cached / "tokenizer.json").is_file():
            from transformers import PreTrainedTokenizerFast

            try:
                return PreTrainedTokenizerFast.from_pretrained(str(cached))
            except Exception as e:  # a damaged cache entry: rebuild it
                log.warning("ignoring the cached tokenizer at %s (%s)", cached, e)
        from transformers import AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        except Exception as e:
            raise ModelLoadError(
                f"{path}: cannot build a tokenizer from the GGUF metadata "
                f"({type(e).__name__}: {e})"
            ) from e
        tmp: Path | None = None
        try:
            cached.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=cached.name, dir=cached.parent))
            tok.save_pretrained(str(tmp))
            shutil.rmtree(cached, ignore_errors=True)  # a damaged entry
            os.replace(tmp, cached)  # another process may have won the race: fine
        except OSError as e:  # no writable cache: every start builds it again
            log.warning("cannot cache the GGUF tokenizer under %s (%s)", cached.parent, e)
        finally:
            if tmp is not None and tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        return tok
