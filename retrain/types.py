"""Typed records that cross module boundaries (data -> trainer -> backend -> logs)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Example:
    """One training problem. `prompt` is the question text (before any chat template);
    `reference` the answer a reward compares against; `meta` carries source-specific
    data (e.g. the reasoning-gym entry its task needs to score an answer)."""

    prompt: str
    reference: str
    meta: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)
