"""tierserve installs one name, ``tierserve``, and lives beside the packages that own the generic
ones: Hugging Face's ``kernels`` (which ``transformers`` requires from 5.25 on) and the newest
``transformers``.

- the wheel holds ``tierserve/`` alone (every module of the repository's part folders under it,
  the C++ sources too, no benchmark), and the console scripts point into it; the sdist holds the
  same package and no ``benchmarks/``; either, installed into a fresh virtualenv, imports from
  there, finds no ``benchmarks`` and runs ``tierserve-load``;
- the part folders have no ``__init__.py``: with the repository on ``sys.path`` (pytest, or
  ``python -m`` from a checkout) ``import kernels`` still finds Hugging Face's package, and ours
  is only ever ``tierserve.kernels``;
- in that environment the engine runs the default model, with ``kernels`` imported beside it.
"""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import tarfile
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


def test_the_benchmarks_are_a_plain_package_outside_the_namespace() -> None:
    """``benchmarks/`` runs from the repository's root (``python -m benchmarks.NAME``): a package
    of its own, not linked into ``tierserve/`` (nor is the old ``bench``)."""
    assert (ROOT / "benchmarks" / "__init__.py").is_file()
    assert not (ROOT / "tierserve" / "benchmarks").exists()
    assert not (ROOT / "tierserve" / "bench").exists() and not (ROOT / "bench").exists()


def _our_modules() -> set[str]:
    """Every module of the part folders, by its path under ``tierserve/``."""
    return {f"tierserve/{p.relative_to(ROOT).as_posix()}" for part in PARTS
            for p in (ROOT / part).rglob("*.py") if "__pycache__" not in p.parts}


def _installs_and_imports(artifact: Path, tmp_path: Path) -> None:
    """``artifact`` (a wheel or an sdist) installed into a fresh virtualenv with ``--no-deps
    --no-build-isolation --ignore-installed`` (by this interpreter's pip, as ``--python``; the
    dependencies, and setuptools to build an sdist, are this interpreter's: its site-packages
    comes after the virtualenv's own on the new one's path); then, away from the repository:
    ``tierserve`` and the load generator import from the virtualenv, ``benchmarks`` is nowhere,
    and the ``tierserve-load`` script runs."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   capture_output=True, text=True, timeout=120)
    python = venv / "bin" / "python"
    where = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    purelib = subprocess.run([str(python), "-c", where], check=True, capture_output=True,
                             text=True, timeout=60).stdout.strip()
    Path(purelib, "_tierserve_test_deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
         "--no-build-isolation", "--ignore-installed", str(artifact)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stderr[-3000:]
    code = (
        "import importlib.util, sys, tierserve, tierserve.cluster.load as load\n"
        "print(tierserve.__file__)\n"
        "print(load.__file__)\n"
        "print(importlib.util.find_spec('benchmarks'))\n"
    )
    out = subprocess.run([str(python), "-c", code], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    package, load, benchmarks = out.stdout.strip().splitlines()[-3:]
    assert package.startswith(purelib) and package.endswith("tierserve/__init__.py"), package
    assert load.startswith(purelib), load
    assert benchmarks == "None"
    script = subprocess.run([str(venv / "bin" / "tierserve-load"), "--help"], cwd=tmp_path,
                            env=env, capture_output=True, text=True, timeout=300)
    assert script.returncode == 0 and "usage: tierserve-load" in script.stdout, script.stderr[-3000:]


def _tracked_copy(dest: Path) -> Path:
    """The repository's tracked files (links kept as links) under ``dest``: what a clean clone
    builds from, without a checkout's leftovers (a stale ``build/`` would go into the wheel)."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, check=True, capture_output=True,
                            text=True).stdout.split("\0")
    for name in filter(None, listed):
        src, dst = ROOT / name, dest / name
        if not src.is_symlink() and not src.exists():
            continue  # deleted in the work tree, not yet in the index
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst, follow_symlinks=False)
    return dest


@pytest.mark.slow
def test_the_wheel_installs_one_name(tmp_path: Path) -> None:
    source = _tracked_copy(tmp_path / "src")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(tmp_path), str(source)],
                   check=True, capture_output=True, text=True, timeout=600)
    (wheel,) = tmp_path.glob("tierserve-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"tierserve"}, sorted(tops)
    ours = _our_modules()
    assert ours <= set(names), sorted(ours - set(names))[:5]
    assert "tierserve/__init__.py" in names
    assert "tierserve/kernels/csrc/cpu_kernels.cpp" in names
    assert "tierserve/cluster/load.py" in names and "tierserve/cluster/measure.py" in names
    assert not [n for n in names if "bench" in n], [n for n in names if "bench" in n][:5]
    (entry,) = [n for n in names if n.endswith("entry_points.txt")]
    scripts = zipfile.ZipFile(wheel).read(entry).decode()
    assert "tierserve = tierserve.cluster.launch:cli" in scripts
    assert "tierserve-load = tierserve.cluster.load:main" in scripts
    _installs_and_imports(wheel, tmp_path)


@pytest.mark.slow
def test_the_sdist_holds_the_package_without_the_benchmarks_and_installs(tmp_path: Path) -> None:
    """What ``python -m build --sdist --no-isolation`` makes (setuptools' own build hook, called
    here: ``build`` is not a dependency): the package's sources (the part folders' modules under
    ``tierserve/``, the C++ sources) and the project's files, no ``benchmarks/``; it installs and
    imports as the wheel does."""
    dist = tmp_path / "dist"
    code = "import sys; from setuptools import build_meta; build_meta.build_sdist(sys.argv[1])"
    built = subprocess.run([sys.executable, "-c", code, str(dist)], cwd=ROOT, capture_output=True,
                           text=True, timeout=600)
    assert built.returncode == 0, built.stderr[-3000:]
    (sdist,) = dist.glob("tierserve-*.tar.gz")
    top = sdist.name.removesuffix(".tar.gz")
    with tarfile.open(sdist) as tar:
        names = {n.removeprefix(top + "/") for n in tar.getnames()}
    assert {"pyproject.toml", "README.md", "tierserve/__init__.py",
            "tierserve/kernels/csrc/cpu_kernels.cpp"} <= names
    ours = _our_modules()
    assert ours <= names, sorted(ours - names)[:5]
    assert not [n for n in names if n.split("/")[0] in ("benchmarks", "bench")
                or n.startswith(("tierserve/bench", "tierserve/benchmarks"))]
    _installs_and_imports(sdist, tmp_path)


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
        "print(len(out.outputs[0].token_ids))\n"
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
    bare ``import tierserve`` (the ingress, the router) still loads no torch. ``LLM`` is the
    replica's with ``chat``; ``RequestOutput`` and ``CompletionOutput`` are the offline
    answer's records, not the engine's deltas (``tierserve.records.RequestOutput``)."""
    code = (
        "import sys, tierserve\n"
        "print('torch' in sys.modules)\n"
        "from tierserve import LLM, SamplingParams, EngineConfig, RequestOutput, CompletionOutput\n"
        "from tierserve.replica import llm\n"
        "from tierserve import records\n"
        "print(issubclass(LLM, llm.LLM) and hasattr(LLM, 'chat'), SamplingParams(max_tokens=3).max_tokens, 'max_num_seqs' in EngineConfig.model_fields)\n"
        "print(RequestOutput is llm.RequestOutput is not records.RequestOutput, CompletionOutput is llm.CompletionOutput)\n"
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
        "False", "True 3 True", "True True", "True", "module 'tierserve' has no attribute 'Engine'"]
