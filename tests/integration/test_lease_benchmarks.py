"""The lease's benchmark scripts end to end on this CPU (their `--smoke`: a tiny random
model with the headline's code paths), then the lease's report over what they wrote: the
contract between benchmarks/gpu.py's, memory_fit.py's and profile_step.py's JSON and
benchmarks/lease_report.py's figures, which a GPU lease (rare, 15 minutes) would otherwise
be the first to test. test_lease_report.py checks the report on hand-made JSON; this one
on the scripts' own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from benchmark_module import load

ROOT = Path(__file__).resolve().parents[2]
lease_report = load("lease_report")


def run(*scripts: list[str], tmp: Path) -> None:
    """Each [script, args...] of `scripts` in a process of its own, all at once (each is
    mostly torch's import, on one core), each to succeed, with `tmp` as their TMPDIR."""
    env = {**os.environ, "TMPDIR": str(tmp)}
    procs = [
        subprocess.Popen(
            [sys.executable, str(ROOT / "benchmarks" / script), *args],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for script, *args in scripts
    ]
    for proc, (script, *_) in zip(procs, scripts, strict=True):
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{script}: {err[-3000:]}"


@pytest.mark.slow  # a long CLI-process test; the GPU lease's plumbing: run before a lease
def test_the_lease_scripts_write_what_its_report_reads(tmp_path):
    out, scratch = tmp_path / "lease", tmp_path / "scratch"
    scratch.mkdir()
    run(
        [
            "gpu.py", "--smoke", "--what", "headline", "--only", "retrain", "--steps", "2",
            "--rounds", "1", "--model-dir", str(tmp_path / "model"),
            "--json", str(out / "headline.json"),
        ],
        ["memory_fit.py", "--smoke", "--groups", "1,2", "--json", str(out / "memory_fit.json")],
        ["profile_step.py", "--smoke", "--json", str(out / "profile.json")],
        ["attention.py", "--smoke", "--json", str(out / "attention.json")],
        tmp=scratch,
    )  # fmt: skip
    # their scratch folders (runs' logs and adapters, the smoke models) are gone at exit:
    # on a workstation each headline run would leave an adapter of hundreds of MB behind
    # (torch's compile cache stays: it is torch's, kept between runs on purpose)
    left = [p.name for p in scratch.iterdir() if not p.name.startswith("torchinductor_")]
    assert left == []
    headline = json.loads((out / "headline.json").read_text())
    assert headline["finished"] and "failed" not in headline["summary"]["headline/retrain"]
    steps = headline["runs"]["headline/retrain"][0]["steps"]
    assert len(steps) == 2 and all(s["sampled_tokens"] == 2 * 2 * 8 for s in steps)
    # read from the metrics rows: a renamed field would leave these None. A step whose
    # rewards all tie trains nothing and has no training figures (the draws differ by
    # torch version: torch 2.11's step 0 ties here)
    trained = [s for s in steps if s["trained_tokens"]]
    assert trained and all(s["checkpointing"] == 0.0 for s in trained)
    assert all(s["train_oom_retries"] == 0 for s in trained)

    results = lease_report.load(out)
    figures = lease_report.measured(results)
    for what in ("sampling tok/s at the headline", "training s at the headline"):
        assert figures[what] is not None and figures[what] > 0, what
    step = headline["summary"]["headline/retrain"]
    assert figures["step s at the headline"] == step["step_s"]
    assert figures["sampling tok/s at the headline"] == step["sampling_tokens_per_s"]
    assert figures["peak GPU GB at the headline"] is None  # no GPU here: nothing to read
    text = lease_report.report(results)
    assert text.splitlines()[0].startswith("measured on: no GPU (torch ")
    fits = [line for line in text.splitlines() if line.startswith("memory fit, ")]
    assert len(fits) == 2 and all("trained tok/s" in line for line in fits)
    parts = [line for line in text.splitlines() if line.startswith("profile, parts: ")]
    assert len(parts) == 1 and "micro-batches, a one-datum step" in parts[0]
    phases = [line.split(":")[0] for line in text.splitlines() if line.startswith("profile, t")]
    # the training phase's kernels, then its host time by thread; the sampling phase's after
    assert phases == ["profile, training", "profile, training, host"]
    assert any(line.startswith("profile, sampling: ") for line in text.splitlines())
    # the attention layer's variants on this CPU: the dense mask, the varlen layout through
    # its reference (the kernel is CUDA's)
    attention = [line for line in text.splitlines() if line.startswith("attention, ")]
    assert len(attention) == 1 and "dense " in attention[0] and "varlen " in attention[0]
    decode = [line for line in text.splitlines() if line.startswith("decode attention ")]
    assert [line.split(",")[0] for line in decode] == [
        "decode attention sdpa",
        "decode attention sdpa-efficient",
        "decode attention matmul",
        "decode attention unmasked-bound",
    ]
