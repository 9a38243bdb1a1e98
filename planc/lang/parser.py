"""Text to syntax tree: the grammar, the tree builders, and syntax diagnostics.

The grammar lives in ``grammars/plan.lark`` (shipped inside the wheel as
``planc/grammars/plan.lark``). lark turns it into LALR(1) tables; planc/lang/lalr.py runs
them and calls the builders below on each reduction, so even very long or deeply nested
inputs never recurse in Python.

A file that does not parse is read once more by planc/lang/recovery.py, which reports
every independent syntax error in one pass, as most compilers do.

:func:`parse_value` reads one value (what follows '=') with the same grammar, for
command-line overrides (``--set KEY=VALUE``, planc/lang/overrides.py).
"""

from __future__ import annotations

import ast as python_ast
import dataclasses
import re
from functools import lru_cache
from importlib import resources
from pathlib import Path

import lark
from lark import Token
from lark.lark import PostLex

from planc.diagnostics import Diagnostic, Span, error
from planc.lang import lalr, lalr_tables
from planc.vocabulary import ast
from planc.lang.recovery import (closer_for, describe_expected, describe_token,
                                  nested_too_deep, span_of, syntax_errors,
                                  unexpected_character)
from planc.vocabulary.units import UNITS

MAX_NESTING = 64

_OPENERS = {"LPAR": "(", "LSQB": "[", "LBRACE": "{"}
_CLOSERS = {"RPAR": "LPAR", "RSQB": "LSQB", "RBRACE": "LBRACE"}
_NUMBER = re.compile(r"([0-9][0-9_]*(?:\.[0-9_]+)?(?:[eE][+-]?[0-9_]+)?)(.*)", re.S)
# Underscores may only separate digits: 1_024, not 1__024, 1_ or 1_e5.
_WELL_FORMED = re.compile(r"[0-9](?:_?[0-9])*(?:\.[0-9](?:_?[0-9])*)?(?:[eE][+-]?[0-9]+)?")
MAX_DIGITS = 100  # longer literals are out of range for every key (and for int())


def grammar_text() -> str:
    """The grammar, from the installed package or, in a source checkout, from grammars/."""
    packaged = resources.files("planc") / "grammars" / "plan.lark"
    if packaged.is_file():
        return packaged.read_text(encoding="utf-8")
    return (Path(__file__).resolve().parents[2] / "grammars" / "plan.lark").read_text(
        encoding="utf-8")


class _NestingTooDeep(lark.exceptions.LarkError):
    """Raised by the post-lexer of the parsers at the first bracket nested too deep.

    A LarkError, so that whatever handles lark's errors handles this one too; but only
    the parsers raise it: the lexer that diagnoses syntax errors has no limit."""

    def __init__(self, token: Token):
        super().__init__(f"brackets nested more than {MAX_NESTING} deep")
        self.token = token


class _BracketAwareNewlines(PostLex):
    """Drops newlines inside ( ) and [ ] so lists and calls may span lines, and stops
    at brackets nested more than ``max_nesting`` deep (None: no limit)."""

    always_accept = ("_NL",)

    def __init__(self, max_nesting: int | None = MAX_NESTING):
        self.max_nesting = max_nesting

    def process(self, stream):
        open_brackets: list[str] = []
        for token in stream:
            kind = token.type
            if kind in _OPENERS:
                open_brackets.append(kind)
                if self.max_nesting is not None and len(open_brackets) > self.max_nesting:
                    raise _NestingTooDeep(token)
            elif kind in _CLOSERS:
                if open_brackets and open_brackets[-1] == _CLOSERS[kind]:
                    open_brackets.pop()
            elif kind == "_NL" and open_brackets and open_brackets[-1] != "LBRACE":
                continue
            yield token


def _at(piece: lalr.Piece) -> Span:
    return Span(piece[1], piece[2], piece[3], piece[4])


def _string_node(text: str, span: Span) -> ast.String:
    """A quoted string, its escapes decoded as Python's; one whose escapes do not decode
    (``"\\u12"``) keeps its text and says why, for the checker to report at its span."""
    try:
        return ast.String(python_ast.literal_eval(text), span)
    except (ValueError, SyntaxError) as exc:
        reason = str(getattr(exc, "msg", exc) or exc).rpartition(": ")[2]
        return ast.String(text[1:-1], span, reason or "an escape that does not decode")


# --- the tree builders: one per rule (or alias) of the grammar, each taking its children
# (tokens as lalr.Pieces) and returning a planc.vocabulary.ast node; lalr runs them on each
# reduction, so even very long or deeply nested inputs never recurse in Python.


def _number(children):
    return _number_node(children[0][0], _at(children[0]))


def _number_node(text: str, span: Span) -> ast.Number:
    if text.isdigit() and len(text) <= MAX_DIGITS:  # the common case, without regexes
        return ast.Number(text, int(text), "", span)
    digits, suffix = _NUMBER.fullmatch(text).groups()
    if not _WELL_FORMED.fullmatch(digits):
        return ast.Number(text, 0, suffix, span, malformed=True)
    is_float = "." in digits or "e" in digits.lower()
    if len(digits) > MAX_DIGITS:
        value = float("inf")
    else:
        value = float(digits) if is_float else int(digits)
    return ast.Number(text, value, suffix, span)


def _word(children):
    return ast.Word(children[0][0], _at(children[0]))


def _string(children):
    return _string_node(children[0][0], _at(children[0]))


def _binop(children):
    left, op, right = children
    return ast.BinOp(op[0], left, right, left.span.to(right.span))


def _neg(children):
    minus, operand = children
    return ast.Neg(operand, _at(minus).to(operand.span))


def _pos(children):
    plus, operand = children
    return dataclasses.replace(operand, span=_at(plus).to(operand.span))


def _paren(children):
    lpar, inner, rpar = children
    return dataclasses.replace(inner, span=_at(lpar).to(_at(rpar)))


def _range(children):
    first, _, last = children
    return ast.Range(first, last, first.span.to(last.span))


def _list(children):
    items = tuple(x for x in children[1:-1] if x is not None and not isinstance(x, tuple))
    return ast.ListValue(items, _at(children[0]).to(_at(children[-1])))


def _call(children):
    name = children[0]
    args = tuple(x for x in children[2:-1] if x is not None and not isinstance(x, tuple))
    return ast.Call(name[0], _at(name), args, _at(name).to(_at(children[-1])))


def _keyword_arg(children):
    name, _, value = children
    return ast.Argument(name[0], _at(name), value, _at(name).to(value.span))


def _positional_arg(children):
    value = children[0]
    return ast.Argument(None, None, value, value.span)


def _assign(children):
    key, _, value = children
    line, column = key[1], key[2]
    end = value.span
    return ast.Assign(key[0], Span(line, column, key[3], key[4]), value,
                      Span(line, column, end.end_line, end.end_column))


def _dashed(children):
    return ast.Word("".join(piece[0] for piece in children),
                    _at(children[0]).to(_at(children[-1])))


def _block(children):
    name, label = children[0], children[1]
    entries = tuple(x for x in children[3:-1] if not isinstance(x, tuple))
    return ast.Block(name[0], _at(name), label.text if label else None,
                     label.span if label else None, entries,
                     _at(name).to(_at(children[-1])))


def _plan(children):
    keyword, name = children[0], children[1]
    entries = tuple(x for x in children[3:-1] if not isinstance(x, tuple))
    return ast.PlanFile(name.text, name.span, entries, _at(keyword).to(_at(children[-1])))


def _start(children):
    return children[0]


BUILDERS: dict[str, lalr.Builder] = {
    "number": _number, "word": _word, "string": _string,
    "add": _binop, "sub": _binop, "mul": _binop, "div": _binop,
    "neg": _neg, "pos": _pos, "paren": _paren, "range": _range, "list": _list,
    "call": _call, "keyword_arg": _keyword_arg, "positional_arg": _positional_arg,
    "assign": _assign, "dashed": _dashed, "block": _block, "plan": _plan, "start": _start,
}

def _entry(key: str, line: int, key_column: int, key_end: int, atom: str, text: str,
           column: int, end: int) -> ast.Assign:
    """``key = value`` on one line with a one-token value: what _assign makes of it, with
    _number, _word or _string for the value, made without their children lists."""
    span = Span(line, column, line, end)
    if atom == "NUMBER":
        value = _number_node(text, span)
    elif atom == "NAME":
        value = ast.Word(text, span)
    else:
        value = _string_node(text, span)
    return ast.Assign(key, Span(line, key_column, line, key_end), value,
                      Span(line, key_column, line, end))


# The entry most plan lines are: a key, '=', one token, a comment perhaps, then a new
# line or ';' (lalr_tables.EntryShape).
_ENTRY = lalr_tables.EntryShape(
    rule="assign", key="NAME", equal="EQUAL", value="value", atoms=("NUMBER", "NAME", "STRING"),
    separator=r";|\r?\n", blank=r"[ \t\f\r]*", tail=r"[ \t\f\r]*(?:#[^\n]*)?",
    build=_entry)


@lru_cache(maxsize=1)
def _parser() -> lark.Lark:
    return lark.Lark(grammar_text(), parser="lalr", lexer="contextual",
                     postlex=_BracketAwareNewlines(), maybe_placeholders=True)


@lru_cache(maxsize=1)
def _value_parser() -> lark.Lark:
    """The same grammar started at ``value``: what may follow '=', for --set overrides
    (lark's own loop runs it only to describe a value that does not parse)."""
    return lark.Lark(grammar_text(), parser="lalr", lexer="contextual", start="value",
                     postlex=_BracketAwareNewlines(), maybe_placeholders=True)


@lru_cache(maxsize=1)
def _lexer() -> lark.Lark:
    """The parser's terminals and newline rule without its nesting limit, for diagnosing
    syntax errors: the text is lexed to its end, however deep its brackets go (only
    parsing stops at the limit, which keeps every tree shallow)."""
    return lark.Lark(grammar_text(), parser="lalr", lexer="basic",
                     postlex=_BracketAwareNewlines(max_nesting=None))


# --- the whole file ----------------------------------------------------------------


@lru_cache(maxsize=1)
def _tables() -> lalr.Tables:
    return lalr_tables.tables_of(_parser(), BUILDERS, _ENTRY)


@lru_cache(maxsize=1)
def _value_tables() -> lalr.Tables:
    return lalr_tables.tables_of(_value_parser(), BUILDERS)


def parse(text: str, fast: bool = True) -> tuple[ast.PlanFile | None, list[Diagnostic]]:
    """Parse a whole file; return the tree (None after any syntax error) and every
    syntax error, found in one more pass over the text (planc/lang/recovery.py).
    ``fast`` takes common entries whole (lalr_tables.EntryShape); the outcome is the same."""
    try:
        return lalr.parse(text, _tables(), MAX_NESTING, fast), []
    except lalr.Stop:
        pass
    return None, syntax_errors(text, _tables(), MAX_NESTING)


# --- helpers for one value's diagnostics (lark's own lexer and exceptions) ----------


def _end_of_text_span(text: str) -> Span:
    end = lalr.end_token(text)
    return Span.point(end.line, end.column)


def _tokens(text: str) -> list[Token]:
    """Every token of ``text`` (newlines included) up to the first one that cannot be lexed."""
    tokens: list[Token] = []
    try:
        for token in _lexer().lex(text, dont_ignore=False):
            tokens.append(token)
    except lark.exceptions.LarkError:
        pass
    return tokens


def _open_brackets(tokens: list[Token], before: int) -> list[Token]:
    """The brackets still open before character offset ``before``."""
    stack: list[Token] = []
    for token in tokens:
        if token.start_pos >= before:
            break
        if token.type in _OPENERS:
            stack.append(token)
        elif token.type in _CLOSERS and stack and stack[-1].type == _CLOSERS[token.type]:
            stack.pop()
    return stack


def _accepted(exc: lark.exceptions.UnexpectedToken) -> set[str]:
    """What the parser would have taken here. Errors raised by the contextual lexer list
    every terminal of the lexer state (newlines included); the parser knows better."""
    parser = getattr(exc, "interactive_parser", None)
    if parser is not None:
        try:
            return set(parser.accepts())
        except lark.exceptions.LarkError:
            pass
    return set(exc.expected)


# --- one value, for command-line overrides -----------------------------------------

_END_OF_VALUE = "the end of the value"


def parse_value(text: str) -> tuple[ast.Value | None, Diagnostic | None]:
    """Parse one value, as written after '=' in a file (for ``--set KEY=VALUE``).

    Blanks count as columns, so a caller may blank out what precedes the value to have
    positions count from the start of its own text. Returns the value and None, or None
    and the diagnostic of the first syntax error (there is no recovery in one value).
    """
    try:
        return lalr.parse(text, _value_tables(), MAX_NESTING), None
    except lalr.Stop:
        pass
    try:
        _value_parser().parse(text)
    except (lark.exceptions.UnexpectedInput, _NestingTooDeep) as exc:
        return None, _diagnose_value(exc, text)
    raise AssertionError(f"lark parses the value {text!r} that planc's machine refused")


def _diagnose_value(exc: Exception, text: str) -> Diagnostic:
    if isinstance(exc, _NestingTooDeep):
        return nested_too_deep(exc.token, MAX_NESTING)
    tokens = _tokens(text)
    if isinstance(exc, lark.exceptions.UnexpectedCharacters):
        char = text[exc.pos_in_stream] if exc.pos_in_stream < len(text) else ""
        return unexpected_character(Token("_BAD", char, exc.pos_in_stream, exc.line,
                                          exc.column), "")
    assert isinstance(exc, lark.exceptions.UnexpectedToken)
    token = exc.token
    if token.type == "$END":
        opened = _open_brackets(tokens, len(text))
        if opened:
            first = opened[-1]
            return error(f"unexpected end of the value: '{first}' at column {first.column} "
                         f"is never closed", span_of(first), f"add '{closer_for(first)}' to "
                         f"close it")
        if not tokens:
            return error("no value", _end_of_text_span(text), "write a value after '='")
        return error(f"unexpected end of the value; expected "
                     f"{describe_expected(_accepted(exc), None, _END_OF_VALUE)}",
                     _end_of_text_span(text))
    opened = _open_brackets(tokens, token.start_pos)
    innermost = opened[-1].type if opened else None
    span = span_of(token) if token.type != "_NL" else Span.point(token.line, token.column)
    if token.type in _CLOSERS and innermost != _CLOSERS[token.type]:
        if opened:
            first = opened[-1]
            return error(f"unexpected '{token}': '{first}' at column {first.column} is not "
                         f"closed", span, f"add '{closer_for(first)}' before it")
        return error(f"unexpected '{token}': it closes nothing", span)
    before = [t for t in tokens if t.end_pos <= token.start_pos]
    previous = before[-1] if before else None
    hints = []
    if (token.type == "NAME" and previous is not None and previous.type == "NUMBER"
            and str(token) in UNITS):
        hints.append(f"write the unit right after the number, without a space: "
                     f"{previous}{token}")
    return error(f"unexpected {describe_token(token)}; expected "
                 f"{describe_expected(_accepted(exc), innermost, _END_OF_VALUE)}", span,
                 *hints)
