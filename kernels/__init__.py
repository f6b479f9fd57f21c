"""Paged-attention kernels: the runner calls ``kernels.attention.attention`` once per layer.

- ``metadata``: the flat-batch seam (``AttentionMetadata``, ``build_metadata``).
- ``attention``: the dispatch (backend ``torch``/``triton`` x ``deterministic``) and input checks.
- ``reference``: the obviously-correct per-sequence torch reference every path is tested against.
- ``cpu_native``: the CPU fast path, a C++ kernel (``csrc/``) built at first use, reading the
  paged cache in place.
- ``torch_attention``: plain-torch CPU paths, fast (SDPA; when the native kernel cannot be built
  or the dtype is not fp32) and deterministic (batch/chunk invariant).
- ``triton_kv`` / ``triton_attention``: the GPU kernels (CPU under ``TRITON_INTERPRET=1``).
"""
