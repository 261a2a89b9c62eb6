"""The foundation (p2pfl/) has no import cycles: read from the source with ast,
every import statement counts, function-level ones included (only imports under
`if TYPE_CHECKING:` are left out)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def module_names(package: str) -> dict[str, Path]:
    modules: dict[str, Path] = {}
    for path in (ROOT / package).rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def imported(module: str, path: Path, known: set[str]) -> set[str]:
    """The modules of `known` that `module` imports anywhere in its body."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    typing_only = {
        id(node)
        for branch in ast.walk(tree)
        if isinstance(branch, ast.If) and "TYPE_CHECKING" in ast.unparse(branch.test)
        for statement in branch.body
        for node in ast.walk(statement)
    }
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package[: len(package) - (node.level - 1)]
                base = ".".join(parent + ([base] if base else []))
            targets = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        else:
            continue
        found.update(t for t in targets if t in known and t != module)
    return found


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_p2pfl_has_no_import_cycles() -> None:
    modules = module_names("p2pfl")
    edges = {m: imported(m, path, set(modules)) for m, path in modules.items()}
    assert "p2pfl.learning.train" in edges and edges["p2pfl.learning.train"]
    assert cycles(edges) == []


def test_a_cycle_is_found() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
