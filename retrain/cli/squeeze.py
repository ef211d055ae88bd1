"""`retrain squeeze ADAPTER [options]`, and the standalone `[squeeze]` TOML.

    retrain squeeze adapters/run/final
    retrain squeeze adapters/run/final --target-ranks 4,8,16 --min-variance-retention 0.9
    retrain squeeze adapters/run/final --output adapters/run/r8 --compress-to 8
    retrain squeeze adapters/run/final --json

A TOML with `[squeeze] adapter_path` and no `[campaign]` runs the same analysis
(`retrain squeeze.toml`), compressing when `output_path` is set.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from typing import Any

from retrain.config import Config
from retrain.errors import UsageError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # exit 2 through the CLI's error path, no traceback
        raise UsageError(f"{message} (see retrain squeeze --help)")


def _ranks(text: str) -> list[int]:
    ranks: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:  # `4,,8` is a slip of the hand, not a list of two
            raise argparse.ArgumentTypeError(
                f"{text!r} has an empty entry (use e.g. --target-ranks 4,8,16)"
            )
        try:
            value = int(part)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{part!r} is not an integer (use e.g. --target-ranks 4,8,16)"
            ) from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"ranks must be >= 1, got {value}")
        if value in ranks:
            raise argparse.ArgumentTypeError(f"{text!r} lists {value} twice")
        ranks.append(value)
    return ranks


def _retention(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="retrain squeeze",
        description=(
            "LoRA-Squeeze: how much of each layer's update a smaller LoRA rank keeps "
            "(retained variance V(k) per rank), the smallest rank that keeps enough, and "
            "optionally a compressed copy of the adapter."
        ),
    )
    p.add_argument("adapter", help="PEFT adapter directory (adapter_config.json + weights)")
    p.add_argument(
        "--min-variance-retention",
        type=_retention,
        default=0.95,
        metavar="X",
        help="recommend the smallest rank whose mean V(k) reaches X (default 0.95)",
    )
    p.add_argument(
        "--target-ranks",
        type=_ranks,
        default=None,
        metavar="K,K,...",
        help="ranks to evaluate (default: powers of two up to the adapter's rank)",
    )
    p.add_argument(
        "--source-rank",
        type=_non_negative,
        default=0,
        metavar="R",
        help="expected rank of the adapter; 0 = detect (default)",
    )
    p.add_argument(
        "--output", default="", metavar="DIR", help="write a compressed adapter here (a new dir)"
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="write into a non-empty --output directory (never a run's checkpoint or logs)",
    )
    p.add_argument(
        "--compress-to",
        type=_non_negative,
        default=0,
        metavar="K",
        help="rank of the compressed adapter (default: the recommended rank); needs --output",
    )
    p.add_argument("--device", default="cpu", help="torch device for the SVDs (default cpu)")
    p.add_argument("--json", action="store_true", help="print the result as JSON, no table")
    return p


# How the command line sets each key `config_problems` names.
_FLAGS = {
    "[squeeze] adapter_path": "ADAPTER",
    "[squeeze] target_ranks": "--target-ranks",
    "[squeeze] source_rank": "--source-rank",
    "[squeeze] output_path": "--output",
    "[squeeze] compress_to": "--compress-to",
    "[squeeze] device": "--device",
}


def _squeeze(
    adapter: str,
    *,
    min_variance_retention: float,
    target_ranks: list[int] | None,
    source_rank: int,
    output: str,
    compress_to: int,
    device: str,
    as_json: bool,
    force: bool = False,
    where: Callable[[str], str],
) -> dict[str, Any]:
    from retrain.squeeze import squeeze_from_options

    result = squeeze_from_options(
        adapter_path=adapter,
        min_variance_retention=min_variance_retention,
        target_ranks=target_ranks or None,
        source_rank=source_rank,
        output_path=output or None,
        compress_to=compress_to,
        device=device,
        print_fn=None if as_json else print,
        force=force,
        where=where,
    )
    data = result.as_dict()
    if as_json:
        print(json.dumps(data, indent=2))
    return data


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.compress_to and not args.output:
        raise UsageError("--compress-to needs --output DIR to write the adapter to")
    if args.force and not args.output:
        raise UsageError("--force applies to --output DIR; there is no --output here")
    _squeeze(
        args.adapter,
        min_variance_retention=args.min_variance_retention,
        target_ranks=args.target_ranks,
        source_rank=args.source_rank,
        output=args.output,
        compress_to=args.compress_to,
        device=args.device,
        as_json=args.json,
        force=args.force,
        where=lambda key: _FLAGS.get(key, key),
    )
    return 0


def run_standalone(
    config: Config, config_path: str | None = None, flags: Sequence[str] = ()
) -> int:
    """`retrain squeeze.toml`: a config whose `[squeeze]` table names the adapter. A
    problem names its key with the file and line (or the flag) that set it, when
    `config_path` and `flags` say."""
    from retrain.logs.ownership import key_origin

    sq = config.squeeze
    if sq is None or not sq.adapter_path:
        raise UsageError('a standalone squeeze needs [squeeze] adapter_path = "path/to/adapter"')
    origin = key_origin(config_path, flags)
    _squeeze(
        sq.adapter_path,
        min_variance_retention=sq.min_variance_retention,
        target_ranks=list(sq.target_ranks) or None,
        source_rank=sq.source_rank,
        output=sq.output_path,
        compress_to=sq.compress_to,
        device=sq.device,
        as_json=False,
        where=lambda key: key + origin(*key.strip("[").split("] ")),
    )
    return 0
