"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, and their mixture-of-experts kin
Mixtral, Qwen2-MoE and Qwen3-MoE) over one flat batch of paged sequences.

A step's batch is flat: ``T`` tokens from many sequences (decodes first, then prefill chunks, as
``tierserve.kernels.metadata`` lays them out). Every op except attention is row-wise; attention reads and
writes each layer's paged KV cache through ``tierserve.kernels.attention.attention``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from tierserve.kernels import cpu_native, cpu_ops
from tierserve.kernels.attention import Backend, attention
from tierserve.kernels.metadata import AttentionMetadata
from tierserve.replica.models.config import ModelConfig
from tierserve.replica.models.layers import (
    Linear,
    RMSNorm,
    RotaryEmbedding,
    SwiGLU,
    VocabEmbedding,
    apply_rotary_,
    qk_norm_,
)
from tierserve.replica.models.moe import MoEExperts, MoEMLP

KVCache = tuple[torch.Tensor, torch.Tensor]
Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin of this step's positions


@dataclass(frozen=True, slots=True)
class ModelOptions:
    """How the model runs (not what it is).

    attention_backend: attention kernels, ``"torch"`` (CPU) or ``"triton"`` (GPU).
    deterministic: a row's bits depend neither on the rest of the batch nor on how its prompt
        was cut into chunks: every layer runs on the native CPU kernels, fp32 only, and the
        model refuses to build or run where they cannot (docs/determinism.md).
    max_model_len: positions the rotary tables cover; None means the config's
        ``max_position_embeddings``.
    fused_kernels: on the triton backend, each RMSNorm with its residual add, and the rotary
        embedding with the KV store, run as one Triton kernel each (``tierserve.kernels.fused``) instead of
        several torch ops and a store launch; False keeps the unfused ops. Other backends ignore it.
    """

    attention_backend: Backend = "torch"
    deterministic: bool = False
    max_model_len: int | None = None
    fused_kernels: bool = True

    @property
    def fused(self) -> bool:
        """Whether the fused Triton kernels run (``fused_kernels`` on the triton backend)."""
        return self.fused_kernels and self.attention_backend == "triton"

    def __post_init__(self) -> None:
        if self.attention_backend not in ("torch", "triton"):
            raise ValueError(
                f"attention_backend must be 'torch' or 'triton', got {self.attention_backend!r}"
            )
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")


def check_deterministic(
    options: ModelOptions, config: ModelConfig, device: torch.device | str, dtype: torch.dtype
) -> None:
    """Raise ``DeterministicModeUnavailable`` (saying why) when ``options`` ask for the
    deterministic mode and a model of ``config`` on ``device`` in ``dtype`` cannot honour it."""
    if not options.deterministic:
        return
    reason = cpu_native.deterministic_unsupported(
        device, dtype, config.num_heads, config.num_kv_heads, config.head_dim
    )
    if reason is None and options.attention_backend != "torch":
        reason = f"it runs the torch backend's native kernels, not {options.attention_backend!r}"
    if reason is not None:
        raise cpu_native.DeterministicModeUnavailable(
            f"the deterministic mode cannot run here: {reason}"
        )


def check_step(
    layers: int,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    kv_caches: Sequence[KVCache],
    meta: AttentionMetadata,
) -> None:
    """``ValueError`` where a step's caches are not one per layer, or its ids and positions not
    the tokens ``meta`` describes."""
    if len(kv_caches) != layers:
        raise ValueError(f"got {len(kv_caches)} KV caches for a model of {layers} layers")
    if input_ids.shape[0] != meta.num_tokens or positions.shape[0] != meta.num_tokens:
        raise ValueError(
            f"batch has {input_ids.shape[0]} ids and {positions.shape[0]} positions; "
            f"metadata describes {meta.num_tokens} tokens"
        )


class LlamaAttention(nn.Module):
    """Fused qkv projection, rotary embeddings, paged GQA attention, output projection.

    With ``qk_norm`` (Qwen3) each q and k head is RMS-normalized over head_dim (``q_norm``,
    ``k_norm``) between the projection and the rotary embedding: on the native CPU path as its
    own step before the fused rotary + KV store; on the fused Triton path inside that kernel,
    before it rotates and stores; else by torch ops before ``apply_rotary_``.

    ``window``: this layer's attention window (``ModelConfig.layer_windows``), passed to every
    attention call; None for full causal attention.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        opts: ModelOptions,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        window: int | None = None,
    ) -> None:
        super().__init__()
        self.window = window
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.softcap: float | None = None  # scores soft-capped (Gemma 2's), None: not
        self.backend: Backend = opts.attention_backend
        self.deterministic = opts.deterministic
        self.fused = opts.fused
        det = opts.deterministic
        self.qkv_proj = Linear(
            cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, cfg.qkv_bias, det, device, dtype
        )
        self.o_proj = Linear(cfg.q_size, cfg.hidden_size, cfg.o_bias, det, device, dtype)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, det, device, dtype)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, det, device, dtype)

    def _norm_heads(self, qkv: torch.Tensor) -> None:
        if self.q_norm is not None and self.k_norm is not None:
            qk_norm_(
                qkv,
                self.q_norm.weight,
                self.k_norm.weight,
                self.num_heads,
                self.q_norm.eps,
                self.deterministic,
            )

    def _fused_norm(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float] | None:
        """The q/k head norm for the fused Triton rotary + store, which normalizes inside the
        kernel: its weights and eps (None: no head norm). A subclass whose norm the kernel cannot
        do runs it on ``qkv`` here and returns None."""
        if self.q_norm is not None and self.k_norm is not None:
            return (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        return None

    def forward(
        self, x: torch.Tensor, rope: Rope, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        t = x.shape[0]
        hq, hkv = self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x).view(t, hq + 2 * hkv, self.head_dim)
        stored = False
        if self.deterministic:
            cpu_native.require_fused(qkv, "rotary embedding")
        if self.backend == "torch" and cpu_native.fused_ok(qkv):
            self._norm_heads(qkv)  # its own pass: the fused rotary + store takes normed q/k
            cos, sin = rope
            cpu_ops.rope_store(qkv, cos, sin, meta.slot_mapping, kv_cache[0], kv_cache[1], hq)
            stored = True
        elif self.fused:
            from tierserve.kernels import (
                fused,  # imported late: Triton reads TRITON_INTERPRET at import
            )

            cos, sin = rope
            norm = self._fused_norm(qkv)
            fused.rope_store(
                qkv, cos, sin, meta.slot_mapping, kv_cache[0], kv_cache[1], hq, qk_norm=norm
            )
            stored = True
        else:
            self._norm_heads(qkv)
            apply_rotary_(qkv[:, : hq + hkv], *rope)
        out = attention(
            qkv[:, :hq],
            qkv[:, hq : hq + hkv],
            qkv[:, hq + hkv :],
            kv_cache[0],
            kv_cache[1],
            meta,
            self.scale,
            backend=self.backend,
            deterministic=self.deterministic,
            kv_stored=stored,
            window=self.window,
            softcap=self.softcap,
        )
        return self.o_proj(out.reshape(t, hq * self.head_dim))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks that add into the residual stream in place.

    The MLP's output is returned, not added: the next layer (or the final norm) adds it as it
    normalizes, one pass over the rows instead of two. ``window``: the layer's attention window.
    The MLP is the dense SwiGLU, or the mixture of experts (``moe.MoEMLP``) in the layers
    ``cfg.moe_layers`` names (``layer`` is this layer's index).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        opts: ModelOptions,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        window: int | None = None,
        layer: int = 0,
    ) -> None:
        super().__init__()
        det = opts.deterministic
        self.input_layernorm = RMSNorm(
            cfg.hidden_size, cfg.rms_norm_eps, det, device, dtype, fused=opts.fused
        )
        self.self_attn = LlamaAttention(cfg, opts, device, dtype, window)
        self.post_attention_layernorm = RMSNorm(
            cfg.hidden_size, cfg.rms_norm_eps, det, device, dtype, fused=opts.fused
        )
        self.mlp: SwiGLU | MoEMLP
        if cfg.is_moe_layer(layer):
            self.mlp = MoEMLP(cfg, opts.deterministic, opts.fused, device, dtype)
        else:
            self.mlp = SwiGLU(
                cfg.hidden_size, cfg.intermediate_size, opts.deterministic, device, dtype
            )

    def forward(
        self,
        residual: torch.Tensor,
        delta: torch.Tensor | None,
        rope: Rope,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Add ``delta`` (the previous layer's MLP output, or None) into ``residual`` in place,
        run the layer, and return this layer's MLP output (not yet added)."""
        h = self.self_attn(self.input_layernorm.add_and_norm(residual, delta), rope, kv_cache, meta)
        return self.mlp(self.post_attention_layernorm.add_and_norm(residual, h))


class Decoder(Protocol):
    """What a causal LM needs of its decoder (``LlamaModel``, ``gemma.GemmaModel``): the
    embedding (tied to the head where the config says), the layers, the final norm, the rotary
    table, and a forward that returns the residual stream and the last output still to add."""

    @property
    def embed_tokens(self) -> VocabEmbedding: ...
    @property
    def layers(self) -> nn.ModuleList: ...
    @property
    def norm(self) -> RMSNorm: ...
    @property
    def rotary(self) -> RotaryEmbedding: ...

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[KVCache],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor | None]: ...


class LlamaModel(nn.Module):
    """Embedding and decoder layers; ``forward`` returns the residual stream before the final
    norm, as the stream and the last layer's MLP output still to be added to it."""

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
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, opts, device, dtype, window, layer=i)
            for i, window in enumerate(cfg.layer_windows())
        )
        self.norm = RMSNorm(
            cfg.hidden_size, cfg.rms_norm_eps, opts.deterministic, device, dtype, fused=opts.fused
        )
        self.rotary = RotaryEmbedding(
            cfg.head_dim, max_len, cfg.rope_theta, cfg.rope_scaling, device, dtype,
            rotary_dim=cfg.rotary_dim,
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[KVCache],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        residual = self.embed_tokens(input_ids)
        rope = self.rotary(positions)
        delta: torch.Tensor | None = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            delta = layer(residual, delta, rope, kv_cache, meta)
        return residual, delta


class LlamaForCausalLM(nn.Module):
    """Llama/Mistral/Qwen2/Qwen3 causal LM over one flat paged batch.

    Parameters are allocated uninitialised (except norm weights); ``tierserve.replica.models.loader`` or
    ``tierserve.replica.models.embedded`` fills them. Names follow the Hugging Face layout, with q/k/v fused
    into ``self_attn.qkv_proj`` (rows ``[q | k | v]``) and gate/up into ``mlp.gate_up_proj``
    (rows ``[gate | up]``). With partial rotary (``config.rotary_dim``: Phi-3) the rows of each
    q and k head are in ``layers.rotary_permutation``'s order, not the checkpoint's: the
    loaders permute them (``loader.fill_weights``).
    """

    def __init__(
        self,
        config: ModelConfig,
        options: ModelOptions | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.options = options or ModelOptions()
        self._check(device, dtype)
        self.model: Decoder = self._decoder(device, dtype)
        self.lm_head = Linear(
            config.hidden_size, config.vocab_size, False, self.options.deterministic, device, dtype
        )
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def _check(self, device: torch.device | str | None, dtype: torch.dtype | None) -> None:
        """Raise where this model cannot be built as ``config`` and ``options`` ask (a
        subclass adds its own reasons)."""
        check_deterministic(
            self.options, self.config, device or "cpu", dtype or torch.get_default_dtype()
        )

    def _decoder(self, device: torch.device | str | None, dtype: torch.dtype | None) -> Decoder:
        """The embedding and decoder layers (a subclass builds its family's)."""
        return LlamaModel(self.config, self.options, device, dtype)

    def _final(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits as the model returns them (a subclass may cap them)."""
        return logits

    def pack_for_cpu(self) -> int:
        """Repack every linear layer for the native CPU kernel where it applies (see
        ``Linear.pack_for_cpu``; a layer's stacked experts, ``MoEExperts.pack_for_cpu``); returns
        how many were packed. Call after loading weights (the loaders do for a deterministic
        model, which needs it). With tied embeddings the LM head
        gets its own packed copy (the embedding keeps its rows): ``vocab x hidden`` floats more.
        A deterministic model that cannot run here raises ``DeterministicModeUnavailable``."""
        p = self.model.embed_tokens.weight
        check_deterministic(self.options, self.config, p.device, p.dtype)
        return sum(
            m.pack_for_cpu() for m in self.modules() if isinstance(m, (Linear, MoEExperts))
        )

    @property
    def max_model_len(self) -> int:
        return self.model.rotary.max_positions

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[KVCache],
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """Run one step: store every token's K/V, return logits ``[R, vocab]`` (model dtype) of
        the rows ``logits_indices`` ``[R]`` of the flat batch.

        ``input_ids``/``positions``: ``[T]`` int64, laid out as ``meta`` says. ``kv_caches``: one
        ``(k_cache, v_cache)`` per layer, each ``[num_blocks, block_size, kv_heads, head_dim]``.
        """
        check_step(len(self.model.layers), input_ids, positions, kv_caches, meta)
        residual, delta = self.model(input_ids, positions, kv_caches, meta)
        rows = residual.index_select(0, logits_indices)
        last = None if delta is None else delta.index_select(0, logits_indices)
        return self._final(self.lm_head(self.model.norm.add_and_norm(rows, last)))
