"""The config path among a command's arguments, wherever it stands.

`retrain explain --lr 1e-4 base.toml` means `retrain explain base.toml --lr 1e-4`: the
path is the one token that is neither a flag nor a flag's value. Which flags take a value
comes from the flag table (every config flag does), so `--model ./my.toml` never reads
`./my.toml` as the path. `retrain`, `retrain explain` and `retrain doctor` find their
path here; each strips its own switches (`--json`, `--overwrite`, ...) first.
"""

from __future__ import annotations

from collections.abc import Sequence

from retrain.config import dialect
from retrain.config.flags import flag_table
from retrain.errors import UsageError


def split_config_args(argv: Sequence[str]) -> tuple[str | None, list[str]]:
    """(the config path, or None when none was given; the config flags in their order)."""
    known = set(flag_table()) | set(dialect.current().param_flags)
    paths: list[str] = []
    flags: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        i += 1
        if not token.startswith("-") or token == "-":
            paths.append(token)
            continue
        flags.append(token)
        if "=" in token or i >= len(argv):
            continue
        following = argv[i]
        # A config flag always takes a value, but never another flag (`--seed --lr 1e-4`:
        # the loader says --seed needs one). An unknown one (a typo) takes the next token
        # as the loader does, except a `.toml` one: that is the path, and the loader then
        # names the typo rather than a missing ./retrain.toml.
        if following.startswith("--"):
            continue
        if token in known or not following.endswith(".toml"):
            flags.append(following)
            i += 1
    if len(paths) > 1:
        raise UsageError(
            f"more than one config path: {', '.join(map(repr, paths))}. Fix: give one TOML; "
            "every other argument is a flag with its value (--lr 1e-4)"
        )
    return (paths[0] if paths else None), flags
