"""`retrain` entry point: dispatch to a command module, print errors without tracebacks."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

from retrain import __version__
from retrain.errors import RetrainError

# command -> (module:function, one-line description). Modules are imported on use, so
# `retrain --help` never imports torch.
COMMANDS: dict[str, tuple[str, str]] = {
    "explain": ("retrain.cli.explain:main", "dry run: what a config would do (no torch)"),
    "init": ("retrain.cli.init:main", "write a starter TOML from a template"),
    "status": ("retrain.cli.status:main", "summarise runs and campaigns under a log dir"),
    "compare": ("retrain.cli.compare:main", "compare conditions across seeds with CIs and plots"),
    "squeeze": ("retrain.cli.squeeze:main", "LoRA-Squeeze: analyse/compress an adapter's rank"),
    "eval": (
        "retrain.cli.eval:main",
        "evaluate a saved adapter (or 'base') on the held-out set",
    ),
    "man": ("retrain.cli.man:main", "the bundled manual"),
    "doctor": ("retrain.cli.doctor:main", "check the installation and environment"),
    "backends": ("retrain.cli.backends:main", "backends, capabilities and options"),
    "plugins": ("retrain.cli.plugins:main", "built-in and discovered plugins"),
    "init-plugin": ("retrain.cli.init_plugin:main", "scaffold a plugin (+ test)"),
    "migrate-config": (
        "retrain.cli.migrate_config:main",
        "update a config of the original retrain (renamed and unsupported keys)",
    ),
}

USAGE = """\
usage: retrain [CONFIG] [--flag value ...] [--overwrite]   train (default: ./retrain.toml)
       retrain COMMAND [options]

retrain: TOML-first reinforcement learning with verifiable rewards for LLMs.
A TOML with a [campaign] table runs conditions x seeds; one with only
[squeeze] adapter_path runs LoRA-Squeeze.

commands:
{commands}

Every config key can be overridden: --{{table}}-{{key}} VALUE (e.g. --training-lr 1e-4),
or the short form --{{key}} when it is unambiguous (e.g. --lr 1e-4, --seed 42,
--resume LOGDIR); the original retrain's flag names work too (--bp-enabled true,
--optim-beta1 0.9, --backend-opt KEY=VALUE). Without ./retrain.toml, flags alone run
on the built-in defaults. `retrain --help-flags` lists them all. CONFIG may stand
anywhere among the flags.

A run never writes into a [logging] log_dir or [backend] adapter_path that holds another
run: resume that run (--resume LOGDIR), set new directories, or pass --overwrite, which
moves the old ones aside to DIR.old-YYYYmmdd-HHMMSS (nothing is deleted).

  retrain init --template quickstart && retrain     a first run on CPU
  retrain explain                                   what the config would do
  retrain --version
"""


def usage() -> str:
    width = max(len(c) for c in COMMANDS)
    return USAGE.format(
        commands="\n".join(f"  {name.ljust(width)}  {desc}" for name, (_, desc) in COMMANDS.items())
    )


def flags_help() -> str:
    from retrain.config import dialect
    from retrain.config.load import iter_flag_help

    lines = ["Config flags (defaults < TOML < flags); values are checked like TOML values:", ""]
    current = None
    for names, spec in iter_flag_help():
        if spec.table != current:
            current = spec.table
            lines.append(f"[{current}]")
        default = repr(spec.default) if spec.type == "str" else str(spec.default)
        lines.append(f"  {names}  ({spec.type}, default {default})")
        lines.append(f"      {spec.help}")
    lines += ["", "Repeatable KEY=VALUE flags (VALUE read like a TOML value):"]
    for flag, (table, key) in dialect.current().param_flags.items():
        lines.append(f"  {flag} KEY=VALUE  adds KEY to [{table}.{key}]")
    return "\n".join(lines)


def _call(target: str, argv: list[str]) -> int:
    module, _, func = target.partition(":")
    return int(getattr(importlib.import_module(module), func)(argv) or 0)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        if args and args[0] in ("-h", "--help", "help"):
            print(usage())
            return 0
        if args and args[0] in ("-V", "--version"):
            print(f"retrain {__version__}")
            return 0
        # The original retrain's configs, flags and plugins, for every command and run
        # (campaign workers start here too); after the two answers above, which stay instant.
        import retrain.compat  # noqa: F401

        if args and args[0] == "--help-flags":
            print(flags_help())
            return 0
        if args and args[0] in COMMANDS:
            return _call(COMMANDS[args[0]][0], args[1:])
        return _call("retrain.cli.run:main", args)
    except RetrainError as exc:
        print(f"retrain: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("retrain: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `retrain man | head`: the reader left; not an error
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as exc:
        # Last resort for a file the commands did not check first (unreadable, vanished,
        # a full disk): the file and the reason are the user's to fix, not a traceback.
        # Only OSError: any other exception is a bug and keeps its traceback.
        where = exc.filename if exc.filename is not None else ""
        print(
            f"retrain: error: {f'{where}: ' if where else ''}{exc.strerror or exc}", file=sys.stderr
        )
        return 2


if __name__ == "__main__":
    sys.exit(main())
