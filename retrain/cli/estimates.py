"""`retrain explain`'s estimates of a run: the local step's peak memory on its training
device against that device's free memory (retrain/memory.py's model, the device read by
retrain/hardware.py), and the wall time per step. `doctor` asks here too.

Never imports torch, as explain does not.
"""

from __future__ import annotations

from dataclasses import asdict, replace
from typing import Any

from retrain import registry
from retrain.backends.base import BackendInfo, backend_options
from retrain.config import Config
from retrain.config.schema import FALLBACK_MAX_TURNS
from retrain.config.validate import device_kind, training_device
from retrain.errors import BackendError
from retrain.hardware import MEASURED_GPU, device_memory, gpu_name, gpu_peaks, matmul_dtype
from retrain.memory import (
    MICRO_BATCH_STEP,
    PROMPT_TOKENS_GUESS,
    FitProblem,
    ModelShape,
    Sizing,
    StepSizes,
    adapter_bytes,
    auto_micro_batch_tokens,
    block_bytes,
    decode_row_budget,
    fit_problem,
    kv_value_bytes,
    largest_micro_batch,
    lighter_weights,
    memory_model,
    needs_checkpointing,
    params_in_name,
    peak_memory,
    sampler_copy_bytes,
    sampler_on_device,
    sampling_rows,
    weight_bytes,
)
from retrain.models import model_shape
from retrain.types import EngineTraits
from retrain.world import World


def local_options(config: Config) -> dict[str, Any]:
    """The local backend's options (its defaults when another backend is configured)."""
    given = config.backend.options if config.backend.backend == "local" else {}
    return backend_options("local", given)


# Effective FLOP/s of a step's sampling (2 x params per sampled token) and training (6 x
# params per trained token) by device kind, every completion taken at max_tokens: what
# retrain measured, so an estimate reproduces those runs and is rough anywhere else.
# cuda: one H100 80GB (SXM) at the headline shape (Qwen3-4B's shapes, 8 x 16 completions
# of 256 tokens; sampling 3.39 s, training 2.78 s a step with one group a micro-batch, as
# auto packs it: docs/performance.md "On a CUDA GPU"), scaled to another GPU by its peak
# figures (`_gpu_scale`); cpu: the quickstart on 2 cores (SmolLM2-135M, 4 x 8 of 24
# tokens; medians of 90 steps, sampling 2.28 s, training 1.27 s:
# benchmarks/results/quickstart.json). MPS: none.
_EFFECTIVE_FLOPS = {"cuda": (7.8e13, 2.8e14), "cpu": (9e10, 4.9e11)}
_MEASURED_ON = {"cuda": "an H100 at Qwen3-4B's shapes", "cpu": "2 CPU cores at the quickstart"}
# A step's least time on a GPU, whatever its FLOPs: the quickstart on an H100 took a
# median 0.53 s, ~100x what its FLOPs at the rates above would take (docs/performance.md).
_STEP_FLOOR_S = {"cuda": 0.53}


def _gpu_scale(index: int) -> tuple[float, float, str]:
    """(sampling, training) factors from the H100 the cuda rates were measured on to
    torch's `cuda:index`, by peak memory bandwidth (a decoded token reads the weights)
    and peak bf16 rate, and the clause that says so; 1 and 1 where the GPU is that H100,
    or unknown (then the clause says that)."""
    name = gpu_name(index)
    if name is None:  # no nvidia-smi here (a GPU of another machine), or its number unknown
        return 1.0, 1.0, ""
    peaks, measured = gpu_peaks(name), gpu_peaks(MEASURED_GPU)
    if peaks is None:
        unknown = f"; retrain has no peak figures for the {name}: taken as an H100, so likely low"
        return 1.0, 1.0, unknown
    if peaks == measured:
        return 1.0, 1.0, ""
    (rate, bandwidth), (rate0, bandwidth0) = peaks, measured
    clause = (
        f", then to the {name} by its peak bf16 rate and memory bandwidth ({rate:g} "
        f"TFLOPS, {bandwidth:g} TB/s; the H100's {rate0:g} and {bandwidth0:g})"
    )
    return bandwidth / bandwidth0, rate / rate0, clause


# What sets a step's pace: a logged run's median stands for this config's step only
# where these agree (a run moved aside by --overwrite, or another model's, does not).
_PACE_KEYS = (
    ("model", "model"),
    ("model", "lora_rank"),
    ("backend", "backend"),
    ("backend", "devices"),
    ("inference", "engine"),
    ("training", "batch_size"),
    ("training", "group_size"),
    ("training", "max_tokens"),
)


def _recent_rates(config: Config) -> dict[str, Any] | None:
    """Median time per step and sampled tokens per second of the run in [logging] log_dir,
    when it has logged steps; with `differs` set (the keys of `_PACE_KEYS` it ran with
    otherwise, as it recorded them) where that run's setup is not this config's."""
    import statistics
    from pathlib import Path

    from retrain.logs.rundir import RunDir, as_number

    path = Path(config.logging.log_dir)
    if not (path / "metrics.jsonl").is_file():
        return None
    run = RunDir(path)
    rows = run.step_rows
    times = [v for r in rows if (v := as_number(r.get("step_time_s"))) is not None]
    if not times:
        return None
    rates = [
        tokens / secs
        for r in rows
        if (tokens := as_number(r.get("tokens_generated"))) is not None
        and (secs := as_number(r.get("time_sampling_s")))
    ]
    differs = [
        f"[{table}] {key} = {theirs!r} (here {ours!r})"
        for table, key in _PACE_KEYS
        if (theirs := run.config_value(table, key)) is not None
        and theirs != (ours := getattr(getattr(config, table), key))
    ]
    return {
        "log_dir": str(path),
        "steps": len(times),
        "median_step_s": statistics.median(times),
        "sampled_tokens_per_s": statistics.median(rates) if rates else None,
        "differs": differs,
    }


def _gib(value: float | None) -> float | None:
    return None if value is None else round(value / 2**30, 2)


def _micro_batch(opts: dict[str, Any], shape: ModelShape, plan: dict[str, Any]) -> int | None:
    """The micro-batch the run would train with: the option's number, or "auto" resolved
    as the backend resolves it at start (None: that needs free memory unknown here)."""
    if opts["micro_batch_tokens"] != "auto":
        return opts["micro_batch_tokens"]
    if plan["sizing"].device_kind == "cuda" and plan["free"] is None:
        return None
    try:
        return auto_micro_batch_tokens(shape, plan["sizing"], plan["free"], plan["step"].max_tokens)
    except BackendError as exc:
        plan["errors"].append(str(exc))
        return 0


def engine_traits(config: Config) -> EngineTraits | None:
    """The `[inference]` engine's traits from its registry entry (None: not registered)."""
    entry = registry.ENGINES.entry(config.inference.engine)
    return entry.engine_traits if entry is not None else None


def _sampler(config: Config) -> str | None:
    """What samples on the training device (`memory.sampler_on_device`), from the
    engine's traits (the dtype only where the engine applies it) and the devices."""
    traits = engine_traits(config)
    devices = [d.strip() for d in config.backend.devices.split(",")]
    in_process = traits is not None and traits.in_process
    dtype = (
        config.inference.dtype
        if traits is not None and config.inference.dtype in traits.dtypes
        else "auto"
    )
    return sampler_on_device(in_process, devices[0] == devices[-1], dtype)


def _shape_memory(config: Config, shape: ModelShape, plan: dict[str, Any]) -> dict[str, Any]:
    """`peak_memory` of the local step from the model's shape, and the estimate against
    the training device's free memory (`fit_problem`)."""
    opts, step, sizing = plan["opts"], plan["step"], plan["sizing"]
    kind, dtype = sizing.device_kind, sizing.dtype
    sized = _rows_sized_to_memory(shape, plan)
    if sized:
        step = replace(step, max_rows=sized)
    chosen = _micro_batch(opts, shape, plan)
    size = chosen or MICRO_BATCH_STEP  # unknown: auto's smallest, so a lower bound
    parts = peak_memory(shape, sizing, step, size)
    # a decoder that sizes its rows to the free memory fills it by design: what must fit
    # is one completion's cache beside the weights (and the training micro-batch)
    least = peak_memory(shape, sizing, replace(step, max_rows=1), size) if sized else parts
    gib = {k: v / 2**30 for k, v in parts.as_dict().items()}
    how = "auto" if opts["micro_batch_tokens"] == "auto" else "set"
    # shard = true: the sampler reads the gathered blocks themselves (no copy of its own)
    sampler = sizing.sampler if step.shards == 1 else None
    copy_ = sampler_copy_bytes(shape, replace(sizing, sampler=sampler))
    own = f" (of which the sampler's copy {copy_ / 2**30:.2f})" if copy_ else ""
    micro = f"a training micro-batch of {size} positions ({how}) {gib['training']:.2f} GiB"
    if sizing.sampler is None:  # a server engine, or split mode's other device
        traits = engine_traits(config)
        where = "the other device's" if traits and traits.in_process else "the server's"
        parts_text = f"{micro} (sampling is {where})"
    else:
        wanted = step.batch_size * step.group_size
        rows = sampling_rows(step.batch_size, step.group_size, step.prompt_batch, step.max_rows)
        limited = sized and rows < wanted  # the free memory, not the step, bounds them
        at_once = f" ({rows} of {wanted} completions at once, as many as fit)" if limited else ""
        parts_text = f"the larger of sampling {gib['sampling']:.2f}{at_once} and {micro}"
    note = (
        f"weights {gib['weights']:.2f}{own} + adapter {gib['adapter']:.2f} + {parts_text}, "
        f"+{parts.slack - 1:.0%} allocator slack, + {gib['runtime']:.1f} GiB runtime; "
        f"prompts of ~{PROMPT_TOKENS_GUESS} tokens"
    )
    if step.shards > 1:
        note += (
            f"; shard = true: training holds {gib['training_weights']:.2f} GiB of weights "
            f"(the blocks / {step.shards}), sampling gathers them whole"
        )
    if not step.prompt_batch:  # with prompt_batch > 0 sampling grows with the group
        note += "; does not grow with the group size"
    if chosen is None:
        note += f"; auto is sized at start to {plan['where']}'s free memory (unknown here)"
    if not memory_model(kind, dtype).calibrated:
        note += f"; the {kind} memory model is not calibrated yet"
    out = {"peak_memory_gib": round(gib["total"], 2), "micro_batch_tokens": chosen}
    out["memory_note"] = note
    if plan["free"] is not None and chosen:
        largest = largest_micro_batch(shape, sizing, plan["free"])
        out["memory_problem"] = fit_problem(
            least,  # split mode and a server engine: training alone (`Sizing.sampler`)
            free_bytes=plan["free"],
            total_bytes=plan["total"],
            where=plan["where"],
            micro_batch_tokens=chosen,
            largest=largest,
            calibrated=bool(memory_model(kind, dtype).calibrated),
            one_row=bool(sized),
            prompt_batch=step.prompt_batch,
            lighter=lighter_weights(dtype, kind),
        ) or _completion_problem(shape, plan, largest)
    return out


def _completion_problem(shape: ModelShape, plan: dict[str, Any], largest: int) -> FitProblem | None:
    """A warning when a completion of max_tokens could not be trained: a completion is
    trained whole, in one micro-batch, and a longer one than the largest micro-batch
    that fits stops the run out of memory (retrain/backends/local.py `_back_off`; the
    last checkpoint kept). A warning, not an error: completions may end sooner. None
    under shard = true (each rank holds a share of the blocks while training)."""
    step, sizing = plan["step"], plan["sizing"]
    longest = step.prompt_tokens + step.max_tokens
    if step.shards > 1 or largest == 0 or largest >= longest:
        return None
    fixes = []
    if not sizing.checkpointing:
        ckpt = largest_micro_batch(shape, replace(sizing, checkpointing=True), plan["free"])
        fits = "a completion of max_tokens then fits" if ckpt >= longest else f"up to {ckpt}"
        fixes.append(f"[backend.options] checkpointing = true ({fits})")
    if largest > step.prompt_tokens:
        fixes.append(f"max_tokens <= {largest - step.prompt_tokens}")
    fixes.append("a device with more memory")
    return FitProblem(
        "warning",
        f"[training] max_tokens = {step.max_tokens}: a completion is trained whole, in one "
        f"micro-batch of up to ~{longest} positions (a prompt of ~{step.prompt_tokens} "
        f"tokens and max_tokens), and the largest that fits the "
        f"{plan['free'] / 2**30:.1f} GiB free on {plan['where']} is {largest}; a completion "
        "longer than that would run out of memory, which stops the run (the last "
        "checkpoint kept). Fix: " + ", or ".join(fixes),
        what="completion",
    )


def _rows_sized_to_memory(shape: ModelShape, plan: dict[str, Any]) -> int | None:
    """The completions the pytorch engine decodes at once where it sizes them to the free
    memory (an in-process sampler on CUDA, `prompt_batch = 0`: retrain/engines/pytorch.py),
    as it does: from what is free when it samples, after the weights, the adapter and the
    runtime took theirs; None where the rows are fixed (a CPU's SAMPLE_ROWS, whole prompts
    with `prompt_batch`) or unknown."""
    step, sizing, free = plan["step"], plan["sizing"], plan["free"]
    if sizing.device_kind != "cuda" or free is None or sizing.sampler is None:
        return None
    if step.prompt_batch:
        return None
    model = memory_model(sizing.device_kind, sizing.dtype)
    loaded = weight_bytes(shape, sizing) + adapter_bytes(shape, sizing)
    kv = kv_value_bytes(sizing)
    return decode_row_budget(
        device_kind=sizing.device_kind,
        free_bytes=max(free - loaded * model.slack - model.runtime_bytes, 0),
        kv_bytes_per_token=shape.kv_bytes_per_token(kv),
        logit_bytes_per_row=shape.logit_bytes_per_row(),
        max_len=step.prompt_tokens + step.max_tokens,
    )


def _named_memory(params: int, plan: dict[str, Any]) -> dict[str, Any]:
    """The weights alone from the parameter count in the model's name, at the device's
    block dtype (a lower bound: no config.json on disk for the rest)."""
    dtype = plan["sizing"].dtype
    weights = params * block_bytes(dtype)
    out: dict[str, Any] = {"peak_memory_gib": round(weights / 2**30, 2)}
    out["memory_note"] = (
        f"at least the weights at {block_bytes(dtype)} bytes each ({dtype}; "
        "size from the model name, no config.json on disk for the rest)"
    )
    if plan["free"] is not None and weights > plan["free"]:
        out["memory_problem"] = FitProblem(
            "error",
            f"[model] model: the weights alone need ~{weights / 2**30:.1f} GiB, "
            f"{plan['where']} has {plan['free'] / 2**30:.1f} GiB free. Fix: a smaller model, "
            "a device with more memory, or a remote backend",
        )
    return out


def conversation_turns(config: Config) -> str | None:
    """With a multi-turn environment, what the estimates leave out: they count one model
    turn of max_tokens per completion, where a conversation takes up to max_turns of
    them, plus the environment's replies, into its one trained row. None otherwise."""
    e = config.environment
    if not e.provider or e.max_turns == 1:
        return None
    turns = (
        f"up to {e.max_turns} turns"
        if e.max_turns > 0
        else f"as many turns as the environment allows ({FALLBACK_MAX_TURNS} where it sets no cap)"
    )
    return (
        f"one model turn per completion: an environment's conversation takes {turns}, "
        "each up to max_tokens, plus its replies, so its steps and rows can be that many "
        "times longer"
    )


def memory_estimate(config: Config, world: World | None = None) -> dict[str, Any]:
    """The local step's peak memory on its training device (retrain/memory.py), that
    device's free and total memory (retrain/hardware.py, no torch), `checkpointing` as
    the backend resolves "auto" at start, and `memory_problem`: a FitProblem when the
    estimate comes near or over the free memory."""
    opts = local_options(config)
    where, kind, index = training_device(config)
    found = device_memory(kind, index)
    free, total = found if found is not None else (None, None)
    t = config.training
    shape = model_shape(config.model.model)
    sizing = Sizing(
        device_kind=kind,
        dtype=matmul_dtype(opts["dtype"], kind, index),
        lora_rank=config.model.lora_rank,
        target_modules=tuple(config.lora.target_modules),
        sampler=_sampler(config),
    )
    checkpointing, why = opts.get("checkpointing", False), ""
    if checkpointing == "auto":
        checkpointing = needs_checkpointing(shape, sizing, free, t.max_tokens)
        why = (
            "it decides on a GPU only"
            if kind != "cuda"
            else "decided at start from the model's config and the free memory"
            if free is None or shape is None
            else "a completion of max_tokens needs it"
            if checkpointing
            else "a completion of max_tokens fits without it"
        )
    plan = {
        "opts": opts,
        "where": where,
        "sizing": replace(sizing, checkpointing=bool(checkpointing)),
        "free": free,
        "total": total,
        "errors": [],
        "step": StepSizes(
            # under torchrun each rank holds its share of the batch (and its own device)
            batch_size=max(1, t.batch_size // (world.size if world else 1)),
            group_size=t.group_size,
            max_tokens=t.max_tokens,
            prompt_tokens=PROMPT_TOKENS_GUESS,
            prompt_batch=opts["prompt_batch"],
            shards=world.size if world and opts.get("shard") is True else 1,
        ),
    }
    out: dict[str, Any] = {
        "device": where,
        "device_free_gib": _gib(free),
        "device_total_gib": _gib(total),
        "micro_batch_tokens": None,
        # as the backend resolves it ("auto" at start; None: decided there, unknown here)
        "checkpointing": None if why.startswith("decided") else bool(checkpointing),
        "checkpointing_auto": why,
        "memory_problem": None,
    }
    params = params_in_name(config.model.model)
    if shape is not None:
        out.update(_shape_memory(config, shape, plan))
    elif params is not None:
        out.update(_named_memory(params, plan))
    else:
        out["peak_memory_gib"] = None
        out["memory_note"] = "unknown model size (no config.json on disk, no size in the name)"
    turns = conversation_turns(config)
    if turns and out.get("memory_note"):
        out["memory_note"] += f"; {turns}"
    if plan["errors"]:
        out["memory_problem"] = FitProblem("error", plan["errors"][0])
    problem = out["memory_problem"]
    out["memory_problem"] = None if problem is None else asdict(problem)
    return out


def estimates(config: Config, info: BackendInfo, world: World | None = None) -> dict[str, Any]:
    """Rough peak memory and wall time per step. Memory: `memory_estimate` (the local
    step on its device, compared with the device's free memory). Time: a recent run's
    measured median when [logging] log_dir has one, else FLOPs (2 x params per sampled
    token, 6 x params per trained token, 8 with activation checkpointing) over the
    effective rates retrain measured on the device kind (`_EFFECTIVE_FLOPS`; none for MPS)."""
    t = config.training
    completions = t.batch_size * t.group_size
    tokens = completions * t.max_tokens
    out: dict[str, Any] = {"sampled_tokens_per_step": tokens}
    remote = "[backend] devices" in info.ignores
    shape = model_shape(config.model.model)
    params = shape.params if shape is not None else params_in_name(config.model.model)
    out["model_params"] = params
    device = device_kind(config)
    if remote:
        out["peak_memory_gib"] = None
        out["memory_note"] = f"the model runs on the {info.name} service"
    else:
        out.update(memory_estimate(config, world))
    recent = _recent_rates(config)
    out["recent_run"] = recent
    if recent is not None and not recent["differs"]:
        out["step_time_s"] = round(recent["median_step_s"], 2)
        out["step_time_source"] = f"median of {recent['steps']} steps logged in {recent['log_dir']}"
    elif params is not None and not remote and device in _EFFECTIVE_FLOPS:
        sampling_rate, training_rate = _EFFECTIVE_FLOPS[device]
        scaled = (1.0, 1.0, "")
        if device == "cuda":
            scaled = _gpu_scale(training_device(config)[2])
            sampling_rate, training_rate = sampling_rate * scaled[0], training_rate * scaled[1]
        sampling = 2 * params * tokens / sampling_rate
        # activation checkpointing runs each block's forward twice: 8 x params, not 6
        recompute = bool(out.get("checkpointing"))
        training = (8 if recompute else 6) * params * tokens / training_rate
        floor = _STEP_FLOOR_S.get(device, 0.0)
        out["step_time_s"] = round(max(floor, sampling + training), 2)
        least = (
            f"; at least the {floor:g} s the quickstart took on an H100"
            if floor > sampling + training
            else ""
        )
        out["step_time_source"] = (
            f"rough: sampling ~{sampling:.2g} s + training ~{training:.2g} s"
            f"{' (a third more: activation checkpointing)' if recompute else ''}, scaled by "
            f"parameters x tokens from what retrain measured on {_MEASURED_ON[device]}"
            f"{scaled[2]}{least}; "
            "every completion at max_tokens"
            + (f" ({turns})" if (turns := conversation_turns(config)) else "")
            + f". Run a few steps for a measured median{_other_setup(recent)}"
        )
    else:
        why = "remote service" if remote else "unknown model size"
        if not remote and params is not None:
            why = f"no rate measured on {device}"
        out["step_time_s"] = None
        out["step_time_source"] = f"no estimate ({why}; run a few steps){_other_setup(recent)}"
    return out


def _other_setup(recent: dict[str, Any] | None) -> str:
    """Why a run logged in log_dir gave no step time: it ran another setup."""
    if recent is None or not recent["differs"]:
        return ""
    return (
        f"; the {recent['steps']} steps logged in {recent['log_dir']} ran another setup "
        f"({', '.join(recent['differs'][:2])}), so their median is not this one's"
    )
