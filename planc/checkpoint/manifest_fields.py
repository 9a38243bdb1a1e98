"""The fields of a checkpoint's manifest.json, each checked for its type and range, with
the field's path in the message (``optimizer.steps is -1, not a whole number >= 0``).
planc.checkpoint.manifest reads a manifest with them; the underscored names are its
alone, the others planc.checkpoint.files' too."""

from __future__ import annotations

import json
import math
import re
import typing

MAX_WHOLE = 2**53  # as planc.lang.schema.MAX_INTEGER: past it a float cannot hold a count
# A file a checkpoint names: a plain name inside its step directory, no path, no dot
# file, nothing a terminal or a shell would read differently.
PLAIN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]{0,254}")
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class _Wrong(Exception):
    """A field that is missing, unknown or of the wrong type or range."""


def _at(where: str, key: str | int) -> str:
    """The path of a field for messages: ``optimizer.steps``, ``history[0]``,
    ``parameters["layers.0.qkv.weight"]``."""
    if isinstance(key, int):
        return f"{where}[{key}]"
    if _IDENTIFIER.fullmatch(key):
        return f"{where}.{key}" if where else key
    return f"{where}[{json.dumps(key)}]"


def shown(value: object) -> str:
    """A value as the manifest has it, short (a container is not written out: it may
    nest as deep as the reader allowed)."""
    if isinstance(value, dict):
        return "{}" if not value else "an object"
    if isinstance(value, list):
        scalars = all(v is None or isinstance(v, (str, int, float)) for v in value)
        text = json.dumps(value) if scalars and len(value) <= 4 else ""
        return text if text and len(text) <= 48 else f"a list of {len(value)}"
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    text = json.dumps(value) if not isinstance(value, int) or abs(value) < 10**40 else \
        f"a number of {len(str(abs(value)))} digits"
    return text if len(text) <= 48 else text[:40] + "...\""


def _wrong(where: str, value: object, expected: str) -> _Wrong:
    return _Wrong(f"{where} is {shown(value)}, not {expected}")


def _fields(value: object, where: str, names: typing.Iterable[str]) -> dict:
    """``value`` as an object with exactly the fields ``names``."""
    names = tuple(names)
    if not isinstance(value, dict):
        raise _wrong(where, value, "an object")
    for name in names:
        if name not in value:
            raise _Wrong(f"{_at(where, name)} is missing")
    for name in value:
        if name not in names:
            raise _Wrong(f"{_at(where, name)} is not a field of a planc checkpoint manifest")
    return value


def _whole(value: object, where: str, low: int = 0, high: int = MAX_WHOLE) -> int:
    if type(value) is not int or not low <= value <= high:
        raise _wrong(where, value, f"a whole number >= {low}" if high == MAX_WHOLE else
                     f"a whole number from {low} to {high}")
    return value


def _real(value: object, where: str, positive: bool = False, below: float | None = None
          ) -> float:
    """A finite number, >= 0 (> 0 if ``positive``, < ``below`` if given)."""
    if type(value) not in (int, float) or not math.isfinite(value) or value < 0 or \
            (positive and value == 0) or (below is not None and value >= below):
        raise _wrong(where, value, f"a finite number {'>' if positive else '>='} 0"
                     + (f" and < {below:g}" if below is not None else ""))
    return value


def _text(value: object, where: str, pattern: re.Pattern | None = None,
          expected: str = "a non-empty string") -> str:
    if not isinstance(value, str) or not value or not value.isprintable() or \
            len(value) > 4096 or (pattern is not None and not pattern.fullmatch(value)):
        raise _wrong(where, value, expected)
    return value


def _one_of(value: object, where: str, choices: typing.Iterable[str]) -> str:
    choices = tuple(choices)
    if not isinstance(value, str) or value not in choices:
        raise _wrong(where, value, "one of " + ", ".join(map(json.dumps, choices)))
    return value


def file_name(value: object, where: str) -> str:
    """A file of the step directory: a plain name (no ``/``, no ``..``, no dot file)."""
    return _text(value, where, PLAIN_NAME, "a plain file name (letters, digits and _ . + -, "
                 "not starting with a dot)")


def _list(value: object, where: str, low: int = 0, high: int = MAX_WHOLE) -> list:
    if not isinstance(value, list) or not low <= len(value) <= high:
        raise _wrong(where, value, f"a list of {low} items" if low == high else
                     f"a list of {low} to {high} items" if high < MAX_WHOLE else
                     "a list" + (" with at least one item" if low else ""))
    return value
