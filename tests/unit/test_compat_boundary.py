"""The core never imports retrain.compat: the compatibility layer installs itself into the
core's extension points, and only the two façades reach it, lazily, from their
``__getattr__``. Also: without it, the core loads retrain's own keys and reports the
original's as unknown."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parents[2] / "retrain"
# Not core: the layer itself, the commands, and the loop that composes a run.
NOT_CORE = ("compat/", "cli/", "campaign/", "build.py", "trainer.py")
FACADES = ("__init__.py", "advantages/__init__.py")
COMPAT = "retrain.compat"


def _core_modules() -> list[Path]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if not rel.startswith(NOT_CORE):
            out.append(path)
    return out


def _names_compat(node: ast.AST) -> bool:
    """True for an import (statement or importlib call) that reaches retrain.compat."""
    if isinstance(node, ast.Import):
        return any(a.name == COMPAT or a.name.startswith(COMPAT + ".") for a in node.names)
    if isinstance(node, ast.ImportFrom):
        module = node.module or ""
        if module == COMPAT or module.startswith(COMPAT + "."):
            return True
        return module == "retrain" and any(a.name == "compat" for a in node.names)
    if isinstance(node, ast.Call) and node.args:
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        first = node.args[0]
        return (
            name in ("import_module", "__import__")
            and isinstance(first, ast.Constant)
            and isinstance(first.value, str)
            and first.value.startswith(COMPAT)
        )
    return False


def _compat_imports(tree: ast.Module) -> list[tuple[int, str | None]]:
    """(line, enclosing module-level function or None) of every import of retrain.compat."""
    found = []
    for top in tree.body:
        scope = top.name if isinstance(top, ast.FunctionDef | ast.AsyncFunctionDef) else None
        for node in ast.walk(top):
            if _names_compat(node):
                found.append((node.lineno, scope))
    return found


def test_there_are_core_modules_and_the_facades_are_among_them():
    rel = {p.relative_to(PACKAGE).as_posix() for p in _core_modules()}
    assert len(rel) > 40
    assert set(FACADES) <= rel
    assert not any(r.startswith(NOT_CORE) for r in rel)


@pytest.mark.parametrize(
    "path", [pytest.param(p, id=p.relative_to(PACKAGE).as_posix()) for p in _core_modules()]
)
def test_core_module_does_not_import_compat(path):
    rel = path.relative_to(PACKAGE).as_posix()
    found = _compat_imports(ast.parse(path.read_text(encoding="utf-8")))
    if rel in FACADES:
        # the façades may, only inside their module-level __getattr__ (PEP 562)
        assert all(scope == "__getattr__" for _, scope in found), found
    else:
        assert not found, f"{rel} imports {COMPAT} at line(s) {[line for line, _ in found]}"


def test_the_facades_reach_compat_only_lazily():
    for rel in FACADES:
        found = _compat_imports(ast.parse((PACKAGE / rel).read_text(encoding="utf-8")))
        assert found and {scope for _, scope in found} == {"__getattr__"}, rel


def test_the_checker_sees_every_form_of_import():
    source = (
        "import retrain.compat\n"
        "from retrain.compat.contexts import TransformContext\n"
        "from retrain import compat\n"
        "def f():\n"
        "    import importlib\n"
        "    importlib.import_module('retrain.compat.install')\n"
        "def __getattr__(name):\n"
        "    import retrain.compat as c\n"
        "from retrain import registry\n"
    )
    found = _compat_imports(ast.parse(source))
    assert found == [(1, None), (2, None), (3, None), (6, "f"), (8, "__getattr__")]


def _fresh(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=PACKAGE.parent
    )


@pytest.mark.parametrize("module", ["retrain.advantages", "retrain.config", "retrain.registry"])
def test_importing_the_core_does_not_load_compat(module):
    proc = _fresh(
        f"import sys, {module}\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('retrain.compat'))\n"
        "assert not loaded, loaded\n"
    )
    assert proc.returncode == 0, proc.stderr


def test_a_facade_name_installs_compat_once_asked_for():
    proc = _fresh(
        "import sys, retrain.advantages as adv\n"
        "assert 'retrain.compat' not in sys.modules\n"
        "spec = adv.TransformSpec\n"
        "assert 'retrain.compat' in sys.modules\n"
        "from retrain import registry\n"
        "from retrain.config import dialect\n"
        "assert registry.TRANSFORM_MODES.adapters and dialect.current() is not dialect.RETRAIN\n"
        "import retrain.compat\n"
        "retrain.compat.install()  # again: nothing changes\n"
        "assert len(registry.TRANSFORM_MODES.adapters) == 1\n"
    )
    assert proc.returncode == 0, proc.stderr


def test_without_compat_the_originals_keys_are_unknown_keys():
    proc = _fresh(
        "import sys\n"
        "from retrain.config import ConfigError, config_from_dict\n"
        "try:\n"
        "    config_from_dict({'algorithm': {'entropy_mask_rho': 0.2}}, ['--bp-enabled', 'true'])\n"
        "except ConfigError as exc:\n"
        "    print(exc)\n"
        "config = config_from_dict({'algorithm': {'surprisal_mask_rho': 0.2}})\n"
        "assert config.algorithm.surprisal_mask_rho == 0.2\n"
        "assert 'retrain.compat' not in sys.modules\n"
    )
    assert proc.returncode == 0, proc.stderr
    assert "unknown flag --bp-enabled" in proc.stdout
    proc = _fresh(
        "from retrain.config import ConfigError, config_from_dict\n"
        "try:\n"
        "    config_from_dict({'algorithm': {'entropy_mask_rho': 0.2}})\n"
        "except ConfigError as exc:\n"
        "    print(exc)\n"
    )
    assert "[algorithm] entropy_mask_rho: unknown key" in proc.stdout
    assert "did you mean" in proc.stdout


def test_the_root_load_config_reads_the_originals_keys():
    fixture = PACKAGE.parent / "tests/fixtures/original_configs/entropy-mask-yue.toml"
    proc = _fresh(
        "import retrain\n"
        f"config = retrain.load_config({str(fixture)!r})\n"
        "assert config.algorithm.surprisal_mask_rho == 0.2, config.algorithm\n"
    )
    assert proc.returncode == 0, proc.stderr


# ------------------------------------------------------------------ the circles that went


def _imported_modules(rel: str) -> set[str]:
    """Every module `retrain/{rel}` imports, at module level or inside a function."""
    out: set[str] = set()
    for node in ast.walk(ast.parse((PACKAGE / rel).read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


@pytest.mark.parametrize(
    "rel, forbidden",
    [
        # the schema is below the loader and the campaign ([[campaign.conditions]] checks)
        ("config/schema.py", ("retrain.campaign", "retrain.config.load")),
        ("config/conditions.py", ("retrain.campaign", "retrain.config.load")),
        # (the advantages' circle ran through the adapters, now in compat: see above)
        # doctor runs explain's checks; explain does not reach back
        ("cli/explain.py", ("retrain.cli.doctor",)),
        ("cli/estimates.py", ("retrain.cli.doctor", "retrain.cli.explain")),
        # explain's parts (the summaries, the advice, the startup checks) sit below it
        *(
            (f"cli/{part}.py", ("retrain.cli.doctor", "retrain.cli.explain"))
            for part in ("summaries", "advice", "startup_checks")
        ),
    ],
)
def test_a_removed_import_circle_stays_removed(rel, forbidden):
    found = sorted(m for m in _imported_modules(rel) if m.startswith(forbidden))
    assert not found, f"retrain/{rel} imports {found}"
