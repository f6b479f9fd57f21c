"""Where tierserve keeps what it builds once per machine: ``$TIERSERVE_CACHE_DIR``, else
``~/.cache/tierserve`` (GGUF tokenizers and prepared weights, assembled packaged models; the
native kernels build under the same root). Standard library only: the catalogue imports it
without the model code."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """tierserve's cache: ``$TIERSERVE_CACHE_DIR``, else ``~/.cache/tierserve``."""
    env = os.environ.get("TIERSERVE_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "tierserve"
