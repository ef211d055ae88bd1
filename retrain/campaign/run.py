"""Run a campaign: every condition x seed as an ordinary run, tracked in manifest.json.

Every run is a child process (`python -m retrain.cli.main runs/{name}/run.toml`), so a run
that crashes, even with a segfault, cannot take the campaign down. Its output goes to
`runs/{name}/console.log` (the sequential executor also streams it to the terminal,
prefixed with the run name).

Executors:
* sequential (default): one run after the other.
* parallel (`[campaign] parallel = true`): up to `max_workers` runs at once (0 = all),
  launched `stagger_seconds` apart.
* ray (`[campaign] executor = "ray"`): each run is one Ray task asking for
  `ray_num_cpus` / `ray_num_gpus`; the task starts the same child process on whichever node
  Ray picks (the campaign directory must then be on a filesystem all nodes share).

Resume: `retrain campaign.toml --resume CAMPAIGN_DIR`. In a campaign config `[resume] from`
names the campaign directory (the one holding manifest.json). Finished runs are skipped;
unfinished ones continue from their last checkpoint (`--resume` of the run's own log dir)
or start over when they never saved one. The current TOML supplies the run settings and the
executor; the manifest supplies which runs make up the campaign.

Exit status: 0 when every run finished, 1 when any failed (they are listed), 130 after
Ctrl-C (running children get SIGTERM, save a checkpoint and stop; the manifest says how far
each got), 2 for configuration errors found before anything starts.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from retrain.campaign.conditions import campaign_conditions, condition_from_manifest
from retrain.campaign.expand import (
    RunSpec,
    campaign_dir_name,
    campaign_root,
    check_runs,
    expand_campaign,
    expand_entries,
    uses_throttle,
)
from retrain.config.schema import Config
from retrain.config.toml_writer import config_to_toml
from retrain.errors import ConfigError, RetrainError
from retrain.logs.jsonl import write_json_atomic
from retrain.logs.rundir import MANIFEST, RunDir, read_json
from retrain.throttle import ENV_DIR, ENV_MAX

BASE_CONFIG = "base_config.toml"
MANIFEST_VERSION = 1

# Per-run states in the manifest.
PENDING, RUNNING, FINISHED, FAILED, INTERRUPTED = (
    "pending",
    "running",
    "finished",
    "failed",
    "interrupted",
)


def final_adapter(run: RunSpec) -> str:
    """The finished run's adapter: where its last checkpoint says it can be read (a
    tinker:// path for remote backends), else the local `adapter_path/final`."""
    from retrain.checkpoint import load_state
    from retrain.errors import CheckpointError

    try:
        adapter = load_state(run.log_dir).checkpoint.adapter
    except CheckpointError:
        adapter = ""
    return adapter or str(Path(run.adapter_path) / "final")


class CampaignError(RetrainError):
    """A campaign cannot start or resume (no manifest, unreadable manifest, ...)."""


# ------------------------------------------------------------------ helpers


def run_python_args(run: RunSpec, resume: bool) -> list[str]:
    """Arguments after the Python interpreter that start one run."""
    args = ["-m", "retrain.cli.main", run.config_path]
    if resume:
        args += ["--resume", run.log_dir]
    return args


def has_checkpoint(run: RunSpec) -> bool:
    return RunDir(run.log_dir).has_checkpoint


def last_eval(run: RunSpec) -> dict[str, Any] | None:
    """The run's last held-out evaluation ([eval]) for the manifest, or None."""
    from retrain.logs.metrics import read_eval_rows

    try:
        rows = read_eval_rows(run.log_dir)
    except RetrainError:
        return None
    if not rows:
        return None
    keys = ("eval_correct_rate", "eval_mean_reward", "eval_pass_at_k", "eval_k")
    return {"step": rows[-1].get("step"), **{k: rows[-1].get(k) for k in keys}}


def state_finished(run: RunSpec) -> bool:
    return RunDir(run.log_dir).finished


def set_aside_partial_logs(run: RunSpec, attempt: int) -> list[str]:
    """A run restarting from scratch must not append to the rows of a failed attempt (and
    would refuse a directory holding them): rename them `metrics.attempt{n}.jsonl`,
    `emergence.attempt{n}/`, and the attempt's checkpoints `adapter.attempt{n}/`.
    Returns what moved."""
    moved = []
    log_dir = Path(run.log_dir)
    for path in (
        *(log_dir / n for n in ("metrics.jsonl", "eval.jsonl", "emergence")),
        Path(run.adapter_path),
    ):
        if not path.exists():
            continue
        stem, dot, ext = path.name.partition(".")
        target = path.with_name(f"{stem}.attempt{attempt}{dot}{ext}")
        n = 1
        while target.exists():
            n += 1
            target = path.with_name(f"{stem}.attempt{attempt}-{n}{dot}{ext}")
        path.rename(target)
        moved.append(str(target))
    return moved


def secret_env(config: Config) -> dict[str, str]:
    """run.toml files are written with secrets redacted; hand a secret that came from the
    campaign TOML to the runs through the variable the run reads when the key is empty."""
    env = {}
    if config.reward.judge_api_key:
        env["OPENAI_API_KEY"] = config.reward.judge_api_key
    return env


def _import_ray():
    try:
        import ray
    except ImportError:
        raise RetrainError(
            "[campaign] executor = \"ray\" needs the ray package: pip install 'retrain[ray]' "
            '(or use executor = "local" with parallel = true)'
        ) from None
    return ray


def _ray_task(
    python_args: list[str], cwd: str, log_path: str, extra_env: dict[str, str], header: str
) -> dict[str, Any]:
    """Body of one Ray task: run the child process on this node, output to console.log."""
    import socket

    env = dict(os.environ)  # this worker's (Ray sets CUDA_VISIBLE_DEVICES per task here)
    env.update(extra_env)
    started = time.time()
    Path(log_path).parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        log.write(header.encode())
        log.flush()
        proc = subprocess.Popen(
            [sys.executable, *python_args],
            cwd=cwd if os.path.isdir(cwd) else None,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            code = proc.wait()
        except KeyboardInterrupt:  # ray.cancel: let the run save a checkpoint and stop
            _signal_group(proc, signal.SIGTERM)
            code = proc.wait()
    return {
        "exit_code": code,
        "started_at": started,
        "finished_at": time.time(),
        "host": socket.gethostname(),
        "pid": proc.pid,
    }


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    """Signal a child started with start_new_session (its whole process group)."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)


class _SigtermAsInterrupt:
    """While a campaign runs in the main thread, SIGTERM stops it like Ctrl-C does."""

    def __enter__(self):
        self.previous = None
        if threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGTERM, self._raise)
        return self

    @staticmethod
    def _raise(signum, frame):
        raise KeyboardInterrupt

    def __exit__(self, *exc):
        if self.previous is not None:
            signal.signal(signal.SIGTERM, self.previous)
        return False


# ------------------------------------------------------------------ the campaign


class Campaign:
    def __init__(
        self,
        config: Config,
        campaign_dir: Path,
        runs: list[RunSpec],
        manifest: dict[str, Any],
        *,
        config_path: str | None = None,
        out: Callable[[str], Any] = print,
    ):
        assert config.campaign is not None
        self.config = config
        self.camp = config.campaign
        self.dir = campaign_dir
        self.runs = runs
        self.by_name = {r.name: r for r in runs}
        self.manifest = manifest
        self.config_path = config_path
        self._out = out
        self._print_lock = threading.Lock()
        self.lock = threading.RLock()
        self.stop = threading.Event()
        self.procs: dict[str, subprocess.Popen] = {}
        self.threads: list[threading.Thread] = []
        self._squeeze_lock = threading.Lock()
        self._squeezed: set[str] = set()  # analysed in this session (success or not)
        self.cwd = os.getcwd()

    # ---------------------------------------------------------- manifest

    def out(self, text: str = "") -> None:
        with self._print_lock:
            self._out(text)

    def entry(self, name: str) -> dict[str, Any]:
        for e in self.manifest["runs"]:
            if e["name"] == name:
                return e
        raise KeyError(name)

    def save(self) -> None:
        with self.lock:
            self.manifest["updated_at"] = time.time()
            write_json_atomic(self.dir / "manifest.json", self.manifest)

    def update(self, name: str, **fields: Any) -> None:
        with self.lock:
            self.entry(name).update(fields)
            self.save()

    @property
    def executor(self) -> str:
        if self.camp.executor == "ray":
            return "ray"
        return "parallel" if self.camp.parallel else "sequential"

    def child_env(self) -> dict[str, str]:
        env = {"PYTHONUNBUFFERED": "1", **secret_env(self.config)}
        if uses_throttle(self.config):
            dirs = [r.config.backend.throttle_dir for r in self.runs]
            env[ENV_DIR] = next((d for d in dirs if d), "")
            env[ENV_MAX] = str(self.config.backend.max_concurrent)
        return env

    # ---------------------------------------------------------- one run

    def _begin(self, run: RunSpec) -> tuple[list[str], str]:
        """Bookkeeping before a run starts: resume or fresh start, manifest, log header."""
        entry = self.entry(run.name)
        attempts = int(entry.get("attempts") or 0)
        resume = has_checkpoint(run)
        if not resume and attempts:
            moved = set_aside_partial_logs(run, attempts)
            if moved:
                self.out(
                    f"[{run.name}] no checkpoint to resume from; earlier logs moved to {', '.join(moved)}"
                )
        Path(run.log_dir).mkdir(parents=True, exist_ok=True)
        args = run_python_args(run, resume)
        now = time.time()
        self.update(
            run.name,
            status=RUNNING,
            attempts=attempts + 1,
            started_at=now,
            finished_at=None,
            duration_s=None,
            exit_code=None,
            resumed=resume,
            error=None,
        )
        header = (
            f"\n===== retrain campaign: attempt {attempts + 1} of {run.name} at "
            f"{datetime.fromtimestamp(now):%Y-%m-%d %H:%M:%S}"
            f"{' (resuming from its checkpoint)' if resume else ''}: "
            f"{' '.join(['python', *args])} =====\n"
        )
        return args, header

    def _finish(
        self, run: RunSpec, code: int | None, started: float, error: str | None = None, **extra: Any
    ) -> str:
        ended = time.time()
        if code == 0:
            extra.setdefault("eval", last_eval(run))
            status = FINISHED
        elif self.stop.is_set():
            status = INTERRUPTED
        else:
            status = FAILED
        self.update(
            run.name,
            status=status,
            exit_code=code,
            finished_at=ended,
            duration_s=round(ended - started, 3),
            error=error,
            **extra,
        )
        how = "finished" if status == FINISHED else f"{status} (exit code {code})"
        if error:
            how += f": {error}"
        self.out(f"[{run.name}] {how} after {ended - started:.1f}s; log: {run.console_log}")
        return status

    def _execute_local(self, run: RunSpec, stream: bool) -> None:
        args, header = self._begin(run)
        started = time.time()
        env = {**os.environ, **self.child_env()}
        code: int | None = None
        error = None
        try:
            with open(run.console_log, "ab") as log:
                log.write(header.encode())
                log.flush()
                proc = subprocess.Popen(
                    [sys.executable, *args],
                    cwd=self.cwd,
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,  # Ctrl-C reaches it only through us (SIGTERM)
                )
                with self.lock:
                    self.procs[run.name] = proc
                self.update(run.name, pid=proc.pid)
                if self.stop.is_set():
                    _signal_group(proc, signal.SIGTERM)
                self.out(f"[{run.name}] started (pid {proc.pid})")
                assert proc.stdout is not None
                for raw in iter(proc.stdout.readline, b""):
                    log.write(raw)
                    log.flush()
                    if stream:
                        self.out(f"[{run.name}] {raw.decode('utf-8', 'replace').rstrip()}")
                code = proc.wait()
        except OSError as exc:
            error = f"could not run: {exc}"
        finally:
            with self.lock:
                self.procs.pop(run.name, None)
        self._finish(run, code, started, error)

    def _worker(self, run: RunSpec, slots: threading.Semaphore, stream: bool) -> None:
        try:
            self._execute_local(run, stream)
        except Exception as exc:  # a bug here must not hang the pool
            with contextlib.suppress(Exception):
                self._finish(run, None, time.time(), f"campaign error: {exc!r}")
        finally:
            try:
                self._after_run()
            finally:
                slots.release()

    # ---------------------------------------------------------- executors

    def _wait_stagger(self, last_launch: float | None) -> None:
        if last_launch is None or self.camp.stagger_seconds <= 0:
            return
        remaining = self.camp.stagger_seconds - (time.monotonic() - last_launch)
        while remaining > 0 and not self.stop.is_set():
            time.sleep(min(remaining, 0.2))
            remaining = self.camp.stagger_seconds - (time.monotonic() - last_launch)

    def _run_local(self, todo: list[RunSpec]) -> None:
        parallel = self.camp.parallel
        workers = (self.camp.max_workers or len(todo)) if parallel else 1
        slots = threading.Semaphore(max(1, workers))
        last_launch: float | None = None
        for run in todo:
            while not slots.acquire(timeout=0.2):
                pass
            if self.stop.is_set():
                slots.release()
                break
            if parallel:
                self._wait_stagger(last_launch)
            thread = threading.Thread(
                target=self._worker, args=(run, slots, not parallel), name=run.name, daemon=True
            )
            self.threads.append(thread)
            thread.start()
            last_launch = time.monotonic()
        self._join_threads()

    def _join_threads(self) -> None:
        for thread in self.threads:
            while thread.is_alive():
                thread.join(0.2)

    def _run_ray(self, todo: list[RunSpec]) -> None:
        ray = _import_ray()
        camp = self.camp
        started_here = False
        if not ray.is_initialized():
            ray.init(address=camp.ray_address or None, log_to_driver=False)
            started_here = True
        remote = ray.remote(num_cpus=camp.ray_num_cpus, num_gpus=camp.ray_num_gpus, max_retries=0)(
            _ray_task
        )
        limit = camp.max_workers or len(todo)
        inflight: dict[Any, tuple[RunSpec, float]] = {}
        extra_env = self.child_env()

        def collect(timeout: float | None) -> None:
            ready, _ = ray.wait(list(inflight), num_returns=1, timeout=timeout)
            for ref in ready:
                run, submitted = inflight.pop(ref)
                try:
                    result = ray.get(ref)
                except Exception as exc:  # the task itself died (node lost, cancelled, ...)
                    self._finish(
                        run, None, submitted, f"ray task failed: {type(exc).__name__}: {exc}"
                    )
                else:
                    self._finish(
                        run,
                        result["exit_code"],
                        result["started_at"],
                        started_at=result["started_at"],
                        host=result["host"],
                        pid=result["pid"],
                    )
                self._after_run()

        try:
            last_launch: float | None = None
            for run in todo:
                while len(inflight) >= limit:
                    collect(0.5)
                self._wait_stagger(last_launch)
                args, header = self._begin(run)
                ref = remote.remote(args, self.cwd, run.console_log, extra_env, header)
                inflight[ref] = (run, time.time())
                self.out(f"[{run.name}] submitted to Ray")
                last_launch = time.monotonic()
            while inflight:
                collect(0.5)
        except KeyboardInterrupt:
            self.stop.set()
            self.out(
                "Interrupted: cancelling Ray tasks (each run gets SIGTERM and saves a checkpoint)..."
            )
            for ref in list(inflight):
                with contextlib.suppress(Exception):
                    ray.cancel(ref)
            deadline = time.time() + 60
            while inflight and time.time() < deadline:
                try:
                    collect(1.0)
                except Exception:
                    break
            for run, submitted in inflight.values():
                self._finish(run, None, submitted, "cancelled")
            raise
        finally:
            if started_here:
                ray.shutdown()

    # ---------------------------------------------------------- auto-squeeze

    def _squeeze_pending(self) -> bool:
        if self.config.squeeze is None:
            return False
        done = self.manifest.get("squeeze")
        return not (isinstance(done, dict) and "error" not in done and done.get("recommended_rank"))

    def _squeeze_candidate(self) -> RunSpec | None:
        """The first run in submission order once it has finished; if it failed, the first
        run that did finish."""
        with self.lock:
            if not self._squeeze_pending():
                return None
            first = self.entry(self.runs[0].name)
            if first["status"] == FINISHED:
                return self.runs[0]
            if first["status"] in (FAILED, INTERRUPTED):
                for run in self.runs:
                    if self.entry(run.name)["status"] == FINISHED:
                        return run
            return None

    def _after_run(self) -> None:
        if self.stop.is_set():
            return
        with self._squeeze_lock:
            # Under _squeeze_lock: one analysis at a time, and a second finisher sees the
            # result of the first in the manifest.
            run = self._squeeze_candidate()
            if run is not None and run.name not in self._squeezed:
                self._squeezed.add(run.name)
                self._squeeze(run)

    def _squeeze(self, run: RunSpec) -> None:
        sq = self.config.squeeze
        assert sq is not None
        adapter = final_adapter(run)
        self.out(f"Auto-squeeze: analysing the final adapter of {run.name} ({adapter})")
        try:
            from retrain.squeeze import squeeze_from_options

            result = squeeze_from_options(
                adapter_path=adapter,
                min_variance_retention=sq.min_variance_retention,
                target_ranks=sq.target_ranks or None,
                source_rank=sq.source_rank,
                output_path=sq.output_path or None,
                compress_to=sq.compress_to,
                device=sq.device,
                print_fn=self.out,
            )
        except Exception as exc:  # reported and recorded; the campaign goes on
            data: dict[str, Any] = {
                "error": f"{type(exc).__name__}: {exc}",
                "run": run.name,
                "adapter_path": str(adapter),
                "analysed_at": time.time(),
            }
            self.out(f"Auto-squeeze failed: {exc}. The remaining runs continue.")
        else:
            data = result.as_dict() | {
                "recommended_rank": result.recommended_rank,
                "adapter_path": str(adapter),
                "run": run.name,
                "mean_variance": {str(k): v for k, v in result.mean_variance.items()},
                "analysed_at": time.time(),
            }
            self.out(
                f"Auto-squeeze: recommended LoRA rank {result.recommended_rank} "
                f"(of {result.source_rank}); written to {self.dir / MANIFEST}"
            )
        with self.lock:
            self.manifest["squeeze"] = data
            self.save()

    # ---------------------------------------------------------- the whole thing

    def _interrupt(self) -> None:
        self.stop.set()
        with self.lock:
            live = dict(self.procs)
        if live:
            self.out(
                f"Interrupted: stopping {len(live)} running run(s) with SIGTERM; each saves a "
                "checkpoint after its current step (Ctrl-C again to kill them now)..."
            )
        for proc in live.values():
            _signal_group(proc, signal.SIGTERM)
        while True:
            try:
                self._join_threads()
                break
            except KeyboardInterrupt:
                with self.lock:
                    live = dict(self.procs)
                self.out(f"Killing {len(live)} run(s) without a final checkpoint.")
                for proc in live.values():
                    _signal_group(proc, signal.SIGKILL)

    def execute(self) -> int:
        todo = []
        for run in self.runs:
            entry = self.entry(run.name)
            if entry["status"] == FINISHED or state_finished(run):
                if entry["status"] != FINISHED:
                    entry["status"] = FINISHED
                continue
            todo.append(run)
            if entry["status"] != PENDING:
                entry["status"] = PENDING
        with self.lock:
            self.manifest["status"] = RUNNING
            self.manifest["executor"] = self.executor
            self.save()
        skipped = len(self.runs) - len(todo)
        total_steps = len(todo) * self.camp.max_steps
        self.out(
            f"Campaign {self.dir}: {len(self.runs)} runs ({skipped} already finished), "
            f"{len(todo)} to run x {self.camp.max_steps} steps = {total_steps} steps, {self.executor}"
            + (
                f" ({self.camp.max_workers or len(todo)} workers)"
                if self.executor == "parallel"
                else ""
            )
        )
        self._after_run()  # a resumed campaign may already hold the run to squeeze
        interrupted = False
        with _SigtermAsInterrupt():
            try:
                if todo:
                    if self.executor == "ray":
                        self._run_ray(todo)
                    else:
                        self._run_local(todo)
            except KeyboardInterrupt:
                interrupted = True
                self._interrupt()
        return self._conclude(interrupted)

    def _conclude(self, interrupted: bool) -> int:
        with self.lock:
            states = {e["name"]: e["status"] for e in self.manifest["runs"]}
            failed = [n for n, s in states.items() if s == FAILED]
            finished = [n for n, s in states.items() if s == FINISHED]
            if interrupted or any(s in (PENDING, RUNNING, INTERRUPTED) for s in states.values()):
                status = INTERRUPTED
            elif failed:
                status = FAILED
            else:
                status = FINISHED
            self.manifest["status"] = status
            self.manifest["finished_at"] = time.time()
            self.save()
        cfg = f" {self.config_path}" if self.config_path else ""
        self.out(
            f"Campaign {status}: {len(finished)}/{len(states)} runs finished"
            + (f", {len(failed)} failed" if failed else "")
            + f". Manifest: {self.dir / MANIFEST}"
        )
        for name in failed:
            entry = self.entry(name)
            self.out(
                f"  FAILED {name}: exit code {entry.get('exit_code')}"
                + (f" ({entry['error']})" if entry.get("error") else "")
                + f"; see {self.by_name[name].console_log}"
            )
        if status != FINISHED:
            self.out(f"Resume with: retrain{cfg} --resume {self.dir}")
        if status == INTERRUPTED:
            return 130
        return 1 if failed else 0


# ------------------------------------------------------------------ entry point


def _new_manifest(config: Config, campaign_dir: Path, runs: list[RunSpec], config_path) -> dict:
    import tomllib

    assert config.campaign is not None
    return {
        "version": MANIFEST_VERSION,
        "campaign_dir": str(campaign_dir),
        "config_path": str(config_path) if config_path else None,
        "created_at": time.time(),
        "updated_at": time.time(),
        "status": PENDING,
        "base_config": tomllib.loads(config_to_toml(config)),
        "conditions": [c.label for c in campaign_conditions(config)],
        "seeds": list(config.campaign.seeds),
        "max_steps": config.campaign.max_steps,
        "executor": None,
        "runs": [_new_entry(r) for r in runs],
    }


def _new_entry(run: RunSpec) -> dict[str, Any]:
    return {
        "name": run.name,
        "condition": run.condition,
        "advantage_mode": run.advantage_mode,
        "transform_mode": run.transform_mode,
        "overrides": dict(run.overrides),
        "seed": run.seed,
        "log_dir": run.log_dir,
        "adapter_path": run.adapter_path,
        "config_path": run.config_path,
        "console_log": run.console_log,
        "status": PENDING,
        "exit_code": None,
        "started_at": None,
        "finished_at": None,
        "duration_s": None,
        "attempts": 0,
    }


def _make_dir(config: Config) -> Path:
    root = campaign_root(config)
    base = root / campaign_dir_name(datetime.now())
    path, n = base, 1
    while True:
        try:
            path.mkdir(parents=True, exist_ok=False)
            return path
        except FileExistsError:
            n += 1
            path = base.with_name(f"{base.name}_{n}")


def load_manifest(campaign_dir: str | Path) -> dict[str, Any]:
    path = Path(campaign_dir) / MANIFEST
    if not Path(campaign_dir).is_dir():
        raise CampaignError(f"[resume] from: campaign directory {campaign_dir} does not exist")
    if not path.is_file():
        hint = (
            " (it looks like a single run's log dir: resume it with the run's own TOML)"
            if RunDir(campaign_dir).has_checkpoint
            else ""
        )
        raise CampaignError(
            f"[resume] from: {campaign_dir} holds no {MANIFEST}, so it is not a campaign directory{hint}"
        )
    problems: list[str] = []
    data = read_json(path, problems)
    if data is None or not isinstance(data.get("runs"), list):
        raise CampaignError(
            problems[0] if problems else f"{path} is not a campaign manifest (no runs list)"
        )
    return data


def _manifest_entries(manifest: dict[str, Any], campaign_dir: Path) -> list:
    """(condition, seed) of every run a manifest lists; a CampaignError names a bad entry."""
    entries = []
    for e in manifest["runs"]:
        where = f"{campaign_dir / MANIFEST}: run entry {e.get('name', e)!r}"
        try:
            seed = int(e["seed"])
            condition = condition_from_manifest(e)
        except (KeyError, TypeError, ValueError) as exc:
            problems = exc.problems if isinstance(exc, ConfigError) else []
            why = "; ".join(problems) or "lacks advantage_mode/transform_mode/seed"
            raise CampaignError(f"{where}: {why}") from None
        entries.append((condition, seed))
    return entries


def _condition_problems(config: Config, runs: list[RunSpec]) -> list[str]:
    """What the campaign's runs would refuse at their start, found before any directory is
    made: the base config's startup problems (every run would fail on them, each after
    the campaign had started), then each condition's (startup.condition_problems: the
    preflight, and the startup checks where a condition overrides the base)."""
    from retrain.startup import condition_problems, startup_problems

    firsts: dict[str, RunSpec] = {}
    for run in runs:
        firsts.setdefault(run.condition, run)
    listed = [(label, run.config, bool(run.overrides)) for label, run in firsts.items()]
    # where every condition overrides the base, their own checks say what still holds
    plain = any(not overridden for *_, overridden in listed)
    base = startup_problems(config) if plain else []
    return [f"{key}: {message}" for key, message in base] + condition_problems(
        listed, base, startup_problems
    )


def run_campaign(
    config: Config, config_path: str | None = None, *, out: Callable[[str], Any] = print
) -> int:
    """Run (or, with `[resume] from = CAMPAIGN_DIR`, resume) a campaign; returns the exit
    status (0 all finished, 1 some failed, 130 interrupted)."""
    if config.campaign is None:
        raise CampaignError("run_campaign needs a config with a [campaign] table")
    if config.algorithm.algorithm_mode:
        out(
            f"Note: [algorithm] algorithm_mode = {config.algorithm.algorithm_mode!r} is ignored in a "
            "campaign: each run uses its condition's advantage_mode + transform_mode."
        )
    if config.campaign.executor == "ray":
        _import_ray()  # fail before anything is created
    resume_dir = config.resume.from_
    if resume_dir:
        campaign_dir = Path(resume_dir)
        manifest = load_manifest(campaign_dir)
        entries = _manifest_entries(manifest, campaign_dir)
        runs = expand_entries(config, entries, campaign_dir)
        wanted = {r.name for r in expand_campaign(config, campaign_dir)}
        if wanted != {r.name for r in runs}:
            out(
                "Note: the conditions/seeds in the TOML differ from the campaign being resumed; "
                f"the manifest's {len(runs)} runs are used."
            )
        for run in runs:  # entries written by older versions may lack fields
            entry = next(e for e in manifest["runs"] if e.get("name") == run.name)
            for key, value in _new_entry(run).items():
                entry.setdefault(key, value)
        out(f"Resuming campaign {campaign_dir}")
    else:
        campaign_dir = None
        runs = expand_campaign(config, "CAMPAIGN_DIR")  # validated before any dir is made
    problems = check_runs(runs) + _condition_problems(config, runs)
    if problems:
        raise ConfigError(problems, source=config_path)
    if campaign_dir is None:
        campaign_dir = _make_dir(config)
        runs = expand_campaign(config, campaign_dir)
        manifest = _new_manifest(config, campaign_dir, runs, config_path)
        try:
            (campaign_dir / BASE_CONFIG).write_text(config_to_toml(config), encoding="utf-8")
        except OSError as exc:
            raise RetrainError(f"cannot write {campaign_dir / BASE_CONFIG}: {exc}") from exc
    campaign = Campaign(config, campaign_dir, runs, manifest, config_path=config_path, out=out)
    for run in runs:
        if campaign.entry(run.name).get("status") == FINISHED or state_finished(run):
            continue
        try:
            Path(run.log_dir).mkdir(parents=True, exist_ok=True)
            Path(run.config_path).write_text(run.toml(), encoding="utf-8")
        except OSError as exc:
            raise RetrainError(f"cannot write {run.config_path}: {exc.strerror or exc}") from exc
    campaign.save()
    return campaign.execute()
