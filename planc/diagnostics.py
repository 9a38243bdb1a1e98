"""Source spans, diagnostics and their rendering, in the style of gcc and rustc.

Every message planc reports about a user's file is a :class:`Diagnostic`: a severity,
one sentence, the exact span it is about and optional hints. Rendering is separate
from detection so that the same diagnostics can be printed for a person (with the
source line and a caret underline) or as JSON for editors and tools.
"""

from __future__ import annotations

import functools
import json
import operator
import unicodedata
from dataclasses import dataclass, field
from typing import Iterable, Sequence


ERROR = "error"
WARNING = "warning"
MAX_SHOWN = 20  # diagnostics printed as text unless asked otherwise (clang's -ferror-limit)
EXCERPT_WIDTH = 100  # columns of a long source line shown around the span


def source_lines(text: str) -> list[str]:
    """The lines of a source text, as the lexer counts them: only LF ends a line (CRLF
    counts as one end). Form feeds, vertical tabs, U+001C to U+001E, U+0085, U+2028 and
    U+2029, which str.splitlines() also breaks at, stay inside their line, so that the
    line shown under a diagnostic is the line its position counts in."""
    lines = text.split("\n")
    return [line[:-1] if line.endswith("\r") else line for line in lines]


def line_starts(text: str) -> list[int]:
    """The offset in ``text`` where each line starts, lines counted as the lexer counts
    them (:func:`source_lines`): a span's line and column are at
    ``starts[line - 1] + column - 1``."""
    starts, at = [0], text.find("\n")
    while at >= 0:
        starts.append(at + 1)
        at = text.find("\n", at + 1)
    return starts


@dataclass(frozen=True)
class Source:
    """A text other than the file being compiled that spans may point into: a
    command-line override such as ``--set mesh.tp=8``.

    ``name`` is shown where a file's path would be (``--set mesh.tp=8:1:9: error: ...``),
    ``text`` is what lines and columns count in (``mesh.tp=8``), and ``index`` orders
    the sources: the file is 0, the overrides 1, 2, ... in command-line order.
    """

    name: str
    text: str
    index: int = 1


@functools.total_ordering
@dataclass(frozen=True, init=False)
class Span:
    """A region of a source file; lines and columns are 1-based, ``end`` is exclusive.

    ``source`` is None for the file being compiled (every span of a plan without
    overrides) and the :class:`Source` of a command-line override otherwise. Spans
    order by source (the file first), then by position.
    """

    line: int
    column: int
    end_line: int
    end_column: int
    source: Source | None = None

    def __init__(self, line: int, column: int, end_line: int, end_column: int,
                 source: Source | None = None):
        # Written into the instance's dict directly: the generated __init__ of a frozen
        # dataclass goes through object.__setattr__ per field, at twice the cost, and a
        # plan makes a few spans per token.
        fields = self.__dict__
        fields["line"], fields["column"] = line, column
        fields["end_line"], fields["end_column"], fields["source"] = end_line, end_column, source

    @staticmethod
    def point(line: int, column: int, source: Source | None = None) -> "Span":
        return Span(line, column, line, column + 1, source)

    def to(self, other: "Span") -> "Span":
        """The smallest span covering ``self`` and ``other`` (of the same source)."""
        start = min((self.line, self.column), (other.line, other.column))
        end = max((self.end_line, self.end_column), (other.end_line, other.end_column))
        return Span(start[0], start[1], end[0], end[1], self.source)

    def _order(self) -> tuple:
        source = (0, "", "") if self.source is None else (
            self.source.index, self.source.name, self.source.text)
        return source, self.line, self.column, self.end_line, self.end_column

    def __lt__(self, other: Span) -> bool:
        if not isinstance(other, Span):
            return NotImplemented
        return self._order() < other._order()

    def __repr__(self) -> str:
        where = f"Span(line={self.line}, column={self.column}, end_line={self.end_line}, " \
                f"end_column={self.end_column}"
        return where + (f", source={self.source!r})" if self.source is not None else ")")


@dataclass(frozen=True, init=False)
class Diagnostic:
    severity: str
    message: str
    span: Span | None
    hints: tuple[str, ...] = ()

    def __init__(self, severity: str, message: str, span: Span | None,
                 hints: tuple[str, ...] = ()):
        fields = self.__dict__  # as Span does: a file may have tens of thousands
        fields["severity"], fields["message"], fields["span"], fields["hints"] = (
            severity, message, span, hints)

    @property
    def is_error(self) -> bool:
        return self.severity == ERROR


MAX_MESSAGE = 400  # characters; a message quoting a megabyte-long value shows its ends


def _bounded(text: str) -> str:
    if len(text) <= MAX_MESSAGE:
        return text
    half = MAX_MESSAGE // 2
    return f"{text[:half]}\u2026 ({len(text) - 2 * half} characters) \u2026{text[-half:]}"


def error(message: str, span: Span | None, *hints: str) -> Diagnostic:
    return Diagnostic(ERROR, _bounded(message), span,
                      tuple(_bounded(h) for h in hints if h) if hints else ())


def warning(message: str, span: Span | None, *hints: str) -> Diagnostic:
    return Diagnostic(WARNING, _bounded(message), span,
                      tuple(_bounded(h) for h in hints if h) if hints else ())


class PlanError(Exception):
    """Raised by a stage that cannot produce its output; carries every diagnostic found."""

    def __init__(self, diagnostics: Sequence[Diagnostic]):
        self.diagnostics = tuple(diagnostics)
        first = next((d for d in self.diagnostics if d.is_error), None)
        super().__init__(first.message if first else "invalid plan")


def in_source_order(diagnostics: Iterable[Diagnostic]) -> list[Diagnostic]:
    """Sort by position (file-level diagnostics first, errors before warnings at one
    place, otherwise as given) and drop exact repeats."""
    nowhere = Span(0, 0, 0, 0)._order()
    in_file = nowhere[0]
    # keyed on plain tuples, hashed and compared in C rather than through the dataclasses'
    # methods (a file may have tens of thousands of diagnostics)
    unique: dict[tuple, tuple] = {}
    for d in diagnostics:
        span = d.span
        if span is None:
            order = nowhere
        elif span.source is None:  # Span._order, inline
            order = (in_file, span.line, span.column, span.end_line, span.end_column)
        else:
            order = span._order()
        unique.setdefault((order, d.severity, d.message, d.hints),
                          (order, d.severity != ERROR, d))
    return [entry[2] for entry in sorted(unique.values(), key=operator.itemgetter(0, 1))]


# --- rendering ---------------------------------------------------------------------

_STYLE = {"error": "\x1b[1;31m", "warning": "\x1b[1;35m", "hint": "\x1b[1;36m",
          "bold": "\x1b[1m", "caret": "\x1b[1;32m", "reset": "\x1b[0m"}


@dataclass(frozen=True)
class TextRenderer:
    """Renders diagnostics as ``path:line:col: error: message`` plus a source excerpt.

    A span in another :class:`Source` (a command-line override) is shown under that
    source's name and with its text: ``--set mesh.tp=8:1:9: error: ...``.
    """

    path: str
    source_lines: Sequence[str] = field(default_factory=tuple)
    color: bool = False

    def _paint(self, style: str, text: str) -> str:
        return f"{_STYLE[style]}{text}{_STYLE['reset']}" if self.color else text

    def _origin(self, span: Span | None) -> tuple[str, Sequence[str]]:
        """The name shown for the span's source and that source's lines."""
        if span is None or span.source is None:
            return self.path, self.source_lines
        return _printable(span.source.name), source_lines(span.source.text)

    def render(self, diagnostic: Diagnostic) -> str:
        span = diagnostic.span
        name, source_lines = self._origin(span)
        where = f"{name}:{span.line}:{span.column}:" if span else f"{name}:"
        head = (f"{self._paint('bold', where)} "
                f"{self._paint(diagnostic.severity, diagnostic.severity + ':')} "
                f"{self._paint('bold', diagnostic.message)}")
        lines = [head]
        if span and 1 <= span.line <= len(source_lines):
            lines.extend(self.excerpt(span, source_lines))
        lines.extend(f"  {self._paint('hint', 'hint:')} {hint}" for hint in diagnostic.hints)
        return "\n".join(lines)

    def excerpt(self, span: Span, lines: Sequence[str]) -> list[str]:
        """The numbered source line of ``span`` and its marker line. A line longer than
        :data:`EXCERPT_WIDTH` is cut to a window around the span, marked with '...', so
        that printing a diagnostic costs the same on a 10 MB line as on a short one."""
        text = lines[span.line - 1]
        start = max(span.column - 1, 0)
        if span.end_line == span.line:
            length = max(span.end_column - span.column, 1)
        else:
            length = max(len(text) - start, 1)
        length = min(length, max(len(text) - start, 1))
        lead, tail = "", ""
        if len(text) > EXCERPT_WIDTH:
            first = max(0, min(start - EXCERPT_WIDTH // 3, len(text) - EXCERPT_WIDTH))
            last = first + EXCERPT_WIDTH
            lead, tail = ("..." if first > 0 else ""), ("..." if last < len(text) else "")
            length = min(length, last - start)
            text, start = text[first:last], start - first
        shown = _printable(text)
        gutter = str(span.line)
        width = max(len(gutter), 4)
        # Keep tabs under tabs and wide characters under two columns, so that the caret
        # lines up with the text in a terminal.
        pad = " " * len(lead) + "".join(
            c if c == "\t" else " " * _columns(c) for c in shown[:start])
        marker = "^" + "~" * max(sum(_columns(c) for c in shown[start:start + length]) - 1, 0)
        return [f"{gutter.rjust(width)} | {lead}{shown}{tail}",
                f"{' ' * width} | {pad}{self._paint('caret', marker)}"]


def _columns(char: str) -> int:
    """Terminal columns of a character: 2 for East Asian wide ones, 0 for combining
    marks, else 1."""
    if unicodedata.combining(char):
        return 0
    return 2 if unicodedata.east_asian_width(char) in "WF" else 1


def _printable(text: str) -> str:
    """Replace control characters (and U+2028, U+2029, U+0085) by U+FFFD, one column
    each, so a binary file cannot garble the terminal or move the caret."""
    return "".join(c if (c.isprintable() or c == "\t") else "\ufffd" for c in text)


def render_text(diagnostics: Sequence[Diagnostic], path: str, source: str | None,
                color: bool = False, limit: int | None = None) -> str:
    """Diagnostics about the file ``path`` holding ``source`` (and about overrides, whose
    spans carry their own text), one after the other: the first ``limit`` of them (all
    if None or 0), then a line counting the rest, as gcc's ``-fmax-errors`` does."""
    renderer = TextRenderer(path, source_lines(source or ""), color)
    shown = diagnostics[:limit] if limit else diagnostics
    text = "\n".join(renderer.render(d) for d in shown)
    rest = diagnostics[len(shown):]
    if rest:
        text += f"\n\u2026 and {_count(rest, 'more ')} (--max-errors 0 shows them all)"
    return text


def _count(diagnostics: Sequence[Diagnostic], more: str = "") -> str:
    errors = sum(d.is_error for d in diagnostics)
    warnings = len(diagnostics) - errors
    return " and ".join(counted(n, more + word) for n, word in
                        ((errors, "error"), (warnings, "warning")) if n)


def summary_line(diagnostics: Sequence[Diagnostic]) -> str:
    """``2 errors and 1 warning generated.``: every diagnostic, printed or not."""
    return _count(diagnostics) + " generated." if diagnostics else ""


def to_json(diagnostics: Sequence[Diagnostic], path: str, limit: int | None = None) -> dict:
    """The ``--error-format json`` document (version 1, documented in README.md): the
    first ``limit`` diagnostics (all if None or 0) and the count of every error and
    warning found.

    ``file`` is ``path``, or the name of the override a span lies in
    (``--set mesh.tp=8``), whose text its line and columns then count in."""
    items = []
    for d in (diagnostics[:limit] if limit else diagnostics):
        where = d.span.source.name if d.span and d.span.source else path
        item: dict = {"severity": d.severity, "message": d.message, "file": where}
        if d.span:
            item.update(line=d.span.line, column=d.span.column,
                        end_line=d.span.end_line, end_column=d.span.end_column)
        else:
            item.update(line=None, column=None, end_line=None, end_column=None)
        item["hints"] = list(d.hints)
        items.append(item)
    errors = sum(d.is_error for d in diagnostics)
    return {"version": 1, "diagnostics": items, "errors": errors,
            "warnings": len(diagnostics) - errors}


def render_json(diagnostics: Sequence[Diagnostic], path: str, limit: int | None = None) -> str:
    return json.dumps(to_json(diagnostics, path, limit), indent=2)


def counted(n: int, noun: str, plural: str | None = None, grouped: bool = False) -> str:
    """``3 ranks``, ``1 rank``, ``2 microbatches``: a count with its noun in agreement;
    ``grouped``: its thousands separated (``1,024 documents``)."""
    number = f"{n:,}" if grouped else f"{n}"
    return f"{number} {noun if n == 1 else plural or noun + 's'}"
