"""The local backend's memory: model shapes, a step's bounds, the peak estimate, and the
sizes chosen from a device's free memory.

A step's memory does not grow with the group size: sampling decodes at most SAMPLE_ROWS
completions at once (with `[backend.options] prompt_batch = 0`), training runs packed
micro-batches of at most `micro_batch_tokens` positions, padding included, and the
trainer computes the logits LOGIT_ROWS positions at a time. `explain` prints the
estimate, the local backend checks it against the device before the model loads, and
`micro_batch_tokens = "auto"` is the largest micro-batch it says fits. No torch here, so
`explain` works on a bare install.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from retrain.errors import BackendError
from retrain.hardware import f32_out_matmul, whole_model_bf16

# Completions decoded at once with `prompt_batch = 0` (retrain/engines/pytorch.py) on a
# CPU; a GPU's decoder may take more (`decode_row_budget`).
SAMPLE_ROWS = 64
# Positions per output-layer matmul in training (retrain/kernels/logprobs.py): 128 x
# 49152 float32 logits are 25 MB.
LOGIT_ROWS = 128
# float32 vocabulary-wide rows a decoding step holds per row: logits, logprobs, probs.
SAMPLING_LOGIT_COPIES = 3
# `micro_batch_tokens = "auto"`: on a CPU (and MPS, whose free memory torch does not
# report) the value the CPU measurements were made with, so CPU runs are unchanged; on
# CUDA the largest multiple of MICRO_BATCH_STEP positions that fits, up to AUTO_MOST.
# A micro-batch of a few thousand positions already runs its matmuls at the tensor
# cores' rate: on an H100 at the headline shape (the lease of 2026-11-27) one group of
# 4,166 positions per micro-batch trained the step in 2.78 s, two (8,332) in 2.43 and
# 3.07 s in two runs, at peaks of 33 and 50 GB. Past it a larger one holds memory (and
# gives the sampler's kept caches back) for no speed. MICRO_BATCH_MAX bounds the
# largest that fits, which the fit check's fix quotes.
CPU_MICRO_BATCH = 512
MICRO_BATCH_STEP = 256
AUTO_MOST = 8192
MICRO_BATCH_MAX = 65536
# The share of a device's free memory a size chosen from it may plan to use: the rest
# covers what the estimate misses (other processes' growth, allocator variance).
HEADROOM = 0.9
# The projections of a Llama-style block; PEFT's "all-linear" adapts all seven.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The projections that read the same input: the sampler's copy runs each set as one
# matmul when all are adapted (retrain/engines/sampling_copy.py `Siblings`).
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
GIB = 2**30
# A completion's prompt where its length is not known yet (explain; the run start decides
# `checkpointing = "auto"` before the data's prompts are encoded): an allowance, and
# what the estimates say they assume.
PROMPT_TOKENS_GUESS = 256


# ----------------------------------------------------------------------------- shapes


@dataclass(frozen=True)
class ModelShape:
    """The sizes a decoder-only (Llama-style: gated MLP, grouped-query attention) model's
    memory depends on, as its config.json gives them. Left out, under 0.01% of the
    parameters: Qwen2's q/k/v biases (its config does not declare them) and Qwen3's
    per-head q/k norms."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied_embeddings: bool
    attention_bias: bool = False  # q, k, v, o biases (Llama's `attention_bias`)
    mlp_bias: bool = False

    def projections(self) -> dict[str, tuple[int, int]]:
        """(inputs, outputs) of each linear of one block."""
        h, i = self.hidden, self.intermediate
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

    def adapted(self, target_modules: Sequence[str] = ()) -> dict[str, tuple[int, int]]:
        """The projections LoRA adapts: all of them for () (`[lora] target_modules` unset:
        PEFT's all-linear), else those named (other names match no projection here)."""
        every = self.projections()
        return {k: v for k, v in every.items() if not target_modules or k in target_modules}

    @property
    def block_params(self) -> int:
        """Weights of the blocks' linears: layers x sum of in x out."""
        return self.layers * sum(i * o for i, o in self.projections().values())

    @property
    def params(self) -> int:
        """Every parameter: the blocks' linears, their biases, the norms (two per block and
        a final one), the embeddings and, untied, the output layer."""
        p = self.projections()
        bias = (sum(p[k][1] for k in PROJECTIONS[:4]) if self.attention_bias else 0) + (
            sum(p[k][1] for k in PROJECTIONS[4:]) if self.mlp_bias else 0
        )
        norms = (2 * self.layers + 1) * self.hidden
        embed = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return self.block_params + self.layers * bias + norms + embed

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    def kv_bytes_per_token(self, value_bytes: int = 4) -> int:
        """KV cache of one token: 2 (K and V) x layers x kv_width x value_bytes (the
        residual stream's: float32 by default, as a CPU's bf16 mode keeps it; 2 for a
        GPU's wholly bf16 model, as the sampler asks)."""
        return 2 * self.layers * self.kv_width * value_bytes

    def logit_bytes_per_row(self) -> int:
        """A decoding row's float32 vocabulary-wide tensors: SAMPLING_LOGIT_COPIES x vocab x 4."""
        return SAMPLING_LOGIT_COPIES * self.vocab * 4


def _positive_int(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        return None
    return int(value)


def shape_from_config(cfg: Mapping[str, Any]) -> ModelShape | None:
    """The shape of a config.json mapping (or a transformers config's `to_dict()`); a
    multimodal config's `text_config` is read over its top level. None when a size the
    estimate needs is missing (hidden_size, num_hidden_layers, num_attention_heads,
    intermediate_size, vocab_size): the caller falls back to the name and says so.
    Absent values with a documented meaning take it: num_key_value_heads = the heads (no
    GQA), head_dim = hidden / heads; tie_word_embeddings absent counts untied (the
    larger)."""
    text = cfg.get("text_config")
    merged = {**cfg, **text} if isinstance(text, Mapping) else dict(cfg)
    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
    sizes = [_positive_int(merged.get(k)) for k in (*keys, "vocab_size")]
    if any(s is None for s in sizes):
        return None
    hidden, layers, heads, inter, vocab = sizes
    return ModelShape(
        hidden=hidden,
        layers=layers,
        heads=heads,
        kv_heads=_positive_int(merged.get("num_key_value_heads")) or heads,
        head_dim=_positive_int(merged.get("head_dim")) or hidden // heads,
        intermediate=inter,
        vocab=vocab,
        tied_embeddings=bool(merged.get("tie_word_embeddings", False)),
        attention_bias=bool(merged.get("attention_bias", False)),
        mlp_bias=bool(merged.get("mlp_bias", False)),
    )


def cache_bytes_per_token(model, shape: ModelShape | None = None) -> int | None:
    """KV cache bytes per cached position of a loaded transformers `model` (`shape`: its
    sizes, where the caller has them), at the dtype of its residual stream, its
    embeddings' (what its cache holds); None when its config's sizes cannot be read."""
    shape = shape or shape_from_config(model.config.to_dict())
    if shape is None:
        return None
    return shape.kv_bytes_per_token(model.get_input_embeddings().weight.element_size())


def params_in_name(model: str) -> int | None:
    """The parameter count a model's name states (`Qwen3-4B` -> 4e9, `SmolLM2-135M` ->
    1.35e8), or None: what the estimate falls back to without a config.json."""
    m = re.search(r"(\d+(?:\.\d+)?)\s*([BbMm])\b", model.replace("-", " ").replace("_", " "))
    if m is None:
        return None
    return int(float(m.group(1)) * (1e9 if m.group(2).lower() == "b" else 1e6))


# ----------------------------------------------------------------------------- the
# memory model of each (device kind, matmul dtype): THE place a calibration edits


@dataclass(frozen=True)
class DeviceMemoryModel:
    """What a step costs beyond its tensors' sizes on one kind of device."""

    activation_bytes: int  # bytes a trained position keeps per hidden unit and layer
    runtime_bytes: float  # the runtime's own memory (Python and torch, or a CUDA context)
    slack: float  # allocator slack: the peak held over the live tensors
    calibrated: str  # where these were measured; "" = not yet calibrated


_CPU = DeviceMemoryModel(
    # 32 float32 values per position, hidden unit and layer, with LoRA on all seven
    # projections: ~1.1 GB of heap for a micro-batch of 512 positions of SmolLM2-135M
    # (576 hidden units, 30 layers). The bf16 mode keeps the same float32 activations
    # (only the frozen weights are bf16), so both modes share it.
    activation_bytes=32 * 4,
    runtime_bytes=0.6 * GIB,  # resident Python, torch, transformers and their libraries
    slack=1.15,  # glibc's heap kept 5-15% over the live peak
    calibrated="SmolLM2-135M on a 2-core CPU (docs/performance.md)",
)
_GPU_GUESS = DeviceMemoryModel(
    # NOT CALIBRATED: float32 on CUDA, and MPS. The CPU's float32 figure; bf16 matmuls
    # with a float32 residual stream measured 113 on an H100, so float32 throughout
    # keeps at least that.
    activation_bytes=32 * 4,
    runtime_bytes=1.0 * GIB,  # a CUDA context and cuBLAS workspaces: a guess
    slack=1.15,  # the caching allocator's fragmentation: a guess
    calibrated="",
)
_CUDA_BF16 = DeviceMemoryModel(
    # The whole model in bf16 (retrain/hardware.py WHOLE_BF16), LoRA r32 on all seven
    # projections, the adapter computing in bf16 from the layers' inputs
    # (retrain/kernels/lora_layers.py), the norms and gated products keeping their
    # inputs only (retrain/kernels/recompute.py), FlexAttention: benchmarks/memory_fit.py
    # measured 43.5 bytes per position, hidden unit and layer at Qwen3-4B's shapes
    # (peaks of 24.0 and 39.5 GiB at 4,166 and 8,332 positions, to the byte alike on an
    # H100 and an H200, 2026-11-27); 46 keeps the estimate ~10% over those peaks (60
    # before, counted from the H100's 92-100 of an older code on a CPU, was 32-38% over).
    activation_bytes=46,
    runtime_bytes=0.5 * GIB,  # cuBLAS workspaces, compiled kernels' buffers
    slack=1.05,  # the caching allocator reserved 1.035x its peak
    calibrated="Qwen3-4B shapes, LoRA r32, H100 80GB and H200, torch 2.11, 2026-11-27 "
    "(docs/performance.md)",
)
MEMORY_MODELS: dict[tuple[str, str], DeviceMemoryModel] = {
    ("cpu", "fp32"): _CPU,
    ("cpu", "bf16"): _CPU,
    ("cuda", "bf16"): _CUDA_BF16,
    ("cuda", "fp32"): _GPU_GUESS,
    ("mps", "bf16"): _GPU_GUESS,
    ("mps", "fp32"): _GPU_GUESS,
}


def memory_model(device_kind: str, dtype: str) -> DeviceMemoryModel:
    """The memory model of a device kind ("cpu", "cuda", "mps") and matmul dtype."""
    try:
        return MEMORY_MODELS[(device_kind, dtype)]
    except KeyError:
        raise ValueError(f"no memory model for device {device_kind!r} with {dtype!r}") from None


def rest_bytes(dtype: str, device_kind: str = "cpu") -> int:
    """Bytes of a value outside the blocks' linears (embeddings, output layer, norms,
    biases, and so the residual stream and the KV cache): 2 where bf16 mode holds the
    whole model (a GPU, retrain/hardware.py `whole_model_bf16`), else 4."""
    return 2 if whole_model_bf16(dtype, device_kind) else 4


def block_bytes(dtype: str) -> int:
    """Bytes of a transformer block's linear weight: 2 in bf16-matmul mode, else 4."""
    return 2 if dtype == "bf16" else 4


# ----------------------------------------------------------------------------- a step


def decoding_batches(
    prompts: int, group_size: int, prompt_batch: int, max_rows: int | None = None
) -> list[tuple[int, int, int]]:
    """(first prompt, prompts, completions each) of each batch the pytorch engine decodes:
    with `prompt_batch` that many whole prompts; with 0, at most `max_rows` completions
    (None: SAMPLE_ROWS, read at the call), as whole prompts or, for a larger group, one
    prompt's completions in parts."""
    rows = SAMPLE_ROWS if max_rows is None else max_rows
    if prompt_batch or group_size <= rows:
        per = prompt_batch or rows // group_size
        return [(i, min(per, prompts - i), group_size) for i in range(0, prompts, per)]
    return [
        (i, 1, min(rows, group_size - done))
        for i in range(prompts)
        for done in range(0, group_size, rows)
    ]


def sampling_rows(
    batch_size: int, group_size: int, prompt_batch: int, max_rows: int | None = None
) -> int:
    """Completions the pytorch engine decodes at once: the largest of `decoding_batches`,
    counted rather than listed (explain sizes any batch without building the list)."""
    rows = SAMPLE_ROWS if max_rows is None else max_rows
    if batch_size <= 0:
        return 0
    if prompt_batch or group_size <= rows:
        return min(prompt_batch or rows // group_size, batch_size) * group_size
    return rows  # one prompt's completions in parts of `rows`


@dataclass(frozen=True)
class Sizing:
    """What a training device's memory depends on besides the model's shape and the
    micro-batch: the device kind and matmul dtype, the adapter, activation checkpointing,
    and the sampler beside the trainer. The local backend, explain and the benchmarks
    size with one."""

    device_kind: str  # "cpu", "cuda" or "mps"
    dtype: str  # the matmul dtype: "bf16" or "fp32"
    lora_rank: int = 0
    target_modules: tuple[str, ...] = ()  # () = every projection
    checkpointing: bool = False  # [backend.options] checkpointing, resolved
    # the sampler on this device: "auto" (the in-process engine's copy, in the trainer's
    # dtype), "bf16" (its `[inference] dtype = "bf16"` copy) or None (a server engine, or
    # the other device of split mode)
    sampler: str | None = "auto"


@dataclass(frozen=True)
class StepSizes:
    """What a local step's memory depends on besides the model and the `Sizing`."""

    batch_size: int
    group_size: int
    max_tokens: int
    prompt_tokens: int
    prompt_batch: int
    max_rows: int | None = None  # the decoder's row budget (None: SAMPLE_ROWS)
    shards: int = 1  # [backend.options] shard = true under torchrun: the ranks


@dataclass(frozen=True)
class PeakMemory:
    """Bytes of each part of a local step's peak on one device, and the total."""

    weights: float  # the trainer's weights and what the sampler's copy holds of its own
    adapter: float  # LoRA weights, their gradients and two Adam moments
    sampling: float  # KV cache and logits of the rows decoded at once
    training: float  # one micro-batch's activations and logit chunk
    runtime: float
    slack: float
    total: float  # (weights + adapter + max(sampling, training)) x slack + runtime
    training_weights: float = 0.0  # shard = true: the weights a rank holds while training

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def weight_bytes(shape: ModelShape, sizing: Sizing) -> int:
    """The blocks' linears at `block_bytes(dtype)` (bf16 mode: 2), everything else
    (embeddings, output layer, norms, biases) at `rest_bytes` (float32 on a CPU, bf16 on
    a GPU), as retrain/kernels/precision.py holds them, and what the sampler's copy holds
    of its own (`sampler_copy_bytes`):

        (params - block_params) x rest_bytes + block_params x block_bytes + copy"""
    rest = rest_bytes(sizing.dtype, sizing.device_kind)
    blocks = shape.block_params * block_bytes(sizing.dtype)
    return (shape.params - shape.block_params) * rest + blocks + sampler_copy_bytes(shape, sizing)


def sampler_copy_bytes(shape: ModelShape, sizing: Sizing) -> int:
    """What the in-process sampler's copy (retrain/engines/sampling_copy.py) holds
    beside the trainer's weights, which it shares (nothing where `sizing.sampler` is
    None: no sampler on this device):

    - float32: W + scaling * B @ A of each adapted linear, merged (adapted x 4);
    - bf16: its own A and B beside the shared weights (`copy_adapter_bytes`), and on a
      wholly bf16 model where a bf16 matmul cannot give float32 logits
      (`f32_out_matmul`: a GPU with torch < 2.8) a float32 output layer (`Float32Head`,
      vocab x hidden x 4);
    - `sizing.sampler` "bf16" (`[inference] dtype = "bf16"`) on a float32 model (a bf16
      one samples through its own bf16 matmuls, as above): a whole bf16 model of its own
      (params x 2) and the adapter's float32 A and B beside it; where `f32_out_matmul`
      does not hold, its output layer in float32 (`Float32Head`) instead of bf16, or
      besides the bf16 input embeddings it is tied to."""
    dtype, device_kind = sizing.dtype, sizing.device_kind
    if sizing.sampler is None:
        return 0
    head = shape.vocab * shape.hidden * 4
    beside = copy_adapter_bytes(shape, sizing)
    if own_bf16_copy(sizing):
        if not f32_out_matmul(device_kind):
            beside += head if shape.tied_embeddings else head // 2  # 4 bytes, not 2
        return shape.params * 2 + beside
    if block_bytes(dtype) != 2:
        adapted = shape.adapted(sizing.target_modules).values()
        return shape.layers * sum(i * o for i, o in adapted) * 4
    narrow_head = rest_bytes(dtype, device_kind) == 2 and not f32_out_matmul(device_kind)
    return beside + (head if narrow_head else 0)


def copy_adapter_bytes(shape: ModelShape, sizing: Sizing) -> int:
    """The sampler's own A and B beside bf16 weights (bf16 mode, or a bf16 copy of its
    own: `own_bf16_copy`; float32 merges them into the weights instead), in the dtype the
    trainer computes them in: bf16 on a wholly bf16 model (a GPU), else float32; a set of
    `SIBLINGS` as one (`set_layout_bytes`)."""
    if not sizing.lora_rank or sizing.sampler is None:
        return 0
    if block_bytes(sizing.dtype) != 2 and not own_bf16_copy(sizing):
        return 0
    whole = whole_model_bf16(sizing.dtype, sizing.device_kind)
    return set_layout_bytes(shape, sizing, 2 if whole else 4)


def set_layout_bytes(shape: ModelShape, sizing: Sizing, value_bytes: int) -> int:
    """A and B of every adapted linear at `value_bytes` each, sets of `SIBLINGS` (all
    adapted) as one: their A's stacked, their B's block-diagonal, so a set's B holds
    (sum of outs) x (members x rank) values. Per layer:

        sum over sets and lone projections of rank x members x (in + outs) x value_bytes"""
    adapted = shape.adapted(sizing.target_modules)
    sets = [names for names in SIBLINGS if all(n in adapted for n in names)]
    sets += [(n,) for n in adapted if not any(n in names for names in sets)]
    per_layer = 0
    for names in sets:
        inputs, outs = adapted[names[0]][0], sum(adapted[n][1] for n in names)
        per_layer += sizing.lora_rank * len(names) * (inputs + outs) * value_bytes
    return shape.layers * per_layer


def sampler_on_device(in_process: bool, same_device: bool, engine_dtype: str) -> str | None:
    """`Sizing.sampler` for the training device: None for a server engine (its weights
    and KV cache are the server's) or in split mode (the sampler is on the other device);
    else the in-process engine's copy, "bf16" where it samples in `[inference] dtype =
    "bf16"`, "auto" otherwise. explain and the local backend both ask here."""
    if not in_process or not same_device:
        return None
    return "bf16" if engine_dtype == "bf16" else "auto"


def own_bf16_copy(sizing: Sizing) -> bool:
    """Whether the sampler holds a bf16 model of its own: `[inference] dtype = "bf16"` on
    a float32 trainer (on a bf16 one the engine samples through the trainer's bf16
    matmuls: retrain/engines/pytorch.py `bind`)."""
    return sizing.sampler == "bf16" and sizing.dtype == "fp32"


def kv_value_bytes(sizing: Sizing) -> int:
    """Bytes of a KV cache value: the sampling model's residual stream's (`rest_bytes`),
    2 for a bf16 copy of its own (`own_bf16_copy`)."""
    return 2 if own_bf16_copy(sizing) else rest_bytes(sizing.dtype, sizing.device_kind)


def adapter_bytes(shape: ModelShape, sizing: Sizing) -> int:
    """float32 LoRA weights (rank x (in + out) per adapted linear), their gradients and
    AdamW's two moments: rank x sum(in + out) x 4 bytes x 4; on a wholly bf16 model also
    the bf16 copies of them the trainer's products read (`staged_adapter_bytes`)."""
    in_out = shape.layers * sum(i + o for i, o in shape.adapted(sizing.target_modules).values())
    return sizing.lora_rank * in_out * 4 * 4 + staged_adapter_bytes(shape, sizing)


def staged_adapter_bytes(shape: ModelShape, sizing: Sizing) -> int:
    """The bf16 A's and B's the trainer's products read on a wholly bf16 model, kept
    between steps (retrain/kernels/staged_factors.py), in the layout of sets
    (`set_layout_bytes`); 0 elsewhere (the adapter computed in float32). Compiled blocks
    and a sharded base build them per pass instead: counted all the same (~0.6% of the
    headline step's peak), the estimate errs high there."""
    if not sizing.lora_rank or not whole_model_bf16(sizing.dtype, sizing.device_kind):
        return 0
    return set_layout_bytes(shape, sizing, 2)


def training_bytes(
    shape: ModelShape,
    positions: int,
    model: DeviceMemoryModel,
    checkpointing: bool = False,
    residual_bytes: int = 4,
) -> int:
    """One micro-batch: positions x hidden x layers x activation_bytes, and the float32
    logits of LOGIT_ROWS positions with their gradient (x 2). With activation
    checkpointing each block keeps only its input (`residual_bytes` per hidden unit:
    float32 on a CPU, bf16 on a GPU) and one block at a time recomputes its activations:

        positions x hidden x (layers x residual_bytes + activation_bytes)"""
    per_position = shape.hidden * (
        shape.layers * residual_bytes + model.activation_bytes
        if checkpointing
        else shape.layers * model.activation_bytes
    )
    return positions * per_position + min(positions, LOGIT_ROWS) * shape.vocab * 4 * 2


def training_memory(shape: ModelShape, sizing: Sizing, micro_batch_tokens: int) -> PeakMemory:
    """The peak while training a micro-batch of `micro_batch_tokens` positions, sampling
    left out (what the micro-batch size moves; all the run-start check knows), the
    weights with what the sampler on this device holds of its own (`weight_bytes`):

        total = (weights + adapter + training) x slack + runtime"""
    model = memory_model(sizing.device_kind, sizing.dtype)
    weights, adapter = weight_bytes(shape, sizing), adapter_bytes(shape, sizing)
    residual = rest_bytes(sizing.dtype, sizing.device_kind)
    training = training_bytes(shape, micro_batch_tokens, model, sizing.checkpointing, residual)
    return PeakMemory(
        weights=weights,
        adapter=adapter,
        sampling=0,
        training=training,
        runtime=model.runtime_bytes,
        slack=model.slack,
        total=(weights + adapter + training) * model.slack + model.runtime_bytes,
    )


def peak_memory(
    shape: ModelShape, sizing: Sizing, step: StepSizes, micro_batch_tokens: int
) -> PeakMemory:
    """A local step's peak on one device: the weights and the adapter, then the larger of
    sampling (rows x (prompt + max_tokens) tokens of KV cache, and the rows' logits) and
    training (one micro-batch, no larger than the step), times the allocator's slack, plus
    the runtime:

        total = (weights + adapter + max(sampling, training)) x slack + runtime"""
    per_step = step.batch_size * (step.prompt_tokens + step.group_size * step.max_tokens)
    train = training_memory(shape, sizing, min(micro_batch_tokens, per_step))
    rows = sampling_rows(step.batch_size, step.group_size, step.prompt_batch, step.max_rows)
    tokens = step.prompt_tokens + step.max_tokens
    kv = shape.kv_bytes_per_token(kv_value_bytes(sizing))
    # a server engine's KV cache is the server's, not this device's
    sampling = 0 if sizing.sampler is None else rows * (kv * tokens + shape.logit_bytes_per_row())
    if step.shards > 1:
        return _sharded_peak(shape, sizing, step.shards, train, sampling)
    live = train.weights + train.adapter + max(sampling, train.training)
    return replace(train, sampling=sampling, total=live * train.slack + train.runtime)


def _sharded_peak(
    shape: ModelShape, sizing: Sizing, shards: int, train: PeakMemory, sampling: int
) -> PeakMemory:
    """`[backend.options] shard = true` on `shards` ranks: training holds 1/shards of
    the blocks plus the one block it has gathered; sampling gathers every block whole
    (retrain/distributed.py `full_weights`), and there is no merged sampling copy:

        total = max(whole + adapter + sampling, sharded + adapter + training) x slack + runtime"""
    blocks = shape.block_params * block_bytes(sizing.dtype)
    rest = (shape.params - shape.block_params) * rest_bytes(sizing.dtype, sizing.device_kind)
    whole = rest + blocks  # weight_bytes, no sampling copy
    sharded = whole - blocks + blocks / shards + blocks / max(shape.layers, 1)
    live = max(whole + sampling, sharded + train.training) + train.adapter
    return replace(
        train,
        weights=whole,
        training_weights=sharded,
        sampling=sampling,
        total=live * train.slack + train.runtime,
    )


# ----------------------------------------------------------------------------- sizes
# chosen from a device's free memory


def largest_micro_batch(shape: ModelShape, sizing: Sizing, free_bytes: float) -> int:
    """The largest micro-batch, a multiple of MICRO_BATCH_STEP positions up to
    MICRO_BATCH_MAX, whose training peak fits HEADROOM x free_bytes:

        (weights + adapter + training(n)) x slack + runtime <= HEADROOM x free

    0 when not even MICRO_BATCH_STEP positions fit (the weights alone may not)."""
    budget = HEADROOM * free_bytes
    best = 0
    for n in range(MICRO_BATCH_STEP, MICRO_BATCH_MAX + 1, MICRO_BATCH_STEP):
        if training_memory(shape, sizing, n).total > budget:
            break  # the peak grows with n
        best = n
    return best


def auto_micro_batch_tokens(
    shape: ModelShape | None, sizing: Sizing, free_bytes: float | None, max_tokens: int = 0
) -> int:
    """`[backend.options] micro_batch_tokens = "auto"`: CPU_MICRO_BATCH (512) on a CPU or
    MPS, so their runs do not change; on CUDA `largest_micro_batch` of the free memory,
    at most AUTO_MOST or, when more, a completion of `max_tokens` after a prompt of
    PROMPT_TOKENS_GUESS tokens (as `needs_checkpointing` counts it), rounded up to
    MICRO_BATCH_STEP: a completion is trained whole, alone in a
    micro-batch over the budget if need be, so the budget, which the memory estimate
    sizes, covers it. Refuses (BackendError) on CUDA without the model's shape or when
    nothing fits."""
    if sizing.device_kind != "cuda":
        return CPU_MICRO_BATCH
    if shape is None or free_bytes is None:
        missing = "the model's shape (its config.json)" if shape is None else "its free memory"
        raise BackendError(
            f'[backend.options] micro_batch_tokens = "auto" needs {missing} on cuda; '
            "set micro_batch_tokens to a number of positions"
        )
    n = largest_micro_batch(shape, sizing, free_bytes)
    if n == 0:
        fixed = (weight_bytes(shape, sizing) + adapter_bytes(shape, sizing)) / GIB
        lighter = lighter_weights(sizing.dtype, sizing.device_kind)
        raise BackendError(
            f"[backend.options] micro_batch_tokens: not even {MICRO_BATCH_STEP} positions fit "
            f"the device's {free_bytes / GIB:.1f} GiB free (weights and adapter alone "
            f"~{fixed:.1f} GiB). Fix: free the device, {lighter}a "
            "smaller [model] model or [model] lora_rank, or a device with more memory"
        )
    whole = -(-(PROMPT_TOKENS_GUESS + max_tokens) // MICRO_BATCH_STEP) * MICRO_BATCH_STEP
    return min(n, max(AUTO_MOST, whole))


def lighter_weights(dtype: str, device_kind: str) -> str:
    """The fix that halves float32 weights on a GPU (where `dtype = "auto"` chose float32
    for want of native bf16, or it was set), "" elsewhere: a clause for a list of fixes."""
    if dtype != "fp32" or device_kind != "cuda":
        return ""
    return (
        '[backend.options] dtype = "bf16" (half the weights, and no float32 merged copy '
        "for the sampler; slower on a GPU without native bf16), "
    )


def needs_checkpointing(
    shape: ModelShape | None, sizing: Sizing, free_bytes: float | None, max_tokens: int
) -> bool:
    """`[backend.options] checkpointing = "auto"`: on CUDA, on when a completion of
    `max_tokens` (after a prompt of PROMPT_TOKENS_GUESS tokens) is longer than the
    largest micro-batch that fits without it; a completion is trained whole, so it would
    run out of memory. Off on a CPU or MPS (their runs do not change), and where the
    shape or the free memory is unknown. (`sizing.checkpointing` is what it decides.)"""
    if sizing.device_kind != "cuda" or shape is None or free_bytes is None:
        return False
    largest = largest_micro_batch(shape, replace(sizing, checkpointing=False), free_bytes)
    return largest < PROMPT_TOKENS_GUESS + max_tokens


def decode_row_budget(
    *,
    device_kind: str,
    free_bytes: float,
    kv_bytes_per_token: int,
    logit_bytes_per_row: int,
    max_len: int,
) -> int:
    """Completions the decoder may hold at once: SAMPLE_ROWS on a CPU or MPS (read at the
    call, as the CPU measurements were made); on CUDA the most rows whose KV cache of
    `max_len` tokens and logits fit HEADROOM x free_bytes, at least 1:

        rows = max(1, floor(HEADROOM x free / (kv_bytes_per_token x max_len + logit_bytes_per_row)))"""
    if device_kind != "cuda":
        return SAMPLE_ROWS
    per_row = kv_bytes_per_token * max_len + logit_bytes_per_row
    return max(1, int(HEADROOM * free_bytes // per_row))


# ----------------------------------------------------------------------------- the
# estimate against a device (explain, doctor and the local backend's run-start check)


@dataclass(frozen=True)
class FitProblem:
    level: str  # "error": the step would run out of memory; "warning": within 1 - HEADROOM
    message: str  # names the setting and the value that fits
    # "peak": the step's peak against the free memory; "completion": a completion of
    # max_tokens would not fit the largest micro-batch (retrain/cli/estimates.py)
    what: str = "peak"


def fit_problem(
    peak: PeakMemory,
    *,
    free_bytes: float,
    total_bytes: float | None,
    where: str,
    micro_batch_tokens: int,
    largest: int,
    calibrated: bool = True,
    one_row: bool = False,
    prompt_batch: int = 0,
    lighter: str = "",
) -> FitProblem | None:
    """The estimate against a device's free memory: None when it stays within HEADROOM of
    it, a warning when it comes closer, an error above it, naming what to change:
    `micro_batch_tokens` (with `largest`, the largest value that fits) when a training
    micro-batch makes the peak, the sampling keys when sampling does (`one_row`: the
    decoder sizes its rows to the free memory, so `peak` holds one completion, and only
    max_tokens can help; else `prompt_batch` as set), the model when even the weights do
    not fit (`lighter`: `lighter_weights`' clause for the device and dtype)."""
    need = peak.total
    if need <= HEADROOM * free_bytes:
        return None
    have = f"{free_bytes / GIB:.1f} GiB free on {where}" + (
        f" (of {total_bytes / GIB:.1f} GiB)" if total_bytes else ""
    )
    over = need > free_bytes
    amount = f"needs ~{need / GIB:.1f} GiB, " + (
        f"over the {have}" if over else f"{need / free_bytes:.0%} of the {have}"
    )
    amount += "" if calibrated else " (this device's memory model is not calibrated yet)"
    amount += "" if over else ": close to running out"
    if largest == 0:
        message = (
            f"[backend] devices: the step {amount}, and the weights and adapter alone leave "
            f"no room for a micro-batch of {MICRO_BATCH_STEP} positions. Fix: {lighter}a "
            "device with more free memory, or a smaller [model] model or [model] lora_rank"
        )
    elif peak.training >= peak.sampling:
        fits = "the largest that fits is" if over else "leaving a margin:"
        message = (
            f"[backend.options] micro_batch_tokens = {micro_batch_tokens}: the step {amount}; "
            f'{fits} {largest} (or "auto")'
        )
    elif one_row:
        message = (
            f"[training] max_tokens: sampling {amount} with a single completion decoded at "
            "a time (its KV cache of prompt + max_tokens positions, and its logits). Fix: "
            "lower max_tokens, or a device with more memory"
        )
    else:
        also = (
            f", or [backend.options] prompt_batch = 0 (not {prompt_batch}: a bounded number "
            "of completions at once)"
            if prompt_batch
            else ""
        )
        message = (
            f"[training] max_tokens: sampling {amount} (the KV cache and logits of the "
            f"completions decoded at once). Fix: lower max_tokens{also}"
        )
    return FitProblem("error" if over else "warning", message)
