"""Find the final `\\boxed{...}` answer in a model response (or a MATH solution).

Rules (shared by every reward that looks for a boxed answer):
- The LAST `\\boxed` in the text decides. Its argument is read with brace balancing, so
  `\\boxed{\\frac{1}{2}}` yields `\\frac{1}{2}`; escaped braces (`\\{`, `\\}`) do not count.
- Whitespace between `\\boxed` and `{` is allowed, and the content is stripped.
- If that last box is never closed (a truncated completion) there is no answer: we do not
  fall back to an earlier box, because the model was in the middle of replacing it.
- `\\fbox{...}` counts as a box; the brace-less form `\\boxed 5` (seen in MATH solutions)
  takes the next token.
"""

from __future__ import annotations

import re

# `\boxed` or `\fbox` not followed by another letter (so `\boxedx` is not a box).
_BOX = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")


def _read_group(text: str, start: int) -> str | None:
    """The content of the brace group opening at text[start] == '{', or None when the
    group is never closed."""
    depth = 0
    i = start
    n = len(text)
    while i < n:
        ch = text[i]
        if ch == "\\":
            i += 2  # an escaped char (\{, \}, \\) never opens or closes a group
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1 : i]
        i += 1
    return None


def _read_box(text: str, pos: int) -> str | None:
    """The argument of the box command ending at `pos` (just past `\\boxed`)."""
    i = pos
    n = len(text)
    while i < n and text[i] in " \t\r\n":
        i += 1
    if i >= n:
        return None
    if text[i] == "{":
        return _read_group(text, i)
    if i == pos:  # `\boxed5` without a space is not LaTeX we understand
        return None
    # `\boxed 5`: the argument runs to the next whitespace or math delimiter.
    j = i
    while j < n and text[j] not in " \t\r\n$":
        j += 1
    return text[i:j] or None


def extract_boxed(text: str | None) -> str | None:
    """The stripped content of the last box in `text`, or None (no box, or the last box is
    unterminated)."""
    if not text or "\\" not in text:
        return None
    last = None
    for m in _BOX.finditer(text):
        last = m
    if last is None:
        return None
    content = _read_box(text, last.end())
    return None if content is None else content.strip()


def extract_all_boxed(text: str | None) -> list[str]:
    """Every closed box in `text`, in order (handy for logging and tests)."""
    if not text:
        return []
    out = []
    for m in _BOX.finditer(text):
        content = _read_box(text, m.end())
        if content is not None:
            out.append(content.strip())
    return out
