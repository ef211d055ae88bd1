"""The local backend's memory settings fitted to its training device (retrain/memory.py
holds the model): at the start, `checkpointing` and `micro_batch_tokens` resolved, or a
set budget checked against the free memory; after an out-of-memory error in a training
micro-batch, the next budget. Decisions and their messages only: the backend applies them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from retrain.errors import BackendError, TrainingError
from retrain.memory import (
    ModelShape,
    Sizing,
    auto_micro_batch_tokens,
    fit_problem,
    largest_micro_batch,
    lighter_weights,
    memory_model,
    needs_checkpointing,
    training_memory,
)
from retrain.settings import LocalOptions


@dataclass(frozen=True)
class Fitted:
    """The options with `checkpointing` and `micro_batch_tokens` resolved, the `Sizing`
    the run's memory checks use, and the model's shape (None: unknown, or not needed off
    CUDA)."""

    options: LocalOptions
    sizing: Sizing
    shape: ModelShape | None


@dataclass(frozen=True)
class CudaMemory:
    """The training device's memory at the start, read before the model loads."""

    where: str  # the device, as the messages name it ("cuda:0")
    free: int  # bytes
    total: int


def fit_to_device(
    options: LocalOptions,
    sizing: Sizing,
    *,
    max_tokens: int,
    model: str,
    cuda: CudaMemory | None,
    shape: ModelShape | None,
    say: Callable[[str], None],
) -> Fitted:
    """`checkpointing = "auto"` resolved (off on a CPU; on CUDA on when a completion of
    `max_tokens` would not fit the largest micro-batch without it); `micro_batch_tokens =
    "auto"` resolved (512 on a CPU; on CUDA the largest micro-batch whose training peak
    fits the free memory); on CUDA a set value checked against the free memory and
    refused (BackendError) with the largest value that fits. `cuda`: None off CUDA."""
    free = cuda.free if cuda is not None else None
    auto = options.checkpointing == "auto"
    needed = options.checkpointing is not True and needs_checkpointing(
        shape, sizing, free, max_tokens
    )
    if auto:
        options = replace(options, checkpointing=needed)
    if needed and cuda is not None:  # needs_checkpointing says True on CUDA only
        why = (
            f"a completion of {max_tokens} tokens after a prompt would not fit the largest "
            f"micro-batch without it; {cuda.free / 2**30:.1f} GiB free on {cuda.where}"
        )
        # set off by hand, it stays off: said, as a long completion would stop the run
        say(
            f"checkpointing = auto: on ({why})"
            if auto
            else f"WARNING: [backend.options] checkpointing = false: {why}; set it true or auto"
        )
    sizing = replace(sizing, checkpointing=bool(options.checkpointing))
    if cuda is None:  # CPU and MPS: auto is the CPU-measured 512, no check
        if options.micro_batch_tokens == "auto":
            n = auto_micro_batch_tokens(None, sizing, None)
            options = replace(options, micro_batch_tokens=n)
        return Fitted(options, sizing, None)
    if options.micro_batch_tokens == "auto":
        n = auto_micro_batch_tokens(shape, sizing, cuda.free, max_tokens)
        say(
            f"micro_batch_tokens = auto: {n} positions ({cuda.free / 2**30:.1f} GiB free on {cuda.where})"
        )
        return Fitted(replace(options, micro_batch_tokens=n), sizing, shape)
    if shape is None:
        say(
            f"WARNING: [backend.options] micro_batch_tokens = {options.micro_batch_tokens} is "
            f"not checked against {cuda.where}'s memory: {model}'s config.json "
            "does not give the sizes retrain/memory.py needs"
        )
        return Fitted(options, sizing, shape)
    problem = fit_problem(
        training_memory(shape, sizing, options.micro_batch_tokens),
        free_bytes=cuda.free,
        total_bytes=cuda.total,
        where=cuda.where,
        micro_batch_tokens=options.micro_batch_tokens,
        largest=largest_micro_batch(shape, sizing, cuda.free),
        calibrated=bool(memory_model(sizing.device_kind, sizing.dtype).calibrated),
        lighter=lighter_weights(sizing.dtype, sizing.device_kind),
    )
    if problem is not None and problem.level == "error":
        raise BackendError(problem.message)
    if problem is not None:
        say(f"WARNING: {problem.message}")
    return Fitted(options, sizing, shape)


@dataclass(frozen=True)
class BackOff:
    """What follows an out-of-memory error in a training micro-batch: the budget the step
    runs again at, and whether activation checkpointing goes on first."""

    micro_batch_tokens: int
    checkpoint: bool = False
    notice: str = ""  # said when checkpointing goes on


def back_off(
    failed: int,
    *,
    longest: int,
    budget: int,
    before: int,
    where: str,
    shard: bool,
    auto_checkpointing: bool,
    checkpointing: bool,
) -> BackOff:
    """After a micro-batch of `failed` completions (the longest `longest` positions, its
    prompt included) ran out of memory at `budget`: half the budget. One completion
    cannot be split: with `checkpointing = "auto"` still off, activation checkpointing
    goes on for the rest of the run and the step runs again at its first budget
    (`before`); else TrainingError naming what to lower (the trainer keeps the last
    checkpoint). `shard`: a sharded base under torchrun, where no rank can redo a step
    alone."""
    if shard:  # the other ranks are inside the next pass's all-gather
        raise TrainingError(
            f"out of memory on {where} in a training micro-batch with "
            f"[backend.options] shard = true ({failed} completions, micro_batch_tokens "
            f"= {budget}): with a sharded base every rank runs the same passes, so one "
            "rank cannot halve its budget and redo the step alone. Fix: a lower "
            "micro_batch_tokens, or checkpointing = true"
        )
    if failed > 1:
        return BackOff(max(1, budget // 2))
    if auto_checkpointing and not checkpointing:
        return BackOff(
            before,
            checkpoint=True,
            notice=(
                f"out of memory on {where} training one completion (up to {longest} "
                "positions): checkpointing = auto turns activation checkpointing on for "
                f"the rest of the run, and the step runs again (micro_batch_tokens {before})"
            ),
        )
    recompute = (
        ""
        if checkpointing
        else "[backend.options] checkpointing = true "
        "(each block keeps only its input, and recomputes the rest in the backward), "
    )
    raise TrainingError(
        f"out of memory on {where} training a micro-batch of one completion "
        f"(up to {longest} positions, prompt included; [backend.options] "
        f"micro_batch_tokens is down to {budget}, which cannot split it further). Fix: "
        f"{recompute}lower [training] max_tokens (a completion is trained whole), or free "
        "memory on the device; a lower [training] group_size or micro_batch_tokens does "
        "not shrink a single completion"
    )
