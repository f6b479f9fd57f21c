"""Test helpers for ``tierserve.replica.models``: drive a model over paged KV caches, and build tiny random
Hugging Face checkpoints (``save_pretrained`` into a directory, with the embedded tokenizer)."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tierserve.kernels.metadata import SeqSpec, build_metadata
from tierserve.kernels.reference import gather_seq
from tierserve.replica.models.embedded import build_tokenizer
from tierserve.replica.models.llama import LlamaForCausalLM
from tierserve.replica.models.loader import CausalLM


@dataclass(frozen=True)
class Work:
    """``tokens`` of sequence ``seq`` starting at position ``start``, in one step."""

    seq: int
    start: int
    tokens: Sequence[int]


@dataclass
class PagedHarness:
    """Per-layer KV caches and contiguous block tables: sequence ``i`` owns blocks
    ``1 + i * per_seq .. 1 + (i + 1) * per_seq - 1`` (block 0 stays unused)."""

    model: CausalLM
    max_seqs: int
    max_len: int
    block_size: int = 16
    caches: list[tuple[torch.Tensor, torch.Tensor]] = field(init=False)

    def __post_init__(self) -> None:
        cfg = self.model.config
        self.per_seq = -(-self.max_len // self.block_size)
        blocks = 1 + self.max_seqs * self.per_seq
        dtype = self.model.model.embed_tokens.weight.dtype
        shape = (blocks, self.block_size, cfg.num_kv_heads, cfg.head_dim)
        self.caches = [
            (torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
            for _ in range(cfg.num_layers)
        ]

    def table(self, seq: int) -> list[int]:
        first = 1 + seq * self.per_seq
        return list(range(first, first + self.per_seq))

    def step(self, work: Sequence[Work], all_rows: bool = False) -> list[torch.Tensor]:
        """One flat batch (decodes are moved first); per item, the logits of its last token
        ``[vocab]``, or of all its tokens ``[len, vocab]`` with ``all_rows``, in ``work``'s order."""
        order = sorted(range(len(work)), key=lambda i: len(work[i].tokens) != 1)
        specs: list[SeqSpec] = []
        ids: list[int] = []
        spans: dict[int, tuple[int, int]] = {}
        for i in order:
            w = work[i]
            specs.append(SeqSpec(w.start, len(w.tokens), self.table(w.seq)))
            spans[i] = (len(ids), len(ids) + len(w.tokens))
            ids.extend(w.tokens)
        meta = build_metadata(specs, self.block_size)
        if all_rows:
            rows = torch.arange(len(ids))
        else:
            rows = torch.tensor([spans[i][1] - 1 for i in range(len(work))])
        logits = self.model(torch.tensor(ids), meta.positions, self.caches, meta, rows)
        if not all_rows:
            return list(logits)
        return [logits[spans[i][0] : spans[i][1]] for i in range(len(work))]

    def kv(self, seq: int, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Cached K and V ``[length, kv_heads, head_dim]`` of every layer for ``seq``."""
        table = torch.tensor(self.table(seq), dtype=torch.int32)
        return [
            (gather_seq(k, table, length), gather_seq(v, table, length)) for k, v in self.caches
        ]

    def greedy(self, prompts: Sequence[Sequence[int]], new_tokens: int) -> list[list[int]]:
        """Prefill every prompt in one step, then decode all together; greedy tokens per prompt."""
        logits = self.step([Work(i, 0, p) for i, p in enumerate(prompts)])
        out = [[int(lg.argmax())] for lg in logits]
        for _ in range(new_tokens - 1):
            work = [Work(i, len(p) + len(out[i]) - 1, [out[i][-1]]) for i, p in enumerate(prompts)]
            for i, lg in enumerate(self.step(work)):
                out[i].append(int(lg.argmax()))
        return out


def randomize_(model: torch.nn.Module, seed: int, std: float = 0.2) -> None:
    """Give every weight a visible value: matrices N(0, std), norm weights 1 + N(0, 0.1), biases
    N(0, 0.1) (HF initialises norms to one and biases to zero, which would hide loading bugs)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if p.dim() >= 2:
                p.copy_(noise * std)
            elif "norm" in name:
                p.copy_(1 + 0.1 * noise)
            else:
                p.copy_(0.1 * noise)


def tiny_hf_model(kind: str, seed: int = 0, **overrides: Any) -> Any:
    """A tiny random ``transformers`` causal LM (fp32, eval mode) of one of ``TINY_KINDS``."""
    import transformers

    base: dict[str, Any] = dict(
        vocab_size=300,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=136,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    cls: Any = transformers.LlamaConfig
    if kind == "llama-gqa":
        base["num_key_value_heads"] = 2
    elif kind == "llama3-rope":
        base.update(
            num_key_value_heads=2,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=256,
            ),
        )
    elif kind == "llama-tied":
        base["tie_word_embeddings"] = True
    elif kind == "llama-bias":
        base["attention_bias"] = True
    elif kind == "qwen2":
        cls = transformers.Qwen2Config
        base["num_key_value_heads"] = 2
    elif kind == "qwen2-yarn":  # the tests' prompts and decodes run past 32 positions
        cls = transformers.Qwen2Config
        base.update(
            num_key_value_heads=2,
            max_position_embeddings=128,  # factor * original: transformers warns otherwise
            rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32),
        )
    elif kind == "mistral":
        cls = transformers.MistralConfig
        base.update(num_key_value_heads=2, head_dim=24, sliding_window=None)
    elif kind == "qwen3":  # per-head q/k norms; head_dim 32, not hidden / heads (16)
        cls = transformers.Qwen3Config
        base.update(num_key_value_heads=2, head_dim=32)
    elif kind.startswith("phi3"):  # fused qkv_proj and gate_up_proj in the checkpoint
        cls = transformers.Phi3Config
        base.update(num_key_value_heads=2, sliding_window=None)
        if kind in ("phi3-partial", "phi3-longrope"):  # as Phi-4-mini: 12 of 16 dims rotate
            base.update(tie_word_embeddings=True)
            base["rope_parameters"] = dict(
                rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.75
            )
        if kind == "phi3-longrope":  # served within 128 positions: the short factors
            base.update(original_max_position_embeddings=PHI3_LONGROPE_ORIGINAL)
            base["rope_parameters"] = dict(
                rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=0.75,
                short_factor=list(PHI3_SHORT_FACTOR), long_factor=list(PHI3_LONG_FACTOR),
            )
        elif kind not in ("phi3", "phi3-partial"):
            raise ValueError(kind)
    elif kind in GEMMA_KINDS:
        cls = _gemma_config(kind, base)
    elif kind == "mixtral":  # 4 experts, 2 per token; the experts' size is intermediate_size
        cls = transformers.MixtralConfig
        base.update(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                    intermediate_size=48, sliding_window=None)
    elif kind == "qwen3-moe":  # q/k norms, head_dim 32; layer 1 dense (mlp_only_layers)
        cls = transformers.Qwen3MoeConfig
        base.update(num_key_value_heads=2, head_dim=32, num_experts=4, num_experts_per_tok=2,
                    moe_intermediate_size=40, norm_topk_prob=True, mlp_only_layers=[1])
    elif kind == "qwen2-moe":  # q/k/v biases, a shared expert with its sigmoid gate
        cls = transformers.Qwen2MoeConfig
        base.update(num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                    moe_intermediate_size=40, shared_expert_intermediate_size=56,
                    norm_topk_prob=False)
    elif kind != "llama":
        raise ValueError(kind)
    base.update(overrides)
    config = cls(**base)
    model_cls = {
        "Gemma2Config": transformers.Gemma2ForCausalLM,
        "Gemma3TextConfig": transformers.Gemma3ForCausalLM,
        "LlamaConfig": transformers.LlamaForCausalLM,
        "Qwen2Config": transformers.Qwen2ForCausalLM,
        "MistralConfig": transformers.MistralForCausalLM,
        "Qwen3Config": transformers.Qwen3ForCausalLM,
        "Phi3Config": transformers.Phi3ForCausalLM,
        "MixtralConfig": transformers.MixtralForCausalLM,
        "Qwen3MoeConfig": transformers.Qwen3MoeForCausalLM,
        "Qwen2MoeConfig": transformers.Qwen2MoeForCausalLM,
    }[cls.__name__]
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    randomize_(model, seed)
    if config.tie_word_embeddings:
        model.tie_weights()
    return model


# Tiny Gemma models: GQA, head_dim 32 (not hidden / heads), query_pre_attn_scalar 24 (not
# head_dim), three layers mixing sliding (window 32: longer than the tests' default positions,
# see gemma_window) and full attention. gemma3: per-head q/k norms, sliding layers on rotary base
# 10000 and global ones on 1e6 with linear scaling (factor 8, as Gemma 3 4B+); gemma2: final logit
# soft-capping 30 and attention soft-capping 50; gemma2-nocap: without the latter.
GEMMA_KINDS = ("gemma3", "gemma2", "gemma2-nocap")


def _gemma_config(kind: str, base: dict[str, Any]) -> Any:
    import transformers

    base.update(
        num_hidden_layers=3,
        num_key_value_heads=2,
        head_dim=32,
        query_pre_attn_scalar=24,
        sliding_window=32,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    )
    if kind == "gemma3":
        base["rope_parameters"] = {
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        }
        return transformers.Gemma3TextConfig
    base.update(final_logit_softcapping=30.0, attn_logit_softcapping=50.0)
    if kind == "gemma2-nocap":
        base["attn_logit_softcapping"] = None
    return transformers.Gemma2Config


TINY_KINDS = (
    "llama", "llama-gqa", "llama3-rope", "llama-tied", "llama-bias", "qwen2", "qwen2-yarn",
    "mistral", "qwen3", "phi3", "phi3-partial", "phi3-longrope",
)
# The tiny LongRoPE Phi-3 ("phi3-longrope"): trained for 128 positions of its 512 (attention
# factor sqrt(1 + ln 4 / ln 128)), one factor per frequency of its 12 rotary dims.
PHI3_LONGROPE_ORIGINAL = 128
PHI3_SHORT_FACTOR = (1.0, 1.1, 1.3, 1.6, 2.0, 2.5)
PHI3_LONG_FACTOR = (1.2, 2.0, 4.0, 8.0, 16.0, 24.0)
# The engine length each kind is served at where it matters (LongRoPE: within the original
# context, so that the short factors, and transformers' tokens, apply).
TINY_MAX_MODEL_LEN = {"phi3-longrope": PHI3_LONGROPE_ORIGINAL}
MOE_KINDS = ("mixtral", "qwen3-moe", "qwen2-moe")


def save_checkpoint(model: Any, path: Path, **save_kwargs: Any) -> Path:
    """``save_pretrained`` plus the embedded byte tokenizer (its 263 ids fit every tiny vocab)."""
    model.save_pretrained(str(path), **save_kwargs)
    build_tokenizer().save_pretrained(str(path))
    return path


def hf_state_dict(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """Our weights under Hugging Face names (q/k/v and gate/up split again)."""
    cfg = model.config
    q, kv, inter = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        if ".qkv_proj." in name:
            kind = name.rsplit(".", 1)[1]
            stem = name.split(".qkv_proj.")[0]
            out[f"{stem}.q_proj.{kind}"] = t[:q]
            out[f"{stem}.k_proj.{kind}"] = t[q : q + kv]
            out[f"{stem}.v_proj.{kind}"] = t[q + kv :]
        elif ".gate_up_proj." in name:
            stem = name.split(".gate_up_proj.")[0]
            out[f"{stem}.gate_proj.weight"] = t[:inter]
            out[f"{stem}.up_proj.weight"] = t[inter:]
        else:
            out[name] = t
    return out


def row_mismatches(
    fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, sizes: tuple[int, ...]
) -> list[tuple[int, int]]:
    """Cases (size, offset) where ``fn`` of a slice of ``x`` differs from the same rows of ``fn(x)``.

    Each slice is copied into a fresh tensor too, so that a row's memory alignment differs."""
    rng = random.Random(0)
    full = fn(x)
    bad = []
    for m in sizes:
        for off in {0, x.shape[0] - m, rng.randrange(x.shape[0] - m + 1)}:
            rows = x[off : off + m]
            shifted = torch.empty(m * x.shape[1] + 1)[1:].view(m, x.shape[1]).copy_(rows)
            for t in (rows, shifted):
                if not torch.equal(fn(t), full[off : off + m]):
                    bad.append((m, off))
                    break
    return bad
