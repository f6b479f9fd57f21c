"""The ecosystem's load tools in virtualenvs of their own (their dependencies conflict with
ours): ``guidellm``, ``aiperf`` and ``langchain-openai`` (LangChain's OpenAI chat model, which
the quick-start tests drive from a script), installed from the package registry on first use under
``.venv-tools/`` (git ignores it; a stamp names what was installed), with the CPU build of torch
that ``make install`` pinned where a tool pulls torch in (guidellm does). The benchmarks and the
tests that run these tools as users do share them."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ROOT / ".venv-tools"
GUIDELLM = "guidellm==0.8.1"
AIPERF = "aiperf==0.13.0"
LANGCHAIN = "langchain-openai==1.8.1"


def tool_venv(name: str, requirement: str) -> Path:
    """The ``bin`` folder of a virtualenv holding ``requirement`` (created on first use)."""
    venv = TOOLS / name
    stamp = venv / ".installed"
    if stamp.is_file() and stamp.read_text().strip() == requirement:
        return venv / "bin"
    if venv.exists():
        shutil.rmtree(venv)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    # make install leaves the CPU torch pin here on a machine without a GPU: a tool that pulls
    # torch in then takes that build, not a multi-GB CUDA one.
    constraint = ROOT / ".venv" / "torch-constraint.txt"
    if constraint.is_file():
        pip += ["-c", str(constraint)]
    proc = subprocess.run([*pip, requirement], capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0:
        raise RuntimeError(f"installing {requirement} failed:\n{proc.stderr[-3000:]}")
    stamp.write_text(requirement)
    return venv / "bin"
