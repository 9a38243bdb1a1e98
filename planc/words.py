"""Small helpers for the words of messages."""

from __future__ import annotations


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """``3 ranks``, ``1 rank``, ``2 microbatches``: a count with its noun in agreement."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"
