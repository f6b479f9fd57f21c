"""Dependencies point one way, checked by walking the imports of the source (no module is run):

- the layers (docs/architecture.md): ``tierserve.records`` (the records every process shares)
  < ``tierserve.kernels`` < ``tierserve.replica`` < ``tierserve.router`` < ``tierserve.cluster``
  (the load generator ``tierserve.cluster.load`` included); no module imports one of a higher
  layer, and every import of ours is through the ``tierserve`` namespace;
- the benchmarks (``benchmarks/``, not part of the package) sit above every layer: they may
  import anything of tierserve's, through the namespace as any client does, and nothing of
  tierserve imports them (not even inside a function or for its types);
- the scheduler, the router's ranking policy and its stats records stay free of Ray and torch
  (all they import, transitively);
- the ingress gets its config and tokenizer without the torch model code: what importing
  ``tierserve.cluster.ingress`` loads holds no ``torch``, no ``kernels``, no model, engine or sampler
  module (and a fresh interpreter that imports it has no torch module loaded);
- building the Serve app (importing ``tierserve.cluster.app``) loads neither torch nor transformers.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Lowest first.
LAYERS = ("records", "kernels", "replica", "router", "cluster")
PARTS = LAYERS[1:]  # the folders linked into tierserve/
BENCHMARKS = "benchmarks"  # above every layer, outside the package


def _module_file(name: str) -> Path | None:
    base = ROOT.joinpath(*name.split("."))
    for cand in (base.with_suffix(".py"), base / "__init__.py"):
        if cand.is_file():
            return cand
    return None


def _is_type_checking(node: ast.If) -> bool:
    return isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def imports(name: str, top_level_only: bool = False, type_only: bool = False) -> set[str]:
    """The modules ``name`` imports (absolute names; submodules of ``from pkg import mod``
    resolved), skipping ``if TYPE_CHECKING:`` blocks unless ``type_only``; with
    ``top_level_only``, only what runs at import time (not imports inside functions)."""
    path = _module_file(name)
    assert path is not None, name
    tree = ast.parse(path.read_text(), str(path))
    found: set[str] = set()

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child) and not type_only:
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
    return name.split(".")[0] == "tierserve" and _module_file(name) is not None


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


def all_modules(part: str) -> list[str]:
    """The modules of one layer, by their names in the namespace (the benchmarks': by their own
    top-level names)."""
    if part == "records":
        return ["tierserve.records"]
    prefix = "" if part == BENCHMARKS else "tierserve."
    return sorted(
        prefix + ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for p in (ROOT / part).rglob("*.py")
    )


def every_import(module: str) -> set[str]:
    """Every module ``module`` names in an import, anywhere in it (inside functions and
    ``if TYPE_CHECKING:`` blocks too), with ``from pkg import name`` also as ``pkg.name``."""
    path = _module_file(module)
    assert path is not None, module
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return found


def _roots(mods: set[str]) -> set[str]:
    return {m.split(".")[0] for m in mods}


def layer_of(module: str) -> int:
    """The rank of a ``tierserve.<layer>...`` module's layer (the package itself: the bottom)."""
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else 0


@pytest.mark.parametrize("part", LAYERS)
def test_no_layer_imports_a_higher_one(part: str) -> None:
    """Type-only imports count too: a record a lower layer names belongs below it."""
    rank = LAYERS.index(part)
    bad: dict[str, list[str]] = {}
    for module in all_modules(part):
        found = every_import(module)
        up = sorted(m for m in found if m.startswith("tierserve.") and layer_of(m) > rank)
        if up:
            bad[module] = up
    assert bad == {}


def runtime_modules() -> list[str]:
    """Every module of the package: ``tierserve/``'s own files and every part's."""
    own = sorted(f"tierserve.{p.stem}".removesuffix(".__init__")
                 for p in (ROOT / "tierserve").glob("*.py"))
    return own + [m for part in PARTS for m in all_modules(part)]


def test_the_runtime_never_imports_the_benchmarks() -> None:
    """Not even in a function or for a type: the package installs without ``benchmarks/``."""
    mods = runtime_modules()
    assert "tierserve" in mods and "tierserve.cluster.load" in mods
    bad = {m: sorted(i for i in every_import(m) if i.split(".")[0] == BENCHMARKS) for m in mods}
    assert {m: b for m, b in bad.items() if b} == {}


def test_the_benchmarks_import_tierserve_as_a_client_does() -> None:
    """``from tierserve.replica...``, never a bare ``replica...`` (which would load a second copy
    of the module, or for ``kernels`` Hugging Face's package), and nothing of the tests (the
    tests import the benchmarks, not the other way round); and no benchmark is linked into the
    namespace."""
    mods = all_modules(BENCHMARKS)
    assert "benchmarks" in mods and "benchmarks.router_sim" in mods
    bare = {m: sorted(i for i in every_import(m) if i.split(".")[0] in (*PARTS, "tests"))
            for m in mods}
    assert {m: b for m, b in bare.items() if b} == {}
    assert any(i.startswith("tierserve.") for m in mods for i in every_import(m))
    assert not (ROOT / "tierserve" / BENCHMARKS).exists()
    assert not (ROOT / "tierserve" / "bench").exists()


@pytest.mark.parametrize("module", ["tierserve.records", "tierserve.arith"])
def test_the_bottom_imports_nothing_of_ours(module: str) -> None:
    mods = imports(module)
    assert not {m for m in mods if m.split(".")[0] == "tierserve"}, sorted(mods)


@pytest.mark.parametrize("part", PARTS)
def test_every_import_of_ours_goes_through_the_namespace(part: str) -> None:
    """A bare ``import replica...`` would load a second copy of a module (or, for ``kernels``,
    Hugging Face's package): every first-party import names ``tierserve``."""
    bare = {m: sorted(mod for mod in imports(m) if mod.split(".")[0] in PARTS)
            for m in all_modules(part)}
    assert {m: b for m, b in bare.items() if b} == {}


@pytest.mark.parametrize(
    "module", ["tierserve.replica.scheduler", "tierserve.router.policy", "tierserve.records",
               "tierserve.replica.config"]
)
def test_the_cores_are_free_of_ray_and_torch(module: str) -> None:
    reach = closure(module)
    assert not _roots(reach) & {"ray", "torch", "kernels", "triton"}, sorted(
        m for m in reach if m.split(".")[0] in {"ray", "torch", "kernels", "triton"})


def test_the_ingress_loads_no_torch_model_code() -> None:
    reach = closure("tierserve.cluster.ingress", top_level_only=True)
    model_code = {"tierserve.replica.models.llama", "tierserve.replica.models.layers", "tierserve.replica.models.embedded",
                  "tierserve.replica.models.loader", "tierserve.replica.engine", "tierserve.replica.sampler", "tierserve.replica.runner"}
    assert not (reach & model_code), sorted(reach & model_code)
    assert not _roots(reach) & {"torch", "kernels"}, sorted(
        m for m in reach if m.split(".")[0] in {"torch", "kernels"})
    # What actually happens in a fresh interpreter (third-party imports included).
    code = ("import sys, tierserve.cluster.ingress; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'kernels')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.strip() == "[]"


def test_the_walker_sees_imports() -> None:
    """The checks above are not vacuous: the walker does find the edges that exist."""
    assert "tierserve.replica.scheduler" in closure("tierserve.replica.engine")
    assert "torch" in closure("tierserve.replica.engine")
    assert "ray" in imports("tierserve.replica.deployment")
    assert "tierserve.replica.models.gguf_loader" in imports("tierserve.replica.models.meta")
    assert layer_of("tierserve.cluster.ingress") > layer_of("tierserve.replica.engine")
    assert layer_of("tierserve.records") == 0 < layer_of("tierserve.kernels.attention")
    assert "tierserve.records" in all_modules("records") and all_modules("router")


def test_building_the_app_loads_neither_torch_nor_transformers() -> None:
    """Serve builds the app in a process of its own before any replica starts: importing
    ``tierserve.cluster.app`` (and through it the replica's deployment) must not pay for torch or
    transformers (about 2 s of the cluster's start-up); the replica imports its engine itself."""
    code = ("import sys, tierserve.cluster.app; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers'}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.strip() == "[]"


def import_cycles() -> list[list[str]]:
    """The first-party import graph's cycles: each strongly connected component of more than one
    module (imports inside functions and ``if TYPE_CHECKING:`` ones count: a type one module
    names from another is a dependency too; a package's ``__init__`` run before its submodule
    is not an edge)."""
    modules = [m for part in LAYERS for m in all_modules(part)]
    graph = {m: sorted(d for d in imports(m, type_only=True) if first_party(d) and d != m)
             for m in modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    for root in modules:  # Tarjan's algorithm, iteratively
        if root in index:
            continue
        work = [(root, iter(graph.get(root, [])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(graph.get(nxt, []))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    component.append(m)
                    if m == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return cycles


def test_no_module_imports_itself_through_others() -> None:
    """No import circle, not even inside functions: the sampler and the grammar code share
    ``tierserve.replica.constraint`` instead of importing each other."""
    assert import_cycles() == []
    assert "tierserve.replica.constraint" in imports("tierserve.replica.sampler")
