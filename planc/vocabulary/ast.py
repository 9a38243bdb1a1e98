"""The syntax tree of a .plan file: what the user wrote, with where they wrote it.

The tree is untyped on purpose: ``layers = fp32`` parses fine and is rejected by
the checker, which knows what each key expects and can say so precisely.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from planc.diagnostics import Span


@dataclass(frozen=True, init=False)
class Number:
    """A numeric literal, possibly with a tail glued on: ``8``, ``25MB``, ``1f1b``."""

    text: str
    value: int | float  # inf when out of any range
    suffix: str  # "" for a plain number, the unit or enum tail otherwise
    span: Span
    malformed: bool = False  # misplaced underscores: 1__0, 1_

    def __init__(self, text: str, value: int | float, suffix: str, span: Span,
                 malformed: bool = False):
        fields = self.__dict__  # as planc.diagnostics.Span does: one per number in a plan
        fields["text"], fields["value"], fields["suffix"] = text, value, suffix
        fields["span"], fields["malformed"] = span, malformed


@dataclass(frozen=True)
class Word:
    """A bare identifier: an enum word, a boolean, or a name of a key of the same block."""

    text: str
    span: Span


@dataclass(frozen=True)
class String:
    value: str
    span: Span
    malformed: str | None = None  # why its escapes do not decode: "truncated \\xXX escape"


@dataclass(frozen=True)
class BinOp:
    op: str  # one of + - * /
    left: "Value"
    right: "Value"
    span: Span


@dataclass(frozen=True)
class Neg:
    operand: "Value"
    span: Span


@dataclass(frozen=True)
class Range:
    """An inclusive integer range ``first..last``."""

    first: "Value"
    last: "Value"
    span: Span


@dataclass(frozen=True)
class ListValue:
    items: tuple["Value", ...]
    span: Span


@dataclass(frozen=True)
class Argument:
    name: str | None  # None for a positional argument
    name_span: Span | None
    value: "Value"
    span: Span


@dataclass(frozen=True)
class Call:
    name: str
    name_span: Span
    args: tuple[Argument, ...]
    span: Span


Value = Union[Number, Word, String, BinOp, Neg, Range, ListValue, Call]


@dataclass(frozen=True, init=False)
class Assign:
    key: str
    key_span: Span
    value: Value
    span: Span

    def __init__(self, key: str, key_span: Span, value: Value, span: Span):
        fields = self.__dict__  # as planc.diagnostics.Span does: one per entry in a plan
        fields["key"], fields["key_span"], fields["value"], fields["span"] = (
            key, key_span, value, span)


@dataclass(frozen=True)
class Block:
    name: str
    name_span: Span
    label: str | None  # the second word of ``model gpt { }``
    label_span: Span | None
    entries: tuple["Entry", ...]
    span: Span


Entry = Union[Assign, Block]


@dataclass(frozen=True)
class PlanFile:
    name: str
    name_span: Span
    entries: tuple[Entry, ...]
    span: Span


def describe(value: Value) -> str:
    """A short noun phrase for a value, for messages like 'expects a size, got a list'."""
    if isinstance(value, Number):
        if value.suffix:
            return f"'{value.text}'"
        return f"the number {value.text}"
    if isinstance(value, Word):
        return f"the word '{value.text}'"
    if isinstance(value, String):
        return "a string"
    if isinstance(value, (BinOp, Neg)):
        return "an expression"
    if isinstance(value, Range):
        return "a range"
    if isinstance(value, ListValue):
        return "a list"
    return f"a call of {value.name}()"
