"""The shape of retrain/ (docs/architecture.md), checked on the source: imports only go
down the layer table, no import circle, no function over 80 lines, and no engine chosen
by a string test outside the registry. Imports inside functions count like module-level
ones (they run too); imports under `if TYPE_CHECKING:` do not (they never run)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "retrain"

# Lowest first: a module may import its own layer and those below it.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    (
        "records",
        (
            "retrain",
            "retrain.registry",
            "retrain.types",
            "retrain.errors",
            "retrain.settings",
            "retrain.throttle",
            "retrain.memory",
            "retrain.hardware",
            "retrain.world",
        ),
    ),
    (
        "pure math",
        (
            "retrain.advantages",
            "retrain.sepa",
            "retrain.backpressure",
            "retrain.roofline",
            "retrain.shaping",
        ),
    ),
    ("configuration", ("retrain.config",)),
    ("kernels", ("retrain.kernels",)),
    (
        "components",
        (
            "retrain.backends",
            "retrain.engines",
            "retrain.data",
            "retrain.rewards",
            "retrain.logs",
            "retrain.loss",
            "retrain.environments",
            "retrain.compare",
            "retrain.checkpoint",
            "retrain.distributed",
            "retrain.rollout",
            "retrain.multiturn",
            "retrain.zero_signal",
            "retrain.tool_calls",
            "retrain.threads",
            "retrain.evaluate",
            "retrain.schedule",
            "retrain.squeeze",
            "retrain.models",
            "retrain.http",
            "retrain.algorithms",
        ),
    ),
    ("compat", ("retrain.compat",)),
    (
        "loop",
        (
            "retrain.startup",
            "retrain.build",
            "retrain.trainer",
            "retrain.stepping",
            "retrain.campaign",
        ),
    ),
    ("commands", ("retrain.cli", "retrain.__main__")),
]
# Package façades that serve the original API's names lazily (inside `__getattr__`).
FACADES = {"retrain", "retrain.advantages"}


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()


def layer_of(module: str) -> int:
    best, rank = -1, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            matches = module == prefix or module.startswith(prefix + ".")
            if matches and len(prefix) > best:
                best, rank = len(prefix), i
    if rank < 0:
        raise AssertionError(f"{module} is in no layer of the table: add it")
    return rank


def _known(name: str) -> str | None:
    """The retrain module an import names (a submodule, else its package)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


class _Imports(ast.NodeVisitor):
    """(target module, line, inside a façade's __getattr__) of every import that runs."""

    def __init__(self, module: str, is_package: bool):
        self.module, self.is_package = module, is_package
        self.found: list[tuple[str, int, bool]] = []
        self._getattr = 0

    def visit_If(self, node: ast.If) -> None:
        if _is_type_checking(node):
            for child in node.orelse:
                self.visit(child)
            return
        self.generic_visit(node)

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        lazy = node.name == "__getattr__" and self.module in FACADES
        self._getattr += lazy
        self.generic_visit(node)
        self._getattr -= lazy

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:
            package = self.module if self.is_package else self.module.rpartition(".")[0]
            for _ in range(node.level - 1):
                package = package.rpartition(".")[0]
            base = f"{package}.{base}" if node.module else package
        for alias in node.names:
            full = f"{base}.{alias.name}"
            self._add(full if full in MODULES else base, node.lineno)

    def _add(self, name: str, line: int) -> None:
        if name == "retrain" or name.startswith("retrain."):
            target = _known(name)
            if target is not None and target != self.module:
                self.found.append((target, line, self._getattr > 0))


def imports_of(module: str) -> list[tuple[str, int, bool]]:
    path = MODULES[module]
    visitor = _Imports(module, path.name == "__init__.py")
    visitor.visit(ast.parse(path.read_text(), str(path)))
    return visitor.found


GRAPH = {m: imports_of(m) for m in MODULES}


def test_every_module_has_a_layer():
    for module in MODULES:
        layer_of(module)


def test_imports_only_go_down_the_layers():
    upward = [
        f"{module} ({LAYERS[layer_of(module)][0]}) imports {target} "
        f"({LAYERS[layer_of(target)][0]}) at {MODULES[module].name}:{line}"
        for module, found in GRAPH.items()
        for target, line, lazy_facade in found
        if layer_of(target) > layer_of(module) and not lazy_facade
    ]
    assert not upward, "\n".join(upward)


def test_there_is_no_import_circle():
    edges = {m: {t for t, _, lazy in found if not lazy} for m, found in GRAPH.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
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
                circles.append(sorted(component))

    for v in edges:
        if v not in index:
            visit(v)
    assert not circles, circles


def test_no_function_is_over_80_lines():
    long = [
        f"{path.relative_to(ROOT.parent)}:{node.lineno} {node.name} ({length} lines)"
        for path in MODULES.values()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and (length := node.end_lineno - node.lineno + 1) > 80
    ]
    assert not long, long


def test_no_engine_is_chosen_by_name_outside_the_registry():
    """The backend, validation and explain branch on an engine's EngineTraits."""
    test = re.compile(r"""[!=]=\s*["']pytorch["']|["']pytorch["']\s*[!=]=""")
    found = [
        f"{path.relative_to(ROOT.parent)}:{i}"
        for path in MODULES.values()
        if path.name != "registry.py"
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if test.search(line)
    ]
    assert not found, found


@pytest.mark.parametrize(
    ("source", "flagged"),
    [
        ("import retrain.build\n", True),
        ("def f():\n    from retrain import build\n", True),
        ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import retrain.build\n", False),
    ],
)
def test_the_checker_sees_function_imports_and_skips_type_checking(source, flagged, tmp_path):
    """The checks above cannot pass vacuously: an upward import from the records layer
    is seen wherever it runs, and only TYPE_CHECKING imports are skipped."""
    visitor = _Imports("retrain.types", False)
    visitor.visit(ast.parse(source))
    assert bool(visitor.found) == flagged
    if flagged:
        assert layer_of(visitor.found[0][0]) > layer_of("retrain.types")
