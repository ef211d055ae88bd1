"""Time the local backend's training step on one fixed batch, for one or more retrain
checkouts, alternating run by run in one invocation (the way to compare code versions:
the box's load changes by the minute).

The batch is the quickstart's shape: 4 prompts of 40 tokens x 8 completions of 24 tokens
(random token ids, advantages +-0.5), trained by the quickstart template's model and
settings on this machine's default device. Each checkout runs in its own child process,
which times `train_step` `--steps` times (the first is warm-up, left out of the median).

    python benchmarks/train_step.py --checkouts before=/tmp/old-checkout,now=. --rounds 3
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
import json, sys, tempfile, time
from pathlib import Path
import numpy as np
from transformers import AutoTokenizer
from retrain.build import build_backend
from retrain.cli.init import templates
from retrain.config import load_config
from retrain.models import resolve_model
from retrain.types import Datum, TrainHyper

work = Path(tempfile.mkdtemp())
(work / "r.toml").write_text(templates()["quickstart"])
flags = ["--log-dir", str(work / "logs"), "--adapter-path", str(work / "adapter")]
config = load_config(work / "r.toml", flags)
tokenizer = AutoTokenizer.from_pretrained(resolve_model(config.model.model).path)
backend = build_backend(config, tokenizer, say=lambda s: None)
rng = np.random.default_rng(0)
prompts = [rng.integers(100, 40000, 40).tolist() for _ in range(4)]
datums = [
    Datum(p, rng.integers(100, 40000, 24), -rng.random(24), np.full(24, 0.5 - i % 2))
    for p in prompts
    for i in range(8)
]
hyper = TrainHyper(lr=1e-5, weight_decay=0.0, beta1=0.9, beta2=0.99, eps=1e-8)
times = []
for _ in range(int(sys.argv[1])):
    start = time.perf_counter()
    backend.train_step(datums, hyper)
    times.append(time.perf_counter() - start)
print(json.dumps(times))
"""


def run_child(checkout: Path, steps: int) -> list[float]:
    env = dict(os.environ, PYTHONPATH=str(checkout))
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(steps)],
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
    parser.add_argument("--json", default="benchmarks/results/train_step.json")
    args = parser.parse_args(argv)
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
            times = run_child(path, args.steps)
            median = statistics.median(times[1:])
            runs.append(dict(name=name, round=round_, times=times, median=median, load=load))
            print(f"round {round_} {name:>10}: median {median:.3f} s (load {load:.2f})", flush=True)
    print(f"\n{'checkout':>10} {'median s':>9} {'runs':>30}")
    summary = {}
    for name in checkouts:
        medians = [r["median"] for r in runs if r["name"] == name]
        summary[name] = statistics.median(medians)
        listed = " ".join(f"{m:.2f}" for m in medians)
        print(f"{name:>10} {summary[name]:>9.3f} {listed:>30}")
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
