"""Text to syntax tree: the lark LALR parser, syntax diagnostics and error recovery.

The grammar lives in ``grammars/plan.lark`` (shipped inside the wheel as
``planc/grammars/plan.lark``). The tree is built while parsing by an inline lark
transformer, so even very long or deeply nested inputs never recurse in Python.

Recovery, as in most compilers: after a syntax error the offending line is blanked
(its brackets kept, so blocks stay balanced) and the file is parsed again, so one run
reports every independent syntax error. Errors in the bracket structure itself stop
recovery, since everything after them would be noise.

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
from lark import Token, Transformer, v_args
from lark.lark import PostLex

from planc.diagnostics import Diagnostic, Span, error
from planc.lang import ast, lalr
from planc.lang.recovery import (closer_for, describe_expected, describe_token,
                                  nested_too_deep, syntax_errors, unexpected_character)
from planc.lang.units import UNITS

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


def _span(token: Token) -> Span:
    return Span(token.line, token.column, token.end_line, token.end_column)


def _span_of(item) -> Span:
    return _span(item) if isinstance(item, Token) else item.span


def _unescape(text: str) -> str:
    try:
        return python_ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text[1:-1]


@v_args(inline=True)
class _TreeBuilder(Transformer):
    """Inline transformer: runs on each LALR reduction, producing planc.lang.ast nodes."""

    def number(self, token):
        text = str(token)
        if text.isdigit() and len(text) <= MAX_DIGITS:  # the common case, without regexes
            return ast.Number(text, int(text), "", _span(token))
        digits, suffix = _NUMBER.fullmatch(text).groups()
        if not _WELL_FORMED.fullmatch(digits):
            return ast.Number(str(token), 0, suffix, _span(token), malformed=True)
        is_float = "." in digits or "e" in digits.lower()
        if len(digits) > MAX_DIGITS:
            value = float("inf")
        else:
            value = float(digits) if is_float else int(digits)
        return ast.Number(str(token), value, suffix, _span(token))

    def word(self, token):
        return ast.Word(str(token), _span(token))

    def string(self, token):
        return ast.String(_unescape(str(token)), _span(token))

    def _binop(self, left, op, right):
        return ast.BinOp(str(op), left, right, left.span.to(right.span))

    add = sub = mul = div = _binop

    def neg(self, minus, operand):
        return ast.Neg(operand, _span(minus).to(operand.span))

    def pos(self, plus, operand):
        return dataclasses.replace(operand, span=_span(plus).to(operand.span))

    def paren(self, lpar, inner, rpar):
        return dataclasses.replace(inner, span=_span(lpar).to(_span(rpar)))

    def range(self, first, dots, last):
        return ast.Range(first, last, first.span.to(last.span))

    def list(self, lsqb, *rest):
        items = tuple(x for x in rest[:-1] if x is not None and not isinstance(x, Token))
        return ast.ListValue(items, _span(lsqb).to(_span(rest[-1])))

    def call(self, name, lpar, *rest):
        args = tuple(x for x in rest[:-1] if x is not None and not isinstance(x, Token))
        return ast.Call(str(name), _span(name), args, _span(name).to(_span(rest[-1])))

    def keyword_arg(self, name, equal, value):
        return ast.Argument(str(name), _span(name), value, _span(name).to(value.span))

    def positional_arg(self, value):
        return ast.Argument(None, None, value, value.span)

    def assign(self, key, equal, value):
        return ast.Assign(str(key), _span(key), value, _span(key).to(value.span))

    def dashed(self, *tokens):
        return ast.Word("".join(map(str, tokens)), _span(tokens[0]).to(_span(tokens[-1])))

    def block(self, name, label, lbrace, *rest):
        entries = tuple(x for x in rest[:-1] if not isinstance(x, Token))
        return ast.Block(str(name), _span(name), label.text if label else None,
                         label.span if label else None, entries,
                         _span(name).to(_span(rest[-1])))

    def plan(self, keyword, name, lbrace, *rest):
        entries = tuple(x for x in rest[:-1] if not isinstance(x, Token))
        return ast.PlanFile(name.text, name.span, entries, _span(keyword).to(_span(rest[-1])))

    def start(self, plan):
        return plan


@lru_cache(maxsize=1)
def _parser() -> lark.Lark:
    return lark.Lark(grammar_text(), parser="lalr", lexer="contextual",
                     postlex=_BracketAwareNewlines(), transformer=_TreeBuilder(),
                     maybe_placeholders=True)


@lru_cache(maxsize=1)
def _value_parser() -> lark.Lark:
    """The same grammar started at ``value``: what may follow '=', for --set overrides."""
    return lark.Lark(grammar_text(), parser="lalr", lexer="contextual", start="value",
                     postlex=_BracketAwareNewlines(), transformer=_TreeBuilder(),
                     maybe_placeholders=True)


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
    return lalr.tables_of(_parser())


def parse(text: str) -> tuple[ast.PlanFile | None, list[Diagnostic]]:
    """Parse a whole file; return the tree (None after any syntax error) and every
    syntax error, found in one more pass over the text (planc/lang/recovery.py)."""
    try:
        return lalr.parse(text, _tables(), MAX_NESTING), []
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
        return _value_parser().parse(text), None
    except (lark.exceptions.UnexpectedInput, _NestingTooDeep) as exc:
        return None, _diagnose_value(exc, text)


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
                         f"is never closed", _span(first), f"add '{closer_for(first)}' to "
                         f"close it")
        if not tokens:
            return error("no value", _end_of_text_span(text), "write a value after '='")
        return error(f"unexpected end of the value; expected "
                     f"{describe_expected(_accepted(exc), None, _END_OF_VALUE)}",
                     _end_of_text_span(text))
    opened = _open_brackets(tokens, token.start_pos)
    innermost = opened[-1].type if opened else None
    span = _span(token) if token.type != "_NL" else Span.point(token.line, token.column)
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
