"""Where the time of one headline step goes: its parts timed through the real local
backend, then one training step and one short sampling call under torch.profiler, broken
down by kernel and by kind of kernel (matmul, attention, norm, sampling, copies,
elementwise).

The headline shape by default: the random-weight Qwen3-4B-shaped model that
benchmarks/gpu.py builds (`--model-dir /tmp/rand4b`), LoRA r32, 8 prompts of 55 random
tokens x 16 completions of 256 tokens (random weights never emit end-of-sequence, so every
completion runs to `--max-tokens`: fixed work), the training datums built from those
completions with advantages +-0.5. After a warm-up (CUDA graphs captured, FlexAttention
compiled, optimizer state allocated) the parts are timed without the profiler:

- sampling right after a training step (which may have given the sampler's caches back,
  so its graphs are captured again) and sampling again at once (graphs kept);
- the training step, its micro-batches, and a training step of one tiny datum: what a
  step costs whatever its size (optimizer, clipping, the sampler's refresh, syncs).

Then the training step is profiled (device kernels, the share of the wall time the device
was busy, and the host's busiest ops) and a sampling call of `--profile-tokens` tokens run
eagerly (the graphs set aside for it: the same kernels, each seen by the profiler; a
whole headline call is ~350k kernels, which the profiler took minutes to process). A
table per phase goes to stdout, everything to `--json`; `--trace-dir` also writes the
Chrome traces (large). Extra retrain config flags go after `--`.

    python benchmarks/profile_step.py                      # the headline, on gpu:0
    python benchmarks/profile_step.py --smoke              # the plumbing, on the CPU
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import math
import platform
import re
import shutil
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

# (name, microseconds, is_device_kernel): one kernel launch (CUDA) or one op call's self
# time (CPU, where the profiler sees no device kernels).
Record = tuple[str, float, bool]

# Kinds of kernel, matched case-insensitively on the name; the first match wins, so a more
# specific kind sits above a broader one (an "addmm" is a matmul, not an "add"; a fused RMS
# norm named `triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0` is a norm, not a copy).
# Attention comes before matmul: flash and memory-efficient attention kernels carry
# `cutlass` in their names (`fmha_cutlassF_...`, template arguments `cutlass::bfloat16_t`).
# Beyond the obvious words: `gemv` (small LoRA products), `rsqrt` in norm (only the RMS
# norm takes one here). Extend here.
CATEGORIES: tuple[tuple[str, str], ...] = (
    ("attention", r"flash|fmha|attention|flex|sdpa|triton_tem"),
    ("matmul", r"gemm|gemv|cutlass|cublas|nvjet|sm90_xmma|matmul|addmm|\bmm\b|bmm|linear"),
    ("norm", r"rms_norm|layer_norm|norm|rsqrt"),
    ("softmax_sample", r"softmax|cumsum|scan|searchsorted|sort|argmax|multinomial"),
    ("copy", r"copy|memcpy|memset|cat|index|gather|scatter|fill|clone|contiguous"),
    ("elementwise", r"elementwise|vectorized|unrolled|mul|add|sub|div|neg|exp|silu|pow|where"),
    ("triton_fused", r"triton"),
    ("other", r""),
)
_COMPILED = [(kind, re.compile(pattern, re.IGNORECASE)) for kind, pattern in CATEGORIES]


def category(name: str) -> str:
    return next(kind for kind, pattern in _COMPILED if pattern.search(name))


def summarise(records: list[Record], top: int, tokens: int | None = None) -> dict[str, Any]:
    """Total, per-kind and top-`top` breakdown of one phase's records (pure: no torch).
    `tokens`: decoded tokens per row, for kernels per decode step (sampling only)."""
    total = sum(us for _, us, _ in records)
    kinds: dict[str, dict[str, float]] = {k: {"us": 0.0, "kernels": 0} for k, _ in CATEGORIES}
    names: dict[str, list[float]] = defaultdict(list)
    for name, us, _ in records:
        kind = kinds[category(name)]
        kind["us"] += us
        kind["kernels"] += 1
        names[name].append(us)
    for kind in kinds.values():
        kind["share"] = kind["us"] / total if total else 0.0
    ranked = sorted(names.items(), key=lambda item: (-sum(item[1]), item[0]))[:top]
    return {
        "device_kernels_seen": any(device for _, _, device in records),
        "total_us": total,
        "kernels": len(records),
        "kernels_per_token": len(records) / tokens if tokens else None,
        "categories": kinds,
        "top": [
            {
                "name": name,
                "category": category(name),
                "count": len(times),
                "total_us": sum(times),
                "mean_us": sum(times) / len(times),
                "share": sum(times) / total if total else 0.0,
            }
            for name, times in ranked
        ],
    }


def on_device(event: Any) -> bool:
    """Whether a profiler event ran on the device: told by its `device_type`
    (DeviceType.CUDA; read by name, defensively)."""
    kind = getattr(event, "device_type", None)
    return str(getattr(kind, "name", kind)).upper().endswith("CUDA")


def kernels(prof: Any) -> list[Any]:
    """The device kernels of a finished profile. Its user annotations (`record_function`
    ranges mirrored onto the GPU timeline, e.g. "Optimizer.step#AdamW.step") span
    kernels already counted: left out, as torch's own tables do."""
    return [
        e for e in prof.events() if on_device(e) and not getattr(e, "is_user_annotation", False)
    ]


def records_from(prof: Any) -> list[Record]:
    """The device kernels of a finished profile (`kernels`), or, when it saw none (a
    CPU, where the profile records CPU ops only), every CPU op call's self time."""
    device = [(e.name, float(e.time_range.elapsed_us()), True) for e in kernels(prof)]
    if device:
        return device
    # self time, so nested ops are not counted twice; per call (not key_averages' per
    # name), so the counts stay those of the calls; async events have no self time
    return host_records(prof)


def covered_us(spans: list[tuple[float, float]]) -> float:
    """The time the union of (start, end) spans covers: how long the device ran at least
    one kernel (overlapping kernels, on several streams, counted once)."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def kernel_spans(prof: Any) -> list[tuple[float, float]]:
    """(start, end) microseconds of each device kernel of a finished profile."""
    return [(float(e.time_range.start), float(e.time_range.end)) for e in kernels(prof)]


def host_records(prof: Any) -> list[Record]:
    """Every CPU op call's self time (where the host spent a profiled phase)."""
    return [
        (e.name, float(e.self_cpu_time_total), False)
        for e in prof.events()
        if not on_device(e) and not getattr(e, "is_async", False)
    ]


def host_threads(events: list[tuple[int, float, float]]) -> list[dict[str, float]]:
    """The host's time by thread from a phase's top-level CPU events (thread, start us,
    end us): per thread, the time its events cover and their count, busiest first. On
    CUDA autograd runs the backward on a thread of its own, so a host-bound step splits
    into the main thread's (forward, loss, optimizer, the sums read back) and the
    backward's."""
    spans: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for thread, start, end in events:
        spans[thread].append((start, end))
    rows = [
        {"thread": thread, "busy_ms": covered_us(s) / 1e3, "events": len(s)}
        for thread, s in spans.items()
    ]
    return sorted(rows, key=lambda row: -row["busy_ms"])


def host_events(prof: Any) -> list[tuple[int, float, float]]:
    """(thread, start us, end us) of a finished profile's top-level CPU events."""
    return [
        (int(e.thread), float(e.time_range.start), float(e.time_range.end))
        for e in prof.events()
        if not on_device(e) and getattr(e, "cpu_parent", None) is None
    ]


def optimizer_ms(prof: Any) -> float:
    """The host time of the optimizer's steps (torch annotates them "Optimizer.step#...")."""
    return sum(
        e.time_range.elapsed_us() / 1e3
        for e in prof.events()
        if not on_device(e) and e.name.startswith("Optimizer.step#")
    )


def table(phase: str, summary: dict[str, Any], cuda: bool) -> str:
    """A short markdown breakdown of one phase: kinds by share, then the top kernels."""
    what = "device kernels" if summary["device_kernels_seen"] else "CPU ops (self time)"
    lines = [
        f"\n## {phase}: {summary['total_us'] / 1e3:.1f} ms of {what}, {summary['kernels']} calls"
    ]
    if summary["kernels_per_token"] is not None:
        lines[0] += f", {summary['kernels_per_token']:.1f} per decoded token"
    if cuda and not summary["device_kernels_seen"]:
        lines.append(
            "No device kernels were seen (CUDA-graph replays can hide them from the "
            "profiler): re-run with `-- --backend-opt decode=static`, the same kernels eagerly."
        )
    lines += ["", "| category | share % | ms | kernels |", "|---|---:|---:|---:|"]
    kinds = sorted(summary["categories"].items(), key=lambda kv: -kv[1]["us"])
    for kind, row in kinds:
        if row["kernels"]:
            lines.append(
                f"| {kind} | {100 * row['share']:.1f} | {row['us'] / 1e3:.2f} | {row['kernels']} |"
            )
    lines += ["", "| share % | ms | count | mean us | category | name |"]
    lines.append("|---:|---:|---:|---:|---|---|")
    for t in summary["top"]:
        name = t["name"] if len(t["name"]) <= 90 else t["name"][:87] + "..."
        lines.append(
            f"| {100 * t['share']:.1f} | {t['total_us'] / 1e3:.2f} | {t['count']} "
            f"| {t['mean_us']:.1f} | {t['category']} | `{name}` |"
        )
    return "\n".join(lines)


def finite(value: Any) -> Any:
    """`value` with NaN and infinities as None, so the JSON stays valid JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="/tmp/rand4b")
    p.add_argument("--devices", default="gpu:0")
    p.add_argument("--lora-rank", type=int, default=32)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=16, help="completions per prompt")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=55)
    p.add_argument(
        "--profile-tokens", type=int, default=24, help="tokens of the profiled sampling call"
    )
    p.add_argument("--top", type=int, default=30, help="kernels listed per phase")
    p.add_argument("--smoke", action="store_true", help="a tiny model on the CPU (plumbing)")
    p.add_argument("--json", default="benchmarks/results/profile_step.json")
    p.add_argument("--trace-dir", default=None, help="also write Chrome traces here (large)")
    p.add_argument("flags", nargs="*", help="extra config flags (after --)")
    args = p.parse_args(argv)
    if args.smoke:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from gpu import SMOKE, random_model

        scratch = tempfile.mkdtemp(prefix="smoke-model-")
        atexit.register(shutil.rmtree, scratch, True)  # scratch: gone at exit
        args.model = str(random_model(Path(scratch) / "m", SMOKE, "cpu"))
        args.devices, args.prompts, args.group, args.max_tokens = "cpu", 2, 2, 8
        args.lora_rank = 8
    return args


def build(args: argparse.Namespace, said: list[str]) -> tuple[Any, Any]:
    """The local backend and the TrainHyper a run of this shape would use, from the
    quickstart template plus the shape's flags and the extra ones (as memory_fit.py)."""
    from transformers import AutoTokenizer

    from retrain.build import build_backend, train_hyper
    from retrain.cli.init import templates
    from retrain.config import load_config

    work = Path(tempfile.mkdtemp(prefix="profile-step-"))
    atexit.register(shutil.rmtree, work, True)  # scratch: gone at exit
    path = work / "retrain.toml"
    path.write_text(templates()["quickstart"])
    flags = ["--model", args.model, "--devices", args.devices, "--log-dir", str(work / "logs")]
    flags += ["--lora-rank", str(args.lora_rank), "--batch-size", str(args.prompts)]
    flags += ["--group-size", str(args.group), "--max-tokens", str(args.max_tokens)]
    flags += ["--temperature", "1.0", "--top-p", "1.0"]
    config = load_config(path, [*flags, *args.flags])
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    return build_backend(config, tokenizer, say=said.append), train_hyper(config)


def timed(call: Callable[[], Any], gpus: list[Any]) -> tuple[Any, float]:
    """`call()` and its wall seconds; on CUDA up to its last kernel, not its last launch
    (on every device the backend uses: sampling and training differ in split mode)."""
    import torch

    for device in gpus:
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    out = call()
    for device in gpus:
        torch.cuda.synchronize(device)
    return out, time.perf_counter() - start


def profiled(
    phase: str,
    call: Callable[[], Any],
    gpus: list[Any],
    tokens: int | None,
    args: argparse.Namespace,
    host: bool = False,
) -> dict[str, Any]:
    """One more `call()` under torch.profiler: its summary (and Chrome trace if asked).
    `host`: the CPU ops too, for the host's busiest ops, its time by thread and in the
    optimizer, and the device's busy share (a training step is ~50k of them; a sampling
    call's would triple what the profiler processes, so it records the device's kernels
    only)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = bool(gpus)
    activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    if host and cuda:
        activities.append(ProfilerActivity.CPU)
    with profile(activities=activities) as prof:
        _, seconds = timed(call, gpus)
    summary = {"profiled_s": seconds, **summarise(records_from(prof), args.top, tokens)}
    if cuda:  # how much of the wall time the device ran a kernel: the rest is the host's
        summary["device_busy_s"] = covered_us(kernel_spans(prof)) / 1e6
        summary["device_busy_share"] = summary["device_busy_s"] / seconds
    if host:  # by thread (on CUDA the backward's own), and the optimizer's step
        summary["host_threads"] = host_threads(host_events(prof))
        summary["optimizer_ms"] = optimizer_ms(prof)
    if host and cuda:
        ops = summarise(host_records(prof), args.top)
        summary["host_top"] = ops["top"][: min(args.top, 15)]
    if args.trace_dir:
        Path(args.trace_dir).mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(Path(args.trace_dir) / f"{phase}.json"))
    print(table(phase, summary, cuda), flush=True)
    if "device_busy_share" in summary:
        print(
            f"device busy {summary['device_busy_s']:.3f} s of {seconds:.3f} s "
            f"({100 * summary['device_busy_share']:.0f}%)",
            flush=True,
        )
    for row in summary.get("host_threads", []):
        print(f"  host thread {row['thread']}: {row['busy_ms']:.1f} ms in {row['events']} calls")
    if "optimizer_ms" in summary:
        print(f"  host optimizer step: {summary['optimizer_ms']:.1f} ms")
    for t in summary.get("host_top", []):
        print(f"  host {t['total_us'] / 1e3:8.1f} ms {t['count']:6d}x {t['name'][:80]}")
    return summary


@contextlib.contextmanager
def eager(backend: Any) -> Iterator[None]:
    """A context in which the sampler decodes without its CUDA graphs (nor keeps caches
    for them): the same step's kernels, each one seen by the profiler."""
    static = getattr(backend.engine, "static", None)
    if static is None or not static.graphs:
        yield
        return
    static.graphs = static.keep = False
    try:
        yield
    finally:
        static.graphs = static.keep = True


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    import numpy as np
    import torch

    from retrain.types import Datum, SamplingParams

    said: list[str] = []
    backend, hyper = build(args, said)
    gpus = [d for d in {backend.infer_device, backend.train_device} if d.type == "cuda"]
    vocab = backend.model.get_input_embeddings().weight.shape[0]
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, vocab, args.prompt_len).tolist() for _ in range(args.prompts)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, top_p=1.0, seed=0)

    def sample() -> list[Any]:
        return backend.sample(prompts, args.group, params)

    def datums(groups: list[Any]) -> list[Any]:
        return [
            Datum(p, s.token_ids, s.logprobs, np.full(len(s), 0.5 - i % 2))
            for p, group in zip(prompts, groups)
            for i, s in enumerate(group)
        ]

    # warm-up: CUDA graphs captured, FlexAttention compiled, the optimizer's state allocated
    batch = datums(sample())
    warm = backend.train_step(batch, hyper)
    groups, after_train_s = timed(sample, gpus)  # graphs captured again if training released them
    groups, sample_s = timed(sample, gpus)  # at once: the graphs kept
    batch = datums(groups)  # the timed sampling's completions: exactly the headline's shapes
    result, train_s = timed(lambda: backend.train_step(batch, hyper), gpus)
    first = batch[0]  # its first 8 tokens alone: a step with next to nothing to train
    tiny = [
        Datum(
            first.prompt_ids,
            first.completion_ids[:8],
            first.sampler_logprobs[:8],
            first.advantages[:8],
        )
    ]
    backend.train_step(tiny, hyper)  # its shapes compiled
    _, tiny_s = timed(lambda: backend.train_step(tiny, hyper), gpus)
    sampled = sum(len(s) for g in groups for s in g)
    trained = sum(d.num_trained_tokens for d in batch)
    timings = {
        "sample_after_train_s": after_train_s,
        "sample_s": sample_s,
        "sampled_tokens": sampled,
        "sample_tokens_per_s": sampled / sample_s,
        "ms_per_decode_step": 1e3 * sample_s / args.max_tokens,  # every row runs to the end
        "train_s": train_s,
        "trained_tokens": trained,
        "train_tokens_per_s": trained / train_s,
        "micro_batches": len(backend._micro_batches(batch)),
        "tiny_train_s": tiny_s,  # a step of one 8-token completion: what any step costs
        "warm_extra": dict(warm.extra),  # did training release the sampler's caches
        "train_extra": dict(result.extra),  # the engine's metrics too (CUDA graphs or not)
    }
    print(
        f"\nunprofiled: sampling {sample_s:.3f} s ({sampled / sample_s:.0f} tok/s, "
        f"{timings['ms_per_decode_step']:.1f} ms a decode step; {after_train_s:.3f} s right "
        f"after a training step), training {train_s:.3f} s ({trained / train_s:.0f} tok/s, "
        f"{timings['micro_batches']} micro-batches), a one-datum step {tiny_s:.3f} s",
        flush=True,
    )
    short = replace(params, max_tokens=min(args.profile_tokens, args.max_tokens))
    with eager(backend):
        summaries = {
            "training": profiled(
                "training", lambda: backend.train_step(batch, hyper), gpus, None, args, host=True
            ),
            "sampling": profiled(
                "sampling",
                lambda: backend.sample(prompts, args.group, short),
                gpus,
                short.max_tokens,
                args,
            ),
        }
    machine = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name(gpus[0]) if gpus else None,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    out = {"args": vars(args), "machine": machine, "said": said, "timings": timings}
    out["summaries"] = summaries
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(finite(out), indent=2, default=str))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
