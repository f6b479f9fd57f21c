"""tierserve installs one name, ``tierserve``, and lives beside the packages that own the generic
ones: Hugging Face's ``kernels`` (which ``transformers`` requires from 5.25 on) and the newest
``transformers``.

- the wheel holds ``tierserve/`` alone (every module of the repository's part folders under it,
  the C++ sources too), and the console scripts point into it;
- the part folders have no ``__init__.py``: with the repository on ``sys.path`` (pytest, or
  ``python -m`` from a checkout) ``import kernels`` still finds Hugging Face's package, and ours
  is only ever ``tierserve.kernels``;
- in that environment the engine runs the default model, with ``kernels`` imported beside it.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("cluster", "replica", "kernels", "router")


def test_the_parts_are_folders_linked_into_the_namespace() -> None:
    for part in PARTS:
        link = ROOT / "tierserve" / part
        assert link.is_symlink() and link.resolve() == (ROOT / part).resolve(), part
        assert not (ROOT / part / "__init__.py").exists(), (
            f"{part}/__init__.py would make `{part}` a top-level package of its own")


@pytest.mark.slow
def test_the_wheel_installs_one_name(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(tmp_path), str(ROOT)],
                   check=True, capture_output=True, text=True, timeout=600)
    (wheel,) = tmp_path.glob("tierserve-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"tierserve"}, sorted(tops)
    ours = {f"tierserve/{p.relative_to(ROOT).as_posix()}" for part in PARTS
            for p in (ROOT / part).rglob("*.py") if "__pycache__" not in p.parts}
    assert ours <= set(names), sorted(ours - set(names))[:5]
    assert "tierserve/__init__.py" in names
    assert "tierserve/kernels/csrc/cpu_kernels.cpp" in names
    (entry,) = [n for n in names if n.endswith("entry_points.txt")]
    scripts = zipfile.ZipFile(wheel).read(entry).decode()
    assert "tierserve = tierserve.cluster.launch:cli" in scripts
    assert "tierserve-load = tierserve.cluster.load:main" in scripts


@pytest.mark.model
@pytest.mark.slow
def test_the_engine_runs_beside_huggingface_kernels_and_transformers() -> None:
    """From the repository's root, as pytest and ``python -m`` run: ``kernels`` is Hugging
    Face's, transformers imports, and the engine answers with the default model."""
    code = (
        "import importlib.metadata as md, kernels, transformers\n"
        "from tierserve.replica.llm import LLM\n"
        "from tierserve.records import SamplingParams\n"
        "import tierserve.kernels.attention as ours\n"
        "llm = LLM('smollm2-135m-instruct', max_num_seqs=2)\n"
        "(out,) = llm.generate(['The capital of France is'],\n"
        "                      SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)\n"
        "print(kernels.__file__)\n"
        "print(ours.__name__, ours.__file__)\n"
        "print(md.version('kernels'), transformers.__version__)\n"
        "print(len(out.token_ids))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    hf_kernels, ours, versions, tokens = proc.stdout.strip().splitlines()[-4:]
    assert "site-packages" in hf_kernels and not hf_kernels.startswith(str(ROOT / "kernels"))
    assert ours.startswith("tierserve.kernels.attention ")
    assert tokens == "4"
    kernels_version, transformers_version = versions.split()
    assert kernels_version and transformers_version


def test_the_offline_names_are_at_the_top_and_load_on_first_use() -> None:
    """``from tierserve import LLM, SamplingParams, EngineConfig`` as vLLM users write it; a
    bare ``import tierserve`` (the ingress, the router) still loads no torch."""
    code = (
        "import sys, tierserve\n"
        "print('torch' in sys.modules)\n"
        "from tierserve import LLM, SamplingParams, EngineConfig, RequestOutput\n"
        "from tierserve.replica.llm import LLM as L\n"
        "print(LLM is L, SamplingParams(max_tokens=3).max_tokens, 'max_num_seqs' in EngineConfig.model_fields)\n"
        "print(all(getattr(tierserve, n) is not None and n in dir(tierserve)\n"
        "          for n in tierserve.__all__))\n"
        "try:\n"
        "    tierserve.Engine\n"
        "except AttributeError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, check=True)
    assert out.stdout.splitlines() == [
        "False", "True 3 True", "True", "module 'tierserve' has no attribute 'Engine'"]
