"""The LALR(1) machine that runs lark's tables, and the tokenizer that feeds it.

lark builds the tables from ``grammars/plan.lark`` (read into :class:`Tables` by
planc.lang.lalr_tables); this module runs them and builds the tree. Owning the loop
gives three things lark's own loop cannot:

- **speed**: one compiled regular expression scans the text (``re.finditer``), every
  action is a plain tuple looked up once per state, tokens are plain tuples, and each
  rule's tree builder is called directly, without lark's chain of wrappers;
- **a fast path for the common entry**: ``key = value`` with a one-token value and the
  separator after it is matched by one regular expression and built in one call; in a
  block of them, once the machine's cycle per entry is known, each further entry is
  appended to the block's list without running the machine (see
  :class:`planc.lang.lalr_tables.EntryShape` and :func:`_learn_cycle`). Everything else,
  and every entry the parser could not take there, goes token by token, with the same
  outcome;
- **recovery in linear time**: :func:`planc.lang.recovery.syntax_errors` runs the same
  machine on states alone and, after an error, returns to the state saved where the
  broken entry began, so a file with N syntax errors is read once, not N times.

Lines end at LF (CRLF counts as one end); no other character ends a line (see
:func:`planc.diagnostics.source_lines`). A token's ``line`` and ``column`` (1-based, in
characters) are counted here, the same way the snippets and the JSON output count them.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Iterator

OPENERS = {"LPAR": "(", "LSQB": "[", "LBRACE": "{"}
CLOSERS = {"RPAR": "LPAR", "RSQB": "LSQB", "RBRACE": "LBRACE"}
BAD = "_BAD"  # a character no terminal starts with
NEWLINE = "_NL"
END = "$END"
ENTRY = "_ENTRY"  # the fast path's whole-entry match (lalr_tables.EntryShape), its parts:
ENTRY_KEY, ENTRY_SEPARATOR = f"{ENTRY}_KEY", f"{ENTRY}_SEP"

# What the tree builders receive for a token: its text, line, column, end line and end
# column (a plain tuple: a dense plan has hundreds of thousands of tokens).
Piece = tuple[str, int, int, int, int]
# A rule's builder takes its children (tokens as Pieces, the filtering done as lark's
# tree builder does it) and returns the node.
Builder = Callable[[list], Any]
PASS = None  # a one-child '?' rule (``?value: expr``): the child itself, left in place
# The fast path's builder: key, line, key's column and end column, the value's terminal,
# text, column and end column -> the entry's node.
EntryBuilder = Callable[[str, int, int, int, str, str, int, int], Any]

# (True, next state) or (False, (symbols popped, rule's name, reducer or PASS))
Action = tuple[bool, Any]


@dataclass(frozen=True)
class Entry:
    """The fast path's tables (see :class:`planc.lang.lalr_tables.EntryShape`)."""

    pattern: re.Pattern  # the tokenizer's pattern, with the whole entry tried first
    rule: str
    key: str  # the key's terminal
    build: EntryBuilder
    atoms: tuple[tuple[int, str], ...]  # each value terminal's group number, and its name
    groups: tuple[int, int]  # the key's group number and the separator's


@dataclass(frozen=True)
class Tables:
    """What the machine needs from a lark grammar, in the shape it reads fastest."""

    pattern: re.Pattern
    ignored: frozenset[str]
    keywords: dict[str, str]  # a word that is a keyword where the parser expects it
    actions: dict[int, dict[str, Action]]
    start: int
    end: int
    entry: Entry | None = None


class Lexeme:
    """A token as recovery and its messages see it: its terminal, text and place (lighter
    than lark's Token, a str with a dict: a file with 10,000 errors has 50,000 tokens)."""

    __slots__ = ("type", "text", "line", "column", "end_line", "end_column")

    def __init__(self, type: str, text: str, line: int, column: int, end_line: int,
                 end_column: int):
        self.type, self.text, self.line, self.column = type, text, line, column
        self.end_line, self.end_column = end_line, end_column

    def __str__(self) -> str:
        return self.text

    def __repr__(self) -> str:
        return f"Lexeme({self.type}, {self.text!r}, {self.line}:{self.column})"


def tokens(text: str, tables: Tables) -> Iterator[Lexeme]:
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
            yield Lexeme(kind, match.group(), line, column, line + 1, 1)
            line, line_start = line + 1, end
        else:
            yield Lexeme(kind, match.group(), line, column, line, column + end - start)


def end_token(text: str) -> Lexeme:
    """The end-of-text token, at the end of the last line."""
    line = text.count("\n") + 1
    column = len(text) - (text.rfind("\n") + 1) + 1
    return Lexeme(END, "", line, column, line, column)


class Stop(Exception):
    """The machine met a token it cannot take (or brackets nested too deep)."""

    def __init__(self, kind: str, piece: Piece, nesting: bool = False):
        super().__init__(f"unexpected {kind}")
        self.kind, self.piece, self.nesting = kind, piece, nesting


def keyword_or_word(token: str, row: dict[str, Action], tables: Tables) -> str:
    """The type of a NAME token where the parser stands: a keyword where one may come or
    where no name may (lark's contextual lexer decides the same way)."""
    keyword = tables.keywords.get(token)
    if keyword is not None and (keyword in row or "NAME" not in row):
        return keyword
    return "NAME"


def step(states: list[int], values: list | None, kind: str, token: Any,
         actions: dict[int, dict[str, Action]], take: bool = True) -> bool:
    """Feed one token of type ``kind``: reduce as the tables say, then shift (unless not
    ``take``). False (and the stacks possibly reduced) when the token cannot come here.
    Without ``values`` the machine runs on states alone."""
    while True:
        action = actions[states[-1]].get(kind)
        if action is None:
            return False
        shift, arg = action
        if shift:
            if take:
                states.append(arg)
                if values is not None:
                    values.append(token)
            return True
        size, origin, reduce = arg
        if size:
            if values is not None and reduce is not PASS:
                children = values[-size:]
                del values[-size:]
                values.append(reduce(children))
            del states[-size:]
        elif values is not None:
            values.append(reduce([]))
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


def parse(text: str, tables: Tables, max_nesting: int, fast: bool = True) -> Any:
    """The value the builders build for ``text``; raises :class:`Stop` at the first token
    that cannot come where it is. New lines inside ( ) and [ ] are dropped, so lists and
    calls may span lines. ``fast`` takes common entries whole (see
    :class:`planc.lang.lalr_tables.EntryShape` and :func:`_learn_cycle`); the tree is the
    same either way."""
    actions, ignored, keywords = tables.actions, tables.ignored, tables.keywords
    entry = tables.entry if fast else None
    if entry is not None:
        (key_group, separator_group), atoms, build = entry.groups, entry.atoms, entry.build
    states, values = [tables.start], []
    brackets: list[str] = []
    line, line_start = 1, 0
    cycles: dict[tuple, int] = {}  # see _learn_cycle
    for match in (entry.pattern if entry else tables.pattern).finditer(text):
        kind = match.lastgroup
        if kind in ignored:
            continue
        if kind == ENTRY:
            # a whole entry: its key, '=', a one-token value and the separator after it
            key_start, key_end = match.span(key_group)
            key = text[key_start:key_end]
            if key not in keywords and (not brackets or brackets[-1] == "LBRACE"):
                for group, atom in atoms:
                    start, end = match.span(group)
                    if start >= 0:
                        break
                separator_start, separator_end = match.span(separator_group)
                separator = text[separator_start:separator_end]
                assign = build(key, line, key_start - line_start + 1, key_end - line_start + 1,
                               atom, text[start:end], start - line_start + 1,
                               end - line_start + 1)
                column = separator_start - line_start + 1
                ends_line = separator[-1] == "\n"
                piece = (separator, line, column, line + 1, 1) if ends_line else (
                    separator, line, column, line, column + separator_end - separator_start)
                cycle = (tuple(states), atom, separator)
                grown = cycles.get(cycle)
                if grown is not None:  # the cycle this stack and these tokens take
                    values[grown].append(values[-2])
                    values[-2], values[-1] = assign, piece
                elif not _learn_cycle(cycle, assign, piece, entry, tables, states, values,
                                      cycles):
                    grown = -1
                if grown != -1:
                    if ends_line:
                        line, line_start = line + 1, separator_end
                    continue
            # Not where an entry may start: the same text, token by token.
            matches = tables.pattern.finditer(text, match.start(), match.end())
        else:
            matches = (match,)
        for match in matches:
            kind = match.lastgroup
            if kind in ignored:
                continue
            start, end = match.span()
            column = start - line_start + 1
            if kind == NEWLINE:
                piece = (match.group(), line, column, line + 1, 1)
                line, line_start = line + 1, end
                if brackets and brackets[-1] != "LBRACE":
                    continue
            else:
                piece = (match.group(), line, column, line, column + end - start)
                if kind in OPENERS:
                    brackets.append(kind)
                    if len(brackets) > max_nesting:
                        raise Stop(kind, piece, nesting=True)
                elif kind in CLOSERS:
                    if brackets and brackets[-1] == CLOSERS[kind]:
                        brackets.pop()
                elif kind == "NAME" and piece[0] in keywords:
                    kind = keyword_or_word(piece[0], actions[states[-1]], tables)
            if not step(states, values, kind, piece, actions):
                raise Stop(kind, piece)
    end = end_token(text)
    piece = ("", end.line, end.column, end.line, end.column)
    step(states, values, END, piece, actions)
    if states[-1] != tables.end:  # the end state has no action: reaching it is success
        raise Stop(END, piece)
    return values[-1]


def _learn_cycle(cycle: tuple, assign: Any, piece: Piece, entry: Entry, tables: Tables,
                 states: list[int], values: list, cycles: dict[tuple, int]) -> bool:
    """Push an entry (built by the fast path) and its separator through the machine,
    if an entry may start where it stands; False, with nothing pushed, if not.

    In a block of such entries the machine goes round one cycle per entry: the previous
    entry is folded into the block's list (the reductions a new key causes), the new
    entry is pushed, then its separator. The first time a cycle leaves the state stack
    as it found it, with the only change below the top two values being one list that
    grew by the previous entry, ``cycles`` remembers which list; an entry met later with
    the same stack and the same kinds of value and separator takes the same cycle
    directly (the machine is deterministic: same stack, same tokens, same steps)."""
    actions = tables.actions
    before = values.copy()
    lengths = {index: len(v) for index, v in enumerate(values) if type(v) is list}
    if not step(states, values, entry.key, None, actions, take=False):
        return False
    goto = actions[states[-1]].get(entry.rule)
    if goto is None:
        return False
    values.append(assign)
    states.append(goto[1])
    kind = tables.pattern.match(piece[0]).lastgroup
    if not step(states, values, kind, piece, actions):
        raise Stop(kind, piece)
    if list(cycle[0]) == states and len(values) == len(before) and all(
            now is then for now, then in zip(values[:-2], before[:-2])):
        changed = [index for index, length in lengths.items()
                   if index < len(values) - 2 and len(values[index]) != length]
        if (len(changed) == 1 and len(values[changed[0]]) == lengths[changed[0]] + 1
                and values[changed[0]][-1] is before[-2]):
            cycles[cycle] = changed[0]
    return True
