"""The local backend's bf16 mode (`[backend.options] dtype`). On a GPU the whole model is
bf16 (`bf16_weights`; the adapter and the logits stay float32; retrain/hardware.py
`WHOLE_BF16` says why); on a CPU, which the rest of this docstring is about, only the
matmuls: bf16 matmuls, float32 rest.

On a GPU, and on a CPU with native bf16 dot products (AVX512-BF16 or AMX), a bf16 matmul
runs 2-3x faster than a float32 one (2.2-2.7x on this project's 2-core AVX512-BF16 box).
Only the frozen weights of the linear layers inside the transformer blocks become bf16
(`Bf16Linear`: the input is rounded to bf16, the output goes back to float32). The
residual stream, norms, embeddings, the output layer (so the logits) and the LoRA adapter
stay float32: a model cast wholly to bf16 rounds the residual stream at every layer, and
its sampler and trainer, which run the same weights in different shapes (one token at a
time vs a packed row), disagreed by 0.02 on average and up to 0.5 in a token's logprob on
SmolLM2; with float32 outside the matmuls it is ~0.01 and ~0.1. The sampler records the
logprobs of the distribution it drew from, so the importance ratio corrects what remains
(`log_ratio_mean` / `log_ratio_max_abs` show it; docs/performance.md has the numbers).

On a CPU, torch runs bf16 matmuls through oneDNN, which compiles a kernel for every new
input shape and keeps it in two caches of 1024 entries each (oneDNN's primitive cache and
ideep's), about 0.5 MB an entry that is never given back. Packed micro-batches, prefills
and shrinking decode batches give a new row count almost every call, so those caches grew
by ~5 MB per training micro-batch and ~40 MB per step at group 64, scattered between the
freed activations, and the heap grew with them. `Bf16Linear` therefore runs the rows of a
CPU matmul in a fixed set of row counts (`row_tiles`), at most 36 of them, whatever the
micro-batch, prompt or group size: the caches stop growing after the first steps.
"""

from __future__ import annotations

import torch

from retrain.hardware import f32_out_matmul, matmul_dtype


def use_bf16(option: str, device: torch.device) -> bool:
    """Whether `[backend.options] dtype` means bf16 matmuls on `device`. "auto" on CUDA
    asks torch for the GPU's compute capability (8.0 on: native bf16): torch names the GPU
    as the run numbers it, where nvidia-smi (explain's source) may read another one
    (retrain/hardware.py `gpu_order_unknown`)."""
    if option == "auto" and device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 0)
    return matmul_dtype(option, device.type, device.index or 0) == "bf16"


# The largest row count of one CPU bf16 matmul: measured on SmolLM2's four weight shapes,
# 512 rows run as fast as 1024 (256 rows were up to 25% slower).
ROW_TILE = 512
# Row counts up to this run as they are (decode batches of a few rows, where padding would
# cost the most); above it they are rounded up to 4 sizes per octave.
EXACT_ROWS = 16


def padded_rows(rows: int) -> int:
    """`rows` (1..ROW_TILE) rounded up to one of the fixed matmul sizes: itself up to
    EXACT_ROWS, then 4 sizes per octave (20, 24, 28, 32, 40, 48, ...), so the padding is
    under 25% of the rows."""
    if rows <= EXACT_ROWS:
        return rows
    step = 1 << (rows.bit_length() - 3)  # a quarter of the octave [2^k, 2^(k+1))
    return -(-rows // step) * step


def row_tiles(rows: int) -> list[tuple[int, int, int]]:
    """(start, rows, padded rows) of each piece of a `rows`-row matmul: whole tiles of
    ROW_TILE rows, then the rest padded by `padded_rows`."""
    tiles = []
    for start in range(0, rows, ROW_TILE):
        n = min(ROW_TILE, rows - start)
        tiles.append((start, n, padded_rows(n)))
    return tiles


class Bf16Linear(torch.nn.Linear):
    """A frozen linear layer whose weight is stored in bf16: the matmul runs in bf16 and
    its output goes back to the input's dtype. On a CPU the rows run in the fixed sizes
    of `row_tiles` (zero rows added, their outputs dropped), so oneDNN's per-shape kernel
    caches stay small (see the module docstring)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if x.device.type != "cpu":
            return torch.nn.functional.linear(x.to(w.dtype), w, self.bias).to(x.dtype)
        flat = x.reshape(-1, x.shape[-1])
        pieces = []
        for start, rows, padded in row_tiles(flat.shape[0]):
            part = flat[start : start + rows].to(w.dtype)
            if padded > rows:
                part = torch.nn.functional.pad(part, (0, 0, 0, padded - rows))
            pieces.append(torch.nn.functional.linear(part, w, self.bias)[:rows].to(x.dtype))
        out = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        return out.reshape(*x.shape[:-1], w.shape[0])


@torch.compiler.assume_constant_result
def f32_out_here(device_type: str) -> bool:
    """`hardware.f32_out_matmul`, a constant to torch.compile, which runs it as it traces
    rather than tracing it: it reads torch's version from the installed package's
    metadata, and torch 2.11's Dynamo cannot trace importlib.metadata ("does not know how
    to trace method `update` of class `<unknown type>`": the compiled decode step on the
    H200 of 2026-11-27 failed so). A device kind's answer never changes in a process."""
    return f32_out_matmul(device_type)


def _f32_result(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two operands of one narrow dtype (bf16, fp16) multiply into a float32
    result as they are, on the device's tensor cores (`f32_out_here`)."""
    narrow = a.dtype == b.dtype and a.dtype in (torch.bfloat16, torch.float16)
    return narrow and f32_out_here(a.device.type)


def mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b (2-D) in float32. Two bf16 (or fp16) operands on CUDA go to the tensor cores
    with a float32 result (`hardware.f32_out_matmul`): each product of two bf16 numbers
    is exact in float32 and cuBLAS sums in float32, so this is the float32 product of the
    same values up to the order of sums, on hardware with an order of magnitude more bf16
    than float32 throughput (an H100's peak figures; not measured here) and with no
    float32 copy of either operand. Elsewhere both are taken to float32 (the same
    values)."""
    if _f32_result(a, b):
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.float(), b.float())


def addmm_f32_(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha: float) -> torch.Tensor:
    """c += alpha * a @ b, into the float32 `c` itself, for two bf16 (or fp16) operands;
    returns the sum (outside torch.compile, `c`). On CUDA the product runs on the tensor
    cores with `c` added in its epilogue (`torch.addmm(..., out_dtype=torch.float32)`): a
    float32 operand instead sent it to the CUDA cores' float32 GEMM, which for the
    adapter's product beside each adapted linear took more of an H100's decode step than
    the layers' own bf16 weights (docs/performance.md, the lease of 2026-11-27). Into `c`,
    because an addmm into a new tensor first copies `c` there (aten's addmm_out copies its
    input to the result when the two differ): a pass over the float32 sum that reads and
    writes 8 bytes an element, a kernel more per adapted linear. Elsewhere of float32
    copies: the same values."""
    if _f32_result(a, b):
        if torch.compiler.is_compiling():  # torch 2.11's fake tensors take addmm's
            # out_dtype for its beta (TypeError: dtype * FakeTensor), which failed the
            # compiled decode step; the product, then one add that inductor fuses
            return torch.add(c, torch.mm(a, b, out_dtype=torch.float32), alpha=alpha)
        return torch.addmm(c, a, b, alpha=alpha, out_dtype=torch.float32, out=c)
    return c.addmm_(a.float(), b.float(), alpha=alpha)


def linear_f32(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """float32 `x @ weight^T + bias` over x's last dimension, by `mm_f32`: float32 logits
    from a bf16 model's hidden states and output layer without a float32 copy of it."""
    out = mm_f32(x.reshape(-1, x.shape[-1]), weight.t())
    if bias is not None:
        out = out + bias.float()
    return out.reshape(*x.shape[:-1], weight.shape[0])


def bf16_weights(model: torch.nn.Module) -> int:
    """Every floating-point parameter of `model` in bf16 (in place, before the LoRA
    adapter is added), buffers left as they are (rotary frequencies stay float32);
    returns how many. Norms then compute in float32 inside and round their output, as
    transformers' bf16 models do; the logits are computed in float32 from the bf16
    hidden states (retrain/kernels/logprobs.py, the sampling copy's `Float32Head`)."""
    count = 0
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != torch.bfloat16:
            p.data = p.data.to(torch.bfloat16)
            count += 1
    return count


def bf16_linears(model: torch.nn.Module) -> int:
    """Turn every `nn.Linear` of `model` except its output layer into a `Bf16Linear` (in
    place, before the LoRA adapter is added); returns how many."""
    head = model.get_output_embeddings()
    count = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear and module is not head:
            module.__class__ = Bf16Linear
            module.weight.data = module.weight.data.to(torch.bfloat16)
            if module.bias is not None:
                module.bias.data = module.bias.data.to(torch.bfloat16)
            count += 1
    return count


# Sibling projections that read the same input, by their Llama-family names: the sampler
# runs each set as one matmul (retrain/engines/sampling_copy.py), for which their weights
# must be consecutive rows of one tensor.
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def sibling_sets(model: torch.nn.Module) -> list[tuple[torch.nn.Module, tuple[str, ...]]]:
    """(parent, names) of every set of SIBLINGS present in `model`."""
    return [
        (parent, names)
        for parent in model.modules()
        for names in SIBLINGS
        if all(hasattr(parent, n) for n in names)
    ]


def stacked(weights: list[torch.Tensor]) -> torch.Tensor | None:
    """The (rows, columns) tensor whose consecutive row blocks are `weights`, sharing their
    storage; None when they are not laid out that way."""
    first = weights[0]
    offset = first.storage_offset()
    for w in weights:
        if (
            w.dim() != 2
            or not w.is_contiguous()
            or w.shape[1] != first.shape[1]
            or w.dtype != first.dtype
            or w.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
            or w.storage_offset() != offset
        ):
            return None
        offset += w.numel()
    rows = sum(w.shape[0] for w in weights)
    whole = first.new_empty(0)
    return whole.set_(first.untyped_storage(), first.storage_offset(), (rows, first.shape[1]))


def share_sibling_storage(model: torch.nn.Module) -> int:
    """Lay each set of sibling linears' weights out as consecutive rows of one tensor, in
    place (each weight becomes a view of it, same values, no memory kept beyond the set's
    transient copy), so `stacked` finds them; returns how many sets. Weights moved to
    another device one by one (`model.to`) lose the layout: call it after the move."""
    count = 0
    for parent, names in sibling_sets(model):
        layers = [getattr(parent, n) for n in names]
        layers = [getattr(m, "base_layer", m) for m in layers]  # under a PEFT adapter
        if not all(isinstance(m, torch.nn.Linear) for m in layers):
            continue
        weights = [m.weight for m in layers]
        if stacked(weights) is not None:
            count += 1
            continue
        if len({(w.shape[1], w.dtype, w.device) for w in weights}) != 1:
            continue
        stack_in_place(layers)
        count += 1
    return count


def stack_in_place(layers: list[torch.nn.Module]) -> None:
    """Make the layers' weights (same columns, dtype and device) consecutive row blocks of
    one new tensor, keeping their values and their Parameter objects."""
    whole = torch.cat([m.weight.data for m in layers])
    start = 0
    for m in layers:
        rows = m.weight.shape[0]
        m.weight.data = whole[start : start + rows]
        start += rows
