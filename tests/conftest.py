"""Setup for the whole suite.

Some images set PYTHONDONTWRITEBYTECODE (this one and CI's do), which makes every Python
process the tests start (the CLI runs, torchrun's ranks, the re-runs under other venvs)
compile retrain's modules again: ~0.3 s of ~1 s of retrain imports, in a hundred-odd
processes. The suite lets them write and read the bytecode caches (git ignores
__pycache__), which changes nothing they do."""

from __future__ import annotations

import os
import sys

os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False
