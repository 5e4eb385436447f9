"""The package's layers hold: wire -> subscriber -> index -> runtime -> store / service ->
cli, and the tools around them; a module imports only its own package and lower layers
(docs/architecture.md). Read from the source's imports (function-level ones too), so an
upward edge fails here before it becomes a cycle or a runtime call-back."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"

# The layer of each top-level package of kvindex; a module may import packages of a lower
# layer only (and its own package). Equal layers don't import each other: store and
# service both sit on runtime, never on one another.
LAYERS: dict[str, int] = {
    "wire": 0,
    "security": 0,  # CURVE keys and HTTP guards: imports nothing of kvindex
    "subscriber": 1,
    "kvindex": 2,  # the package root: the library face (subscriber + wire) and __version__
    "index": 3,
    "sim": 3,
    "recording": 3,
    "relay": 3,
    "runtime": 4,
    "analysis": 4,
    "store": 5,
    "service": 5,
    "bench": 6,
    "cli": 7,
    "__main__": 8,
}


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _imports(tree: ast.AST) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m == "kvindex" or m.startswith("kvindex.")}


def _edges() -> list[tuple[str, str]]:
    """(importing file, imported module) for every kvindex import in src/kvindex."""
    edges = []
    for path in sorted((SRC / "kvindex").rglob("*.py")):
        rel = path.relative_to(SRC / "kvindex")
        here = rel.parts[0].removesuffix(".py") if len(rel.parts) > 1 else rel.stem
        here = "kvindex" if here == "__init__" else here
        for module in _imports(ast.parse(path.read_text(encoding="utf-8"))):
            edges.append((f"{here}:{rel}", module))
    return edges


def test_every_package_has_a_layer() -> None:
    packages = {p.name.removesuffix(".py") for p in (SRC / "kvindex").iterdir()}
    packages -= {"__init__", "__pycache__", "py.typed"}
    packages = {p for p in packages if not p.endswith((".so", ".pyi"))}
    assert packages <= LAYERS.keys(), f"give these a layer: {sorted(packages - LAYERS.keys())}"


def test_no_import_goes_up_or_sideways() -> None:
    wrong = []
    for where, module in _edges():
        here, target = where.split(":")[0], _package(module)
        if target != here and LAYERS[target] >= LAYERS[here]:
            wrong.append(f"{where.split(':')[1]} imports {module}")
    assert not wrong, "imports against the layers:\n" + "\n".join(wrong)


def test_the_check_sees_an_upward_import() -> None:
    # The rule is read from the source: a store module importing the service is caught.
    tree = ast.parse("def f():\n    from kvindex.service.app import create_app\n")
    (module,) = _imports(tree)
    assert LAYERS[_package(module)] >= LAYERS["store"]
