"""Model configuration: the few numbers the Llama-family model code needs, read from a HF config."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
_ARCH_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# The architectures whose sliding window applies only where ``layer_types`` (or, in older
# configs, ``use_sliding_window``) says so: their configs name a window they may not use.
_LAYERED_WINDOW = ("Qwen2ForCausalLM", "Qwen3ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "llama3", "yarn")
# Per-layer attention kinds, as ``layer_types`` in Hugging Face configs names them.
SLIDING_ATTENTION = "sliding_attention"
FULL_ATTENTION = "full_attention"
LAYER_TYPES = (SLIDING_ATTENTION, FULL_ATTENTION)


class ModelLoadError(ValueError):
    """A model could not be built or loaded; the message says what was wrong and what to do."""


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Llama 3 ("llama3") rotary frequency scaling."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True, slots=True)
class YarnScaling:
    """YaRN ("yarn") rotary scaling, as ``transformers`` computes it.

    Frequencies that turn fewer than ``beta_slow`` times over ``original_max_position_embeddings``
    are divided by ``factor``, those turning more than ``beta_fast`` times are kept, and a linear
    ramp over the head dimensions blends the two between (the ramp's ends rounded outwards when
    ``truncate``). ``attention_factor`` multiplies the cos/sin tables: already resolved from
    ``factor`` (and ``mscale``/``mscale_all_dim``) when the config did not give it.
    """

    factor: float
    original_max_position_embeddings: int
    attention_factor: float
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    rope_type: str = "yarn"  # tells ``ModelConfig.from_json`` which scaling it reads


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention scaling ``0.1 * mscale * ln(factor) + 1`` (1 for ``factor <= 1``)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder.

    ``qkv_bias``: q/k/v projections carry a bias (Qwen2; Llama and Qwen3 with ``attention_bias``).
    ``o_bias``: the output projection carries a bias (Llama and Qwen3 with ``attention_bias``).
    ``qk_norm``: each query and key head is RMS-normalized over ``head_dim`` (weights
    ``self_attn.q_norm`` and ``self_attn.k_norm``, eps ``rms_norm_eps``) before the rotary
    embedding (Qwen3).
    ``sliding_window``: the window the checkpoint was trained with, or None for full attention.
    ``layer_types``: per layer, ``"sliding_attention"`` (the window applies) or
    ``"full_attention"``; None: the window, if any, applies to every layer (Mistral).
    ``layer_windows()`` resolves the two into each layer's window.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | YarnScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"{self.num_heads} attention heads is not a multiple of {self.num_kv_heads} "
                "key/value heads"
            )
        if self.head_dim % 2:
            raise ModelLoadError(f"rotary embeddings need an even head_dim, got {self.head_dim}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ModelLoadError(
                f"{self.architecture}: sliding_window must be at least 1, got {self.sliding_window}"
            )
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers:
                raise ModelLoadError(
                    f"{self.architecture}: layer_types names {len(self.layer_types)} layers but "
                    f"the model has {self.num_layers}"
                )
            unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if unknown:
                raise ModelLoadError(
                    f"{self.architecture}: layer type(s) {', '.join(map(repr, unknown))} not "
                    f"supported; supported: {', '.join(LAYER_TYPES)}"
                )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's attention window (None: full causal attention), for ``attention``'s
        ``window``: ``sliding_window`` on the layers ``layer_types`` calls sliding (on every
        layer without ``layer_types``), None elsewhere and everywhere without a window."""
        if self.sliding_window is None:
            return (None,) * self.num_layers
        if self.layer_types is None:
            return (self.sliding_window,) * self.num_layers
        return tuple(
            self.sliding_window if t == SLIDING_ATTENTION else None for t in self.layer_types
        )

    def check_context(self, max_model_len: int) -> None:
        """Raise ``ModelLoadError`` if serving ``max_model_len`` positions needs what we lack.

        A sliding window shorter than ``max_model_len`` is served as such (the attention kernels
        take the window per layer), so it is no reason to refuse.
        """
        if max_model_len > self.max_position_embeddings:
            raise ModelLoadError(
                f"max_model_len {max_model_len} exceeds the model's "
                f"max_position_embeddings {self.max_position_embeddings}"
            )

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (``from_json`` reads it back to an equal config)."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ModelConfig:
        """The config ``to_json`` wrote; a ``KeyError``/``TypeError`` for anything else."""
        fields = dict(data)
        scaling = fields.get("rope_scaling")
        if scaling is None:
            fields["rope_scaling"] = None
        elif scaling.get("rope_type") == "yarn":
            fields["rope_scaling"] = YarnScaling(**scaling)
        else:
            fields["rope_scaling"] = RopeScaling(**scaling)
        fields["eos_token_ids"] = tuple(fields.get("eos_token_ids", ()))
        if fields.get("layer_types") is not None:
            fields["layer_types"] = tuple(fields["layer_types"])
        return cls(**fields)

    @classmethod
    def from_hf(cls, hf: Any) -> ModelConfig:
        """Build from a ``transformers`` config (v4 or v5 field names); unsupported -> ModelLoadError."""
        arch = _architecture(hf)
        act = getattr(hf, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ModelLoadError(f"{arch}: activation {act!r} is not supported (only silu)")
        if getattr(hf, "mlp_bias", False):
            raise ModelLoadError(f"{arch}: mlp_bias=True is not supported")
        if getattr(hf, "pretraining_tp", 1) not in (1, None):
            raise ModelLoadError(f"{arch}: pretraining_tp != 1 is not supported")
        heads = int(hf.num_attention_heads)
        hidden = int(hf.hidden_size)
        head_dim = getattr(hf, "head_dim", None) or hidden // heads
        theta, scaling = _rope(hf, arch)
        attention_bias = bool(getattr(hf, "attention_bias", False))
        qwen2 = arch == "Qwen2ForCausalLM"
        eos = getattr(hf, "eos_token_id", None)
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        window = _sliding_window(hf, arch)
        return cls(
            architecture=arch,
            vocab_size=int(hf.vocab_size),
            hidden_size=hidden,
            num_layers=int(hf.num_hidden_layers),
            num_heads=heads,
            num_kv_heads=int(getattr(hf, "num_key_value_heads", None) or heads),
            head_dim=int(head_dim),
            intermediate_size=int(hf.intermediate_size),
            rms_norm_eps=float(hf.rms_norm_eps),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(hf.max_position_embeddings),
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            qkv_bias=qwen2 or attention_bias,
            o_bias=attention_bias and not qwen2,
            qk_norm=arch == "Qwen3ForCausalLM",
            bos_token_id=getattr(hf, "bos_token_id", None),
            eos_token_ids=tuple(int(e) for e in eos_ids),
            pad_token_id=getattr(hf, "pad_token_id", None),
            sliding_window=window,
            layer_types=_layer_types(hf, arch, window),
        )


def _architecture(hf: Any) -> str:
    archs = getattr(hf, "architectures", None) or []
    model_type = getattr(hf, "model_type", None)
    arch = (
        archs[0] if archs else _ARCH_BY_MODEL_TYPE.get(str(model_type), f"model_type={model_type}")
    )
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return str(arch)


def _rope(hf: Any, arch: str) -> tuple[float, RopeScaling | YarnScaling | None]:
    params: Mapping[str, Any] = getattr(hf, "rope_parameters", None) or {}
    legacy: Mapping[str, Any] = getattr(hf, "rope_scaling", None) or {}
    if "full_attention" in params:  # per-layer-type parameters (v5): all our layers are full
        params = params["full_attention"]
    theta = float(params.get("rope_theta", getattr(hf, "rope_theta", None) or 10000.0))
    scaling = dict(legacy)
    scaling.update(params)
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"{arch}: rope scaling type {rope_type!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if float(scaling.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ModelLoadError(f"{arch}: partial rotary embeddings are not supported")
    if rope_type == "default":
        return theta, None
    if rope_type == "yarn":
        return theta, _yarn(hf, arch, scaling)
    try:
        return theta, RopeScaling(
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
        )
    except KeyError as e:
        raise ModelLoadError(f"{arch}: llama3 rope scaling lacks the field {e.args[0]!r}") from e


def _yarn(hf: Any, arch: str, scaling: Mapping[str, Any]) -> YarnScaling:
    """The YaRN parameters as ``transformers``' ``_compute_yarn_parameters`` reads them."""
    max_pos = int(hf.max_position_embeddings)
    # A config-level original_max_position_embeddings wins (transformers' standardization);
    # lacking both, transformers takes max_position_embeddings.
    orig = getattr(hf, "original_max_position_embeddings", None)
    if orig is None:
        orig = scaling.get("original_max_position_embeddings") or max_pos
    orig = int(orig)
    factor = scaling.get("factor")
    factor = max_pos / orig if factor is None else float(factor)
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, float(mscale)) / yarn_mscale(
                factor, float(mscale_all_dim)
            )
        else:
            attention_factor = yarn_mscale(factor)
    if factor <= 0 or float(attention_factor) <= 0:
        raise ModelLoadError(
            f"{arch}: yarn rope scaling needs a positive factor and attention_factor, got "
            f"{factor} and {attention_factor}"
        )
    return YarnScaling(
        factor=factor,
        original_max_position_embeddings=orig,
        attention_factor=float(attention_factor),
        beta_fast=float(scaling.get("beta_fast") or 32),  # transformers: 0/None -> the default
        beta_slow=float(scaling.get("beta_slow") or 1),
        truncate=bool(scaling.get("truncate", True)),
    )


def _sliding_window(hf: Any, arch: str) -> int | None:
    window = getattr(hf, "sliding_window", None)
    if window is None:
        return None
    if arch in _LAYERED_WINDOW:
        layer_types = getattr(hf, "layer_types", None)
        if layer_types is not None:
            used = "sliding_attention" in layer_types
        else:
            used = bool(getattr(hf, "use_sliding_window", False))
        if not used:
            return None
    return int(window)


def _layer_types(hf: Any, arch: str, window: int | None) -> tuple[str, ...] | None:
    """Which layers the window applies to, for the architectures where that is per layer: the
    config's ``layer_types``, or in older configs the layers from ``max_window_layers`` on (as
    ``transformers`` derives it). None where every layer is alike (no window, or Mistral's)."""
    if window is None or arch not in _LAYERED_WINDOW:
        return None
    layer_types = getattr(hf, "layer_types", None)
    if layer_types is not None:
        return tuple(str(t) for t in layer_types)
    first = int(getattr(hf, "max_window_layers", 0) or 0)
    layers = int(hf.num_hidden_layers)
    return tuple(SLIDING_ATTENTION if i >= first else FULL_ATTENTION for i in range(layers))
