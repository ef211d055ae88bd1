"""Time the local backend's training step on one fixed batch, for one or more retrain
checkouts, alternating run by run in one invocation (the way to compare code versions:
the box's load changes by the minute).

The batch is the quickstart's shape: 4 prompts of 40 tokens x 8 completions of 24 tokens
(random token ids, advantages +-0.5), trained by the quickstart template's model and
settings on this machine's default device. Each checkout runs in its own child process,
which times `train_step` `--steps` times (the first is warm-up, left out of the median).

    python benchmarks/train_step.py --checkouts before=/tmp/old-checkout,now=. --rounds 3

`--layout gpu` runs the GPU's layout on this CPU: the whole model in bf16, the adapter's
sum rounded once (retrain/hardware.py `WHOLE_BF16`), and CUDA's bf16 matmuls with float32
results (`torch.mm(..., out_dtype=torch.float32)`, which torch has for CUDA only) given a
CPU kernel (tests/cuda_branch_rig.py `cuda_branches`), so the step runs the operators it
runs on a GPU. `--narrow` trains a
random-weight model of SmolLM2's depth (30 blocks, hidden 64) instead, whose arithmetic
is negligible: its step time is the host's part, what a small model's step costs on a
GPU, where the quickstart's training is host-bound (docs/performance.md). `--ops` also
counts the operators one step dispatches (views apart: they launch no kernel; a foreach
copy as CUDA launches it, tests/op_count.py), the same number on any machine for a given
torch.

    python benchmarks/train_step.py --layout gpu --narrow --ops --checkouts before=/tmp/old,now=.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

CHILD = r"""
import atexit, json, shutil, sys, tempfile, time
from pathlib import Path
import numpy as np
import torch

opts = json.loads(sys.argv[1])
sys.path.insert(0, opts["tests"])  # this repository's rig and operator count
if opts["layout"] == "gpu":  # before anything reads the layout
    import cuda_branch_rig

    cuda_branch_rig.cuda_branches()
from transformers import AutoTokenizer
from retrain.build import build_backend
from retrain.cli.init import templates
from retrain.config import load_config
from retrain.models import resolve_model
from retrain.types import Datum, TrainHyper

work = Path(tempfile.mkdtemp())
atexit.register(shutil.rmtree, work, True)  # scratch: gone at exit
(work / "r.toml").write_text(templates()["quickstart"])
flags = ["--log-dir", str(work / "logs"), "--adapter-path", str(work / "adapter")]
if opts["layout"] == "gpu":  # what `auto` picks for this batch on a GPU: one micro-batch
    flags += ["--backend-options", '{"micro_batch_tokens": 8192}']
config = load_config(work / "r.toml", flags)
tokenizer = AutoTokenizer.from_pretrained(resolve_model(config.model.model).path)
if opts["narrow"]:  # SmolLM2's depth and vocabulary, arithmetic negligible
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=30, head_dim=16)
    shape.update(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    cfg = AutoConfig.for_model("llama", vocab_size=49152, bos_token_id=1, eos_token_id=2, **shape)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(work / "narrow")
    config = load_config(work / "r.toml", [*flags, "--model", str(work / "narrow")])
backend = build_backend(config, tokenizer, say=lambda s: None)
if opts["layout"] == "gpu":  # AdamW as CUDA runs it (local.py `adamw_options`: fused)
    from retrain.backends.local import adamw_options

    for group in backend.optimizer.param_groups:
        group.update(adamw_options(torch.device("cuda")), foreach=False)
rng = np.random.default_rng(0)
prompts = [rng.integers(100, 40000, 40).tolist() for _ in range(4)]
datums = [
    Datum(p, rng.integers(100, 40000, 24), -rng.random(24), np.full(24, 0.5 - i % 2))
    for p in prompts
    for i in range(8)
]
hyper = TrainHyper(lr=1e-5, weight_decay=0.0, beta1=0.9, beta2=0.99, eps=1e-8)
times = []
for _ in range(opts["steps"]):
    start = time.perf_counter()
    backend.train_step(datums, hyper)
    times.append(time.perf_counter() - start)
ops = None
if opts["ops"]:
    from op_count import OpCount

    VIEWS = {"view", "_unsafe_view", "t", "transpose", "expand", "slice", "unsqueeze",
             "squeeze", "alias", "as_strided", "select", "permute", "detach", "split",
             "split_with_sizes", "unbind", "_reshape_alias", "view_as", "lift_fresh"}
    with OpCount() as counted:
        backend.train_step(datums, hyper)
    ops = {k: n for k, n in counted.seen.items() if k not in VIEWS}
print(json.dumps({"times": times, "ops": ops}))
"""


def run_child(checkout: Path, opts: dict) -> dict:
    env = dict(os.environ, PYTHONPATH=str(checkout))
    out = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(opts)],
        env=env,
        cwd=checkout,
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode != 0:
        raise SystemExit(f"{checkout}: the child failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--checkouts",
        default="now=.",
        help="comma-separated name=path of retrain checkouts (default: now=.)",
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6, help="train steps per run (1 warm-up)")
    parser.add_argument("--layout", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--narrow", action="store_true", help="SmolLM2's depth, hidden 64")
    parser.add_argument("--ops", action="store_true", help="count one step's operators")
    parser.add_argument("--json", default="benchmarks/results/train_step.json")
    args = parser.parse_args(argv)
    opts = dict(steps=args.steps, layout=args.layout, narrow=args.narrow, ops=args.ops)
    opts["tests"] = str(Path(__file__).resolve().parent.parent / "tests")  # the rig, OpCount
    checkouts = {}
    for item in args.checkouts.split(","):
        name, _, path = item.partition("=")
        if not path or not (Path(path) / "retrain").is_dir():
            parser.error(f"--checkouts: {item!r} is not name=path of a retrain checkout")
        checkouts[name] = Path(path).resolve()
    runs = []
    for round_ in range(args.rounds):
        for name, path in checkouts.items():
            load = os.getloadavg()[0]
            child = run_child(path, opts)
            times, ops = child["times"], child["ops"]
            median = statistics.median(times[1:])
            runs.append(
                dict(name=name, round=round_, times=times, median=median, load=load, ops=ops)
            )
            print(f"round {round_} {name:>10}: median {median:.3f} s (load {load:.2f})", flush=True)
    print(f"\n{'checkout':>10} {'median s':>9} {'runs':>30}")
    summary = {}
    for name in checkouts:
        medians = [r["median"] for r in runs if r["name"] == name]
        summary[name] = statistics.median(medians)
        listed = " ".join(f"{m:.2f}" for m in medians)
        print(f"{name:>10} {summary[name]:>9.3f} {listed:>30}")
    if args.ops:  # the same in every round: the last run's
        counts = {
            name: next(r["ops"] for r in reversed(runs) if r["name"] == name) for name in checkouts
        }
        names = sorted(
            {op for c in counts.values() for op in c},
            key=lambda op: -max(c.get(op, 0) for c in counts.values()),
        )
        print(
            f"\noperators one step dispatches (views apart)\n{'operator':>24} "
            + " ".join(f"{n:>10}" for n in checkouts)
        )
        print(f"{'all':>24} " + " ".join(f"{sum(counts[n].values()):>10}" for n in checkouts))
        for op in names[:15]:
            print(f"{op:>24} " + " ".join(f"{counts[n].get(op, 0):>10}" for n in checkouts))
    record = dict(
        summary=summary,
        runs=runs,
        checkouts={k: str(v) for k, v in checkouts.items()},
        args=vars(args),
        machine=dict(platform=platform.platform(), cpus=os.cpu_count()),
        finished=time.strftime("%Y-%m-%d %H:%M:%S"),
    )
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(record, indent=1))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
