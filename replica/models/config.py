"""Model configuration: the few numbers the model code needs (the Llama family's, and Gemma 2's
and Gemma 3's), read from a HF config."""

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
    "Phi3ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
)
# The Gemma decoders (``tierserve.replica.models.gemma``): (1 + weight) norms, four per layer,
# GELU-tanh MLP, scaled embeddings, per-layer sliding or global attention.
GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
_ARCH_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
# The architectures whose sliding window applies only where ``layer_types`` (or, in older
# configs, ``use_sliding_window``) says so: their configs name a window they may not use.
_LAYERED_WINDOW = (
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    *GEMMA_ARCHITECTURES,
)
# The mixture-of-experts architectures (``_moe_fields`` reads their expert fields).
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
# The architectures whose rotary embedding may cover only part of each head
# (``partial_rotary_factor`` < 1): transformers' Llama-style attention rotates whole heads.
_PARTIAL_ROTARY = ("Phi3ForCausalLM",)
# Per-layer attention kinds, as ``layer_types`` in Hugging Face configs names them: a layer
# attends to the last ``sliding_window`` positions, or to every earlier one.
SLIDING_ATTENTION = "sliding_attention"
FULL_ATTENTION = "full_attention"
LAYER_TYPES = (SLIDING_ATTENTION, FULL_ATTENTION)
# MLP activations: SwiGLU's SiLU (the Llama family), Gemma's tanh-approximated GELU.
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


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


@dataclass(frozen=True, slots=True)
class LongRopeScaling:
    """LongRoPE ("longrope", Phi-3's "su") rotary scaling: each inverse frequency divided by its
    own factor, ``short_factor`` or ``long_factor`` (one per frequency of the rotary dims).

    ``transformers`` switches between the two by the current sequence length (long past
    ``original_max_position_embeddings``), which a paged KV cache cannot follow: keys already in
    the cache were rotated with the short factors, and a prefix-cached block is shared by
    sequences of any length. So the choice is made once per engine (``factors``): the short
    factors when the engine serves at most ``original_max_position_embeddings`` positions (every
    token then equals ``transformers``'), the long ones when it serves more (as llama.cpp
    chooses by its context size). ``attention_factor`` multiplies the rotated part of the
    cos/sin tables either way, as ``transformers`` does; already resolved from the config
    (``sqrt(1 + ln(s) / ln(original))``, ``s = max_position_embeddings / original``, 1 for
    ``s <= 1``) when it did not give one.
    """

    short_factor: tuple[float, ...]
    long_factor: tuple[float, ...]
    original_max_position_embeddings: int
    attention_factor: float
    rope_type: str = "longrope"  # tells ``ModelConfig.from_json`` which scaling it reads

    def __post_init__(self) -> None:
        # from_json hands lists: keep tuples, so that the config stays hashable and comparable.
        object.__setattr__(self, "short_factor", tuple(float(f) for f in self.short_factor))
        object.__setattr__(self, "long_factor", tuple(float(f) for f in self.long_factor))

    def factors(self, max_positions: int) -> tuple[float, ...]:
        """The factors an engine serving ``max_positions`` positions uses (see the class)."""
        if max_positions > self.original_max_position_embeddings:
            return self.long_factor
        return self.short_factor


def longrope_attention_factor(factor: float, original_max_position_embeddings: int) -> float:
    """LongRoPE's default attention scaling ``sqrt(1 + ln(factor) / ln(original))`` (1 for
    ``factor <= 1``)."""
    if factor <= 1:
        return 1.0
    return math.sqrt(1 + math.log(factor) / math.log(original_max_position_embeddings))


@dataclass(frozen=True, slots=True)
class LinearScaling:
    """Linear ("linear", position interpolation) rotary scaling: positions divided by ``factor``
    (every inverse frequency divided by it). Gemma 3's global layers from 4B up use factor 8."""

    factor: float
    rope_type: str = "linear"  # tells ``ModelConfig.from_json`` which scaling it reads


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
    ``rotary_dim``: the leading dims of each q/k head that the rotary embedding turns (Phi-3's
    ``partial_rotary_factor``: Phi-4-mini rotates 96 of 128), the rest passing through; None
    for all of ``head_dim``. The model keeps those dims in another order than the checkpoint
    (``layers.rotary_permutation``: the loaders permute the q/k rows), so that the rotary
    kernels, which turn pairs ``(i, i + head_dim / 2)``, need no change.

    Gemma (``GEMMA_ARCHITECTURES``; the fields below keep the Llama family's meaning at their
    defaults):
    ``hidden_act``: the MLP's gate activation, one of ``ACTIVATIONS``.
    ``layer_types``: per layer, ``"sliding_attention"`` (the window applies) or
    ``"full_attention"``; None: the window, if any, applies to every layer (Mistral).
    ``layer_windows()`` resolves the two into each layer's window.
    ``rope_local_theta``: the rotary base of the sliding layers, which then have their own
    unscaled table (Gemma 3: 10000, the global layers ``rope_theta`` 1e6 with ``rope_scaling``);
    None: every layer shares one table.
    ``query_pre_attn_scalar``: attention scores are scaled by its ``** -0.5`` (None: by
    ``head_dim ** -0.5``).
    ``attn_logit_softcapping`` / ``final_logit_softcapping``: scores / logits ``s`` become
    ``c * tanh(s / c)`` (Gemma 2: 50 and 30); None: uncapped.

    Mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE; the defaults mean a dense model):
    ``num_experts`` routed experts, of which a router picks ``num_experts_per_tok`` per token
    (softmax over all experts in fp32, then the top k); ``norm_topk_prob``: the k weights are
    divided by their sum (Mixtral always; Qwen by its config). Each expert is a SwiGLU MLP of
    ``moe_intermediate_size``. ``moe_layers``: the layers whose MLP is the experts (the others
    keep the dense MLP of ``intermediate_size``). ``shared_expert_intermediate_size`` > 0
    (Qwen2-MoE): every token also runs a shared SwiGLU expert of that size, scaled by the
    sigmoid of its own one-output gate, added to the routed experts' sum.
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
    rope_scaling: RopeScaling | YarnScaling | LongRopeScaling | LinearScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    sliding_window: int | None = None
    rotary_dim: int | None = None
    # Gemma (see the class docstring).
    hidden_act: str = "silu"
    layer_types: tuple[str, ...] | None = None
    rope_local_theta: float | None = None
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: tuple[int, ...] = ()
    shared_expert_intermediate_size: int = 0

    def __post_init__(self) -> None:
        self._check_moe()
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
        if self.hidden_act not in ACTIVATIONS:
            raise ModelLoadError(
                f"{self.architecture}: activation {self.hidden_act!r} is not supported; "
                f"supported: {', '.join(ACTIVATIONS)}"
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
            if SLIDING_ATTENTION in self.layer_types and self.sliding_window is None:
                raise ModelLoadError(
                    f"{self.architecture}: layer_types has sliding_attention layers but the "
                    "config names no sliding_window"
                )
        for name in ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ModelLoadError(f"{self.architecture}: {name} must be > 0, got {value}")
        self._check_rotary()

    def _check_rotary(self) -> None:
        """Partial rotary dims and LongRoPE factors that fit the head; ModelLoadError if not."""
        rot = self.rope_dim
        if not 0 < rot <= self.head_dim or rot % 2:
            raise ModelLoadError(
                f"{self.architecture}: the rotary embedding must turn an even number of dims, "
                f"at most head_dim {self.head_dim}; got rotary_dim {self.rotary_dim}"
            )
        scaling = self.rope_scaling
        if isinstance(scaling, LongRopeScaling):
            for name in ("short_factor", "long_factor"):
                factors = getattr(scaling, name)
                if len(factors) != rot // 2:
                    raise ModelLoadError(
                        f"{self.architecture}: longrope {name} has {len(factors)} entries; the "
                        f"rotary dims ({rot}) need {rot // 2}, one per frequency"
                    )
                if not all(math.isfinite(f) and f > 0 for f in factors):
                    raise ModelLoadError(
                        f"{self.architecture}: longrope {name} must hold positive numbers"
                    )
            if scaling.original_max_position_embeddings <= 0 or not scaling.attention_factor > 0:
                raise ModelLoadError(
                    f"{self.architecture}: longrope needs a positive "
                    "original_max_position_embeddings and attention_factor, got "
                    f"{scaling.original_max_position_embeddings} and {scaling.attention_factor}"
                )

    @property
    def rope_dim(self) -> int:
        """The dims of each q/k head the rotary embedding turns (``rotary_dim`` or ``head_dim``)."""
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    def _check_moe(self) -> None:
        if not self.moe_layers and not self.num_experts:
            return
        what = f"{self.architecture}: mixture of experts"
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ModelLoadError(
                f"{what} with {self.num_experts} experts and {self.num_experts_per_tok} per "
                "token: it needs 1 <= experts per token <= experts"
            )
        if self.moe_intermediate_size <= 0:
            raise ModelLoadError(
                f"{what} needs a positive expert intermediate size, got "
                f"{self.moe_intermediate_size}"
            )
        bad = [i for i in self.moe_layers if not 0 <= i < self.num_layers]
        if bad or list(self.moe_layers) != sorted(set(self.moe_layers)):
            raise ModelLoadError(
                f"{what}: sparse layers {list(self.moe_layers)} are not distinct increasing "
                f"layer indices below {self.num_layers}"
            )
        if self.shared_expert_intermediate_size < 0:
            raise ModelLoadError(f"{what}: negative shared expert intermediate size")

    @property
    def is_moe(self) -> bool:
        """Whether any layer's MLP is a mixture of experts."""
        return bool(self.moe_layers)

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer ``layer``'s MLP is the experts (else the dense SwiGLU)."""
        return layer in self.moe_layers

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
        elif scaling.get("rope_type") == "longrope":
            fields["rope_scaling"] = LongRopeScaling(**scaling)
        elif scaling.get("rope_type") == "linear":
            fields["rope_scaling"] = LinearScaling(**scaling)
        else:
            fields["rope_scaling"] = RopeScaling(**scaling)
        fields["eos_token_ids"] = tuple(fields.get("eos_token_ids", ()))
        if fields.get("layer_types") is not None:
            fields["layer_types"] = tuple(fields["layer_types"])
        fields["moe_layers"] = tuple(fields.get("moe_layers", ()))
        return cls(**fields)

    @classmethod
    def from_hf(cls, hf: Any) -> ModelConfig:
        """Build from a ``transformers`` config (v4 or v5 field names); unsupported -> ModelLoadError."""
        arch = _architecture(hf)
        if arch in GEMMA_ARCHITECTURES:
            return _gemma(hf, arch)
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
        rotary_dim = _rotary_dim(hf, arch, int(head_dim))
        attention_bias = bool(getattr(hf, "attention_bias", False))
        qwen2 = arch == "Qwen2ForCausalLM"
        if arch == "Qwen2MoeForCausalLM":  # its q/k/v bias has its own switch, o_proj none
            qwen2, attention_bias = bool(getattr(hf, "qkv_bias", True)), False
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
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            bos_token_id=getattr(hf, "bos_token_id", None),
            eos_token_ids=tuple(int(e) for e in eos_ids),
            pad_token_id=getattr(hf, "pad_token_id", None),
            sliding_window=window,
            layer_types=_layer_types(hf, arch, window),
            rotary_dim=rotary_dim,
            **_moe_fields(hf, arch),
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


def _rope_parameters(hf: Any) -> tuple[Mapping[str, Any], dict[str, Any]]:
    """The config's rope parameters (v5 ``rope_parameters``, per layer type or not) and those
    merged over the legacy ``rope_scaling``."""
    params: Mapping[str, Any] = getattr(hf, "rope_parameters", None) or {}
    legacy: Mapping[str, Any] = getattr(hf, "rope_scaling", None) or {}
    if "full_attention" in params:  # per-layer-type parameters (v5): all our layers are full
        params = params["full_attention"]
    scaling = dict(legacy)
    scaling.update(params)
    return params, scaling


def _rope(
    hf: Any, arch: str
) -> tuple[float, RopeScaling | YarnScaling | LongRopeScaling | LinearScaling | None]:
    params, scaling = _rope_parameters(hf)
    theta = float(params.get("rope_theta", getattr(hf, "rope_theta", None) or 10000.0))
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "su":  # LongRoPE's first name (early Phi-3 configs)
        rope_type = "longrope"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"{arch}: rope scaling type {rope_type!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return theta, None
    if rope_type == "yarn":
        return theta, _yarn(hf, arch, scaling)
    if rope_type == "longrope":
        return theta, _longrope(hf, arch, scaling)
    if rope_type == "linear":
        factor = float(scaling.get("factor") or 0)
        if not factor > 0:
            raise ModelLoadError(
                f"{arch}: linear rope scaling needs a factor > 0, got {scaling.get('factor')!r}"
            )
        return theta, LinearScaling(factor)
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


def _longrope(hf: Any, arch: str, scaling: Mapping[str, Any]) -> LongRopeScaling:
    """The LongRoPE parameters as ``transformers``' ``_compute_longrope_parameters`` reads them
    (the factor lists' lengths are checked against the rotary dims by ``ModelConfig``)."""
    max_pos = int(hf.max_position_embeddings)
    # As for YaRN, a config-level original_max_position_embeddings wins (Phi-3 keeps it there).
    orig = getattr(hf, "original_max_position_embeddings", None)
    if orig is None:
        orig = scaling.get("original_max_position_embeddings") or max_pos
    orig = int(orig)
    factors: dict[str, tuple[float, ...]] = {}
    for name in ("short_factor", "long_factor"):
        value = scaling.get(name)
        if value is None:
            raise ModelLoadError(f"{arch}: longrope rope scaling lacks the field {name!r}")
        if not isinstance(value, (list, tuple)) or not all(
            isinstance(f, (int, float)) and not isinstance(f, bool) for f in value
        ):
            raise ModelLoadError(
                f"{arch}: longrope {name} must be a list of numbers, got {value!r}"
            )
        factors[name] = tuple(float(f) for f in value)
    if orig <= 0:
        raise ModelLoadError(
            f"{arch}: longrope needs a positive original_max_position_embeddings, got {orig}"
        )
    factor = scaling.get("factor")
    factor = max_pos / orig if factor is None else float(factor)
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = longrope_attention_factor(factor, orig)
    return LongRopeScaling(
        short_factor=factors["short_factor"],
        long_factor=factors["long_factor"],
        original_max_position_embeddings=orig,
        attention_factor=float(attention_factor),
    )


def _rotary_dim(hf: Any, arch: str, head_dim: int) -> int | None:
    """The rotated dims of each head when ``partial_rotary_factor`` (in the rope parameters, or
    on the config itself in older configs) is below 1, as ``transformers`` rounds it
    (``int(head_dim * factor)``); None when the whole head turns."""
    _, scaling = _rope_parameters(hf)
    factor = scaling.get("partial_rotary_factor")
    if factor is None:
        factor = getattr(hf, "partial_rotary_factor", None)
    factor = 1.0 if factor is None else float(factor)
    if factor == 1.0:
        return None
    if arch not in _PARTIAL_ROTARY:
        raise ModelLoadError(
            f"{arch}: partial rotary embeddings (partial_rotary_factor {factor}) are supported "
            f"for {', '.join(_PARTIAL_ROTARY)} only"
        )
    rot = int(head_dim * factor)
    if not 0 < factor < 1 or rot <= 0 or rot % 2:
        raise ModelLoadError(
            f"{arch}: partial_rotary_factor {factor} of head_dim {head_dim} gives {rot} rotary "
            "dims; it must be in (0, 1] and give an even number of dims"
        )
    return rot


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


def _gemma(hf: Any, arch: str) -> ModelConfig:
    """Gemma 2 / Gemma 3 (text): the fields ``transformers``' Gemma configs carry. Gemma 3's
    ``rope_parameters`` are per layer type: the global (``full_attention``) ones give
    ``rope_theta``/``rope_scaling``, the ``sliding_attention`` ones ``rope_local_theta`` (which
    must be unscaled); Gemma 2's one set serves every layer."""
    act = getattr(hf, "hidden_activation", None) or getattr(hf, "hidden_act", None)
    if act != "gelu_pytorch_tanh":
        raise ModelLoadError(
            f"{arch}: hidden_activation {act!r} is not supported (only gelu_pytorch_tanh)"
        )
    if getattr(hf, "use_bidirectional_attention", False):
        raise ModelLoadError(
            f"{arch}: use_bidirectional_attention=True (an encoder's attention) is not supported; "
            "only causal attention is"
        )
    theta, scaling = _rope(hf, arch)
    local_theta = None
    params: Mapping[str, Any] = getattr(hf, "rope_parameters", None) or {}
    local = params.get("sliding_attention")
    if local is not None:
        local_type = local.get("rope_type", "default")
        if local_type != "default":
            raise ModelLoadError(
                f"{arch}: rope type {local_type!r} on the sliding-window layers is not "
                "supported (only default: their table is unscaled)"
            )
        local_theta = float(local.get("rope_theta") or 10000.0)
    heads = int(hf.num_attention_heads)
    hidden = int(hf.hidden_size)
    layer_types = getattr(hf, "layer_types", None)
    bias = bool(getattr(hf, "attention_bias", False))
    eos = getattr(hf, "eos_token_id", None)
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
    scalar = getattr(hf, "query_pre_attn_scalar", None)
    attn_cap = getattr(hf, "attn_logit_softcapping", None)
    final_cap = getattr(hf, "final_logit_softcapping", None)
    return ModelConfig(
        architecture=arch,
        vocab_size=int(hf.vocab_size),
        hidden_size=hidden,
        num_layers=int(hf.num_hidden_layers),
        num_heads=heads,
        num_kv_heads=int(getattr(hf, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(hf, "head_dim", None) or hidden // heads),
        intermediate_size=int(hf.intermediate_size),
        rms_norm_eps=float(hf.rms_norm_eps),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(hf.max_position_embeddings),
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", True)),
        qkv_bias=bias,
        o_bias=bias,
        qk_norm=arch == "Gemma3ForCausalLM",
        bos_token_id=getattr(hf, "bos_token_id", None),
        eos_token_ids=tuple(int(e) for e in eos_ids),
        pad_token_id=getattr(hf, "pad_token_id", None),
        sliding_window=_sliding_window(hf, arch),
        hidden_act="gelu_pytorch_tanh",
        layer_types=None if layer_types is None else tuple(str(t) for t in layer_types),
        rope_local_theta=local_theta,
        query_pre_attn_scalar=None if scalar is None else float(scalar),
        attn_logit_softcapping=None if attn_cap is None else float(attn_cap),
        final_logit_softcapping=None if final_cap is None else float(final_cap),
    )


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


def _moe_fields(hf: Any, arch: str) -> dict[str, Any]:
    """The mixture-of-experts fields of ``ModelConfig`` from a ``transformers`` config (none for
    a dense architecture), with which layers are sparse as ``transformers`` decides it: Mixtral
    all; Qwen2/3-MoE those not in ``mlp_only_layers`` whose ``(index + 1)`` is a multiple of
    ``decoder_sparse_step``. Unsupported variants -> ModelLoadError."""
    if arch not in MOE_ARCHITECTURES:
        return {}
    layers = int(hf.num_hidden_layers)
    experts = getattr(hf, "num_local_experts", None)
    if experts is None:
        experts = getattr(hf, "num_experts", 0)
    experts = int(experts or 0)
    top_k = int(getattr(hf, "num_experts_per_tok", 0) or 0)
    if arch == "MixtralForCausalLM":
        sparse = tuple(range(layers)) if experts > 0 else ()
        return dict(
            num_experts=experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=int(hf.intermediate_size),
            norm_topk_prob=True,
            moe_layers=sparse,
        )
    step = int(getattr(hf, "decoder_sparse_step", 1) or 1)
    dense_only = {int(i) for i in (getattr(hf, "mlp_only_layers", None) or ())}
    sparse = tuple(
        i for i in range(layers) if i not in dense_only and experts > 0 and (i + 1) % step == 0
    )
    shared = 0
    if arch == "Qwen2MoeForCausalLM":
        shared = int(getattr(hf, "shared_expert_intermediate_size", 0) or 0)
        if shared <= 0:
            raise ModelLoadError(
                f"{arch}: shared_expert_intermediate_size {shared}: a Qwen2-MoE without its "
                "shared expert is not supported"
            )
    return dict(
        num_experts=experts if sparse else 0,
        num_experts_per_tok=top_k if sparse else 0,
        moe_intermediate_size=int(getattr(hf, "moe_intermediate_size", 0) or 0) if sparse else 0,
        norm_topk_prob=bool(getattr(hf, "norm_topk_prob", False)),
        moe_layers=sparse,
        shared_expert_intermediate_size=shared if sparse else 0,
    )
