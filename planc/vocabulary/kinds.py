"""The kinds of values a key of a .plan file may hold, and how a value is read.

Each key has a :class:`Kind` that turns its syntax tree into a Python value or raises
:class:`Problem` with a precise message. Integer keys may be expressions over other
keys of the same block; :class:`Scope` evaluates those on demand, in any order, and
reports cycles. This module is the language's leaf: the model families declare their
keys with it (:class:`Key`), so it imports nothing of the plan or of the families.
"""

from __future__ import annotations

import bisect
import difflib
import functools
from dataclasses import dataclass, field
from typing import Any, Callable

from planc.diagnostics import Span
from planc.vocabulary import ast
from planc.vocabulary.units import (EXAMPLES, LARGEST, RANGES, SI_UNITS, SMALLEST, TIME,
                                    UNITS, units_of)

MAX_INTEGER = 2**53  # beyond this a float cannot hold the value and nothing is sensible
MAX_EXPRESSION_DEPTH = 200


class Problem(Exception):
    """A value that cannot be read; becomes one error diagnostic."""

    def __init__(self, message: str, span: Span | None, *hints: str):
        super().__init__(message)
        self.message, self.span, self.hints = message, span, tuple(h for h in hints if h)


class Unresolved(Exception):
    """A value depends on another that already failed (and was reported there)."""


def did_you_mean(word: str, choices) -> str:
    """"did you mean 'X'?" for the choice closest to ``word`` (difflib, cutoff 0.6), or
    for the one that differs only in case; "" if none."""
    lengths, ordered, lowered = _choice_index(tuple(choices))
    # Only choices of a length that can reach the cutoff (difflib's real_quick_ratio:
    # 2 * shorter / total >= 0.6, in integers) and sharing a letter with the word go to
    # difflib: a file with 10,000 unknown keys asks 10,000 times.
    size, letters = len(word), set(word)
    near = [c for c in ordered[bisect.bisect_left(lengths, -(-3 * size // 7)):
                               bisect.bisect_right(lengths, 7 * size // 3)]
            if not letters.isdisjoint(c) or not size]
    match = difflib.get_close_matches(word, near, n=1, cutoff=0.6) if near else []
    if not match and word.lower() in lowered:
        match = [lowered[word.lower()]]
    return f"did you mean '{match[0]}'?" if match else ""


@functools.lru_cache(maxsize=256)
def _choice_index(choices: tuple[str, ...]) -> tuple[list[int], list[str], dict[str, str]]:
    """The choices by length (and their lengths), and each one by its lower case."""
    ordered = sorted(choices, key=len)
    return [len(c) for c in ordered], ordered, {c.lower(): c for c in choices}


def join_words(words, conjunction: str = "or") -> str:
    words = list(words)
    if len(words) == 1:
        return words[0]
    return ", ".join(words[:-1]) + f" {conjunction} " + words[-1]


def named_arguments(call: ast.Call, allowed, example: Callable[[ast.Argument], str]
                    ) -> dict[str, ast.Argument]:
    """The arguments of a call value such as ``adamw(lr = 1e-3)``, by name: each named,
    one of ``allowed`` and given once, or a Problem (``example(argument)``: the hint
    for an unnamed one)."""
    given: dict[str, ast.Argument] = {}
    for argument in call.args:
        if argument.name is None:
            raise Problem(f"arguments of {call.name} must be named", argument.span,
                          example(argument))
        if argument.name not in allowed:
            raise Problem(f"{call.name} has no argument '{argument.name}'; it takes "
                          f"{join_words(list(allowed))}", argument.name_span,
                          did_you_mean(argument.name, allowed))
        if argument.name in given:
            raise Problem(f"argument '{argument.name}' given twice", argument.name_span)
        given[argument.name] = argument
    return given


# --- expression scope --------------------------------------------------------------


@dataclass
class Scope:
    """The keys of one block, for evaluating integer expressions such as ``4 * hidden``."""

    entries: dict[str, ast.Assign]
    kinds: dict[str, "Kind"]
    defaults: dict[str, Any]
    required: frozenset[str] = frozenset()
    # The syntax of another block that has the key ``name`` (``mesh { }``), for the hint
    # on a name of the wrong block in an expression; the schema knows, this leaf cannot.
    home_of: Callable[[str], str | None] = lambda name: None
    _values: dict[str, Any] = field(default_factory=dict)
    _failed: set[str] = field(default_factory=set)
    _active: list[str] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)

    def value(self, key: str) -> Any:
        """The value of ``key`` (given or default); Unresolved if it could not be read."""
        if key in self._values:
            return self._values[key]
        if key in self._failed:
            raise Unresolved(key)
        self._active.append(key)
        try:
            if key in self.entries:
                result = self.kinds[key].read(self.entries[key].value, self)
            else:
                default = self.defaults.get(key)
                result = default(self) if callable(default) else default
        except Problem as problem:
            self.problems.append(problem)
            self._failed.add(key)
            raise Unresolved(key) from None
        except Unresolved:
            self._failed.add(key)
            raise
        finally:
            self._active.pop()
        self._values[key] = result
        return result

    def integer(self, name: str, span: Span) -> int:
        """The value of the key ``name`` referenced at ``span`` inside an expression."""
        if name not in self.kinds:
            near = did_you_mean(name, [k for k, v in self.kinds.items()
                                       if isinstance(v, Integer)])
            elsewhere = self.home_of(name)
            if not near and elsewhere:
                near = (f"expressions may use only keys of the same block; '{name}' is a key "
                        f"of {elsewhere}")
            raise Problem(f"unknown name '{name}' in expression", span, near)
        if not isinstance(self.kinds[name], Integer):
            raise Problem(f"'{name}' is not an integer key and cannot be used in arithmetic",
                          span)
        if name in self._active:
            cycle = self._active[self._active.index(name):] + [name]
            raise Problem(f"'{name}' is defined in terms of itself ({' -> '.join(cycle)})", span)
        value = self.value(name)
        if value is None:
            if name in self.required:  # missing, and reported as such on its own
                raise Unresolved(name)
            raise Problem(f"'{name}' is not set and has no default to use here", span)
        return value


def check_literal(value: ast.Value) -> None:
    """Reject malformed and out-of-range number literals, whatever the key expects."""
    if isinstance(value, ast.Number):
        if value.malformed:
            raise Problem(f"malformed number '{value.text}': '_' may only separate digits",
                          value.span)
        if value.value == float("inf"):
            raise Problem(f"number {value.text[:20]}{'...' if len(value.text) > 20 else ''} "
                          f"is out of range", value.span)


def evaluate_integer(value: ast.Value, scope: Scope, depth: int = 0) -> int:
    """Integer arithmetic with + - * / (exact) over literals and keys of the block."""
    if depth > MAX_EXPRESSION_DEPTH:
        raise Problem(f"expression has more than {MAX_EXPRESSION_DEPTH} nested operations",
                      value.span)
    if isinstance(value, ast.Number):
        check_literal(value)
        if value.suffix:
            if value.suffix in UNITS:
                raise Problem(f"expected a plain integer, got the {UNITS[value.suffix][0]} "
                              f"{value.text}", value.span)
            full = {"K": 10**3, "k": 10**3, "M": 10**6, "G": 10**9}.get(value.suffix)
            raise Problem(f"'{value.text}' is not a number", value.span,
                          f"write the number in full: {value.value * full}"
                          if full and isinstance(value.value, int) else "")
        if isinstance(value.value, float):
            raise Problem(f"expected an integer, got {value.text}", value.span)
        result = value.value
    elif isinstance(value, ast.Word):
        result = scope.integer(value.text, value.span)
    elif isinstance(value, ast.Neg):
        result = -evaluate_integer(value.operand, scope, depth + 1)
    elif isinstance(value, ast.BinOp):
        left = evaluate_integer(value.left, scope, depth + 1)
        right = evaluate_integer(value.right, scope, depth + 1)
        if value.op == "+":
            result = left + right
        elif value.op == "-":
            result = left - right
        elif value.op == "*":
            result = left * right
        elif right == 0:
            raise Problem("division by zero", value.span)
        elif left % right:
            raise Problem(f"{left} / {right} does not divide exactly (remainder {left % right})",
                          value.span, "'/' in a plan is exact integer division")
        else:
            result = left // right
    else:
        raise Problem(f"expected an integer, got {ast.describe(value)}", value.span)
    if abs(result) > MAX_INTEGER:
        raise Problem(f"value {result} is too large", value.span)
    return result


# --- kinds of values ---------------------------------------------------------------


class Kind:
    noun = "a value"

    def read(self, value: ast.Value, scope: Scope) -> Any:
        raise NotImplementedError

    def mismatch(self, value: ast.Value) -> Problem:
        return Problem(f"expected {self.noun}, got {ast.describe(value)}", value.span)


@dataclass(frozen=True)
class Integer(Kind):
    minimum: int = 1
    maximum: int | None = None

    @property
    def noun(self) -> str:
        if self.maximum is not None:
            return f"an integer from {self.minimum} to {self.maximum}"
        return "a positive integer" if self.minimum == 1 else f"an integer >= {self.minimum}"

    def read(self, value, scope):
        if isinstance(value, (ast.ListValue, ast.String, ast.Call, ast.Range)):
            raise self.mismatch(value)
        if isinstance(value, ast.Word) and value.text not in scope.kinds:
            # A bare word that names no key: a type mistake, not an expression.
            integers = [k for k, kind in scope.kinds.items() if isinstance(kind, Integer)]
            raise Problem(f"expected {self.noun}, got the word '{value.text}'", value.span,
                          did_you_mean(value.text, integers))
        result = evaluate_integer(value, scope)
        if result < self.minimum or (self.maximum is not None and result > self.maximum):
            raise Problem(f"expected {self.noun}, got {result}", value.span)
        return result


@dataclass(frozen=True)
class Real(Kind):
    minimum: float = 0.0
    maximum: float | None = None
    minimum_allowed: bool = True  # whether the minimum itself is valid

    @property
    def noun(self) -> str:
        low = ">=" if self.minimum_allowed else ">"
        if self.maximum is None:
            return f"a number {low} {self.minimum:g}"
        return f"a number {low} {self.minimum:g} and <= {self.maximum:g}"

    def read(self, value, scope):
        sign = 1
        literal = value
        if isinstance(literal, ast.Neg):
            sign, literal = -1, literal.operand
        if not isinstance(literal, ast.Number):
            raise self.mismatch(value)
        check_literal(literal)
        if literal.suffix:
            raise Problem(f"expected a plain number, got '{literal.text}'", value.span)
        result = sign * float(literal.value)
        # 0, or 1e-100 to 1e100 in magnitude, as a metrics file's numbers: a product or a
        # quotient of two stays a finite float (an efficiency of 1e-320 made a step inf)
        if result != result or not (result == 0 or SMALLEST <= abs(result) <= LARGEST):
            raise Problem(f"number {literal.text} is out of range: 0, or 1e-100 to 1e100 in "
                          f"magnitude", value.span)
        too_low = result < self.minimum or (result == self.minimum and not self.minimum_allowed)
        if too_low or (self.maximum is not None and result > self.maximum):
            raise Problem(f"expected {self.noun}, got {result:g}", value.span)
        return result


BOOLEAN_WORDS = {"on": True, "true": True, "off": False, "false": False}


class Boolean(Kind):
    noun = "on or off"

    def read(self, value, scope):
        if isinstance(value, ast.Word):
            if value.text in BOOLEAN_WORDS:
                return BOOLEAN_WORDS[value.text]
            raise Problem(f"expected on or off, got '{value.text}'", value.span,
                          did_you_mean(value.text, BOOLEAN_WORDS))
        raise self.mismatch(value)


def word_text(value: ast.Value) -> str | None:
    """The text of an enum word: ``column``, ``1f1b`` (a digit first), ``dgx-a100`` (words
    joined by '-' with no space, which the grammar reads as a subtraction)."""
    if isinstance(value, ast.Word):
        return value.text
    if isinstance(value, ast.Number) and value.suffix and value.suffix not in UNITS \
            and not value.malformed:
        return value.text
    if isinstance(value, ast.BinOp) and value.op == "-":
        left, right = word_text(value.left), _piece(value.right)
        touching = (value.left.span.end_line == value.right.span.line
                    and value.left.span.end_column + 1 == value.right.span.column)
        if left is not None and right is not None and touching:
            return f"{left}-{right}"
    return None


def _piece(value: ast.Value) -> str | None:
    if isinstance(value, ast.Word):
        return value.text
    if isinstance(value, ast.Number) and isinstance(value.value, int):
        return value.text
    return None


class OnOffOrCount(Kind):
    """``on``, ``off`` or a whole number of pieces (at least 1): a switch whose ``on`` lets
    the compiler choose how many, as ``optimize.tp_overlap``."""

    noun = "on, off or a number of chunks"

    def read(self, value, scope):
        if isinstance(value, ast.Number) and not value.suffix and \
                isinstance(value.value, int) and not isinstance(value.value, bool):
            if value.value < 1:
                raise Problem(f"expected at least 1 chunk, got {value.value}", value.span,
                              "1 chunk is off; 2 or more split each collective into that "
                              "many pieces")
            return value.value
        if isinstance(value, ast.Word):
            if value.text in BOOLEAN_WORDS:
                return BOOLEAN_WORDS[value.text]
            raise Problem(f"expected on, off or a number of chunks, got '{value.text}'",
                          value.span, did_you_mean(value.text, BOOLEAN_WORDS) or
                          "on lets the cost model choose the chunk count; 2, 4, ... force it")
        raise self.mismatch(value)


@dataclass(frozen=True)
class Choice(Kind):
    words: tuple[str, ...]

    @property
    def noun(self) -> str:
        return "one of " + join_words(self.words)

    def read(self, value, scope):
        text = word_text(value)
        if text is None:
            if isinstance(value, ast.Number) and not value.suffix and str(value.value) in self.words:
                return str(value.value)
            raise self.mismatch(value)
        if text not in self.words:
            raise Problem(f"unknown value '{text}'; expected {join_words(self.words)}",
                          value.span, did_you_mean(text, self.words))
        return text


@dataclass(frozen=True)
class Quantity(Kind):
    dimension: str

    @property
    def noun(self) -> str:
        return f"a {self.dimension} such as {EXAMPLES[self.dimension]}"

    def read(self, value, scope):
        if not isinstance(value, ast.Number):
            raise self.mismatch(value)
        check_literal(value)
        if not value.suffix:
            raise Problem(f"{value.text} needs a unit: expected {self.noun}", value.span,
                          f"write it as, for example, {value.text}{EXAMPLES[self.dimension].lstrip('0123456789.')}")
        if value.suffix not in UNITS:
            raise Problem(f"unknown unit '{value.suffix}' in '{value.text}'", value.span,
                          did_you_mean(value.suffix, units_of(self.dimension)))
        dimension, scale = UNITS[value.suffix]
        if dimension != self.dimension:
            raise Problem(f"expected {self.noun}, got the {dimension} {value.text}", value.span)
        # Divide by the inverse of sub-unit scales so that 5us is exactly 5e-06.
        result = (float(value.value) / round(1 / scale) if scale < 1 and round(1 / scale) > 1
                  else float(value.value) * scale)
        if result == float("inf"):
            raise Problem(f"{value.text} is out of range", value.span)
        if not 0 < result:
            raise Problem(f"expected a positive {self.dimension}, got {value.text}", value.span)
        return self.within(result, value)

    def within(self, result: float, value) -> float:
        """``result`` if it lies in its dimension's range (planc.vocabulary.units.RANGES)."""
        low, high = RANGES[self.dimension]
        if not low <= result <= high:
            unit = SI_UNITS[self.dimension]
            raise Problem(f"{value.text} is out of range: a {self.dimension} from "
                          f"{low:g}{unit} to {high:g}{unit}", value.span)
        return result


class Time(Quantity):
    """Latencies may be zero."""

    def read(self, value, scope):
        if isinstance(value, ast.Number) and value.value == 0 and not value.suffix:
            return 0.0
        if isinstance(value, ast.Number) and value.value == 0 and value.suffix in UNITS:
            if UNITS[value.suffix][0] == TIME:
                return 0.0
        return super().read(value, scope)


@dataclass(frozen=True)
class Key:
    """One key of a block: its kind, its default and one line saying what it sets."""

    kind: Kind
    # A value, a function of the block's Scope, or None: no default (required if
    # ``required``, otherwise decided later from other blocks).
    default: Any = None
    required: bool = False
    doc: str = ""
    # No value unless given (or set by a preset): the family then derives it (llama's
    # head_dim, hidden / heads), and the model holds it only when set, so that plans
    # without it keep their plan.json.
    optional: bool = False
