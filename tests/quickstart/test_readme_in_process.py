"""The README's in-process example ("Python, in-process"), extracted from README.md and run
verbatim in a fresh interpreter: the default model answers greedily, the request finishes by
its length, and the engine's stats show every KV block back in the pool."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.model

ROOT = Path(__file__).resolve().parents[2]


def test_the_readmes_in_process_example_runs_verbatim() -> None:
    text = (ROOT / "README.md").read_text()
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", text, re.S)
                if "from tierserve import LLM" in b]
    out = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True,
                         timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    # "The capital of France is" -> " Paris." greedily, then more text up to 16 tokens.
    assert out.stdout.startswith(" Paris."), out.stdout
    stats = out.stdout[out.stdout.index(" length EngineStats("):]
    assert "running=0, waiting=0, free_blocks=512, total_blocks=512" in stats, stats
