"""A benchmark script (benchmarks/NAME.py) imported by the tests as a module, loaded by
its path: putting benchmarks/ on sys.path would let its sampling.py, step.py, engines.py
... shadow other top-level names for the rest of the session."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
