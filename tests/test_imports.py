"""Dependencies point one way, checked by walking the imports of the source (no module is run):

- ``replica/`` and ``kernels/`` never import ``cluster/`` (the replica's metrics, API records
  and config live with the replica), ``kernels/`` nothing of ``replica/`` either, and
  ``router/`` never imports ``cluster/``;
- the scheduler, the router's ranking policy and its stats records stay free of Ray and torch
  (all they import, transitively);
- the ingress gets its config and tokenizer without the torch model code: what importing
  ``cluster.ingress`` loads holds no ``torch``, no ``kernels``, no model, engine or sampler
  module (and a fresh interpreter that imports it has no torch module loaded);
- building the Serve app (importing ``cluster.app``) loads neither torch nor transformers.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("cluster", "replica", "kernels", "router")


def _module_file(name: str) -> Path | None:
    base = ROOT.joinpath(*name.split("."))
    for cand in (base.with_suffix(".py"), base / "__init__.py"):
        if cand.is_file():
            return cand
    return None


def _is_type_checking(node: ast.If) -> bool:
    return isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def imports(name: str, top_level_only: bool = False) -> set[str]:
    """The modules ``name`` imports (absolute names; submodules of ``from pkg import mod``
    resolved), skipping ``if TYPE_CHECKING:`` blocks; with ``top_level_only``, only what runs
    at import time (not imports inside functions)."""
    path = _module_file(name)
    assert path is not None, name
    tree = ast.parse(path.read_text(), str(path))
    found: set[str] = set()

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                continue
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.Import) and not (top_level_only and in_function):
                found.update(a.name for a in child.names)
            elif (isinstance(child, ast.ImportFrom) and not (top_level_only and in_function)
                  and child.level == 0 and child.module):
                found.add(child.module)
                for a in child.names:
                    if _module_file(f"{child.module}.{a.name}") is not None:
                        found.add(f"{child.module}.{a.name}")
            visit(child, nested)

    visit(tree, False)
    return found


def first_party(name: str) -> bool:
    return name.split(".")[0] in PACKAGES and _module_file(name) is not None


def closure(name: str, top_level_only: bool = False) -> set[str]:
    """Every module reachable from ``name`` through first-party imports (third-party modules
    are included by name but not followed)."""
    seen: set[str] = set()
    todo = [name]
    while todo:
        mod = todo.pop()
        if mod in seen:
            continue
        seen.add(mod)
        if first_party(mod):
            todo.extend(imports(mod, top_level_only))
            parent = mod.rsplit(".", 1)[0]  # importing a.b runs a/__init__.py first
            if "." in mod and first_party(parent):
                todo.append(parent)
    return seen


def all_modules(package: str) -> list[str]:
    return sorted(
        ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for p in (ROOT / package).rglob("*.py")
    )


def _roots(mods: set[str]) -> set[str]:
    return {m.split(".")[0] for m in mods}


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [("replica", {"cluster"}), ("kernels", {"cluster", "replica", "router"}),
     ("router", {"cluster"})],
)
def test_packages_never_import_upwards(package: str, forbidden: set[str]) -> None:
    bad = {m: sorted(_roots(imports(m)) & forbidden) for m in all_modules(package)}
    assert {m: b for m, b in bad.items() if b} == {}


@pytest.mark.parametrize(
    "module", ["replica.scheduler", "router.policy", "router.stats", "replica.config",
               "replica.api"]
)
def test_the_cores_are_free_of_ray_and_torch(module: str) -> None:
    reach = closure(module)
    assert not _roots(reach) & {"ray", "torch", "kernels", "triton"}, sorted(
        m for m in reach if m.split(".")[0] in {"ray", "torch", "kernels", "triton"})


def test_the_ingress_loads_no_torch_model_code() -> None:
    reach = closure("cluster.ingress", top_level_only=True)
    model_code = {"replica.models.llama", "replica.models.layers", "replica.models.embedded",
                  "replica.models.loader", "replica.engine", "replica.sampler", "replica.runner"}
    assert not (reach & model_code), sorted(reach & model_code)
    assert not _roots(reach) & {"torch", "kernels"}, sorted(
        m for m in reach if m.split(".")[0] in {"torch", "kernels"})
    # What actually happens in a fresh interpreter (third-party imports included).
    code = ("import sys, cluster.ingress; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'kernels')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.strip() == "[]"


def test_the_walker_sees_imports() -> None:
    """The checks above are not vacuous: the walker does find the edges that exist."""
    assert "replica.scheduler" in closure("replica.engine")
    assert "torch" in closure("replica.engine")
    assert "ray" in imports("replica.deployment")
    assert "replica.models.gguf_loader" in imports("replica.models.meta")


def test_building_the_app_loads_neither_torch_nor_transformers() -> None:
    """Serve builds the app in a process of its own before any replica starts: importing
    ``cluster.app`` (and through it the replica's deployment) must not pay for torch or
    transformers (about 2 s of the cluster's start-up); the replica imports its engine itself."""
    code = ("import sys, cluster.app; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers'}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.strip() == "[]"
