"""The format version a file planc reads back must hold."""

from __future__ import annotations


def is_version(value, expected: int) -> bool:
    """Whether a file's ``version`` is the integer ``expected``. JSON's ``true`` equals 1
    in Python and ``1.0`` equals 1, but planc writes neither: a file that holds one was
    not written by planc, and is refused as any other version would be."""
    return type(value) is int and value == expected
