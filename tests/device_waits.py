"""The operators after which a host waits for a CUDA device, recorded on any device.

On CUDA the host queues kernels and runs ahead of the GPU until something needs a value
only the device has: a number read back (`float(t)`, `t.item()`, `bool(t)`: torch's
`_local_scalar_dense`), or a shape that depends on the data (a bool-mask index or
assignment, `nonzero`, `masked_select`). Each such operator is dispatched the same way on
a CPU, so a CPU run of the trainer shows every place a GPU run would wait. (A copy from
pageable host memory waits too; a CPU cannot see that one: the `-m gpu` test runs the
same work under torch's sync debug mode.)
"""

from __future__ import annotations

import collections
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

WAITING = {"_local_scalar_dense", "nonzero", "masked_select"}
INDEXING = {"index", "index_put", "index_put_", "_index_put_impl_"}


def _bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 else None
    return isinstance(indices, (list, tuple)) and any(
        isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices
    )


class DeviceWaits(TorchDispatchMode):
    """Counts the operators that would wait for a CUDA device, by (name, retrain's line)."""

    def __init__(self):
        super().__init__()
        self.seen: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[1]
        if name in WAITING or (name in INDEXING and _bool_index(args)):
            ours = [f for f in traceback.extract_stack() if "/retrain/" in f.filename]
            where = f"{ours[-1].filename.split('/retrain/')[-1]}:{ours[-1].lineno}" if ours else "?"
            self.seen[(name, where)] += 1
        return func(*args, **(kwargs or {}))
