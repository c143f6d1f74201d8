"""The package's import graph, read from the source: layers only call down (no cycles), and the I/O
layer stands alone. Every import counts, at module level or inside a function, those under ``if
TYPE_CHECKING:`` too: an import made for annotations alone still ties the two modules' meanings, so
a circle through one is a circle."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import zerooffload

PACKAGE = Path(zerooffload.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """The zerooffload modules ``path`` imports (a package import counts as its ``__init__``)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("zerooffload")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            if base.startswith("zerooffload"):
                found.add(base)
                found |= {f"{base}.{a.name}" for a in node.names}
    return found


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: {m for m in _imports(path) if m in modules and m != name} for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected group of modules (Tarjan's algorithm)."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return groups


def test_the_import_graph_has_no_cycle():
    graph = {name: deps - {"zerooffload"} for name, deps in _graph().items()}  # the lazy facade imports nothing
    assert _cycles(graph) == []


def test_the_io_layer_imports_nothing_above_it():
    above = {name: sorted(m for m in deps if not m.startswith("zerooffload.io"))
             for name, deps in _graph().items() if name.startswith("zerooffload.io")}
    assert {name: deps for name, deps in above.items() if deps} == {}


def test_importing_the_io_layer_loads_no_engine_module():
    loaded = subprocess.run([sys.executable, "-c", "import sys, zerooffload.io; print(' '.join(sorted(sys.modules)))"],
                            capture_output=True, text=True, check=True).stdout.split()
    ours = [m for m in loaded if m.startswith("zerooffload")]
    assert ours and all(m.startswith("zerooffload.io") or m in ("zerooffload", "zerooffload.threads") for m in ours), ours
