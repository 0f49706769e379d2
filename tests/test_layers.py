"""The package's import map: imports only point down the layers of docs/architecture.md, no two parts import
each other (directly or through others), and no two modules do either. Read from the source with ``ast``, so lazy
imports inside functions and imports for type checking count too."""

from __future__ import annotations

import ast
from pathlib import Path

import lightning_d9d

PACKAGE = Path(lightning_d9d.__file__).parent
# Bottom to top; parts on one line may use each other, as long as no cycle forms.
LAYERS: list[tuple[str, ...]] = [
    ("compat",),
    ("mesh",),
    ("kernels",),
    ("modules",),
    ("optim",),
    ("plans", "pipeline", "state", "data"),
    ("models",),
    ("loss",),  # the loss layer: below both strategies, above the models and the pipeline runner
    ("callbacks",),
    ("strategies",),
    ("fabric",),
    ("__init__", "convert"),
]
LEVEL = {part: level for level, parts in enumerate(LAYERS) for part in parts}


def _part(module: str) -> str:
    """``lightning_d9d.state.hf.io`` -> ``state``; the package itself -> ``__init__``."""
    pieces = module.split(".")
    return pieces[1] if len(pieces) > 1 else "__init__"


def _module_name(path: Path) -> str:
    relative = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(relative.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1] if len(parts) > 1 else [*parts[:-1], "__init__"]
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Every ``lightning_d9d`` module the file imports, relative imports resolved."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("lightning_d9d"))
        elif isinstance(node, ast.ImportFrom):
            name = _from_name(path, node)
            if name.startswith("lightning_d9d"):
                found.add(name)
    return found


def _from_name(path: Path, node: ast.ImportFrom) -> str:
    """The module a ``from ... import`` in ``path`` reads from, relative imports resolved."""
    if not node.level:
        return node.module or ""
    package = _module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    base = package[: len(package) - node.level + 1]
    return ".".join([*base, *([node.module] if node.module else [])])


def _module_imports(path: Path, modules: set[str]) -> set[str]:
    """The ``lightning_d9d`` modules the file imports: ``from package import module`` names the module, ``from
    package import name`` the package (its ``__init__``)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            package = _from_name(path, node)
            named = {f"{package}.{alias.name}" for alias in node.names}
            found |= named & modules
            if not named <= modules:  # a name defined in the package (its __init__), not a module of it
                found.add(package)
    return found & modules


def _graph() -> dict[str, set[str]]:
    """part -> the parts it imports (from every file of the part)."""
    graph: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = _module_name(path)
        source = "__init__" if name == "lightning_d9d.__init__" else _part(name)
        targets = {_part(target) for target in _imports(path)} - {source}
        graph.setdefault(source, set()).update(targets)
    return graph


def test_every_part_has_a_layer() -> None:
    assert set(_graph()) <= set(LEVEL), set(_graph()) - set(LEVEL)


def test_imports_point_down() -> None:
    upward = [
        f"{source} (layer {LEVEL[source]}) imports {target} (layer {LEVEL[target]})"
        for source, targets in _graph().items()
        for target in targets
        if LEVEL[target] > LEVEL[source]
    ]
    assert not upward, upward


def test_no_import_cycles_between_parts() -> None:
    graph = _graph()

    def reachable(start: str) -> set[str]:
        seen: set[str] = set()
        stack = [start]
        while stack:
            for nxt in graph.get(stack.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
        return seen

    cycles = sorted(part for part in graph if part in reachable(part))
    assert not cycles, f"parts on an import cycle: {cycles}"


def test_no_import_cycles_between_modules() -> None:
    """Within a part too: a module that imports another never is imported back by it, not even for type checking
    (a reader of either would need the other first)."""
    paths = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph = {name: _module_imports(path, set(paths)) - {name} for name, path in paths.items()}

    def reachable(start: str) -> set[str]:
        seen: set[str] = set()
        stack = [start]
        while stack:
            for nxt in graph[stack.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
        return seen

    cycles = sorted(name for name in graph if name in reachable(name))
    assert not cycles, f"modules on an import cycle: {cycles}"


def test_the_loss_layer_sits_between_the_strategies_and_the_models() -> None:
    """A loss walks down once: strategy -> loss layer -> (pipeline runner) -> model head -> kernel. The loss layer
    imports what lies below it (the models, the pipeline runner, the plans, the blocks) and nothing above it."""
    assert LEVEL["models"] < LEVEL["loss"] < LEVEL["strategies"] < LEVEL["fabric"]
    assert LEVEL["pipeline"] < LEVEL["loss"]
    above = {part for part, level in LEVEL.items() if level > LEVEL["loss"]}
    graph = _graph()
    assert not graph["loss"] & above, graph["loss"] & above
    assert "loss" in graph["strategies"] and "loss" in graph["fabric"]  # both strategies go through it
