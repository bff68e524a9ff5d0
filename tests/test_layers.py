"""The package layout keeps its layers: no upward imports, no import cycles (deferred imports included)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "raympi"

# What each layer may import from raympi (besides itself); third-party packages it must not import.
ALLOWED = {
    "core": ({"raympi.core", "raympi.exceptions"}, {"ray", "mpi4py"}),
    "comm": ({"raympi.comm", "raympi.core", "raympi.exceptions", "raympi.deadline"}, set()),
    "worker": ({"raympi.worker", "raympi.comm", "raympi.core", "raympi.exceptions", "raympi.deadline"}, set()),
}


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(path: Path, top_level_only: bool) -> set[str]:
    """What ``path`` imports: at the top only, or anywhere (inside functions too), but never what is
    imported for type checkers alone (``if TYPE_CHECKING:``, which does not run)."""
    tree = ast.parse(path.read_text())
    typing_only = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and _is_type_checking(node.test)
        for stmt in node.body
        for n in ast.walk(stmt)
    }
    nodes = tree.body if top_level_only else [n for n in ast.walk(tree) if id(n) not in typing_only]
    names: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}
    return names


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in ALLOWED else None


@pytest.mark.parametrize("module", sorted(m for m in _modules() if _layer(m)))
def test_no_upward_imports(module):
    allowed, forbidden = ALLOWED[_layer(module)]
    for name in _imports(_modules()[module], top_level_only=False):
        if name.startswith("raympi."):
            assert any(name == a or name.startswith(a + ".") for a in allowed), f"{module} imports {name}"
        assert name.split(".")[0] not in forbidden, f"{module} imports {name}"


def test_no_import_cycles():
    """Imports inside functions count too: a deferred import is still a dependency of the logic."""
    modules = _modules()
    graph = {m: {n for n in _imports(p, top_level_only=False) if n in modules and n != m} for m, p in modules.items()}
    # A package's __init__ re-exporting its children is not a cycle of logic: leave those edges out.
    graph = {m: {n for n in deps if not n.startswith(m + ".")} for m, deps in graph.items()}
    state: dict[str, int] = {}

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for n in graph[m]:
            if state.get(n) == 1:
                pytest.fail(
                    "import cycle: " + " -> ".join(stack[stack.index(n) :] + [m, n]) if n in stack else f"{m} -> {n}"
                )
            if n not in state:
                visit(n, stack + [m])
        state[m] = 2

    for m in graph:
        if m not in state:
            visit(m, [])
