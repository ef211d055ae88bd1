"""Time one attention layer's forward and backward over a training micro-batch's packed
rows, in each way `[backend.options] attention` offers, alternating run by run in one
invocation: the dense L x L mask through SDPA's memory-efficient kernel
(retrain/kernels/masked_attention.py), FlexAttention (compiled) with its block
mask, and flash attention's variable-length kernel over the rows cut into sequences
(retrain/kernels/varlen.py). Each also times packing the rows and building its mask on
the device, which a micro-batch pays once for all its layers.

The default layout is a headline micro-batch on a GPU: 2 rows of a 55-token prompt and
16 completions of 255 fed tokens (256 new tokens, the last predicts nothing), Qwen3-4B's
heads (32 query, 8 key/value, 128 wide), bf16. An H100 lease of 2026-11-27 measured
FlexAttention's backward at ~2.9 ms a call there, ~8x its forward: this says whether the
variable-length kernel does better, before `attention = "auto"` is pointed at it.

    python benchmarks/attention.py                      # on a GPU: all three
    python benchmarks/attention.py --smoke              # the plumbing, on the CPU

Then the decode step's attention (one query position per row over the cache's filled
keys, an additive mask: `flex.grouped_decode`, SDPA, which takes cuDNN's kernel on an
H100) against SDPA held to its memory-efficient kernel (`decode_efficient`) and the same
by explicit products (`decode_matmul`), with SDPA unmasked as a bound on what the mask
costs (`decode_unmasked`), and, on CUDA, flash attention's variable-length kernel over a
token-major cache, each row reading its keys from its first unmasked one
(`decode_flash_offsets`: the rule with no mask), at the headline's 128 rows and three key
spans, each captured in a CUDA graph as the decode step is.

On a CPU only the dense mask and the variable-length layout through `varlen.reference`
(one SDPA call per sequence: not the kernel, so not a speed) run.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def groups_of(rows: int, prompt: int, group: int, fed: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    # pack() feeds a completion all but its last token
    return [
        (rng.integers(0, 1000, prompt).tolist(), [rng.integers(0, 1000, fed + 1)] * group)
        for _ in range(rows)
    ]


def variants(device, dtype, available: set[str]):
    """name -> (packing style, build(packed) -> mask, attend(q, k, v, mask) -> (B, L,
    heads, dim)), for queries in `dtype`."""

    from retrain.kernels import flex, masked_attention, varlen
    from retrain.kernels.packing import additive, dense_mask

    def dense_build(packed):  # as the trainer hands it to SDPA: additive, made once
        allowed = packed.mask.to(device)
        return additive(dense_mask(allowed, packed.positions.to(device), None, "bool"), dtype)

    def dense_attend(q, k, v, mask):  # as the trainer runs it (SDPA's efficient kernel)
        return masked_attention.attend(q, k, v, mask, None)

    out = {
        "dense": ("bool", dense_build, dense_attend),
        "varlen": (
            "varlen",
            lambda packed: varlen.Mask(varlen.layout(packed.segments).to(device)),
            varlen.attend,
        ),
        "flex": (
            "flex",
            lambda packed: flex.block_mask(packed.segments.to(device), packed.positions.to(device)),
            lambda q, k, v, mask: flex._flex(q, k, v, mask, None).transpose(1, 2),
        ),
    }
    return {name: out[name] for name in out if name in available}


def decode_matmul(query, key, value, mask, scaling=None):
    """`flex.grouped_decode` (one query position per row, grouped heads, an additive mask
    over the keys) by explicit products: the scores in float32, their softmax, the
    values. A candidate for the decode step's attention, where the H100's profile of
    2026-11-27 put cuDNN's kernel for it at ~74 us a layer (~20% of a step): tested
    against `grouped_decode` (tests/unit/test_attention_benchmark.py), timed here."""
    import torch

    rows, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    q = query.reshape(rows * kv_heads, heads // kv_heads, dim)
    k = key.reshape(rows * kv_heads, -1, dim)
    if q.is_cuda:  # bf16 operands, float32 scores (the tensor cores' accumulation)
        scores = torch.bmm(q, k.transpose(1, 2), out_dtype=torch.float32)
    else:
        scores = torch.bmm(q.float(), k.float().transpose(1, 2))
    scores = scores.view(rows, kv_heads, -1, k.shape[1])
    scores = scores.mul_(scaling or dim**-0.5).add_(mask[:, :, :, : k.shape[1]])
    probs = scores.softmax(-1).to(value.dtype).view(rows * kv_heads, -1, k.shape[1])
    out = torch.bmm(probs, value.reshape(rows * kv_heads, -1, dim))
    return out.view(rows, heads, 1, dim).transpose(1, 2)


def decode_efficient(query, key, value, mask, scaling=None):
    """`flex.grouped_decode` with SDPA held to its memory-efficient kernel (cuDNN's is
    what it picks on an H100)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from retrain.kernels import flex

    # a CPU has no memory-efficient kernel: its math one (the smoke run, the test)
    held = [SDPBackend.EFFICIENT_ATTENTION] if query.is_cuda else [SDPBackend.MATH]
    with sdpa_kernel(held):
        return flex.grouped_decode(query, key, value, mask, scaling)


def decode_unmasked(query, key, value, mask, scaling=None):
    """`flex.grouped_decode` without its mask: not the rule (a left-padded row would read
    its pads), a bound on what the mask costs the decode step (SDPA then takes the flash
    kernel)."""
    import torch

    rows, heads, _, dim = query.shape
    q = query.reshape(rows, key.shape[1], heads // key.shape[1], dim)  # as grouped_decode
    out = torch.nn.functional.scaled_dot_product_attention(q, key, value, scale=scaling)
    return out.reshape(rows, heads, 1, dim).transpose(1, 2)


def flash_layout(key, value, mask):
    """The decode step's cache as flash attention's variable-length kernel would read it,
    built once (a cache laid out so would hold it): keys and values token-major, (rows x
    span, kv_heads, dim), and where each row's keys start and how many it reads: from its
    first unmasked position (a left-padded row's pads are a prefix of its keys) to the
    span's end. (keys, values, starts (rows + 1,) int32, counts (rows,) int32)."""
    import torch

    rows, kv_heads, span, dim = key.shape
    k, v = (
        t.transpose(1, 2).reshape(rows * span, kv_heads, dim).contiguous() for t in (key, value)
    )
    pads = (mask[:, 0, 0, :span] == float("-inf")).sum(-1)
    starts = torch.arange(rows + 1, device=key.device) * span
    starts[:-1] += pads
    return k, v, starts.to(torch.int32), (span - pads).to(torch.int32)


def decode_flash_offsets(query, key, value, starts, counts, span, scaling=None):
    """`flex.grouped_decode`, the rule exactly, with no mask: one query position per row
    through flash attention's variable-length kernel over `flash_layout`'s cache, each
    row reading `counts` keys from `starts` (its `seqused_k`). A candidate for the decode
    step where cuDNN's masked kernel took ~74 us a layer on an H100, ~3.7x what reading
    the keys takes; it needs a token-major cache. CUDA only (the kernel is)."""
    import torch

    rows, heads, _, dim = query.shape
    q = query.reshape(rows, heads, dim)
    found = _ONE_QUERY_A_ROW.get((rows, query.device))
    if found is None:  # made once, outside the captured step, as a decoder would keep it
        found = torch.arange(rows + 1, dtype=torch.int32, device=query.device)
        _ONE_QUERY_A_ROW[(rows, query.device)] = found
    out = torch.ops.aten._flash_attention_forward(
        q, key, value, found, starts, 1, span, 0.0, False, False, scale=scaling, seqused_k=counts
    )[0]
    return out.view(rows, 1, heads, dim)


_ONE_QUERY_A_ROW: dict = {}  # (rows, device) -> the queries' starts, 0..rows


def flash_reference(query, key, value, starts, counts, scaling=None):
    """`decode_flash_offsets` by SDPA, row by row over `flash_layout`'s cache: what the
    kernel is asked (tests/unit/test_attention_benchmark.py checks it against
    `flex.grouped_decode` on a CPU, where the kernel does not run)."""
    import torch

    rows, heads, _, dim = query.shape
    outs = []
    for i in range(rows):
        lo = int(starts[i])
        k, v = (t[lo : lo + int(counts[i])].transpose(0, 1) for t in (key, value))
        q = query[i].reshape(k.shape[0], heads // k.shape[0], dim)
        outs.append(torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scaling))
    return torch.stack(outs).reshape(rows, 1, heads, dim)


def decode_times(rows, heads, kv_heads, dim, spans, device, dtype, calls, failed=None) -> dict:
    """ms per call of the decode step's attention at each key span, `grouped_decode`
    (SDPA, as it picks and held to its memory-efficient kernel) against `decode_matmul`,
    and SDPA without the mask (`decode_unmasked`: a bound, not the rule),
    on CUDA each captured in a CUDA graph as the decode step is (so launches cost what
    they cost there)."""
    import torch

    from retrain.errors import summary
    from retrain.kernels import flex

    g = torch.Generator(device="cpu").manual_seed(1)
    out: dict[str, dict[str, float]] = {}
    failed = {} if failed is None else failed  # variant -> why it was not timed
    made = []
    for span in spans:
        q = torch.randn(rows, heads, 1, dim, generator=g).to(device, dtype)
        k, v = (torch.randn(rows, kv_heads, span, dim, generator=g).to(device, dtype) for _ in "kv")
        mask = torch.zeros(rows, 1, 1, span, dtype=dtype, device=device)
        mask[: rows // 2, :, :, : span // 8] = float("-inf")  # left-padded rows
        made.append((span, q, k, v, mask))
        for name, fn in (
            ("sdpa", flex.grouped_decode),
            ("sdpa-efficient", decode_efficient),
            ("matmul", decode_matmul),
            ("unmasked-bound", decode_unmasked),
        ):
            ms = per_call(functools.partial(fn, q, k, v, mask, None), device, calls)
            out.setdefault(name, {})[str(span)] = ms
    # flash attention's variable-length kernel (CUDA's), after the others: each span timed
    # once it gives the rule's answer; a failure (a capture gone wrong among them) is
    # recorded, not raised, and the times above stand
    for span, q, k, v, mask in made if device.type == "cuda" else []:
        try:
            step = functools.partial(decode_flash_offsets, q, *flash_layout(k, v, mask), span)
            want = flex.grouped_decode(q, k, v, mask, None).float()
            error = (step().float() - want).abs().max().item()
            if error > 0.05:  # bf16 outputs of magnitude ~1
                raise ValueError(f"not the rule: max error {error:.3g}")
            out.setdefault("flash-offsets", {})[str(span)] = per_call(step, device, calls)
        except Exception as exc:
            failed["flash-offsets"] = summary(exc)
            break
    return out


def per_call(step, device, calls: int) -> float:
    """ms per call of `step()`, `calls` of them captured in one CUDA graph on CUDA (the
    best of three replays), run eagerly elsewhere."""
    import torch

    if device.type == "cuda":
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()  # warm-up off the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                step()
        run = graph.replay
    else:

        def run():
            for _ in range(calls):
                step()

    run()
    return 1e3 * min(timed(run, device) for _ in range(3)) / calls


def timed(fn, device) -> float:
    """Seconds `fn()` takes, the device's queue drained before and after."""
    import torch

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rows", type=int, default=2)
    p.add_argument("--prompt", type=int, default=55)
    p.add_argument("--group", type=int, default=16)
    p.add_argument("--fed", type=int, default=255, help="fed tokens per completion")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=10, help="layer calls timed per round")
    p.add_argument("--only", default="dense,flex,varlen")
    p.add_argument("--decode-rows", type=int, default=128, help="rows a decode step runs")
    p.add_argument("--decode-spans", default="64,192,320", help="key spans ('' : none)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    p.add_argument("--json", default="benchmarks/results/attention.json")
    args = p.parse_args(argv)
    if args.smoke:
        args.rows, args.prompt, args.group, args.fed = 2, 7, 3, 9
        args.heads, args.kv_heads, args.dim, args.rounds, args.calls = 4, 2, 16, 2, 2
        args.decode_rows, args.decode_spans = 4, "16,48"

    import torch

    from retrain.kernels.packing import pack

    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    available = {"dense", "flex", "varlen"} if cuda else {"dense", "varlen"}
    asked = [n for n in args.only.split(",") if n in available]
    groups = groups_of(args.rows, args.prompt, args.group, args.fed)
    length = pack(groups, "varlen").segments.shape[1]
    g = torch.Generator(device="cpu").manual_seed(0)

    def tensor(heads):
        t = torch.randn(args.rows, heads, length, args.dim, generator=g).to(device, dtype)
        return t.requires_grad_()

    q, k, v = tensor(args.heads), tensor(args.kv_heads), tensor(args.kv_heads)
    grad = torch.randn(args.rows, length, args.heads, args.dim, generator=g).to(device, dtype)
    table = variants(device, dtype, set(asked))
    masks = {name: build(pack(groups, style)) for name, (style, build, _) in table.items()}

    def layer(name):
        def once():
            q.grad = k.grad = v.grad = None
            table[name][2](q, k, v, masks[name]).backward(grad)

        return once

    def forward_only(name):
        def once():
            with torch.no_grad():
                table[name][2](q, k, v, masks[name])

        return once

    for name in table:  # warm-up: FlexAttention compiles here
        layer(name)()
    times: dict[str, dict[str, list[float]]] = {
        n: {"fwd_bwd": [], "fwd": [], "mask": []} for n in table
    }

    def repeated(fn, calls):
        return lambda: [fn() for _ in range(calls)]

    for _ in range(args.rounds):
        for name, (style, build, _) in table.items():
            for part, fn, calls in (
                ("fwd_bwd", layer(name), args.calls),
                ("fwd", forward_only(name), args.calls),
                ("mask", lambda b=build, s=style: b(pack(groups, s)), 1),
            ):
                times[name][part].append(timed(repeated(fn, calls), device) / calls)
    summary = {
        name: {f"{part}_ms": 1e3 * statistics.median(t) for part, t in parts.items()}
        for name, parts in times.items()
    }
    spans = [int(x) for x in args.decode_spans.split(",") if x]
    failed: dict[str, str] = {}
    decode = decode_times(
        args.decode_rows, args.heads, args.kv_heads, args.dim, spans, device, dtype, args.calls,
        failed,
    )  # fmt: skip
    print(
        f"attention at {args.rows} rows x {length} positions, heads {args.heads}/{args.kv_heads} x {args.dim}, {dtype}, {device}"
    )
    print(f"{'variant':8} {'fwd+bwd ms':>11} {'fwd ms':>8} {'mask ms':>8}")
    for name, s in summary.items():
        print(f"{name:8} {s['fwd_bwd_ms']:11.3f} {s['fwd_ms']:8.3f} {s['mask_ms']:8.3f}")
    print(f"decode step's attention, {args.decode_rows} rows, ms per layer call by key span")
    for name, row in decode.items():
        print(f"{name:15} " + "  ".join(f"{span}: {ms:.4f}" for span, ms in row.items()))
    for name, why in failed.items():
        print(f"{name:15} not timed: {why}")
    result = {
        "summary": summary,
        "decode": decode,
        "decode_failed": failed,
        "runs": times,
        "args": vars(args),
        "positions": length,
        "machine": {
            "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name() if cuda else None,
            "python": platform.python_version(),
        },
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
