"""What to tell a user about a name retrain does not know: a TOML key or table, a flag, a
`[[campaign.conditions]]` key.

A peer trainer's name comes first (:mod:`retrain.config.peer_names`: `learning_rate` is
TRL's name for `[training] lr`), then one of retrain's keys placed in another table, then
a name near in spelling. Spelling alone is not enough: a guess must also share most of
its words with the name written (`lerning_rate` is not `training_temperature`), and the
peers' names are guessed from too (`--lerning-rate` is close to TRL's `learning_rate`).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from retrain.config.peer_names import INDEX, PeerName, find, normalize
from retrain.config.schema import TABLES, FieldSpec, table_fields
from retrain.config.toml_writer import value_to_toml

# (table, key, value as text or None) -> how to write that key where the name was written
Writer = Callable[[str, str, "str | None"], str]

_MIN_RATIO = 0.6  # difflib's usual cutoff, on names compared without case or -/_
_NEAR_WORD = 0.75  # two words this close are one word misspelt


def _words(name: str) -> list[str]:
    return [w for w in re.split(r"[_.]", name) if w]


def _shares_words(written: str, candidate: str) -> bool:
    """At least half the words written are (nearly) words of the candidate."""
    theirs = _words(candidate)
    mine = _words(written)
    near = sum(
        any(difflib.SequenceMatcher(None, w, t).ratio() >= _NEAR_WORD for t in theirs) for w in mine
    )
    return bool(mine) and near * 2 >= len(mine)


def closest(name: str, candidates: Iterable[str]) -> str | None:
    """The candidate nearest `name` in spelling, when it is near enough to be a typo of it;
    the first of equals wins."""
    written = normalize(name)
    best, best_ratio = None, _MIN_RATIO
    for candidate in candidates:
        norm = normalize(candidate)
        ratio = difflib.SequenceMatcher(None, written, norm).ratio()
        if (ratio > best_ratio or (best is None and ratio == best_ratio)) and _shares_words(
            written, norm
        ):
            best, best_ratio = candidate, ratio
    return best


def did_you_mean(name: str, candidates: Iterable[str]) -> str:
    """A ' (did you mean X?)' suffix, or '' when no candidate is near in spelling."""
    close = closest(name, candidates)
    return f" (did you mean {close!r}?)" if close else ""


def peer_text(
    peer: PeerName, write: Writer, value: str | None, close: bool = False, named: bool = True
) -> str:
    """What `peer` is here and the fix, written the way `write` spells retrain's key
    (`close`: the name written is only near `peer`'s; `named`: the message names it)."""
    source = f"the name in {peer.source}"
    if close:
        subject = f"did you mean {peer.name}? That is {source}"
    else:
        subject = f"{peer.name} is {source}" if named else f"it is {source}"
    if peer.target is None:
        return f"{subject}; retrain has no such setting. Fix: remove it; {peer.note}"
    table, key = peer.target
    if peer.convert:
        return (
            f"{subject}; retrain's {peer.label} differs: {peer.convert}. "
            f"Fix: {write(table, key, None)}, converted"
        )
    note = f"; {peer.note}" if peer.note else ""
    return f"{subject} for {peer.label}{note}. Fix: {write(table, key, value)}"


def _keys(table: str) -> list[str]:
    return [spec.key for spec in table_fields(table)]


def _owners(key: str, besides: str = "") -> list[str]:
    return [t for t in TABLES if t != besides and key in _keys(t)]


def option_home(key: str) -> str | None:
    """The built-in backend (the local one first) whose `[backend.options]` has `key`."""
    from retrain.registry import BACKENDS

    for name in ("local", *BACKENDS.names()):
        entry = BACKENDS.entry(name)
        if entry is not None and key in entry.options:
            return name
    return None


def table_home(key: str) -> str:
    """' (it belongs to [T]: did you mean [T] key?)' for a key of a config table written
    among a backend's options, or ''."""
    homes = _owners(key)
    return f" (it belongs to [{homes[0]}]: did you mean [{homes[0]}] {key}?)" if homes else ""


def _same_key(peer: PeerName | None, key: str) -> bool:
    """The peer's name is retrain's own key name (`seed`, `max_grad_norm`), so the key is
    better pointed to its table than called a peer's."""
    return peer is not None and peer.target is not None and peer.target[1] == normalize(key)


def toml_value(value: Any) -> str | None:
    try:
        return value_to_toml(value)
    except TypeError:
        return None


def toml_writer(table: str, key: str, value: str | None) -> str:
    return f"{key} = {value if value is not None else '...'} under [{table}]"


def _leaf_names() -> list[str]:
    return [name for name in INDEX if "." not in name]


def key_text(table: str, key: str, value: Any) -> str:
    """The problem of `[table] key`, a key that table does not have (after its label)."""
    peer = find((table, key))
    owners = _owners(key, table)
    if owners and (peer is None or _same_key(peer, key)):
        home = peer.target[0] if peer and peer.target[0] in owners else owners[0]
        note = f"; {peer.note}" if peer and peer.note else ""
        hint = f" (it belongs to [{home}]: did you mean [{home}] {key}?){note}"
    elif (backend := option_home(key)) and (peer is None or _same_key(peer, key)):
        hint = f" (it is an option of the {backend} backend: did you mean [backend.options] {key}?)"
    elif peer is not None:
        return f"unknown key: {peer_text(peer, toml_writer, toml_value(value))}"
    else:
        own = _keys(table)
        close = closest(key, [*own, *_leaf_names()])
        near = INDEX.get(close) if close is not None and close not in own else None
        if near is not None and _same_key(near, close):  # a key of another table, misspelt
            hint = f" (did you mean [{near.target[0]}] {close}?)"
        elif near is not None:
            peer_hint = peer_text(near, toml_writer, toml_value(value), close=True)
            return f"unknown key: {peer_hint}"
        else:
            hint = f" (did you mean {close!r}?)" if close else ""
    return f"unknown key{hint}; valid keys in [{table}]: {', '.join(_keys(table))}"


def top_level_text(name: str, value: Any) -> str | None:
    """The problem of `name = value` outside any table, when it names a setting."""
    peer = find((name,))
    owners = _owners(name)
    if owners and (peer is None or _same_key(peer, name)):
        return f"keys belong in a table; did you mean [{owners[0]}] {name}?"
    if peer is not None:
        return f"keys belong in a table; {peer_text(peer, toml_writer, toml_value(value))}"
    return None


def leaves(path: Sequence[str], value: Any) -> Iterable[tuple[list[str], Any]]:
    """Every (path, value) under a nested table, the table's own path first."""
    if isinstance(value, dict) and value:
        for key, inner in value.items():
            yield from leaves([*path, str(key)], inner)
    else:
        yield list(path), value


def peer_leaves(
    path: Sequence[str], value: Any, misspelt: bool = False
) -> tuple[list[tuple[list[str], str]], list[list[str]]]:
    """For a table retrain does not have: ([(leaf path, problem)] for the leaves that are
    peers' names, [leaf path] for the others). When the table's name is a misspelling of
    one of retrain's (`[trainig] lr`), only a peer's whole dotted name counts."""
    known: list[tuple[list[str], str]] = []
    unknown: list[list[str]] = []
    for leaf, inner in leaves(path, value):
        peer = find(leaf)
        if peer is None or (misspelt and "." not in peer.name):
            unknown.append(leaf)
            continue
        text = peer_text(peer, toml_writer, toml_value(inner), named=False)
        known.append((leaf, f"unknown key: {text}"))
    return known, unknown


# ---------------------------------------------------------------- flags and condition keys


def _spelling_forms(
    flags: Mapping[str, FieldSpec], extra: Iterable[str]
) -> dict[str, str | PeerName]:
    """Names to guess from -> the flag (or peer name) each stands for: every flag, every
    key name (its shortest flag: `temperature` -> --training-temperature), the peers'."""
    forms: dict[str, str | PeerName] = {normalize(f[2:]): f for f in [*flags, *extra]}
    for spec in flags.values():  # in table order: a key of two tables goes to the first
        forms.setdefault(normalize(spec.key), flag_for(spec.table, spec.key, flags))
    for name, peer in INDEX.items():
        forms.setdefault(name, peer)
    return forms


def flag_for(table: str, key: str, flags: Mapping[str, FieldSpec]) -> str:
    """The shortest flag that sets [table] key."""
    named = [f for f, spec in flags.items() if (spec.table, spec.key) == (table, key)]
    return min(named, key=len) if named else f"--{table}-{key}".replace("_", "-")


def flag_text(
    name: str, value: str | None, flags: Mapping[str, FieldSpec], extra: Iterable[str] = ()
) -> str:
    """The problem of an unknown flag `name` (given `value`, or None), `extra` being the
    flags that are not in `flags` (the key dialect's repeatable ones)."""

    def write(table: str, key: str, text: str | None) -> str:
        return f"{flag_for(table, key, flags)} {text if text is not None else 'VALUE'}"

    written = normalize(name.removeprefix("--"))
    direct = {normalize(f[2:]): f for f in [*flags, *extra]}
    peer = find(written.split("."))
    if written not in direct and peer is not None and not _same_key(peer, written):
        return f"unknown flag {name}: {peer_text(peer, write, value)}"
    forms = _spelling_forms(flags, extra)
    guess = closest(written, forms)
    close = forms[guess] if guess is not None else None
    if peer is not None and peer.target is not None and written not in direct:
        close = flag_for(*peer.target, flags)  # the peer's key of that name: `temperature`
    if isinstance(close, PeerName):
        return f"unknown flag {name}: {peer_text(close, write, value, close=True)}"
    hint = f" (did you mean {close!r}?)" if close else ""
    return f"unknown flag {name}{hint}; run `retrain --help-flags` for the list"


def _condition_writer(flags: Mapping[str, FieldSpec]) -> Writer:
    def write(table: str, key: str, text: str | None) -> str:
        spec = flags.get(f"--{key.replace('_', '-')}")
        written = key if spec is not None and spec.table == table else f"{table}.{key}"
        return f"{written} = {text if text is not None else '...'} in the entry"

    return write


def condition_peer(path: Sequence[str], value: Any, flags: Mapping[str, FieldSpec]) -> str | None:
    """The problem of a `[[campaign.conditions]]` key (`path`: its parts) that is a peer's
    name for another key of retrain's; None when it is not one."""
    peer = find(path)
    if peer is None or _same_key(peer, path[-1]):
        return None
    return peer_text(peer, _condition_writer(flags), toml_value(value))


def condition_guess(
    key: str, candidates: Sequence[str], flags: Mapping[str, FieldSpec], peers: bool = True
) -> str:
    """A hint for a condition key that is nothing known: the candidate (or, with `peers`, a
    peer's name) near it in spelling, as ' (did you mean X?)' or ': did you mean X? That is
    ...'; else ''."""
    close = closest(key, [*candidates, *(_leaf_names() if peers else [])])
    if close is None:
        return ""
    if close in candidates:
        return f" (did you mean {close!r}?)"
    return f": {peer_text(INDEX[close], _condition_writer(flags), None, close=True)}"
