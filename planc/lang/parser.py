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
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path

import lark
from lark import Token, Transformer, v_args
from lark.lark import PostLex

from planc.diagnostics import Diagnostic, Span, error
from planc.lang import ast
from planc.lang.units import UNITS

MAX_NESTING = 64
MAX_SYNTAX_ERRORS = 20

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
        digits, suffix = _NUMBER.fullmatch(str(token)).groups()
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


# --- syntax diagnostics ------------------------------------------------------------

_TERMINAL_WORDS = {
    "NAME": "a name", "NUMBER": "a number", "STRING": "a string", "PLAN": "'plan'",
    "LBRACE": "'{'", "RBRACE": "'}'", "LSQB": "'['", "RSQB": "']'", "LPAR": "'('",
    "RPAR": "')'", "EQUAL": "'='", "COMMA": "','", "DOTDOT": "'..'", "PLUS": "'+'",
    "MINUS": "'-'", "STAR": "'*'", "SLASH": "'/'", "SEMICOLON": "';'", "_NL": "a new line",
    "$END": "the end of the file",
}
_VALUE_STARTS = {"NUMBER", "NAME", "STRING", "LSQB", "LPAR", "MINUS", "PLUS"}


def _describe_token(token: Token) -> str:
    if token.type == "$END":
        return "end of file"
    if token.type == "_NL":
        return "end of line"
    if token.type in ("NAME", "NUMBER"):
        return f"'{token}'"
    if token.type == "STRING":
        return "a string"
    return _TERMINAL_WORDS.get(token.type, f"'{token}'")


def _describe_expected(expected: set[str], innermost: str | None,
                       end: str = "the end of the file") -> str:
    """Name what could come next, leaving out closers of brackets that are not open.
    ``end`` names the end of the text ($END)."""
    wanted = {t for t in expected
              if t not in _CLOSERS or _CLOSERS[t] == innermost}
    if innermost in ("LSQB", "LPAR"):
        wanted -= {"_NL", "SEMICOLON"}  # new lines mean nothing inside brackets
    else:
        wanted.discard("COMMA")
    if wanted & {"RSQB", "RPAR", "RBRACE", "COMMA", "_NL", "$END"}:
        wanted -= {"PLUS", "MINUS", "STAR", "SLASH", "DOTDOT"}  # "after a value", briefly
    names = {**_TERMINAL_WORDS, "$END": end}
    if _VALUE_STARTS <= wanted:
        words = ["a value"] + sorted(names.get(t, t) for t in wanted - _VALUE_STARTS)
    else:
        words = sorted({names.get(t, t) for t in wanted})
    if len(words) == 1:
        return words[0]
    return ", ".join(words[:-1]) + " or " + words[-1]


def _end_of_text_span(text: str) -> Span:
    lines = text.split("\n")
    return Span.point(len(lines), len(lines[-1]) + 1)


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


def _closer_for(opener: Token) -> str:
    return {"LPAR": ")", "LSQB": "]", "LBRACE": "}"}[opener.type]


@dataclass(frozen=True)
class _SyntaxProblem:
    diagnostic: Diagnostic
    # Character range to blank before parsing again; None when recovery would be noise.
    blank: tuple[int, int] | None
    keep_braces: bool = False  # the range may hold unbalanced braces


def _brackets_inside_block(tokens: list[Token], offset: int) -> int:
    """How many ( and [ enclose ``offset`` inside its innermost block."""
    count = 0
    for opener in reversed(_open_brackets(tokens, offset)):
        if opener.type == "LBRACE":
            break
        count += 1
    return count


def _entry_start(tokens: list[Token], index: int, in_brackets: int) -> int:
    """Index of the first token of the entry holding token ``index``."""
    start, depth, to_leave = index, 0, in_brackets
    for i in range(index - 1, -1, -1):
        kind = tokens[i].type
        if kind in _CLOSERS:
            depth += 1
        elif kind in _OPENERS:
            if depth > 0:
                depth -= 1
            elif kind == "LBRACE":
                break
            else:
                to_leave -= 1
        elif depth == 0 and to_leave == 0 and kind in ("_NL", "SEMICOLON"):
            break
        start = i
    return start


def _entry_around(tokens: list[Token], offset: int) -> tuple[int, int] | None:
    """Character range of the whole entry holding the token at ``offset``.

    The entry runs between block-level separators (new line or ';', outside any
    ( or [ ), so a mistake inside a list drops the whole list and nothing else. The
    range holds balanced brackets, or None is returned.
    """
    index = next((i for i, t in enumerate(tokens) if t.start_pos >= offset), len(tokens))
    in_brackets = _brackets_inside_block(tokens, offset)
    start = _entry_start(tokens, index, in_brackets)
    end, depth, to_close = index, 0, in_brackets
    for i in range(index, len(tokens)):
        kind = tokens[i].type
        if kind in _OPENERS:
            depth += 1
        elif kind in _CLOSERS:
            if depth > 0:
                depth -= 1
            elif kind == "RBRACE" or to_close == 0:
                break
            else:
                to_close -= 1
        elif depth == 0 and to_close == 0 and kind in ("_NL", "SEMICOLON"):
            break
        end = i + 1
    if end <= start or to_close or depth:
        return None
    return tokens[start].start_pos, tokens[end - 1].end_pos


def _rest_of_line(text: str, tokens: list[Token], offset: int) -> tuple[int, int]:
    """For text the lexer rejects: from its entry's start to the end of its line."""
    index = len(tokens)  # lexing stopped at offset
    start_index = _entry_start(tokens, index, _brackets_inside_block(tokens, offset))
    start = tokens[start_index].start_pos if start_index < index else offset
    end = text.find("\n", offset)
    return start, len(text) if end < 0 else end


def _diagnose(exc: Exception, text: str) -> _SyntaxProblem:
    if isinstance(exc, _NestingTooDeep):
        return _SyntaxProblem(error(f"brackets nested more than {MAX_NESTING} deep",
                                    _span(exc.token)), None)
    tokens = _tokens(text)
    if isinstance(exc, lark.exceptions.UnexpectedCharacters):
        span = Span.point(exc.line, exc.column)
        offset = exc.pos_in_stream
        inside_plan = bool(_open_brackets(tokens, offset))
        char = text[offset] if offset < len(text) else ""
        if char == '"':
            return _SyntaxProblem(error("unterminated string", span,
                                        "a string ends with '\"' on the same line"),
                                  _rest_of_line(text, tokens, offset) if inside_plan else None,
                                  keep_braces=True)
        shown = f"'{char}'" if char.isprintable() else f"U+{ord(char):04X}"
        return _SyntaxProblem(error(f"unexpected character {shown}", span),
                              _rest_of_line(text, tokens, offset) if inside_plan else None,
                              keep_braces=True)
    assert isinstance(exc, lark.exceptions.UnexpectedToken)
    token = exc.token
    if token.type == "$END":
        return _unexpected_end(exc, text, tokens)
    offset = token.start_pos
    opened = _open_brackets(tokens, offset)
    innermost = opened[-1].type if opened else None
    span = _span(token) if token.type != "_NL" else Span.point(token.line, token.column)
    if token.type in _CLOSERS and innermost != _CLOSERS[token.type]:
        if opened:
            first = opened[-1]
            return _SyntaxProblem(error(
                f"unexpected '{token}': '{first}' opened at line {first.line}, column "
                f"{first.column} is not closed", span, f"add '{_closer_for(first)}' before it"),
                None)
        return _SyntaxProblem(error(f"unexpected '{token}': it closes nothing", span), None)
    accepted = _accepted(exc)
    before = [t for t in tokens if t.end_pos <= offset and t.type != "_NL"]
    previous = before[-1] if before else None
    if previous is not None and previous.type == "EQUAL" and token.type in ("_NL", "RBRACE",
                                                                            "SEMICOLON"):
        return _SyntaxProblem(error("expected a value after '='", _span(previous)),
                              _entry_around(tokens, offset) if opened else None)
    message = f"unexpected {_describe_token(token)}; expected {_describe_expected(accepted, innermost)}"
    hints = []
    if not opened:
        closer = _plan_closer(tokens, offset)
        if closer is not None and token.type != "PLAN":
            hints.append(f"the '}}' at line {closer.line}, column {closer.column} closes the "
                         f"plan; remove it if the plan goes on")
        elif token.type == "PLAN":
            hints.append("a file holds exactly one plan")
    elif (token.type == "NAME" and previous is not None and previous.type == "NUMBER"
          and str(token) in UNITS):
        hints.append(f"write the unit right after the number, without a space: "
                     f"{previous}{token}")
    elif token.type == "NAME" and "LBRACE" in accepted and "EQUAL" not in accepted:
        hints.append("a block starts with one or two words and '{', as in 'model gpt {'")
    elif token.type in ("NAME", "NUMBER") and "EQUAL" in accepted:
        hints.append("a key and its value are written 'key = value'")
    elif (previous is not None and "_NL" in accepted and innermost == "LBRACE"
          and previous.type in ("NAME", "NUMBER", "STRING", "RSQB", "RPAR")):
        hints.append("separate entries with a new line or ';'")
    return _SyntaxProblem(error(message, span, *hints),
                          _entry_around(tokens, offset) if opened else None)


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


def _plan_closer(tokens: list[Token], offset: int) -> Token | None:
    """The '}' that closed the plan before ``offset``, if the plan was closed."""
    depth = 0
    for token in tokens:
        if token.start_pos >= offset:
            break
        if token.type == "LBRACE":
            depth += 1
        elif token.type == "RBRACE":
            depth -= 1
            if depth == 0:
                return token
    return None


def _unexpected_end(exc, text: str, tokens: list[Token]) -> _SyntaxProblem:
    span = _end_of_text_span(text)
    opened = _open_brackets(tokens, len(text))
    if opened:
        first = _likely_unclosed(text, tokens) or opened[-1]
        return _SyntaxProblem(error(
            f"unexpected end of file: '{first}' opened at line {first.line} is never closed",
            _span(first), f"add '{_closer_for(first)}' to close it"), None)
    if not any(t.type != "_NL" for t in tokens):
        return _SyntaxProblem(error("the file holds no plan", span,
                                    "a plan file holds one 'plan NAME { ... }'"), None)
    return _SyntaxProblem(error(
        f"unexpected end of file; expected {_describe_expected(_accepted(exc), None)}",
        span), None)


def _indent(text: str, token: Token) -> int:
    line = text.split("\n")[token.line - 1]
    return len(line) - len(line.lstrip(" \t"))


def _likely_unclosed(text: str, tokens: list[Token]) -> Token | None:
    """The brace that is probably missing its '}', judged by indentation as rustc does:
    the first '{' whose matching '}' sits at a smaller indentation than the line that
    opened it."""
    stack: list[Token] = []
    for token in tokens:
        if token.type == "LBRACE":
            stack.append(token)
        elif token.type == "RBRACE" and stack:
            opener = stack.pop()
            if _indent(text, token) < _indent(text, opener) and opener.line != token.line:
                return opener
    return None


def _blank(text: str, start: int, end: int, keep_braces: bool) -> str:
    """Replace text[start:end] by spaces, keeping new lines (so positions stay the same)
    and, if asked, braces (so the block structure does)."""
    kept = "\n{}" if keep_braces else "\n"
    return text[:start] + "".join(c if c in kept else " " for c in text[start:end]) + text[end:]


def parse(text: str) -> tuple[ast.PlanFile | None, list[Diagnostic]]:
    """Parse a whole file; return the tree (None after any syntax error) and diagnostics."""
    diagnostics: list[Diagnostic] = []
    attempt = text
    while len(diagnostics) < MAX_SYNTAX_ERRORS:
        try:
            tree = _parser().parse(attempt)
        except (lark.exceptions.UnexpectedInput, _NestingTooDeep) as exc:
            problem = _diagnose(exc, attempt)
            repeated = problem.diagnostic in diagnostics
            diagnostics.append(problem.diagnostic) if not repeated else None
            if problem.blank is None or repeated:
                break
            attempt = _blank(attempt, *problem.blank, problem.keep_braces)
            continue
        return (tree if not diagnostics else None), diagnostics
    return None, diagnostics


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
        return error(f"brackets nested more than {MAX_NESTING} deep", _span(exc.token))
    tokens = _tokens(text)
    if isinstance(exc, lark.exceptions.UnexpectedCharacters):
        span = Span.point(exc.line, exc.column)
        char = text[exc.pos_in_stream] if exc.pos_in_stream < len(text) else ""
        if char == '"':
            return error("unterminated string", span, "a string ends with '\"'")
        shown = f"'{char}'" if char.isprintable() else f"U+{ord(char):04X}"
        return error(f"unexpected character {shown}", span)
    assert isinstance(exc, lark.exceptions.UnexpectedToken)
    token = exc.token
    if token.type == "$END":
        opened = _open_brackets(tokens, len(text))
        if opened:
            first = opened[-1]
            return error(f"unexpected end of the value: '{first}' at column {first.column} "
                         f"is never closed", _span(first), f"add '{_closer_for(first)}' to "
                         f"close it")
        if not tokens:
            return error("no value", _end_of_text_span(text), "write a value after '='")
        return error(f"unexpected end of the value; expected "
                     f"{_describe_expected(_accepted(exc), None, _END_OF_VALUE)}",
                     _end_of_text_span(text))
    opened = _open_brackets(tokens, token.start_pos)
    innermost = opened[-1].type if opened else None
    span = _span(token) if token.type != "_NL" else Span.point(token.line, token.column)
    if token.type in _CLOSERS and innermost != _CLOSERS[token.type]:
        if opened:
            first = opened[-1]
            return error(f"unexpected '{token}': '{first}' at column {first.column} is not "
                         f"closed", span, f"add '{_closer_for(first)}' before it")
        return error(f"unexpected '{token}': it closes nothing", span)
    before = [t for t in tokens if t.end_pos <= token.start_pos]
    previous = before[-1] if before else None
    hints = []
    if (token.type == "NAME" and previous is not None and previous.type == "NUMBER"
            and str(token) in UNITS):
        hints.append(f"write the unit right after the number, without a space: "
                     f"{previous}{token}")
    return error(f"unexpected {_describe_token(token)}; expected "
                 f"{_describe_expected(_accepted(exc), innermost, _END_OF_VALUE)}", span,
                 *hints)
