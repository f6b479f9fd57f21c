"""What the sampler asks of a structured output's grammar, and the step's masking with it.

``TokenConstraint`` is one sample's position in its grammar, as the sampler sees it
(``tierserve.replica.structured.Constraint`` is the one implementation, over an xgrammar
matcher); ``apply_constraints`` masks a batch's constrained rows with one bitmask. Both the
sampler and the grammar code import this module; it imports neither.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch


class TokenConstraint(Protocol):
    """One sample's grammar."""

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens the grammar allows next into ``bitmask[row]``."""
        ...

    def accept(self, token: int) -> bool:
        """Advance past ``token``; False if the grammar does not allow it (nothing changes)."""
        ...

    @property
    def terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted: the output ends here."""
        ...


def apply_constraints(logits: torch.Tensor, rows: Sequence[int],
                      constraints: Sequence[TokenConstraint]) -> None:
    """Set to -inf, in ``logits`` ``[R, V]``, every token the grammar of row ``rows[i]`` does
    not allow next. One bitmask for the step, filled row by row on the host, applied in one
    call on the logits' device (each row's mask is its own: the rows do not affect each other).
    xgrammar is imported here, on the first constrained step."""
    import xgrammar as xgr

    vocab = logits.shape[1]
    bitmask = xgr.allocate_token_bitmask(logits.shape[0], vocab)
    for r, c in zip(rows, constraints, strict=True):
        c.fill(bitmask, r)
    if logits.device.type != "cpu":
        bitmask = bitmask.to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab, indices=list(rows))
