"""Sampling: greedy, temperature, top-k, top-p, and a random generator owned by each request.

Every random draw comes from the request's own ``torch.Generator`` and consumes the same amount of
randomness per token whatever else is in the batch, so a seeded request samples the same tokens
alone, in any batch, and across a preemption (the generator stays with the request). Every
operation is per row, so a row's result does not depend on the other rows.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

GREEDY_BELOW = 1e-5


@dataclass(slots=True)
class SamplingParams:
    """How to pick each next token and when to stop (close to vLLM's ``SamplingParams``).

    temperature 0 is greedy. top_k 0 (or -1) and top_p 1.0 disable those filters. ``stop`` strings
    are matched on the detokenized text and not returned; ``stop_token_ids`` end the request like
    EOS; ``ignore_eos`` keeps generating past EOS.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first field out of range."""
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise ValueError(f"max_tokens must be an integer, got {self.max_tokens!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not isinstance(self.temperature, (int, float)) or not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer >= 0 (0 or -1: off), got {self.top_k!r}")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int)
        ):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if self.stop is not None:
            if isinstance(self.stop, str):
                self.stop = [self.stop]
            if any(not isinstance(s, str) or not s for s in self.stop):
                raise ValueError("stop must be a list of non-empty strings")
        if self.stop_token_ids is not None and any(
            isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.stop_token_ids
        ):
            raise ValueError("stop_token_ids must be a list of non-negative integers")

    @property
    def greedy(self) -> bool:
        """Temperatures below ``GREEDY_BELOW`` are greedy (dividing by them would overflow)."""
        return self.temperature < GREEDY_BELOW


@dataclass(slots=True)
class SamplerState:
    """A request's sampling parameters and its own generator (kept across preemption)."""

    params: SamplingParams
    generator: torch.Generator = field(init=False)

    def __post_init__(self) -> None:
        self.generator = torch.Generator(device="cpu")
        seed = self.params.seed if self.params.seed is not None else random.getrandbits(63)
        self.generator.manual_seed(seed)


def sample(logits: torch.Tensor, states: Sequence[SamplerState]) -> list[int]:
    """One token per row of ``logits`` ``[R, V]`` (fp32, on any device)."""
    if logits.shape[0] != len(states):
        raise ValueError(f"{logits.shape[0]} rows of logits but {len(states)} sampler states")
    if not states:
        return []
    logits = logits.float()
    greedy = [s.params.greedy for s in states]
    if all(greedy):
        return logits.argmax(dim=-1).tolist()
    out = logits.argmax(dim=-1).tolist() if any(greedy) else [0] * len(states)
    rows = [i for i, g in enumerate(greedy) if not g]
    x = logits[rows] if len(rows) < len(states) else logits
    temps = torch.tensor([states[i].params.temperature for i in rows], dtype=torch.float32)
    x = x / temps.to(x.device).unsqueeze(1)
    x = _filter_top_k_top_p(x, [states[i].params for i in rows])
    probs = x.softmax(dim=-1)
    # Exponential race (Gumbel-max in another form): argmax(p / E) with E ~ Exp(1) draws from p.
    # Each request draws V variates from its own generator, so its stream is batch-independent.
    vocab = probs.shape[1]
    noise = torch.empty((len(rows), vocab), dtype=torch.float32)
    for j, i in enumerate(rows):
        noise[j].exponential_(generator=states[i].generator)
    picked = (probs / noise.to(probs.device)).argmax(dim=-1).tolist()
    for j, i in enumerate(rows):
        out[i] = picked[j]
    return out


def _filter_top_k_top_p(x: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Mask logits outside each row's top-k and top-p sets to -inf."""
    ks = [p.top_k if p.top_k > 0 else 0 for p in params]
    ps = [p.top_p for p in params]
    if not any(ks) and all(p >= 1.0 for p in ps):
        return x
    vocab = x.shape[1]
    sorted_x, order = x.sort(dim=-1, descending=True)
    keep = torch.ones_like(sorted_x, dtype=torch.bool)
    if any(ks):
        k = torch.tensor([min(k, vocab) if k else vocab for k in ks], device=x.device)
        ranks = torch.arange(vocab, device=x.device).unsqueeze(0)
        keep &= ranks < k.unsqueeze(1)
    if any(p < 1.0 for p in ps):
        masked = sorted_x.masked_fill(~keep, float("-inf"))
        probs = masked.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass strictly above each token
        top_p = torch.tensor(ps, dtype=probs.dtype, device=x.device).unsqueeze(1)
        keep &= before < top_p  # the first token is always kept
    filtered = sorted_x.masked_fill(~keep, float("-inf"))
    return torch.empty_like(x).scatter_(1, order, filtered)
