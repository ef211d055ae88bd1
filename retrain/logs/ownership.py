"""A run never writes into another run's files.

A fresh run refuses a `[logging] log_dir` that holds another run's rows or checkpoint
state, and a `[backend] adapter_path` that holds another run's `checkpoint_step_*/` or
`final/`, before any model loads: appending would mix two runs in one metrics.jsonl (and
the closing summary would read the other run's rows). The choices it offers: resume that
run (`--resume LOGDIR`), a new directory, or `--overwrite`, which moves the old
directory aside to `DIR.old-YYYYmmdd-HHMMSS` and never deletes it. A resumed run writes
into its own log directory and its own adapter directory. Campaigns never get here with
an occupied directory: each campaign starts in a new directory of its own.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from retrain import registry
from retrain.errors import ConfigError, UsageError
from retrain.logs.metrics import EVAL
from retrain.logs.rundir import GENERATIONS, METRICS, TRAINER_STATE, read_json

# Files whose rows belong to one run (empty ones, left by a run that stopped before its
# first step, hold nothing to mix with).
ROW_FILES = (METRICS, EVAL, "emergence/steps.jsonl", str(GENERATIONS))
LOG_DIR, ADAPTER_PATH = ("logging", "log_dir"), ("backend", "adapter_path")


def key_origin(config_path: str | None, flags: Sequence[str] = ()) -> Callable[[str, str], str]:
    """Where a key's value came from, as config errors say it: ` (from --log-dir)`,
    ` (retrain.toml:37)`, or `` for a default."""
    from retrain.config.load import locate_keys, parse_overrides

    _, by_flag, _ = parse_overrides(list(flags))
    lines: dict[tuple[str, str], int] = {}
    if config_path and Path(config_path).is_file():
        lines = locate_keys(Path(config_path).read_text(encoding="utf-8", errors="replace"))

    def origin(table: str, key: str) -> str:
        if (table, key) in by_flag:
            return f" (from {by_flag[(table, key)]})"
        line = lines.get((table, key))
        return f" ({config_path}:{line})" if line else ""

    return origin


@dataclass(frozen=True)
class Launch:
    """How the run was started: what the messages that say what to type next need."""

    command: tuple[str, ...] = ("retrain",)  # starts this run again, without --resume/--overwrite
    overwrite: bool = False
    origin: Callable[[str, str], str] = field(default=lambda table, key: "")

    def line(self, *extra: str) -> str:
        return shlex.join([*self.command, *extra])


def _without(flags: Sequence[str], table: str, key: str) -> list[str]:
    """The flags minus any that set [table] key (with its value): the hints add their own."""
    from retrain.config.flags import flag_table

    names = {n for n, spec in flag_table().items() if (spec.table, spec.key) == (table, key)}
    kept, i = [], 0
    while i < len(flags):
        name, eq, _ = flags[i].partition("=")
        if name in names:
            i += 1 if eq else 2  # `--resume=DIR` or `--resume DIR`
            continue
        kept.append(flags[i])
        i += 1
    return kept


def launch_for(
    config_path: str | None, flags: Sequence[str] = (), *, overwrite: bool = False
) -> Launch:
    """The Launch of `retrain [CONFIG] [FLAGS]`: the command that starts it again (the
    path unless it is ./retrain.toml, the flags but --resume) and where each key was set."""
    from retrain.config import DEFAULT_CONFIG

    path = [config_path] if config_path and config_path != DEFAULT_CONFIG else []
    return Launch(
        command=("retrain", *path, *_without(flags, "resume", "from")),
        overwrite=overwrite,
        origin=key_origin(config_path, flags),
    )


@dataclass(frozen=True)
class Occupied:
    """A directory of this run's config that holds another run's files."""

    table: str
    key: str
    path: Path
    found: tuple[str, ...]  # what is there, e.g. "metrics.jsonl: 3 rows"
    resumable: bool = False  # it holds the trainer_state.json that --resume reads
    finished: bool = False  # ... of a run that finished its max_steps
    writer: Path | None = None  # adapters: the log dir of the run whose checkpoints they are
    state: dict | None = None  # the trainer state of the run in the log dir


def _rows(path: Path) -> int:
    try:
        with open(path, "rb") as fh:
            return sum(1 for line in fh if line.strip())
    except OSError:
        return 0


def log_dir_holds(path: Path) -> tuple[list[str], dict | None]:
    """What of a run the directory holds, and its trainer state (None: not resumable)."""
    found = [f"{name}: {n} rows" for name in ROW_FILES if (n := _rows(path / name))]
    state = read_json(path / TRAINER_STATE)
    if state is not None:
        finished = ", finished" if state.get("finished") is True else ""
        found.append(f"{TRAINER_STATE}: step {state.get('step')}{finished}")
    elif (path / TRAINER_STATE).exists():
        found.append(f"{TRAINER_STATE} (unreadable)")
    return found, state


def _adapter_dir_holds(path: Path) -> list[str]:
    if not path.is_dir():
        return []
    names = sorted(
        p.name
        for p in path.iterdir()
        if p.is_dir() and (p.name == "final" or p.name.startswith("checkpoint_step_"))
    )
    return [f"{name}/" for name in names]


def _same_dir(a: str | Path, b: str | Path) -> bool:
    return Path(a).expanduser().resolve() == Path(b).expanduser().resolve()


def occupied_dirs(config) -> list[Occupied]:
    """The run's directories that hold another run's files (none for a campaign, which
    makes its own; a resumed run's own log and adapter directories are its own)."""
    if config.campaign is not None:
        return []
    resume = config.resume.from_
    out = []
    log_dir, state = Path(config.logging.log_dir), None
    if not (resume and _same_dir(log_dir, resume)):
        found, state = log_dir_holds(log_dir)
        if found:
            finished = state is not None and state.get("finished") is True
            out.append(
                Occupied(*LOG_DIR, log_dir, tuple(found), state is not None, finished, state=state)
            )
    entry = registry.BACKENDS.entry(config.backend.backend)
    writes_adapters = entry is None or "[backend] adapter_path" not in entry.ignores
    if writes_adapters and not resume:
        adapters = Path(config.backend.adapter_path)
        found = _adapter_dir_holds(adapters)
        if found:
            writer = log_dir if _checkpoint_within(state, adapters) else None
            out.append(Occupied(*ADAPTER_PATH, adapters, tuple(found), writer=writer, state=state))
    return out


def _checkpoint_within(state: dict | None, adapters: Path) -> bool:
    """Whether a run's trainer state names a checkpoint inside `adapters` (then --resume
    of that run continues into them)."""
    checkpoint = (state or {}).get("checkpoint")
    saved = checkpoint.get("adapter") if isinstance(checkpoint, dict) else None
    if not isinstance(saved, str) or not saved:
        return False
    # relative to the directory that run started in (recorded since it is)
    saved_path = _workdir(state or {}, Path.cwd()) / Path(saved).expanduser()
    return saved_path.resolve().is_relative_to(adapters.expanduser().resolve())


def _workdir(state: dict, default: Path) -> Path:
    recorded = state.get("workdir")
    return Path(recorded) if isinstance(recorded, str) and recorded else default


def continue_line(state: dict, log_dir: Path, launch: Launch, max_steps: int) -> str:
    """The command that continues the run in `log_dir` (`state`: its trainer state), as the
    other resume hints are built: the command that started it (its state records it;
    else `launch`, this one) with --resume, from the directory it started in. A finished
    run stops again at once, so its --max-steps is raised to `max_steps` (this config's)
    when that is further, else to N; what it will train is said after the command."""
    recorded = state.get("launch")
    if isinstance(recorded, list) and recorded and all(isinstance(w, str) for w in recorded):
        words = recorded
    else:
        words = list(launch.command)
    done, extra, note = state.get("step"), [], ""
    if state.get("finished") is True:
        words = _without(words, "training", "max_steps")
        if isinstance(done, int) and max_steps > done:
            extra = ["--max-steps", str(max_steps)]
            origin = launch.origin("training", "max_steps").strip()[1:-1]  # "(...)"
            if origin and not origin.startswith("from "):
                origin = f"from {origin}"
            note = (
                f" (it finished its {done} steps; this trains steps {done} to {max_steps - 1}: "
                f"--max-steps {max_steps} is this command's max_steps"
                f"{', ' + origin if origin else ''})"
            )
        else:
            extra = ["--max-steps", "N"]
            note = f" (it finished its {done} steps: N above {done} is how far it trains on)"
    here = Path.cwd().resolve()
    workdir = _workdir(state, here).resolve()
    if workdir == here:
        return shlex.join([*words, "--resume", str(log_dir), *extra]) + note
    command = shlex.join([*words, "--resume", typed_in(workdir, log_dir), *extra])
    return f"cd {shlex.quote(str(workdir))} && {command}{note}"


def typed_in(workdir: Path | None, path: Path) -> str:
    """`path` as typed in `workdir`: relative to it when inside it, else absolute (as
    given when `workdir` is unknown)."""
    if workdir is None:
        return str(path)
    full, base = path.resolve(), workdir.resolve()
    return str(full.relative_to(base)) if full.is_relative_to(base) else str(full)


def _problem(occ: Occupied, launch: Launch, max_steps: int) -> str:
    label = f"[{occ.table}] {occ.key}"
    what = "another run's checkpoints" if occ.key == "adapter_path" else "another run"
    choices = []
    if occ.resumable:
        resume = continue_line(occ.state or {}, occ.path, launch, max_steps)
        choices.append(f"continue that run: {resume}")
    elif occ.writer is not None:  # the run in this config's log_dir
        resume = continue_line(occ.state or {}, occ.writer, launch, max_steps)
        choices.append(f"continue the run that wrote them: {resume}")
    elif occ.key == "adapter_path":
        choices.append("resume the run that wrote them (--resume ITS_LOG_DIR)")
    choices.append(f"set a new {label}")
    choices.append(
        f"start over: {launch.line('--overwrite')} (moves {occ.path} aside to "
        f"{occ.path}.old-YYYYmmdd-HHMMSS; nothing is deleted)"
    )
    return (
        f"{label}{launch.origin(occ.table, occ.key)}: {occ.path} holds {what} "
        f"({', '.join(occ.found)}); a run never writes into another run's files. "
        f"Fix: {'; or '.join(choices)}"
    )


def check(config, launch: Launch) -> tuple[list[str], list[str]]:
    """(errors, warnings) for `retrain explain` and `doctor`: each occupied directory is an
    error naming its key, where it was set and the fix; with --overwrite, a warning saying
    where the run will move it."""
    occupied = occupied_dirs(config)
    if not launch.overwrite:
        return [_problem(occ, launch, config.training.max_steps) for occ in occupied], []
    return [], [
        f"[{occ.table}] {occ.key}: {occ.path} holds another run; --overwrite moves it aside "
        f"to {occ.path}.old-YYYYmmdd-HHMMSS at start"
        for occ in occupied
    ]


def aside_path(path: Path, now: datetime) -> Path:
    """`DIR.old-YYYYmmdd-HHMMSS`, with `-2`, `-3`, ... when that exists already."""
    base = path.with_name(f"{path.name}.old-{now:%Y%m%d-%H%M%S}")
    target, n = base, 1
    while target.exists():
        n += 1
        target = base.with_name(f"{base.name}-{n}")
    return target


def _refuse_the_working_directory(occ: Occupied) -> None:
    here = Path.cwd().resolve()
    if here == occ.path.resolve() or occ.path.resolve() in here.parents:
        raise UsageError(
            f"--overwrite: [{occ.table}] {occ.key} = {occ.path} holds the working directory, "
            f"so it cannot be moved aside. Fix: set a new [{occ.table}] {occ.key}"
        )


def move_aside(occ: Occupied, now: datetime) -> Path | None:
    """Rename the directory aside (None when an earlier move took it along)."""
    if not occ.path.exists():
        return None
    target = aside_path(occ.path, now)
    try:
        occ.path.rename(target)
    except OSError as exc:
        raise UsageError(
            f"--overwrite: cannot move {occ.path} aside to {target}: {exc.strerror or exc}"
        ) from exc
    return target


def claim(config, launch: Launch, say: Callable[[str], None]) -> None:
    """Before the run builds anything: refuse directories that hold another run (exit 2,
    every problem at once), or with --overwrite move them aside and say where."""
    occupied = occupied_dirs(config)
    if not occupied:
        return
    if not launch.overwrite:
        raise ConfigError(
            [_problem(occ, launch, config.training.max_steps) for occ in occupied],
            head="another run's files are in the way",
        )
    for occ in occupied:  # all checked before anything moves
        _refuse_the_working_directory(occ)
    now = datetime.now()
    for occ in occupied:
        target = move_aside(occ, now)
        if target is not None:
            say(
                f"--overwrite: moved the previous run's [{occ.table}] {occ.key} {occ.path} "
                f"aside to {target} (nothing deleted)"
            )
