"""scripts/quickstart_numbers.py: the README's and the manual's quickstart numbers are
generated blocks; the script finds its blocks, shortens a run's console the same way
every time, and fills the blocks with what the run measured."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("qn", ROOT / "scripts" / "quickstart_numbers.py")
qn = importlib.util.module_from_spec(spec)
spec.loader.exec_module(qn)

CONSOLE = [
    "Loading tokenizer for M ...",
    "Held-out set: 64 problems; 64 share a question text with a training problem",
    "Local backend ready (engine=pytorch).",
    "Eval after 0 steps | held-out correct=34.4%",
    "  group: 1/8 correct | answer=13",
    "Step 0 [c] | correct=3.1%",
    "Step 1 [c] | correct=28.1%",
    "Eval after 2 steps | held-out correct=87.5%",
    "Step 2 [c] | correct=81.2%",
    "Eval after 3 steps | held-out correct=90.0%",
    "Saved final adapter at step 3 -> a/final",
    "Done: 3 steps",
]
RUN = {
    "seed": 0,
    "wall_s": 300.0,
    "console": CONSOLE,
    "steps": [
        {"correct_rate": c, "step_time_s": t} for c, t in ((0.031, 4.0), (0.281, 5.0), (0.812, 6.0))
    ],
    "evals": [{"eval_correct_rate": 0.344}, {"eval_correct_rate": 0.9}],
}


def test_every_generated_block_is_in_the_repository():
    assert qn.check() == 0


def test_the_console_is_shortened_to_its_first_and_last_step():
    block = qn.output_block(RUN).splitlines()
    assert block[0] == block[-1] == "```"
    assert block[1:-1] == [
        "Loading tokenizer for M ...",
        "Held-out set: 64 problems; 64 share a question text with a training problem",
        "Local backend ready (engine=pytorch).",
        "Eval after 0 steps | held-out correct=34.4%",
        "Step 0 [c] | correct=3.1%",
        "...",
        "Step 2 [c] | correct=81.2%",
        "Eval after 3 steps | held-out correct=90.0%",
        "Saved final adapter at step 3 -> a/final",
        "Done: 3 steps",
    ]


def test_the_numbers_are_the_runs():
    s = qn.summary(RUN)
    assert s["step0"] == 0.031 and s["held_out_first"] == 0.344 and s["held_out_last"] == 0.9
    assert s["median_step_s"] == 5.0 and s["wall_min"] == 5.0
    text = qn.numbers_block(s)
    assert "3.1% at step 0" in text and "34.4% before training -> 90.0% after" in text
    assert "| 0 | 3.1% |" in qn.seeds_block([s])


def test_a_block_is_replaced_between_its_markers_only():
    text = "a\n<!-- quickstart:numbers -->\nold\n<!-- /quickstart:numbers -->\nb"
    assert qn.replace_block(text, "numbers", "new") == (
        "a\n<!-- quickstart:numbers -->\nnew\n<!-- /quickstart:numbers -->\nb"
    )
    with pytest.raises(SystemExit, match="quickstart:output"):
        qn.replace_block(text, "output", "x")


def test_an_empty_block_is_filled_and_refilled():
    """The repository's blocks start empty: the markers on consecutive lines."""
    text = "a\n<!-- quickstart:output -->\n<!-- /quickstart:output -->\nb"
    once = qn.replace_block(text, "output", "x\ny")
    assert once == "a\n<!-- quickstart:output -->\nx\ny\n<!-- /quickstart:output -->\nb"
    assert qn.replace_block(once, "output", "z") == (
        "a\n<!-- quickstart:output -->\nz\n<!-- /quickstart:output -->\nb"
    )
