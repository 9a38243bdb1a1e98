"""Every syntax error of a file, found in one pass.

Recovery as in yacc's panic mode, at the grain of the language's entries: the machine
of :mod:`planc.lang.lalr` runs on parser states alone, saving the state stack where each
entry of a block begins (a few states: the blocks around it). At a token that cannot
come, the error is reported, the stack goes back to the entry's start and the rest of
the entry is skipped, up to the next ';' or new line outside brackets, or the '}' that
closes its block. After an unexpected character, the skip runs to the end of its line,
whatever brackets it holds. Errors in the bracket structure itself (a closer that
closes nothing, the end of the file inside a block, brackets nested too deep) end the
search, since everything after them would be noise.

Each token is read once, and each error costs the length of its entry, so a file with N
syntax errors costs O(N + size), not N parses.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from planc.diagnostics import Diagnostic, Span, error
from planc.diagnostics import line_starts as lexer_line_starts
from planc.lang import lalr
from planc.lang.lalr import CLOSERS, END, NEWLINE, OPENERS, Lexeme, Tables
from planc.vocabulary.units import UNITS

TERMINAL_WORDS = {
    "NAME": "a name", "NUMBER": "a number", "STRING": "a string", "PLAN": "'plan'",
    "LBRACE": "'{'", "RBRACE": "'}'", "LSQB": "'['", "RSQB": "']'", "LPAR": "'('",
    "RPAR": "')'", "EQUAL": "'='", "COMMA": "','", "DOTDOT": "'..'", "PLUS": "'+'",
    "MINUS": "'-'", "STAR": "'*'", "SLASH": "'/'", "SEMICOLON": "';'", "_NL": "a new line",
    "$END": "the end of the file",
}
VALUE_STARTS = {"NUMBER", "NAME", "STRING", "LSQB", "LPAR", "MINUS", "PLUS"}
SEPARATORS = (NEWLINE, "SEMICOLON")
# What str.splitlines() breaks at besides LF and CR: not line ends in a plan.
NOT_LINE_ENDS = frozenset("\v\x1c\x1d\x1e\x85\u2028\u2029")


def span_of(token: Lexeme) -> Span:
    return Span(token.line, token.column, token.end_line, token.end_column)


def describe_token(token: Lexeme) -> str:
    if token.type == END:
        return "end of file"
    if token.type == NEWLINE:
        return "end of line"
    if token.type in ("NAME", "NUMBER"):
        return f"'{token}'"
    if token.type == "STRING":
        return "a string"
    return TERMINAL_WORDS.get(token.type, f"'{token}'")


def describe_expected(expected: set[str], innermost: str | None,
                      end: str = "the end of the file") -> str:
    """Name what could come next, leaving out closers of brackets that are not open.
    ``end`` names the end of the text ($END)."""
    wanted = {t for t in expected if t not in CLOSERS or CLOSERS[t] == innermost}
    if innermost in ("LSQB", "LPAR"):
        wanted -= {NEWLINE, "SEMICOLON"}  # new lines mean nothing inside brackets
    else:
        wanted.discard("COMMA")
    if wanted & {"RSQB", "RPAR", "RBRACE", "COMMA", NEWLINE, END}:
        wanted -= {"PLUS", "MINUS", "STAR", "SLASH", "DOTDOT"}  # "after a value", briefly
    names = {**TERMINAL_WORDS, END: end}
    if VALUE_STARTS <= wanted:
        words = ["a value"] + sorted(names.get(t, t) for t in wanted - VALUE_STARTS)
    else:
        words = sorted({names.get(t, t) for t in wanted})
    if len(words) == 1:
        return words[0]
    return ", ".join(words[:-1]) + " or " + words[-1]


def closer_for(opener: Lexeme) -> str:
    return {"LPAR": ")", "LSQB": "]", "LBRACE": "}"}[opener.type]


def unexpected_character(token: Lexeme, hint_end: str = "on the same line") -> Diagnostic:
    span = Span.point(token.line, token.column)
    if str(token) == '"':
        return error("unterminated string", span,
                     "a string ends with '\"'" + (f" {hint_end}" if hint_end else ""))
    char = str(token)
    shown = f"'{char}'" if char.isprintable() else f"U+{ord(char):04X}"
    hint = ("only a new line (LF) ends a line of a plan; this character may appear in "
            "comments and strings only") if char in NOT_LINE_ENDS else ""
    return error(f"unexpected character {shown}", span, hint)


def nested_too_deep(token: Lexeme, limit: int) -> Diagnostic:
    return error(f"brackets nested more than {limit} deep", span_of(token))


@dataclass
class _Reader:
    """The machine, its brackets and what the messages need, over one text."""

    text: str
    tables: Tables
    max_nesting: int
    states: list[int] = field(default_factory=list)
    brackets: list[Lexeme] = field(default_factory=list)  # the open ones, innermost last
    braces: list[Lexeme] = field(default_factory=list)  # every '{' and '}' fed, in order
    previous: Lexeme | None = None  # the last token fed, new lines aside
    plan_closer: Lexeme | None = None  # the '}' that closed the plan
    anything: bool = False  # a token other than a new line was read
    line_starts: list[int] | None = None
    expected_at: dict[tuple[int, ...], set[str]] = field(default_factory=dict)
    described_at: dict[tuple, str] = field(default_factory=dict)

    def expected(self) -> set[str]:
        """What the parser could take next; the same stack gives the same answer, and
        10,000 copies of one mistake meet the same stack 10,000 times."""
        key = tuple(self.states)
        found = self.expected_at.get(key)
        if found is None:
            found = self.expected_at[key] = lalr.expected(self.states, self.tables)
        return found

    def describe_expected(self, innermost: str | None) -> str:
        """describe_expected of what the parser could take next, likewise remembered."""
        key = (tuple(self.states), innermost)
        found = self.described_at.get(key)
        if found is None:
            found = self.described_at[key] = describe_expected(self.expected(), innermost)
        return found

    def indent(self, token: Lexeme) -> int:
        """Blanks before the first token of ``token``'s line."""
        if self.line_starts is None:
            self.line_starts = lexer_line_starts(self.text)
        start = self.line_starts[token.line - 1]
        end = self.text.find("\n", start)
        line = self.text[start:end if end >= 0 else len(self.text)]
        return len(line) - len(line.lstrip(" \t"))


def syntax_errors(text: str, tables: Tables, max_nesting: int) -> list[Diagnostic]:
    """Every syntax error of ``text``, in order (empty if it parses)."""
    reader = _Reader(text, tables, max_nesting, [tables.start])
    diagnostics: list[Diagnostic] = []
    actions = tables.actions
    stream = lalr.tokens(text, tables)
    at_entry_start = False
    checkpoint: list[int] = []
    entry_depth = 0
    for token in stream:
        kind = token.type
        brackets = reader.brackets
        if kind == NEWLINE and brackets and brackets[-1].type != "LBRACE":
            continue
        if kind == "NAME":
            kind = lalr.keyword_or_word(token.text, actions[reader.states[-1]], tables)
        if at_entry_start and kind not in SEPARATORS and kind != "RBRACE":
            checkpoint, entry_depth = list(reader.states), len(brackets)
        if kind == lalr.BAD:
            diagnostics.append(unexpected_character(token))
            recoverable, first, to_line_end = bool(brackets), None, True
        elif kind in OPENERS and len(brackets) >= max_nesting:
            diagnostics.append(nested_too_deep(token, max_nesting))
            return diagnostics
        elif lalr.step(reader.states, None, kind, token, actions):
            _track(reader, token, kind)
            at_entry_start = kind in SEPARATORS or kind in ("LBRACE", "RBRACE")
            continue
        else:
            problem, recoverable = _diagnose(reader, token, kind)
            diagnostics.append(problem)
            first, to_line_end = token, False
        if not recoverable or not checkpoint:
            return diagnostics
        reader.states[:] = checkpoint
        resumed = _skip(reader, stream, entry_depth, first, to_line_end, diagnostics)
        if resumed is None:
            break  # the text ended inside the broken entry
        if not resumed:
            return diagnostics
        at_entry_start = True
    end = lalr.end_token(text)
    lalr.step(reader.states, None, END, end, actions)
    if reader.states[-1] != tables.end:
        diagnostics.append(_unexpected_end(reader))
    return diagnostics


def _track(reader: _Reader, token: Lexeme, kind: str) -> None:
    """Bookkeeping after the machine took ``token``."""
    if kind in OPENERS:
        reader.brackets.append(token)
    elif kind in CLOSERS:
        reader.brackets.pop()
        if not reader.brackets and kind == "RBRACE":
            reader.plan_closer = token
    if kind in ("LBRACE", "RBRACE"):
        reader.braces.append(token)
    if kind != NEWLINE:
        reader.previous, reader.anything = token, True


def _skip(reader: _Reader, stream, entry_depth: int, first: Lexeme | None,
          to_line_end: bool, diagnostics: list[Diagnostic]) -> bool | None:
    """Skip the rest of a broken entry (from ``first`` on, if given), then feed the
    separator or '}' that ends it. True when the machine goes on; False when the bracket
    structure is broken (the search ends there); None when the text ends first."""
    brackets = reader.brackets
    # brackets the entry opened before the error; a skip to the line's end keeps braces only
    opened = [t for t in brackets[entry_depth:] if not to_line_end or t.type == "LBRACE"]
    del brackets[entry_depth:]
    # a generator wrapped around ``stream`` would close it when dropped: chain by hand
    tokens = stream if first is None else itertools.chain((first,), stream)
    for token in tokens:
        kind = token.type
        if kind in OPENERS:
            if to_line_end and kind != "LBRACE":
                continue
            opened.append(token)  # skipped text may nest as deep as it likes
        elif kind in CLOSERS:
            if to_line_end and kind != "RBRACE":
                continue
            if opened:
                if opened[-1].type != CLOSERS[kind]:
                    return False
                opened.pop()
                continue
            if kind != "RBRACE":
                return False
            return _resume(reader, token, kind, diagnostics)
        elif kind in SEPARATORS and not opened:
            if kind == "SEMICOLON" and to_line_end:
                continue
            return _resume(reader, token, kind, diagnostics)
        elif kind == NEWLINE and to_line_end and all(t.type == "LBRACE" for t in opened):
            to_line_end = False  # the line ends inside a block it opened: skip that block
    return None


def _resume(reader: _Reader, token: Lexeme, kind: str, diagnostics: list[Diagnostic]) -> bool:
    """Feed the separator or '}' that ends a skipped entry."""
    if not lalr.step(reader.states, None, kind, token, reader.tables.actions):
        diagnostics.append(_diagnose(reader, token, kind)[0])
        return False
    _track(reader, token, kind)
    return True


def _diagnose(reader: _Reader, token: Lexeme, kind: str) -> tuple[Diagnostic, bool]:
    """The error for ``token`` (which the machine refused) and whether to go on."""
    opened = reader.brackets
    innermost = opened[-1].type if opened else None
    span = span_of(token) if kind != NEWLINE else Span.point(token.line, token.column)
    if kind in CLOSERS and innermost != CLOSERS[kind]:
        if opened:
            first = opened[-1]
            return error(
                f"unexpected '{token}': '{first}' opened at line {first.line}, column "
                f"{first.column} is not closed", span, f"add '{closer_for(first)}' before it"
            ), False
        return error(f"unexpected '{token}': it closes nothing", span), False
    accepted = reader.expected()
    previous = reader.previous
    if previous is not None and previous.type == "EQUAL" and kind in (NEWLINE, "RBRACE",
                                                                     "SEMICOLON"):
        return error("expected a value after '='", span_of(previous)), bool(opened)
    shown = token if kind == token.type else Lexeme(kind, token.text, token.line, token.column,
                                                       token.end_line, token.end_column)
    message = (f"unexpected {describe_token(shown)}; expected "
               f"{reader.describe_expected(innermost)}")
    hints = []
    if not opened:
        closer = reader.plan_closer
        if closer is not None and kind != "PLAN":
            hints.append(f"the '}}' at line {closer.line}, column {closer.column} closes the "
                         f"plan; remove it if the plan goes on")
        elif kind == "PLAN":
            hints.append("a file holds exactly one plan")
    elif (kind == "NAME" and previous is not None and previous.type == "NUMBER"
          and str(token) in UNITS):
        hints.append(f"write the unit right after the number, without a space: "
                     f"{previous}{token}")
    elif kind == "NAME" and "LBRACE" in accepted and "EQUAL" not in accepted:
        hints.append("a block starts with one or two words and '{', as in 'model gpt {'")
    elif kind in ("NAME", "NUMBER") and "EQUAL" in accepted:
        hints.append("a key and its value are written 'key = value'")
    elif (previous is not None and NEWLINE in accepted and innermost == "LBRACE"
          and previous.type in ("NAME", "NUMBER", "STRING", "RSQB", "RPAR")):
        hints.append("separate entries with a new line or ';'")
    return error(message, span, *hints), bool(opened)


def _unexpected_end(reader: _Reader) -> Diagnostic:
    end = lalr.end_token(reader.text)
    span = Span.point(end.line, end.column)
    if reader.brackets:
        first = _likely_unclosed(reader) or reader.brackets[-1]
        return error(
            f"unexpected end of file: '{first}' opened at line {first.line} is never closed",
            span_of(first), f"add '{closer_for(first)}' to close it")
    if not reader.anything:
        # a file of old Mac line ends (CR alone) is one line, a comment to its end
        ends = "; its lines end in CR alone (old Mac), which the language reads as one " \
            "line: save it with LF line ends" if "\r" in reader.text and \
            "\n" not in reader.text else ""
        return error(f"the file holds no plan{ends}", span,
                     "a plan file holds one 'plan NAME { ... }'")
    accepted = reader.expected()
    return error(f"unexpected end of file; expected {describe_expected(accepted, None)}",
                 span)


def _likely_unclosed(reader: _Reader) -> Lexeme | None:
    """The brace that is probably missing its '}', judged by indentation as rustc does:
    the first '{' whose matching '}' sits at a smaller indentation than the line that
    opened it."""
    stack: list[Lexeme] = []
    for token in reader.braces:
        if token.type == "LBRACE":
            stack.append(token)
        elif stack:
            opener = stack.pop()
            if opener.line != token.line and reader.indent(token) < reader.indent(opener):
                return opener
    return None
