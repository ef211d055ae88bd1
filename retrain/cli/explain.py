"""`retrain explain [PATH] [--json]`: load and validate a config and say what it would do.

Never imports torch: everything here comes from the config and the registry entries
(a dotted-path backend is imported for its capability hooks).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from retrain import registry
from retrain.backends.base import BackendInfo, backend_info
from retrain.campaign.expand import (
    Condition,
    RunSpec,
    campaign_conditions,
    check_runs,
    expand_run,
)
from retrain.cli.run import is_standalone_squeeze, split_path
from retrain.config import Config, load_config, load_dotenv
from retrain.config.validate import flow_problems, static_token_varying
from retrain.errors import ConfigError, PluginError
from retrain.types import BackendCapabilities


def uses_sepa(config: Config) -> bool:
    """Whether the flow's transform reads the SEPA lambda (gtpo_sepa and its amp forms)."""
    algo = config.algorithm
    alias = registry.ALGORITHM_MODES.entry(algo.algorithm_mode) if algo.algorithm_mode else None
    transform = (
        alias.alias_of[1] if alias is not None else algo.algorithm_mode or algo.transform_mode
    )
    return "sepa" in transform


def sepa_summary(config: Config) -> str:
    if not uses_sepa(config):
        return f"not used by {config.condition}"
    s = config.sepa
    if s.steps == 0:
        ramp = f"lambda jumps to 1 at step {s.delay_steps}"
    else:
        ramp = f"lambda 0 until step {s.delay_steps}, rises linearly to 1 at step {s.delay_steps + s.steps}"
    if s.schedule == "auto":
        ramp += f"; auto: after {s.warmup} warmup steps lambda also follows the decay of execution-uncertainty variance (threshold {s.var_threshold}, EMA {s.ema_decay})"
    gate = (
        f"gate: opens once a batch correct rate >= {s.correct_rate_gate} (sticky)"
        if s.correct_rate_gate > 0
        else "no correctness gate"
    )
    if config.training.max_steps <= s.delay_steps and s.schedule == "linear":
        ramp += f" (never reached: max_steps is {config.training.max_steps})"
    return f"{s.schedule}: {ramp}; {gate}"


def checkpoint_steps(max_steps: int, save_every: int) -> list[int]:
    """Steps after which a periodic checkpoint is written (the final one comes on top)."""
    if save_every <= 0:
        return []
    return [s for s in range(save_every, max_steps + 1, save_every)]


def data_summary(config: Config) -> str:
    env = config.environment
    if env.provider:
        return f"{env.provider} environment {env.id!r} (args {env.args})"
    d = config.data
    if d.source == "reasoning_gym":
        return (
            f"reasoning_gym task {d.task!r} ({d.size} problems, data seed {d.seed}, args {d.args})"
        )
    if d.source == "jsonl":
        return f"jsonl {d.path} (prompt={d.prompt_field!r}, answer={d.answer_field!r})"
    if d.source == "math":
        where = f"local copy {d.path}" if d.path else "EleutherAI/hendrycks_math from the hub"
        return f"MATH, five subjects, {where}"
    return f"plugin {d.source}"


def _squeeze_report(config: Config, path: str) -> dict[str, Any]:
    sq = config.squeeze
    return {
        "config": path,
        "kind": "squeeze",
        "adapter_path": sq.adapter_path,
        "min_variance_retention": sq.min_variance_retention,
        "target_ranks": sq.target_ranks or "powers of two up to the source rank",
        "output_path": sq.output_path or None,
        "compress_to": sq.compress_to or "recommended",
        "warnings": [],
        "errors": [],
    }


def _backend(config: Config, errors: list[str]) -> BackendInfo:
    """The configured backend's info; a plugin that cannot be imported is reported as an
    error and described with conservative defaults."""
    name = config.backend.backend
    try:
        return backend_info(name, tuple(config.plugins.search_paths))
    except PluginError as exc:
        errors.append(str(exc))
        return BackendInfo(name, BackendCapabilities(), {}, "plugin/default")


def _flow_errors(config: Config, info: BackendInfo) -> list[str]:
    """The flow checks of config loading and preflight, with what is known without
    running the flow (a plugin transform is probed only at preflight)."""
    problems = flow_problems(config, info.capabilities, token_varying=static_token_varying(config))
    return [f"{key}: {message} ({info.source} backend)" for key, message in problems]


def _advice(config: Config) -> list[str]:
    """Settings that are valid but probably not what was meant."""
    warnings = []
    algo = config.algorithm
    if config.training.seed == -1:
        warnings.append(
            "[training] seed = -1: the run is not reproducible; set a seed to compare conditions"
        )
    if algo.transform_mode.startswith("gtpo") and config.gtpo.beta == 0 and not algo.algorithm_mode:
        warnings.append("[gtpo] beta = 0: GTPO weighting is off, the transform reduces to its base")
    if algo.transform_mode == "gtpo_hicra" and config.hicra.alpha == 0:
        warnings.append("[hicra] alpha = 0: gtpo_hicra behaves exactly like gtpo")
    if config.reward.type == "gym" and config.data.source != "reasoning_gym":
        warnings.append(
            "[reward] type = gym scores with reasoning-gym's task scorer; it needs [data] source = reasoning_gym"
        )
    if config.data.source == "reasoning_gym" and config.reward.type == "math":
        warnings.append(
            "reasoning-gym answers are plain strings: reward 'match' or 'gym' fits them better than 'math'"
        )
    return warnings


def _per_step(config: Config) -> dict[str, int]:
    t = config.training
    completions = t.batch_size * t.group_size
    return {
        "batch_size": t.batch_size,
        "group_size": t.group_size,
        "completions": completions,
        "max_new_tokens_per_completion": t.max_tokens,
        "sampled_token_upper_bound": completions * t.max_tokens,
    }


def _checkpoints(config: Config, info: BackendInfo, max_steps: int) -> dict[str, Any]:
    every = config.training.save_every
    remote = "[backend] adapter_path" in info.ignores
    return {
        "every": every,
        "periodic": len(checkpoint_steps(max_steps, every)),
        "final": True,
        "adapter_path": "on the backend's service" if remote else config.backend.adapter_path,
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
    }


def _campaign_report(config: Config, errors: list[str]) -> dict[str, Any]:
    """The matrix; each condition's first run is checked the way the campaign checks
    every run before it starts (its problems go to `errors`)."""
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
    return {
        "conditions": [cond.label for cond, _ in matrix],
        "condition_details": conds,
        "seeds": seeds,
        "runs": n_runs,
        "max_steps_per_run": camp.max_steps,
        "total_steps": sum(c["max_steps"] * len(seeds) for c in conds),
        "executor": executor,
        "max_workers": (camp.max_workers or n_runs) if camp.parallel else 1,
        "auto_squeeze": config.squeeze is not None,
        "matrix": [name for c in conds for name in c["runs"]],
    }


def _backpressure(config: Config) -> str:
    bp = config.backpressure
    if not bp.enabled:
        return "off"
    return f"on: batch size adapts within [{bp.min_batch_size}, {bp.max_batch_size}] after {bp.warmup_steps} warmup steps"


def build_report(config: Config, path: str) -> dict[str, Any]:
    if is_standalone_squeeze(config):
        return _squeeze_report(config, path)
    errors: list[str] = []
    info = _backend(config, errors)
    errors += _flow_errors(config, info)
    max_steps = (
        config.campaign.max_steps if config.campaign is not None else config.training.max_steps
    )
    report: dict[str, Any] = {
        "config": path,
        "kind": "campaign" if config.campaign is not None else "run",
        "condition": config.condition,
        "backend": {
            "name": info.name,
            "source": info.source,
            "capabilities": info.capabilities.as_dict(),
            "ignored_sections": list(info.ignores),
        },
        "model": {
            "model": config.model.model,
            "lora_rank": config.model.lora_rank,
            "lora_alpha": config.lora.alpha or 2 * config.model.lora_rank,
        },
        "data": data_summary(config),
        "reward": config.reward.type,
        "uncertainty_kind": config.algorithm.uncertainty_kind,
        "per_step": _per_step(config),
        "total_steps": max_steps,
        "checkpoints": _checkpoints(config, info, max_steps),
        "sepa": sepa_summary(config),
        "backpressure": _backpressure(config),
        "log_dir": config.logging.log_dir,
        "resume_from": config.resume.from_ or None,
        "wandb": config.logging.wandb_project or None,
    }
    if config.campaign is not None:
        report["campaign"] = _campaign_report(config, errors)
        report["total_steps"] = report["campaign"]["total_steps"]
    report["warnings"] = _advice(config)
    report["errors"] = errors
    return report


def render(report: dict[str, Any]) -> str:
    if report["kind"] == "squeeze":
        lines = [
            f"Config: {report['config']}  (standalone LoRA-Squeeze)",
            f"Adapter: {report['adapter_path']}",
            f"Keep >= {report['min_variance_retention']:.0%} of the variance; ranks: {report['target_ranks']}",
            f"Compress: {'to ' + str(report['compress_to']) + ' -> ' + report['output_path'] if report['output_path'] else 'no (analysis only)'}",
        ]
        return "\n".join(lines)
    b = report["backend"]
    caps = ", ".join(
        f"{k}={str(v).lower()}" for k, v in b["capabilities"].items() if k != "token_data"
    )
    ps = report["per_step"]
    ck = report["checkpoints"]
    lines = [
        f"Config:      {report['config']}",
        f"Condition:   {report['condition']}",
        f"Backend:     {b['name']} ({b['source']}): {caps}",
    ]
    if b["ignored_sections"]:
        lines.append(
            f"Ignored:     {', '.join(b['ignored_sections'])} (not used by the {b['name']} backend)"
        )
    lines += [
        f"Model:       {report['model']['model']} (LoRA rank {report['model']['lora_rank']}, alpha {report['model']['lora_alpha']})",
        f"Data:        {report['data']}",
        f"Reward:      {report['reward']}   uncertainty: {report['uncertainty_kind']}",
        f"Per step:    {ps['batch_size']} prompts x {ps['group_size']} completions = {ps['completions']} completions, <= {ps['sampled_token_upper_bound']:,} sampled tokens ({ps['max_new_tokens_per_completion']} per completion)",
        f"Steps:       {report['total_steps']:,}",
        f"Checkpoints: {('every ' + str(ck['every']) + ' steps (' + str(ck['periodic']) + ') + final') if ck['every'] else 'final only'} -> {ck['adapter_path']}",
        f"SEPA:        {report['sepa']}",
        f"Backpressure: {report['backpressure']}",
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


def _steps_per_run(camp: dict[str, Any]) -> str:
    steps = camp["max_steps_per_run"]
    differ = any(c["max_steps"] != steps for c in camp.get("condition_details", []))
    return f"{steps} steps" + (" (some conditions set their own)" if differ else "")


def _render_conditions(camp: dict[str, Any]) -> list[str]:
    """Each condition of the matrix, its overrides, and its runs' directories."""
    lines = []
    for c in camp.get("condition_details", []):
        lines.append(f"  - {c['label']}")
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
        description="Dry run: validate a config and say what it would do.",
        add_help=True,
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    known, rest = parser.parse_known_args(argv)
    path, flags = split_path(rest)
    load_dotenv()
    try:
        config = load_config(path, flags)
    except ConfigError as exc:
        if known.json:
            print(json.dumps({"config": path, "errors": exc.problems}, indent=2))
        raise
    report = build_report(config, path)
    print(json.dumps(report, indent=2) if known.json else render(report))
    return 2 if report["errors"] else 0
