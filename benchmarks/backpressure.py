"""Simulation of the back-pressure controller against synthetic USL systems.

For each system (sigma, kappa, group size) and seed, runs `BackPressureController` for
`--steps` steps with multiplicative throughput noise, then reports the true and fitted p*,
the batch size it settled on versus floor(throttle_margin * p* / group_size), how often the
batch size changed after warmup, the throughput it achieved relative to the best batch size,
and the cost of one `observe()` call. Writes JSON.

    python benchmarks/backpressure.py --steps 400 --seeds 5 --noise 0.05
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from retrain.backpressure import BackPressureController, usl_throughput  # noqa: E402

# (sigma, kappa, group_size); lambda is 100 throughout (it only sets the scale)
SYSTEMS = [
    (0.10, 0.0005, 4),
    (0.05, 0.002, 1),
    (0.20, 0.001, 8),
    (0.02, 0.0001, 16),
    (0.30, 0.01, 1),
]
LAM = 100.0


def run_one(sigma, kappa, g, steps, noise, seed, warmup, max_batch):
    rng = np.random.default_rng(seed)
    ctrl = BackPressureController(warmup_steps=warmup, group_size=g, max_batch_size=max_batch)
    b, sizes, regimes, fitted = ctrl.batch_size, [], [], None
    t0 = time.perf_counter()
    for _ in range(steps):
        x = usl_throughput(b * g, LAM, sigma, kappa) * (1.0 + noise * rng.standard_normal())
        d = ctrl.observe(b, x)
        sizes.append(d.batch_size)
        regimes.append(d.regime)
        fitted = d.p_star
        b = d.batch_size
    per_call_us = (time.perf_counter() - t0) / steps * 1e6
    start = next((i for i, r in enumerate(regimes) if r != "warmup"), len(regimes))
    tail = sizes[start:]
    changes = sum(1 for a, c in zip(tail, tail[1:]) if a != c)
    best = max(usl_throughput(k * g, LAM, sigma, kappa) for k in range(1, max_batch + 1))
    achieved = usl_throughput(sizes[-1] * g, LAM, sigma, kappa)
    return {
        "fitted_p_star": fitted,
        "final_batch": sizes[-1],
        "first_decision_step": start,
        "changes_after_warmup": changes,
        "throughput_vs_best": achieved / best,
        "observe_us": per_call_us,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--noise", type=float, default=0.05, help="relative throughput noise (std)")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "backpressure.json"))
    args = ap.parse_args()

    rows = []
    head = (
        f"{'sigma':>6} {'kappa':>8} {'g':>3} {'p*':>7} {'fit p*':>14} {'target b':>8} "
        f"{'final b':>12} {'changes':>8} {'X/best':>7} {'us/obs':>7}"
    )
    print(head)
    print("-" * len(head))
    for sigma, kappa, g in SYSTEMS:
        p_star = math.sqrt((1 - sigma) / kappa)
        target = max(1, min(args.max_batch, math.floor(0.85 * p_star / g)))
        runs = [
            run_one(sigma, kappa, g, args.steps, args.noise, s, args.warmup, args.max_batch)
            for s in range(args.seeds)
        ]
        fits = [r["fitted_p_star"] for r in runs if r["fitted_p_star"] is not None]
        finals = [r["final_batch"] for r in runs]
        row = {
            "sigma": sigma,
            "kappa": kappa,
            "group_size": g,
            "p_star": p_star,
            "target_batch": target,
            "runs": runs,
        }
        rows.append(row)
        fit_txt = f"{min(fits):.1f}-{max(fits):.1f}" if fits else "-"
        print(
            f"{sigma:>6.2f} {kappa:>8.4f} {g:>3d} {p_star:>7.1f} {fit_txt:>14} {target:>8d} "
            f"{f'{min(finals)}-{max(finals)}':>12} "
            f"{max(r['changes_after_warmup'] for r in runs):>8d} "
            f"{statistics.mean(r['throughput_vs_best'] for r in runs):>7.3f} "
            f"{statistics.mean(r['observe_us'] for r in runs):>7.1f}"
        )
    result = {
        "benchmark": "backpressure",
        "args": vars(args),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "systems": rows,
    }
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
