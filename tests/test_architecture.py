"""The layers of docs/architecture.md, checked from the code's own imports:
imports point down only, the foundation's two halves do not import each other,
and no import circle runs through any package."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("p2pfl", "genbuffer", "protocols", "node", "bench")
# Lower number = lower layer; a module may import its own layer or lower ones.
LAYER = {
    "p2pfl": 0,  # config, errors, files: the schema and helpers both halves read
    "p2pfl.secure": 1,
    "p2pfl.learning": 1,
    "genbuffer": 2,
    "protocols": 3,
    "node": 4,
    "bench": 5,
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(module: str) -> tuple[str, int] | None:
    for prefix in sorted(LAYER, key=len, reverse=True):
        if module == prefix or module.startswith(prefix + "."):
            return prefix, LAYER[prefix]
    return None


def runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node of `tree` except those under `if TYPE_CHECKING:` (imports
    for type hints only, which never run)."""
    out: list[ast.AST] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        out.append(node)
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and ast.unparse(child.test).endswith("TYPE_CHECKING"):
                stack.extend(child.orelse)
                continue
            stack.append(child)
    return out


def project_imports() -> dict[str, set[str]]:
    """module -> the project modules it imports (anywhere in the file)."""
    modules = {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets: set[str] = set()
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in runtime_nodes(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                names = [base] + [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            for target in names:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    targets.add(target)
        graph[name] = targets
    return graph


def test_imports_point_down_only() -> None:
    upward = []
    for module, targets in project_imports().items():
        here = layer_of(module)
        for target in targets:
            there = layer_of(target)
            if here and there and there[1] > here[1]:
                upward.append(f"{module} -> {target}")
    assert upward == []


def half(module: str) -> str | None:
    found = layer_of(module)
    return found[0] if found else None


def test_the_foundations_two_halves_do_not_import_each_other() -> None:
    crossing = [
        f"{module} -> {target}"
        for module, targets in project_imports().items()
        for target in targets
        if {half(module), half(target)} == {"p2pfl.secure", "p2pfl.learning"}
    ]
    assert crossing == []


def test_no_import_circles() -> None:
    graph = project_imports()
    circles: list[list[str]] = []
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                circles.append(path[path.index(target) :] + [target])
            elif target not in state:
                visit(target)
        path.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)
    assert circles == []


def test_every_protocol_name_runs_a_class_that_carries_that_name() -> None:
    """A protocol's name is written once (its params class); the registry maps
    every params class to the class that runs it."""
    import protocols
    from p2pfl.config import protocol_names

    for name in protocol_names():
        protocol = protocols.create(name)
        assert protocol.name == name
