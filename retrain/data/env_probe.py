"""What `retrain explain` and `retrain doctor` learn about an `[environment]` before any
model loads: they import and instantiate it (the data source the run would build, so an
environment that fails to load fails here first), under a timeout, and report its API
generation, its task count, whether it opens the conversation, whether it talks back,
and whether it needs tool calls."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from retrain.errors import DataError, RetrainError
from retrain.threads import Overran, call_within

if TYPE_CHECKING:
    from retrain.config import Config

PROBE_TIMEOUT_S = 120.0  # loading a taskset may download or build data; a hang must not


@dataclass(frozen=True)
class EnvironmentReport:
    api: str  # classic | v1 | openenv-server | openenv-in-process
    tasks: int
    opens: bool  # the environment speaks first (no prompt of its own)
    multi_turn: bool
    needs_tools: bool
    max_turns: int = 0  # a multi-turn one's cap on model turns per conversation
    # the model's tool-call format (retrain/tool_calls.py) when the tokenizer was at hand
    tool_format: str = ""

    def summary(self) -> str:
        tools = "no tools"
        if self.needs_tools:
            tools = "needs tools (" + (
                f"the model writes {self.tool_format} tool calls)"
                if self.tool_format
                else "the model's tool-call format is checked at the run's start)"
            )
        return (
            f"{self.api} API, {self.tasks} tasks, "
            f"{'opens the conversation' if self.opens else 'the task prompt opens'}, "
            f"{f'multi-turn (at most {self.max_turns} model turns)' if self.multi_turn else 'single-turn'}, "
            f"{tools}"
        )


def describe(source: Any) -> EnvironmentReport:
    examples = list(getattr(source, "examples", []))
    opens = bool(getattr(source, "opens", False)) or any(
        not e.prompt and not (e.meta or {}).get("messages") for e in examples
    )
    turns = getattr(source, "turn_environment", None)
    return EnvironmentReport(
        api=str(getattr(source, "api", "?")),
        tasks=len(source),
        opens=opens,
        multi_turn=turns is not None,
        needs_tools=bool(getattr(source, "needs_tools", False)),
        max_turns=int(getattr(turns, "max_turns", 0) or 0),
    )


def probe_environment(config: Config, timeout_s: float = PROBE_TIMEOUT_S) -> EnvironmentReport:
    """Build the run's environment data source in a thread (a hang is reported, not
    waited on forever), describe it and close it. DataError when it fails to load."""
    from retrain.data import build_data_source

    def load() -> EnvironmentReport:
        source = build_data_source(
            config.data,
            environment=config.environment,
            max_examples=config.training.max_examples,
            shuffle_seed=0,
            search_paths=tuple(config.plugins.search_paths),
        )
        try:
            return describe(source)
        finally:
            source.close()

    try:
        report = call_within(load, timeout_s, "retrain-env-probe")
    except Overran:
        raise DataError(
            f"the environment did not load within {timeout_s:g} s (import and instantiate, "
            "no model): check that it does not wait on a server or a download that never comes"
        ) from None
    except RetrainError:
        raise
    except Exception as exc:  # reported by the caller, with the key
        raise DataError(f"loading the environment failed: {type(exc).__name__}: {exc}") from exc
    if report.needs_tools:
        report = replace(report, tool_format=_tool_format(config.model.model))
    return report


def _tool_format(model: str) -> str:
    """The model's tool-call format when its tokenizer is on disk (a model directory or
    the Hugging Face cache: cheap, no download); "" when it is not (the run's start
    checks it). ConfigError when its chat template has none."""
    from transformers import AutoTokenizer

    from retrain.tool_calls import require_format

    local = Path(model).expanduser()
    try:
        if local.is_dir():
            tokenizer = AutoTokenizer.from_pretrained(str(local))
        else:
            tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True)
    except (OSError, ValueError):  # not on disk: not worth a download here
        return ""
    return require_format(tokenizer, model).name
