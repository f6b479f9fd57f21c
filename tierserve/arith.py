"""Integer arithmetic every layer uses, in one place (below every layer; imports nothing)."""

from __future__ import annotations


def ceil_div(a: int, b: int) -> int:
    """``a / b`` rounded up, for ``b > 0`` (blocks for ``a`` positions of ``b`` each)."""
    return -(-a // b)


def round_up(a: int, b: int) -> int:
    """``a`` rounded up to a multiple of ``b > 0``."""
    return -(-a // b) * b
