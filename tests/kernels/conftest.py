"""Kernel tests: Triton must see TRITON_INTERPRET before its kernels are decorated (at import)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    # Without a GPU the Triton kernels can only run in the interpreter; triton 3.x reads the
    # variable when ``@triton.jit`` runs, i.e. when kernels.triton_* is first imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")
