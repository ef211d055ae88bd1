"""`retrain init` in a git work tree offers the .gitignore lines for what retrain writes
there, and appends them only with --gitignore (issue 28). The real CLI as a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def init(cwd: Path, *args: str) -> tuple[int, str, str]:
    python_path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, "-m", "retrain.cli.main", "init", *args],
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": python_path},
        capture_output=True,
        text=True,
        timeout=60,
    )
    return proc.returncode, proc.stdout, proc.stderr


def test_in_a_git_work_tree_init_prints_the_lines_and_edits_nothing(tmp_path):
    (tmp_path / ".git").mkdir()  # what `git init` makes: a work tree's marker
    work = tmp_path / "project"  # a subdirectory of the tree
    work.mkdir()
    code, out, err = init(work)
    assert code == 0, err
    assert "This is a git work tree" in out
    offered = [line.strip() for line in out.splitlines() if line.startswith("  /")]
    assert offered == ["/retrain.toml", "/logs/", "/adapters/"]
    assert "printf '/retrain.toml\\n/logs/\\n/adapters/\\n' >> .gitignore" in out
    assert not (work / ".gitignore").exists()


def test_gitignore_appends_only_the_missing_entries_to_the_users_file(tmp_path):
    (tmp_path / ".gitignore").write_text("__pycache__/\nlogs/")  # no final newline
    code, out, _ = init(tmp_path, "--template", "experiment", "--gitignore")
    assert code == 0 and "Added to .gitignore: /retrain.toml, /adapters/" in out
    assert (tmp_path / ".gitignore").read_text() == (
        "__pycache__/\nlogs/\n/retrain.toml\n/adapters/\n"
    )
    # run again (with --force for the config): nothing is missing, nothing is offered
    code, out, _ = init(tmp_path, "--template", "experiment", "--force")
    assert code == 0 and ".gitignore" not in out


def test_outside_a_git_work_tree_init_says_nothing_about_git(tmp_path):
    code, out, _ = init(tmp_path, "--output", "configs/run.toml")
    assert code == 0 and "git" not in out
    code, out, _ = init(tmp_path, "--output", "configs/run2.toml", "--gitignore")
    assert code == 0
    assert (tmp_path / ".gitignore").read_text() == "/configs/run2.toml\n/logs/\n/adapters/\n"
