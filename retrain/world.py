"""Where this process stands in a run on several processes (torchrun): the `World`
record, read from the environment torchrun sets, and the pure rules every rank applies
the same way (which prompts are this rank's, which configs cannot run on N ranks).

No torch here: `retrain explain` and `retrain doctor` use it before anything heavy
loads. The collectives themselves are retrain/distributed.py's.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

# What torchrun (torch.distributed.run) sets in every worker's environment.
ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class World:
    """This process's rank among `size` processes of one run (one device each);
    `size == 1` is a run without torchrun, which never touches torch.distributed."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    timeout_s: float = 600.0  # a collective waiting longer names the rank that is missing
    shard: bool = False  # the frozen base sharded over the ranks (FSDP2)

    @property
    def is_main(self) -> bool:
        """Rank 0: the one rank that writes logs, metrics, checkpoints and adapters."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1

    def bounds(self, n: int) -> tuple[int, int]:
        """This rank's [start, stop) of `n` items (see `shard_bounds`)."""
        return shard_bounds(n, self.rank, self.size)


def world_from_env(
    environ: Mapping[str, str] | None = None, *, timeout_s: float = 600.0, shard: bool = False
) -> World:
    """The World torchrun describes in the environment (WORLD_SIZE, RANK, LOCAL_RANK);
    a single process when WORLD_SIZE is unset."""
    env = os.environ if environ is None else environ
    size = int(env.get("WORLD_SIZE", "1") or 1)
    if size <= 1:
        return World(timeout_s=timeout_s)
    rank = int(env.get("RANK", "0"))
    local = int(env.get("LOCAL_RANK", str(rank)))
    return World(rank=rank, size=size, local_rank=local, timeout_s=timeout_s, shard=shard)


def shard_bounds(n: int, rank: int, size: int) -> tuple[int, int]:
    """Rank `rank`'s contiguous [start, stop) of `n` items over `size` ranks: sizes differ
    by at most one, earlier ranks take the extra ones, and rank order concatenates back
    to the original order (so gathering the ranks' parts rebuilds the whole batch)."""
    base, extra = divmod(n, size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)
