"""One registry mechanism for every pluggable kind.

A name is either a short built-in name (looked up lazily as "module:attr", so listing
or validating names never imports torch) or a dotted path `pkg.mod.attr` (or
`pkg.mod:attr`) imported on demand, optionally from `[plugins] search_paths`.
"""

from __future__ import annotations

import difflib
import importlib
import os
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from retrain.errors import PluginError

_DOTTED = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*([.:][A-Za-z_][\w]*)$")


def is_dotted_path(name: str) -> bool:
    """True for `pkg.mod.attr` or `pkg.mod:attr` (at least one separator)."""
    return bool(_DOTTED.match(name)) and ("." in name or ":" in name)


def suggest(name: str, choices: Iterable[str]) -> str:
    """A ' (did you mean X?)' suffix, or '' when nothing is close."""
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def add_search_paths(search_paths: Iterable[str]) -> None:
    """Put `[plugins] search_paths` on sys.path, as absolute paths so a later chdir
    cannot repoint them, and drop import caches so plugin files written since start-up
    are found."""
    for p in search_paths:
        if not p:
            continue
        p = os.path.abspath(p)
        if p not in sys.path:
            sys.path.insert(0, p)
    importlib.invalidate_caches()


def import_object(path: str, search_paths: Iterable[str] = ()) -> Any:
    """Import `pkg.mod.attr` / `pkg.mod:attr`, adding search_paths to sys.path first."""
    add_search_paths(search_paths)
    if ":" in path:
        mod_name, attr = path.split(":", 1)
    else:
        mod_name, _, attr = path.rpartition(".")
    if not mod_name:
        raise PluginError(f"{path!r} is not a dotted path (expected pkg.module.attr)")
    try:
        module = importlib.import_module(mod_name)
    except ImportError as exc:
        raise PluginError(f"cannot import module {mod_name!r} for plugin {path!r}: {exc}") from exc
    obj = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise PluginError(
                f"module {mod_name!r} has no attribute {attr!r} (plugin {path!r})"
            ) from None
    return obj


@dataclass
class Registry:
    """Built-in names for one pluggable kind, plus dotted-path plugins."""

    kind: str
    builtins: dict[str, str] = field(default_factory=dict)  # name -> "module:attr"
    aliases: dict[str, str] = field(default_factory=dict)  # alias -> canonical name
    descriptions: dict[str, str] = field(default_factory=dict)
    allow_plugins: bool = True

    def names(self) -> list[str]:
        return list(self.builtins)

    def canonical(self, name: str) -> str:
        return self.aliases.get(name, name)

    def is_builtin(self, name: str) -> bool:
        return self.canonical(name) in self.builtins

    def check(self, name: str) -> str | None:
        """None when `name` is acceptable (built-in or, if allowed, a dotted path);
        otherwise a message listing the valid names. Never imports anything."""
        if self.is_builtin(name) or (self.allow_plugins and is_dotted_path(name)):
            return None
        valid = ", ".join(self.names())
        extra = " or a dotted path pkg.module.attr" if self.allow_plugins else ""
        return f"unknown {self.kind} {name!r}{suggest(name, [*self.builtins, *self.aliases])}; valid: {valid}{extra}"

    def resolve(self, name: str, search_paths: Iterable[str] = ()) -> Any:
        """The object behind `name`: a built-in, else an imported dotted path."""
        problem = self.check(name)
        if problem:
            raise PluginError(problem)
        canon = self.canonical(name)
        if canon in self.builtins:
            return import_object(self.builtins[canon])
        return import_object(name, search_paths)

    def register(self, name: str, target: str, description: str = "") -> None:
        self.builtins[name] = target
        if description:
            self.descriptions[name] = description


# Built-in names of every pluggable kind live here, so config validation, `explain`,
# and `retrain plugins` can list and check them without importing heavy modules.
ADVANTAGE_MODES = Registry(
    "advantage_mode",
    {"grpo": "retrain.advantages.episode:grpo", "maxrl": "retrain.advantages.episode:maxrl"},
    descriptions={
        "grpo": "A_i = r_i - mean(r)",
        "maxrl": "A_i = (r_i - mean(r)) / (mean(r) + eps): inverse success-rate reweighting",
    },
)
TRANSFORM_MODES = Registry(
    "transform_mode",
    {
        "none": "retrain.advantages.transforms:transform_none",
        "gtpo": "retrain.advantages.transforms:transform_gtpo",
        "gtpo_hicra": "retrain.advantages.transforms:transform_gtpo_hicra",
        "gtpo_sepa": "retrain.advantages.transforms:transform_gtpo_sepa",
    },
    descriptions={
        "none": "every token gets its completion's episode advantage",
        "gtpo": "entropy-weighted token credit (beta = [gtpo] beta)",
        "gtpo_hicra": "GTPO, then amplify planning tokens (alpha = [hicra] alpha)",
        "gtpo_sepa": "pool execution-token uncertainty (lambda from [sepa]), then GTPO",
    },
)
ALGORITHM_MODES = Registry(
    "algorithm_mode",
    {
        "maxrl_gtpo": "retrain.advantages.pipeline:algorithm_maxrl_gtpo",
        "maxrl_gtpo_hicra": "retrain.advantages.pipeline:algorithm_maxrl_gtpo_hicra",
        "maxrl_gtpo_sepa": "retrain.advantages.pipeline:algorithm_maxrl_gtpo_sepa",
    },
    descriptions={
        "maxrl_gtpo": "maxrl + gtpo as one named algorithm",
        "maxrl_gtpo_hicra": "maxrl + gtpo_hicra as one named algorithm",
        "maxrl_gtpo_sepa": "maxrl + gtpo_sepa as one named algorithm",
    },
)
UNCERTAINTY_KINDS = Registry(
    "uncertainty_kind",
    {
        "surprisal": "retrain.advantages.uncertainty:surprisal",
        "predictive_variance": "retrain.advantages.uncertainty:predictive_variance",
        "shannon_entropy": "retrain.advantages.uncertainty:shannon_entropy",
    },
    aliases={"pred_var": "predictive_variance", "bernoulli_variance": "predictive_variance"},
    descriptions={
        "surprisal": "-logprob of the sampled token, capped at 50",
        "predictive_variance": "p(1-p) of the sampled token",
        "shannon_entropy": "full-vocabulary entropy (local backend + pytorch engine only)",
    },
)
PLANNING_DETECTORS = Registry(
    "planning detector",
    {
        "regex": "retrain.advantages.planning:RegexPlanningDetector",
        "semantic": "retrain.advantages.planning:SemanticPlanningDetector",
    },
    descriptions={
        "regex": "word-bounded, case-insensitive match of strategic grams",
        "semantic": "sentence-transformer similarity to the strategic grams",
    },
)
REWARDS = Registry(
    "reward type",
    {
        "match": "retrain.rewards.match:MatchReward",
        "math": "retrain.rewards.math:MathReward",
        "judge": "retrain.rewards.judge:JudgeReward",
        "custom": "retrain.rewards.custom:CustomReward",
        "gym": "retrain.rewards.gym:GymReward",
    },
    descriptions={
        "match": "exact string match of the last \\boxed{} answer",
        "math": "symbolic equivalence with math-verify",
        "judge": "LLM judge over an OpenAI-compatible chat API",
        "custom": "your function: [reward] custom_module + custom_function",
        "gym": "reasoning-gym's own score_answer (partial credit)",
    },
    allow_plugins=False,
)
DATA_SOURCES = Registry(
    "data source",
    {
        "math": "retrain.data.math:MathSource",
        "reasoning_gym": "retrain.data.reasoning_gym:ReasoningGymSource",
        "jsonl": "retrain.data.jsonl:JsonlSource",
    },
    descriptions={
        "math": "hendrycks MATH (EleutherAI/hendrycks_math), five subjects",
        "reasoning_gym": "procedural reasoning-gym tasks ([data] task, [data.args])",
        "jsonl": "your JSONL file ([data] path, prompt_field, answer_field)",
    },
)
BACKENDS = Registry(
    "backend",
    {
        "local": "retrain.backends.local:LocalBackend",
        "tinker": "retrain.backends.tinker:TinkerBackend",
        "prime_rl": "retrain.backends.prime_rl:PrimeRLBackend",
    },
    descriptions={
        "local": "PyTorch + PEFT on this machine's CPU/GPUs",
        "tinker": "the Tinker remote training service",
        "prime_rl": "an external PRIME-RL trainer + inference (experimental)",
    },
)
ENGINES = Registry(
    "inference engine",
    {
        "pytorch": "retrain.engines.pytorch:PyTorchEngine",
        "max": "retrain.engines.http:MaxEngine",
        "vllm": "retrain.engines.http:VLLMEngine",
        "sglang": "retrain.engines.http:SGLangEngine",
        "trtllm": "retrain.engines.http:TRTLLMEngine",
        "mlx": "retrain.engines.http:MLXEngine",
        "openai": "retrain.engines.http:OpenAIEngine",
    },
    descriptions={
        "pytorch": "shares the training model in-process (default)",
        "max": "Modular MAX server over HTTP; not available in this build (use pytorch)",
        "vllm": "vLLM server over HTTP (LoRA hot-load); not available in this build (use pytorch)",
        "sglang": "SGLang server over HTTP (LoRA hot-load); not available in this build (use pytorch)",
        "trtllm": "TensorRT-LLM server over HTTP; not available in this build (use pytorch)",
        "mlx": "MLX-LM server over HTTP; not available in this build (use pytorch)",
        "openai": "any OpenAI-compatible /v1/completions server; not available in this build (use pytorch)",
    },
)

ALL_REGISTRIES: dict[str, Registry] = {
    "advantage_mode": ADVANTAGE_MODES,
    "transform_mode": TRANSFORM_MODES,
    "algorithm_mode": ALGORITHM_MODES,
    "uncertainty_kind": UNCERTAINTY_KINDS,
    "planning_detector": PLANNING_DETECTORS,
    "reward": REWARDS,
    "data_source": DATA_SOURCES,
    "backend": BACKENDS,
    "engine": ENGINES,
}
