"""The operators a piece of work dispatches, by name: on a GPU each is a kernel launch
(views apart), the host's cost of a small model's step."""

from __future__ import annotations

import collections

from torch.utils._python_dispatch import TorchDispatchMode


class OpCount(TorchDispatchMode):
    """Counts every operator dispatched inside it, by its name without the overload. A
    foreach copy counts what it launches on CUDA: one where every pair shares its sizes
    and strides (its fast path, a few kernels for the whole list), else one per pair."""

    def __init__(self):
        super().__init__()
        self.seen: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.seen[name] += _launches(name, args)
        return func(*args, **(kwargs or {}))


def _launches(name: str, args) -> int:
    if name != "_foreach_copy_":
        return 1
    pairs = list(zip(args[0], args[1]))
    alike = all(c.shape == s.shape and c.stride() == s.stride() for c, s in pairs)
    return 1 if alike else len(pairs)
