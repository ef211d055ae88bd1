"""The operators a piece of work dispatches, by name: on a GPU each is a kernel launch
(views apart), the host's cost of a small model's step."""

from __future__ import annotations

import collections

from torch.utils._python_dispatch import TorchDispatchMode


class OpCount(TorchDispatchMode):
    """Counts every operator dispatched inside it, by its name without the overload."""

    def __init__(self):
        super().__init__()
        self.seen: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))
