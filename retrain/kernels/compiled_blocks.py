"""The trained model's transformer blocks compiled by torch.compile, for training on a
GPU (`[backend.options] compile = true`).

Eager, each block of a Llama-family model runs ~150 operators forward and more
backward, most of them element-wise passes over its activations (rotary embedding,
residual adds, the gated activation, casts between bf16 and float32): on a small model
the host launching them sets a training step's time, on a large one their memory
traffic is a fifth of it (docs/performance.md, the H100's headline profile). Compiled,
inductor fuses those passes into a few kernels per block around the matmuls, and its
partitioner chooses what the backward keeps and what it recomputes.

Each block is compiled on its own (`Module.compile`, with dynamic shapes): the blocks
run the same code, and torch compiles their parameters as inputs, so one graph serves
them all, compiled at the first training step (and once more per grad mode and shape
class). What a compiled block cannot trace is left out by the local backend when it
compiles: sibling LoRA linears trained as one (their stacked-storage check reads
storage offsets) run one by one, and the gated product is not wrapped in a recompute
(a backward that calls autograd; inductor recomputes what it chooses itself). Only the
trained model's blocks are compiled, after the sampling copy is made: the copy's
blocks run eagerly (its decode step is captured or compiled on its own terms).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from retrain.errors import BackendError, summary
from retrain.kernels.blocks import transformer_blocks

# the compiler; tests on a CPU use "aot_eager" (dynamo's trace and AOT autograd's
# graphs, not inductor's kernels: inductor has no CPU kernel for CUDA's float32-result
# bf16 matmuls that the GPU's layout runs)
BACKEND = "inductor"
# graphs a block's code may compile to: per grad mode (training, and logprobs without a
# gradient) and shape class, and a few for dynamo's guards on the blocks' attributes
RECOMPILES = 32


def compile_blocks(model: torch.nn.Module) -> int:
    """Every transformer block of `model` (`blocks.transformer_blocks`) compiled in place
    (module docstring); returns how many (0: the model names no blocks, and nothing is
    compiled)."""
    found = transformer_blocks(model)
    dynamo = torch._dynamo.config
    dynamo.recompile_limit = max(dynamo.recompile_limit, RECOMPILES)
    for block in found:
        block.compile(backend=BACKEND, fullgraph=True, dynamic=True)
    return len(found)


def compiled(module: torch.nn.Module) -> bool:
    """Whether `module` runs compiled (`compile_blocks`)."""
    return getattr(module, "_compiled_call_impl", None) is not None


def device_error(error: BaseException | None) -> BaseException | None:
    """The out-of-memory (or other device) error in `error` or what it wraps, if any.
    Dynamo re-raises whatever the compiler raised as BackendCompilerFailed "from None",
    keeping the cause only in its `inner_exception`, and inductor can run out of device
    memory too (benchmarking kernels): no compile failure, but the caller's
    out-of-memory back-off's to handle."""
    kinds = tuple(
        k for k in (torch.OutOfMemoryError, getattr(torch, "AcceleratorError", None)) if k
    )
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, kinds):
            return error
        error = getattr(error, "inner_exception", None) or error.__cause__
    return None


@contextlib.contextmanager
def compile_errors(compiling: bool) -> Iterator[None]:
    """A failure of torch.compile in the block (dynamo's trace, or the compiler it calls)
    as a BackendError naming the option, when `compiling`: it shows at the first training
    step, before the optimizer steps, so the weights and the last checkpoint stand."""
    try:
        yield
    except Exception as error:
        if not compiling:
            raise
        from torch._dynamo.exc import TorchDynamoException

        if not isinstance(error, TorchDynamoException):
            raise
        inner = device_error(error)
        if inner is not None:  # memory ran out while compiling: the back-off's to handle
            raise inner from error
        raise BackendError(
            "[backend.options] compile = true: torch.compile failed on the trained model's "
            f"blocks ({summary(error)}); the weights were not updated. Fix: compile = false"
        ) from error
