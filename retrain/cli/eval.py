"""`retrain eval ADAPTER [--config retrain.toml] [--out FILE] [--json] [--flags]`: evaluate a
saved adapter, or the base model (`retrain eval base`), on the config's held-out set.

    retrain eval adapters/quickstart/final
    retrain eval base --size 200 --out base.json
    retrain eval adapters/run/checkpoint_step_20 --config run.toml --eval-temperature 0.7 --samples 4

The held-out set, sampling and scoring are exactly those of `[eval]` during training
(`retrain man --topic eval`); nothing is trained. Other `--flags` override config keys
as they do for `retrain`. The result has the eval.jsonl fields (eval_correct_rate,
eval_mean_reward, eval_pass_at_k, ...) plus the adapter and config.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
from pathlib import Path
from typing import Any

from retrain.cli.init import check_output_file
from retrain.cli.run import quiet_libraries
from retrain.config import DEFAULT_CONFIG, load_config, load_dotenv
from retrain.errors import RetrainError, UsageError
from retrain.logs.rundir import run_dir_holding
from retrain.squeeze import SAFETENSORS_NAME, saved_adapters_in

BASE = "base"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # exit 2 through the CLI's error path, no traceback
        raise UsageError(f"{message} (see retrain eval --help)")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="retrain eval",
        description=(
            "Evaluate a saved LoRA adapter (or the base model: ADAPTER = base) on the config's "
            "held-out set ([eval]): held-out correct rate, mean reward and pass@k. Config "
            "keys can be overridden with --{table}-{key} VALUE flags."
        ),
    )
    p.add_argument("adapter", metavar="ADAPTER", help="adapter directory (PEFT), or 'base'")
    p.add_argument("--config", default=DEFAULT_CONFIG, help="the run's TOML (default retrain.toml)")
    p.add_argument("--out", default="", metavar="FILE", help="also write the result as JSON here")
    p.add_argument("--force", action="store_true", help="overwrite an existing --out file")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--size", type=int, default=None, help="held-out problems ([eval] size)")
    p.add_argument("--samples", type=int, default=None, help="completions per problem (k)")
    p.add_argument("--temperature", type=float, default=None, help="0 = greedy")
    return p


def _adapter_overrides(adapter: str, flags: list[str]) -> list[str]:
    """A local PEFT adapter's rank and alpha, as config flags, so the model is built
    with the LoRA layers the adapter holds; a flag of the user's that sets either to
    another value is refused (the adapter's shape is not a choice)."""
    from retrain.config.load import parse_overrides

    config_file = Path(adapter) / "adapter_config.json"
    try:
        data = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    given, origins, _ = parse_overrides(flags)  # its problems are the loader's to report
    out = []
    for table, key, field, flag in (
        ("model", "lora_rank", "r", "--model-lora-rank"),
        ("lora", "alpha", "lora_alpha", "--lora-alpha"),
    ):
        value = data.get(field)
        if not isinstance(value, int):
            continue
        if key not in given.get(table, {}):
            out += [flag, str(value)]
        elif given[table][key] != value:
            raise UsageError(
                f"{origins[(table, key)]} {given[table][key]} contradicts the adapter's "
                f"{field} = {value} ({config_file}): the model is built with the adapter's "
                "LoRA layers. Fix: drop the flag"
            )
    return out


def _check_saved_adapter(path: Path, rest: list[str]) -> None:
    """A local ADAPTER is a directory with a saved adapter's weights, checked before any
    model loads; a run's adapter_path (which holds its checkpoints) names them, and the
    command (with the other arguments, `rest`) that evaluates the newest."""
    if not path.is_dir():
        raise UsageError(
            f"adapter {str(path)!r} is not a directory (pass a saved adapter such as "
            "adapters/quickstart/final, or 'base' for the base model)"
        )
    if (path / SAFETENSORS_NAME).is_file():
        return
    saved = saved_adapters_in(path)
    inside = (
        f"; it holds the saved adapters {', '.join(str(d) for d in saved[:4])}"
        f"{', ...' if len(saved) > 4 else ''}. Fix: "
        f"{shlex.join(['retrain', 'eval', str(saved[0]), *rest])}"
        if saved
        else " (a run saves one at [backend] adapter_path/final and each checkpoint_step_N)"
    )
    raise UsageError(f"adapter {str(path)!r} holds no {SAFETENSORS_NAME}{inside}")


def _check_out(out: Path, force: bool) -> None:
    """--out is checked before any model loads (an evaluation takes minutes); it never
    names a file of a run's log directory, whose rows the run (and status, compare)
    read back."""
    run = run_dir_holding(out)
    if run is not None:
        raise UsageError(
            f"--out {out} is inside the log directory of a run ({run}); a command never "
            "writes into a run's files. Fix: --out another path, e.g. --out eval.json"
        )
    check_output_file(out, force, "--out")


def _step_of(adapter: str) -> int | None:
    if adapter == BASE:
        return 0
    match = re.search(r"checkpoint_step_(\d+)$", adapter.rstrip("/"))
    return int(match.group(1)) if match else None


def evaluate_adapter(adapter: str, config, say=print) -> dict[str, Any]:
    """Build the run's components (no training), load `adapter` unless it is `base`,
    evaluate on the held-out set; the result row."""
    from retrain.evaluate import build_evaluator, prepare_held_out
    from retrain.logs.console import eval_line
    from retrain.logs.metrics import eval_row
    from retrain.startup import checked_build
    from retrain.types import CheckpointInfo

    parts = checked_build(config, say)
    try:
        evaluator = parts.evaluator or build_evaluator(
            config, parts.rollout, prepare_held_out(config, parts.data, parts.renderer, say)
        )
        if adapter != BASE:
            say(f"Loading adapter {adapter} ...")
            parts.backend.load_checkpoint(
                CheckpointInfo(config.backend.backend, adapter=adapter, state=adapter)
            )
        step = _step_of(adapter)
        result = evaluator(step if step is not None else -1)
        say(eval_line(step, config.condition, result))
    finally:
        parts.close(say)
    row = eval_row(result, config.condition)
    row.pop("kind")
    row["step"] = row["eval_step"] = step  # None: not known from the adapter's name
    return {"adapter": adapter, "model": config.model.model, **row}


def main(argv: list[str]) -> int:
    args, flags = build_parser().parse_known_args(argv)
    adapter = args.adapter
    if adapter != BASE and "://" not in adapter:
        rest = list(argv)
        rest.remove(adapter)
        _check_saved_adapter(Path(adapter), rest)
    if args.out:
        _check_out(Path(args.out), args.force)
    elif args.force:
        raise UsageError("--force applies to --out FILE; there is no --out here")
    for name, value in (
        ("size", args.size),
        ("samples", args.samples),
        ("temperature", args.temperature),
    ):
        if value is not None:
            flags += [f"--eval-{name}", str(value)]
    if load_dotenv():
        print("Loaded .env")
    overrides = [] if adapter == BASE else _adapter_overrides(adapter, flags)
    config = load_config(args.config, overrides + flags)
    quiet_libraries()
    quiet = args.json
    data = evaluate_adapter(adapter, config, say=(lambda _t: None) if quiet else print)
    data["config"] = args.config
    if args.out:
        out = Path(args.out)
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
        except OSError as exc:
            raise RetrainError(f"cannot write {out}: {exc.strerror or exc}") from exc
    if args.json:
        print(json.dumps(data, indent=2))
    elif args.out:
        print(f"Wrote {args.out}")
    return 0
