"""Benchmark of the advantage pipeline against the plain per-token Python reference.

For each size (completions x tokens) and each of the five standard conditions, times
a `retrain.advantages.AdvantagePipeline` (built once, outside the clock) on one
synthetic step (groups of
`--group-size` completions with mixed rewards, random logprobs, ~2% planning tokens,
SEPA lambda 0.5) and the reference in tests/unit/reference_advantages.py, checks they
agree to 1e-9, and prints ms per batch, tokens/s and the speed-up. Writes JSON.

    python benchmarks/advantages.py --tokens 2048 10240 --completions 128 --repeat 20

The reference is slow on large batches: `--ref-max-tokens N` runs it on only the first
completions (at most N tokens in all) and scales its time linearly to the full batch
(the reference is linear in tokens); such rows are marked "extrapolated".
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "unit"))

from reference_advantages import ref_batch_advantages  # noqa: E402

from retrain.advantages import AdvantagePipeline  # noqa: E402
from retrain.types import TokenGroup  # noqa: E402

CONDITIONS = [
    ("grpo", "none"),
    ("maxrl", "none"),
    ("maxrl", "gtpo"),
    ("maxrl", "gtpo_hicra"),
    ("maxrl", "gtpo_sepa"),
]
SEPA_LAMBDA = 0.5


def make_batch(completions: int, tokens: int, group_size: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    groups = []
    for start in range(0, completions, group_size):
        g = min(group_size, completions - start)
        rewards = rng.integers(0, 2, size=g).astype(np.float64)
        rewards[0] = 1.0
        if g > 1:
            rewards[1] = 0.0  # every group informative
        logprobs = [-rng.exponential(0.8, size=tokens) for _ in range(g)]
        planning = [rng.random(tokens) < 0.02 for _ in range(g)]
        groups.append((rewards, logprobs, planning))
    return groups


def time_fast(groups, adv, tr, repeat):
    """The pipeline is built once, as the trainer builds it at set-up; each timed call
    is one step."""
    pipeline = AdvantagePipeline(advantage_mode=adv, transform_mode=tr)
    token_groups = [TokenGroup(*g) for g in groups]
    pipeline(token_groups, sepa_lambda=SEPA_LAMBDA)  # warm-up (imports, scratch buffers)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = pipeline(token_groups, sepa_lambda=SEPA_LAMBDA)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def time_reference(groups, adv, tr, repeat):
    """The reference works on Python lists: they are made before the clock starts."""
    as_lists = [
        (r.tolist(), [x.tolist() for x in lp], [p.tolist() for p in pl]) for r, lp, pl in groups
    ]
    times = []
    out = None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = ref_batch_advantages(
            as_lists, advantage_mode=adv, transform_mode=tr, sepa_lambda=SEPA_LAMBDA
        )
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def subsample(groups, max_tokens: int):
    """Whole groups from the front, at most max_tokens tokens (at least one group)."""
    kept, total = [], 0
    for g in groups:
        n = sum(len(x) for x in g[1])
        if kept and total + n > max_tokens:
            break
        kept.append(g)
        total += n
    return kept, total


def check_agreement(fast_out, ref_out, n_groups):
    worst = 0.0
    for fg, rg in zip(fast_out.advantages[:n_groups], ref_out):
        for f, r in zip(fg, rg):
            worst = max(worst, float(np.max(np.abs(f - np.asarray(r)), initial=0.0)))
    return worst


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 10240])
    ap.add_argument("--completions", type=int, default=128)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=20, help="timed runs of the fast path")
    ap.add_argument("--ref-repeat", type=int, default=1, help="timed runs of the reference")
    ap.add_argument(
        "--ref-max-tokens",
        type=int,
        default=0,
        help="run the reference on at most this many tokens and extrapolate (0 = all)",
    )
    ap.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "advantages.json"))
    args = ap.parse_args(argv)

    rows = []
    header = (
        f"{'condition':<18} {'size':>11} {'fast ms':>9} {'ref ms':>10} {'speedup':>8} "
        f"{'fast tok/s':>12} {'ref tok/s':>11}  note"
    )
    print(header)
    print("-" * len(header))
    for tokens in args.tokens:
        groups = make_batch(args.completions, tokens, args.group_size)
        total = args.completions * tokens
        for adv, tr in CONDITIONS:
            cond = f"{adv}+{tr}"
            fast_s, fast_out = time_fast(groups, adv, tr, args.repeat)
            note = ""
            ref_groups, ref_tokens = groups, total
            if args.ref_max_tokens and total > args.ref_max_tokens:
                ref_groups, ref_tokens = subsample(groups, args.ref_max_tokens)
                note = f"ref extrapolated from {ref_tokens} tokens"
            ref_s, ref_out = time_reference(ref_groups, adv, tr, args.ref_repeat)
            ref_s_full = ref_s * total / ref_tokens
            err = check_agreement(fast_out, ref_out, len(ref_groups))
            if err > 1e-9:
                note = (note + "; " if note else "") + f"MISMATCH max|diff|={err:.2e}"
            row = {
                "condition": cond,
                "completions": args.completions,
                "tokens": tokens,
                "total_tokens": total,
                "fast_ms": fast_s * 1e3,
                "ref_ms": ref_s_full * 1e3,
                "speedup": ref_s_full / fast_s,
                "fast_tokens_per_s": total / fast_s,
                "ref_tokens_per_s": total / ref_s_full,
                "ref_extrapolated": ref_tokens < total,
                "max_abs_diff": err,
            }
            rows.append(row)
            print(
                f"{cond:<18} {f'{args.completions}x{tokens}':>11} {row['fast_ms']:9.2f} "
                f"{row['ref_ms']:10.1f} {row['speedup']:7.0f}x {row['fast_tokens_per_s']:12.3e} "
                f"{row['ref_tokens_per_s']:11.3e}  {note}"
            )
    result = {
        "benchmark": "advantages",
        "python": platform.python_version(),
        "numpy": np.__version__,
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "group_size": args.group_size,
        "sepa_lambda": SEPA_LAMBDA,
        "repeat": args.repeat,
        "rows": rows,
    }
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
