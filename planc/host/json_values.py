"""JSON's own words for the values a JSON file holds, for the messages that say what a
file has where it should have something else."""

from __future__ import annotations

import sys


def json_kind(value) -> str:
    """What JSON calls ``value``'s type: ``null`` for None (never Python's ``NoneType``),
    ``boolean``, ``number``, ``string``, ``array`` (a list or a tuple), ``object``."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, (list, tuple)):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def too_long_integer() -> str:
    """What a JSON document holds when json.loads raises a plain ValueError (no
    JSONDecodeError): an integer longer than Python converts from text (CPython's limit
    against quadratic-time parsing, sys.get_int_max_str_digits), in words that say what
    the file holds rather than how to raise the limit."""
    return f"an integer of more than {sys.get_int_max_str_digits():,} digits"


# Python's names of the types json.load makes, as JSON calls them.
_PYTHON_TYPES = {"NoneType": "a JSON null", "bool": "a JSON boolean", "int": "a JSON number",
                 "float": "a JSON number", "str": "a JSON string", "list": "a JSON array",
                 "dict": "a JSON object"}
# What Python says when a parser met one of them where something else belongs, by the
# end of its message: the JSON value that belongs there.
_WANTED = (("has no attribute 'items'", "an object"), ("has no attribute 'get'", "an object"),
           ("has no attribute 'keys'", "an object"), ("is not iterable", "an array or an object"),
           ("is not subscriptable", "an object or an array"),
           ("object is not a mapping", "an object"))


def malformed_text(exc: BaseException) -> str:
    """What a parser's TypeError or AttributeError on a JSON file's values means, in
    JSON's words ("a JSON null where an array belongs"), where Python's message names its
    own types ("'NoneType' object is not iterable"); any other exception's own text."""
    text = str(exc)
    if not isinstance(exc, (TypeError, AttributeError)):
        return text
    if text.startswith("string indices must be integers"):
        return "a JSON string where an object or an array belongs"
    if text.startswith("list indices must be integers"):
        return "a JSON array where an object belongs"
    found = next((json for python, json in _PYTHON_TYPES.items()
                  if text.startswith(f"'{python}' object")), None)
    wanted = next((json for end, json in _WANTED if text.endswith(end)), None)
    if found is not None and wanted is not None:
        return f"{found} where {wanted} belongs"
    return "a value of the wrong JSON type" if "'" in text else text
