"""retrain vs TRL's GRPOTrainer on one setup, in one invocation, alternating run by run.

The setup is the quickstart's: SmolLM2-135M-Instruct, reasoning-gym 1-digit addition with
the system prompt and one worked example, batch 4 prompts x group 8, 24 new tokens,
temperature 1, LoRA r16/alpha 32 on all seven projections, AdamW lr 2e-4 beta2 0.99, one
optimizer step per RL step. Both trainers see the same prompts in the same order and
score with the same reward (retrain's `match`: the last \\boxed{} equals the answer).
TRL runs with loss_type "dapo", no KL, no gradient checkpointing, fp32 on the CPU.

Each run is a child process (so peak RSS is its own): retrain, TRL, retrain, TRL, ...
Step 0 of each run is warm-up and left out of the medians. Every step records the load
average, so a noisy box shows in the JSON.

    pip install -e '.[bench]'                  # TRL is a benchmark-only extra
    python benchmarks/vs_trl.py --steps 6 --rounds 2
    python benchmarks/vs_trl.py --contended    # a CPU burner of our own runs beside both
    python benchmarks/vs_trl.py --steps 10 --rounds 3 --seeds 0,1,2   # learning, 3 seeds
    python benchmarks/vs_trl.py --only retrain --group-sizes 8,16   # RSS vs group size
    python benchmarks/vs_trl.py --only retrain --contended --variant auto= \
        --variant t2="--backend-opt threads=2"     # A/B of retrain variants, alternating

`--contended` starts `--burners` busy processes (default: one per CPU) beside every run,
each bounded by the run's length (it exits on its own after `--burn-limit` seconds too).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SYSTEM = "You are a calculator. Put the final answer in \\boxed{}."


# ------------------------------------------------------------------ children


def _retrain_config(work: Path, steps: int, group: int, extra: list[str]):
    from retrain.cli.init import templates
    from retrain.config import load_config

    path = work / "quickstart.toml"
    path.write_text(templates()["quickstart"])
    flags = [
        *extra,
        "--max-steps",
        str(steps),
        "--training-group-size",
        str(group),
        "--save-every",
        "0",
        "--eval-every",
        "0",
        "--log-dir",
        str(work / "logs"),
        "--adapter-path",
        str(work / "adapter"),
    ]
    return load_config(path, flags), path


def child_retrain(steps: int, group: int, extra: list[str]) -> dict:
    from retrain.logs.jsonl import read_jsonl
    from retrain.trainer import train

    work = Path(tempfile.mkdtemp(prefix="vs-trl-retrain-"))
    atexit.register(shutil.rmtree, work, True)  # scratch: gone at exit
    config, path = _retrain_config(work, steps, group, extra)
    loads: list[float] = []
    console = _LoadConsole(loads)
    train(config, str(path), console=console)
    rows, _ = read_jsonl(work / "logs" / "metrics.jsonl")
    return {
        "steps": [
            {
                "step_s": r["step_time_s"],
                "sampling_s": r["time_sampling_s"],
                "training_s": r["time_training_s"],
                "reward": r["mean_reward"],
                "correct": r["correct_rate"],
                "load1": loads[i] if i < len(loads) else None,
            }
            for i, r in enumerate(rows)
        ],
    }


class _LoadConsole:
    """retrain's console, quiet, noting the load average at every step line."""

    def __init__(self, loads: list[float]):
        from retrain.logs.console import Console

        self._inner = Console(stream=sys.stderr, live=False)
        self._loads = loads

    def print(self, text: str) -> None:
        if text.startswith("Step "):
            self._loads.append(os.getloadavg()[0])
        self._inner.print(text)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def same_prompts(steps: int, batch: int) -> list[dict]:
    """The examples retrain's quickstart draws, in its order, as chat messages (TRL renders
    them with the same chat template). Made by the parent and handed to a TRL child as a
    file, so the child runs TRL alone: no retrain data pipeline in its process."""
    from retrain.build import build_data
    from retrain.models import load_tokenizer

    work = Path(tempfile.mkdtemp(prefix="vs-trl-data-"))
    atexit.register(shutil.rmtree, work, True)  # scratch: gone at exit
    config, _ = _retrain_config(work, steps, 8, [])
    tokenizer = load_tokenizer(config.model.model)
    data, renderer = build_data(config, tokenizer, lambda s: None)
    examples = data.next_batch(steps * batch)
    return [{"prompt": renderer.messages(e), "answer": str(e.reference)} for e in examples]


def child_trl(
    steps: int, group: int, seed: int, rows: list[dict], model_path: str, batch: int = 4
) -> dict:
    """TRL on the quickstart's setup (benchmarks/trl_run.py): fp32, all of a step's
    completions in one micro-batch."""
    from trl_run import boxed_reward, train_trl

    steps_out = train_trl(
        model_path=model_path,
        rows=rows,
        reward=boxed_reward,
        group=group,
        completions=batch * group,
        micro=batch * group,
        max_tokens=24,
        lr=2e-4,
        lora_rank=16,
        steps=steps,
        seed=seed,
        cuda=False,
    )
    return {"steps": steps_out}


# ------------------------------------------------------------------ parent


def run_child(kind: str, args, group: int, burn: bool, flags: list[str], seed: int) -> dict:
    out = Path(tempfile.mkdtemp(prefix="vs-trl-out-")) / "result.json"
    atexit.register(shutil.rmtree, out.parent, True)  # scratch: gone at exit
    cmd = [sys.executable, __file__, "--child", kind, "--steps", str(args.steps)]
    cmd += ["--seeds", str(seed)]
    cmd += ["--group-sizes", str(group), "--child-out", str(out)]
    if kind == "trl":  # the prompts retrain draws, made here: the child runs TRL alone
        from retrain.models import resolve_model

        prompts = out.parent / "prompts.json"
        prompts.write_text(json.dumps(same_prompts(args.steps, 4)))
        model = resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct").path
        cmd += ["--child-prompts", str(prompts), "--child-model", str(model)]
    if flags:
        cmd += ["--", *flags]
    burners = start_burners(args.burners, args.burn_limit) if burn else []
    started = time.time()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    finally:
        stop_burners(burners)
    if proc.returncode != 0:
        tail = proc.stderr.decode(errors="replace")[-3000:]
        raise SystemExit(f"{kind} run failed (exit {proc.returncode}):\n{tail}")
    result = json.loads(out.read_text())
    result.update(
        kind=kind, group_size=group, contended=burn, seed=seed, wall_s=time.time() - started
    )
    return result


def start_burners(count: int, limit_s: float) -> list[subprocess.Popen]:
    """Busy processes (pure Python loops), each exiting by itself after `limit_s`."""
    code = f"import time\nend = time.time() + {limit_s}\nwhile time.time() < end:\n    pass\n"
    return [subprocess.Popen([sys.executable, "-c", code]) for _ in range(count)]


def stop_burners(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        p.wait()


def summarise(runs: list[dict]) -> dict:
    """Medians over the steps after step 0 of every run of one kind."""
    steps = [s for r in runs for s in r["steps"][1:]]

    def med(key):
        vals = [s[key] for s in steps if s.get(key) is not None]
        return statistics.median(vals) if vals else None

    per_step = [
        statistics.mean(r["steps"][i]["correct"] for r in runs if i < len(r["steps"]))
        for i in range(max(len(r["steps"]) for r in runs))
    ]
    return {
        "step_s": med("step_s"),
        "sampling_s": med("sampling_s"),
        "training_s": med("training_s"),
        "load1": med("load1"),
        "peak_rss_mb": max(r["peak_rss_mb"] for r in runs),
        "correct_per_step": per_step,
        "correct_mean": statistics.mean(per_step),
    }


def table(summary: dict) -> str:
    """The markdown table the README shows."""
    lines = [
        "| trainer | setting | step s | sampling s | peak RSS MB | correct rate per step | load avg |",
        "|---|---|---:|---:|---:|---|---:|",
    ]
    for key, s in summary.items():
        kind, setting = key.split("/", 1)
        curve = " ".join(f"{c:.2f}" for c in s["correct_per_step"])
        lines.append(
            f"| {kind} | {setting} | {s['step_s']:.2f} | {_fmt(s['sampling_s'])} | "
            f"{s['peak_rss_mb']:.0f} | {curve} | {s['load1']:.1f} |"
        )
    return "\n".join(lines)


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def ratios(summary: dict) -> list[str]:
    out = []
    for key, s in summary.items():
        name, setting = key.split("/", 1)
        other = summary.get("trl/" + setting)
        if name != "trl" and other:
            out.append(
                f"{setting}: TRL / {name} step time = {other['step_s'] / s['step_s']:.2f}x, "
                f"peak RSS {other['peak_rss_mb'] / s['peak_rss_mb']:.1f}x"
            )
    return out


def parse(argv):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=6, help="steps per run (step 0 is warm-up)")
    p.add_argument("--rounds", type=int, default=1, help="runs of each trainer, alternating")
    p.add_argument("--group-sizes", default="8", help="comma list, e.g. 8,16 (RSS vs group)")
    p.add_argument(
        "--seeds",
        default="0",
        help="comma list: round r uses seed r mod len (retrain's [training] seed, TRL's seed; "
        "the prompts stay the same). Several seeds make the correct-rate curves comparable",
    )
    p.add_argument("--only", choices=["retrain", "trl"], default=None)
    p.add_argument("--contended", action="store_true", help="with a CPU burner beside each run")
    p.add_argument("--both", action="store_true", help="quiet and contended, alternating")
    p.add_argument("--burners", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--burn-limit", type=float, default=1800.0, help="seconds, per burner")
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        help='a retrain variant NAME="FLAGS" (repeatable), e.g. t2="--backend-opt threads=2"',
    )
    p.add_argument("--json", default="benchmarks/results/vs_trl.json")
    p.add_argument("--child", choices=["retrain", "trl"], help=argparse.SUPPRESS)
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    p.add_argument("--child-prompts", help=argparse.SUPPRESS)
    p.add_argument("--child-model", help=argparse.SUPPRESS)
    p.add_argument("retrain_flags", nargs="*", help="extra retrain config flags (after --)")
    return p.parse_args(argv)


def child_main(args) -> int:
    group = int(args.group_sizes)
    if args.child == "retrain":
        flags = [*args.retrain_flags, "--seed", args.seeds]
        result = child_retrain(args.steps, group, flags)
    else:
        rows = json.loads(Path(args.child_prompts).read_text())
        result = child_trl(args.steps, group, int(args.seeds), rows, args.child_model)
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    Path(args.child_out).write_text(json.dumps(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.child:
        return child_main(args)
    kinds = [args.only] if args.only else ["retrain", "trl"]
    modes = [False, True] if args.both else [args.contended]
    groups = [int(g) for g in args.group_sizes.split(",")]
    # (name, kind, retrain flags): TRL once, retrain once per --variant (A/B in one go)
    trainers = []
    for kind in kinds:
        if kind == "trl":
            trainers.append(("trl", "trl", []))
        else:
            variants = [v.partition("=") for v in args.variant] or [("retrain", "", "")]
            for name, _, flags in variants:
                trainers.append((name, "retrain", [*flags.split(), *args.retrain_flags]))
    runs: dict[str, list[dict]] = {}
    seeds = [int(s) for s in args.seeds.split(",")]
    for round_ in range(args.rounds):
        seed = seeds[round_ % len(seeds)]
        for burn in modes:
            for group in groups:
                for name, kind, flags in trainers:
                    key = f"{name}/g{group}{' contended' if burn else ''}"
                    print(
                        f"running {key} seed {seed} (load {os.getloadavg()[0]:.1f}) ...", flush=True
                    )
                    result = run_child(kind, args, group, burn, flags, seed)
                    runs.setdefault(key, []).append(result)
                    print(f"  median step {summarise([result])['step_s']:.1f}s", flush=True)
    summary = {key: summarise(rs) for key, rs in runs.items()}
    print()
    print(table(summary))
    for line in ratios(summary):
        print(line)
    result = {
        "summary": summary,
        "runs": runs,
        "args": {k: v for k, v in vars(args).items() if not k.startswith("child")},
        "machine": {
            "cpus": len(os.sched_getaffinity(0)),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "env": {k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")},
        },
        "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
