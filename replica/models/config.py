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
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
)
_ARCH_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
# The architectures whose sliding window applies only where ``layer_types`` (or, in older
# configs, ``use_sliding_window``) says so: their configs name a window they may not use.
_LAYERED_WINDOW = (
    "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"
)
# The mixture-of-experts architectures (``MoeSpec.from_hf`` reads their expert fields).
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "llama3", "yarn")


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

    def check_context(self, max_model_len: int) -> None:
        """Raise ``ModelLoadError`` if serving ``max_model_len`` positions needs what we lack."""
        if max_model_len > self.max_position_embeddings:
            raise ModelLoadError(
                f"max_model_len {max_model_len} exceeds the model's "
                f"max_position_embeddings {self.max_position_embeddings}"
            )
        if self.sliding_window is not None and self.sliding_window < max_model_len:
            raise ModelLoadError(
                f"{self.architecture} uses sliding-window attention (window {self.sliding_window}) "
                f"and sliding windows are not supported; set max_model_len <= "
                f"{self.sliding_window} to serve it with full attention"
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
        fields["moe_layers"] = tuple(fields.get("moe_layers", ()))
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
        if arch == "Qwen2MoeForCausalLM":  # its q/k/v bias has its own switch, o_proj none
            qwen2, attention_bias = bool(getattr(hf, "qkv_bias", True)), False
        eos = getattr(hf, "eos_token_id", None)
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
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
            sliding_window=_sliding_window(hf, arch),
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
