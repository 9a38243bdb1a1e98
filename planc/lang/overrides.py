"""Command-line overrides: ``--set KEY=VALUE`` sets one key of a plan for one run.

KEY is the dotted path of a key as written in a file, block names then the key
(``mesh.tp``, ``shard.dp.zero``, ``topology.device.memory``; ``model.layers`` whatever
the model's family word). VALUE is read by the language's own value grammar. An
override replaces the key in the parsed file, or adds it (and the blocks on its path
that the file lacks); the checker then sees the result as if the user had written it.

Every span of an override lies in its own :class:`~planc.diagnostics.Source`, named
``--set KEY=VALUE`` (or by the option that gave it: :class:`Given`), whose lines and
columns count in ``KEY=VALUE``: a diagnostic about an override points into the
override, one about the file into the file.

A malformed override (no '=', no key, a path that is not a key path, names a block or
goes through a key, or a value that does not parse) is a command-line error:
:func:`parse_override` raises :class:`OverrideError`, and ``planc`` exits with status 2
before reading the file.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass

from planc.diagnostics import Diagnostic, Source, Span, TextRenderer, error, source_lines
from planc.vocabulary import ast
from planc.lang.parser import parse_value
from planc.lang.schema import BlockSchema, plan_schema

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
EXAMPLE = "mesh.tp=2"


class OverrideError(ValueError):
    """A malformed override; ``diagnostic`` locates the problem in the override."""

    def __init__(self, diagnostic: Diagnostic):
        super().__init__(diagnostic.message)
        self.diagnostic = diagnostic

    def describe(self) -> str:
        """One line naming the override and the problem, then the override with a marker
        under the problem and the hints (what ``planc`` prints after 'argument --set:')."""
        d = self.diagnostic
        lines = [f"{d.span.source.text}: {d.message}" if d.span else d.message]
        if d.span is not None:
            lines.extend(TextRenderer("").excerpt(d.span, source_lines(d.span.source.text)))
        lines.extend(f"  hint: {hint}" for hint in d.hints)
        return "\n".join(lines)


class Given(str):
    """An override's ``KEY=VALUE`` text given by an option other than ``--set`` (diff's
    ``--set-b``, simulate's ``--imbalance-from M.jsonl``), which its diagnostics name so
    that the user finds what they typed. A str: it travels wherever an override's text
    does."""

    option: str

    def __new__(cls, text: str, option: str) -> "Given":
        given = super().__new__(cls, text)
        given.option = option
        return given


@dataclass(frozen=True)
class Override:
    """One parsed ``--set KEY=VALUE``."""

    text: str  # KEY=VALUE, as given
    path: tuple[str, ...]  # ("mesh", "tp")
    path_spans: tuple[Span, ...]  # where each part of the path is, in ``source``
    value: ast.Value  # its spans in ``source``
    source: Source

    @property
    def key(self) -> str:
        return ".".join(self.path)

    @property
    def name(self) -> str:
        return self.source.name


def parse_override(text: str, index: int = 1) -> Override:
    """Parse ``KEY=VALUE``; ``index`` is its place among the overrides (1 for the first).
    Raises OverrideError if the override is malformed."""
    source = Source(f"{getattr(text, 'option', '--set')} {text}", str(text), index)

    def fail(message: str, span: Span | None, *hints: str):
        raise OverrideError(error(message, span, *hints))

    if "\n" in text or "\r" in text:
        fail(f"{text!r} holds a line break; an override is one line", None)
    key_text, equal, value_text = text.partition("=")
    if not equal:
        fail(f"'{text}' has no '='; write KEY=VALUE, such as {EXAMPLE}", None)
    if not key_text.strip():
        fail(f"'{text}' names no key before '='; write KEY=VALUE, such as {EXAMPLE}",
             Span.point(1, len(key_text) + 1, source))
    path, spans = _key_path(key_text, source, fail)
    _check_path(path, spans, fail)
    if not value_text.strip():
        fail(f"{key_text.strip()} has no value after '='",
             Span.point(1, len(text) + 1, source), f"write a value, such as {EXAMPLE}")
    # Blanking KEY= keeps every column of the value as it is in the override.
    value, problem = parse_value(" " * (len(key_text) + 1) + value_text)
    if problem is not None:
        span = dataclasses.replace(problem.span, source=source) if problem.span else None
        raise OverrideError(dataclasses.replace(problem, span=span))
    return Override(text, path, spans, _in_source(value, source), source)


def parse_overrides(texts: Sequence[str]) -> tuple[Override, ...]:
    """Parse every override in command-line order (the later of two on one key wins)."""
    if isinstance(texts, str):
        raise TypeError("overrides are a sequence of KEY=VALUE texts, not one text")
    return tuple(parse_override(text, i) for i, text in enumerate(texts, start=1))


def _key_path(key_text: str, source: Source, fail) -> tuple[tuple[str, ...], tuple[Span, ...]]:
    """The parts of KEY and their spans; blanks around KEY are allowed."""
    start = len(key_text) - len(key_text.lstrip(" \t"))
    key = key_text.strip(" \t")
    parts = key.split(".")
    spans, column = [], start + 1
    for part in parts:
        span = Span(1, column, 1, column + max(len(part), 1), source)
        if not _NAME.fullmatch(part):
            fail(f"'{key}' is not a key path: write the block names and the key joined by "
                 f"'.', such as {EXAMPLE.partition('=')[0]} or shard.dp.zero", span)
        spans.append(span)
        column += len(part) + 1
    return tuple(parts), tuple(spans)


def _check_path(path: tuple[str, ...], spans: tuple[Span, ...], fail) -> None:
    """Reject paths that name a block or go through a key. Names the schema does not
    know are left to the checker, which reports them with a did-you-mean hint."""
    schema: BlockSchema = plan_schema()  # the model block of the families registered now
    for i, part in enumerate(path):
        dotted = ".".join(path[:i + 1])
        last = i == len(path) - 1
        if part in schema.keys and not last:
            fail(f"'{dotted}' is a key, not a block: it holds a value, not '{path[i + 1]}'",
                 spans[i + 1], f"write {dotted}=VALUE")
        if part in schema.blocks:
            if last:
                fail(f"'{dotted}' is a block, not a key; name one of its keys, such as "
                     f"{_first_key(schema.blocks[part], dotted)}", spans[i])
            schema = schema.blocks[part]
            continue
        if not last and part in schema.labels:
            rest = ".".join(path[:i] + path[i + 1:])
            fail(f"the path of a key of {schema.name} {part} {{ }} names the block, not "
                 f"its family: write {rest}", spans[i])
        return


def _first_key(schema: BlockSchema, path: str) -> str:
    if schema.keys:
        return f"{path}.{next(iter(schema.keys))}"
    name, block = next(iter(schema.blocks.items()))
    return _first_key(block, f"{path}.{name}")


def _in_source(value: ast.Value, source: Source) -> ast.Value:
    """``value`` with every span moved into ``source``. Iterative: a value may be a long
    chain of operations, deeper than Python's recursion limit."""
    rebuilt: dict[int, object] = {}
    stack: list[tuple[object, bool]] = [(value, False)]
    while stack:
        node, children_done = stack.pop()
        if not children_done:
            stack.append((node, True))
            stack.extend((child, False) for child in _children(node))
            continue
        changes = {}
        for field in dataclasses.fields(node):
            item = getattr(node, field.name)
            if isinstance(item, Span):
                changes[field.name] = dataclasses.replace(item, source=source)
            elif isinstance(item, tuple):
                changes[field.name] = tuple(rebuilt[id(x)] for x in item)
            elif dataclasses.is_dataclass(item):
                changes[field.name] = rebuilt[id(item)]
        rebuilt[id(node)] = dataclasses.replace(node, **changes)
    return rebuilt[id(value)]


def _children(node) -> list:
    children = []
    for field in dataclasses.fields(node):
        item = getattr(node, field.name)
        if isinstance(item, tuple):
            children.extend(item)
        elif dataclasses.is_dataclass(item) and not isinstance(item, Span):
            children.append(item)
    return children


# --- applying overrides to a parsed file ---------------------------------------------


def apply(tree: ast.PlanFile, overrides: Sequence[Override]) -> ast.PlanFile:
    """The file with every override applied in order: each replaces the first
    assignment of its key in the first block on its path, or is added at the end of
    that block, creating the blocks the file lacks."""
    entries = tree.entries
    for override in overrides:
        entries = _set(entries, override, 0, plan_schema())
    return dataclasses.replace(tree, entries=entries)


def _set(entries: tuple[ast.Entry, ...], override: Override, depth: int,
         schema: BlockSchema | None) -> tuple[ast.Entry, ...]:
    name, span = override.path[depth], override.path_spans[depth]
    if depth == len(override.path) - 1:
        assign = ast.Assign(name, span, override.value, span.to(override.value.span))
        for i, entry in enumerate(entries):
            if isinstance(entry, ast.Assign) and entry.key == name:
                return entries[:i] + (assign,) + entries[i + 1:]
        return entries + (assign,)
    inner = schema.blocks.get(name) if schema is not None else None
    for i, entry in enumerate(entries):
        if isinstance(entry, ast.Block) and entry.name == name:
            block = dataclasses.replace(
                entry, entries=_set(entry.entries, override, depth + 1, inner))
            return entries[:i] + (block,) + entries[i + 1:]
    label = inner.labels[0] if inner is not None and inner.labels else None
    block = ast.Block(name, span, label, None, _set((), override, depth + 1, inner),
                      span.to(override.value.span))
    return entries + (block,)


def override_argument(text: str, option: str = "--set") -> str:
    """The argparse ``type`` of ``--set`` (or of ``option``, which gives overrides too):
    the override as given, once it is known to be well formed; a malformed one is a
    command-line error (exit status 2)."""
    import argparse

    given = text if option == "--set" else Given(text, option)
    try:
        parse_override(given)
    except OverrideError as exc:
        raise argparse.ArgumentTypeError(exc.describe()) from None
    return given
