"""`retrain explain [PATH] [--json]`: load and validate a config and say what it would do.

Never imports torch: everything here comes from the config and the registry entries
(a dotted-path backend is imported for its capability hooks).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import Any

from retrain import hardware
from retrain.backends.base import BackendInfo, backend_info
from retrain.build import world_of
from retrain.campaign.expand import (
    Condition,
    RunSpec,
    campaign_conditions,
    check_runs,
    expand_run,
)
from retrain.cli.advice import advice, resume_advice
from retrain.cli.estimates import engine_traits, estimates, local_options
from retrain.cli.run import config_path, is_standalone_squeeze, refuse_overwrite
from retrain.cli.startup_checks import missing_modules, startup_problems, where_set
from retrain.cli.summaries import (
    backpressure_summary,
    data_summary,
    eval_summary,
    named_algorithm,
    objective_summary,
    periodic_checkpoints,
    reward_summary,
    sepa_summary,
    shaping_summary,
    uses_sepa,
)
from retrain.config import Config, load_config, load_dotenv
from retrain.config.schema import FALLBACK_MAX_TURNS
from retrain.config.validate import Problems, device_kind, training_device
from retrain.data.env_probe import EnvironmentReport
from retrain.engines.decoders import decoder_for, sharded_problem
from retrain.engines.decoders import describe as describe_decoder
from retrain.errors import ConfigError, PluginError
from retrain.hardware import matmul_dtype, no_native_bf16, whole_model_bf16
from retrain.kernels import flex
from retrain.logs import ownership
from retrain.logs.console import format_duration
from retrain.models import HubAsk, ask_hub
from retrain.startup import (
    backend_problems,
    condition_problems,
    engine_problems,
    preflight_problems,
)
from retrain.types import BackendCapabilities
from retrain.world import World


def _squeeze_report(
    config: Config, path: str | None, launch: ownership.Launch | None
) -> dict[str, Any]:
    """A standalone squeeze: what it does, and what it would refuse before any weights
    load (retrain/squeeze.py's `config_problems`, the squeeze run's own check)."""
    from retrain.squeeze import config_problems

    sq = config.squeeze
    problems = config_problems(
        sq.adapter_path,
        target_ranks=sq.target_ranks,
        source_rank=sq.source_rank,
        output_path=sq.output_path,
        compress_to=sq.compress_to,
        device=sq.device,
    )
    return {
        "config": path,
        "kind": "squeeze",
        "adapter_path": sq.adapter_path,
        "min_variance_retention": sq.min_variance_retention,
        "target_ranks": sq.target_ranks or "powers of two up to the source rank",
        "output_path": sq.output_path or None,
        "compress_to": sq.compress_to or "recommended",
        "warnings": [],
        "errors": [f"{key}{where_set(config, path, key, launch)}: {p}" for key, p in problems],
    }


def _backend(config: Config) -> tuple[BackendInfo, bool]:
    """The configured backend's info, and whether it resolved: a plugin that cannot be
    imported is described with conservative defaults (the startup checks report it,
    under its key: startup.plugin_problems)."""
    name = config.backend.backend
    try:
        return backend_info(name, tuple(config.plugins.search_paths)), True
    except (PluginError, TypeError, ValueError):
        return BackendInfo(name, BackendCapabilities(), {}, "plugin/default"), False


def _per_step(config: Config, env: EnvironmentReport | None) -> dict[str, Any]:
    """A step's completions and its sampled-token upper bound. With an environment the
    cap applies to each model turn of a conversation: the turns are the probed
    environment's cap (`env`), else the configured one, else the fallback cap."""
    t = config.training
    completions = t.batch_size * t.group_size
    turns, source = 1, ""
    if config.environment.provider and (env is None or env.multi_turn):
        if config.environment.max_turns > 0:
            turns, source = config.environment.max_turns, "[environment] max_turns"
        elif env is not None:  # the cap the run takes: the environment's, or the fallback
            turns, source = env.max_turns, "the probed environment's turn cap"
        else:  # not probed (it did not load): its own cap is unknown here
            turns = FALLBACK_MAX_TURNS
            source = (
                f"the fallback cap of {FALLBACK_MAX_TURNS} turns for max_turns = -1: "
                "the environment was not probed, its own cap applies where it sets one"
            )
    return {
        "tokens_per": "model turn" if config.environment.provider else "completion",
        "batch_size": t.batch_size,
        "group_size": t.group_size,
        "completions": completions,
        "max_new_tokens_per_completion": t.max_tokens,
        "turns": turns,
        "turns_source": source or None,
        "sampled_token_upper_bound": completions * t.max_tokens * turns,
    }


def _checkpoints(config: Config, info: BackendInfo, max_steps: int) -> dict[str, Any]:
    every = config.training.save_every
    remote = "[backend] adapter_path" in info.ignores
    path = config.backend.adapter_path
    if config.campaign is not None:  # each run gets its own (campaign/expand.py)
        from retrain.campaign.expand import campaign_root

        path = f"{campaign_root(config)}/campaign_*/runs/CONDITION_sSEED/adapter"
    return {
        "every": every,
        "periodic": periodic_checkpoints(max_steps, every),
        "final": True,
        "adapter_path": "on the backend's service" if remote else path,
    }


def _condition_report(cond: Condition, runs: list[RunSpec]) -> dict[str, Any]:
    """One condition of the matrix: its label, modes, overrides (the field each sets and
    the value its runs get) and its runs."""
    cfg = runs[0].config
    return {
        "label": cond.label,
        "advantage_mode": cond.advantage_mode,
        "transform_mode": cond.transform_mode,
        "overrides": [
            {
                "key": o.key,
                "field": o.spec.label,
                "value": getattr(getattr(cfg, o.spec.table), o.spec.attr),
            }
            for o in sorted(cond.overrides, key=lambda o: o.key)
        ],
        "max_steps": cfg.training.max_steps,
        "runs": [r.name for r in runs],
        "algorithm": named_algorithm(cfg),
        "sepa": sepa_summary(cfg),
        "uses_sepa": uses_sepa(cfg),
    }


def _campaign_sepa(conds: list[dict[str, Any]]) -> str:
    """The SEPA line of a campaign: each schedule its conditions run (with their own
    max_steps), and which conditions do not use it."""
    used: dict[str, list[str]] = {}
    for c in conds:
        if c["uses_sepa"]:
            used.setdefault(c["sepa"], []).append(c["label"])
    parts = [f"{text} ({', '.join(labels)})" for text, labels in used.items()]
    unused = [c["label"] for c in conds if not c["uses_sepa"]]
    if unused:
        parts.append(f"not used by {', '.join(unused)}")
    return "; ".join(parts)


def _campaign_report(
    config: Config, errors: list[str], check: Callable[[Config], Problems], base: Problems
) -> dict[str, Any]:
    """The matrix; each condition's first run is checked the way the campaign checks
    every run before it starts: reloaded, preflighted as the run preflights it and, where
    its overrides change the base config, `check`ed (the startup checks); problems the
    base config has (`base`) are its own (its problems go to `errors`)."""
    camp = config.campaign
    seeds = list(camp.seeds)
    matrix = [
        (cond, [expand_run(config, cond, seed, "CAMPAIGN_DIR") for seed in seeds])
        for cond in campaign_conditions(config)
    ]
    conds = [_condition_report(cond, runs) for cond, runs in matrix if runs]
    n_runs = len(matrix) * len(seeds)
    if camp.executor == "ray":
        executor = "ray"
    else:
        executor = "parallel" if camp.parallel else "sequential"
    errors += check_runs(runs[0] for _, runs in matrix if runs)
    firsts = [(cond.label, runs[0].config, bool(cond.overrides)) for cond, runs in matrix if runs]
    errors += condition_problems(firsts, base, check)
    return {
        "conditions": [cond.label for cond, _ in matrix],
        "condition_details": conds,
        "seeds": seeds,
        "runs": n_runs,
        "max_steps_per_run": camp.max_steps,
        "total_steps": sum(c["max_steps"] * len(seeds) for c in conds),
        "executor": executor,
        # ray runs up to max_workers tasks at once whatever `parallel` says (campaign/run.py)
        "max_workers": (camp.max_workers or n_runs) if executor != "sequential" else 1,
        "auto_squeeze": config.squeeze is not None,
        "matrix": [name for c in conds for name in c["runs"]],
    }


def _campaign_wall_time(camp: dict[str, Any], step_s: float | None) -> dict[str, Any] | None:
    """A rough wall time: every run's steps at the base config's estimated time per step,
    over the runs that go at once (None without a step-time estimate)."""
    if step_s is None:
        return None
    at_once = max(1, min(camp["max_workers"], camp["runs"]))
    return {"seconds": camp["total_steps"] * step_s / at_once, "at_once": at_once}


def _campaign_flag_errors(config: Config, launch: ownership.Launch) -> list[str]:
    """`--max-steps` sets a campaign's runs' steps (config/load.py) unless
    `--campaign-max-steps` is given too: two different numbers, one of them ignored."""
    flag = launch.origin("training", "max_steps")
    steps = config.training.max_steps
    if not flag.startswith(" (from ") or steps == config.campaign.max_steps:
        return []
    return [
        f"[training] max_steps{flag}: a campaign's runs take [campaign] max_steps "
        f"({config.campaign.max_steps}, from --campaign-max-steps), so {steps} would be "
        "ignored. Fix: give only one of --max-steps and --campaign-max-steps"
    ]


# ----------------------------------------------------------------------------- resolved
# settings (the estimates: retrain/cli/estimates.py)


def _auto_dtype_why(dtype: str, index: int) -> str | None:
    """Why `dtype = "auto"` resolved to `dtype` on gpu:`index`, where worth saying: fp32
    on a GPU without native bf16; bf16 read from an unknown GPU (mixed models without PCI
    order), which torch decides at the start."""
    if dtype == "fp32":
        return no_native_bf16(index)
    unordered = hardware.gpu_order_unknown()
    return f"bf16 unless torch's gpu:{index} lacks it ({unordered})" if unordered else None


def resolved_settings(config: Config, info: BackendInfo) -> dict[str, Any]:
    """The values that shape a run, after the TOML, .env and CLI flags."""
    t, o = config.training, config.optimizer
    ignored = set(info.ignores)
    out: dict[str, Any] = {
        "lr": t.lr,
        "lr_schedule": getattr(t, "lr_schedule", "constant"),
        "warmup_steps": getattr(t, "warmup_steps", 0),
        "weight_decay": t.weight_decay,
        "temperature": t.temperature,
        "top_p": t.top_p,
        "max_tokens": t.max_tokens,
        "seed": t.seed,
        "optimizer": {
            "name": "AdamW",
            "beta1": o.beta1,
            "beta2": o.beta2,
            "eps": o.eps,
            "max_grad_norm": o.max_grad_norm,
        },
        "lora": _lora_used(config, ignored),
        "loss": {
            name: getattr(t, name)
            for name in (
                "policy_loss",
                "loss_agg",
                "clip_eps",
                "clip_eps_high",
                "clip_ratio_c",
                "adv_clip_max",
                "kl_coef",
                "kl_estimator",
            )
            if hasattr(t, name)
        },
        "devices": None if "[backend] devices" in ignored else config.backend.devices,
    }
    if config.backend.backend == "local":
        opts = local_options(config)
        _, kind, index = training_device(config)
        out["matmuls"] = matmul_dtype(opts["dtype"], kind, index)
        if opts["dtype"] == "auto" and kind == "cuda":
            out["matmuls_why"] = _auto_dtype_why(out["matmuls"], index)
        out["whole_model_bf16"] = whole_model_bf16(out["matmuls"], kind)
        out["micro_batch_tokens"] = opts["micro_batch_tokens"]
        out["checkpointing"] = opts["checkpointing"]
        blocked = flex.device_blockers(out["matmuls"], kind, index)
        out["attention"] = flex.describe(opts["attention"], kind, blocked)
        out["compiled_blocks"] = opts["compile"] is True
    if "[inference]" in ignored:
        out["inference"] = {
            "engine": f"the {info.name} backend's own sampler",
            "url": config.model.base_url or None,
        }
    elif "[inference] engine" in ignored:  # prime_rl: its own server, at [inference] url
        out["inference"] = {
            "engine": f"the {info.name} backend's inference server",
            "url": config.inference.url or None,
        }
    else:
        out["inference"] = {
            "engine": config.inference.engine,
            "url": config.inference.url or None,
        }
        traits = engine_traits(config)
        if config.backend.backend == "local" and traits is not None and traits.in_process:
            sampler = device_kind(config)  # checked by the config's validation
            opts = local_options(config)
            option, sharded = opts["decode"], opts.get("shard") is True
            if sharded and sharded_problem(option, sampler):  # a config error of its own
                out["inference"]["decode"] = f"{option} (refused with shard = true)"
            else:
                decoder = decoder_for(option, sampler, sharded)
                out["inference"]["decode"] = describe_decoder(decoder, sampler)
    return out


def _lora_used(config: Config, ignored: set[str]) -> dict[str, Any]:
    """The LoRA settings the backend takes from the config; `backend_own` names those it
    chooses itself (its `ignores`: tinker `[lora] alpha/dropout/target_modules`, prime_rl
    the whole `[lora]` table, and with it the rank: its trainer's LoRA layout)."""
    lora, rank = config.lora, config.model.lora_rank
    values = {
        "rank": rank,
        "alpha": lora.alpha or 2 * rank,
        "dropout": lora.dropout,
        "target_modules": list(lora.target_modules) or "all-linear",
    }
    own: list[str] = list(values) if "[lora]" in ignored else []
    for spec in ignored:
        if spec.startswith("[lora] "):
            own += spec.removeprefix("[lora] ").split("/")
    used = {k: v for k, v in values.items() if k not in own}
    return used | ({"backend_own": own} if own else {})


def _lora_text(lora: dict[str, Any], backend: str) -> str:
    parts = [
        f"{name} {lora[name]:g}" if name == "dropout" else f"{name} {lora[name]}"
        for name in ("rank", "alpha", "dropout", "target_modules")
        if name in lora
    ]
    text = ", ".join(parts).replace("target_modules", "modules")
    if lora.get("backend_own"):
        own = f"{', '.join(lora['backend_own'])}: the {backend} backend's own"
        text = f"{text}; {own}" if text else own
    return text


def _micro_batch_text(settings: dict[str, Any], est: dict[str, Any] | None) -> str:
    """`micro_batch_tokens` as set, and what "auto" resolves to on this machine."""
    chosen = (est or {}).get("micro_batch_tokens")
    if settings["micro_batch_tokens"] != "auto":
        return f"{settings['micro_batch_tokens']} tokens"
    return f"{chosen} tokens (auto)" if chosen else "auto size (set at start from free memory)"


def _checkpointing_text(settings: dict[str, Any], est: dict[str, Any] | None) -> str:
    """Activation checkpointing as set, and what "auto" resolves to on this machine."""
    if settings["checkpointing"] != "auto":
        return "on" if settings["checkpointing"] else "off"
    est = est or {}
    on, why = est.get("checkpointing"), est.get("checkpointing_auto")
    if on is None or not why:
        return f"auto ({why})" if why else "auto"
    return f"{'on' if on else 'off'} (auto: {why})"


def _memory_text(est: dict[str, Any]) -> str:
    """The Memory line: the device's memory, parameters, and the peak estimate."""
    device = ""
    if est.get("device"):
        free, total = est.get("device_free_gib"), est.get("device_total_gib")
        memory = f"{free:.1f} of {total:.1f} GiB free" if free is not None else "memory unknown"
        device = f"{est['device']}: {memory}; "
    params = f"{est['model_params'] / 1e6:,.0f}M params; " if est.get("model_params") else ""
    if est.get("peak_memory_gib") is None:
        return device + params + est.get("memory_note", "unknown")
    problem = est.get("memory_problem") or {}
    if problem.get("what") == "completion":  # the peak fits; its own warning says the rest
        problem = {}
    flag = {"error": ", OVER the free memory", "warning": ", close to the free memory"}
    return (
        f"{device}{params}peak ~{est['peak_memory_gib']:g} GiB"
        f"{flag.get(problem.get('level'), '')} ({est['memory_note']})"
    )


def _render_settings(report: dict[str, Any]) -> list[str]:
    s, est = report.get("settings"), report.get("estimates")
    lines = []
    if s:
        o, lora, inf = s["optimizer"], s["lora"], s["inference"]
        warm = f", {s['warmup_steps']} warmup" if s.get("warmup_steps") else ""
        lines.append(
            f"Training:    lr {s['lr']:g} ({s['lr_schedule']}{warm}), weight decay {s['weight_decay']:g}, "
            f"temperature {s['temperature']:g}, top_p {s['top_p']:g}, seed "
            + ("per run ([campaign] seeds)" if report.get("campaign") else str(s["seed"]))
        )
        lines.append(
            f"Optimizer:   {o['name']} betas ({o['beta1']:g}, {o['beta2']:g}), eps {o['eps']:g}, "
            f"grad clip {o['max_grad_norm'] or 'off'}"
        )
        lines.append(f"LoRA:        {_lora_text(lora, report['backend']['name'])}")
        if s["loss"]:
            loss = ", ".join(f"{k} {v}" for k, v in s["loss"].items())
            lines.append(f"Loss:        {loss}{_base_of_campaign(report)}")
        where = f" at {inf['url']}" if inf.get("url") else ""
        dev = f" on {s['devices']}" if s.get("devices") else ""
        decode = f", decode: {inf['decode']}" if inf.get("decode") else ""
        lines.append(f"Sampling:    {inf['engine']}{where}{dev}{decode}")
        if s.get("matmuls"):
            why = f"; auto: {s['matmuls_why']}" if s.get("matmuls_why") else ""
            what = (
                "bf16 model (float32 adapter weights, computed in bf16; float32 logits; "
                f"norms and gated MLPs keep only their inputs for the backward{why})"
                if s.get("whole_model_bf16")
                else f"{s['matmuls']} matmuls (float32 adapter and logits{why})"
            )
            lines.append(
                f"Compute:     {what}, micro-batches "
                f"of {_micro_batch_text(s, est)}, activation checkpointing: "
                f"{_checkpointing_text(s, est)}, attention: {s['attention']}"
                + (
                    ", transformer blocks compiled (torch.compile)"
                    if s.get("compiled_blocks")
                    else ""
                )
            )
    if est:
        lines.append(f"Memory:      {_memory_text(est)}")
        step = (
            f"~{est['step_time_s']:g} s/step ({est['step_time_source']})"
            if est.get("step_time_s") is not None
            else est.get("step_time_source", "unknown")
        )
        recent = est.get("recent_run")
        if recent and recent.get("sampled_tokens_per_s") and not recent["differs"]:
            step += f"; sampling {recent['sampled_tokens_per_s']:,.0f} tokens/s"
        lines.append(f"Step time:   {step}")
    return lines


def _backend_entry(info, config: Config) -> dict[str, Any]:
    from retrain.build import ignored_settings

    return {
        "name": info.name,
        "source": info.source,
        "capabilities": info.capabilities.as_dict(),
        "ignored_sections": list(info.ignores),  # what the backend never reads
        "ignored_set": list(ignored_settings(config, info.ignores)),  # ... that this sets
    }


def build_report(
    config: Config,
    path: str | None,
    launch: ownership.Launch | None = None,
    *,
    ask: HubAsk | None = ask_hub,
    world: World | None = None,
) -> dict[str, Any]:
    """What the config would do, and every problem the run would stop on before its first
    step. `path`: the config file, None for the built-in defaults plus flags; `launch`:
    the command line explained (its flags and --overwrite), for the directories that
    hold another run and the keys flags set; `ask`: the hub request of the model check
    (None skips it)."""
    if is_standalone_squeeze(config):
        return _squeeze_report(config, path, launch)
    errors: list[str] = []
    world = world or world_of(config)  # torchrun's WORLD_SIZE, or --world-size
    launch = launch or ownership.launch_for(path)
    info, resolved = _backend(config)
    flow_info = info if resolved else None  # no flow checks against a guessed backend
    if config.campaign is None:  # a campaign's runs are preflighted per condition
        errors += [
            f"{key}{where_set(config, path, key, launch)}: {problem}"
            for key, problem in preflight_problems(config, flow_info)[0]
        ]
    max_steps = (
        config.campaign.max_steps if config.campaign is not None else config.training.max_steps
    )
    lora = _lora_used(config, set(info.ignores))
    report: dict[str, Any] = {
        "config": path,
        "kind": "campaign" if config.campaign is not None else "run",
        "condition": config.condition,
        "backend": _backend_entry(info, config),
        "model": {
            "model": config.model.model,
            "lora_rank": lora.get("rank"),
            "lora_alpha": lora.get("alpha"),
        },
        "data": data_summary(config),
        "reward": reward_summary(config),
        "uncertainty_kind": config.algorithm.uncertainty_kind,
        "objective": objective_summary(config),
        "algorithm": named_algorithm(config),
        "settings": resolved_settings(config, info),
        "estimates": estimates(config, info, world),
        "world": _world(config, world),
        "per_step": None,  # with the probed environment's turns: `_input_errors`
        "total_steps": max_steps,
        "checkpoints": _checkpoints(config, info, max_steps),
        "sepa": sepa_summary(config),
        "backpressure": backpressure_summary(config),
        "shaping": shaping_summary(config),
        "eval": eval_summary(config),
        "log_dir": config.logging.log_dir,
        "resume_from": config.resume.from_ or None,
        "wandb": config.logging.wandb_project or None,
    }
    # a module the run's start checks itself (it has no module check) is said twice
    startup = list(dict.fromkeys(startup_problems(config, ask, world)))
    if config.campaign is not None:
        check = partial(startup_problems, ask=ask, world=world)
        errors += _add_campaign(report, config, launch, check, startup)
    errors += [
        f"{key}{where_set(config, path, key, launch)}: {problem}" for key, problem in startup
    ]
    errors += _input_errors(config, path, report, launch)
    occupied, moved = ownership.check(config, launch)
    errors += occupied
    # An engine's server must answer before step 0 (the run would stop there), so its
    # problems are errors; a backend's own probe (prime_rl) may find a server started later.
    errors += [f"{key}: {problem}" for key, problem in engine_problems(config)]
    probed = [f"{key}: {problem}" for key, problem in backend_problems(config)]
    report["warnings"] = advice(config) + probed + moved + resume_advice(config, launch)
    memory = report["estimates"].get("memory_problem")
    if memory and config.backend.backend == "local":  # the local backend refuses it too
        (errors if memory["level"] == "error" else report["warnings"]).append(memory["message"])
    report["errors"] = errors
    return report


def _add_campaign(
    report: dict[str, Any],
    config: Config,
    launch: ownership.Launch,
    check: Callable[[Config], Problems],
    base: Problems,
) -> list[str]:
    """The matrix in `report` (the base config's own condition is no run's: each
    condition is named in it); the errors of its runs and flags."""
    errors: list[str] = []
    campaign = report["campaign"] = _campaign_report(config, errors, check, base)
    campaign["wall_time"] = _campaign_wall_time(campaign, report["estimates"].get("step_time_s"))
    report["total_steps"] = campaign["total_steps"]
    report["sepa"] = _campaign_sepa(campaign["condition_details"])
    report["condition"] = report["algorithm"] = None
    return errors + _campaign_flag_errors(config, launch)


def _world(config: Config, world: World) -> dict[str, Any]:
    """The run's processes: one, or torchrun's ranks and each one's share of a step."""
    t = config.training
    return {
        "size": world.size,
        "prompts_per_rank": t.batch_size / world.size,
        "completions_per_rank": t.batch_size * t.group_size / world.size,
    }


def _world_line(w: dict[str, Any]) -> list[str]:
    if w["size"] == 1:
        return []
    share = f"{w['prompts_per_rank']:g} prompts ({w['completions_per_rank']:g} completions)"
    return [
        f"Ranks:       {w['size']} processes (torchrun), {share} per rank per step; the "
        "memory estimate is per rank; rank 0 writes logs and checkpoints"
    ]


def _input_errors(
    config: Config, path: str | None, report: dict[str, Any], launch: ownership.Launch
) -> list[str]:
    """The environment and the JSONL files, probed as the run's start loads them: their
    summaries go into `report` (the environment's turn cap into its per-step bound), what
    the run would stop with is returned."""
    env, env_errors = environment_report(config)
    report["environment"] = env.summary() if env is not None else None
    report["per_step"] = _per_step(config, env)
    examples, data_errors = data_file_report(config)
    if examples is not None:
        report["data"] += f"; {examples:,} example{'s' if examples != 1 else ''}"
    return [
        f"{key}{where_set(config, path, key, launch)}: {p}" for key, p in env_errors + data_errors
    ]


def data_file_report(config: Config) -> tuple[int | None, list[tuple[str, str]]]:
    """The JSONL files the run reads (`[data] path`, and `[eval] path` while eval is on),
    read as its start reads them: the training file's example count, and a malformed
    line or a missing field as the error the run would stop with."""
    d, e = config.data, config.eval
    if config.environment.provider or d.source != "jsonl":
        return None, []
    from retrain.data.jsonl import read_jsonl_examples
    from retrain.errors import DataError

    count, errors = None, []
    files = [("[data] path", d.path)] + ([("[eval] path", e.path)] if e.every > 0 else [])
    for key, path in files:
        try:
            examples = read_jsonl_examples(path, d.prompt_field, d.answer_field)
        except DataError as exc:
            errors.append((key, str(exc)))
            continue
        if key == "[data] path":
            count = len(examples)
    return count, errors


def environment_report(
    config: Config,
) -> tuple[EnvironmentReport | None, list[tuple[str, str]]]:
    """An `[environment]` imported and instantiated (no model, a timeout): what it is,
    or the error the run would stop with at its start."""
    env = config.environment
    if not env.provider or (env.provider == "verifiers" and missing_modules(("verifiers",))):
        return None, []  # no environment, or the missing module is reported already
    from retrain.data.env_probe import probe_environment
    from retrain.errors import RetrainError

    try:
        return probe_environment(config), []
    except RetrainError as exc:
        key = "[environment] module" if env.module else "[environment] id"
        if env.provider == "openenv":
            key = "[environment] base_url" if env.base_url else "[environment] id"
        return None, [(key, str(exc))]


def render(report: dict[str, Any]) -> str:
    if report["kind"] == "squeeze":
        lines = [
            f"Config: {report['config'] or 'none: the built-in defaults plus the flags'}  (standalone LoRA-Squeeze)",
            f"Adapter: {report['adapter_path']}",
            f"Keep >= {report['min_variance_retention']:.0%} of the variance; ranks: {report['target_ranks']}",
            f"Compress: {'to ' + str(report['compress_to']) + ' -> ' + report['output_path'] if report['output_path'] else 'no (analysis only)'}",
        ]
        return "\n".join(lines + [f"ERROR: {e}" for e in report["errors"]])
    b = report["backend"]
    caps = ", ".join(
        f"{k}={str(v).lower()}"
        for k, v in b["capabilities"].items()
        if k not in ("token_data", "loss_options")
    )
    ps = report["per_step"]
    ck = report["checkpoints"]
    lines = [
        f"Config:      {report['config'] or 'none: the built-in defaults plus the flags given'}",
        f"Condition:   {report['condition'] or _campaign_conditions(report['campaign'])}",
        f"Backend:     {b['name']} ({b['source']}): {caps}",
    ]
    if b["ignored_set"]:  # (a backend's never-read settings left at their defaults: silent)
        lines.append(
            f"Ignored:     {'; '.join(b['ignored_set'])} (set, but not used by the "
            f"{b['name']} backend)"
        )
    lines += [
        f"Model:       {report['model']['model']} ({_model_lora(report['model'], b['name'])})",
        f"Data:        {report['data']}",
        *([f"Environment: {report['environment']}"] if report.get("environment") else []),
        f"Reward:      {report['reward']}   uncertainty: {report['uncertainty_kind']}",
        f"Objective:   {report['objective']}{_base_of_campaign(report)}",
        *([f"Algorithm:   {report['algorithm']['text']}"] if report.get("algorithm") else []),
        *_render_settings(report),
        *_world_line(report["world"]),
        f"Per step:    {ps['batch_size']} prompts x {ps['group_size']} completions = {ps['completions']} completions, <= {ps['sampled_token_upper_bound']:,} sampled tokens ({ps['max_new_tokens_per_completion']} per {ps['tokens_per']}{_turns_text(ps)})",
        f"Shaping:     {report['shaping']}",
        f"Steps:       {report['total_steps']:,}",
        f"Checkpoints: {('every ' + str(ck['every']) + ' steps (' + str(ck['periodic']) + ') + final') if ck['every'] else 'final only'} -> {ck['adapter_path']}",
        f"SEPA:        {report['sepa']}",
        f"Backpressure: {report['backpressure']}",
        f"Eval:        {report['eval']}",
        f"Logs:        {report['log_dir']}"
        + (f"   wandb: {report['wandb']}" if report["wandb"] else ""),
    ]
    if report.get("resume_from"):
        lines.append(f"Resume:      from {report['resume_from']}")
    camp = report.get("campaign")
    if camp:
        lines += [
            "",
            f"Campaign:    {len(camp['conditions'])} conditions x {len(camp['seeds'])} seeds = {camp['runs']} runs x {_steps_per_run(camp)} = {camp['total_steps']:,} steps ({camp['executor']}"
            + (f", {camp['max_workers']} workers)" if camp["executor"] != "sequential" else ")"),
            f"Seeds:       {', '.join(map(str, camp['seeds']))}",
            *_wall_time_line(camp, report.get("estimates") or {}),
        ]
        lines += _render_conditions(camp)
        if camp["auto_squeeze"]:
            lines.append(
                "Auto-squeeze: the first run's final adapter is analysed; the recommendation goes into manifest.json"
            )
    for w in report["warnings"]:
        lines.append(f"WARNING: {w}")
    for e in report["errors"]:
        lines.append(f"ERROR: {e}")
    return "\n".join(lines)


def _turns_text(ps: dict[str, Any]) -> str:
    if not ps.get("turns_source"):
        return ""
    return f" x {ps['turns']} turn{'s' if ps['turns'] != 1 else ''}: {ps['turns_source']}"


def _model_lora(model: dict[str, Any], backend: str) -> str:
    """The Model line's LoRA part: what of rank and alpha the backend takes from the config."""
    if model["lora_rank"] is None:
        return f"LoRA: the {backend} backend's own"
    alpha = f", alpha {model['lora_alpha']}" if model["lora_alpha"] is not None else ""
    return f"LoRA rank {model['lora_rank']}{alpha}"


def _wall_time_line(camp: dict[str, Any], est: dict[str, Any]) -> list[str]:
    wall = camp.get("wall_time")
    if not wall:
        return []
    at_once = f" / {wall['at_once']} runs at once" if wall["at_once"] > 1 else ""
    shared = "; runs sharing a device slow each other" if wall["at_once"] > 1 else ""
    return [
        f"Wall time:   ~{format_duration(wall['seconds'])}, an estimate: {camp['total_steps']:,} "
        f"steps x ~{est['step_time_s']:g} s/step{at_once} (the base config's step time; "
        f"conditions differ{shared})"
    ]


def _base_of_campaign(report: dict[str, Any]) -> str:
    """A line that describes the base config, where a campaign's conditions override it."""
    camp = report.get("campaign")
    if camp and any(c["overrides"] for c in camp["condition_details"]):
        return " (the base config; conditions below override parts of it)"
    return ""


def _campaign_conditions(camp: dict[str, Any]) -> str:
    return f"one per run: {', '.join(camp['conditions'])} (Campaign, below)"


def _steps_per_run(camp: dict[str, Any]) -> str:
    steps = camp["max_steps_per_run"]
    differ = any(c["max_steps"] != steps for c in camp.get("condition_details", []))
    return f"{steps} steps" + (" (some conditions set their own)" if differ else "")


def _render_conditions(camp: dict[str, Any]) -> list[str]:
    """Each condition of the matrix, its overrides, and its runs' directories."""
    lines = []
    for c in camp.get("condition_details", []):
        lines.append(f"  - {c['label']}")
        if c.get("algorithm"):
            lines.append(f"      algorithm: {c['algorithm']['text']}")
        lines += [f"      {o['field']} = {json.dumps(o['value'])}" for o in c["overrides"]]
        if c["max_steps"] != camp["max_steps_per_run"]:
            lines.append(f"      {c['max_steps']} steps per run")
        names = c["runs"]
        if names:
            seeds = ", ".join(n.rsplit("_s", 1)[1] for n in names)
            lines.append(f"      runs/{names[0].rsplit('_s', 1)[0]}_s{{{seeds}}}")
    return lines


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="retrain explain",
        # CONFIG and the config flags are not argparse's (config_path reads them)
        usage="retrain explain [CONFIG] [--flag value ...] [--json] [--world-size N] [--overwrite]",
        description="Dry run: validate a config and say what it would do. CONFIG (default "
        "./retrain.toml if present) and config flags are taken as the run takes them.",
        add_help=True,
        allow_abbrev=False,  # a prefix of --json must stay a config flag's problem
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument(
        "--world-size",
        type=int,
        default=None,
        metavar="N",
        help="explain a run on N processes (torchrun --nproc-per-node x --nnodes); "
        "default: WORLD_SIZE from the environment, else 1",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="as the run's --overwrite: directories holding another run are moved aside",
    )
    known, rest = parser.parse_known_args(argv)
    # the run's rule: flags alone without ./retrain.toml run on the built-in defaults
    path, flags = config_path(rest)
    load_dotenv()
    try:
        config = load_config(path, flags)
    except ConfigError as exc:
        if known.json:
            print(json.dumps({"config": path, "errors": exc.problems}, indent=2))
        raise
    if known.overwrite:
        refuse_overwrite(config)  # as the run would
    launch = ownership.launch_for(path, flags, overwrite=known.overwrite)
    world = world_of(config)
    if known.world_size is not None:
        world = replace(world, size=max(1, known.world_size))
    report = build_report(config, path, launch, world=world)
    print(json.dumps(report, indent=2) if known.json else render(report))
    return 2 if report["errors"] else 0
