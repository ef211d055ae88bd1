"""`retrain init`: write a starter TOML from a bundled template.

In a git work tree (or a directory with a .gitignore) it offers the .gitignore lines for
what retrain writes there (the config, the log and adapter directories) and appends them
with `--gitignore`; it never edits the user's .gitignore otherwise."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from importlib import resources
from pathlib import Path

from retrain.errors import UsageError
from retrain.logs.rundir import cannot_write_in

TEMPLATE_DIR = "config/templates"
# Campaign templates get a file of their own, so a run's retrain.toml beside them stays.
_DEFAULT_OUTPUT = {"campaign": "campaign.toml", "zoo": "zoo.toml"}


def templates() -> dict[str, str]:
    """Template name -> its TOML text, read from the package data."""
    root = resources.files("retrain").joinpath(TEMPLATE_DIR)
    return {
        p.name.removesuffix(".toml"): p.read_text(encoding="utf-8")
        for p in sorted(root.iterdir(), key=lambda p: p.name)
        if p.name.endswith(".toml")
    }


def description(text: str) -> str:
    first = text.splitlines()[0] if text else ""
    return (
        first.removeprefix("# description:").strip() if first.startswith("# description:") else ""
    )


def check_output_file(path: Path, force: bool, flag: str) -> None:
    """Refuse, before any work, a file a command cannot or must not write: a directory,
    an existing file without --force, a path under a file, or a place this user cannot
    write. `flag` names the argument that chose the path."""
    if path.is_dir():
        raise UsageError(f"{flag} {path} is a directory; name a file (e.g. {path / 'out.json'})")
    if path.exists() and not force:
        raise UsageError(
            f"{flag} {path} already exists; pass --force to overwrite it, or {flag} another path"
        )
    if path.exists():
        if not os.access(path, os.W_OK):
            raise UsageError(f"{flag} {path}: cannot write it (permission denied)")
        return
    # the directory it will be created in: the nearest part of the path that exists
    problem = cannot_write_in(path)
    if problem is not None:
        raise UsageError(f"{flag} {path}: {problem}")


def _write(path: Path, text: str, force: bool) -> None:
    check_output_file(path, force, "--output")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    except OSError as exc:  # what the checks above cannot see (a full disk, a race)
        raise UsageError(f"cannot write {path}: {exc.strerror or exc}") from exc


def output_path(given: str | None, default: str) -> Path:
    """Where --output writes: `given`, or `default` in it when it names a directory
    (an existing one, or any path ending in a slash), as `cp` does; `default` alone
    when it is not given."""
    if not given:
        return Path(default)
    if given.endswith(("/", os.sep)) or Path(given).is_dir():
        return Path(given) / default
    return Path(given)


def in_git_tree(here: Path) -> bool:
    """Whether `here` is inside a git work tree (a .git directory or file above it)."""
    return any((d / ".git").exists() for d in (here, *here.parents))


def _top_dir(path: str) -> str | None:
    """`/logs/` for `logs/quickstart`: the directory of this one that a path lives in
    (None when it is absolute or outside: not this tree's business)."""
    parts = Path(path).parts
    if Path(path).is_absolute() or not parts or parts[0] in ("..", "~"):
        return None
    return f"/{parts[0]}/"


def ignore_entries(out: Path, text: str) -> list[str]:
    """.gitignore lines (anchored to this directory) for the config written to `out` and
    the log and adapter directories it names, in the order they are written."""
    import tomllib

    from retrain.config import config_from_dict

    config = config_from_dict(tomllib.loads(text))
    entries = []
    with contextlib.suppress(ValueError):  # written outside this directory: not ours
        entries.append("/" + out.resolve().relative_to(Path.cwd().resolve()).as_posix())
    for path in (config.logging.log_dir, config.backend.adapter_path):
        top = _top_dir(path)
        if top and top not in entries:
            entries.append(top)
    return entries


def _missing_ignores(entries: list[str], gitignore: Path) -> list[str]:
    """The entries a .gitignore lacks (`/logs/`, `logs/` and `logs` count as the same)."""
    have = set()
    if gitignore.is_file():
        for line in gitignore.read_text(encoding="utf-8", errors="replace").splitlines():
            have.add(line.strip().strip("/"))
    return [e for e in entries if e.strip("/") not in have]


def offer_gitignore(out: Path, text: str, write: bool) -> None:
    """In a git work tree or beside a .gitignore: append the missing entries with
    --gitignore, else print them and the flag that appends them."""
    gitignore = Path(".gitignore")
    if not write and not (gitignore.is_file() or in_git_tree(Path.cwd())):
        return
    missing = _missing_ignores(ignore_entries(out, text), gitignore)
    if not missing:
        return
    if not write:
        import shlex

        lines = "".join(f"{line}\\n" for line in missing)
        print(
            f"This is a git work tree: to keep what retrain writes out of `git status`, add "
            f"these lines to {gitignore} (leave out the config to keep it under version control):"
        )
        print("\n".join(f"  {line}" for line in missing))
        print(
            f"  e.g. printf {shlex.quote(lines)} >> {gitignore}  (`retrain init --gitignore` appends them)"
        )
        return
    old = gitignore.read_text(encoding="utf-8") if gitignore.is_file() else ""
    gap = "" if not old or old.endswith("\n") else "\n"
    gitignore.write_text(old + gap + "\n".join(missing) + "\n", encoding="utf-8")
    print(f"Added to {gitignore}: {', '.join(missing)}")


def _check_gitignore(gitignore: Path) -> None:
    """--gitignore appends to `gitignore`: refuse, before the config is written, one that
    cannot be appended to."""
    if gitignore.exists() and not gitignore.is_file():
        raise UsageError(f"--gitignore: {gitignore} is not a file, so nothing can be added to it")
    where = gitignore if gitignore.exists() else gitignore.absolute().parent
    if not os.access(where, os.W_OK):
        raise UsageError(f"--gitignore: cannot write {gitignore} (permission denied)")


def _ask(prompt: str, default: str, choices: tuple[str, ...] = ()) -> str:
    hint = f" [{'/'.join(choices)}]" if choices else ""
    while True:
        answer = input(f"{prompt}{hint} (default: {default}): ").strip() or default
        if not choices or answer in choices:
            return answer
        print(f"  please answer one of: {', '.join(choices)}")


def _interactive() -> str:
    """Ask for model, algorithm, steps and backend; returns TOML text."""
    from retrain.config import config_from_dict
    from retrain.config.toml_writer import set_keys

    model = _ask("Model (hub id, local dir or .gguf)", "HuggingFaceTB/SmolLM2-135M-Instruct")
    condition = _ask(
        "Algorithm",
        "maxrl+gtpo_sepa",
        ("grpo+none", "maxrl+none", "maxrl+gtpo", "maxrl+gtpo_hicra", "maxrl+gtpo_sepa"),
    )
    while True:
        steps = _ask("Training steps", "100")
        if steps.isdigit() and int(steps) > 0:
            break
        print("  please answer a positive integer")
    backend = _ask("Backend", "local", ("local", "tinker"))
    adv, transform = condition.split("+")
    # The whole template, comments and all, with the answers set in it: a config that runs
    # as written (the quickstart's CPU settings for SmolLM2, the experiment's otherwise),
    # whose logs and adapters are named after the condition, not the template's run.
    base = templates()["quickstart"] if "SmolLM2" in model else templates()["experiment"]
    name = f"{adv}_{transform}"
    text = set_keys(
        base,
        {
            ("backend", "backend"): backend,
            ("backend", "adapter_path"): f"adapters/{name}",
            ("model", "model"): model,
            ("algorithm", "advantage_mode"): adv,
            ("algorithm", "transform_mode"): transform,
            ("training", "max_steps"): int(steps),
            ("logging", "log_dir"): f"logs/{name}",
        },
    )
    text = "# written by `retrain init --interactive`\n" + text
    import tomllib

    config_from_dict(tomllib.loads(text))  # validate before writing
    return text


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="retrain init", description="Write a starter retrain TOML."
    )
    parser.add_argument(
        "--template",
        "-t",
        default=None,
        help="quickstart | experiment | campaign | multiturn | zoo (see --list)",
    )
    parser.add_argument(
        "--output",
        "-o",
        default=None,
        help="where to write (default ./retrain.toml; ./campaign.toml and ./zoo.toml for the campaign and zoo templates); a directory (or a path ending in /) gets that name inside it",
    )
    parser.add_argument("--force", action="store_true", help="overwrite an existing file")
    parser.add_argument(
        "--gitignore",
        action="store_true",
        help="append the config, logs/ and adapters/ entries to ./.gitignore (created if absent)",
    )
    parser.add_argument("--list", action="store_true", help="list the templates")
    parser.add_argument(
        "--interactive", "-i", action="store_true", help="ask a few questions (needs a terminal)"
    )
    args = parser.parse_args(argv)

    if args.gitignore:
        _check_gitignore(Path(".gitignore"))
    available = templates()
    if args.list:
        width = max(map(len, available))
        for name, text in available.items():
            print(f"{name.ljust(width)}  {description(text)}")
        return 0
    if args.interactive:
        if not sys.stdin.isatty():
            print(
                "retrain init --interactive needs a terminal (stdin is not a TTY); use --template NAME instead",
                file=sys.stderr,
            )
            return 2
        text = _interactive()
        out = output_path(args.output, "retrain.toml")
        _write(out, text, args.force)
        print(f"Wrote {out}. Next: retrain explain {out} && retrain {out}")
        offer_gitignore(out, text, args.gitignore)
        return 0
    name = args.template or "quickstart"
    if name not in available:
        from retrain.registry import suggest

        raise UsageError(
            f"unknown template {name!r}{suggest(name, available)}; available: {', '.join(available)}"
        )
    out = output_path(args.output, _DEFAULT_OUTPUT.get(name, "retrain.toml"))
    _write(out, available[name], args.force)
    run_hint = (
        f"retrain {out}" if out.name != "retrain.toml" or out.parent != Path(".") else "retrain"
    )
    print(f"Wrote {out} (template {name!r}). Next: retrain explain {out} && {run_hint}")
    offer_gitignore(out, available[name], args.gitignore)
    return 0
