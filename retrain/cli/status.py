"""`retrain status [LOGDIR] [--json] [--stale-after SECONDS]`: every run and campaign
under a log directory (default `logs`): steps, correct rates, reward, step time, ETA and
state; campaigns grouped by condition with the mean +- std of the final correct rate."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from retrain.errors import UsageError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        raise UsageError(f"{message} (see retrain status --help)")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="retrain status",
        description="Summarise the runs and campaigns under a log directory.",
    )
    p.add_argument("logdir", nargs="?", default="logs", help="directory to scan (default: logs)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument(
        "--stale-after",
        type=float,
        default=None,
        metavar="SECONDS",
        help="a running run whose heartbeat is older than this is stale "
        "(default: 3 x its median step time, at least 300)",
    )
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    root = Path(args.logdir)
    if not root.exists():
        raise UsageError(
            f"{root} does not exist (pass the log directory, e.g. retrain status logs)"
        )
    if args.stale_after is not None and args.stale_after <= 0:
        raise UsageError("--stale-after must be > 0 seconds")
    from retrain.logs.status import collect, render

    report = collect(root, stale_after=args.stale_after)
    if args.json:
        print(json.dumps(report.as_dict(), indent=2))
    else:
        print(render(report))
    return 0
