"""Tests that need packages the project's environment cannot hold (verifiers 0.3's
classic API, openenv) re-run under another interpreter that has them: the test file runs
there once (one process per file and marker, not one per test: each start imports those
packages for seconds) and each test asserts its own outcome from that run."""

from __future__ import annotations

import functools
import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def assert_passed_under(python: str, test_file: str, test_name: str, marker: str = "") -> None:
    """The tests of `test_file` whose names contain `test_name` passed under `python`
    (not skipped: a skipped test is not listed as passed)."""
    outcomes, output = _file_outcomes(python, str(test_file), marker)
    mine = {node: status for node, status in outcomes.items() if test_name in node.split("::")[-1]}
    assert mine and set(mine.values()) == {"PASSED"}, (
        f"{test_name} under {python} ({mine or 'not run: skipped or not collected'}):\n{output}"
    )


def run_pytest(python: str, test_file: str, marker: str = "") -> subprocess.CompletedProcess:
    """`pytest -rA test_file` under `python`, with this checkout of retrain on its path;
    `marker`: its -m where not the default one (which deselects a slow test)."""
    exe = Path(python)
    exe = exe if exe.is_absolute() else Path.cwd() / exe
    return subprocess.run(
        [
            *(str(exe), "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider"),
            *(("-m", marker) if marker else ()),
            test_file,
        ],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=3000,
    )


@functools.cache
def _file_outcomes(python: str, test_file: str, marker: str) -> tuple[dict[str, str], str]:
    """node id -> PASSED / FAILED / ERROR from pytest's -rA summary, and the output's tail
    for a failure message. Tests of the file that need the project's own packages may
    fail there; only the outcomes asked for are read."""
    proc = run_pytest(python, test_file, marker)
    outcomes = {}
    for line in proc.stdout.splitlines():
        status, _, rest = line.partition(" ")
        if status in ("PASSED", "FAILED", "ERROR") and "::" in rest:
            outcomes[rest.split(" - ")[0].strip()] = status
    return outcomes, proc.stdout[-3000:] + proc.stderr[-2000:]
