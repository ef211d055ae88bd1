"""What the local backend needs of an inference engine.

An engine registry entry's target is a factory `build(settings: EngineSettings, *,
tokenizer, say) -> Engine` (retrain/registry.py ENGINES); retrain/build.py calls it and
hands the engine to the backend. Its `traits` (the entry's EngineTraits) say which kind
it is, and the backend branches on them, never on the engine's name:

- in-process (`traits.in_process`): samples from the model being trained. The factory
  cannot load that model, so it returns an unbound engine whose `bind(...)` the backend
  calls once the model is loaded; the weights are shared, nothing is pushed.
- a server: samples over HTTP; after each optimizer step the backend saves the adapter
  to a new folder (retrain/engines/sync.py) and calls `sync_adapter(folder, version)`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from retrain.types import EngineTraits, Sample, SamplingParams


@runtime_checkable
class Engine(Protocol):
    name: str
    traits: EngineTraits

    def sample(
        self, prompts_B: list[list[int]], n: int, params: SamplingParams
    ) -> list[list[Sample]]:
        """`n` completions for each prompt (token ids), with the sampler's logprobs."""

    def metrics(self) -> dict[str, float]:
        """The engine's columns of the metrics row."""

    def close(self) -> None: ...


class ServerEngine(Engine, Protocol):
    def set_stop_ids(self, ids: list[int]) -> None:
        """The trainer's end-of-completion tokens (tokenizer + generation config)."""

    def sync_adapter(self, path: str | Path, version: int) -> bool:
        """Make the server sample from the adapter saved at `path`."""


class InProcessEngine(Engine, Protocol):
    """An engine sampling from the trained model in this process, on its device."""

    def kept_bytes(self) -> int:
        """Device bytes it keeps between calls beyond the model (caches for captured
        graphs)."""

    def release(self) -> int:
        """Give those back (the next call rebuilds them); returns the bytes released."""


class UnboundEngine(Protocol):
    """What an in-process engine's factory returns: bound to the model by the backend.
    `dtype`: the `[inference] dtype` it samples in ("auto", or one of its traits'
    `dtypes`), which the backend's memory sizing counts before it binds."""

    name: str
    traits: EngineTraits
    dtype: str

    def bind(
        self,
        model: Any,
        *,
        eos_ids: set[int],
        pad_id: int,
        device: Any,
        bf16: bool,
        threads: Any,
        sampling_copy: bool = True,
    ) -> InProcessEngine:
        """The engine sampling from `model` on `device`; `bf16` says the trainer runs bf16
        matmuls (its sampling copy then does too), `threads` is the backend's
        retrain.threads.ThreadPolicy; `sampling_copy = False` samples from `model`
        itself, never a copy (a sharded base has no whole weights to copy)."""
