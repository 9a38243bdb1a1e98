"""The LALR(1) machine that runs lark's tables, and the tokenizer that feeds it.

lark builds the tables from ``grammars/plan.lark``; this module runs them. Owning the
loop gives two things lark's own loop cannot:

- **speed**: one compiled regular expression scans the text (``re.finditer``), and every
  action is a plain tuple looked up once per state, so a token costs a few dictionary
  lookups;
- **recovery in linear time**: :func:`planc.lang.recovery.syntax_errors` runs the same
  machine on states alone and, after an error, returns to the state saved where the
  broken entry began, so a file with N syntax errors is read once, not N times.

Lines end at LF (CRLF counts as one end); no other character ends a line (see
:func:`planc.diagnostics.source_lines`). A token's ``line`` and ``column`` (1-based, in characters) are
counted here, the same way the snippets and the JSON output count them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterator

import lark
from lark import Token
from lark.parsers.lalr_analysis import Shift

OPENERS = {"LPAR": "(", "LSQB": "[", "LBRACE": "{"}
CLOSERS = {"RPAR": "LPAR", "RSQB": "LSQB", "RBRACE": "LBRACE"}
BAD = "_BAD"  # a character no terminal starts with
NEWLINE = "_NL"
END = "$END"

# (True, next state) or (False, (symbols popped, rule's name, callback))
Action = tuple[bool, Any]


@dataclass(frozen=True)
class Tables:
    """What the machine needs from a lark grammar, in the shape it reads fastest."""

    pattern: re.Pattern
    ignored: frozenset[str]
    keywords: dict[str, str]  # a word that is a keyword where the parser expects it
    actions: dict[int, dict[str, Action]]
    start: int
    end: int


def tables_of(parser: lark.Lark) -> Tables:
    """Tables for a lark LALR parser (its terminals, ignored terminals and parse table).

    Terminals are tried in lark's order (priority, then the longest possible match),
    so the tokens are those lark's basic lexer would make; a string terminal that
    another terminal's pattern also matches (``plan``, a NAME) is a keyword, typed as
    such only where the parser can take it, as lark's contextual lexer does."""
    terminals = sorted(parser.terminals, key=lambda t: (
        -t.priority, -t.pattern.max_width, -len(t.pattern.value), t.name))
    keywords: dict[str, str] = {}
    patterns = []
    for terminal in terminals:
        if terminal.pattern.type == "str" and any(
                other.pattern.type == "re" and re.fullmatch(other.pattern.to_regexp(),
                                                            terminal.pattern.value)
                for other in terminals):
            keywords[terminal.pattern.value] = terminal.name
            continue
        patterns.append(f"(?P<{terminal.name}>{terminal.pattern.to_regexp()})")
    patterns.append(f"(?P<{BAD}>(?s:.))")
    interactive = parser.parse_interactive("")
    conf = interactive.parser_state.parse_conf
    actions: dict[int, dict[str, Action]] = {}
    for state, row in conf.states.items():
        actions[state] = {
            symbol: (True, arg) if action is Shift else
            (False, (len(arg.expansion), arg.origin.name, _callback(arg, conf.callbacks)))
            for symbol, (action, arg) in row.items()}
    return Tables(re.compile("|".join(patterns)), frozenset(parser.ignore_tokens),
                  keywords, actions, conf.start_state, conf.end_state)


def _first(children: list) -> Any:
    return children[0]


def _callback(rule, callbacks):
    """lark's callback for ``rule``; for a one-symbol rule marked '?' (``?value: expr``),
    which passes its one child up, the same thing without lark's wrappers (five of these
    run for every number in a plan)."""
    if rule.options.expand1 and len(rule.expansion) == 1 and not rule.alias:
        return _first
    return callbacks.get(rule)


def tokens(text: str, tables: Tables) -> Iterator[Token]:
    """Every token of ``text`` but the ignored ones (blanks, comments), with a
    :data:`BAD` token for each character that starts no token."""
    line, line_start = 1, 0
    ignored = tables.ignored
    for match in tables.pattern.finditer(text):
        kind = match.lastgroup
        if kind in ignored:
            continue
        start, end = match.span()
        column = start - line_start + 1
        if kind == NEWLINE:
            yield Token(kind, match.group(), start, line, column, line + 1, 1, end)
            line, line_start = line + 1, end
        else:
            yield Token(kind, match.group(), start, line, column, line, column + end - start,
                        end)


def end_token(text: str) -> Token:
    """The end-of-text token, at the end of the last line."""
    line = text.count("\n") + 1
    column = len(text) - (text.rfind("\n") + 1) + 1
    return Token(END, "", len(text), line, column, line, column, len(text))


class Stop(Exception):
    """The machine met a token it cannot take (or brackets nested too deep)."""

    def __init__(self, token: Token, nesting: bool = False):
        super().__init__(f"unexpected {token.type}")
        self.token, self.nesting = token, nesting


def keyword_or_word(token: Token, row: dict[str, Action], tables: Tables) -> str:
    """The token's type where the parser stands: a keyword where one may come or where no
    name may (lark's contextual lexer decides the same way)."""
    keyword = tables.keywords.get(token) if token.type == "NAME" else None
    if keyword is not None and (keyword in row or "NAME" not in row):
        return keyword
    return token.type


def step(states: list[int], values: list | None, kind: str, token: Any,
         actions: dict[int, dict[str, Action]]) -> bool:
    """Feed one token of type ``kind``: reduce as the tables say, then shift. False (and
    the stacks possibly reduced) when the token cannot come here. Without ``values`` the
    machine runs on states alone."""
    while True:
        action = actions[states[-1]].get(kind)
        if action is None:
            return False
        shift, arg = action
        if shift:
            states.append(arg)
            if values is not None:
                values.append(token)
            return True
        size, origin, callback = arg
        if values is not None:
            children = values[-size:] if size else []
            if size:
                del values[-size:]
            values.append(callback(children) if callback is not None else children)
        if size:
            del states[-size:]
        states.append(actions[states[-1]][origin][1])


def accepts(states: list[int], kind: str, tables: Tables) -> bool:
    """Whether a token of type ``kind`` could be taken now: shifted, or for the end of
    the text, reduced to the end state (reductions simulated without copying the
    stack)."""
    actions = tables.actions
    depth, extra = len(states), []
    while True:
        top = extra[-1] if extra else states[depth - 1]
        action = actions[top].get(kind)
        if action is None:
            return False
        shift, arg = action
        if shift:
            return True
        size, origin, _ = arg
        drop_extra = min(size, len(extra))
        if drop_extra:
            del extra[-drop_extra:]
        depth -= size - drop_extra
        top = extra[-1] if extra else states[depth - 1]
        extra.append(actions[top][origin][1])
        if extra[-1] == tables.end:
            return True


def expected(states: list[int], tables: Tables) -> set[str]:
    """The terminals the parser could take next."""
    return {symbol for symbol in tables.actions[states[-1]]
            if symbol.isupper() and accepts(states, symbol, tables)}


def parse(text: str, tables: Tables, max_nesting: int) -> Any:
    """The value the grammar's callbacks build for ``text``; raises :class:`Stop` at the
    first token that cannot come where it is. New lines inside ( ) and [ ] are dropped,
    so lists and calls may span lines."""
    actions = tables.actions
    states, values = [tables.start], []
    brackets: list[str] = []
    for token in tokens(text, tables):
        kind = token.type
        if kind in OPENERS:
            brackets.append(kind)
            if len(brackets) > max_nesting:
                raise Stop(token, nesting=True)
        elif kind in CLOSERS:
            if brackets and brackets[-1] == CLOSERS[kind]:
                brackets.pop()
        elif kind == NEWLINE and brackets and brackets[-1] != "LBRACE":
            continue
        elif kind == "NAME":
            kind = keyword_or_word(token, actions[states[-1]], tables)
            if kind != "NAME":
                token = Token.new_borrow_pos(kind, token, token)
        if not step(states, values, kind, token, actions):
            raise Stop(token)
    end = end_token(text)
    step(states, values, END, end, actions)
    if states[-1] != tables.end:  # the end state has no action: reaching it is success
        raise Stop(end)
    return values[-1]
