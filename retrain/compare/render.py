"""Comparisons as text: the terminal tables and `compare.md`."""

from __future__ import annotations

import math
from collections.abc import Sequence

from retrain.compare.comparison import Comparison
from retrain.compare.runs import is_eval_metric
from retrain.compare.stats import Interval

Table = tuple[list[str], list[list[str]]]


def fmt(value: float | None) -> str:
    if value is None or not math.isfinite(value):
        return "n/a"
    if value == 0:
        return "0"
    if abs(value) >= 1e4 or abs(value) < 1e-3:
        return f"{value:.3g}"
    return f"{value:.4f}".rstrip("0").rstrip(".") if abs(value) < 10 else f"{value:.2f}"


def fmt_p(value: float | None) -> str:
    if value is None or not math.isfinite(value):
        return "n/a"
    if value < 1e-4:
        return "<1e-4"
    return f"{value:.4f}" if value < 0.01 else f"{value:.3f}"


def _ci(iv: Interval) -> str:
    return f"{fmt(iv.estimate)} [{fmt(iv.low)}, {fmt(iv.high)}]"


def condition_table(comp: Comparison) -> Table:
    """(header, rows): each condition's seeds, final and AUC means with CIs, and pooled
    counts for a metric that has counts (correct_rate, eval_correct_rate)."""
    head = ["condition", "seeds", "final mean [95% CI]", "AUC mean [95% CI]"]
    head += ["pooled correct"] if comp.counted else []
    rows = []
    for c in comp.conditions:
        name = c.condition + (" (baseline)" if c.condition == comp.baseline else "")
        rows.append([name, str(c.n), _ci(c.final), _ci(c.auc)])
        if comp.counted:
            rows[-1].append(
                f"{c.correct}/{c.completions} ({100 * (c.pooled_rate or 0):.1f}%)"
                if c.completions
                else "n/a"
            )
    return head, rows


def pairwise_table(comp: Comparison) -> Table:
    """(header, rows): each condition against the baseline; Fisher's test only for a
    metric that has counts."""
    fisher = comp.counted
    head = [f"vs {comp.baseline}", "d final [95% CI]", "p perm", "d AUC [95% CI]", "p perm"]
    head += ["Fisher p", "Holm p (final/AUC/Fisher)"] if fisher else ["Holm p (final/AUC)"]
    rows = []
    for p in comp.pairwise:
        holm = [p.final_p_holm, p.auc_p_holm] + ([p.fisher_p_holm] if fisher else [])
        rows.append(
            [p.condition, _ci(p.final_diff), fmt_p(p.final_p), _ci(p.auc_diff), fmt_p(p.auc_p)]
            + ([fmt_p(p.fisher_p)] if fisher else [])
            + [" / ".join(fmt_p(x) for x in holm)]
        )
    return head, rows


def _plain_table(head: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(x.ljust(w) for x, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)


def _md_table(head: list[str], rows: list[list[str]]) -> str:
    def esc(x: str) -> str:
        return x.replace("|", "\\|")

    lines = ["| " + " | ".join(esc(h) for h in head) + " |"]
    lines.append("|" + "|".join("---" for _ in head) + "|")
    lines += ["| " + " | ".join(esc(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)


def _explain(comp: Comparison) -> str:
    held_out = is_eval_metric(comp.metric)
    gaps = (
        f" ({comp.incomplete} run(s) lack some of these "
        f"{'evaluations' if held_out else 'steps'}: see the warnings)"
        if comp.incomplete
        else ""
    )
    tests = (
        "CIs: t intervals over seeds (Welch's for a difference); p perm: two-sided "
        "permutation test over seeds; "
    )
    if held_out:
        text = (
            f"Held-out evaluations after 0..{comp.horizon} training steps{gaps}. final = the "
            f"last evaluation; AUC = mean over the evaluations. {tests}"
        )
        fisher = "the last evaluation's correct counts pooled over seeds"
    else:
        text = (
            f"Steps 0..{comp.horizon - 1}{gaps}. final = mean of the last {comp.final_window} "
            f"steps; AUC = mean over all compared steps. {tests}"
        )
        fisher = (
            "correct counts pooled over seeds and steps (treats completions as independent: "
            "descriptive)"
        )
    if comp.counted:
        text += f"Fisher p: two-sided exact test on {fisher}. "
    return text + "Holm: adjusted over the comparisons."


def render_text(comp: Comparison) -> str:
    pairs = pairwise_table(comp)
    parts = [f"== {comp.metric} ==", _plain_table(*condition_table(comp))]
    if pairs[1]:
        parts += ["", _plain_table(*pairs)]
    parts += ["", _explain(comp)]
    parts += [f"warning: {w}" for w in comp.warnings]
    return "\n".join(parts)


def render_markdown(comps: Sequence[Comparison], images: dict[str, list[str]] | None = None) -> str:
    lines = ["# retrain compare", ""]
    for comp in comps:
        pairs = pairwise_table(comp)
        lines += [f"## {comp.metric}", "", _md_table(*condition_table(comp)), ""]
        if pairs[1]:
            lines += [_md_table(*pairs), ""]
        lines += [_explain(comp), ""]
        for name in (images or {}).get(comp.metric, []):
            lines += [f"![{name}]({name})", ""]
        if comp.warnings:
            lines += [f"- warning: {w}" for w in comp.warnings] + [""]
    return "\n".join(lines)
