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

import os
import shlex
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from retrain import registry
from retrain.errors import ConfigError, UsageError
from retrain.logs.metrics import EVAL
from retrain.logs.rundir import GENERATIONS, METRICS, RUN_INFO, TRAINER_STATE, as_int, read_json

# Files whose rows belong to one run (empty ones, left by a run that stopped before its
# first step, hold nothing to mix with).
ROW_FILES = (METRICS, EVAL, "emergence/steps.jsonl", str(GENERATIONS))
LOG_DIR, ADAPTER_PATH = ("logging", "log_dir"), ("backend", "adapter_path")
# A heartbeat younger than this says a run on another host is alive (its pid cannot be
# asked); `retrain status` calls an older one stale.
MIN_STALE_S = 300.0


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
    if writes_adapters(config) and not resume:
        adapters = Path(config.backend.adapter_path)
        found = _adapter_dir_holds(adapters)
        if found:
            writer = log_dir if _checkpoint_within(state, adapters) else None
            out.append(Occupied(*ADAPTER_PATH, adapters, tuple(found), writer=writer, state=state))
    return out


def writes_adapters(config) -> bool:
    """Whether the run writes checkpoints into `[backend] adapter_path` (a service backend
    keeps them on its service; a plugin backend is taken to write them)."""
    entry = registry.BACKENDS.entry(config.backend.backend)
    return entry is None or "[backend] adapter_path" not in entry.ignores


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


def process_alive(pid: int) -> bool:
    """Whether a process with this id exists on this host (one owned by another user
    counts as alive)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return False
    return True


# /proc's start time counts clock ticks from a boot time in whole seconds
PID_CLOCK_SLACK_S = 2.0


def process_start(pid: int) -> float | None:
    """When the process `pid` of this host started (epoch seconds), from Linux's /proc;
    None elsewhere or when it cannot be read."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        boot = next(
            int(line.split()[1])
            for line in Path("/proc/stat").read_text().splitlines()
            if line.startswith("btime ")
        )
        ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22, counted after the name
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def run_process_alive(pid: int, started_at: object) -> bool:
    """Whether the process of a run of this host that started at `started_at` (run.json's)
    still lives. A run killed without a word (OOM, SIGKILL) leaves "running" behind, and
    its pid may since be another process's: one born after the run started is not it (a
    container reuses pids)."""
    if not process_alive(pid):
        return False
    born = process_start(pid)
    if born is None or not isinstance(started_at, int | float):
        return True
    return born <= started_at + PID_CLOCK_SLACK_S


def live_run(log_dir: Path) -> str | None:
    """ "running as pid N" when run.json in `log_dir` says its run is running and that run
    lives: on this host its pid exists; on another its heartbeat is fresh. None else
    (no run, a finished one, one killed without a word)."""
    info = read_json(log_dir / RUN_INFO) or {}
    pid, host = as_int(info.get("pid")), info.get("host")
    if info.get("status") != "running" or pid is None:
        return None
    if host == socket.gethostname():
        # this process's own earlier run (started from the library) is over by now
        alive = pid != os.getpid() and run_process_alive(pid, info.get("started_at"))
        return f"running as pid {pid}" if alive else None
    beat = info.get("heartbeat")
    age = time.time() - beat if isinstance(beat, int | float) else None
    if age is None or age > MIN_STALE_S:
        return None
    return f"running as pid {pid} on {host} (heartbeat {age:.0f} s ago)"


def live_problems(config, launch: Launch) -> list[str]:
    """The directory this run would write into, or the run it resumes, held by a run that
    is still running: --overwrite would move its files away while it writes on, and a
    resume would write beside it. Refused whatever the flags."""
    if config.campaign is not None:
        return []  # a campaign makes its own directories and resumes its own runs
    targets = {Path(config.logging.log_dir).expanduser().resolve(): LOG_DIR}
    if config.resume.from_:
        targets[Path(config.resume.from_).expanduser().resolve()] = ("resume", "from")
    problems = []
    for path, (table, key) in targets.items():
        live = live_run(path)
        if live:
            fix = "then resume it" if table == "resume" else "or set a new [logging] log_dir"
            problems.append(
                f"[{table}] {key}{launch.origin(table, key)}: the run in {path} is {live}; "
                "stop it first (or wait for it to finish): a run never writes into a live "
                f"run's files. Fix: stop that run, {fix}"
            )
    return problems


def check(config, launch: Launch) -> tuple[list[str], list[str]]:
    """(errors, warnings) for `retrain explain` and `doctor`: each occupied directory is an
    error naming its key, where it was set and the fix; with --overwrite, a warning saying
    where the run will move it."""
    occupied, live = occupied_dirs(config), live_problems(config, launch)
    if not launch.overwrite:
        return live + [_problem(occ, launch, config.training.max_steps) for occ in occupied], []
    if live:  # nothing is moved aside while a run writes there
        return live, []
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
    every problem at once), or with --overwrite move them aside and say where. A live
    run's directory is refused either way (and so is resuming a live run)."""
    live = live_problems(config, launch)
    if live:
        raise ConfigError(live, head="another run is still running there")
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
