"""Every distinct settings set of the map (retrain/algorithms.py) trains: one step of the
real local backend on the tiny random model per set, logging a finite loss."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
from test_loss_options_run import run

from retrain import algorithms as A
from retrain.config import config_from_dict


def _distinct() -> dict[str, A.Algorithm]:
    """One row per distinct settings set (rows of several peers often share one)."""
    out: dict[str, A.Algorithm] = {}
    for row in A.ALGORITHMS:
        if row.reproduced:
            out.setdefault(json.dumps(row.toml(), sort_keys=True), row)
    return {f"{row.peer}:{row.name}": row for row in out.values()}


SETS = _distinct()


def _raw(tiny_raw: dict, tmp_path: Path, row: A.Algorithm) -> dict:
    raw = copy.deepcopy(tiny_raw)
    tables = row.toml()
    raw["algorithm"].update(tables.get("algorithm", {}))
    tiny_tokens = raw["training"].get("max_tokens")
    raw["training"].update(tables.get("training", {}), max_steps=1, save_every=0)
    if "overlong_buffer" in raw["training"]:  # DAPO's lengths: scaled to the tiny budget
        raw["training"]["max_tokens"] = tiny_tokens
        raw["training"]["overlong_buffer"] = 2
    raw["logging"]["log_dir"] = str(tmp_path / "logs")
    raw["backend"]["adapter_path"] = str(tmp_path / "adapter")
    return raw


@pytest.mark.parametrize("key", list(SETS))
def test_one_step_per_settings_set(tiny_raw, tmp_path, key):
    row = SETS[key]
    raw = _raw(tiny_raw, tmp_path, row)
    config_from_dict(raw)  # every reproduced row's settings load
    code, rows = run(raw)
    assert code == 0 and [r["step"] for r in rows] == [0]
    assert math.isfinite(rows[0]["loss"])
