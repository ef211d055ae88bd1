"""The data-source base class and the resumable batch iterator every source shares.

A source loads its examples eagerly (the datasets are small) into `examples`; the
trainer pulls batches with `next_batch(n)`. The stream walks epoch after epoch; with
`shuffle` on, epoch e's order is a permutation drawn from `random.Random(shuffle_seed + e)`,
so the order depends only on (seed, epoch), never on how batches were cut. `position` is
the number of examples handed out so far: saving `state_dict()` and loading it into a
freshly built source gives exactly the same next batches.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator, Sequence
from typing import Any

from retrain.errors import DataError
from retrain.types import Example

logger = logging.getLogger("retrain.data")


class ExampleStream:
    """Deterministic, resumable, epoch-cycling batches over a fixed list of examples."""

    def __init__(
        self, examples: Sequence[Example], *, shuffle: bool = True, shuffle_seed: int = 0
    ) -> None:
        if not examples:
            raise DataError("the data source has no examples")
        self.examples = list(examples)
        self.shuffle = bool(shuffle)
        self.shuffle_seed = int(shuffle_seed)
        self.position = 0
        self._order_epoch = -1
        self._order: list[int] = []

    def __len__(self) -> int:
        return len(self.examples)

    @property
    def epoch(self) -> int:
        """The epoch the next example comes from."""
        return self.position // len(self.examples)

    def order(self, epoch: int) -> list[int]:
        """Indices of `examples` in the order epoch `epoch` visits them."""
        if epoch != self._order_epoch:
            idx = list(range(len(self.examples)))
            if self.shuffle:
                random.Random(self.shuffle_seed + epoch).shuffle(idx)
            self._order, self._order_epoch = idx, epoch
        return self._order

    def next_batch(self, n: int) -> list[Example]:
        if n < 1:
            raise ValueError(f"batch size must be >= 1, got {n}")
        size = len(self.examples)
        out = []
        for _ in range(n):
            epoch, offset = divmod(self.position, size)
            out.append(self.examples[self.order(epoch)[offset]])
            self.position += 1
        return out

    def state_dict(self) -> dict[str, Any]:
        return {
            "position": self.position,
            "epoch": self.epoch,
            "num_examples": len(self.examples),
            "shuffle": self.shuffle,
            "shuffle_seed": self.shuffle_seed,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "position" not in state:
            raise DataError("data state has no 'position' (not a data-source state?)")
        position = int(state["position"])
        if position < 0:
            raise DataError(f"data state position must be >= 0, got {position}")
        n = state.get("num_examples")
        if n is not None and int(n) != len(self.examples):
            logger.warning(
                "resuming a data stream saved with %s examples on one with %s: the order "
                "after resume differs from the original run",
                n,
                len(self.examples),
            )
        for key in ("shuffle", "shuffle_seed"):
            if key in state and state[key] != getattr(self, key):
                logger.warning(
                    "resuming with [data] %s = %r (saved run used %r): the batch order "
                    "differs from the original run",
                    key,
                    getattr(self, key),
                    state[key],
                )
        self.position = position


class DataSource:
    """Examples plus the batch stream. Subclasses load `examples` and call
    `super().__init__(examples, ...)`.

    Attributes the trainer may read:
      name         short label for logs
      reward_hint  the reward type this data is meant for ("gym" for reasoning-gym), or None
      reward       a ready Reward object when the source carries its own scorer
                   (verifiers environments), else None
    """

    name = "data"
    reward_hint: str | None = None

    def __init__(
        self,
        examples: Sequence[Example],
        *,
        name: str | None = None,
        max_examples: int = 0,
        shuffle: bool = True,
        shuffle_seed: int | None = None,
        seed: int = 0,
        reward: Any = None,
        reward_hint: str | None = None,
    ) -> None:
        examples = list(examples)
        if max_examples and max_examples > 0:
            examples = examples[:max_examples]
        if name is not None:
            self.name = name
        if not examples:
            raise DataError(f"data source {self.name!r} produced no examples")
        self.examples: list[Example] = examples
        self.reward = reward
        if reward_hint is not None:
            self.reward_hint = reward_hint
        self.stream = ExampleStream(
            examples,
            shuffle=shuffle,
            shuffle_seed=seed if shuffle_seed is None else shuffle_seed,
        )

    def __len__(self) -> int:
        return len(self.examples)

    def __iter__(self) -> Iterator[Example]:
        return iter(self.examples)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, n={len(self.examples)})"

    # -- the stream ------------------------------------------------------------------
    def next_batch(self, n: int) -> list[Example]:
        return self.stream.next_batch(n)

    @property
    def position(self) -> int:
        return self.stream.position

    @property
    def epoch(self) -> int:
        return self.stream.epoch

    def state_dict(self) -> dict[str, Any]:
        return {**self.stream.state_dict(), "source": self.name}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stream.load_state_dict(state)

    def close(self) -> None:
        """Release what the source holds (a verifiers environment's resources)."""
