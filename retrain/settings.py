"""Typed settings: what retrain/build.py reads out of the Config for each built-in
component it constructs (the engines and the three backends). The components never see
the Config, so build.py is the one place that maps tables to constructors, and a
component's settings say on one screen everything it depends on.

Backend options (`[backend.options]`) are validated against the registry entry's
option schema when the config loads; their defaults live there (retrain/registry.py)
and `*Options.from_mapping` fills them in. A test checks that each options record has
exactly the schema's keys. Importing this module is cheap (no torch).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, ClassVar, Self

from retrain.world import World

if TYPE_CHECKING:
    from retrain.loss import LossFn


class _BackendOptions:
    """A built-in backend's `[backend.options]`, typed: one field per key of its registry
    entry's option schema."""

    BACKEND: ClassVar[str]

    @classmethod
    def from_mapping(cls, given: Mapping[str, Any]) -> Self:
        """The schema's defaults, overridden by the (already validated) values given."""
        from retrain.registry import BACKENDS

        schema = BACKENDS.entry(cls.BACKEND).options
        values = {**{key: spec.default for key, spec in schema.items()}, **given}
        return cls(**{f.name: values[f.name] for f in fields(cls)})


# ---------------------------------------------------------------- engines


@dataclass(frozen=True)
class EngineSettings:
    """What an inference engine is built from (`[inference]`, plus what it must serve)."""

    engine: str  # [inference] engine: the registry name
    url: str = ""  # "" = the engine's default address (or, for MAX, a server it starts)
    api_key: str = ""  # "" = none, or the engine's environment variable (openai)
    timeout: float = 300.0  # seconds per server request
    max_retries: int = 4
    max_connections: int = 16
    dtype: str = "auto"  # in-process: the sampling copy's dtype ("auto" or "bf16")
    prefix_caching: bool = True  # in-process: prefill each prompt once per group
    prompt_batch: int = 0  # in-process: prompts decoded together (0 = bounded rows)
    decode: str = "auto"  # in-process: "auto", "dynamic", "static" or "graphs"
    model: str = ""  # [model] model: what a server retrain starts must serve
    lora_rank: int = 32  # the largest adapter rank that server must accept


# ---------------------------------------------------------------- the local backend


@dataclass(frozen=True)
class LocalOptions(_BackendOptions):
    """`[backend.options]` of the local backend (retrain/registry.py documents each)."""

    micro_batch_tokens: int | str  # positions, or "auto" (resolved by the backend at start)
    threads: int
    overlap: bool
    prompt_batch: int
    dtype: str
    decode: str
    checkpointing: bool | str  # True, False, or "auto" (resolved by the backend at start)
    attention: str
    compile: bool
    collective_timeout_s: int
    shard: bool

    BACKEND: ClassVar[str] = "local"


@dataclass(frozen=True)
class LoraSettings:
    rank: int
    alpha: float  # 0 = 2 x rank
    dropout: float
    target_modules: tuple[str, ...]  # () = every linear layer

    @property
    def effective_alpha(self) -> float:
        return self.alpha or 2 * self.rank


@dataclass(frozen=True)
class OptimizerSettings:
    """AdamW as created; the learning rate of each step comes with its TrainHyper."""

    lr: float
    weight_decay: float
    beta1: float
    beta2: float
    eps: float


@dataclass(frozen=True)
class LocalSettings:
    model: str  # [model] model: a hub id or a local directory
    lora: LoraSettings
    optimizer: OptimizerSettings
    devices: str  # [backend] devices: "cpu", "gpu:0", "gpu:0,gpu:1" (split mode)
    adapter_path: str  # where checkpoints and, with a server engine, live adapters go
    seed: int  # -1 = unseeded (LoRA init draws from torch's global RNG)
    options: LocalOptions
    loss: LossFn  # [training] policy_loss, resolved once (a dotted path imported here)
    world: World = World()  # under torchrun: this rank (retrain/world.py)
    max_tokens: int = 0  # [training] max_tokens: what checkpointing = "auto" sizes for


# ---------------------------------------------------------------- remote backends


@dataclass(frozen=True)
class TinkerOptions(_BackendOptions):
    max_retries: int
    retry_backoff_s: float
    timeout_s: float
    keepalive_s: float

    BACKEND: ClassVar[str] = "tinker"


@dataclass(frozen=True)
class TinkerSettings:
    model: str
    base_url: str  # [model] base_url: "" = the SDK's default service
    lora_rank: int
    seed: int
    temperature: float  # [training] temperature (the service scores at 1: noted)
    throttle_dir: str  # [backend] throttle_dir: "" = the campaign's, or none
    max_concurrent: int
    options: TinkerOptions
    ignored: tuple[str, ...] = ()  # settings the backend ignores that the config sets


@dataclass(frozen=True)
class PrimeRLOptions(_BackendOptions):
    transport: str
    zmq_host: str
    zmq_port: int
    zmq_hwm: int
    sync_wait_s: int
    sync_poll_s: float
    timeout_s: float
    strict_advantages: bool

    BACKEND: ClassVar[str] = "prime_rl"


# prime-rl's trainer trains only the `run_*` directories directly under its output_dir.
RUN_DIR_PREFIX = "run_"


def prime_rl_run_dir_problem(output_dir: str) -> str | None:
    """Why prime-rl's trainer would never train from `output_dir` ([backend] adapter_path),
    or None (a rule of the settings, so config validation can say it before anything
    loads)."""
    name = os.path.basename(os.path.normpath(os.path.expanduser(str(output_dir))))
    if name.startswith(RUN_DIR_PREFIX):
        return None
    return (
        f"{str(output_dir)!r} is not a prime-rl run directory: the prime-rl trainer trains only "
        f"`{RUN_DIR_PREFIX}*` directories directly under its output_dir. Fix: adapter_path = "
        f'"<the trainer\'s output_dir>/{RUN_DIR_PREFIX}<name>" (one per retrain run)'
    )


@dataclass(frozen=True)
class PrimeRLSettings:
    model: str
    output_dir: str  # [backend] adapter_path: prime-rl's output directory of this run
    url: str  # [inference] url: prime-rl's inference server
    options: PrimeRLOptions
    ignored: tuple[str, ...] = ()
