"""The layers of docs/architecture.md, checked from the code's own imports:
imports point down only, the foundation's two halves do not import each other,
and no import circle runs through any package. Imports under `if
TYPE_CHECKING:` count too: they never run, but a circle through type hints is
still two modules that cannot be read or moved apart (issue 29 found
node/context.py <-> node/daemon.py hidden that way). And the protocol registry
is checked against what each protocol class itself declares it runs on."""

from __future__ import annotations

import ast
import importlib
import inspect
import typing
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


def project_imports() -> dict[str, set[str]]:
    """module -> the project modules it imports (anywhere in the file, type
    hints under `if TYPE_CHECKING:` included)."""
    modules = {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets: set[str] = set()
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
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
    assert circles == [], "import circles: " + "; ".join(" -> ".join(c) for c in circles)


def declared_params(cls: type) -> type | None:
    """The params class a protocol class says it runs on, read from the class
    itself (not from the registry): the argument of a generic base
    (`RoundLoop[FedAvgP2PParams]`), else its own `params:` annotation, else its
    `__init__`'s `params` annotation; the first class in the MRO that says one."""
    from p2pfl.config.protocols import BaseParams

    def params_type(hint: object) -> type | None:
        return hint if isinstance(hint, type) and issubclass(hint, BaseParams) else None

    for klass in cls.__mro__:
        for base in klass.__dict__.get("__orig_bases__", ()):
            for arg in typing.get_args(base):
                if found := params_type(arg):
                    return found
        if found := params_type(inspect.get_annotations(klass, eval_str=True).get("params")):
            return found
        init = klass.__dict__.get("__init__")
        if init is not None:
            hint = inspect.get_annotations(init, eval_str=True).get("params")
            if found := params_type(hint):
                return found
    return None


def test_the_registry_runs_each_params_class_with_the_class_declared_for_it() -> None:
    """`protocols.IMPLEMENTATIONS` maps every params class of `ProtocolParams`
    to a class that declares those params, and every protocol name (the
    params' `name` literal, written once) runs that class. A swapped or wrong
    entry fails here: the class's declaration is read from the class, not from
    what the registry handed it."""
    import protocols
    from p2pfl.config import ProtocolParams, params_class, protocol_names

    assert set(protocols.IMPLEMENTATIONS) == set(typing.get_args(ProtocolParams))
    wrong = []
    for params, target in protocols.IMPLEMENTATIONS.items():
        module_name, _, cls_name = target.partition(":")
        cls = getattr(importlib.import_module(module_name), cls_name)
        if declared_params(cls) is not params:
            wrong.append(f"{params.__name__} -> {target}, which declares {declared_params(cls)}")
    assert wrong == []
    for name in protocol_names():
        protocol = protocols.create(name)
        assert type(protocol.params) is params_class(name)
        assert declared_params(type(protocol)) is params_class(name)
        assert protocol.name == name
