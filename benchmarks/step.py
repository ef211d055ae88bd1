"""Time the training step: run a config (default: the quickstart template) for N steps and
report, per step, the seconds spent sampling, scoring, computing advantages and training,
the sampling throughput, and the process's peak RSS.

    python benchmarks/step.py --steps 5
    python benchmarks/step.py --config my.toml --steps 3 --json benchmarks/results/step.json
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
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

COLUMNS = [  # (metrics key, title, format); every column is 9 characters wide
    ("step", "step", "{:>9}"),
    ("time_sampling_s", "sample s", "{:>9.2f}"),
    ("time_scoring_s", "score s", "{:>9.3f}"),
    ("time_advantages_s", "adv s", "{:>9.3f}"),
    ("time_training_s", "train s", "{:>9.2f}"),
    ("step_time_s", "total s", "{:>9.2f}"),
    ("tokens_generated", "tokens", "{:>9}"),
    ("tokens_per_s", "tok/s", "{:>9.1f}"),
    ("num_datums", "datums", "{:>9}"),
    ("correct_rate", "correct", "{:>9.3f}"),
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--config", default=None, help="TOML to run (default: the quickstart template)"
    )
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--json", default="benchmarks/results/step.json")
    parser.add_argument(
        "flags", nargs="*", help="extra config flags, e.g. --batch-size 2 (after --)"
    )
    args = parser.parse_args(argv)

    from retrain.cli.init import templates
    from retrain.config import load_config
    from retrain.logs.console import Console
    from retrain.logs.jsonl import read_jsonl
    from retrain.trainer import train

    work = Path(tempfile.mkdtemp(prefix="retrain-bench-"))
    atexit.register(shutil.rmtree, work, True)  # scratch: gone at exit
    config_path = Path(args.config) if args.config else work / "quickstart.toml"
    if not args.config:
        config_path.write_text(templates()["quickstart"])
    flags = [
        *args.flags,
        "--max-steps",
        str(args.steps),
        "--save-every",
        "0",
        "--log-dir",
        str(work / "logs"),
        "--adapter-path",
        str(work / "adapter"),
    ]
    config = load_config(config_path, flags)

    started = time.time()
    code = train(config, str(config_path), console=Console(stream=sys.stderr, live=False))
    wall = time.time() - started
    rows, _ = read_jsonl(work / "logs" / "metrics.jsonl")
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    print()
    print(" ".join(f"{title:>9}" for _, title, _ in COLUMNS))
    for row in rows:
        print(" ".join(fmt.format(row.get(key) or 0) for key, _, fmt in COLUMNS))
    steady = rows[1:] or rows
    summary = {
        key: statistics.median(r[key] for r in steady)
        for key in (
            "time_sampling_s",
            "time_scoring_s",
            "time_advantages_s",
            "time_training_s",
            "step_time_s",
            "tokens_per_s",
        )
    }
    print(
        f"\nmedian over steps 1..{len(rows) - 1}: sample {summary['time_sampling_s']:.2f}s, score {summary['time_scoring_s']:.3f}s, "
        f"advantages {summary['time_advantages_s']:.3f}s, train {summary['time_training_s']:.2f}s, "
        f"step {summary['step_time_s']:.2f}s, {summary['tokens_per_s']:.1f} tok/s; peak RSS {peak_rss_mb:.0f} MB; wall {wall:.0f}s (incl. model load)"
    )
    result = {
        "config": str(args.config or "quickstart template"),
        "condition": config.condition,
        "batch_size": config.training.batch_size,
        "group_size": config.training.group_size,
        "max_tokens": config.training.max_tokens,
        "steps": rows,
        "median": summary,
        "peak_rss_mb": peak_rss_mb,
        "wall_s": wall,
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
        "exit_code": code,
    }
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return code


if __name__ == "__main__":
    sys.exit(main())
