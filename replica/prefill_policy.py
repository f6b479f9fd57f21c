"""How a prompt is cut into per-step chunks: the scheduler's second seam (docs/scheduler.md §6)."""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class PrefillPolicy(Protocol):
    def chunk_len(self, remaining: int, budget: int, alone: bool) -> int:
        """Tokens to prefill this step for a request with ``remaining`` uncomputed tokens.

        ``budget`` is what is left of the step's token budget; ``alone`` is true when nothing else
        is scheduled in the step yet. 0 means "not this step".
        """
        ...


class WholePrompt:
    """The whole remainder at once: when it fits the budget, or when the step is empty."""

    def chunk_len(self, remaining: int, budget: int, alone: bool) -> int:
        return remaining if remaining <= budget or alone else 0

    def __repr__(self) -> str:
        return "WholePrompt()"


class Chunked:
    """At most ``chunk_tokens`` per request per step, from what is left of the budget."""

    __slots__ = ("chunk_tokens",)

    def __init__(self, chunk_tokens: int) -> None:
        if chunk_tokens <= 0:
            raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
        self.chunk_tokens = chunk_tokens

    def chunk_len(self, remaining: int, budget: int, alone: bool) -> int:
        return max(0, min(remaining, self.chunk_tokens, budget))

    def __repr__(self) -> str:
        return f"Chunked({self.chunk_tokens})"
