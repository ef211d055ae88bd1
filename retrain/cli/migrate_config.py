"""`retrain migrate-config [CONFIG]`: bring a config of the original retrain up to date.

What is rewritten and what is listed is :mod:`retrain.compat.migrate`; this module is the
command. Modes: the default previews (a report and a diff, nothing written); `--check`
exits 1 when anything needs doing; `--write` rewrites the file in place after copying it
to CONFIG.bak; `--stdout` prints the rewritten TOML (the report goes to stderr).
`--json` prints the report as JSON. Exit status: 1 when keys are left for you
(unsupported, in conflict, or unknown to the loader, with its did-you-mean), or with
--check when a rewrite is pending too; 2 for an unreadable config; else 0.
"""

from __future__ import annotations

import argparse
import difflib
import json
import shutil
import sys
import tomllib
from dataclasses import asdict
from pathlib import Path

from retrain.compat.migrate import plan, report, rewrite
from retrain.config.load import DEFAULT_CONFIG, read_toml, unknown_names
from retrain.errors import ConfigError


def _backup(path: Path) -> Path:
    backup = path.with_name(path.name + ".bak")
    n = 1
    while backup.exists():
        backup = path.with_name(f"{path.name}.bak{n}")
        n += 1
    shutil.copy2(path, backup)
    return backup


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="retrain migrate-config",
        description="Rewrite keys of the original retrain that this build spells differently, "
        "and list the keys of its later versions that this build does not support.",
    )
    parser.add_argument("config", nargs="?", default=DEFAULT_CONFIG, help="the TOML file")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="exit 1 when anything needs doing")
    mode.add_argument("--write", action="store_true", help="rewrite in place (backup: CONFIG.bak)")
    mode.add_argument("--stdout", action="store_true", help="print the rewritten TOML")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    return parser


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    path = Path(args.config)
    raw, text = read_toml(path)
    changes, manual = plan(raw, text)
    try:
        new_text = rewrite(text, changes) if changes else text
    except (ValueError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(
            f"{path}: cannot rewrite this file automatically: {exc}", head=""
        ) from None
    backup = None
    if args.write and changes:
        backup = _backup(path)
        path.write_text(new_text, encoding="utf-8")
    if args.stdout:
        sys.stdout.write(new_text)
    lines = report(str(path), changes, manual)
    problems = unknown_names(raw, text, str(path))
    if problems:
        if lines[-1] == f"{path}: nothing to migrate":
            lines.pop()  # nothing to rewrite, but the file does not load either
        lines.append(f"{path}: {len(problems)} unknown key(s) (left as they are):")
        lines += [f"  {p}" for p in problems]
    if backup is not None:
        lines.append(f"wrote {path} (the original is kept as {backup})")
    elif changes and not (args.write or args.stdout or args.check):
        diff = difflib.unified_diff(
            text.splitlines(keepends=True), new_text.splitlines(keepends=True), str(path), str(path)
        )
        lines += ["", "".join(diff).rstrip("\n"), "", "(nothing written; --write applies it)"]
    if args.json:
        payload = {
            "config": str(path),
            "changes": [asdict(c) for c in changes],
            "unsupported": [asdict(m) for m in manual if not m.conflict],
            "conflicts": [asdict(m) for m in manual if m.conflict],
            "unknown": problems,
            "written": backup is not None,
            "backup": str(backup) if backup else None,
        }
        print(json.dumps(payload, indent=2, default=str), file=sys.stderr if args.stdout else None)
    else:
        print("\n".join(lines), file=sys.stderr if args.stdout else sys.stdout)
    return 1 if manual or problems or (args.check and changes) else 0
