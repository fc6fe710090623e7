"""The package's layout holds: no import circles between its modules, every subpackage placed in the
import-linter layers contract. (Module length is a matter for review, not a test: a module holds one idea, and a
class is never split along a line count.)"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hf_zenflow"


def _name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(name: str, path: Path) -> set[str]:
    """Every hf_zenflow module `name` imports anywhere in its file: at module level, under ``TYPE_CHECKING`` and
    inside functions (a circle through a function-local import is a circle too)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                found.add(f"{target}.{alias.name}" if f"{target}.{alias.name}" in MODULES else target)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m in MODULES and m != name}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_circles():
    graph = {name: _imports(name, path) for name, path in MODULES.items()}
    assert graph["hf_zenflow.optimizer.zenflow"]  # the walk does see imports
    assert _circles(graph) == []


def test_the_circle_finder_finds_a_circle():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_every_subpackage_and_top_module_is_in_the_layers_contract():
    # (read as text: tomllib is Python 3.11+, the package supports 3.10)
    contract = re.search(r'type = "layers"\nlayers = \[(.*?)\]', (ROOT / "pyproject.toml").read_text(), re.DOTALL)
    layers = re.findall(r'"([^"]+)"', contract.group(1))
    placed = {name.strip() for layer in layers for name in re.split(r"[|:]", layer)}
    children = {_name(p) for p in PACKAGE.iterdir() if (p / "__init__.py").is_file() or p.suffix == ".py"}
    children -= {"hf_zenflow"}
    assert children - placed == set(), "a subpackage or top-level module the layers contract does not place"
    assert placed - children == set(), "the contract names something the package does not have"


def test_the_public_names_resolve_and_old_module_paths_do_not():
    import hf_zenflow

    for name in hf_zenflow.__all__:
        assert getattr(hf_zenflow, name) is not None
    assert callable(hf_zenflow.tune)  # the function, not the `tuning` package
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("hf_zenflow.windows")  # moved to hf_zenflow.engine.windows before the first release
