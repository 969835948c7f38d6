"""The layout holds: each package imports only those below it, and no module imports itself round a cycle.

From the bottom: schemas/ (the typed messages), bus/, telemetry/ (logs and
metrics), then gateway/ and workers/ side by side (neither imports the other),
and tokenrelay/ (the command, its settings, the benches) on top. The engine
(workers/engine/) runs without the bus: the worker translates between them.
Imports are read from the source, wherever they stand (a function's deferred
import counts); those under `if TYPE_CHECKING:` are annotations, not imports.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.processes import REPO

BELOW = {  # what each package may import, besides itself
    "schemas": set(),
    "bus": {"schemas"},
    "telemetry": {"schemas", "bus"},
    "gateway": {"schemas", "bus", "telemetry"},
    "workers": {"schemas", "bus", "telemetry"},
    "tokenrelay": {"schemas", "bus", "telemetry", "gateway", "workers"},
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_nodes(tree: ast.AST):
    """The tree's nodes, without the bodies of `if TYPE_CHECKING:`."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            yield from (n for child in node.orelse for n in [child, *_runtime_nodes(child)])
            continue
        yield node
        yield from _runtime_nodes(node)


def import_graph() -> dict[str, set[str]]:
    """Our modules, each with the modules of ours it imports at run time."""
    paths = {_module_name(p): p for package in BELOW for p in (REPO / package).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        imported: set[str] = set()
        for node in _runtime_nodes(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                imported |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
        graph[name] = {module for module in imported if module in paths and module != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for imported in graph[module]:
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            component = []
            while (top := stack.pop()) != module:
                component.append(top)
            if component:
                found.append(sorted([module, *component]))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def test_no_module_imports_itself_round_a_cycle():
    assert cycles(import_graph()) == []


def test_each_package_imports_only_the_packages_below_it():
    wrong = [
        f"{module} imports {imported}"
        for module, imports in import_graph().items()
        for imported in imports
        if imported.split(".")[0] not in BELOW[module.split(".")[0]] | {module.split(".")[0]}
    ]
    assert wrong == []


def test_the_engine_runs_without_the_bus():
    graph = import_graph()
    engine = [m for m in graph if m.startswith("workers.engine")]
    assert engine
    assert [f"{m} imports {i}" for m in engine for i in graph[m] if i.startswith("bus")] == []


def test_the_check_finds_a_cycle_and_passes_over_annotations():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import b\nelse:\n    import c\n")
    names = {alias.name for node in _runtime_nodes(tree) if isinstance(node, ast.Import) for alias in node.names}
    assert names == {"c"}
