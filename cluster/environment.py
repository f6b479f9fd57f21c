"""The installed environment's check that our top-level modules are ours alone:
``python -m cluster.environment`` (``make install`` runs it; ``python -m cluster.launch`` runs the
same check before it starts anything). Exit status 1, with what to do on stderr, on a clash.

Two installed distributions with one top-level name overwrite each other's files, or shadow each
other on ``sys.path``, and the one shadowed then fails to import, far from the cause: from 5.25
on, ``transformers`` requires the PyPI package ``kernels``, named as our ``kernels/``. This module
imports nothing heavy (no Ray, no torch). Detection reads the installed metadata as
``importlib.metadata.packages_distributions`` gives it: complete on Python 3.11 and later; on
3.10 it sees only distributions that ship a ``top_level.txt`` (setuptools builds, as ``kernels``
is).
"""

from __future__ import annotations

import importlib.metadata
import sys
from collections.abc import Mapping

# The packages pyproject.toml installs ([tool.setuptools.packages.find] include; a test checks).
OUR_PACKAGES = ("cluster", "replica", "kernels", "router", "bench")
OUR_DISTRIBUTION = "tierserve"


def package_clashes(owners: Mapping[str, list[str]] | None = None) -> dict[str, list[str]]:
    """Our top-level packages that another installed distribution also ships, each with those
    distributions' names (sorted). ``owners`` defaults to
    ``importlib.metadata.packages_distributions()``."""
    found = importlib.metadata.packages_distributions() if owners is None else owners
    clashes: dict[str, list[str]] = {}
    for name in OUR_PACKAGES:
        others = sorted({d for d in found.get(name, []) if d.lower() != OUR_DISTRIBUTION})
        if others:
            clashes[name] = others
    return clashes


def clash_message(clashes: Mapping[str, list[str]]) -> str:
    """What is wrong and what to do, for ``package_clashes``'s answer."""
    lines = [
        f"tierserve: another installed package also provides the top-level module `{name}`: "
        f"{', '.join(dists)}" for name, dists in clashes.items()
    ]
    others = " ".join(sorted({d for v in clashes.values() for d in v}))
    py = sys.executable
    lines.append(
        "tierserve: such modules cannot be imported side by side. In the project's own virtual "
        "environment, start afresh: `make clean install`. Elsewhere, uninstall them "
        f"(`{py} -m pip uninstall {others}`), keep `transformers` below 5.25 if it pulled them in "
        f"(`{py} -m pip install 'transformers<5.25'`), then reinstall tierserve "
        "(an uninstall can remove files the two installs shared)."
    )
    return "\n".join(lines)


def main() -> int:
    clashes = package_clashes()
    if clashes:
        print(clash_message(clashes), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
