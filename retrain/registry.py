"""One registry mechanism for every pluggable kind.

A name is either a short built-in name (looked up lazily as "module:attr", so listing
or validating names never imports torch) or a dotted path `pkg.mod.attr` (or
`pkg.mod:attr`) imported on demand, optionally from `[plugins] search_paths`.

Plugins may be written in another calling convention than their kind's (the original
retrain's spec records, factories and context forms): a registry's adapters
(:meth:`Registry.add_adapter`) turn such objects into its kind's convention when a
plugin is resolved (:meth:`Registry.resolve_plugin`). retrain.compat installs them; this
module knows none.
"""

from __future__ import annotations

import difflib
import importlib
import os
import re
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from retrain.errors import PluginError
from retrain.hardware import MATMUL_DTYPES
from retrain.types import LOSS_OPTIONS, BackendCapabilities, EngineTraits, OptionSpec

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


def add_working_directory() -> bool:
    """Make modules of the working directory importable (as ``python -m`` would), so a
    dotted path like ``plugins.my_transform.fn`` resolves from where retrain runs even
    when it was started through the ``retrain`` script. Appended, not prepended: an
    installed package of the same name still wins. True when sys.path changed."""
    cwd = os.getcwd()
    if "" in sys.path or cwd in sys.path:
        return False
    sys.path.append(cwd)
    importlib.invalidate_caches()
    return True


def import_module(name: str) -> Any:
    """importlib.import_module, retried once from the working directory when the module
    is not found on sys.path (the working directory is added only then)."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError:
        if not add_working_directory():
            raise
    return importlib.import_module(name)


def import_object(path: str, search_paths: Iterable[str] = ()) -> Any:
    """Import `pkg.mod.attr` / `pkg.mod:attr`, adding search_paths to sys.path first
    (and the working directory, last, when the module is not found otherwise)."""
    add_search_paths(search_paths)
    if ":" in path:
        mod_name, attr = path.split(":", 1)
    else:
        mod_name, _, attr = path.rpartition(".")
    if not mod_name:
        raise PluginError(f"{path!r} is not a dotted path (expected pkg.module.attr)")
    try:
        module = import_module(mod_name)
    except ImportError as exc:
        raise PluginError(f"cannot import module {mod_name!r} for plugin {path!r}: {exc}") from exc
    except Exception as exc:  # the plugin's own code failed as it ran: its error, not a bug here
        raise PluginError(
            f"importing module {mod_name!r} for plugin {path!r} raised {type(exc).__name__}: {exc}"
        ) from exc
    obj = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise PluginError(
                f"module {mod_name!r} has no attribute {attr!r} (plugin {path!r})"
            ) from None
    return obj


@dataclass(frozen=True)
class Entry:
    """The one definition record of a registry entry. Everything the config, the CLI and
    the trainer need to know about a built-in name lives here; nothing is kept in side
    tables or as attributes on the target.

    `target` is "module:attr", imported only on resolve. An entry with `not_built` set is
    listed (so its name gets a precise error) but cannot be used: config validation reports
    it at load, before any model is loaded."""

    name: str
    target: str = ""
    description: str = ""
    aliases: tuple[str, ...] = ()
    not_built: str = ""  # set when this name is not usable in this build: the fix to offer
    requires: tuple[str, ...] = ()  # Python modules needed at run time (doctor, backends)
    install: str = ""  # how to get `requires`
    # backends and engines
    capabilities: BackendCapabilities | None = None
    options: Mapping[str, OptionSpec] = field(default_factory=dict)
    ignores: tuple[str, ...] = ()  # config keys/sections this entry does not use
    # "module:attr" of a probe that explain and doctor run before any model load (servers
    # reachable, directories writable, ...), given the component's settings record
    # (retrain/settings.py; build.py makes it): [(key, problem with a fix)]
    probe: str = ""
    # engines: what the engine is (in-process or a server, what it returns and applies)
    engine_traits: EngineTraits | None = None
    # advantage pipeline
    alias_of: tuple[str, str] | None = None  # algorithm mode = (advantage_mode, transform_mode)
    kernel: str = ""  # transform mode: name of its vectorised kernel in advantages.transforms
    grouped: str = ""  # advantage mode: "module:attr" of its form over many groups at once
    # advantage mode: its functions also take `lengths=` (each completion's trained tokens)
    reads_lengths: bool = False
    token_varying: bool = False  # transform mode: tokens of one completion can differ
    # added at run time (`Registry.add`) for a plugin object: resolved like a dotted path,
    # through the kind's adapters, rather than trusted as a built-in in its kind's form
    plugin: bool = False

    @property
    def available(self) -> bool:
        return not self.not_built


# (name, the object a plugin name points at, its run-time entry or None for a dotted
# path) -> that object in the kind's calling convention, or None when it is not a form
# this adapter knows (the next adapter, then the kind's own convention, applies).
PluginAdapter = Callable[[str, Any, "Entry | None"], Any]


@dataclass
class Registry:
    """The built-in entries of one pluggable kind, plus dotted-path plugins."""

    kind: str
    entries: tuple[Entry, ...] = ()
    allow_plugins: bool = True
    key: str = ""  # the config key that names this kind, for messages
    adapters: list[PluginAdapter] = field(default_factory=list)  # see add_adapter

    def __post_init__(self):
        self._by_name = {e.name: e for e in self.entries}
        self._aliases = {a: e.name for e in self.entries for a in e.aliases}

    def add(self, entry: Entry, *, replace: bool = False) -> None:
        """Register `entry` at run time (e.g. ``register_transform_mode``), so that
        validation, ``explain`` and ``plugins`` see it like a shipped one. A name or alias
        already taken raises ValueError unless `replace`, which first drops the entry of
        that name and any alias the new entry claims."""
        if not entry.name or is_dotted_path(entry.name):
            raise ValueError(f"{self.kind} name {entry.name!r} must be a non-empty short name")
        claimed = (entry.name, *entry.aliases)
        taken = [n for n in claimed if n in self._by_name or n in self._aliases]
        if taken and not replace:
            raise ValueError(f"{self.kind} {taken[0]!r} is already registered")
        if entry.name in self._by_name:
            self.remove(entry.name)
        for name in claimed:
            self._aliases.pop(name, None)
        self.entries = (*self.entries, entry)
        self._by_name[entry.name] = entry
        self._aliases.update({a: entry.name for a in entry.aliases})

    def remove(self, name: str) -> Entry | None:
        """Drop the entry called `name` (and its aliases); returns it, or None."""
        entry = self._by_name.pop(name, None)
        if entry is not None:
            self.entries = tuple(e for e in self.entries if e is not entry)
            for alias in entry.aliases:
                if self._aliases.get(alias) == name:
                    del self._aliases[alias]
        return entry

    def names(self, *, available_only: bool = False) -> list[str]:
        return [e.name for e in self.entries if e.available or not available_only]

    def canonical(self, name: str) -> str:
        return self._aliases.get(name, name)

    def entry(self, name: str) -> Entry | None:
        """The built-in entry behind `name` (or an alias of it), else None."""
        return self._by_name.get(self.canonical(name))

    def is_builtin(self, name: str) -> bool:
        return self.entry(name) is not None

    def check(self, name: str) -> str | None:
        """None when `name` can be used (a built-in of this build or, if allowed, a dotted
        path); otherwise what is wrong and the valid names. Never imports anything."""
        entry = self.entry(name)
        if entry is not None:
            if entry.available:
                return None
            return f"{self.kind} {name!r} is not built in this version of retrain. Fix: {entry.not_built}"
        if self.allow_plugins and is_dotted_path(name):
            return None
        valid = ", ".join(self.names(available_only=True))
        extra = " or a dotted path pkg.module.attr" if self.allow_plugins else ""
        return f"unknown {self.kind} {name!r}{suggest(name, [*self._by_name, *self._aliases])}; valid: {valid}{extra}"

    def resolve(self, name: str, search_paths: Iterable[str] = ()) -> Any:
        """The object behind `name`: a built-in, else an imported dotted path."""
        problem = self.check(name)
        if problem:
            raise PluginError(problem)
        entry = self.entry(name)
        if entry is not None:
            return import_object(entry.target)
        return import_object(name, search_paths)

    def add_adapter(self, adapter: PluginAdapter) -> None:
        """Let `adapter` turn plugin objects of another convention into this kind's (see
        :data:`PluginAdapter`). Adapters are tried in the order added; adding one twice
        keeps one, so an installer may run again."""
        if adapter not in self.adapters:
            self.adapters.append(adapter)

    def is_plugin(self, name: str) -> bool:
        """True when `name` resolves as a plugin: not a built-in entry (a dotted path, or
        an unknown name that :meth:`resolve` rejects), or an entry added for a plugin."""
        entry = self.entry(name)
        return entry is None or entry.plugin

    def resolve_plugin(self, name: str, search_paths: Iterable[str] = ()) -> Any:
        """The object behind plugin `name` (:meth:`resolve`), passed through this kind's
        adapters: the first that knows its form gives the result, else the object as is
        (the caller then holds it to the kind's own calling convention)."""
        obj = self.resolve(name, search_paths)
        entry = self.entry(name)
        for adapter in self.adapters:
            adapted = adapter(name, obj, entry)
            if adapted is not None:
                return adapted
        return obj


# Built-in entries of every pluggable kind live here, so config validation, `explain`,
# `backends` and `plugins` can list and check them without importing heavy modules.


def _positive(value: Any) -> str | None:
    return None if value > 0 else f"must be > 0, got {value!r}"


def _one_of(*choices: str) -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        return None if value in choices else f"must be one of {', '.join(choices)}; got {value!r}"

    return check


ADVANTAGE_MODES = Registry(
    "advantage_mode",
    (
        Entry(
            "grpo",
            "retrain.advantages.episode:grpo",
            "A_i = r_i - mean(r): no std scale (Dr. GRPO's form, Liu et al. 2025)",
            grouped="retrain.advantages.episode:grpo_grouped",
        ),
        Entry(
            "grpo_std",
            "retrain.advantages.episode:grpo_std",
            "A_i = (r_i - mean(r)) / (std(r) + eps): GRPO with the group's sample std "
            "(Shao et al. 2024; eps = advantage_params eps, default 1e-6)",
            grouped="retrain.advantages.episode:grpo_std_grouped",
        ),
        Entry(
            "maxrl",
            "retrain.advantages.episode:maxrl",
            "A_i = (r_i - mean(r)) / (mean(r) + eps): inverse success-rate reweighting",
            grouped="retrain.advantages.episode:maxrl_grouped",
        ),
        Entry(
            "rloo",
            "retrain.advantages.episode:rloo",
            "A_i = r_i - mean of the group's other rewards = G/(G-1) (r_i - mean(r)) "
            "(Kool et al. 2019, Ahmadian et al. 2024)",
            grouped="retrain.advantages.episode:rloo_grouped",
        ),
        Entry(
            "reinforce_pp",
            "retrain.advantages.episode:reinforce_pp",
            "REINFORCE++ (Hu et al. 2025): rewards normalised with the mean and std of every "
            "completion of the step's kept groups (eps = advantage_params eps, default 1e-8)",
            aliases=("reinforce_plus_plus",),
            grouped="retrain.advantages.episode:reinforce_pp_grouped",
        ),
        Entry(
            "reinforce_pp_baseline",
            "retrain.advantages.episode:reinforce_pp_baseline",
            "REINFORCE++-baseline (Hu et al. 2025): r_i - mean(r) of its group, then normalised "
            "with the mean and std of every completion of the step's kept groups",
            aliases=("reinforce_plus_plus_baseline",),
            grouped="retrain.advantages.episode:reinforce_pp_baseline_grouped",
        ),
        Entry(
            "opo",
            "retrain.advantages.episode:opo",
            "A_i = r_i - sum_j l_j r_j / sum_j l_j: OPO's optimal baseline, the group's mean "
            "reward weighted by the completions' lengths l_j (Hao et al. 2025)",
            grouped="retrain.advantages.episode:opo_grouped",
            reads_lengths=True,
        ),
    ),
    key="[algorithm] advantage_mode",
)
TRANSFORM_MODES = Registry(
    "transform_mode",
    (
        Entry(
            "none",
            "retrain.advantages.transforms:transform_none",
            "every token gets its completion's episode advantage",
            kernel="none",
        ),
        Entry(
            "gtpo",
            "retrain.advantages.transforms:transform_gtpo",
            "entropy-weighted token credit (beta = [gtpo] beta)",
            kernel="gtpo",
            token_varying=True,
        ),
        Entry(
            "gtpo_hicra",
            "retrain.advantages.transforms:transform_gtpo_hicra",
            "GTPO, then amplify planning tokens (alpha = [hicra] alpha)",
            kernel="gtpo_hicra",
            token_varying=True,
        ),
        Entry(
            "gtpo_sepa",
            "retrain.advantages.transforms:transform_gtpo_sepa",
            "pool execution-token uncertainty (lambda from [sepa]), then GTPO",
            kernel="gtpo_sepa",
            token_varying=True,
        ),
        Entry(
            "gtpo_sepa_amp",
            "retrain.advantages.transforms:transform_gtpo_sepa_amp",
            "amplify execution-token uncertainty away from its mean (lambda from [sepa]), then GTPO",
            kernel="gtpo_sepa_amp",
            token_varying=True,
        ),
        Entry(
            "gtpo_sepa_amp_c",
            "retrain.advantages.transforms:transform_gtpo_sepa_amp_c",
            "gtpo_sepa_amp with the amplified uncertainty floored at 0",
            kernel="gtpo_sepa_amp_c",
            token_varying=True,
        ),
        Entry(
            "entropy_mask",
            "retrain.advantages.transforms:transform_entropy_mask",
            "GTPO, then zero all but the top-rho most uncertain tokens of each group "
            "(rho = [algorithm] surprisal_mask_rho; 0 = plain GTPO)",
            kernel="entropy_mask",
            token_varying=True,
        ),
    ),
    key="[algorithm] transform_mode",
)
# Built-in algorithm modes are plain aliases of (advantage_mode, transform_mode) pairs.
ALGORITHM_MODES = Registry(
    "algorithm_mode",
    tuple(
        Entry(
            f"{adv}_{tx}",
            description=f"{adv} + {tx} as one named algorithm",
            alias_of=(adv, tx),
        )
        for adv, tx in (
            ("maxrl", "gtpo"),
            ("maxrl", "gtpo_hicra"),
            ("maxrl", "gtpo_sepa"),
            ("grpo", "none"),
            ("maxrl", "none"),
            ("grpo_std", "none"),
            ("rloo", "none"),
            ("reinforce_pp", "none"),
            ("reinforce_pp_baseline", "none"),
            ("opo", "none"),
        )
    ),
    key="[algorithm] algorithm_mode",
)
UNCERTAINTY_KINDS = Registry(
    "uncertainty_kind",
    (
        Entry(
            "surprisal",
            "retrain.advantages.uncertainty:surprisal",
            "-logprob of the sampled token, capped at 50",
            aliases=("token_surprisal", "neg_logprob", "negative_logprob", "nll"),
        ),
        Entry(
            "predictive_variance",
            "retrain.advantages.uncertainty:predictive_variance",
            "p(1-p) of the sampled token",
            aliases=("pred_var", "bernoulli_variance"),
        ),
        Entry(
            "shannon_entropy",
            "retrain.advantages.uncertainty:shannon_entropy",
            "full-vocabulary entropy (needs a backend whose capabilities include token_data 'entropy')",
            aliases=("shannon", "entropy", "token_entropy"),
        ),
    ),
    key="[algorithm] uncertainty_kind",
)
PLANNING_DETECTORS = Registry(
    "planning detector",
    (
        Entry(
            "regex",
            "retrain.advantages.planning:RegexPlanningDetector",
            "word-bounded, case-insensitive match of strategic grams",
        ),
        Entry(
            "semantic",
            "retrain.advantages.planning:SemanticPlanningDetector",
            "sentence-transformer similarity to the strategic grams",
            requires=("sentence_transformers",),
            install="pip install 'retrain[semantic]'",
        ),
    ),
    key="[planning] detector",
)
REWARDS = Registry(
    "reward type",
    (
        Entry(
            "match",
            "retrain.rewards.match:MatchReward",
            "exact string match of the last \\boxed{} answer",
        ),
        Entry(
            "math",
            "retrain.rewards.math:MathReward",
            "symbolic equivalence with math-verify",
            requires=("math_verify",),
            install="pip install 'retrain[math]'",
        ),
        Entry(
            "judge",
            "retrain.rewards.judge:JudgeReward",
            "LLM judge over an OpenAI-compatible chat API",
            requires=("httpx",),
            install="pip install 'retrain[judge]'",
        ),
        Entry(
            "custom",
            "retrain.rewards.custom:CustomReward",
            "your function: [reward] custom_module + custom_function",
        ),
        Entry(
            "gym",
            "retrain.rewards.gym:GymReward",
            "reasoning-gym's own score_answer (partial credit)",
            requires=("reasoning_gym",),
            install="pip install 'retrain[gym]'",
        ),
    ),
    allow_plugins=False,
    key="[reward] type",
)
DATA_SOURCES = Registry(
    "data source",
    (
        Entry(
            "math",
            "retrain.data.math:MathSource",
            "hendrycks MATH (EleutherAI/hendrycks_math), five subjects",
        ),
        Entry(
            "reasoning_gym",
            "retrain.data.reasoning_gym:ReasoningGymSource",
            "procedural reasoning-gym tasks ([data] task, [data.args])",
            requires=("reasoning_gym",),
            install="pip install 'retrain[gym]'",
        ),
        Entry(
            "jsonl",
            "retrain.data.jsonl:JsonlSource",
            "your JSONL file ([data] path, prompt_field, answer_field)",
        ),
    ),
    key="[data] source",
)
BACKENDS = Registry(
    "backend",
    (
        Entry(
            "local",
            "retrain.backends.local:LocalBackend",
            "PyTorch + PEFT on this machine's CPU/GPUs",
            requires=("torch", "transformers", "peft"),
            install="pip install 'retrain[local]'  (torch, transformers, peft, safetensors, gguf)",
            ignores=("[model] base_url",),  # the tinker backend's service address
            capabilities=BackendCapabilities(
                reports_sync_loss=True,
                preserves_token_advantages=True,
                supports_checkpoint_resume=True,
                token_data=("entropy",),
                loss_options=LOSS_OPTIONS,  # all of them, a dotted-path policy_loss included
                multi_process=True,
            ),
            options={
                "micro_batch_tokens": OptionSpec(
                    "int/auto",
                    "auto",
                    "Positions per packed forward/backward micro-batch (rows x longest row; a row "
                    "is a prompt, then its completions); bounds training memory. auto = 512 on "
                    "a CPU; on a GPU the largest multiple of 256 whose estimated peak fits 90% "
                    "of its free memory, at most 8192 (past a few thousand positions a larger "
                    "one trains no faster, only holds more memory) or, when longer, a ~256-token "
                    "prompt and a completion of max_tokens (chosen at start, shown in the ready "
                    "line and the micro_batch_tokens metric)",
                    validator=_positive,
                ),
                "threads": OptionSpec(
                    "int", 0, "torch CPU threads. 0 = chosen from the free cores before each phase"
                ),
                "overlap": OptionSpec(
                    "bool",
                    False,
                    "Train one step behind sampling: step n trains in the background while "
                    "step n+1 samples from the weights one optimizer step old (the importance "
                    "ratio corrects it; metrics: off_policy_steps). Needs a sampler that does "
                    "not share the trained weights: [backend] devices with two entries, or a "
                    "server [inference] engine",
                ),
                "prompt_batch": OptionSpec(
                    "int",
                    0,
                    "Prompts decoded together. 0 = a bounded number of completions at once "
                    "(whole prompts, or a larger group in parts), so sampling memory does not "
                    "grow with the group: at most 64 on a CPU; on a GPU as many as fit 90% of "
                    "its free memory when it samples",
                ),
                "dtype": OptionSpec(
                    "str",
                    "auto",
                    "Base weights' dtype: auto (bf16 on a GPU of compute capability 8.0+ or a "
                    "CPU with AVX512-BF16/AMX, else fp32), fp32 or bf16. bf16 on a GPU: the whole model (weights and "
                    "activations); on a CPU: the blocks' matmuls, float32 residual stream. "
                    "The adapter's weights and the logits stay float32 (on a GPU the adapter computes in bf16 and its output joins the layer's in float32, rounded once). "
                    "bf16 on a GPU below 8.0 (V100, T4) refuses attention = flex and decode = compiled "
                    "(triton has no bf16 there) and trains through the dense mask",
                    validator=_one_of(*MATMUL_DTYPES),
                ),
                "decode": OptionSpec(
                    "str",
                    "auto",
                    "How the pytorch engine decodes: auto (graphs on CUDA, static there with "
                    "shard = true, dynamic elsewhere), "
                    "dynamic (the cache grows, finished rows leave the batch), static (a "
                    "preallocated cache and one fixed-shape step), graphs (static, the step "
                    "captured as a CUDA graph; CUDA only) or compiled (static, the step "
                    "compiled by torch.compile into fewer fused kernels, and on CUDA captured "
                    "as a graph; compiles at the first sampling, once more at a new shape, and "
                    "once per sampling setting (training's and greedy eval's); "
                    "needs triton on CUDA, a C++ compiler on a CPU). With shard = true on CUDA, "
                    "graphs and compiled are refused: the gathered blocks move every step",
                    validator=_one_of("auto", "dynamic", "static", "graphs", "compiled"),
                ),
                "checkpointing": OptionSpec(
                    "bool/auto",
                    "auto",
                    "Activation checkpointing: keep each transformer block's input only and "
                    "recompute the block in the backward pass (~30% more training compute for "
                    "much less activation memory: long completions, large micro-batches). "
                    "auto: on a GPU, on when a completion of max_tokens (and a ~256-token "
                    "prompt) would not fit the largest micro-batch without it (a completion is "
                    "trained whole), or from the first completion that runs out of memory; off "
                    "on a CPU",
                ),
                "attention": OptionSpec(
                    "str",
                    "auto",
                    "How packed training rows attend (a prompt, then its completions): dense "
                    "(an L x L mask per row through the model's SDPA or eager attention; on "
                    "CUDA SDPA's memory-efficient kernel, not cuDNN's, whose masked backward "
                    "has given NaN gradients), "
                    "flex (FlexAttention, compiled, skipping the wholly masked blocks: about "
                    "the sum of the segments' squares instead of the row's square; CUDA only, "
                    "torch has no FlexAttention backward on a CPU) or auto (flex on CUDA for "
                    "micro-batches whose longest row reaches 2048 positions, where that saving "
                    "outweighs a compile; dense otherwise, and always for a model whose "
                    "soft-capped logits, attention sinks or attention dropout FlexAttention "
                    "does not apply here, with bf16 on a GPU without native bf16, or without "
                    "triton, which compiles FlexAttention; where FlexAttention's kernels do "
                    "not build on the GPU (a consumer card's shared memory), auto says so and "
                    "takes dense from then on, flex stops the run), or varlen (flash "
                    "attention's variable-length kernel: each completion over "
                    "its prompt and itself, no mask and no compile; CUDA only, bf16, "
                    "checked against the rule on the device at the run's start). All apply "
                    "a model's sliding windows",
                    validator=_one_of("auto", "dense", "flex", "varlen"),
                ),
                "compile": OptionSpec(
                    "bool",
                    False,
                    "Compile each transformer block of the trained model with torch.compile "
                    "(inductor) for training: rotary, residual adds, the gated activation and "
                    "casts fused into few kernels around the matmuls, far fewer operators "
                    "launched a step. One graph serves every block, compiled at the first "
                    "training step (dynamic shapes). Sibling LoRA linears then run one by one "
                    "and the compiler chooses what the backward recomputes. CUDA only, needs "
                    "triton; not with shard = true or attention = varlen",
                ),
                "collective_timeout_s": OptionSpec(
                    "int",
                    600,
                    "Under torchrun (world size > 1): seconds a rank waits in a collective "
                    "for the others before the run stops with an error naming the rank that "
                    "did not answer (docs/distributed.md)",
                    validator=_positive,
                ),
                "shard": OptionSpec(
                    "bool",
                    False,
                    "Under torchrun (world size > 1): shard the frozen base model's "
                    "transformer blocks over the ranks with FSDP2 "
                    "(torch.distributed.fsdp.fully_shard) while training; the LoRA adapter "
                    "stays whole on every rank and sampling gathers the blocks whole "
                    "(docs/distributed.md)",
                ),
            },
        ),
        Entry(
            "tinker",
            "retrain.backends.tinker:TinkerBackend",
            "the Tinker remote training service",
            requires=("tinker",),
            install="pip install 'retrain[tinker]'  (the tinker SDK)",
            capabilities=BackendCapabilities(
                reports_sync_loss=True,
                preserves_token_advantages=True,
                supports_checkpoint_resume=True,
                resume_runtime_dependent=True,
                # The service's "ppo" and "cispo" losses are token-wise, with thresholds
                # (1 - clip_eps, 1 + clip_eps_high); aggregations and advantage clipping
                # are exact rescalings of the advantages sent (both losses are linear in A
                # per token). No dual clip, no KL, no off-policy correction, no sequence
                # ratios, nothing that needs the step's logprobs before the loss.
                loss_options=(
                    "ppo_clip",
                    "cispo",
                    "adv_clip",
                    "seq_mean_token_sum",
                    "seq_mean_token_mean",
                    "seq_mean_token_sum_norm",
                    "bnpo",
                ),
            ),
            options={
                "max_retries": OptionSpec(
                    "int", 5, "Attempts per Tinker call before giving up", validator=_positive
                ),
                "retry_backoff_s": OptionSpec(
                    "float", 2.0, "First retry delay; doubles per attempt", validator=_positive
                ),
                "timeout_s": OptionSpec(
                    "float", 600.0, "Seconds to wait for one Tinker call", validator=_positive
                ),
                "keepalive_s": OptionSpec(
                    "float",
                    60.0,
                    "Heartbeat period that keeps the session alive during local work. 0 = off",
                ),
            },
            ignores=(
                "[inference]",
                "[backend] devices",
                "[backend] adapter_path",
                "[lora] alpha/dropout/target_modules",
            ),
        ),
        Entry(
            "prime_rl",
            "retrain.backends.prime_rl:PrimeRLBackend",
            "an external PRIME-RL trainer + inference server; retrain orchestrates the run "
            "in adapter_path, a run_* directory under the trainer's output_dir (prime-rl "
            "formats of commit 9104df43c627). Tested here against the test receiver in "
            "scripts/prime_rl_receiver and prime-rl's own config and batch classes, not "
            "against a running prime-rl (docs/prime_rl.md)",
            requires=("msgspec", "zmq", "httpx"),
            install="pip install 'retrain[prime_rl]'  (msgspec, pyzmq, httpx; prime-rl itself "
            "runs separately, installed from source)",
            capabilities=BackendCapabilities(
                reports_sync_loss=False,
                preserves_token_advantages=False,
                supports_checkpoint_resume=True,
            ),
            options={
                "transport": OptionSpec(
                    "str",
                    "filesystem",
                    "How batches reach the prime-rl trainer: files under adapter_path/rollouts, or ZMQ",
                    choices=("filesystem", "zmq"),
                ),
                "zmq_host": OptionSpec("str", "localhost", "Host of the trainer's ZMQ receiver"),
                "zmq_port": OptionSpec(
                    "int", 5555, "Port of the trainer's ZMQ receiver", validator=_positive
                ),
                "zmq_hwm": OptionSpec(
                    "int", 10, "ZMQ high-water mark (batches queued)", validator=_positive
                ),
                "sync_wait_s": OptionSpec(
                    "int",
                    30,
                    "Seconds to wait for the trainer's next weight broadcast (STABLE) before sampling",
                    validator=lambda v: None if v >= 0 else f"sync_wait_s must be >= 0, got {v!r}",
                ),
                "sync_poll_s": OptionSpec(
                    "float", 0.2, "Poll period for broadcast STABLE markers", validator=_positive
                ),
                "timeout_s": OptionSpec(
                    "float", 600.0, "Seconds for one inference request", validator=_positive
                ),
                "strict_advantages": OptionSpec(
                    "bool",
                    True,
                    "Refuse completions whose token advantages vary (prime-rl takes one per completion)",
                    validator=lambda v: (
                        None
                        if v
                        else "strict_advantages = false is not supported: prime-rl takes one "
                        "advantage per completion, so token advantages would be aggregated silently"
                    ),
                ),
            },
            ignores=(
                "[inference] engine",
                "[inference] attention_kernel/dtype/kv_cache_dtype/prefix_caching",
                "[backend] devices",
                "[training] lr/weight_decay",
                "[optimizer]",
                "[lora]",
                "[model] base_url",
            ),
            probe="retrain.backends.prime_rl:probe",
        ),
    ),
    key="[backend] backend",
)
ENGINES = Registry(
    "inference engine",
    (
        Entry(
            "pytorch",
            "retrain.engines.pytorch:build",
            "shares the training model in-process (default)",
            requires=("torch", "transformers"),
            install="pip install 'retrain[local]'",
            engine_traits=EngineTraits(
                in_process=True, token_data=("entropy",), dtypes=("auto", "bf16")
            ),
        ),
        # Server engines (retrain/engines/http.py, one Dialect record each in
        # retrain/engines/dialects.py): sampling over HTTP, training in-process, the adapter
        # pushed to the server after every optimizer step. Logprobs only (no entropies).
        # `retrain backends` says which were run against a real server.
        *(
            Entry(
                name,
                "retrain.engines.http:build",
                desc,
                requires=("httpx",),
                install="pip install 'retrain[judge]'  (httpx); the server runs separately",
                probe="retrain.engines.probe:probe",
                engine_traits=EngineTraits(needs_url=name == "openai"),
            )
            for name, desc in (
                ("max", "Modular MAX max serve (LoRA on GPUs only)"),
                ("vllm", "vLLM server (LoRA hot-load)"),
                ("sglang", "SGLang server (LoRA unload + load)"),
                ("trtllm", "TensorRT-LLM trtllm-serve (LoRA per request)"),
                ("mlx", "MLX-LM mlx_lm.server (adapter per request)"),
                ("openai", "any OpenAI-compatible /v1/completions server (best effort)"),
            )
        ),
    ),
    # Entry targets are factories `build(settings: EngineSettings, *, tokenizer, say)`
    # (retrain/engines/base.py); build.py calls them and hands the engine to the backend.
    allow_plugins=False,
    key="[inference] engine",
)

# Policy losses (retrain/loss/objectives.py): fn(inputs: LossInputs, hyper: TrainHyper)
# -> TokenLoss, resolved once per run by retrain.loss.resolve_objective. Any name other
# than "is" is a loss option a backend must list (a built-in under its own name, a
# dotted path as types.USER_OBJECTIVE).
OBJECTIVES = Registry(
    "policy_loss",
    (
        Entry(
            "is",
            "retrain.loss.objectives:importance_sampling",
            "-A r: the importance-sampling policy gradient (default)",
        ),
        Entry(
            "ppo_clip",
            "retrain.loss.objectives:ppo_clip",
            "-min(A r, A clip(r, 1 - clip_eps, 1 + clip_eps_high)); dual clip with clip_ratio_c",
        ),
        Entry(
            "gspo",
            "retrain.loss.objectives:gspo",
            "GSPO (Zheng et al. 2025): ppo_clip on the length-normalised sequence ratio s_i",
        ),
        Entry(
            "cispo",
            "retrain.loss.objectives:cispo",
            "CISPO (MiniMax-M1 2025): -sg(clip(r, 1 - clip_eps, 1 + clip_eps_high)) A logp",
        ),
        Entry(
            "sapo",
            "retrain.loss.objectives:sapo",
            "SAPO (Gao et al. 2025): -sigmoid(tau (r - 1)) 4/tau A, tau by the sign of A",
        ),
        Entry(
            "vespo",
            "retrain.loss.objectives:vespo",
            "VESPO: -sg(w^k exp(lambda (1 - w))) A logp, w the sequence's product ratio",
        ),
        Entry(
            "clip_cov",
            "retrain.loss.objectives:clip_cov",
            "Clip-Cov (Cui et al. 2025): ppo_clip with a few high-covariance tokens cut out",
        ),
        Entry(
            "kl_cov",
            "retrain.loss.objectives:kl_cov",
            "KL-Cov (Cui et al. 2025): -A r, plus |log r| on the highest-covariance tokens",
        ),
        Entry(
            "gpg",
            "retrain.loss.objectives:gpg",
            "GPG (Chu et al. 2025): -A logp, the plain policy gradient (no ratio, no clip)",
        ),
        Entry(
            "gmpo",
            "retrain.loss.objectives:gmpo",
            "GMPO (Zhao et al. 2025; verl's geo_mean): -A_i x the geometric mean of the "
            "completion's ratios, each clipped in log space",
        ),
        Entry(
            "dppo",
            "retrain.loss.objectives:dppo",
            "DPPO-Binary-TV (prime-rl's default loss): -A r, dropped where p - p_sampler leaves "
            "the trust region; + dppo_kl_coef (log r)^2",
        ),
    ),
    key="[training] policy_loss",
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
    "policy_loss": OBJECTIVES,
}
