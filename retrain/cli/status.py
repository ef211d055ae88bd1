"""`retrain status [LOGDIR] [--json] [--stale-after S] [--watch [--interval S] [--count N]]`:
every run and campaign under a log directory (default `logs`): steps, correct rates,
reward, step time, ETA and state (a run killed without a word reads `dead` or `stale`, with
its last step and the command that resumes it); campaigns grouped by condition with the
mean +- std of the final correct rate. `--watch` redraws the report every few seconds until
Ctrl-C or `--count` refreshes."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from retrain.errors import UsageError
from retrain.logs.rundir import is_run_dir

DEFAULT_WATCH_S = 5.0
CLEAR = "\x1b[H\x1b[2J"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        raise UsageError(f"{message} (see retrain status --help)")


def build_parser() -> argparse.ArgumentParser:
    from retrain.logs.status import legend

    p = _Parser(
        prog="retrain status",
        description="Summarise the runs and campaigns under a log directory.",
        epilog="\n".join(legend()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
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
    p.add_argument(
        "--watch",
        action="store_true",
        help="redraw the report every --interval seconds until Ctrl-C "
        "(with --json: one JSON report per line)",
    )
    p.add_argument(
        "--interval",
        type=float,
        default=DEFAULT_WATCH_S,
        metavar="SECONDS",
        help=f"with --watch: seconds between reports (default {DEFAULT_WATCH_S:g})",
    )
    p.add_argument(
        "--count",
        type=int,
        default=None,
        metavar="N",
        help="with --watch: stop after N reports",
    )
    return p


def _report_text(root: Path, stale_after: float | None, as_json: bool) -> str:
    from retrain.logs.status import collect, render

    report = collect(root, stale_after=stale_after)
    if as_json:
        return json.dumps(report.as_dict())
    return render(report)


def watch(
    root: Path,
    *,
    interval: float,
    count: int | None,
    stale_after: float | None = None,
    as_json: bool = False,
    write: Callable[[str], None] | None = None,
    sleep: Callable[[float], None] = time.sleep,
    clear: bool | None = None,
) -> int:
    """Print the report every `interval` seconds, `count` times (None: until Ctrl-C).
    Ctrl-C ends the loop quietly with exit status 0."""
    write = write or (lambda text: (sys.stdout.write(text), sys.stdout.flush()))
    if clear is None:
        clear = not as_json and sys.stdout.isatty()
    shown = 0
    try:
        while count is None or shown < count:
            text = _report_text(root, stale_after, as_json)
            stamp = time.strftime("%H:%M:%S")
            if as_json:
                write(text + "\n")
            else:
                head = CLEAR if clear else ("\n" if shown else "")
                write(
                    f"{head}retrain status {root} at {stamp} (every {interval:g}s, Ctrl-C stops)\n"
                )
                write(text + "\n")
            shown += 1
            if count is not None and shown >= count:
                break
            sleep(interval)
    except KeyboardInterrupt:
        write("\n")
    return 0


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    root = Path(args.logdir)
    if not root.exists():
        raise UsageError(
            f"{root} does not exist (pass the log directory, e.g. retrain status logs)"
        )
    if not root.is_dir():
        fix = (
            f"retrain status {root.parent}, the run it belongs to"
            if is_run_dir(root.parent)
            else "retrain status logs"
        )
        raise UsageError(f"{root} is a file, not a directory (pass a log directory, e.g. {fix})")
    try:  # an unreadable directory would read as one holding no runs
        with os.scandir(root) as entries:
            next(entries, None)
    except OSError as exc:
        raise UsageError(f"cannot read {root}: {exc.strerror or exc}") from exc
    if args.stale_after is not None and args.stale_after <= 0:
        raise UsageError("--stale-after must be > 0 seconds")
    if args.interval <= 0:
        raise UsageError("--interval must be > 0 seconds")
    if args.count is not None and args.count < 1:
        raise UsageError("--count must be >= 1")
    if args.count is not None and not args.watch:
        raise UsageError("--count needs --watch")
    if args.watch:
        return watch(
            root,
            interval=args.interval,
            count=args.count,
            stale_after=args.stale_after,
            as_json=args.json,
        )
    text = _report_text(root, args.stale_after, args.json)
    if args.json:  # indented when printed once
        text = json.dumps(json.loads(text), indent=2)
    print(text)
    return 0
