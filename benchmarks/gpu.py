"""retrain on one CUDA GPU against its anchors, in one invocation, alternating run by run.

Two setups (`--what`):

- `headline`: the original retrain's headline shape on a random-weight model with
  Qwen3-4B's shapes (36 layers, hidden 2560, GQA 32/8 heads of 128, intermediate 9728,
  SmolLM2's tokenizer, bf16), built by this script (`--model-dir`, once): LoRA r32 on all
  projections, 8 prompts x 16 completions, 256 new tokens, a parity reward (random weights
  never emit end-of-sequence, so every completion runs to 256 tokens: fixed work).
  retrain vs TRL 1.16's GRPOTrainer (bf16, the same LoRA, batch and token budget, one
  generation per optimizer step, no gradient checkpointing) vs HF `generate` on the same
  128 rows (a dynamic cache, then a static cache + torch.compile) for sampling alone.
- `quickstart`: retrain's quickstart template on `gpu:0` vs TRL on the same prompts, with
  the per-step correct rates (learning, not only speed).

Per run: median s/step (step 0 is warm-up and left out), sampling and training tokens/s,
peak GPU memory. Each run is a child process (its own peak memory, its own CUDA context);
runs of the kinds alternate (retrain, TRL, retrain, TRL, ...) so a drifting machine
affects both. A table goes to stdout, everything to `--json`, which is rewritten after
every run ("finished" stays null until the last), so an invocation killed from outside
leaves the runs it finished; `--child-timeout` records a run that takes too long as
failed and goes on.

    pip install -e '.[bench]'                     # TRL 1.16.0, a benchmark-only extra
    python benchmarks/gpu.py --what headline,quickstart --rounds 2
    python benchmarks/gpu.py --smoke              # the plumbing, on the CPU, in a minute
    python benchmarks/gpu.py --what headline --only retrain,retrain-dense   # flex vs dense
    python benchmarks/gpu.py --what headline --only retrain,retrain-compiled   # decode compiled
    python benchmarks/gpu.py --what headline --only retrain,retrain-whole-cache   # key spans
    python benchmarks/gpu.py --what quickstart --only retrain,retrain-no-cudnn   # cuDNN's SDPA
    python benchmarks/gpu.py --what headline --only retrain,retrain-mb4k,retrain-mb8k   # memory

On an offline CUDA machine see ../shared/gpu/README.md (the bundle) and docs/performance.md.
"""

from __future__ import annotations

import argparse
import atexit
import functools
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
QWEN3_4B = dict(
    hidden_size=2560,
    intermediate_size=9728,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rope_theta=1_000_000.0,
    tie_word_embeddings=True,
    rms_norm_eps=1e-6,
)
# The smoke setup: the same code paths on a CPU-sized model.
SMOKE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=2048,
    rope_theta=10_000.0,
    tie_word_embeddings=True,
    rms_norm_eps=1e-6,
)
PARITY = "def parity(response, reference):\n    return float(len(response) % 2 == 0)\n"


# ------------------------------------------------------------------ the model


def smollm2_dir() -> Path:
    from retrain.models import resolve_model

    return Path(resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct").path)


def random_model(out: Path, shape: dict, device: str) -> Path:
    """A random-weight Qwen3-architecture model of `shape` with SmolLM2's tokenizer
    (vocab 49152), saved as bf16 safetensors (once)."""
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(
        "qwen3", vocab_size=49152, bos_token_id=1, eos_token_id=2, pad_token_id=2, **shape
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(out)
    for f in smollm2_dir().iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template", "generation")):
            shutil.copy(f, out / f.name)
    return out


# ------------------------------------------------------------------ children


def _headline_flags(setup: dict, work: Path) -> list[str]:
    (work / "parity_reward.py").write_text(PARITY)
    return [
        "--model", setup["model"],
        "--lora-rank", str(setup["lora_rank"]),
        "--batch-size", str(setup["batch"]),
        "--group-size", str(setup["group"]),
        "--max-tokens", str(setup["max_tokens"]),
        "--temperature", "1.0",
        "--top-p", "1.0",
        "--reward-type", "custom",
        "--reward-custom-module", str(work / "parity_reward.py"),
        "--reward-custom-function", "parity",
        "--transform-mode", "none",
        "--advantage-mode", "grpo",
    ]  # fmt: skip


def child_retrain(setup: dict, steps: int, seed: int, extra: list[str]) -> dict:
    from retrain.cli.init import templates
    from retrain.config import load_config
    from retrain.logs.console import Console
    from retrain.logs.jsonl import read_jsonl
    from retrain.trainer import train

    work = Path(tempfile.mkdtemp(prefix="gpu-bench-retrain-"))
    atexit.register(shutil.rmtree, work, True)  # scratch: gone at exit
    path = work / "retrain.toml"
    path.write_text(templates()["quickstart"])
    flags = _headline_flags(setup, work) if setup["kind"] == "headline" else []
    flags += [
        *extra,
        "--devices", setup["device"],
        "--max-steps", str(steps),
        "--seed", str(seed),
        "--save-every", "0",
        "--eval-every", "0" if setup["kind"] == "headline" else str(setup["eval_every"]),
        "--log-dir", str(work / "logs"),
        "--adapter-path", str(work / "adapter"),
    ]  # fmt: skip
    config = load_config(path, flags)
    train(config, str(path), console=Console(stream=sys.stderr, live=False))
    rows, _ = read_jsonl(work / "logs" / "metrics.jsonl")
    evals = []
    if (work / "logs" / "eval.jsonl").is_file():
        evals = [r["eval_correct_rate"] for r in read_jsonl(work / "logs" / "eval.jsonl")[0]]
    return {
        "steps": [
            {
                "step_s": r["step_time_s"],
                "sampling_s": r["time_sampling_s"],
                "training_s": r["time_training_s"],
                "sampled_tokens": r["tokens_generated"],
                "trained_tokens": r["trained_tokens"],
                "correct": r["correct_rate"],
                "peak_gpu_gb": r.get("gpu_peak_memory_gb"),
                "log_ratio_mean": r.get("log_ratio_mean"),
                "log_ratio_max_abs": r.get("log_ratio_max_abs"),
                "cuda_graphs": r.get("engine_cuda_graphs"),  # 1: the decode step captured
                "compiled": r.get("engine_compiled"),  # 1: compiled (retrain-compiled)
                # the sampler's kept caches given up for training (its graphs recaptured)
                "cache_released": r.get("sampler_cache_released"),
                "oom_retries": r.get("sampling_oom_retries"),
                # training redone after running out of memory; activation checkpointing
                # on (checkpointing = "auto" turns it on where a completion would not fit)
                "train_oom_retries": r.get("oom_retries"),
                "checkpointing": r.get("checkpointing"),
            }
            for r in rows
        ],
        "eval_correct": evals,
    }


def child_trl(setup: dict, steps: int, seed: int) -> dict:
    """TRL on the setup (benchmarks/trl_run.py): bf16 on CUDA; the headline's 128
    completions trained in micro-batches of 16 (all at once ran out of memory on an 80 GB
    H100), the quickstart's 32 in one; all of a step's completions generated together,
    as retrain does."""
    from trl_run import boxed_reward, train_trl

    rows = json.loads(Path(setup["prompts"]).read_text())  # made by the parent

    def parity(completions, **_):  # the headline's reward, as retrain's PARITY module
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [float(len(t) % 2 == 0) for t in texts]

    completions = setup["batch"] * setup["group"]
    steps_out = train_trl(
        model_path=setup["model"] if setup["kind"] == "headline" else str(smollm2_dir()),
        rows=rows,
        reward=parity if setup["kind"] == "headline" else boxed_reward,
        group=setup["group"],
        completions=completions,
        micro=min(completions, 16) if setup["kind"] == "headline" else completions,
        max_tokens=setup["max_tokens"],
        lr=setup["lr"],
        lora_rank=setup["lora_rank"],
        steps=steps,
        seed=seed,
        cuda=setup["device"].startswith("gpu"),
    )
    return {"steps": steps_out, "eval_correct": []}


def child_generate(setup: dict, steps: int, seed: int) -> dict:
    """HF generate on the headline's rows: a dynamic cache, then a static cache compiled."""
    import torch
    from transformers import AutoModelForCausalLM

    device = "cuda" if setup["device"].startswith("gpu") else "cpu"
    model = AutoModelForCausalLM.from_pretrained(setup["model"], dtype=torch.bfloat16)
    model = model.to(device).eval()
    rows, new = setup["batch"] * setup["group"], setup["max_tokens"]
    ids = torch.randint(100, 40000, (rows, 70), generator=torch.Generator().manual_seed(seed))
    ids = ids.to(device)
    out = []
    for name, kw in (("dynamic", {}), ("static_compiled", {"cache_implementation": "static"})):
        for attempt in range(2):  # the first static run includes the compile
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            with torch.no_grad():
                model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=new,
                    min_new_tokens=new,
                    do_sample=True,
                    top_k=0,
                    pad_token_id=2,
                    **kw,
                )
            if device == "cuda":
                torch.cuda.synchronize()
            seconds = time.perf_counter() - start
            out.append({"name": f"{name}{'' if attempt else ' (first)'}", "sampling_s": seconds})
            out[-1]["sampled_tokens"] = rows * new
    return {"generate": out}


# retrain's variants: one [backend.options] entry added to the run's table (not replacing
# it). dense: packed rows through the L x L mask, not FlexAttention (what "auto" picks on
# CUDA for rows of 2048+ positions); varlen: through flash attention's variable-length
# kernel instead (retrain/kernels/varlen.py); compiled: the decode step compiled by
# inductor, then captured as a CUDA graph, instead of captured uncompiled (auto); mb4k
# and mb8k: training micro-batches of one and of two headline groups (a prompt of up to
# 256 tokens and 16 completions of 256) instead of the largest that fits the free memory
# (auto): the peak memory a smaller micro-batch saves, against the training time it
# costs.
VARIANTS = {
    "retrain-dense": "attention=dense",
    "retrain-varlen": "attention=varlen",
    "retrain-compiled": "decode=compiled",
    "retrain-compiled-train": "compile=true",
    "retrain-mb4k": "micro_batch_tokens=4352",
    "retrain-mb8k": "micro_batch_tokens=8704",
}


def child_retrain_variant(kind: str, setup: dict, steps: int, seed: int, extra: list[str]):
    return child_retrain(setup, steps, seed, [*extra, "--backend-opt", VARIANTS[kind]])


def child_retrain_whole_cache(setup: dict, steps: int, seed: int, extra: list[str]) -> dict:
    """retrain with every decode step reading the whole KV cache, as before key spans
    (retrain/engines/static_decode.py): patched in this child only, no option for it."""
    from retrain.engines import static_decode

    static_decode.reads_prefix = lambda model: False
    return child_retrain(setup, steps, seed, extra)


def child_retrain_no_cudnn(setup: dict, steps: int, seed: int, extra: list[str]) -> dict:
    """retrain with SDPA kept off cuDNN's attention (patched in this child only, no option
    for it): on an H100 SDPA takes cuDNN's kernel for masked attention, which builds an
    execution plan for each new shape, and the quickstart's rows change length every step.
    On the H100 of 2026-11-27 that was the dense mask's in training too (the quickstart's
    rows, under FlexAttention's 2048), with training steps of ~2 s (steps 0, 1 and 4; 0, 1,
    4 and 7 on the H200) and a 0.21-0.47 s spread. Since, the masked passes of many query
    positions (training, the prefill) call SDPA's memory-efficient kernel by name
    (retrain/kernels/masked_attention.py), so this variant differs from `retrain` in the
    decode steps' attention alone; the default's training times now answer the question."""
    import torch

    torch.backends.cuda.enable_cudnn_sdp(False)
    return child_retrain(setup, steps, seed, extra)


CHILDREN = {
    "retrain": child_retrain,
    **{kind: functools.partial(child_retrain_variant, kind) for kind in VARIANTS},
    "retrain-whole-cache": child_retrain_whole_cache,
    "retrain-no-cudnn": child_retrain_no_cudnn,
    "trl": child_trl,
    "generate": child_generate,
}


# ------------------------------------------------------------------ parent


def run_child(kind: str, setup: dict, args) -> dict:
    out = Path(tempfile.mkdtemp(prefix="gpu-bench-out-")) / "result.json"
    atexit.register(shutil.rmtree, out.parent, True)  # scratch: gone at exit
    if kind == "trl":  # retrain's prompts in its order, made here: the child runs TRL alone
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from vs_trl import same_prompts

        prompts = out.parent / "prompts.json"
        prompts.write_text(json.dumps(same_prompts(args.steps, setup["batch"])))
        setup = {**setup, "prompts": str(prompts)}
    cmd = [sys.executable, __file__, "--child", kind, "--child-out", str(out)]
    cmd += ["--child-setup", json.dumps(setup), "--steps", str(args.steps)]
    cmd += ["--seed", str(args.seed)]
    if args.retrain_flags:
        cmd += ["--", *args.retrain_flags]
    started = time.time()
    try:
        proc = subprocess.run(
            cmd,
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            timeout=args.child_timeout or None,
        )
        code, err = proc.returncode, proc.stderr
    except subprocess.TimeoutExpired as exc:  # killed; recorded like a failure
        code, err = f"timed out after {args.child_timeout} s", exc.stderr or b""
    if code != 0:  # said and recorded; the other runs go on
        tail = err.decode(errors="replace")[-4000:]
        print(f"{kind} ({setup['kind']}) failed ({code}):\n{tail}", flush=True)
        return {"kind": kind, "setup": setup["kind"], "failed": f"{code}: {tail[-600:]}"}
    result = json.loads(out.read_text())
    result.update(kind=kind, setup=setup["kind"], wall_s=time.time() - started)
    return result


def summarise(runs: list[dict]) -> dict:
    """Medians over the steps after step 0 of every run of one kind."""
    if "generate" in runs[0]:
        best = {}
        for r in runs:
            for g in r["generate"]:
                rate = g["sampled_tokens"] / g["sampling_s"]
                best[g["name"]] = max(best.get(g["name"], 0.0), rate)
        return {"generate_tokens_per_s": best}
    steps = [s for r in runs for s in r["steps"][1:]] or [s for r in runs for s in r["steps"]]

    def med(fn):
        vals = [v for s in steps if (v := fn(s)) is not None]
        return statistics.median(vals) if vals else None

    per_step = [
        statistics.mean(r["steps"][i].get("correct", 0.0) for r in runs if i < len(r["steps"]))
        for i in range(max(len(r["steps"]) for r in runs))
    ]
    return {
        "step_s": med(lambda s: s["step_s"]),
        "sampling_s": med(lambda s: s["sampling_s"]),
        "training_s": med(lambda s: s.get("training_s")),
        "sampling_tokens_per_s": med(
            lambda s: s["sampled_tokens"] / s["sampling_s"] if s.get("sampling_s") else None
        ),
        "training_tokens_per_s": med(
            lambda s: s["trained_tokens"] / s["training_s"] if s.get("training_s") else None
        ),
        "peak_gpu_gb": max((v for s in steps if (v := s.get("peak_gpu_gb"))), default=None),
        "log_ratio_mean": med(lambda s: s.get("log_ratio_mean")),
        "log_ratio_max_abs": med(lambda s: s.get("log_ratio_max_abs")),
        "correct_per_step": per_step,
        "eval_correct": runs[0].get("eval_correct", []),
    }


def _f(x, spec=".2f") -> str:
    return "-" if x is None else format(x, spec)


def table(summary: dict) -> str:
    lines = [
        "| setup | trainer | s/step | sampling s | sampled tok/s | trained tok/s | peak GPU GB |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for key, s in summary.items():
        setup, kind = key.split("/", 1)
        if "failed" in s:
            lines.append(f"| {setup} | {kind} | failed (see the JSON) | - | - | - | - |")
            continue
        if "generate_tokens_per_s" in s:
            for name, rate in s["generate_tokens_per_s"].items():
                lines.append(f"| {setup} | HF generate, {name} | - | - | {rate:.0f} | - | - |")
            continue
        lines.append(
            f"| {setup} | {kind} | {_f(s['step_s'])} | {_f(s['sampling_s'])} | "
            f"{_f(s['sampling_tokens_per_s'], '.0f')} | {_f(s['training_tokens_per_s'], '.0f')} | "
            f"{_f(s['peak_gpu_gb'], '.1f')} |"
        )
    return "\n".join(lines)


def setups(args) -> list[dict]:
    device = "cpu" if args.smoke else "gpu:0"
    out = []
    for what in args.what.split(","):
        if what == "headline":
            shape = SMOKE if args.smoke else QWEN3_4B
            model = random_model(Path(args.model_dir), shape, "cpu" if args.smoke else "cuda")
            small = dict(batch=2, group=2, max_tokens=8) if args.smoke else {}
            out.append(
                {"kind": "headline", "device": device, "model": str(model), "lora_rank": 32,
                 "batch": 8, "group": 16, "max_tokens": 256, "lr": 1e-5, **small}
            )  # fmt: skip
        elif what == "quickstart":
            out.append(
                {"kind": "quickstart", "device": device, "model": "", "lora_rank": 16,
                 "batch": 4, "group": 8, "max_tokens": 24, "lr": 2e-4, "eval_every": 5}
            )  # fmt: skip
        else:
            raise SystemExit(f"--what: headline or quickstart, got {what!r}")
    return out


def parse(argv):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--what", default="headline,quickstart")
    p.add_argument("--steps", type=int, default=4, help="steps per run (step 0 is warm-up)")
    p.add_argument("--rounds", type=int, default=2, help="runs of each trainer, alternating")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--only",
        default="retrain,trl,generate",
        help="which kinds to run: retrain, retrain-dense (packed rows through the dense "
        "mask, not FlexAttention), retrain-varlen (through flash attention's variable-length "
        "kernel), retrain-compiled (the decode step compiled), "
        "retrain-whole-cache (decode steps read the whole KV cache), retrain-no-cudnn "
        "(SDPA kept off cuDNN's attention kernel), retrain-compiled-train (the trained "
        "blocks compiled), retrain-mb4k and "
        "retrain-mb8k (training micro-batches of one and two headline groups), trl, generate",
    )
    p.add_argument(
        "--child-timeout",
        type=float,
        default=0,
        help="seconds a run may take before it is killed and recorded as failed (0: no limit)",
    )
    p.add_argument("--model-dir", default=str(Path(tempfile.gettempdir()) / "rand4b"))
    p.add_argument("--smoke", action="store_true", help="a tiny model on the CPU (plumbing)")
    p.add_argument("--json", default="benchmarks/results/gpu.json")
    p.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    p.add_argument("--child-setup", help=argparse.SUPPRESS)
    p.add_argument("retrain_flags", nargs="*", help="extra retrain config flags (after --)")
    return p.parse_args(argv)


def child_main(args) -> int:
    setup = json.loads(args.child_setup)
    fn = CHILDREN[args.child]
    extra = [args.retrain_flags] if args.child.startswith("retrain") else []
    result = fn(setup, args.steps, args.seed, *extra)
    Path(args.child_out).write_text(json.dumps(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.child:
        return child_main(args)
    if args.smoke:
        args.steps, args.rounds = min(args.steps, 2), 1
        args.model_dir = tempfile.mkdtemp(prefix="gpu-bench-smoke-")
        atexit.register(shutil.rmtree, args.model_dir, True)  # scratch: gone at exit
    kinds = args.only.split(",")
    runs: dict[str, list[dict]] = {}
    machine = _machine()
    for _ in range(args.rounds):
        for setup in setups(args):
            for kind in kinds:
                if kind == "generate" and setup["kind"] != "headline":
                    continue
                key = f"{setup['kind']}/{kind}"
                print(f"running {key} ...", flush=True)
                runs.setdefault(key, []).append(run_child(kind, setup, args))
                # after every run, so a killed invocation leaves what it finished
                summary = write(args, runs, machine, finished=False)
    summary = write(args, runs, machine, finished=True)
    print()
    print(table(summary))
    print(f"wrote {args.json}")
    return 1 if any("failed" in s for s in summary.values()) else 0


HIDDEN_ARGS = {"child", "child_out", "child_setup"}  # a child's own; not the invocation's


def write(args, runs: dict[str, list[dict]], machine: dict, finished: bool) -> dict:
    """The runs so far, summarised, into `--json` ("finished": null until the last);
    returns the summary."""
    summary = {}
    for key, rs in runs.items():
        done = [r for r in rs if "failed" not in r]
        summary[key] = summarise(done) if done else {"failed": rs[-1]["failed"]}
    result = {
        "summary": summary,
        "runs": runs,
        "args": {k: v for k, v in vars(args).items() if k not in HIDDEN_ARGS},
        "machine": machine,
        "finished": time.strftime("%Y-%m-%d %H:%M:%S") if finished else None,
    }
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    return summary


def _machine() -> dict:
    info = {"python": platform.python_version(), "platform": platform.platform()}
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name()
    except ImportError:
        pass
    for name in ("transformers", "peft", "trl"):
        try:
            info[name] = __import__(name).__version__
        except ImportError:
            info[name] = None
    info["cpus"] = len(os.sched_getaffinity(0))
    return info


if __name__ == "__main__":
    sys.exit(main())
