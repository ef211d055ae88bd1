"""Rewards per second for `match` and `math` on MATH-style answers.

    python benchmarks/rewards.py                 # 10,000 answers, prints a table
    python benchmarks/rewards.py --n 2000 --json out.json

Answers are generated (seeded) in the shapes MATH references take: integers, fractions
written as decimals or `\\frac`, radicals, intervals, sets, polynomials, with about half of
the responses correct. Every (answer, reference) pair is distinct, so the math reward's
verdict cache does not help the cold pass; the warm pass repeats the same batch to show
what the cache buys (a GRPO group often repeats answers). `math` is timed with the worker
pool (default size) and inline (`workers = 0`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from retrain.rewards import build_reward  # noqa: E402
from retrain.types import Example  # noqa: E402


def make_pairs(n: int, seed: int = 0) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    pairs: list[tuple[str, str]] = []
    seen: set[tuple[str, str]] = set()
    while len(pairs) < n:
        kind = rng.randrange(7)
        right = rng.random() < 0.5
        a, b = rng.randint(1, 999), rng.randint(2, 99)
        if kind == 0:
            ref = str(a)
            ans = ref if right else str(a + rng.randint(1, 9))
        elif kind == 1:
            ref = f"\\frac{{{a}}}{{{b}}}"
            ans = f"\\frac{{{2 * a}}}{{{2 * b}}}" if right else f"\\frac{{{a + 1}}}{{{b}}}"
        elif kind == 2:
            b = rng.choice([2, 4, 5, 8, 10, 20, 25])
            ref = f"\\frac{{{a}}}{{{b}}}"
            ans = f"{a / b:g}" if right else f"{a / b + 0.5:g}"
        elif kind == 3:
            ref = f"{a}\\sqrt{{{b}}}"
            ans = f"\\sqrt{{{a * a * b}}}" if right else f"{a + 1}\\sqrt{{{b}}}"
        elif kind == 4:
            lo, hi = sorted(rng.sample(range(-50, 50), 2))
            ref = f"[{lo}, {hi})"
            ans = f"[{lo},{hi})" if right else f"({lo}, {hi}]"
        elif kind == 5:
            xs = rng.sample(range(1, 100), 3)
            ref = "\\{" + ", ".join(map(str, xs)) + "\\}"
            ys = list(reversed(xs)) if right else [xs[0], xs[1], xs[2] + 1]
            ans = "\\{" + ",".join(map(str, ys)) + "\\}"
        else:
            ref = f"x^2 + {2 * a}x + {a * a}"
            ans = f"(x+{a})^2" if right else f"(x+{a + 1})^2"
        if (ans, ref) in seen:
            continue
        seen.add((ans, ref))
        pairs.append((f"Working it out step by step... so the answer is $\\boxed{{{ans}}}$.", ref))
    return pairs


def time_reward(label: str, reward, responses, examples) -> dict:
    t0 = time.perf_counter()
    out = reward.score_batch(responses, examples)
    dt = time.perf_counter() - t0
    return {
        "reward": label,
        "n": len(responses),
        "seconds": round(dt, 4),
        "rewards_per_s": round(len(responses) / dt, 1) if dt > 0 else float("inf"),
        "mean_reward": round(out.mean, 4),
        "errors": out.errors,
        "timeouts": out.timeouts,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--n", type=int, default=10_000, help="answers to score (default 10000)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=None, help="math worker processes")
    ap.add_argument("--timeout", type=float, default=5.0, help="math time limit per answer")
    ap.add_argument("--skip-inline", action="store_true", help="skip math with workers = 0")
    ap.add_argument(
        "--json",
        default=str(Path(__file__).resolve().parent / "results" / "rewards.json"),
        help="where to write the results (default benchmarks/results/rewards.json)",
    )
    args = ap.parse_args(argv)

    pairs = make_pairs(args.n, args.seed)
    responses = [r for r, _ in pairs]
    examples = [Example(prompt="", reference=ref) for _, ref in pairs]
    rows = []

    rows.append(time_reward("match", build_reward("match"), responses, examples))

    math_pool = build_reward("math", timeout=args.timeout, workers=args.workers)
    math_pool.score("\\boxed{1}", "1")  # start the workers outside the timed region
    label = f"math (workers={math_pool.workers}, cold)"
    rows.append(time_reward(label, math_pool, responses, examples))
    rows.append(
        time_reward(
            f"math (workers={math_pool.workers}, warm cache)", math_pool, responses, examples
        )
    )
    math_pool.close()

    if not args.skip_inline:
        inline = build_reward("math", timeout=args.timeout, workers=0)
        inline.score("\\boxed{1}", "1")  # import math-verify outside the timed region
        rows.append(time_reward("math (workers=0, inline, cold)", inline, responses, examples))

    header = f"{'reward':<34} {'n':>7} {'seconds':>9} {'rewards/s':>11} {'mean':>6} {'err':>4} {'t/o':>4}"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['reward']:<34} {r['n']:>7} {r['seconds']:>9.3f} {r['rewards_per_s']:>11.1f} "
            f"{r['mean_reward']:>6.3f} {r['errors']:>4} {r['timeouts']:>4}"
        )

    result = {
        "benchmark": "rewards",
        "n": args.n,
        "seed": args.seed,
        "machine": {
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
        },
        "results": rows,
    }
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
