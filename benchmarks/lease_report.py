"""The end of a GPU lease in one short table: what `benchmarks/gpu_lease.sh measure` left
in its folder, against issue 27's targets, then where the time went.

A device call returns only the end of what it printed and at most 8 files, so the lease
prints this last: each target with its goal, the measured figure and whether it is met
(or "not run" when its item was skipped), whether every step sampled through the
captured decode step, the quickstart's correct rates per step for retrain and TRL, the
decode variants' sampling rates, the profile's shares by kind
of kernel, and the memory fit's speed and peak per micro-batch size.

    python benchmarks/lease_report.py DIR        # the folder gpu_lease.sh wrote ($OUT)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

# (what, goal, the direction that meets it): issue 27's targets on an H100
TARGETS = (
    ("sampling tok/s at the headline", 10_000.0, "at least"),
    ("training s at the headline", 4.0, "at most"),
    ("step s at the headline", 8.0, "at most"),
    ("step speed-up over TRL", 7.0, "at least"),
    ("peak GPU GB at the headline", 41.0, "at most"),
    ("quickstart s/step on gpu:0", 0.5, "at most"),
)
# per-step checks of the headline runs (benchmarks/gpu.py's step records): each a count of
# the steps where it held
STEP_CHECKS = (
    ("cuda_graphs", "sampled through the captured step"),
    ("cache_released", "kept caches given up for training (graphs recaptured)"),
    ("oom_retries", "sampling out of memory, redone with fewer rows"),
    ("train_oom_retries", "training out of memory, redone"),
    ("checkpointing", "activation checkpointing on (its recompute inside training s)"),
)
ITEMS = (
    "attention",
    "headline",
    "quickstart",
    "variants",
    "quickstart_variants",
    "micro_batches",
    "trl",
    "profile",
    "profile_quickstart",
    "memory_fit",
)
# TRL 1.16 at the headline as ../shared/gpu/README.md recorded it (an H100, the same
# bundle), for when this lease's TRL item did not run (it comes last): s/step, median and
# best. Not this invocation, so never the target's verdict.
TRL_HEADLINE_ANCHOR = {"median": 66.0, "best": 37.0}


def load(folder: Path) -> dict[str, Any]:
    """The lease's results by item name (an item that wrote nothing is left out)."""
    found: dict[str, Any] = {}
    for name in ITEMS:
        path = folder / f"{name}.json"
        if path.is_file():
            found[name] = json.loads(path.read_text())
    return found


def _summary(results: dict[str, Any], item: str, kind: str, setup: str = "headline"):
    summary = results.get(item, {}).get("summary", {}).get(f"{setup}/{kind}", {})
    return {} if "failed" in summary else summary


def _training_times(results: dict[str, Any], item: str, kind: str) -> str:
    """A quickstart run's training seconds per step after step 0 (its first use of every
    kernel), as text: the steps that stand out say what the median hides ("" if none)."""
    runs = results.get(item, {}).get("runs", {}).get(f"quickstart/{kind}", [])
    times = [s.get("training_s") for r in runs[:1] for s in r.get("steps", [])[1:]]
    return " ".join(f"{t:.2f}" for t in times if t is not None)


def measured(results: dict[str, Any]) -> dict[str, float | None]:
    """Each target's measured figure, None where its item did not run or failed."""
    ours = _summary(results, "headline", "retrain")
    trl = _summary(results, "trl", "trl")
    step, trl_step = ours.get("step_s"), trl.get("step_s")
    return {
        "sampling tok/s at the headline": ours.get("sampling_tokens_per_s"),
        "training s at the headline": ours.get("training_s"),
        "step s at the headline": step,
        "step speed-up over TRL": trl_step / step if step and trl_step else None,
        "peak GPU GB at the headline": ours.get("peak_gpu_gb"),
        "quickstart s/step on gpu:0": _summary(results, "quickstart", "retrain", "quickstart").get(
            "step_s"
        ),
    }


def met(value: float | None, goal: float, direction: str) -> str:
    if value is None:
        return "not run"
    return "yes" if (value >= goal if direction == "at least" else value <= goal) else "no"


def device_line(results: dict[str, Any]) -> str:
    """Which GPU measured, from the first item that recorded it: a lease may get an H200
    (a run that names no kind can start one when no H100 opens), whose memory and
    bandwidth make the H100 targets' figures not comparable as they stand."""
    machine = next(
        (
            results[i]["machine"]
            for i in ITEMS
            if isinstance(results.get(i, {}).get("machine"), dict)
        ),
        {},
    )
    if not machine:
        return "measured on: (no item recorded its machine)"
    versions = ", ".join(
        f"{k} {machine[k]}" for k in ("torch", "transformers", "peft", "trl") if machine.get(k)
    )
    gpu = machine.get("gpu")
    if not gpu:  # the scripts' --smoke, on a CPU
        return f"measured on: no GPU ({versions}): a rehearsal of the plumbing, not a measurement"
    line = f"measured on: {gpu} ({versions})"
    if "H100" not in gpu:
        line += "; the targets are H100 figures: not an H100, so met or not is not the verdict"
    return line


def report(results: dict[str, Any]) -> str:
    figures = measured(results)
    lines = [device_line(results), "", "| target | goal | measured | met |", "|---|---:|---:|---|"]
    for what, goal, direction in TARGETS:
        value = figures[what]
        shown = "-" if value is None else f"{value:,.2f}"
        lines.append(f"| {what} | {direction} {goal:g} | {shown} | {met(value, goal, direction)} |")
    lines.append("")
    step = figures["step s at the headline"]
    if step and figures["step speed-up over TRL"] is None:
        ratios = ", ".join(
            f"{v / step:.1f}x its {k} ({v:g} s)" for k, v in TRL_HEADLINE_ANCHOR.items()
        )
        lines.append(
            f"TRL did not run here; against its recorded anchor (../shared/gpu/README.md, an "
            f"H100, another invocation): {ratios}"
        )
    ours = _summary(results, "quickstart", "retrain", "quickstart").get("step_s")
    theirs = _summary(results, "quickstart", "trl", "quickstart").get("step_s")
    if ours and theirs:
        lines.append(f"quickstart speed-up over TRL: {theirs / ours:.1f}x")
    runs = results.get("headline", {}).get("runs", {}).get("headline/retrain", [])
    steps = [s for r in runs for s in r.get("steps", [])]
    for key, what in STEP_CHECKS:  # recorded on CUDA only
        seen = [s[key] for s in steps if s.get(key) is not None]
        if seen:
            lines.append(f"{what}: {sum(1 for v in seen if v)} of {len(seen)} steps")
    for kind in ("retrain", "trl"):  # learning on the quickstart, side by side
        quick = _summary(results, "quickstart", kind, "quickstart")
        if quick.get("correct_per_step"):
            rates = " ".join(f"{r:.2f}" for r in quick["correct_per_step"])
            held = " -> ".join(f"{r:.2f}" for r in quick.get("eval_correct", []))
            step = quick.get("step_s")
            lines.append(
                f"quickstart {kind}: {'-' if step is None else f'{step:.2f}'} s/step; correct "
                f"per step {rates}" + (f"; held-out {held}" if held else "")
            )
            if kind == "retrain" and (times := _training_times(results, "quickstart", kind)):
                lines.append(f"quickstart retrain training s, steps 1+: {times}")
    for kind in ("retrain-whole-cache", "retrain-compiled"):
        if rate := _summary(results, "variants", kind).get("sampling_tokens_per_s"):
            lines.append(f"{kind}: {rate:,.0f} sampled tok/s")
    # training variants, against the headline item's (FlexAttention, eager blocks)
    for kind in ("retrain-varlen", "retrain-compiled-train"):
        row = _summary(results, "variants", kind)
        if step := row.get("step_s"):
            lines.append(
                f"{kind}: {step:.2f} s/step, training {row.get('training_s') or 0:.2f} s, "
                f"peak {row.get('peak_gpu_gb') or 0:.1f} GB"
            )
    attention = results.get("attention", {})
    if parts := attention.get("summary"):  # one layer over a headline micro-batch
        each = ", ".join(
            f"{name} {row['fwd_bwd_ms']:.2f} ms (forward {row['fwd_ms']:.2f}, mask "
            f"{row['mask_ms']:.2f})"
            for name, row in parts.items()
        )
        lines.append(
            f"attention, one layer forward+backward at {attention['positions']} positions: {each}"
        )
    for name, row in attention.get("decode", {}).items():  # the decode step's, by key span
        spans = ", ".join(f"{span} keys {ms * 1e3:.0f} us" for span, ms in row.items())
        lines.append(f"decode attention {name}, a layer: {spans}")
    for name, why in attention.get("decode_failed", {}).items():
        lines.append(f"decode attention {name}: not timed ({why})")
    # decode compiled, training blocks compiled, SDPA off cuDNN's kernel
    for kind in ("retrain-compiled", "retrain-compiled-train", "retrain-no-cudnn"):
        row = _summary(results, "quickstart_variants", kind, "quickstart")
        if step := row.get("step_s"):
            lines.append(
                f"quickstart {kind}: {step:.2f} s/step, sampling "
                f"{row.get('sampling_s') or 0:.3f} s, training {row.get('training_s') or 0:.3f} s"
            )
            if times := _training_times(results, "quickstart_variants", kind):
                lines.append(f"quickstart {kind} training s, steps 1+: {times}")
    for kind in ("retrain-mb4k", "retrain-mb8k"):  # smaller micro-batches than auto's
        row = _summary(results, "micro_batches", kind)
        if step := row.get("step_s"):
            lines.append(
                f"{kind}: {step:.2f} s/step, training {row.get('training_s') or 0:.2f} s, "
                f"peak {row.get('peak_gpu_gb') or 0:.1f} GB"
            )
    for item, label in (("profile", "profile"), ("profile_quickstart", "quickstart profile")):
        profile = results.get(item, {})
        if t := profile.get("timings"):
            lines.append(
                f"{label}, parts: sampling {t['sample_s']:.2f} s ({t['sample_after_train_s']:.2f}"
                f" s right after training), training {t['train_s']:.2f} s in "
                f"{t['micro_batches']} micro-batches, a one-datum step {t['tiny_train_s']:.2f} s"
            )
        flags = " ".join(profile.get("args", {}).get("flags") or [])  # beyond the shape
        for phase, summary in profile.get("summaries", {}).items():
            kinds = sorted(summary["categories"].items(), key=lambda kv: -kv[1]["us"])
            shares = ", ".join(f"{k} {100 * v['share']:.0f}%" for k, v in kinds if v["kernels"])
            busy = summary.get("device_busy_share")
            lines.append(
                f"{label}, {phase}{f' ({flags})' if flags else ''}: {summary['kernels']} "
                f"kernels; {shares}" + ("" if busy is None else f"; device busy {100 * busy:.0f}%")
            )
            if threads := summary.get("host_threads"):  # a host-bound step: where it went
                busiest = ", ".join(f"{row['busy_ms']:.0f} ms" for row in threads[:2])
                lines.append(
                    f"{label}, {phase}, host: threads {busiest} (busiest first; on CUDA the "
                    f"backward has its own), optimizer {summary.get('optimizer_ms') or 0:.0f} ms"
                )
    for row in results.get("memory_fit", {}).get("rows", []):
        peak = row.get("peak_gib")
        lines.append(
            f"memory fit, {row['positions']} positions: {row['tokens_per_s']:,.0f} trained "
            f"tok/s, peak {'-' if peak is None else f'{peak:.1f}'} GiB "
            f"(estimate {row['estimate_gib']:.1f})"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not Path(args[0]).is_dir():
        print(__doc__, file=sys.stderr)
        return 2
    print(report(load(Path(args[0]))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
