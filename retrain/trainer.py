"""The training loop. It only sequences calls: data -> rollout (sample + score) ->
advantages -> training (retrain.stepping: blocking, or overlapped with the next step's
sampling) -> controllers -> logs -> checkpoint. No formula lives here, and nothing is
built here: retrain.build makes the components."""

from __future__ import annotations

import os
import signal
import statistics
import sys
import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from retrain import distributed
from retrain.build import Components, step_work_of, world_of
from retrain.checkpoint import (
    TrainerState,
    capture_rng,
    check_compatible,
    load_state,
    restore_rng,
    save_state,
)
from retrain.config import Config
from retrain.config.diff import resumed_with
from retrain.config.validate import device_kind
from retrain.errors import CheckpointError, RetrainError
from retrain.logs.console import Console, eval_line, group_line, step_line
from retrain.logs.metrics import RunContext, RunCounters, eval_fields, metrics_row
from retrain.logs.ownership import Launch, claim, launch_for, occupied_dirs
from retrain.logs.runlog import RunLog
from retrain.logs.timer import PhaseTimer
from retrain.rollout import build_datums, correct_rate, pipeline_advantages, planning_masks
from retrain.roofline import StepWork
from retrain.schedule import lr_at
from retrain.shaping import merge_counters, sample_step
from retrain.startup import (
    check_world,
    checked_build,
    resume_changes,
    resume_horizon,
    resume_problems,
)
from retrain.stepping import SampledStep, StepTraining, step_training
from retrain.types import Datum, EvalResult, GroupRollout, RunPosition, StepResult
from retrain.zero_signal import ZeroSignalGuard

if TYPE_CHECKING:
    import numpy as np

    from retrain.advantages import BatchAdvantages


def step_seed(seed: int, step: int) -> int | None:
    """The sampling seed of one step: a function of (seed, step) only, so a resumed run
    samples exactly what the uninterrupted run would have."""
    if seed < 0:
        return None
    return (seed * 1_000_003 + step * 7919 + 17) % (2**63 - 1)


class _StopRequest:
    """SIGINT/SIGTERM: finish the current step, save, exit. A second SIGINT aborts. Once
    the steps are over (`closing`) a SIGTERM changes nothing: the run is stopping already,
    and under torchrun, whose agent terminates the other ranks as soon as one fails, the
    default action would kill this rank before it says why it stops."""

    def __init__(self):
        self.signal: int | None = None
        self.closing = False
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        if threading_main():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.closing and signum == signal.SIGTERM:
            return
        if self.signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signal = signum
        print(
            f"\nReceived {signal.Signals(signum).name}: stopping after this step and saving a checkpoint (Ctrl-C again to abort).",
            file=sys.stderr,
            flush=True,
        )

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def threading_main() -> bool:
    return threading.current_thread() is threading.main_thread()


class Trainer:
    def __init__(
        self,
        config: Config,
        *,
        config_path: str | None = None,
        console: Console | None = None,
        launch: Launch | None = None,
    ):
        self.config = config
        self.config_path = config_path
        self.launch = launch or launch_for(config_path)
        # Under torchrun: rank 0 alone prints and writes (retrain/world.py).
        self.world = world_of(config)
        self.console = console or Console()
        if not self.world.is_main:
            # held for the process's life: the other ranks print nothing
            self.console = Console(open(os.devnull, "w"), live=False)  # noqa: SIM115
        self.say: Callable[[str], None] = self.console.print
        self.log_dir = Path(config.logging.log_dir)
        self.log = RunLog(config, self.log_dir, config_path, self.say)
        self.parts: Components | None = None
        self.step_work: Callable[[StepResult], StepWork] | None = None  # set up with the parts
        self.counters = RunCounters()
        self.start_step = 0
        self.last_saved_step: int | None = None
        self.last_adapter = ""
        self.training: StepTraining | None = None
        self.guard = ZeroSignalGuard(config.training.zero_signal_steps)

    def setup(self) -> None:
        self.parts = c = checked_build(self.config, self.say)
        # With back pressure on, the controller picks every batch size (its warmup
        # explores from the bottom of the ladder); [training] batch_size only seeds it.
        bp = c.backpressure
        self.batch_size = bp.batch_size if bp is not None else self.config.training.batch_size
        self.group_size = self.config.training.group_size
        self.context = RunContext(
            condition=self.config.condition,
            lr=self.config.training.lr,
            loss_is_placeholder=not c.capabilities.reports_sync_loss,
            started=self.log.started,
        )
        # The local backend's option: train step n in the background while step n+1
        # samples one optimizer step behind.
        overlap = self.config.backend.options.get("overlap") is True
        self.training = step_training(c.backend, overlap=overlap)
        self.log.backend = {
            "name": self.config.backend.backend,
            "capabilities": c.capabilities.as_dict(),
        }
        # back pressure's roofline hint: each step's FLOPs and bytes, where peaks are given
        self.step_work = step_work_of(self.config) if c.backpressure is not None else None

    def restore(self, resume_from: str) -> None:
        """Load trainer_state.json + the backend checkpoint."""
        state = load_state(resume_from)
        cfg, c = self.config, self.parts
        check_compatible(
            state, cfg.backend.backend, cfg.model.model, cfg.model.lora_rank, resume_from
        )
        load = getattr(c.backend, "load_checkpoint", None)
        if load is None:  # a plugin that claims supports_checkpoint_resume without it
            raise CheckpointError(
                f"[resume] from: the {cfg.backend.backend!r} backend "
                f"({type(c.backend).__name__}) has no load_checkpoint method, though its "
                "capabilities say supports_checkpoint_resume = true. Fix: implement "
                "load_checkpoint(info) in the backend (or declare supports_checkpoint_resume "
                "= false), or drop --resume and start a new run"
            )
        load(state.checkpoint)
        c.data.load_state_dict(state.data)
        c.sepa.load_state_dict(state.sepa)
        if c.backpressure is not None and state.backpressure:
            c.backpressure.load_state_dict(state.backpressure)
        if state.zero_signal:
            self.guard.load_state_dict(state.zero_signal)
        restore_rng(state.rng)
        self._restore_rank_rng(state.rng, resume_from)
        self.counters = RunCounters.from_dict(state.counters)
        self.batch_size, self.group_size = state.batch_size, state.group_size
        self.start_step = self.last_saved_step = state.step
        self.last_adapter = state.checkpoint.adapter
        if state.condition != cfg.condition:
            self.say(
                f"Note: the checkpoint was trained as {state.condition}; continuing as {cfg.condition}"
            )
        self.say(
            f"Resumed from {resume_from} at step {state.step} (example {c.data.position}, correct so far {self.counters.correct_rate:.1%})"
        )

    # ------------------------------------------------------------ one step

    def run_step(self, step: int) -> dict[str, Any] | None:
        """Sample, score and compute the advantages of `step`, hand it to the training and
        record every step whose training is done. Returns the last row written: this
        step's, or with overlap the previous step's (this one's waits for settle)."""
        c, timer = self.parts, PhaseTimer(self._progress(step))
        off_policy = self.training.steps_behind  # read before sampling: a step in flight
        batch_size, group_size = self.batch_size, self.group_size  # as this step uses them
        params = replace(c.sampling, seed=step_seed(self.config.training.seed, step))
        shaped = sample_step(
            c.shaping, c.data.next_batch, self._rollout, (batch_size, group_size), params, timer
        )
        groups = shaped.groups
        with timer.phase("advantages"):
            planning, adv, datums = self._advantages(step, groups)
        sampled = SampledStep(
            step=step,
            groups=groups,
            reward_counters=shaped.reward_counters,
            planning=planning,
            advantages=adv,
            datums=datums,
            batch_size=batch_size,
            group_size=group_size,
            position=self._position(),
            off_policy_steps=off_policy,
            timer=timer,
            shaping=shaped.report,
        )
        hyper = replace(c.hyper, lr=self.scheduled_lr(step))
        row = None  # with overlap the first step hands back nothing
        for result in self.training.submit(sampled, hyper):
            row = self._record(result)
        return row

    def _rollout(self, examples, group_size: int, params, timer: PhaseTimer):
        """This rank's whole groups sampled and scored; under torchrun every rank's
        gathered, so what follows (advantages, SEPA, counters, metrics) sees the batch."""
        start, stop = self.world.bounds(len(examples))
        params = replace(params, prompt_offset=start)
        mine, counters = self.parts.rollout(examples[start:stop], group_size, params, timer)
        if not self.world.distributed:
            return mine, counters
        with timer.phase("gather", "gathering the ranks' groups"):
            parts = distributed.gather(
                self.world, (mine, counters), "the gather of the step's groups"
            )
        groups = [g for part, _ in parts for g in part]
        return groups, merge_counters([(k, sum(map(len, p))) for p, k in parts])

    def _advantages(
        self, step: int, groups: list[GroupRollout]
    ) -> tuple[list[list[np.ndarray]], BatchAdvantages, list[Datum]]:
        """The planning masks, the pipeline's advantages (SEPA is updated from inside the
        call, with this step's execution-token variance) and the datums of kept groups."""
        c = self.parts
        planning = [planning_masks(c.detector, c.vocab, g.samples) for g in groups]
        adv = pipeline_advantages(
            c.pipeline,
            groups,
            planning,
            sepa_lambda=lambda stats: c.sepa.update(step, correct_rate(groups), stats.exec_var),
            step=step,
        )
        datums = build_datums(groups, adv.advantages, mask_truncated=c.shaping.mask_truncated)
        return planning, adv, datums

    def _position(self) -> RunPosition:
        c = self.parts
        return RunPosition(
            examples_seen=c.data.position, epoch=c.data.epoch, sepa_gate_open=c.sepa.gate_open
        )

    def settle(self) -> None:
        """Record the step still training (with overlap). Checkpoints and evaluations call
        it first, so neither ever sees a half-applied step."""
        for result in self.training.settle():
            self._record(result)

    def scheduled_lr(self, step: int) -> float:
        """The learning rate of `step`: a pure function of the step ([training]
        lr_schedule, warmup_steps), so a resumed run continues the same schedule."""
        t = self.config.training
        return lr_at(step, t.lr, t.lr_schedule, t.warmup_steps, t.max_steps)

    def _progress(self, step: int) -> Callable[[str], None]:
        total, done = self.config.training.max_steps, step - self.start_step
        return lambda label: self.console.progress(step, total, label, self.log.started, done)

    def _record(self, result: StepResult) -> dict[str, Any]:
        """Counters, the metrics row, the back-pressure decision, the console and the logs."""
        c, where = self.parts, result.position
        self.counters.add(result)
        row = metrics_row(
            result,
            replace(self.context, lr=self.scheduled_lr(result.step)),
            self.counters,
            examples_seen=where.examples_seen,
            epoch=where.epoch,
            sepa_gate_open=where.sepa_gate_open,
        )
        row["off_policy_steps"] = result.off_policy_steps
        if c.backpressure is not None:
            # the step's own size: with overlap the next step has sampled already
            work = self.step_work(result) if self.step_work is not None else None
            decision = c.backpressure.observe(
                result.batch_size,
                self._throughput(result),
                flops=work.flops if work else None,
                bytes_moved=work.bytes_moved if work else None,
            )
            row.update(decision.as_metrics())
            self.batch_size = decision.batch_size  # a multiple of the ranks
        for g in result.groups[: self.config.logging.group_lines]:
            self.say(group_line(g.num_correct, len(g), g.example.reference))
        if result.shaping.warning:
            self.say(f"Warning: step {result.step}: {result.shaping.warning}")
        no_signal = self.guard.observe(result)
        if no_signal:
            row["zero_signal"] = no_signal
        self.say(self._step_line(row) + self.guard.flag(no_signal))
        if self._eval_due(result.step + 1):  # the rows carry the evaluation after this step
            row.update(eval_fields(self.evaluate(result.step + 1)))
        if self.world.is_main:
            self.log.write_step(result, row)
        self.guard.check()  # N steps in a row without a datum: stop, saying why
        return row

    def _throughput(self, result: StepResult) -> float:
        """What back pressure observes: under torchrun the same on every rank (the whole
        batch's completions over the slowest rank's busy time), so all decide alike."""
        if not self.world.distributed:
            return self.throughput(result)
        rates = distributed.gather(self.world, self.throughput(result), "back pressure")
        slowest = min(rates)  # every rank's rate counts the whole batch's completions
        return slowest

    @staticmethod
    def throughput(result: StepResult) -> float:
        """Completions per second of busy time (sampling + training): what back pressure
        observes. (Tests replace it with a deterministic curve.)"""
        busy = result.seconds["sampling"] + result.seconds["training"]
        return result.num_completions / max(busy, 1e-9)

    def _step_line(self, row: dict[str, Any]) -> str:
        line = step_line(
            row["step"],
            self.config.condition,
            loss=row["loss"],
            loss_is_placeholder=row["loss_is_placeholder"],
            reward=row["mean_reward"],
            correct_rate=row["correct_rate"],
            datums=row["num_datums"],
            batch_size=row["batch_size"],
            group_size=row["group_size"],
            sepa_lambda=row["sepa_lambda"],
            seconds=row["step_time_s"],
        )
        if "sampling_rounds" in row:  # dynamic sampling: what it dropped to fill the batch
            line += f" | dropped={row['groups_dropped']} | rounds={row['sampling_rounds']}"
        return line

    # ------------------------------------------------------------ held-out evaluation

    def _evaluates(self) -> bool:
        every = self.config.eval.every
        return self.parts is not None and self.parts.evaluator is not None and every > 0

    def _eval_due(self, done: int) -> bool:
        """Evaluations run before step 0, every `[eval] every` steps and after the last."""
        if not self._evaluates():
            return False
        return done % self.config.eval.every == 0 or done == self.config.training.max_steps

    def evaluate(self, done: int) -> EvalResult:
        """Evaluate the current adapter on the held-out set after `done` training steps:
        the console line and the eval.jsonl row (not a training step: nothing trains)."""
        self.settle()  # no-op unless a training is pending: evaluate its weights
        result = self.parts.evaluator(
            done,
            on_phase=lambda label: self.console.status(f"held-out evaluation: {label}"),
        )
        self.say(eval_line(done, self.config.condition, result))
        if self.world.is_main:
            self.log.write_eval(result)
        return result

    # ------------------------------------------------------------ checkpoints

    def checkpoint(self, step: int, *, final: bool = False) -> None:
        """Save after `step` steps are complete: backend first, then the state file."""
        self.settle()  # the pending training is part of the `step` steps saved
        cfg, c = self.config, self.parts
        name = "final" if final else f"checkpoint_step_{step}"
        rng = self._rng_states()  # every rank's (a collective: before rank 0 alone writes)
        if not self.world.is_main:
            self._saved(step, "")
            return distributed.barrier(self.world, "the checkpoint")
        info = c.backend.save_checkpoint(Path(cfg.backend.adapter_path) / name)
        state = TrainerState(
            step=step,
            model=cfg.model.model,
            lora_rank=cfg.model.lora_rank,
            condition=cfg.condition,
            batch_size=self.batch_size,
            group_size=self.group_size,
            data=c.data.state_dict(),
            counters=self.counters.as_dict(),
            sepa=c.sepa.state_dict(),
            checkpoint=info,
            backpressure=c.backpressure.state_dict() if c.backpressure is not None else None,
            rng=rng,
            zero_signal=self.guard.state_dict(),
            finished=final,
            workdir=os.getcwd(),  # the checkpoint's and the config's paths are relative to it
            launch=list(self.launch.command),
        )
        save_state(self.log_dir, state)
        distributed.barrier(self.world, "the checkpoint")  # every rank past a whole save
        self._saved(step, info.adapter)
        self.say(
            f"Saved {'final adapter' if final else 'checkpoint'} at step {step}"
            + (f" -> {info.adapter}" if info.adapter else "")
        )

    def _saved(self, step: int, adapter: str) -> None:
        self.last_saved_step = step
        self.last_adapter = adapter

    def _rng_states(self) -> dict[str, Any]:
        """Python's and numpy's RNG states (rank 0's, as one process saves them); under
        torchrun also every rank's own, Python, numpy and torch, under "ranks"."""
        state = capture_rng()
        if self.world.distributed:
            mine = {**capture_rng(), **distributed.rank_rng_state()}
            state["ranks"] = distributed.gather(self.world, mine, "the checkpoint's RNG states")
        return state

    def _restore_rank_rng(self, rng: dict[str, Any], resume_from: str) -> None:
        """Under torchrun, this rank's own RNG states (saved by a run on as many ranks)."""
        ranks = rng.get("ranks")
        if not self.world.distributed and ranks is None:
            return
        n = len(ranks) if ranks is not None else 1
        if n != self.world.size:
            raise CheckpointError(
                f"[resume] from: {resume_from} was saved by a run on {n} rank(s), and this run "
                f"has {self.world.size}: each rank resumes its own RNG state. Fix: start it "
                f"with torchrun --nproc-per-node {n}" + (" (or without torchrun)" if n == 1 else "")
            )
        mine = ranks[self.world.rank]
        restore_rng(mine)
        distributed.restore_rank_rng(mine)

    # ------------------------------------------------------------ the loop

    def run(self) -> int:
        """The run; under torchrun inside the process group, which a failure on any rank
        ends on every rank (retrain/distributed.py)."""
        check_world(self.config, self.world)  # before the process group: all ranks exit 2
        with distributed.session(self.world, device_kind(self.config)):
            return self._run()

    def _run(self) -> int:
        cfg = self.config
        if self.world.is_main:
            claim(cfg, self.launch, self.say)  # before any model loads
        distributed.barrier(self.world, "the start (rank 0 checks the run directories)")
        resume_from = cfg.resume.from_
        # a run that cannot be resumed is refused by the build's startup checks
        done = load_state(resume_from).step if resume_from and not resume_problems(cfg) else None
        if done is not None and done >= cfg.training.max_steps:  # before any model loads
            self.say(
                f"Nothing to do: the run in {resume_from} has trained {done} steps and max_steps "
                f"is {cfg.training.max_steps} (set --max-steps above {done} to continue)."
            )
            return 0
        where = self.launch.origin("training", "max_steps")
        horizon = resume_horizon(cfg, where) if done is not None else None
        if horizon:  # max_steps is no setting change: it is how far the resume trains
            self.say(horizon)
        changes = resume_changes(cfg) if done is not None else []
        if changes:  # before config.resolved.toml is rewritten with them
            self.say(resumed_with(changes, done))
        if self.world.is_main:
            self.log.reserve(done or 0)  # a second run is refused while the model loads
        try:
            self.setup()
            if resume_from:
                self.restore(resume_from)
            if self.world.is_main:
                self.log.open(self.start_step)
        except BaseException as exc:
            if self.log.is_open:  # e.g. the wandb mirror failed to start
                status = "interrupted" if isinstance(exc, KeyboardInterrupt) else "failed"
                self.log.close(status, self.last_saved_step)
            else:
                self.log.release()
            if self.parts is not None:  # e.g. a checkpoint that does not load: the model
                self.parts.close(self.say)  # goes, in a notebook that calls train() again
            raise
        self.context = replace(self.context, started=self.log.started)
        stop = _StopRequest()
        stop.install()
        status = "failed"
        try:
            status, code = self._loop(stop)
            return code
        except KeyboardInterrupt:
            status = "interrupted"
            self.console.done()
            self.say(self._abort_line())
            raise
        finally:
            stop.closing = True
            try:
                self.training.abandon()  # a background training ends before the model closes
            finally:
                try:
                    self._close(status)
                finally:
                    stop.restore()

    def _loop(self, stop: _StopRequest) -> tuple[str, int]:
        """Steps until max_steps or a stop request; returns (status, exit code)."""
        cfg = self.config
        last = cfg.training.max_steps
        if self.start_step == 0 and self._eval_due(0):
            self.evaluate(0)
        for step in range(self.start_step, last):
            self.run_step(step)
            done = step + 1
            if cfg.training.save_every and done % cfg.training.save_every == 0 and done < last:
                self.checkpoint(done)
            if distributed.any_rank(self.world, stop.signal is not None, "a stop request"):
                if self.last_saved_step != done:
                    self.checkpoint(done)
                self.console.done()
                self.say(self._resume_hint(done))
                return "interrupted", 130 if stop.signal == signal.SIGINT else 143
        self.checkpoint(last, final=True)
        self.console.done()
        self.say(self._summary())
        return "finished", 0

    def _resume_hint(self, step: int) -> str:
        return f"Stopped after step {step}. Resume with: {self._resume_command()}"

    def _resume_command(self) -> str:
        return self.launch.line("--resume", str(self.log_dir))

    def _abort_line(self) -> str:
        """After a second Ctrl-C: the checkpoint that is kept and the command that resumes
        it, or, with none saved yet, that the run must start again (and how)."""
        if self.last_saved_step is None:
            return (
                "Aborted before the first checkpoint: nothing was saved, so there is nothing "
                f"to resume. Start the run again: {self._start_again()}"
            )
        return f"Aborted; {self._kept_checkpoint()}"

    def _start_again(self) -> str:
        """The command that starts this run over: with --overwrite where its rows are in
        the log dir (a new run would refuse them; --overwrite moves them aside)."""
        return self.launch.line(*(["--overwrite"] if occupied_dirs(self.config) else []))

    def _kept_checkpoint(self) -> str:
        """The last checkpoint (one was saved) and the command that resumes it."""
        where = f" ({self.last_adapter})" if self.last_adapter else ""
        return (
            f"the last checkpoint, after step {self.last_saved_step}{where}, is kept. "
            f"Resume with: {self._resume_command()}"
        )

    def failed_line(self) -> str:
        """After a run stopped on an error: what is kept, and how to go on once the cause
        is fixed (a resume takes a changed config and says what changed)."""
        if self.last_saved_step is None:
            return (
                "Nothing was saved before the failure. Once fixed, start the run again: "
                f"{self._start_again()}"
            )
        return f"Once fixed, {self._kept_checkpoint()}"

    def _summary(self) -> str:
        rows = []
        try:
            from retrain.logs.jsonl import read_jsonl

            rows, _ = read_jsonl(self.log_dir / "metrics.jsonl")
        except RetrainError:
            pass
        # A trend needs two disjoint windows: first five vs last five steps of this run.
        first = [r["correct_rate"] for r in rows[:5]] if len(rows) >= 10 else []
        last = [r["correct_rate"] for r in rows[-5:]]
        trend = (
            f"correct rate {statistics.mean(first):.1%} (first steps) -> {statistics.mean(last):.1%} (last steps); "
            if first and last
            else ""
        )
        return f"Done: {self.config.training.max_steps} steps, {trend}{self._eval_trend()}logs in {self.log_dir}, adapter in {self.last_adapter}"

    def _eval_trend(self) -> str:
        from retrain.logs.metrics import read_eval_rows

        if not self._evaluates():
            return ""  # this run did not evaluate: an eval.jsonl here is not its trend
        try:
            rows = read_eval_rows(self.log_dir)
        except RetrainError:
            return ""
        if len(rows) < 2:
            return ""
        first, last = rows[0], rows[-1]
        return (
            f"held-out correct rate {first['eval_correct_rate']:.1%} (after {first['step']} steps) "
            f"-> {last['eval_correct_rate']:.1%} (after {last['step']} steps); "
        )

    def _close(self, status: str) -> None:
        self.log.close(status, self.last_saved_step)
        if self.parts is not None:
            self.parts.close(self.say)


def train(
    config: Config,
    config_path: str | None = None,
    *,
    console: Console | None = None,
    launch: Launch | None = None,
) -> int:
    """Run (or resume) a training run; returns the process exit status. `launch`: how the
    CLI started it (the command line for the hints, --overwrite, where keys were set)."""
    trainer = Trainer(config, config_path=config_path, console=console, launch=launch)
    try:
        return trainer.run()
    except Exception as exc:
        if trainer.log.is_open:
            # a RetrainError names its cause; anything else is a bug, whose traceback follows
            named = isinstance(exc, RetrainError)
            trainer.say(
                f"Run failed: {exc}"
                if named
                else "Run failed on an unexpected error (its traceback follows)."
            )
            trainer.say(trainer.failed_line())
        raise
