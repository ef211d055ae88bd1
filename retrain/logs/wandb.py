"""Weights & Biases logging, on when `[logging] wandb_project` is set.

The JSONL files are the record of a run; wandb is a mirror of them. Nothing here may
stop training: wandb missing, `wandb.init` failing, or a failure while logging prints
one warning and turns the sink off, and the JSONL logs go on.

Metric names get structured prefixes (see :func:`wandb_key`):

- ``train/rewards/...``: reward and correctness (mean_reward, correct_rate,
  running_correct_rate, no_answer_rate, reward_errors, reward_timeouts, and the
  skipped/kept group counts, which follow from the rewards);
- ``train/entropy/...``: token uncertainty statistics (exec_entropy_*, plan_entropy_*,
  token_entropy_mean, num_planning_tokens, num_exec_tokens);
- ``train/backpressure/...``: the back-pressure controller (``bp_*``, prefix dropped);
- ``train/...``: everything else (loss, sepa_lambda, timings, tokens, grad_norm, ...).

Only numbers (and booleans, as 0/1) are logged; text fields stay in the JSONL. The
wandb step is the training step. The run config holds every table of the resolved
configuration (secrets removed) plus the condition label. Name, group, tags and entity
come from `[logging]`; the name defaults to the condition label. A sample of the step's
completions is logged as a ``completions`` table every TABLE_EVERY steps (at most
TABLE_ROWS rows, texts cut to TEXT_LIMIT characters), so the upload stays bounded.

Run files go to $WANDB_DIR when set, else to the run's log_dir (``{log_dir}/wandb/``).
The run id is kept in ``{log_dir}/wandb_run_id.txt``; a resumed run (``--resume LOGDIR``)
continues the same wandb run.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

RUN_ID_FILE = "wandb_run_id.txt"
TABLE_EVERY = 10
TABLE_ROWS = 32
TEXT_LIMIT = 2000
TABLE_COLUMNS = (
    "step",
    "group",
    "index",
    "prompt",
    "completion",
    "reference",
    "answer",
    "reward",
    "correct",
    "num_tokens",
    "stop_reason",
    "planning_tokens",
    "advantage_mean",
)

REWARD_KEYS = frozenset(
    {
        "mean_reward",
        "correct_rate",
        "num_correct",
        "num_completions",
        "running_correct_rate",
        "no_answer_rate",
        "reward_errors",
        "reward_timeouts",
        "skipped_all_correct",
        "skipped_all_wrong",
        "kept_groups",
    }
)
ENTROPY_KEYS = frozenset({"num_planning_tokens", "num_exec_tokens"})
SKIPPED_KEYS = frozenset({"step", "condition", "time"})


def wandb_key(name: str) -> str:
    """The wandb name of a metrics.jsonl field."""
    if name.startswith("bp_"):
        return f"train/backpressure/{name[3:]}"
    if name in REWARD_KEYS or "reward" in name:
        return f"train/rewards/{name}"
    if name in ENTROPY_KEYS or "entropy" in name:
        return f"train/entropy/{name}"
    return f"train/{name}"


def wandb_metrics(row: Mapping[str, Any]) -> dict[str, float]:
    """The numeric fields of a metrics row under their wandb names."""
    out: dict[str, float] = {}
    for key, value in row.items():
        if key in SKIPPED_KEYS or value is None:
            continue
        if isinstance(value, bool):
            out[wandb_key(key)] = int(value)
        elif isinstance(value, int | float) and math.isfinite(value):
            out[wandb_key(key)] = value
        elif hasattr(value, "item") and callable(value.item):  # numpy scalar
            v = value.item()
            if isinstance(v, int | float) and math.isfinite(v):
                out[wandb_key(key)] = v
    return out


def run_config(config: Any) -> dict[str, Any]:
    """The resolved configuration as nested tables, secret fields removed."""
    from retrain.config.schema import TABLES, table_fields

    out: dict[str, Any] = {"condition": getattr(config, "condition", "")}
    for table in TABLES:
        section = getattr(config, table, None)
        if section is None:
            continue
        values = {}
        for spec in table_fields(table):
            if spec.meta.get("secret"):
                continue
            value = getattr(section, spec.attr)
            values[spec.key] = value
        out[table] = values
    return out


def _tags(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _cut(value: Any) -> Any:
    if isinstance(value, str) and len(value) > TEXT_LIMIT:
        return value[:TEXT_LIMIT] + "..."
    return value


# What doctor and explain say where wandb has no login for a run that asks for it.
LOGIN_FIX = "wandb login, set WANDB_API_KEY in .env, or WANDB_MODE=offline"


def not_logged_in(project: str) -> str:
    return f"not logged in: runs with wandb_project = {project!r} will warn and log to JSONL only"


def login() -> tuple[bool, str]:
    """(whether wandb can log a run without asking for a login, how): an offline mode,
    $WANDB_API_KEY, or credentials for its host in ~/.netrc ($NETRC)."""
    import re
    from urllib.parse import urlparse

    mode = os.environ.get("WANDB_MODE", "").lower()
    if mode in ("offline", "disabled", "dryrun"):
        return True, f"WANDB_MODE={mode}: no login needed"
    if os.environ.get("WANDB_API_KEY"):
        return True, "logged in (WANDB_API_KEY is set)"
    url = os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai"
    host = urlparse(url).hostname or "api.wandb.ai"
    netrc = Path(os.environ.get("NETRC") or Path.home() / ".netrc")
    try:
        text = netrc.read_text(encoding="utf-8", errors="replace")
    except OSError:
        text = ""
    if re.search(rf"\bmachine\s+{re.escape(host)}\b", text):
        return True, f"logged in (credentials for {host} in ~/.netrc)"
    return False, "not logged in"


class WandbSink:
    """A wandb run mirroring the metrics (see the module docstring)."""

    def __init__(self, wandb_module: Any, run: Any, say: Callable[[str], None]):
        self.wandb = wandb_module
        self.run = run
        self.say = say
        self.disabled = False
        self.table_every = TABLE_EVERY
        self.table_rows = TABLE_ROWS

    @classmethod
    def start(cls, config: Any, say: Callable[[str], None]) -> WandbSink | None:
        """Start a run for `config`, or warn once and return None."""
        log = config.logging
        try:
            import wandb
        except ImportError:
            say(
                f"warning: [logging] wandb_project = {log.wandb_project!r} but wandb is not installed "
                "(pip install 'retrain[wandb]'); logging to JSONL only"
            )
            return None
        log_dir = Path(log.log_dir)
        kwargs: dict[str, Any] = {
            "project": log.wandb_project,
            "entity": log.wandb_entity or None,
            "name": log.wandb_run_name or config.condition,
            "group": log.wandb_group or None,
            "tags": _tags(log.wandb_tags) or None,
            "config": run_config(config),
            "settings": wandb.Settings(console="off"),
        }
        # Explicit, because wandb reads its environment once per process.
        kwargs["dir"] = os.environ.get("WANDB_DIR") or str(log_dir)
        env_mode = os.environ.get("WANDB_MODE", "").lower()
        mode = "offline" if env_mode == "dryrun" else env_mode
        if mode in ("online", "offline", "disabled"):
            kwargs["mode"] = mode
        resume_from = getattr(config.resume, "from_", "")
        if resume_from:
            previous = Path(resume_from) / RUN_ID_FILE
            try:
                run_id = previous.read_text(encoding="utf-8").strip()
            except OSError:
                run_id = ""
            if run_id:
                kwargs.update(id=run_id, resume="allow")
        try:
            run = wandb.init(**kwargs)
        except Exception as exc:  # any failure: warn, train on
            say(
                f"warning: wandb could not start ({type(exc).__name__}: {_first_line(exc)}); "
                "logging to JSONL only. Check `wandb login` or set WANDB_MODE=offline"
            )
            return None
        if run is None:
            say("warning: wandb.init returned no run; logging to JSONL only")
            return None
        try:
            log_dir.mkdir(parents=True, exist_ok=True)
            (log_dir / RUN_ID_FILE).write_text(str(run.id) + "\n", encoding="utf-8")
        except (OSError, AttributeError):
            pass
        try:
            where = (
                f"offline, in {Path(run.dir).parent}" if getattr(run, "offline", False) else run.url
            )
        except Exception:
            where = ""
        say(
            f"wandb: logging run {kwargs['name']!r} to project {log.wandb_project!r}"
            + (f" ({where})" if where else "")
        )
        return cls(wandb, run, say)

    def _fail(self, what: str, exc: BaseException) -> None:
        self.disabled = True
        self.say(
            f"warning: wandb {what} failed ({type(exc).__name__}: {_first_line(exc)}); "
            "wandb logging is off for the rest of the run, JSONL goes on"
        )

    def completions_table(self, generations: Sequence[Mapping[str, Any]]) -> Any:
        table = self.wandb.Table(columns=list(TABLE_COLUMNS))
        for row in list(generations)[: self.table_rows]:
            table.add_data(*(_cut(row.get(c)) for c in TABLE_COLUMNS))
        return table

    def log(self, row: Mapping[str, Any], generations: Sequence[Mapping[str, Any]] = ()) -> None:
        """Log one step's metrics row (and every TABLE_EVERY steps a completions table)."""
        if self.disabled:
            return
        try:
            step = int(row["step"])
            data: dict[str, Any] = wandb_metrics(row)
            if generations and self.table_every > 0 and step % self.table_every == 0:
                data["completions"] = self.completions_table(generations)
            self.run.log(data, step=step)
        except Exception as exc:
            self._fail("log", exc)

    def finish(self, status: str = "finished") -> None:
        if self.run is None:
            return
        run, self.run = self.run, None
        try:
            if not self.disabled:
                run.summary["status"] = status
            run.finish(exit_code=0 if status == "finished" else 1)
        except Exception as exc:
            self._fail("finish", exc)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else ""
