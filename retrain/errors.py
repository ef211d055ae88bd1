"""The error hierarchy. Every error retrain raises on purpose derives from RetrainError,
so the CLI can print it without a traceback and pick an exit status."""

from __future__ import annotations


class RetrainError(Exception):
    """Base class for errors retrain reports to the user."""

    exit_code = 1


class ConfigError(RetrainError, ValueError):
    """One or more configuration problems. `problems` holds one line per problem, each
    naming the TOML key (`[training] lr`), what was wrong and how to fix it."""

    exit_code = 2

    def __init__(
        self, problems: list[str] | str, source: str | None = None, *, head: str | None = None
    ):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        self.source = source
        if head is None:
            head = f"invalid configuration{f' in {source}' if source else ''}"
        if not head:
            msg = "\n".join(self.problems)
        elif len(self.problems) == 1:
            msg = f"{head}: {self.problems[0]}"
        else:
            msg = f"{head} ({len(self.problems)} problems):\n" + "\n".join(
                f"  - {p}" for p in self.problems
            )
        super().__init__(msg)


class UsageError(RetrainError):
    """A command was called wrongly (bad argument, file exists, no TTY)."""

    exit_code = 2


class PluginError(RetrainError):
    """A plugin (dotted path) could not be imported or returned malformed output."""


class BackendError(RetrainError):
    """A training backend or inference engine failed."""


class DataError(RetrainError):
    """A data source could not be loaded (missing file, malformed line, offline hub)."""


class EnvironmentUnusable(DataError):
    """An environment cannot serve the step at all (its setup, not one conversation: a
    server at its session limit): the run stops with the fix, rather than training on
    the conversations that happened to get through."""


class RewardError(RetrainError):
    """A reward function is misconfigured or returned an invalid value."""


class CheckpointError(RetrainError):
    """A checkpoint or resume directory is missing, incomplete or incompatible."""


class TrainingError(RetrainError):
    """Training cannot continue (NaN loss, preflight failure, ...)."""


class DistributedError(RetrainError):
    """Another rank of a run on several processes (torchrun) failed or stopped answering;
    this rank stops too (docs/distributed.md)."""


def summary(error: BaseException, limit: int = 300) -> str:
    """An exception's type and the first line of its message (at most `limit` characters),
    for a one-line error that names what went wrong inside a library."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0][:limit] if lines else ''}"
