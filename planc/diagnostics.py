"""Source spans, diagnostics and their rendering, in the style of gcc and rustc.

Every message planc reports about a user's file is a :class:`Diagnostic`: a severity,
one sentence, the exact span it is about and optional hints. Rendering is separate
from detection so that the same diagnostics can be printed for a person (with the
source line and a caret underline) or as JSON for editors and tools.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from planc.words import counted

ERROR = "error"
WARNING = "warning"


@dataclass(frozen=True, order=True)
class Span:
    """A region of a source file; lines and columns are 1-based, ``end`` is exclusive."""

    line: int
    column: int
    end_line: int
    end_column: int

    @staticmethod
    def point(line: int, column: int) -> "Span":
        return Span(line, column, line, column + 1)

    def to(self, other: "Span") -> "Span":
        """The smallest span covering ``self`` and ``other``."""
        start = min((self.line, self.column), (other.line, other.column))
        end = max((self.end_line, self.end_column), (other.end_line, other.end_column))
        return Span(start[0], start[1], end[0], end[1])


@dataclass(frozen=True)
class Diagnostic:
    severity: str
    message: str
    span: Span | None
    hints: tuple[str, ...] = ()

    @property
    def is_error(self) -> bool:
        return self.severity == ERROR


def error(message: str, span: Span | None, *hints: str) -> Diagnostic:
    return Diagnostic(ERROR, message, span, tuple(h for h in hints if h))


def warning(message: str, span: Span | None, *hints: str) -> Diagnostic:
    return Diagnostic(WARNING, message, span, tuple(h for h in hints if h))


class PlanError(Exception):
    """Raised by a stage that cannot produce its output; carries every diagnostic found."""

    def __init__(self, diagnostics: Sequence[Diagnostic]):
        self.diagnostics = tuple(diagnostics)
        first = next((d for d in self.diagnostics if d.is_error), None)
        super().__init__(first.message if first else "invalid plan")


def in_source_order(diagnostics: Iterable[Diagnostic]) -> list[Diagnostic]:
    """Sort by position (file-level diagnostics first) and drop exact repeats."""
    seen: set[Diagnostic] = set()
    unique = [d for d in diagnostics if not (d in seen or seen.add(d))]
    return sorted(unique, key=lambda d: (d.span or Span(0, 0, 0, 0), d.severity != ERROR))


# --- rendering ---------------------------------------------------------------------

_STYLE = {"error": "\x1b[1;31m", "warning": "\x1b[1;35m", "hint": "\x1b[1;36m",
          "bold": "\x1b[1m", "caret": "\x1b[1;32m", "reset": "\x1b[0m"}


@dataclass(frozen=True)
class TextRenderer:
    """Renders diagnostics as ``path:line:col: error: message`` plus a source excerpt."""

    path: str
    source_lines: Sequence[str] = field(default_factory=tuple)
    color: bool = False

    def _paint(self, style: str, text: str) -> str:
        return f"{_STYLE[style]}{text}{_STYLE['reset']}" if self.color else text

    def render(self, diagnostic: Diagnostic) -> str:
        span = diagnostic.span
        where = f"{self.path}:{span.line}:{span.column}:" if span else f"{self.path}:"
        head = (f"{self._paint('bold', where)} "
                f"{self._paint(diagnostic.severity, diagnostic.severity + ':')} "
                f"{self._paint('bold', diagnostic.message)}")
        lines = [head]
        if span and 1 <= span.line <= len(self.source_lines):
            lines.extend(self._excerpt(span))
        lines.extend(f"  {self._paint('hint', 'hint:')} {hint}" for hint in diagnostic.hints)
        return "\n".join(lines)

    def _excerpt(self, span: Span) -> list[str]:
        text = self.source_lines[span.line - 1].rstrip("\r\n")
        shown = _printable(text)
        gutter = str(span.line)
        width = max(len(gutter), 4)
        start = max(span.column - 1, 0)
        if span.end_line == span.line:
            length = max(span.end_column - span.column, 1)
        else:
            length = max(len(text) - start, 1)
        length = min(length, max(len(text) - start, 1))
        # Keep tabs under tabs so that the caret lines up whatever the tab width.
        pad = "".join(c if c == "\t" else " " for c in shown[:start])
        marker = "^" + "~" * (length - 1)
        return [f"{gutter.rjust(width)} | {shown}",
                f"{' ' * width} | {pad}{self._paint('caret', marker)}"]


def _printable(text: str) -> str:
    """Replace control characters so a binary file cannot garble the terminal."""
    return "".join(c if (c.isprintable() or c == "\t") else "\ufffd" for c in text)


def render_text(diagnostics: Iterable[Diagnostic], path: str, source: str | None,
                color: bool = False) -> str:
    renderer = TextRenderer(path, (source or "").splitlines(), color)
    return "\n".join(renderer.render(d) for d in diagnostics)


def summary_line(diagnostics: Sequence[Diagnostic]) -> str:
    errors = sum(d.is_error for d in diagnostics)
    warnings = len(diagnostics) - errors
    parts = [counted(n, word) for n, word in ((errors, "error"), (warnings, "warning")) if n]
    return " and ".join(parts) + " generated." if parts else ""


def to_json(diagnostics: Iterable[Diagnostic], path: str) -> dict:
    """The ``--error-format json`` document (version 1, documented in docs/cli.md)."""
    items = []
    for d in diagnostics:
        item: dict = {"severity": d.severity, "message": d.message, "file": path}
        if d.span:
            item.update(line=d.span.line, column=d.span.column,
                        end_line=d.span.end_line, end_column=d.span.end_column)
        else:
            item.update(line=None, column=None, end_line=None, end_column=None)
        item["hints"] = list(d.hints)
        items.append(item)
    return {"version": 1, "diagnostics": items}


def render_json(diagnostics: Iterable[Diagnostic], path: str) -> str:
    return json.dumps(to_json(diagnostics, path), indent=2)
