"""lark's LALR(1) tables read into the shape planc's machine (planc.lang.lalr) runs fastest:
the tokenizer's one regular expression, each state's actions as plain tuples, each rule's
tree builder, and the fast path's whole-entry pattern (:class:`EntryShape`)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import lark
from lark.parsers.lalr_analysis import Shift

from planc.lang.lalr import (BAD, ENTRY, ENTRY_KEY, ENTRY_SEPARATOR, PASS, Action, Builder,
                             Entry, EntryBuilder, Tables)


@dataclass(frozen=True)
class EntryShape:
    """The common entry the fast path takes whole, with the separator after it: a
    ``rule: key equal value`` whose value is one of the ``atoms`` terminals, then a
    separator. ``blank`` matches what may stand before and between the tokens and
    ``tail`` what may stand between the value and the separator; the tokenizer must
    ignore both. ``build`` makes the node the builders would make of the entry, from
    its key, line, key's columns, the value's terminal and text and its columns. For the
    plan grammar: ``assign: NAME EQUAL value`` with a NUMBER, NAME or STRING value, then
    ';' or a new line."""

    rule: str
    key: str
    equal: str
    value: str
    atoms: tuple[str, ...]
    separator: str  # a regular expression matching exactly the separator terminals
    blank: str
    tail: str
    build: EntryBuilder


def tables_of(parser: lark.Lark, builders: Mapping[str, Builder],
              entry: EntryShape | None = None) -> Tables:
    """Tables for a lark LALR parser (its terminals, ignored terminals and parse table),
    with ``builders`` (by rule name or alias) building the tree.

    Terminals are tried in lark's order (priority, then the longest possible match),
    so the tokens are those lark's basic lexer would make; a string terminal that
    another terminal's pattern also matches (``plan``, a NAME) is a keyword, typed as
    such only where the parser can take it, as lark's contextual lexer does."""
    terminals = sorted(parser.terminals, key=lambda t: (
        -t.priority, -t.pattern.max_width, -len(t.pattern.value), t.name))
    keywords: dict[str, str] = {}
    patterns = []
    regexps = {}
    for terminal in terminals:
        regexps[terminal.name] = terminal.pattern.to_regexp()
        if terminal.pattern.type == "str" and any(
                other.pattern.type == "re" and re.fullmatch(other.pattern.to_regexp(),
                                                            terminal.pattern.value)
                for other in terminals):
            keywords[terminal.pattern.value] = terminal.name
            continue
        patterns.append(f"(?P<{terminal.name}>{regexps[terminal.name]})")
    patterns.append(f"(?P<{BAD}>(?s:.))")
    interactive = parser.parse_interactive("")
    conf = interactive.parser_state.parse_conf
    placeholders = parser.options.maybe_placeholders
    reducers = {rule: _reducer(rule, builders, placeholders) for rule in parser.rules}
    actions: dict[int, dict[str, Action]] = {}
    for state, row in conf.states.items():
        actions[state] = {
            symbol: (True, arg) if action is Shift else
            (False, (len(arg.expansion), str(arg.origin.name), reducers[arg]))
            for symbol, (action, arg) in row.items()}
    fast = None if entry is None else _entry_tables(entry, parser, regexps, patterns)
    return Tables(re.compile("|".join(patterns)), frozenset(parser.ignore_tokens), keywords,
                  actions, conf.start_state, conf.end_state, fast)


def _reducer(rule, builders: Mapping[str, Builder], placeholders: bool) -> Builder | None:
    """What a reduction by ``rule`` does to its children, as lark's tree builder does it:
    drop filtered tokens (anonymous ones and those named ``_X``), splice the children of
    inlined rules (named ``_x``, and lark's own ``__x_star`` helpers) into their parent,
    put None where an optional ``[item]`` is missing, and hand a '?' rule's only child
    up unchanged."""
    expansion = rule.expansion
    empty = list(rule.options.empty_indices) if placeholders else []
    if empty:  # how many Nones go before each symbol (and after the last)
        nones = [len(ones) for ones in "".join(str(int(b)) for b in empty).split("0")]
    else:
        nones = [0] * (len(expansion) + 1)
    keep_all = rule.options.keep_all_tokens
    plan: list[tuple[int, bool, int]] = []  # (child, splice it, Nones before it)
    pending = 0
    for index, symbol in enumerate(expansion):
        pending += nones[index]
        if keep_all or not (symbol.is_term and symbol.filter_out):
            plan.append((index, not symbol.is_term and symbol.name.startswith("_"), pending))
            pending = 0
    trailing = pending + nones[len(expansion)]
    name = rule.alias or rule.origin.name
    inline = name.startswith("_")
    single = bool(rule.options.expand1) and not rule.alias
    whole = trailing == 0 and [(i, False, 0) for i in range(len(expansion))] == plan
    if single and whole and len(expansion) == 1:
        return PASS
    builder = None if inline else builders[name]
    if whole and builder is not None and not single:
        return builder  # the children as they are: no wrapper to call

    def reduce(children: list) -> Any:
        if whole:
            kept = children
        else:
            kept = []
            for index, splice, before in plan:
                if before:
                    kept += [None] * before
                if splice:
                    if kept:
                        kept += children[index]
                    else:  # the left-recursive case: grow the child's own list
                        kept = children[index]
                else:
                    kept.append(children[index])
            if trailing:
                kept += [None] * trailing
        if builder is None:
            return kept
        if single and len(kept) == 1:
            return kept[0]
        return builder(kept)

    return reduce


def _entry_tables(shape: EntryShape, parser: lark.Lark, regexps: dict[str, str],
                  patterns: list[str]) -> Entry | None:
    """The fast path's pattern; None if the grammar has not the shape."""
    if not any(rule.origin.name == shape.rule and [s.name for s in rule.expansion] ==
               [shape.key, shape.equal, shape.value] for rule in parser.rules):
        return None
    blank = shape.blank
    values = "|".join(f"(?P<{ENTRY}_{atom}>{regexps[atom]})" for atom in shape.atoms)
    pattern = (f"(?P<{ENTRY}>{blank}(?P<{ENTRY_KEY}>{regexps[shape.key]}){blank}"
               f"{regexps[shape.equal]}{blank}(?:{values}){shape.tail}"
               f"(?P<{ENTRY_SEPARATOR}>{shape.separator}))")
    compiled = re.compile("|".join([pattern] + patterns))
    number = compiled.groupindex
    return Entry(compiled, shape.rule, shape.key, shape.build,
                 tuple((number[f"{ENTRY}_{atom}"], atom) for atom in shape.atoms),
                 (number[ENTRY_KEY], number[ENTRY_SEPARATOR]))
