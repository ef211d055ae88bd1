"""Sampling throughput: retrain's pytorch engine vs plain HF `generate` on the same batch.

The quickstart's batch (4 prompts x 8 completions, 24 new tokens, temperature 1, no
top-k/top-p) on SmolLM2-135M-Instruct with a fresh LoRA adapter (r16, all projections),
as the trainer samples it. Every completion runs the full 24 tokens (eos is ignored by
both) so tokens/s compare like for like. Variants alternate within one invocation, round
by round; medians are reported with the load average of each measurement.

    python benchmarks/sampling.py --rounds 5
    python benchmarks/sampling.py --threads 1,2 --variants generate,engine,unmerged,bf16

Variants on a float32 model: generate (HF `generate` on the PEFT model), engine
(retrain's engine, merged LoRA), unmerged (the engine on the PEFT model as is), bf16
(`[inference] dtype = "bf16"`, a wholly bf16 copy). On the local backend's bf16 mode
(bf16 block weights, float32 rest and adapter; the default on a GPU or a bf16 CPU):
blocks (the engine: the adapter beside the bf16 weights, in float32, sibling
projections as one matmul), blocks_unfused (each projection its own matmul), blocks_peft
(the engine on the PEFT model as is), blocks_folded (the adapter folded into the bf16
weights, rounded: the faster copy retrain does not use, because it rounds a small update
away), blocks_static (the engine through the static decoder: a preallocated cache, one
fixed-shape step), blocks_static_rows (the same prefilling every row's prompt, a group's
copies each, as it did before 2026-11-27: each distinct prompt is fed once now),
blocks_compiled (that step compiled by torch.compile: `decode =
"compiled"`; its compile falls in the warm-up round, timed apart). `--mismatch` prints each
variant's trainer-minus-sampler logprobs instead.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

BATCH, GROUP, TOKENS = 4, 8, 24


def load(blocks_bf16: bool = False, lora_b_std: float = 0.01):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from retrain.kernels.lora_layers import lean_lora_forward
    from retrain.kernels.precision import bf16_linears
    from retrain.models import load_tokenizer, resolve_model

    name = "HuggingFaceTB/SmolLM2-135M-Instruct"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(resolve_model(name).path, dtype=torch.float32)
    if blocks_bf16:
        bf16_linears(model)  # as the local backend does, before the adapter
    lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
    model = get_peft_model(model, lora)
    lean_lora_forward(model)  # as the local backend does: the trainer's LoRA sum in addmm
    # A trained adapter is not zero: give B small values so the LoRA path computes.
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, lora_b_std)
    return model.eval(), load_tokenizer(name)


def fold_into_bf16(engine) -> None:
    """Replace the copy's adapter-beside layers by bf16 layers holding W + scaling * B @ A
    rounded to bf16 (the alternative docs/performance.md measures against)."""
    from retrain.kernels.precision import Bf16Linear

    engine.copy.refresh()
    with torch.no_grad():
        for i, (layer, side) in enumerate(engine.copy.pairs):
            w = side.base.weight
            folded = Bf16Linear(w.shape[1], w.shape[0], bias=False)
            ad = layer.active_adapters[0]
            delta = layer.lora_B[ad].weight @ layer.lora_A[ad].weight * layer.scaling[ad]
            folded.weight = torch.nn.Parameter((w.float() + delta).to(w.dtype), False)
            for parent in engine.copy.model.modules():
                for name, child in parent.named_children():
                    if child is side or getattr(child, "part", None) is side:  # a Sibling
                        setattr(parent, name, folded)
            engine.copy.pairs[i] = (layer, folded)
    engine.copy.refresh = lambda: None  # a fixed adapter here


def unfuse(engine) -> None:
    """Put each sibling projection of the copy back as its own layer (the copy before
    sibling projections ran as one matmul)."""
    for parent in engine.copy.model.modules():
        for name, child in list(parent.named_children()):
            if hasattr(child, "part"):  # a Sibling
                setattr(parent, name, child.part)


def prompts(tokenizer) -> list[list[int]]:
    from retrain.build import build_data
    from retrain.cli.init import templates
    from retrain.config import load_config

    path = Path("/tmp/retrain-sampling-bench.toml")
    path.write_text(templates()["quickstart"])
    config = load_config(path, [])
    data, renderer = build_data(config, tokenizer, lambda s: None)
    return [renderer.encode(e) for e in data.next_batch(BATCH)]


def run_generate(model, tokenizer, prompts_B, seed: int) -> int:
    width = max(len(p) for p in prompts_B)
    pad = tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts_B])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts_B])
    torch.manual_seed(seed)
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=TOKENS,
            min_new_tokens=TOKENS,
            num_return_sequences=GROUP,
            pad_token_id=pad,
        )
    return (out.shape[1] - width) * out.shape[0]


def run_engine(engine, prompts_B, seed: int) -> int:
    from retrain.types import SamplingParams

    params = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=TOKENS, seed=seed)
    groups = engine.sample(prompts_B, GROUP, params)
    return sum(len(s.token_ids) for g in groups for s in g)


def make_engine(model, tokenizer, **kw):
    from retrain.engines.pytorch import PyTorchEngine

    # eos id -1 never occurs: every row decodes all TOKENS
    return PyTorchEngine(model, {-1}, tokenizer.pad_token_id, torch.device("cpu"), **kw)


def mismatch(model, tokenizer, prompts_B, engines: dict) -> dict:
    """Sampler vs trainer logprobs on the tokens each engine sampled: the trainer's are the
    PEFT model's on the whole sequence (what the importance ratio compares against)."""
    out = {}
    for name, engine in engines.items():
        groups = engine.sample(prompts_B, GROUP, _params(seed=123))
        diffs = []
        for prompt, group in zip(prompts_B, groups):
            for s in group:
                ids = torch.tensor([prompt + s.token_ids.tolist()])
                with torch.inference_mode():
                    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
                want = torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt) :, None])
                diffs.append(want[:, 0].double().numpy() - s.logprobs)
        flat = torch.tensor([d for x in diffs for d in x])
        out[name] = {"mean": float(flat.mean()), "max_abs": float(flat.abs().max())}
        print(
            f"{name:<10} trainer - sampler logprob: mean {out[name]['mean']:+.2e}, max |.| {out[name]['max_abs']:.2e}"
        )
    return out


def every_row_prefilled(run, seed: int) -> int:
    """`run(seed)` with the static decoder feeding every row's prompt to its prefill."""
    from retrain.engines import static_decode

    shared = static_decode.distinct_rows
    static_decode.distinct_rows = lambda prompts: (None, None)
    try:
        return run(seed)
    finally:
        static_decode.distinct_rows = shared


def _params(seed: int):
    from retrain.types import SamplingParams

    return SamplingParams(temperature=1.0, top_p=1.0, max_tokens=TOKENS, seed=seed)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--threads", default=str(torch.get_num_threads()))
    p.add_argument("--variants", default="generate,engine,unmerged,bf16")
    p.add_argument("--json", default="benchmarks/results/sampling.json")
    p.add_argument("--mismatch", action="store_true", help="only the logprob mismatch")
    p.add_argument(
        "--lora-b-std",
        type=float,
        default=0.01,
        help="std of the adapter's B (0.01: a trained adapter; 1e-4: after a few steps)",
    )
    args = p.parse_args(argv)
    variants = args.variants.split(",")
    model, tokenizer = load(lora_b_std=args.lora_b_std)
    prompts_B = prompts(tokenizer)
    engines = {}
    if {"engine", "unmerged", "bf16"} & set(variants):
        engines["engine"] = make_engine(model, tokenizer)
        engines["unmerged"] = make_engine(model, tokenizer, sampling_copy=False)
        engines["bf16"] = make_engine(model, tokenizer, dtype="bf16")
    if any(v.startswith("blocks") for v in variants):
        blocks, _ = load(blocks_bf16=True, lora_b_std=args.lora_b_std)
        engines["blocks"] = make_engine(blocks, tokenizer)
        engines["blocks_peft"] = make_engine(blocks, tokenizer, sampling_copy=False)
        engines["blocks_folded"] = make_engine(blocks, tokenizer)
        fold_into_bf16(engines["blocks_folded"])
        engines["blocks_unfused"] = make_engine(blocks, tokenizer)
        unfuse(engines["blocks_unfused"])
        engines["blocks_static"] = make_engine(blocks, tokenizer, decode="static")
        engines["blocks_static_rows"] = make_engine(blocks, tokenizer, decode="static")
        engines["blocks_compiled"] = make_engine(blocks, tokenizer, decode="compiled")
    engines = {k: e for k, e in engines.items() if k in variants}
    if args.mismatch:
        result = {}
        for name, engine in engines.items():
            trainer = blocks if name.startswith("blocks") else model
            result.update(mismatch(trainer, tokenizer, prompts_B, {name: engine}))
        Path(args.json).write_text(json.dumps({"mismatch": result}, indent=2))
        return 0
    runners = {"generate": lambda s: run_generate(model, tokenizer, prompts_B, s)}
    for name, engine in engines.items():
        runners[name] = lambda s, e=engine: run_engine(e, prompts_B, s)
    if "blocks_static_rows" in runners:
        rows = runners["blocks_static_rows"]
        runners["blocks_static_rows"] = lambda s: every_row_prefilled(rows, s)
    variants = [(v, int(t)) for v in variants for t in args.threads.split(",")]
    runs: dict[str, list[dict]] = {f"{v}/t{t}": [] for v, t in variants}
    warmup: dict[str, float] = {}  # round 0's seconds: a compile, when there is one
    for r in range(args.rounds + 1):  # round 0 warms up
        for v, t in variants:
            torch.set_num_threads(t)
            start = time.perf_counter()
            tokens = runners[v](r)
            seconds = time.perf_counter() - start
            load1 = os.getloadavg()[0]
            print(f"round {r} {v}/t{t}: {tokens / seconds:.1f} tok/s, load {load1:.1f}", flush=True)
            if not r:
                warmup[f"{v}/t{t}"] = seconds
            else:
                runs[f"{v}/t{t}"].append({"tok_s": tokens / seconds, "s": seconds, "load1": load1})
    print(
        f"{'variant':<20} {'tok/s':>8} {'s':>7} {'load':>6} {'warm-up s':>10}   (median of {args.rounds})"
    )
    summary = {}
    for key, rs in runs.items():
        summary[key] = {k: statistics.median(x[k] for x in rs) for k in ("tok_s", "s", "load1")}
        summary[key]["warmup_s"] = warmup[key]
        s = summary[key]
        print(
            f"{key:<20} {s['tok_s']:>8.1f} {s['s']:>7.2f} {s['load1']:>6.1f} {s['warmup_s']:>10.2f}"
        )
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"summary": summary, "runs": runs}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
