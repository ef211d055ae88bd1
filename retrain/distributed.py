"""torch.distributed for one run on several processes (torchrun, one device per rank):
the process group, the few collectives the trainer and the local backend need, and how
a failure on one rank stops every other one.

Every helper takes the run's `World` (retrain/world.py) and does nothing on a world of
one, so a run without torchrun never touches torch.distributed and behaves exactly as
before. With N ranks:

- `gather` (all_gather_object) hands every rank the whole step's sampled groups, so
  every batch statistic (advantages, SEPA, back pressure, counters, metrics) is computed
  over the whole batch, the same on every rank, from the same inputs;
- `all_reduce_grads` sums the LoRA gradients after a step's micro-batches (one flat
  all-reduce per optimizer step, not DDP: a rank's number of micro-batches depends on its
  completions' lengths, and DDP reduces on every backward);
- a rank that raises posts `failure/<rank>` (its message) to the rendezvous store
  before it exits; a rank whose collective then fails (the peer's connection closed, or
  `collective_timeout_s` passed) raises DistributedError naming that rank and message;
- `shard_base` (`[backend.options] shard = true`) shards the frozen base's transformer
  blocks over the ranks with FSDP2; `full_weights` / `sharded_weights` switch between
  the whole blocks the sampler reads and the shards training keeps.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

from retrain.errors import BackendError, DistributedError, RetrainError
from retrain.kernels.blocks import transformer_blocks
from retrain.world import World

if TYPE_CHECKING:  # the trainer imports this module on every backend; tinker's needs no torch
    import torch

T = TypeVar("T")
_FAILURE = "failure/"
_state: dict[str, Any] = {}  # the run's store (torch.distributed's own state is global too)


def backend_for(device_kind: str) -> str:
    """NCCL between GPUs, gloo between CPUs."""
    return "nccl" if device_kind == "cuda" else "gloo"


def connect(world: World, device_kind: str) -> None:
    """Join the run's process group. Under torchrun the rendezvous store is the launcher's
    (it outlives the workers, so a failed rank's message stays readable); launched by
    hand, rank 0 hosts it."""
    if not world.distributed:
        return
    import torch
    import torch.distributed as dist

    # A rank that dies inside C++ (gloo, NCCL: SIGABRT, SIGSEGV) would leave only torchrun's
    # "exitcode -6"; this prints every thread's Python stack to the rank's stderr first.
    if not faulthandler.is_enabled():
        faulthandler.enable()
    timeout = timedelta(seconds=world.timeout_s)
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    store = dist.TCPStore(
        os.environ.get("MASTER_ADDR", "localhost"),
        int(os.environ.get("MASTER_PORT", "29500")),
        world.size,
        is_master=world.is_main and not agent,
        timeout=timeout,
        multi_tenant=True,
    )
    if device_kind == "cuda":
        torch.cuda.set_device(world.local_rank)
    dist.init_process_group(
        backend_for(device_kind),
        store=dist.PrefixStore("retrain/pg", store),
        rank=world.rank,
        world_size=world.size,
        timeout=timeout,
    )
    _state["store"] = dist.PrefixStore("retrain/run", store)


def disconnect() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _state.clear()


@contextmanager
def session(world: World, device_kind: str) -> Iterator[None]:
    """The process group for the body; an error in it is posted for the other ranks
    (their collectives fail at once, or after the timeout, naming this rank)."""
    connect(world, device_kind)
    try:
        yield
    except BaseException as exc:
        if world.distributed and not isinstance(exc, DistributedError):
            post_failure(world, exc)
        raise
    finally:
        if world.distributed:
            disconnect()


def post_failure(world: World, exc: BaseException) -> None:
    store = _state.get("store")
    if store is None:
        return
    text = str(exc) if isinstance(exc, RetrainError) else f"{type(exc).__name__}: {exc}"
    with contextlib.suppress(Exception):  # the store is gone with the launcher
        store.set(f"{_FAILURE}{world.rank}", text or type(exc).__name__)


def _posted_failure(world: World, wait_s: float = 3.0) -> tuple[int, str] | None:
    """(rank, message) of the first rank that posted a failure, waiting up to `wait_s`
    for one (a failing rank posts before it exits, but the collective may notice first)."""
    store = _state.get("store")
    if store is None:
        return None
    keys = [f"{_FAILURE}{r}" for r in range(world.size) if r != world.rank]
    deadline = time.monotonic() + wait_s
    while True:
        try:
            for key in keys:
                if store.check([key]):
                    return int(key[len(_FAILURE) :]), store.get(key).decode()
        except Exception:
            return None
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.1)


def collective(world: World, what: str, call: Callable[[], T]) -> T:
    """Run one collective; its failure becomes a DistributedError naming the rank that
    failed (or, when none said why, that a rank stopped answering within the timeout)."""
    try:
        return call()
    except Exception as exc:
        raise named_failure(world, what, exc) from exc


def named_failure(world: World, what: str, exc: BaseException) -> DistributedError:
    """The DistributedError for a collective that failed with `exc`: the rank that posted
    its failure and its message, or a rank that stopped answering."""
    failed = _posted_failure(world)
    if failed is not None:
        rank, message = failed
        return DistributedError(
            f"rank {rank} of {world.size} failed: {message} (rank {world.rank} stops too, "
            f"during {what}; the last checkpoint is kept)"
        )
    first = (str(exc).splitlines() or [type(exc).__name__])[0]
    return DistributedError(
        f"rank {world.rank} of {world.size}: another rank stopped answering during {what} "
        f"(it crashed or was killed, or was still busy after [backend.options] "
        f"collective_timeout_s = {world.timeout_s:g}): {first}. The "
        "launcher's log names the rank; the last checkpoint is kept"
    )


def gather(world: World, obj: T, what: str) -> list[T]:
    """Every rank's `obj`, in rank order."""
    if not world.distributed:
        return [obj]
    import torch.distributed as dist

    out: list[Any] = [None] * world.size
    collective(world, what, lambda: dist.all_gather_object(out, obj))
    return out


def any_rank(world: World, flag: bool, what: str) -> bool:
    """True on every rank when `flag` is True on any (a stop request reaching one rank)."""
    return any(gather(world, bool(flag), what))


def barrier(world: World, what: str) -> None:
    if world.distributed:
        gather(world, None, what)


def all_reduce_grads(world: World, params: Sequence[torch.Tensor]) -> None:
    """Sum the parameters' gradients over the ranks, in one flat buffer. A rank without a
    gradient (no completion of its own this step) adds zeros."""
    if not world.distributed:
        return
    import torch
    import torch.distributed as dist

    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    collective(world, "the gradient all-reduce", lambda: dist.all_reduce(flat))
    start = 0
    for p, g in zip(params, grads, strict=True):
        p.grad = flat[start : start + g.numel()].view_as(g).clone()
        start += g.numel()


def broadcast_params(world: World, params: Sequence[torch.Tensor]) -> None:
    """Rank 0's values into every rank's `params` (a LoRA init drawn unseeded)."""
    if not world.distributed:
        return
    import torch
    import torch.distributed as dist

    with torch.no_grad():
        for p in params:
            collective(world, "the adapter broadcast", lambda p=p: dist.broadcast(p.data, 0))


# ---------------------------------------------------------------- the sharded base (FSDP2)
#
# `[backend.options] shard = true`: each transformer block's frozen weights are split over
# the ranks (torch.distributed.fsdp.fully_shard, one FSDP unit per block); the embeddings,
# the final norm and the output layer stay whole on every rank. The LoRA weights are left
# out of FSDP (`ignored_params`): they stay whole and identical on every rank, so the
# optimizer, clipping, saving and loading are those of the unsharded run, and their
# gradients are summed by the same one flat all-reduce per step (`all_reduce_grads`).
# They are a fraction of a percent of the model; sharding them would save nothing worth a
# second gradient path (FSDP averages its reduce-scatter; retrain sums).


def shard_base(model: torch.nn.Module, world: World, device: torch.device) -> int:
    """Shard every transformer block's frozen weights over the ranks (one FSDP2 unit per
    block, resharded after its forward); the trainable (LoRA) weights stay whole. Returns
    the number of blocks. Every rank must then run the same forward and backward passes
    (each one all-gathers the blocks): see LocalBackend's padded micro-batches."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    found = transformer_blocks(model)
    if not found:
        raise BackendError(
            f"[backend.options] shard = true: {type(model).__name__} names no transformer "
            "block class (`_no_split_modules`), so there is nothing to shard per block. "
            "Fix: shard = false"
        )
    mesh = init_device_mesh(device.type, (world.size,))
    for block in found:
        trainable = {p for p in block.parameters() if p.requires_grad}
        # explicit True: FSDP2 keeps a root's weights whole after forward, and each
        # block is its own root here
        fully_shard(block, mesh=mesh, reshard_after_forward=True, ignored_params=trainable)
    return len(found)


def _sharded(model: torch.nn.Module) -> list[Any]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def full_weights(world: World, model: torch.nn.Module) -> None:
    """All-gather every sharded block and keep it whole until `sharded_weights`, so the
    sampler's forward passes need no collective (each rank decodes a different number of
    tokens). A collective: every rank calls it at the same point (the first sampling call
    after a training step); a second call is a no-op."""
    for module in _sharded(model):
        module.set_reshard_after_forward(False, recurse=False)
        collective(world, "the sharded blocks' all-gather", module.unshard)


def sharded_weights(model: torch.nn.Module) -> None:
    """Back to the shards (local, no collective): training gathers one block at a time."""
    for module in _sharded(model):
        module.set_reshard_after_forward(True, recurse=False)
        module.reshard()


# ---------------------------------------------------------------- per-rank RNG state


def rank_rng_state() -> dict[str, Any]:
    """This rank's torch RNG states (CPU and CUDA), as JSON lists."""
    import torch

    out: dict[str, Any] = {"torch": torch.get_rng_state().tolist()}
    if torch.cuda.is_available():
        out["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return out


def restore_rank_rng(state: dict[str, Any]) -> None:
    import torch

    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if state.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])
