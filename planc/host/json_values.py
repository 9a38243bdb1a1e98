"""JSON's own words for the values a JSON file holds, for the messages that say what a
file has where it should have something else."""

from __future__ import annotations


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
