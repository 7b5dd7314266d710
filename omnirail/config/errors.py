"""The error every config check raises, and the helpers that keep its messages bounded.

A config can be any file an operator points the tools at, so a message never echoes input
unbounded (issue 20: a 460-byte YAML alias bomb printed with `repr` took 8.6 s and
1.5 GiB): values are shown with `short` (a bounded `repr`, computed in bounded time),
names and keys inside locations with `clip`, lists of names with `join_bounded`, and
`ConfigError` itself cuts every line to `MAX_LINE` characters and keeps at most
`MAX_PROBLEMS` of them.
"""

from __future__ import annotations

import re
import reprlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

# Characters of one value echoed in a message (its repr, quotes included).
MAX_VALUE = 80
# Characters of one problem: a location, a sentence and a few values fit well within.
MAX_LINE = 2000
# Problems one ConfigError lists; a config with more is not worth reading further.
MAX_PROBLEMS = 100

_ELLIPSIS = "…"


class ConfigError(ValueError):
    """An invalid pipeline config; `errors` holds every problem found, one per entry.

    Entries are cut to `MAX_LINE` characters, and past `MAX_PROBLEMS` entries the rest is
    counted in a last entry instead of listed.
    """

    def __init__(self, errors: str | Iterable[str], source: str | None = None) -> None:
        lines = [errors] if isinstance(errors, str) else list(errors)
        if len(lines) > MAX_PROBLEMS:
            more = len(lines) - MAX_PROBLEMS
            lines = [*lines[:MAX_PROBLEMS], f"... and {more} more problem(s) not listed"]
        self.errors: list[str] = [clip(str(line), MAX_LINE) for line in lines]
        self.source = source
        super().__init__("\n".join(self.errors))

    def __str__(self) -> str:
        return "\n".join(self.errors)


def _bounded_repr() -> reprlib.Repr:
    # reprlib walks at most `maxlevel` levels and a few items per container, so the cost
    # does not depend on the value's size (an alias bomb shares one list 9^6 times).
    r = reprlib.Repr()
    r.maxlevel = 3
    r.maxdict = 4
    r.maxlist = r.maxtuple = r.maxset = r.maxfrozenset = r.maxdeque = r.maxarray = 6
    r.maxstring = MAX_VALUE
    r.maxlong = 40
    r.maxother = MAX_VALUE
    return r


_REPR = _bounded_repr()
# Python refuses to print ints of more than 4300 digits (sys.int_max_str_digits); this
# many bits stays below that with room to spare.
_MAX_INT_BITS = 4000 * 3


def short(value: object, limit: int = MAX_VALUE) -> str:
    """`repr(value)` of at most `limit` characters, computed in bounded time."""
    if isinstance(value, int) and not isinstance(value, bool):
        if abs(value).bit_length() > _MAX_INT_BITS:
            return f"<int of {abs(value).bit_length()} bits>"
        # Ints are common and short; reprlib elides their middle digits instead.
        return clip(repr(value), limit)
    try:
        text = _REPR.repr(value)
    except Exception:  # a user object's __repr__ (Python configs) may fail
        text = f"<{type(value).__name__}>"
    return clip(text, limit)


def clip(text: str, limit: int = MAX_VALUE) -> str:
    """`text` cut to `limit` characters (a name or key shown inside a location)."""
    if len(text) <= limit:
        return text
    keep = max(limit - 30, 1)  # room for the note saying how much was cut
    return f"{text[:keep]}{_ELLIPSIS} ({len(text) - keep} more characters)"


def join_bounded(items: Sequence[str], sep: str = ", ", limit: int = 12) -> str:
    """`sep.join(items)` showing at most `limit` items (each clipped): the first ones and
    the last, with how many were left out between."""
    shown = [clip(str(i)) for i in items]
    if len(shown) > limit:
        more = len(shown) - (limit - 1)
        shown = [*shown[: limit - 2], f"{_ELLIPSIS} {more} more {_ELLIPSIS}", shown[-1]]
    return sep.join(shown)


# Stage and pipeline names. `\Z`, not `$`: `$` lets a trailing newline through.
NAME_RE = re.compile(r"\A[A-Za-z][A-Za-z0-9_-]{0,62}\Z")


def stage_label(raw_stages: Any, index: int) -> str:
    """How an error names the stage at `index` of a raw `stages:` list: its name when it
    has a valid one, else the index (duck-typed: a mapping or a StageConfig)."""
    raw = None
    if isinstance(raw_stages, list | tuple) and 0 <= index < len(raw_stages):
        raw = raw_stages[index]
    name = raw.get("name") if isinstance(raw, Mapping) else getattr(raw, "name", None)
    if isinstance(name, str) and NAME_RE.match(name):
        return name
    return str(index)
