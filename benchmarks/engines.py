"""Sampling throughput of the server engines against the in-process pytorch engine, on the
same batch in one run.

    python benchmarks/engines.py --vllm http://127.0.0.1:8000 --max http://127.0.0.1:8001
    python benchmarks/engines.py --vllm URL --rounds 3 --json out.json
    python benchmarks/engines.py --llamacpp http://127.0.0.1:8080   # llama-server

The batch is the quickstart's shape: 4 arithmetic prompts (SmolLM2 chat template, the
quickstart system prompt) x 8 completions x 24 tokens at T = 1 (MAX 26.7 returns T = 1 logprobs only), seeded. Each engine
samples it `--rounds` times after one warm-up round (a fresh vLLM spends ~20 s on its first
request); tokens/s counts the sampled tokens (eos included). The pytorch engine runs on
retrain's cached SmolLM2 safetensors copy in fp32 with torch's default threads; a server's
speed depends on its own flags (dtype, LoRA on or off). `--adapter DIR` also times the
server engines through a LoRA adapter (what training samples from after step 0).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from retrain.models import resolve_model  # noqa: E402
from retrain.types import SamplingParams  # noqa: E402

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
SYSTEM = "You are a calculator. Put the final answer in \\boxed{}."
QUESTIONS = ["Calculate 3 + 4.", "Calculate 8 + 5.", "Calculate 2 + 9.", "Calculate 6 + 7."]


def prompts(tokenizer) -> list[list[int]]:
    out = []
    for q in QUESTIONS:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def time_engine(engine, batch, n: int, params: SamplingParams, rounds: int) -> dict:
    engine.sample(batch, n, params)  # warm-up
    seconds, tokens = [], []
    for r in range(rounds):
        p = SamplingParams(params.max_tokens, params.temperature, seed=(params.seed or 0) + r + 1)
        start = time.perf_counter()
        groups = engine.sample(batch, n, p)
        seconds.append(time.perf_counter() - start)
        tokens.append(sum(len(s) for g in groups for s in g))
    return {
        "seconds": [round(s, 2) for s in seconds],
        "tokens": tokens,
        "tokens_per_s": round(sum(tokens) / sum(seconds), 1),
    }


def pytorch_engine(path: str, tokenizer):
    import torch
    from transformers import AutoModelForCausalLM

    from retrain.engines.pytorch import PyTorchEngine

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    eos = {tokenizer.eos_token_id}
    return PyTorchEngine(model, eos, tokenizer.pad_token_id or 0, torch.device("cpu"))


def server_engine(name: str, url: str, tokenizer, adapter: str = ""):
    from retrain.engines.http import HTTPEngine
    from retrain.settings import EngineSettings

    engine = HTTPEngine(EngineSettings(name, url=url), tokenizer, {tokenizer.eos_token_id})
    engine.connect(needs_lora=bool(adapter))
    if adapter:
        engine.sync_adapter(adapter, 1)
    return engine


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name in ("vllm", "max", "sglang", "trtllm", "mlx", "openai"):
        ap.add_argument(f"--{name}", default="", metavar="URL", help=f"a running {name} server")
    ap.add_argument(
        "--llamacpp", default="", metavar="URL", help="a running llama-server (openai engine)"
    )
    ap.add_argument("--adapter", default="", help="also time the servers through this adapter")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--no-pytorch", action="store_true")
    ap.add_argument("--json", default="", help="write the results here")
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    path = resolve_model(MODEL).path
    tokenizer = AutoTokenizer.from_pretrained(path)
    batch, n = prompts(tokenizer), 8
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=0)
    rows: dict[str, dict] = {}
    if not args.no_pytorch:
        rows["pytorch (in-process, fp32)"] = time_engine(
            pytorch_engine(path, tokenizer), batch, n, params, args.rounds
        )
    for name in ("vllm", "max", "sglang", "trtllm", "mlx", "openai"):
        url = getattr(args, name)
        if not url:
            continue
        rows[f"{name} (base)"] = time_engine(
            server_engine(name, url, tokenizer), batch, n, params, args.rounds
        )
        if args.adapter and name in ("vllm", "sglang"):
            rows[f"{name} (through the adapter)"] = time_engine(
                server_engine(name, url, tokenizer, args.adapter), batch, n, params, args.rounds
            )
    if args.llamacpp:  # the openai engine recognises llama.cpp and speaks its dialect
        rows["llamacpp (openai engine, base)"] = time_engine(
            server_engine("openai", args.llamacpp, tokenizer), batch, n, params, args.rounds
        )
    print(f"Sampling {len(batch)} prompts x {n} x {params.max_tokens} tokens, T = 1")
    print(f"{'engine':34s} {'tokens/s':>9s}  rounds (s)")
    for name, row in rows.items():
        print(f"{name:34s} {row['tokens_per_s']:9.1f}  {row['seconds']}")
    if args.json:
        meta = {"machine": platform.machine(), "python": platform.python_version()}
        Path(args.json).write_text(json.dumps({"meta": meta, "engines": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
