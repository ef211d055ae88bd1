"""benchmarks/lease_report.py: issue 27's targets against a lease's results, each met or
not in its own direction, "not run" where an item was skipped or failed, the speed-up
over TRL as TRL's step over retrain's, and the files read as gpu_lease.sh writes them."""

from __future__ import annotations

import json

from benchmark_module import load

lease_report = load("lease_report")


def headline(**summary) -> dict:
    steps = [
        {"cuda_graphs": 1.0, "cache_released": 0.0, "oom_retries": 0.0, "checkpointing": 0.0},
        {"cuda_graphs": 1.0, "cache_released": 2.1e9, "oom_retries": 0.0, "checkpointing": 1.0},
        {"cuda_graphs": 0.0, "cache_released": 0.0, "oom_retries": None, "train_oom_retries": 1},
    ]
    return {
        "summary": {"headline/retrain": summary},
        "runs": {"headline/retrain": [{"steps": steps}]},
    }


def rows(text: str) -> dict[str, list[str]]:
    table = [line for line in text.splitlines() if line.startswith("| ") and "goal" not in line]
    return {
        cells[0]: cells[1:]
        for cells in ([c.strip() for c in r.strip("|").split("|")] for r in table)
    }


def test_each_target_is_met_in_its_own_direction():
    results = {
        "headline": headline(
            step_s=9.0, sampling_tokens_per_s=12_000.0, training_s=4.5, peak_gpu_gb=40.0
        ),
        "trl": {"summary": {"headline/trl": {"step_s": 54.0}}},
        "quickstart": {"summary": {"quickstart/retrain": {"step_s": 0.5}}},
    }
    got = rows(lease_report.report(results))
    assert got["sampling tok/s at the headline"] == ["at least 10000", "12,000.00", "yes"]
    assert got["training s at the headline"] == ["at most 4", "4.50", "no"]
    assert got["step s at the headline"] == ["at most 8", "9.00", "no"]
    assert got["step speed-up over TRL"] == ["at least 7", "6.00", "no"]  # 54 / 9
    assert got["peak GPU GB at the headline"] == ["at most 41", "40.00", "yes"]
    assert got["quickstart s/step on gpu:0"] == ["at most 0.5", "0.50", "yes"]  # the bound meets
    text = lease_report.report(results)
    assert "sampled through the captured step: 2 of 3 steps" in text
    assert "kept caches given up for training (graphs recaptured): 1 of 3 steps" in text
    assert "sampling out of memory, redone with fewer rows: 0 of 2 steps" in text
    assert "training out of memory, redone: 1 of 1 steps" in text
    assert "activation checkpointing on (its recompute inside training s): 1 of 2 steps" in text


def test_a_skipped_or_failed_item_is_not_run():
    results = {
        "headline": {"summary": {"headline/retrain": {"failed": "137: killed"}}},
        "trl": {"summary": {"headline/trl": {"step_s": 50.0}}},
    }
    got = rows(lease_report.report(results))
    assert len(got) == 6 and all(v[1:] == ["-", "not run"] for v in got.values())
    assert all(cells[2] == "not run" for cells in rows(lease_report.report({})).values())


def test_the_folder_is_read_as_the_lease_wrote_it(tmp_path):
    (tmp_path / "headline.json").write_text(json.dumps(headline(step_s=10.0)))
    (tmp_path / "variants.json").write_text(
        json.dumps({"summary": {"headline/retrain-compiled": {"sampling_tokens_per_s": 8100.0}}})
    )
    (tmp_path / "profile.json").write_text(
        json.dumps(
            {
                "args": {"flags": ["--backend-opt", "decode=static", "--top-p", "0.95"]},
                "summaries": {
                    "sampling": {
                        "kernels": 1000,
                        "categories": {
                            "matmul": {"us": 30.0, "kernels": 400, "share": 0.6},
                            "copy": {"us": 0.0, "kernels": 0, "share": 0.0},
                            "norm": {"us": 20.0, "kernels": 600, "share": 0.4},
                        },
                    }
                },
            }
        )
    )
    (tmp_path / "memory_fit.json").write_text(
        json.dumps(
            {
                "rows": [
                    {
                        "positions": 4270,
                        "tokens_per_s": 7600.0,
                        "peak_gib": 30.5,
                        "estimate_gib": 33.1,
                    }
                ]
            }
        )
    )
    quick = {
        "quickstart/retrain": {
            "step_s": 0.47,
            "correct_per_step": [0.1, 0.5],
            "eval_correct": [0.34, 0.88],
        },
        "quickstart/trl": {"step_s": 2.9, "correct_per_step": [0.2, 0.4], "eval_correct": []},
    }
    (tmp_path / "quickstart.json").write_text(json.dumps({"summary": quick}))
    text = lease_report.report(lease_report.load(tmp_path))
    assert rows(text)["quickstart s/step on gpu:0"] == ["at most 0.5", "0.47", "yes"]
    assert (
        "quickstart retrain: 0.47 s/step; correct per step 0.10 0.50; held-out 0.34 -> 0.88" in text
    )
    assert "quickstart trl: 2.90 s/step; correct per step 0.20 0.40" in text
    assert rows(text)["step s at the headline"][1:] == ["10.00", "no"]
    assert "retrain-compiled: 8,100 sampled tok/s" in text
    # the flags it ran with beyond the shape; empty kinds left out
    assert (
        "profile, sampling (--backend-opt decode=static --top-p 0.95): 1000 kernels; "
        "matmul 60%, norm 40%" in text
    )
    assert "memory fit, 4270 positions: 7,600 trained tok/s, peak 30.5 GiB (estimate 33.1)" in text


def test_a_missing_folder_is_a_usage_error(tmp_path, capsys):
    assert lease_report.main([str(tmp_path / "nowhere")]) == 2
    assert lease_report.main([str(tmp_path)]) == 0
    assert "| not run |" in capsys.readouterr().out


def test_the_report_names_the_gpu_and_says_when_it_is_not_the_targets_h100():
    h100 = {"gpu": "NVIDIA H100 80GB HBM3", "torch": "2.11.0+cu130", "peft": "0.21.2"}
    text = lease_report.report({"quickstart": {"summary": {}, "machine": h100}})
    assert (
        text.splitlines()[0]
        == "measured on: NVIDIA H100 80GB HBM3 (torch 2.11.0+cu130, peft 0.21.2)"
    )
    h200 = {**h100, "gpu": "NVIDIA H200"}
    first = lease_report.report(
        {"headline": {**headline(step_s=7.0), "machine": h200}}
    ).splitlines()[0]
    assert first.startswith("measured on: NVIDIA H200 (") and "not an H100" in first
    assert lease_report.report({}).splitlines()[0] == "measured on: (no item recorded its machine)"


def test_without_the_leases_own_trl_the_recorded_anchor_is_said_apart():
    results = {"headline": headline(step_s=11.0)}
    text = lease_report.report(results)
    assert rows(text)["step speed-up over TRL"][1:] == ["-", "not run"]  # never the verdict
    assert "TRL did not run here; against its recorded anchor" in text
    assert "6.0x its median (66 s), 3.4x its best (37 s)" in text
    results["trl"] = {"summary": {"headline/trl": {"step_s": 55.0}}}
    assert "recorded anchor" not in lease_report.report(results)


def test_the_quickstarts_speed_up_over_trl_of_the_same_invocation():
    quick = {"quickstart/retrain": {"step_s": 0.4}, "quickstart/trl": {"step_s": 3.0}}
    text = lease_report.report({"quickstart": {"summary": quick}})
    assert "quickstart speed-up over TRL: 7.5x" in text


def test_smaller_micro_batches_and_the_profiles_parts_are_said():
    results = {
        "micro_batches": {
            "summary": {
                "headline/retrain-mb4k": {"step_s": 7.5, "training_s": 3.9, "peak_gpu_gb": 35.2},
                "headline/retrain-mb8k": {"failed": "124: timed out"},
            }
        },
        "profile": {
            "timings": {
                "sample_s": 3.1,
                "sample_after_train_s": 3.6,
                "train_s": 2.0,
                "micro_batches": 2,
                "tiny_train_s": 0.41,
            },
            "summaries": {
                "training": {
                    "kernels": 10,
                    "categories": {"matmul": {"us": 5.0, "kernels": 10, "share": 1.0}},
                    "device_busy_share": 0.62,
                }
            },
        },
    }
    text = lease_report.report(results)
    assert "retrain-mb4k: 7.50 s/step, training 3.90 s, peak 35.2 GB" in text
    assert "retrain-mb8k" not in text  # failed: nothing to say but the log
    assert (
        "profile, parts: sampling 3.10 s (3.60 s right after training), training 2.00 s in 2 "
        "micro-batches, a one-datum step 0.41 s"
    ) in text
    assert "profile, training: 10 kernels; matmul 100%; device busy 62%" in text
    # the quickstart's profile, said apart under its own label
    results["profile_quickstart"] = results.pop("profile")
    text = lease_report.report(results)
    assert "quickstart profile, parts: sampling 3.10 s" in text
    assert "quickstart profile, training: 10 kernels" in text
    assert "\nprofile, " not in text


def test_the_quickstarts_compiled_decode_is_said():
    compiled = {"step_s": 0.41, "sampling_s": 0.052, "training_s": 0.33}
    results = {"quickstart_variants": {"summary": {"quickstart/retrain-compiled": compiled}}}
    trained = {"step_s": 0.3, "sampling_s": 0.12, "training_s": 0.17}
    results["quickstart_variants"]["summary"]["quickstart/retrain-compiled-train"] = trained
    text = lease_report.report(results)
    assert "quickstart retrain-compiled: 0.41 s/step, sampling 0.052 s, training 0.330 s" in text
    assert (
        "quickstart retrain-compiled-train: 0.30 s/step, sampling 0.120 s, training 0.170 s" in text
    )
    failed = {"quickstart/retrain-compiled": {"failed": "124: timed out"}}
    assert "retrain-compiled" not in lease_report.report(
        {"quickstart_variants": {"summary": failed}}
    )


def test_the_quickstarts_training_times_per_step_are_said():
    """The median hides the quickstart's slow training steps (~2 s at steps 0, 1 and 4 on
    the H100 of 2026-11-27): each run's times after step 0 are listed, the baseline's and
    each variant's, SDPA off cuDNN's kernel among them."""

    def run(*training):
        return [{"steps": [{"training_s": t} for t in training]}]

    summary = {"step_s": 0.5, "sampling_s": 0.12, "training_s": 0.38}
    results = {
        "quickstart": {
            "summary": {"quickstart/retrain": {**summary, "correct_per_step": [0.1, 0.3]}},
            "runs": {"quickstart/retrain": run(2.24, 2.316, 0.211, 0.366, 1.959)},
        },
        "quickstart_variants": {
            "summary": {"quickstart/retrain-no-cudnn": {**summary, "training_s": 0.2}},
            "runs": {"quickstart/retrain-no-cudnn": run(1.9, 0.2, 0.21, None, 0.19)},
        },
    }
    lines = lease_report.report(results).splitlines()
    assert "quickstart retrain training s, steps 1+: 2.32 0.21 0.37 1.96" in lines
    assert "quickstart retrain-no-cudnn: 0.50 s/step, sampling 0.120 s, training 0.200 s" in lines
    assert "quickstart retrain-no-cudnn training s, steps 1+: 0.20 0.21 0.19" in lines
    del results["quickstart"]["runs"]  # nothing recorded: no line
    assert not any(
        "retrain training s" in line for line in lease_report.report(results).splitlines()
    )


def test_the_quickstart_profiles_host_time_is_said_by_thread():
    training = {
        "kernels": 10,
        "categories": {"matmul": {"us": 5.0, "kernels": 10, "share": 1.0}},
        "host_threads": [
            {"thread": 2, "busy_ms": 201.4, "events": 900},
            {"thread": 1, "busy_ms": 150.2, "events": 700},
        ],
        "optimizer_ms": 4.6,
    }
    text = lease_report.report({"profile_quickstart": {"summaries": {"training": training}}})
    assert (
        "quickstart profile, training, host: threads 201 ms, 150 ms (busiest first; on CUDA "
        "the backward has its own), optimizer 5 ms"
    ) in text


def test_the_varlen_headline_and_the_attention_layer_are_said():
    varlen = {"step_s": 5.31, "training_s": 2.02}
    attention = {
        "positions": 8302,
        "summary": {
            "flex": {"fwd_bwd_ms": 3.24, "fwd_ms": 0.37, "mask_ms": 1.5},
            "varlen": {"fwd_bwd_ms": 1.1, "fwd_ms": 0.3, "mask_ms": 0.4},
        },
        "decode": {"sdpa": {"64": 0.074, "320": 0.15}, "matmul": {"64": 0.021, "320": 0.06}},
        "decode_failed": {"flash-offsets": "ValueError: not the rule: max error 1.2"},
    }
    trained = {"step_s": 5.02, "training_s": 1.71, "peak_gpu_gb": 30.5}
    variants = {"headline/retrain-varlen": varlen, "headline/retrain-compiled-train": trained}
    text = lease_report.report({"variants": {"summary": variants}, "attention": attention})
    assert "retrain-varlen: 5.31 s/step, training 2.02 s" in text
    assert "retrain-compiled-train: 5.02 s/step, training 1.71 s, peak 30.5 GB" in text
    assert (
        "attention, one layer forward+backward at 8302 positions: flex 3.24 ms (forward 0.37, "
        "mask 1.50), varlen 1.10 ms (forward 0.30, mask 0.40)"
    ) in text
    assert "decode attention sdpa, a layer: 64 keys 74 us, 320 keys 150 us" in text
    assert "decode attention matmul, a layer: 64 keys 21 us, 320 keys 60 us" in text
    assert (
        "decode attention flash-offsets: not timed (ValueError: not the rule: max error 1.2)"
    ) in text
    failed = {"headline/retrain-varlen": {"failed": "124: timed out"}}
    assert "retrain-varlen" not in lease_report.report({"variants": {"summary": failed}})
