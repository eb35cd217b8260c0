"""Imports run down (README "Layout"): no cycle between forklm's folders, between runtime/'s rooms,
or between the modules inside runtime/ and kernels/; imports under `if TYPE_CHECKING:` do not
count. import-linter cannot read this tree (it walks one folder per top-level package, and
runtime/ becomes forklm.runtime only through pyproject.toml's package-dir), so the import graph
is read here from the sources, with the same mapping."""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from pathlib import Path

import networkx
import tomllib
from conftest import REPO_ROOT

# Known back-edges (module -> module it imports), each with what it would take to remove it:
# none left. A package facade's lazy re-export (importlib, loaded on first use: forklm's public
# names, sgl.Runtime) is not an import of the package's code and is not read as one.
KNOWN_BACK_EDGES: set[tuple[str, str]] = set()


@functools.cache
def _modules() -> dict[str, Path]:
    """Every forklm module name -> its source file, by pyproject.toml's package-dir mapping."""
    config = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    package_dir: dict[str, str] = config["tool"]["setuptools"]["package-dir"]
    modules: dict[str, Path] = {}
    for package in config["tool"]["setuptools"]["packages"]:
        prefix = max((p for p in package_dir if package == p or package.startswith(p + ".")),
                     key=len)
        folder = REPO_ROOT / package_dir[prefix] / package[len(prefix):].lstrip(".").replace(".", "/")
        for source in folder.glob("*.py"):
            if source.stem == "__main__":
                continue  # an entry point: nothing imports it
            name = package if source.stem == "__init__" else f"{package}.{source.stem}"
            modules[name] = source
    return modules


def _runtime_imports(tree: ast.Module) -> Iterator[str]:
    """Dotted names each import statement of the module brings in, but type-only ones."""
    type_only: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            type_only |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module
            yield from (f"{node.module}.{alias.name}" for alias in node.names)


@functools.cache
def _read_graph() -> dict[str, frozenset[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, source in modules.items():
        for target in _runtime_imports(ast.parse(source.read_text())):
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name and (name, target) not in KNOWN_BACK_EDGES:
                graph[name].add(target)
    return {name: frozenset(targets) for name, targets in graph.items()}


def _module_graph() -> dict[str, set[str]]:
    """forklm's modules -> the forklm modules each imports at run time (a fresh copy)."""
    return {name: set(targets) for name, targets in _read_graph().items()}


def _collapse(graph: dict[str, set[str]], group: dict[str, str]) -> dict[str, set[str]]:
    """The graph between groups (a module maps to its group; edges inside a group vanish)."""
    collapsed: dict[str, set[str]] = {g: set() for g in group.values()}
    for name, targets in graph.items():
        collapsed[group[name]] |= {group[t] for t in targets} - {group[name]}
    return collapsed


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one node."""
    components = networkx.strongly_connected_components(networkx.DiGraph(graph))
    return sorted(sorted(c) for c in components if len(c) > 1)


def _folder(name: str) -> str:
    """A module's folder: forklm.runtime.engine.loop -> forklm.runtime.engine; the modules
    directly in runtime/ (config, errors, ...) are the room-less base, forklm.runtime."""
    parts = name.split(".")
    if parts[:2] == ["forklm", "runtime"] or parts[:2] == ["forklm", "kernels"]:
        return ".".join(parts[:3]) if len(parts) > 3 or name in _packages() else ".".join(parts[:2])
    return ".".join(parts[:2])


@functools.cache
def _packages() -> frozenset[str]:
    return frozenset(name for name, source in _modules().items() if source.name == "__init__.py")


def test_the_graph_is_read() -> None:
    graph = _module_graph()
    assert "forklm.runtime.engine.engine" in graph
    assert "forklm.runtime.scheduling.scheduler" in graph["forklm.runtime.engine.builder"]


def test_no_cycle_between_folders_or_rooms() -> None:
    graph = _module_graph()
    assert _cycles(_collapse(graph, {name: _folder(name) for name in graph})) == []


def test_no_cycle_between_the_modules_of_runtime_and_kernels() -> None:
    graph = _module_graph()
    below = {n: {t for t in ts if t.startswith(("forklm.runtime", "forklm.kernels"))}
             for n, ts in graph.items() if n.startswith(("forklm.runtime", "forklm.kernels"))}
    assert _cycles(below) == []


def test_a_back_edge_is_found() -> None:
    """The check can fail: the engine importing the server makes a cycle with the server's
    imports of the engine."""
    graph = _module_graph()
    graph["forklm.runtime.engine.loop"].add("forklm.server.app")
    assert _cycles(_collapse(graph, {name: _folder(name) for name in graph}))
