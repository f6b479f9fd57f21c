"""Paged-attention kernels: the runner calls ``kernels.attention.attention`` once per layer.

- ``metadata``: the flat-batch seam (``AttentionMetadata``, ``build_metadata``).
- ``attention``: the dispatch (backend ``torch``/``triton`` x ``deterministic``) and input checks.
- ``reference``: the obviously-correct per-sequence torch reference every path is tested against.
- ``cpu_native``: the CPU fast path, a C++ library (``csrc/``) built at first use: attention
  reading the paged cache in place, the linear layers and the row-wise ops; row independent by
  construction, so the deterministic mode runs on it alone.
- ``torch_attention``: the plain-torch CPU fallback (SDPA; when the native kernel cannot be
  built or the dtype is not fp32); never in the deterministic mode.
- ``triton_kv`` / ``triton_attention``: the GPU kernels (CPU under ``TRITON_INTERPRET=1``).
"""
