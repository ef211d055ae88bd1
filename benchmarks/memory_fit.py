"""Calibrate retrain/memory.py's memory model on a device: train micro-batches of growing
size through the local backend and compare each one's measured peak with the estimate.

Each size is one training step (one micro-batch: `micro_batch_tokens` is set above the
largest) on groups of a 70-token prompt and `--completions` completions of `--tokens` tokens. The peak is torch's `max_memory_allocated` over the step; `live` is what was
allocated before it (weights, adapter, optimizer state after the first step). The slope
of (peak - live) over the packed positions, divided by hidden x layers, is the
`activation_bytes` a calibration writes into MEMORY_MODELS, and the intercept what a step
holds whatever its size. Each size runs `--repeat` steps and the last is timed (the first
pays for the allocator's growth and new shapes), so `tokens_per_s` over the sizes shows
what a larger micro-batch buys in speed, beside what it costs in memory.

    python benchmarks/memory_fit.py --model /tmp/rand4b --devices gpu:0 --groups 1,2,3,4
    python benchmarks/memory_fit.py --smoke            # the plumbing, on the CPU
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def datums(groups: int, completions: int, tokens: int, vocab: int, seed: int):
    import numpy as np

    from retrain.types import Datum

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(groups):
        prompt = rng.integers(100, vocab, 70).tolist()
        for i in range(completions):
            ids = rng.integers(100, vocab, tokens)
            lp = -rng.random(tokens)
            out.append(Datum(prompt, ids, lp, np.full(tokens, 0.5 - i % 2)))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="/tmp/rand4b")
    p.add_argument("--devices", default="gpu:0")
    p.add_argument("--lora-rank", type=int, default=32)
    p.add_argument("--groups", default="1,2,3,4", help="groups per measured step")
    p.add_argument("--completions", type=int, default=4)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--repeat", type=int, default=2, help="steps per size; the last one is timed")
    p.add_argument("--smoke", action="store_true", help="a tiny model on the CPU (plumbing)")
    p.add_argument("--json", default="benchmarks/results/memory_fit.json")
    p.add_argument("flags", nargs="*", help="extra config flags (after --)")
    args = p.parse_args(argv)

    import torch
    from transformers import AutoTokenizer

    from retrain.build import build_backend
    from retrain.cli.init import templates
    from retrain.config import load_config
    from retrain.memory import memory_model, shape_from_config, training_memory
    from retrain.types import TrainHyper

    sizes = [int(g) for g in args.groups.split(",")]
    if args.smoke:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from gpu import SMOKE, random_model

        scratch = tempfile.mkdtemp(prefix="smoke-model-")
        atexit.register(shutil.rmtree, scratch, True)  # scratch: gone at exit
        args.model = str(random_model(Path(scratch) / "m", SMOKE, "cpu"))
        args.devices, args.tokens, sizes = "cpu", 16, [1, 2]
    work = Path(tempfile.mkdtemp(prefix="memory-fit-"))
    atexit.register(shutil.rmtree, work, True)  # scratch: gone at exit
    path = work / "retrain.toml"
    path.write_text(templates()["quickstart"])
    budget = max(sizes) * (70 + args.completions * args.tokens) * 2
    flags = ["--model", args.model, "--devices", args.devices]
    flags += ["--lora-rank", str(args.lora_rank), "--log-dir", str(work / "logs")]
    # the plain activations are what it calibrates: checkpointing = "auto" would turn
    # activation checkpointing on at a micro-batch of one completion that ran out
    flags += ["--backend-opt", "checkpointing=false"]
    config = load_config(path, [*flags, *args.flags])
    said: list[str] = []
    backend = build_backend(config, AutoTokenizer.from_pretrained(args.model), say=said.append)
    # one micro-batch per measured step, past the run-start check (which refuses a
    # budget over its own estimate: the thing being calibrated)
    backend.options = dataclasses.replace(backend.options, micro_batch_tokens=budget)
    device = backend.train_device
    cuda = device.type == "cuda"
    shape = shape_from_config(backend.model.config.to_dict())
    dtype = "bf16" if backend.bf16 else "fp32"
    hyper = TrainHyper(lr=1e-6, weight_decay=0.0, beta1=0.9, beta2=0.95, eps=1e-8)
    vocab = backend.model.get_input_embeddings().weight.shape[0]
    per_group = 70 + args.completions * args.tokens
    rows = []
    # the first step allocates the optimizer's state: run it once, unmeasured
    backend.train_step(datums(1, 2, 8, vocab, seed=99), hyper)
    for k in sizes:
        batch = datums(k, args.completions, args.tokens, vocab, seed=k)
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
            live = torch.cuda.memory_allocated(device)
        times = []
        for _ in range(args.repeat):  # the first pays the allocator's growth and new shapes
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            start = time.perf_counter()
            result = backend.train_step(batch, hyper)
            if cuda:
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
        seconds = times[-1]
        positions = k * per_group
        row = {
            "groups": k,
            "positions": positions,
            "trained_tokens": k * args.completions * args.tokens,
            "seconds": seconds,
            "seconds_each": times,
            "tokens_per_s": k * args.completions * args.tokens / seconds,
            "oom_retries": result.extra.get("oom_retries"),
            "checkpointing": result.extra.get("checkpointing"),
            "estimate_gib": training_memory(shape, backend.sizing, positions).total / 2**30,
        }
        if cuda:
            peak = torch.cuda.max_memory_allocated(device)
            row.update(
                live_gib=live / 2**30,
                peak_gib=peak / 2**30,
                reserved_gib=torch.cuda.max_memory_reserved(device) / 2**30,
                step_gib=(peak - live) / 2**30,
                per_position_per_unit=(peak - live) / (positions * shape.hidden * shape.layers),
            )
        rows.append(row)
        print(json.dumps(row), flush=True)
    fit = {}
    if cuda and len(rows) >= 2:
        xs = [r["positions"] for r in rows]
        ys = [r["step_gib"] * 2**30 for r in rows]
        slope, intercept = statistics.linear_regression(xs, ys)
        fit = {
            "bytes_per_position": slope,
            "activation_bytes": slope / (shape.hidden * shape.layers),
            "intercept_gib": intercept / 2**30,
            "model_now": vars(memory_model(device.type, dtype)),
        }
        print(json.dumps(fit), flush=True)
    out = {
        "rows": rows,
        "fit": fit,
        "model": args.model,
        "dtype": dtype,
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "torch": torch.__version__,
        "said": said,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2, default=str))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
