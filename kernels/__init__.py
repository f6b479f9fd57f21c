"""Paged-attention kernels: the runner calls ``kernels.attention.attention`` once per layer.

- ``metadata``: the flat-batch seam (``AttentionMetadata``, ``build_metadata``).
- ``attention``: the dispatch (backend ``torch``/``triton`` x ``deterministic``) and input checks.
- ``reference``: the obviously-correct per-sequence torch reference every path is tested against.
- ``torch_attention``: CPU serving paths, fast (SDPA) and deterministic (batch/chunk invariant).
- ``triton_kv`` / ``triton_attention``: the GPU kernels (CPU under ``TRITON_INTERPRET=1``).
"""
