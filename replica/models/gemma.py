"""The Gemma 2 and Gemma 3 (text) decoders over one flat batch of paged sequences.

Built from the Llama family's layers (``tierserve.replica.models.layers``) and run the same way
(``tierserve.replica.models.llama``'s flat batch, paged KV caches, ``ModelOptions``); what differs:

- Norms scale by ``(1 + weight)``, in fp32: the checkpoint's ``weight`` is an offset from one.
  The one is folded in at load (``fold_norm_offsets`` for Hugging Face checkpoints; llama.cpp's
  GGUF files store ``1 + weight`` already), into a weight kept in fp32 whatever the model's
  dtype, and the normalized row is multiplied by it before it is rounded to the model's dtype
  (``GemmaRMSNorm``). That gives the bits of ``transformers``' ``x_normed * (1.0 + w.float())``.
  The q/k head norms (Gemma 3) and the final norm are the same kind.
- Four norms per layer ("sandwich"): input -> attention -> post-attention norm -> residual add;
  pre-feedforward norm -> MLP -> post-feedforward norm -> residual add.
- The MLP is ``down(gelu_tanh(gate(x)) * up(x))``: on CPU the activation is the native kernel's
  fused GELU-tanh-and-mul (``cpu_ops.gelu_tanh_and_mul``, each element alone), elsewhere torch's
  ``gelu(approximate="tanh")``. The deterministic mode runs every layer on the native kernels,
  as for the Llama family; it refuses Gemma 2's final logit soft-cap (a torch ``tanh`` over the
  logits, whose bits it does not hold to).
- Embeddings are multiplied by ``sqrt(hidden_size)`` rounded to the model's dtype (as
  ``transformers`` does: 25.25 in bf16 where 25.298... in fp32 for hidden 640).
- Attention scores are scaled by ``query_pre_attn_scalar ** -0.5``; each layer attends fully or
  within ``sliding_window`` (``ModelConfig.layer_windows``); Gemma 2 soft-caps the scores
  (``attn_logit_softcapping``) and the final logits (``final_logit_softcapping``).
- Gemma 3's sliding layers have their own rotary table (base ``rope_local_theta``, unscaled), its
  global layers the ``rope_theta``/``rope_scaling`` one: the model holds both and each layer
  takes its own.

Windows and score capping are arguments of ``tierserve.kernels.attention.attention``
(``window``, ``softcap``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from tierserve.kernels import cpu_native, cpu_ops
from tierserve.kernels.metadata import AttentionMetadata
from tierserve.replica.models.config import GEMMA_ARCHITECTURES, ModelConfig, ModelLoadError
from tierserve.replica.models.layers import (
    RMSNorm,
    RotaryEmbedding,
    SwiGLU,
    VocabEmbedding,
)
from tierserve.replica.models.llama import (
    Decoder,
    KVCache,
    LlamaAttention,
    LlamaForCausalLM,
    ModelOptions,
    Rope,
)

__all__ = [
    "GEMMA_ARCHITECTURES",
    "LAYER_NORMS",
    "GemmaForCausalLM",
    "GemmaRMSNorm",
    "fold_norm_offsets",
    "gelu_tanh_and_mul",
]

# A layer's four norms, by their Hugging Face names ("sandwich": around attention and the MLP).
LAYER_NORMS = (
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
)


class GemmaRMSNorm(RMSNorm):
    """``x / sqrt(mean(x^2) + eps) * weight`` with ``weight`` (= ``1 + w`` of the checkpoint)
    in fp32 whatever the model's dtype, the product taken in fp32 and rounded once to ``x``'s
    dtype (``RMSNorm`` rounds the normalized row before its weight multiplies it). On the native
    kernel for fp32 rows on CPU (where no rounding lies between); never the fused Triton kernel
    (which rounds as ``RMSNorm`` does)."""

    def __init__(
        self,
        hidden_size: int,
        eps: float,
        deterministic: bool = False,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(hidden_size, eps, deterministic, device, torch.float32, fused=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.deterministic:
            cpu_native.require_fused(x, "RMSNorm")
        if cpu_native.fused_ok(x):
            return cpu_ops.rms_norm(x, self.weight, self.eps)
        xf = x.float()
        out = xf * xf.pow(2).mean(-1, keepdim=True).add_(self.eps).rsqrt_()
        return out.mul_(self.weight).to(x.dtype)


def gemma_qk_norm_(
    qkv: torch.Tensor, q_norm: RMSNorm, k_norm: RMSNorm, q_heads: int
) -> None:
    """Gemma 3's q/k norm: each q head of ``qkv`` ``[T, q_heads + 2 * kv_heads, D]`` normalized by
    ``q_norm`` and each k head by ``k_norm`` over ``D``, in place, as ``GemmaRMSNorm`` does a row;
    v is left alone. On the native kernel (``cpu_ops.qk_norm``) where it takes ``qkv``."""
    if q_norm.deterministic:
        cpu_native.require_fused(qkv, "q/k RMSNorm")
    if cpu_native.fused_ok(qkv):
        cpu_ops.qk_norm(qkv, q_norm.weight, k_norm.weight, q_heads, q_norm.eps)
        return
    kv_heads = (qkv.shape[1] - q_heads) // 2
    qk = qkv[:, : q_heads + kv_heads]
    xf = qk.float()
    normed = xf * xf.pow(2).mean(-1, keepdim=True).add_(q_norm.eps).rsqrt_()
    qk[:, :q_heads] = (normed[:, :q_heads] * q_norm.weight).to(qkv.dtype)
    qk[:, q_heads:] = (normed[:, q_heads:] * k_norm.weight).to(qkv.dtype)


def gelu_tanh_and_mul(gate_up: torch.Tensor, deterministic: bool = False) -> torch.Tensor:
    """``gelu_tanh(gate) * up`` for ``gate_up`` ``[T, 2 * I]`` laid out ``[gate | up]`` -> ``[T, I]``
    (``transformers``' ``gelu_pytorch_tanh``): the native fused kernel on fp32 CPU rows, torch
    ops elsewhere (the deterministic mode refuses those)."""
    if deterministic:
        cpu_native.require_fused(gate_up, "GELU-tanh")
    if gate_up.dim() == 2 and cpu_native.fused_ok(gate_up):
        return cpu_ops.gelu_tanh_and_mul(gate_up)
    inter = gate_up.shape[-1] // 2
    return F.gelu(gate_up[..., :inter], approximate="tanh").mul_(gate_up[..., inter:])


class GeluMLP(SwiGLU):
    """Gemma's MLP: ``down(gelu_tanh(gate(x)) * up(x))``, ``SwiGLU``'s layers (gate and up fused
    in ``gate_up_proj``, rows ``[gate | up]``) with another activation."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gelu_tanh_and_mul(self.gate_up_proj(x), self.deterministic))


class GemmaAttention(LlamaAttention):
    """``LlamaAttention`` with Gemma's differences: scores scaled by
    ``query_pre_attn_scalar ** -0.5`` and soft-capped by ``attn_logit_softcapping`` (Gemma 2), and
    (Gemma 3) q/k head norms of Gemma's kind (``GemmaRMSNorm``: fp32 weight), which run as their
    own pass (``gemma_qk_norm_``) on every path, the fused Triton one included (its in-kernel
    norm is Llama's); the rotary embedding and the KV store then run fused where Llama's do."""

    def __init__(
        self,
        cfg: ModelConfig,
        opts: ModelOptions,
        window: int | None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(cfg, opts, device, dtype, window)
        self.scale = float(cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5
        self.softcap = cfg.attn_logit_softcapping
        if cfg.qk_norm:
            det = opts.deterministic
            self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps, det, device)
            self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps, det, device)

    def _norm_heads(self, qkv: torch.Tensor) -> None:
        if self.q_norm is not None and self.k_norm is not None:
            gemma_qk_norm_(qkv, self.q_norm, self.k_norm, self.num_heads)

    def _fused_norm(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float] | None:
        self._norm_heads(qkv)
        return None


class GemmaDecoderLayer(nn.Module):
    """Sandwich-norm attention and MLP blocks adding into the residual stream in place.

    As ``LlamaDecoderLayer``, the block's last output (here the post-feedforward norm of the MLP's
    output) is returned, not added: the next layer (or the final norm) adds it as it normalizes.
    ``local``: the layer reads the model's local rotary table (Gemma 3's sliding layers).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        opts: ModelOptions,
        window: int | None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        det = opts.deterministic
        self.local = window is not None and cfg.rope_local_theta is not None
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(hidden, eps, det, device)
        self.self_attn = GemmaAttention(cfg, opts, window, device, dtype)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps, det, device)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps, det, device)
        self.mlp = GeluMLP(hidden, cfg.intermediate_size, det, device, dtype)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps, det, device)

    def forward(
        self,
        residual: torch.Tensor,
        delta: torch.Tensor | None,
        rope: Rope,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Add ``delta`` (the previous layer's output, or None) into ``residual`` in place, run
        the layer, and return its MLP block's output (not yet added)."""
        h = self.self_attn(self.input_layernorm.add_and_norm(residual, delta), rope, kv_cache, meta)
        x = self.pre_feedforward_layernorm.add_and_norm(residual, self.post_attention_layernorm(h))
        return self.post_feedforward_layernorm(self.mlp(x))


class GemmaModel(nn.Module):
    """Scaled embedding, decoder layers and the rotary tables (``rotary``: the global one;
    ``rotary_local``: the sliding layers', or None when they share the global one); ``forward``
    returns the residual stream before the final norm and the last layer's output still to be
    added to it."""

    def __init__(
        self,
        cfg: ModelConfig,
        opts: ModelOptions,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        max_len = opts.max_model_len or cfg.max_position_embeddings
        cfg.check_context(max_len)
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, device, dtype)
        # sqrt(hidden) rounded to the model's dtype, as transformers multiplies by it.
        self.embed_scale: torch.Tensor
        self.register_buffer(
            "embed_scale",
            torch.tensor(cfg.hidden_size**0.5, device=device, dtype=dtype),
            persistent=False,
        )
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(cfg, opts, window, device, dtype) for window in cfg.layer_windows()
        )
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, opts.deterministic, device)
        self.rotary = RotaryEmbedding(
            cfg.head_dim, max_len, cfg.rope_theta, cfg.rope_scaling, device, dtype
        )
        self.rotary_local: RotaryEmbedding | None = None
        if cfg.rope_local_theta is not None:
            self.rotary_local = RotaryEmbedding(
                cfg.head_dim, max_len, cfg.rope_local_theta, None, device, dtype
            )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[KVCache],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        residual = self.embed_tokens(input_ids) * self.embed_scale
        rope = self.rotary(positions)
        local = rope if self.rotary_local is None else self.rotary_local(positions)
        delta: torch.Tensor | None = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            delta = layer(residual, delta, local if layer.local else rope, kv_cache, meta)
        return residual, delta


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma 2 / Gemma 3 (text) causal LM over one flat paged batch: ``LlamaForCausalLM`` with
    Gemma's decoder (``GemmaModel``) and, where the config has it, the final logit soft-cap.

    Parameters are allocated uninitialised (norm weights: ones, i.e. a zero offset); the loaders
    fill them. Names follow the Hugging Face layout with q/k/v fused into ``self_attn.qkv_proj``
    and gate/up into ``mlp.gate_up_proj``; norm weights hold ``1 + w`` (see the module). The head
    is tied to the embedding unless the config says otherwise.

    Raises ``ModelLoadError`` for another architecture, ``DeterministicModeUnavailable`` where
    the deterministic mode cannot run (as ``LlamaForCausalLM``; and with a final logit soft-cap).
    """

    def _check(self, device: torch.device | str | None, dtype: torch.dtype | None) -> None:
        config = self.config
        if config.architecture not in GEMMA_ARCHITECTURES:
            raise ModelLoadError(
                f"GemmaForCausalLM builds {', '.join(GEMMA_ARCHITECTURES)}, not "
                f"{config.architecture}"
            )
        if self.options.deterministic and config.final_logit_softcapping is not None:
            raise cpu_native.DeterministicModeUnavailable(
                f"the deterministic mode cannot run {config.architecture} with a final logit "
                f"soft-cap ({config.final_logit_softcapping}): it runs on torch ops, whose bits "
                "the mode does not hold to"
            )
        super()._check(device, dtype)

    def _decoder(self, device: torch.device | str | None, dtype: torch.dtype | None) -> Decoder:
        return GemmaModel(self.config, self.options, device, dtype)

    def _final(self, logits: torch.Tensor) -> torch.Tensor:
        """Soft-capped by ``final_logit_softcapping`` (Gemma 2) when the config has it."""
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap).mul_(cap)


def fold_norm_offsets(
    tensors: Iterator[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """A Hugging Face Gemma checkpoint's tensors with every norm weight ``w`` (``*norm.weight``)
    replaced by ``1.0 + w.float()``, the fp32 factor ``transformers`` multiplies by; the rest as
    they come."""
    for name, tensor in tensors:
        if name.endswith("norm.weight"):
            yield name, tensor.float() + 1.0
        else:
            yield name, tensor
