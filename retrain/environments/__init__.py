"""Verifiers environments that ship with retrain, found by their short id
(`[environment] id = "guess-number"`) after the user's own `[plugins] search_paths` and
installed packages. They are ordinary verifiers (v1) tasksets: each module exports its
Taskset (and, when it talks back, its Env) in `__all__`.

- guess_number: a multi-turn game (the model guesses, the environment says higher or
  lower); the `multiturn` template trains on it.
"""

from __future__ import annotations

from pathlib import Path

ENVIRONMENTS_DIR = Path(__file__).resolve().parent
