"""The training loop. It only sequences calls: data -> prompts -> backend.sample ->
reward -> advantages -> backend.train_step -> controllers -> logs -> checkpoint.
No formula lives here."""

from __future__ import annotations

import math
import os
import signal
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from retrain import registry
from retrain.backends.base import SamplingParams, TrainHyper, backend_info
from retrain.checkpoint import (
    TrainerState,
    adapter_location,
    capture_rng,
    check_compatible,
    load_state,
    restore_rng,
    save_state,
)
from retrain.config import Config
from retrain.errors import RetrainError, TrainingError
from retrain.logs.console import Console, group_line, step_line
from retrain.logs.jsonl import JsonlWriter, truncate_from_step, write_json_atomic
from retrain.rollout import GroupRollout, VocabTable, build_datums, is_correct, planning_masks

RUN_FILE = "run.json"


def step_seed(seed: int, step: int) -> int | None:
    """The sampling seed of one step: a function of (seed, step) only, so a resumed run
    samples exactly what the uninterrupted run would have."""
    if seed < 0:
        return None
    return (seed * 1_000_003 + step * 7919 + 17) % (2**63 - 1)


class _StopRequest:
    """SIGINT/SIGTERM: finish the current step, save, exit. A second SIGINT aborts."""

    def __init__(self):
        self.signal: int | None = None
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        if threading_main():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
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
        self, config: Config, *, config_path: str | None = None, console: Console | None = None
    ):
        self.config = config
        self.config_path = config_path
        self.console = console or Console()
        self.say: Callable[[str], None] = self.console.print
        self.log_dir = Path(config.logging.log_dir)
        self.search_paths = tuple(config.plugins.search_paths)
        registry.add_search_paths(self.search_paths)

    # ------------------------------------------------------------ setup

    def preflight(self) -> None:
        """Fail before step 0 when the flow needs data the backend does not give."""
        cfg = self.config
        info = backend_info(cfg.backend.backend, self.search_paths)
        self.capabilities = info.capabilities
        kind = registry.UNCERTAINTY_KINDS.canonical(cfg.algorithm.uncertainty_kind)
        if kind == "shannon_entropy":
            engine_ok = info.name != "local" or cfg.inference.engine == "pytorch"
            if "entropy" not in info.capabilities.token_data or not engine_ok:
                raise TrainingError(
                    f"[algorithm] uncertainty_kind = shannon_entropy needs per-token entropies, but backend "
                    f"{info.name!r}{' with engine ' + repr(cfg.inference.engine) if info.name == 'local' else ''} returns only logprobs. "
                    'Fix: use uncertainty_kind = "surprisal", or the local backend with the pytorch engine.'
                )
        if not info.capabilities.preserves_token_advantages and self._flow_varies_per_token():
            raise TrainingError(
                f"backend {info.name!r} ({info.source}) does not preserve token-level advantages, and {cfg.condition} gives "
                "different advantages to tokens of one completion: they would be silently aggregated. "
                'Fix: transform_mode = "none", or a backend that preserves token advantages.'
            )

    def _flow_varies_per_token(self) -> bool:
        """Probe the configured advantage flow on a synthetic group."""
        import numpy as np

        from retrain.advantages import compute_batch_advantages

        rng = np.random.default_rng(0)
        group = {
            "rewards": [1.0, 0.0, 0.0, 1.0],
            "logprobs": [-rng.exponential(1.0, size=12) for _ in range(4)],
            "planning": [np.arange(12) < 3 for _ in range(4)],
        }
        a = self.config.algorithm
        out = compute_batch_advantages(
            [group],
            advantage_mode=a.advantage_mode,
            transform_mode=a.transform_mode,
            algorithm_mode=a.algorithm_mode or None,
            gtpo_beta=self.config.gtpo.beta,
            hicra_alpha=self.config.hicra.alpha,
            sepa_lambda=0.5,
            uncertainty_kind="surprisal",
            advantage_params=a.advantage_params,
            transform_params=a.transform_params,
            search_paths=self.search_paths,
        )
        return any(np.ptp(x) > 1e-12 for x in (out.advantages[0] or []))

    def setup(self) -> None:
        from retrain.advantages import make_detector
        from retrain.backpressure import BackPressureController
        from retrain.data import build_data_source
        from retrain.data.prompts import PromptRenderer
        from retrain.models import load_tokenizer
        from retrain.rewards import build_reward
        from retrain.sepa import SEPAScheduler

        cfg = self.config
        t = cfg.training
        self.preflight()
        if t.seed >= 0:
            import random

            import numpy as np

            random.seed(t.seed)
            np.random.seed(t.seed % 2**32)
        self.say(f"Loading tokenizer for {cfg.model.model} ...")
        self.tokenizer = load_tokenizer(cfg.model.model)
        self.say("Loading vocabulary table...")
        self.vocab = VocabTable(self.tokenizer)
        self.say(f"Vocabulary table: {len(self.vocab)} entries")
        self.say("Loading dataset...")
        env = cfg.environment
        self.data = build_data_source(
            cfg.data.source,
            path=cfg.data.path,
            task=cfg.data.task,
            args=dict(cfg.data.args),
            size=cfg.data.size,
            seed=cfg.data.seed,
            split=cfg.data.split,
            prompt_field=cfg.data.prompt_field,
            answer_field=cfg.data.answer_field,
            max_examples=t.max_examples,
            shuffle=cfg.data.shuffle,
            shuffle_seed=t.seed if t.seed >= 0 else int.from_bytes(os.urandom(4), "little"),
            search_paths=self.search_paths,
            environment=(
                {
                    "provider": env.provider,
                    "id": env.id,
                    "args": dict(env.args),
                    "max_turns": env.max_turns,
                    "auto_install": env.auto_install,
                }
                if env.provider
                else None
            ),
        )
        self.say(f"Loaded {len(self.data)} examples")
        self.renderer = PromptRenderer(
            self.tokenizer,
            system_prompt=cfg.data.system_prompt,
            instruction=cfg.data.instruction,
            few_shot=cfg.data.few_shot,
        )
        for example in self.data.examples:
            self.renderer.encode(example)
        self.say(f"Pre-encoded {len(self.data)} prompts")
        r = cfg.reward
        self.reward = getattr(self.data, "reward", None) or build_reward(
            r.type,
            judge_model=r.judge_model,
            judge_base_url=r.judge_base_url,
            judge_api_key=r.judge_api_key,
            custom_module=r.custom_module,
            custom_function=r.custom_function,
            timeout=r.timeout,
            max_concurrency=r.max_concurrency,
            max_retries=r.max_retries,
            search_paths=self.search_paths,
        )
        self.detector = make_detector(
            cfg.planning.detector,
            cfg.logging.strategic_grams or None,
            cfg.planning.model,
            cfg.planning.threshold,
        )
        s = cfg.sepa
        self.sepa = SEPAScheduler(
            steps=s.steps,
            schedule=s.schedule,
            delay_steps=s.delay_steps,
            correct_rate_gate=s.correct_rate_gate,
            ema_decay=s.ema_decay,
            var_threshold=s.var_threshold,
            warmup=s.warmup,
        )
        bp = cfg.backpressure
        self.backpressure = (
            BackPressureController(
                warmup_steps=bp.warmup_steps,
                ema_decay=bp.ema_decay,
                throttle_margin=bp.throttle_margin,
                increase_margin=bp.increase_margin,
                min_batch_size=bp.min_batch_size,
                max_batch_size=bp.max_batch_size,
                peak_gflops=bp.peak_gflops,
                peak_bw_gb_s=bp.peak_bw_gb_s,
                group_size=t.group_size,
                initial_batch_size=t.batch_size,
            )
            if bp.enabled
            else None
        )
        backend_cls = registry.BACKENDS.resolve(cfg.backend.backend, self.search_paths)
        self.backend = backend_cls(cfg, self.tokenizer, say=self.say)
        # With back pressure on, the controller picks every batch size (its warmup
        # explores from the bottom of the ladder), [training] batch_size only seeds it.
        self.batch_size = (
            self.backpressure.batch_size if self.backpressure is not None else t.batch_size
        )
        self.group_size = t.group_size
        self.start_step = 0
        self.counters: dict[str, float] = {
            "correct": 0,
            "completions": 0,
            "reward_sum": 0.0,
            "datums": 0,
            "tokens": 0,
            "skipped_steps": 0,
        }
        self.last_saved_step: int | None = None
        self.wandb = None

    def restore(self, resume_from: str) -> bool:
        """Load trainer_state.json + the backend checkpoint. False when already finished."""
        state = load_state(resume_from)
        cfg = self.config
        check_compatible(state, cfg.model.model, cfg.model.lora_rank, resume_from)
        self.backend.load_checkpoint(state.checkpoint)
        self.data.load_state_dict(state.data)
        self.sepa.load_state_dict(state.sepa)
        if self.backpressure is not None and state.backpressure:
            self.backpressure.load_state_dict(state.backpressure)
        restore_rng(state.rng)
        self.counters.update(state.counters)
        self.batch_size, self.group_size = state.batch_size, state.group_size
        self.start_step = state.step
        self.last_saved_step = state.step
        if state.condition != cfg.condition:
            self.say(
                f"Note: the checkpoint was trained as {state.condition}; continuing as {cfg.condition}"
            )
        self.say(
            f"Resumed from {resume_from} at step {state.step} (example {self.data.position}, correct so far {self._running_rate():.1%})"
        )
        return state.step < cfg.training.max_steps

    # ------------------------------------------------------------ logs

    def open_logs(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        (self.log_dir / "emergence").mkdir(exist_ok=True)
        if self.start_step > 0:
            for name in ("metrics.jsonl", "emergence/steps.jsonl", "emergence/generations.jsonl"):
                moved = truncate_from_step(self.log_dir / name, self.start_step)
                if moved:
                    self.say(
                        f"Moved {moved} rows after step {self.start_step} of {name} to its .superseded.jsonl"
                    )
        header = f"Resolved configuration of the run in {self.log_dir} (written by retrain)."
        from retrain.config.toml_writer import config_to_toml

        try:
            (self.log_dir / "config.resolved.toml").write_text(
                config_to_toml(self.config, header=header), encoding="utf-8"
            )
        except OSError as exc:
            raise RetrainError(
                f"cannot write {self.log_dir / 'config.resolved.toml'}: {exc.strerror or exc}"
            ) from exc
        self.metrics = JsonlWriter(self.log_dir / "metrics.jsonl")
        self.steps_log = JsonlWriter(self.log_dir / "emergence" / "steps.jsonl")
        self.generations = JsonlWriter(self.log_dir / "emergence" / "generations.jsonl")
        self.started = time.time()
        self._write_run("running")
        if self.config.logging.wandb_project:
            from retrain.logs.wandb import WandbSink

            self.wandb = WandbSink.start(self.config, self.say)

    def _write_run(self, status: str, **extra: Any) -> None:
        data = {
            "status": status,
            "pid": os.getpid(),
            "condition": self.config.condition,
            "config": self.config_path,
            "max_steps": self.config.training.max_steps,
            "started_at": getattr(self, "started", time.time()),
            "heartbeat": time.time(),
            **extra,
        }
        write_json_atomic(self.log_dir / RUN_FILE, data)

    def _running_rate(self) -> float:
        return (
            self.counters["correct"] / self.counters["completions"]
            if self.counters["completions"]
            else 0.0
        )

    # ------------------------------------------------------------ one step

    def run_step(self, step: int) -> dict[str, Any]:
        from retrain.advantages import compute_batch_advantages

        cfg = self.config
        t0 = time.time()
        examples = self.data.next_batch(self.batch_size)
        prompts = [self.renderer.encode(e) for e in examples]
        self.console.progress(
            step, cfg.training.max_steps, "sampling", self.started, step - self.start_step
        )
        kind = registry.UNCERTAINTY_KINDS.canonical(cfg.algorithm.uncertainty_kind)
        params = SamplingParams(
            max_tokens=cfg.training.max_tokens,
            temperature=cfg.training.temperature,
            seed=step_seed(cfg.training.seed, step),
            return_entropy=kind == "shannon_entropy",
        )
        samples = self.backend.sample(prompts, self.group_size, params)
        t_sample = time.time()

        self.console.progress(
            step, cfg.training.max_steps, "scoring", self.started, step - self.start_step
        )
        texts = [
            [self.tokenizer.decode(s.token_ids, skip_special_tokens=True) for s in group]
            for group in samples
        ]
        flat_texts = [x for group in texts for x in group]
        flat_examples = [e for e, group in zip(examples, samples, strict=True) for _ in group]
        scored = self.reward.score_batch(flat_texts, flat_examples)
        groups, k = [], 0
        for prompt, group, group_texts in zip(prompts, samples, texts, strict=True):
            n = len(group)
            groups.append(
                GroupRollout(
                    prompt,
                    group,
                    group_texts,
                    list(scored.rewards[k : k + n]),
                    list(scored.answers[k : k + n]),
                )
            )
            k += n
        t_score = time.time()

        correct = sum(g.num_correct for g in groups)
        total = sum(len(g.samples) for g in groups)
        correct_rate = correct / total if total else 0.0
        planning = [planning_masks(self.detector, self.vocab, g.samples) for g in groups]
        a = cfg.algorithm
        batch = compute_batch_advantages(
            [
                {
                    "rewards": g.rewards,
                    "logprobs": [s.logprobs for s in g.samples],
                    "planning": plan,
                    "entropies": [s.entropies for s in g.samples]
                    if kind == "shannon_entropy"
                    else None,
                }
                for g, plan in zip(groups, planning, strict=True)
            ],
            advantage_mode=a.advantage_mode,
            transform_mode=a.transform_mode,
            algorithm_mode=a.algorithm_mode or None,
            gtpo_beta=cfg.gtpo.beta,
            hicra_alpha=cfg.hicra.alpha,
            sepa_lambda=lambda stats: self.sepa.update(step, correct_rate, stats.exec_var),
            uncertainty_kind=a.uncertainty_kind,
            advantage_params=a.advantage_params,
            transform_params=a.transform_params,
            step=step,
            search_paths=self.search_paths,
        )
        datums = build_datums(groups, batch.advantages)
        t_adv = time.time()

        self.console.progress(
            step,
            cfg.training.max_steps,
            f"training on {len(datums)} completions",
            self.started,
            step - self.start_step,
        )
        o = cfg.optimizer
        hyper = TrainHyper(
            lr=cfg.training.lr,
            weight_decay=cfg.training.weight_decay,
            beta1=o.beta1,
            beta2=o.beta2,
            eps=o.eps,
            max_grad_norm=o.max_grad_norm,
        )
        result = self.backend.train_step(datums, hyper)
        if not math.isfinite(result.loss):
            raise TrainingError(
                f"step {step}: the backend reported a non-finite loss ({result.loss}); stopping (the last checkpoint is kept)"
            )
        t_train = time.time()

        lengths = [len(s.token_ids) for g in groups for s in g.samples]
        rewards = [r for g in groups for r in g.rewards]
        self.counters["correct"] += correct
        self.counters["completions"] += total
        self.counters["reward_sum"] += sum(rewards)
        self.counters["datums"] += len(datums)
        self.counters["tokens"] += sum(lengths)
        step_time = t_train - t0
        row: dict[str, Any] = {
            "step": step,
            "condition": cfg.condition,
            "loss": result.loss,
            "loss_is_placeholder": not self.capabilities.reports_sync_loss,
            "mean_reward": sum(rewards) / len(rewards) if rewards else 0.0,
            "correct_rate": correct_rate,
            "running_correct_rate": self._running_rate(),
            "num_datums": len(datums),
            "batch_size": self.batch_size,
            "group_size": self.group_size,
            "sepa_lambda": batch.stats.sepa_lambda,
            "sepa_gate_open": self.sepa.gate_open,
            "step_time_s": step_time,
            "time_sampling_s": t_sample - t0,
            "time_scoring_s": t_score - t_sample,
            "time_advantages_s": t_adv - t_score,
            "time_training_s": t_train - t_adv,
            "tokens_generated": sum(lengths),
            "tokens_per_s": sum(lengths) / max(t_sample - t0, 1e-9),
            "mean_completion_tokens": sum(lengths) / len(lengths) if lengths else 0.0,
            "max_token_hit_rate": sum(s.stop_reason == "length" for g in groups for s in g.samples)
            / max(total, 1),
            **batch.stats.to_metrics(),
            "grad_norm": result.grad_norm,
            "log_ratio_mean": result.log_ratio_mean,
            "log_ratio_max_abs": result.log_ratio_max_abs,
            "trained_tokens": result.num_tokens,
            "reward_errors": scored.errors,
            "reward_timeouts": scored.timeouts,
            "no_answer_rate": scored.no_answer_rate,
            "lr": cfg.training.lr,
            "examples_seen": self.data.position,
            "epoch": self.data.epoch,
            "elapsed_s": time.time() - self.started,
            "time": time.time(),
            **result.extra,
        }
        if kind == "shannon_entropy":
            ents = [e for g in groups for s in g.samples for e in (s.entropies or [])]
            row["token_entropy_mean"] = sum(ents) / len(ents) if ents else None
        if self.backpressure is not None:
            throughput = total / max(t_sample - t0 + t_train - t_adv, 1e-9)
            decision = self.backpressure.observe(self.batch_size, throughput)
            row.update(decision.as_metrics())
            self.batch_size = decision.batch_size
        self._log_step(step, row, examples, groups, planning, batch)
        return row

    def _log_step(self, step, row, examples, groups, planning, batch) -> None:
        cfg = self.config
        for g, e in list(zip(groups, examples, strict=True))[: cfg.logging.group_lines]:
            self.say(group_line(g.num_correct, len(g.samples), e.reference))
        self.say(
            step_line(
                step,
                cfg.condition,
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
        )
        self.metrics.write(row)
        self.steps_log.write(
            {
                "step": step,
                "condition": cfg.condition,
                "mean_reward": row["mean_reward"],
                "correct_rate": row["correct_rate"],
                "sepa_lambda": row["sepa_lambda"],
                "num_planning_tokens": row["num_planning_tokens"],
                "planning_token_rate": row["num_planning_tokens"] / max(row["tokens_generated"], 1),
                "exec_entropy_mean": row["exec_entropy_mean"],
                "plan_entropy_mean": row["plan_entropy_mean"],
                "mean_completion_tokens": row["mean_completion_tokens"],
                "skipped_all_correct": row["skipped_all_correct"],
                "skipped_all_wrong": row["skipped_all_wrong"],
            }
        )
        rows = []
        for gi, (g, e, plan, adv) in enumerate(
            zip(groups, examples, planning, batch.advantages, strict=True)
        ):
            for i, s in enumerate(g.samples):
                rows.append(
                    {
                        "step": step,
                        "group": gi,
                        "index": i,
                        "prompt": e.prompt,
                        "reference": e.reference,
                        "completion": g.texts[i],
                        "reward": g.rewards[i],
                        "answer": g.answers[i],
                        "correct": is_correct(g.rewards[i]),
                        "num_tokens": len(s.token_ids),
                        "stop_reason": s.stop_reason,
                        "planning_tokens": int(plan[i].sum()),
                        "advantage_mean": float(adv[i].mean())
                        if adv is not None and len(adv[i])
                        else None,
                    }
                )
        self.generations.write_many(rows)
        if self.wandb is not None:
            self.wandb.log(row, rows)
        self._write_run("running", step=step + 1)

    # ------------------------------------------------------------ checkpoints

    def checkpoint(self, step: int, *, final: bool = False) -> None:
        """Save after `step` steps are complete: backend first, then the state file."""
        cfg = self.config
        name = "final" if final else f"checkpoint_step_{step}"
        info = self.backend.save_checkpoint(Path(cfg.backend.adapter_path) / name)
        state = TrainerState(
            step=step,
            model=cfg.model.model,
            lora_rank=cfg.model.lora_rank,
            condition=cfg.condition,
            batch_size=self.batch_size,
            group_size=self.group_size,
            data=self.data.state_dict(),
            counters=dict(self.counters),
            sepa=self.sepa.state_dict(),
            checkpoint=info,
            backpressure=self.backpressure.state_dict() if self.backpressure is not None else None,
            rng=capture_rng(),
            finished=final,
        )
        save_state(self.log_dir, state)
        self.last_saved_step = step
        self.last_adapter = adapter_location(info)
        where = self.last_adapter
        self.say(
            f"Saved {'final adapter' if final else 'checkpoint'} at step {step}"
            + (f" -> {where}" if where else "")
        )

    # ------------------------------------------------------------ the loop

    def run(self) -> int:
        cfg = self.config
        self.setup()
        resume_from = cfg.resume.from_
        if resume_from and not self.restore(resume_from):
            self.say(
                f"Nothing to do: the run in {resume_from} already finished {cfg.training.max_steps} steps (raise --max-steps to continue)."
            )
            return 0
        self.open_logs()
        stop = _StopRequest()
        stop.install()
        step = self.start_step
        status = "failed"
        try:
            for step in range(self.start_step, cfg.training.max_steps):
                self.run_step(step)
                done = step + 1
                if (
                    cfg.training.save_every
                    and done % cfg.training.save_every == 0
                    and done < cfg.training.max_steps
                ):
                    self.checkpoint(done)
                if stop.signal is not None:
                    if self.last_saved_step != done:
                        self.checkpoint(done)
                    self.console.done()
                    self.say(self._resume_hint(done))
                    status = "interrupted"
                    return 130 if stop.signal == signal.SIGINT else 143
            self.checkpoint(cfg.training.max_steps, final=True)
            status = "finished"
            self.console.done()
            self.say(self._summary())
            return 0
        except KeyboardInterrupt:
            status = "interrupted"
            self.console.done()
            self.say(
                f"Aborted during step {step}; the last checkpoint (step {self.last_saved_step}) is kept."
            )
            raise
        finally:
            stop.restore()
            self._close(status)

    def _resume_hint(self, step: int) -> str:
        cfg_arg = (
            f" {self.config_path}"
            if self.config_path and self.config_path != "retrain.toml"
            else ""
        )
        return f"Stopped after step {step}. Resume with: retrain{cfg_arg} --resume {self.log_dir}"

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
        return f"Done: {self.config.training.max_steps} steps, {trend}logs in {self.log_dir}, adapter in {self.last_adapter}"

    def _close(self, status: str) -> None:
        for name in ("metrics", "steps_log", "generations"):
            writer = getattr(self, name, None)
            if writer is not None:
                writer.close()
        if hasattr(self, "metrics"):
            try:
                self._write_run(status, step=self.last_saved_step, finished_at=time.time())
            except RetrainError as exc:  # e.g. the disk filled up: report, keep the original error
                self.say(f"warning: {exc}")
        if self.wandb is not None:
            self.wandb.finish(status)
        for obj in (
            getattr(self, "reward", None),
            getattr(self, "backend", None),
            getattr(self, "data", None),
        ):
            close = getattr(obj, "close", None)
            if close is not None:
                try:
                    close()
                except Exception as exc:  # closing must not hide the run's own error
                    self.say(f"warning: closing {type(obj).__name__} failed: {exc}")


def train(config: Config, config_path: str | None = None, *, console: Console | None = None) -> int:
    """Run (or resume) a training run; returns the process exit status."""
    trainer = Trainer(config, config_path=config_path, console=console)
    try:
        return trainer.run()
    except RetrainError as exc:
        if hasattr(trainer, "metrics"):
            trainer.say(f"Run failed: {exc}")
        raise
