"""A plan file's text with some keys set: how ``planc tune`` writes a candidate.

Each setting replaces the value of its key where the file writes it, or is added at the
end of the innermost block of its path the file has (with the blocks it lacks around
it), so that the file keeps its comments, its order and everything the search does not
choose. The result is what ``--set KEY=VALUE`` would make of the file, as a file.
"""

from __future__ import annotations

from planc.diagnostics import line_starts
from planc.vocabulary import ast
from planc.lang.parser import parse


def _find(entries, path: tuple[str, ...]):
    """(the Assign at ``path``, or None; the deepest Block on its way, or None; how many
    parts of the path that block covers)."""
    block, depth = None, 0
    for i, part in enumerate(path):
        last = i == len(path) - 1
        match = next((e for e in entries if (isinstance(e, ast.Assign) if last else
                                             isinstance(e, ast.Block)) and
                      (e.key if last else e.name) == part), None)
        if match is None:
            return None, block, depth
        if last:
            return match, block, depth
        block, depth, entries = match, i + 1, match.entries
    return None, block, depth


def written_values(source: str, keys) -> dict[str, str]:
    """The text of the value the file writes for each dotted key of ``keys`` it writes,
    the file parsed once."""
    tree, _ = parse(source)
    if tree is None:
        return {}
    starts, out = line_starts(source), {}
    for key in keys:
        found = _find(tree.entries, tuple(key.split(".")))[0]
        if found is not None:
            span = found.value.span
            out[key] = source[starts[span.line - 1] + span.column - 1:
                              starts[span.end_line - 1] + span.end_column - 1]
    return out


def written_value(source: str, key: str) -> str | None:
    """The text of the value the file writes for dotted ``key``, or None."""
    return written_values(source, (key,)).get(key)


def _texts(nest: dict) -> list[str]:
    """``key = value`` and ``name { ... }`` entries of a nest of settings."""
    return [f"{name} {{ {'; '.join(_texts(v))} }}" if isinstance(v, dict) else
            f"{name} = {v}" for name, v in nest.items()]


def with_settings(source: str, settings: dict[str, str]) -> str:
    """``source`` with each dotted key of ``settings`` set to its value's text."""
    tree, _ = parse(source)
    if tree is None:
        raise ValueError("the plan does not parse")
    starts = line_starts(source)

    def offset(line: int, column: int) -> int:
        return starts[line - 1] + column - 1

    edits: list[tuple[int, int, str]] = []  # (start, end, new text)
    # insertion offset -> what goes there: key -> value text, or block name -> the same
    additions: dict[int, dict] = {}
    for key, value in settings.items():
        path = tuple(key.split("."))
        found, block, depth = _find(tree.entries, path)
        if found is not None:
            span = found.value.span
            edits.append((offset(span.line, span.column),
                          offset(span.end_line, span.end_column), value))
            continue
        end = (block or tree).span
        at = offset(end.end_line, end.end_column) - 1  # before the closing brace
        nest = additions.setdefault(at, {})
        for name in path[depth:-1]:
            nest = nest.setdefault(name, {})
        nest[path[-1]] = value
    for at, nest in additions.items():
        texts = _texts(nest)
        line_start = source.rfind("\n", 0, at) + 1
        before = source[line_start:at]
        if not before.strip():  # the closing brace starts its line: a line per setting
            edits.append((line_start, line_start,
                          "".join(f"{before}  {t}\n" for t in texts)))
            continue
        previous = source[:at].rstrip()[-1:]
        joined = "; ".join(texts)
        lead = " " if previous in ("{", ";") else "; "
        edits.append((len(source[:at].rstrip()), at, f"{lead}{joined} "))
    # a comment at the end of a line whose value changed described the old one
    # ("microbatches = 192  # 1536 / 8 data-parallel ranks"): it goes with the old value
    stale = {_comment(source, end) for _, end, _ in edits} - {None}
    edits += [(start, end, "") for start, end in stale]
    out = source
    for start, end, new in sorted(edits, key=lambda e: (e[0], e[1]), reverse=True):
        out = out[:start] + new + out[end:]
    return out


def _comment(source: str, at: int) -> tuple[int, int] | None:
    """(start, end) of the comment that ends the line holding offset ``at``, with the
    spaces before it, if the rest of that line after ``at`` holds one outside a string."""
    eol = source.find("\n", at)
    eol = len(source) if eol < 0 else eol
    quoted = False
    for k in range(at, eol):
        if source[k] == '"':
            quoted = not quoted
        elif source[k] == "#" and not quoted:
            return len(source[:k].rstrip(" \t")), eol
    return None


def without_blocks(source: str, paths) -> str:
    """``source`` without the blocks or keys at ``paths`` (("shard", "tp"), ...) it
    writes: a chosen layout of degree 1 on an axis drops that axis's shard block, and one
    without sequence parallelism the key that acts only with it, which would say nothing
    (planc check warns of them). A line the entry leaves empty goes with it."""
    tree, _ = parse(source)
    if tree is None:
        raise ValueError("the plan does not parse")
    starts = line_starts(source)
    cuts = []
    for path in paths:
        entries, found = tree.entries, None
        for depth, part in enumerate(path):
            last = depth == len(path) - 1
            found = next((e for e in entries if isinstance(e, ast.Block) and e.name == part
                          or last and isinstance(e, ast.Assign) and e.key == part), None)
            if found is None or last:
                break
            entries = found.entries
        if found is None:
            continue
        span = found.span
        start = starts[span.line - 1] + span.column - 1
        end = starts[span.end_line - 1] + span.end_column - 1
        line_start = source.rfind("\n", 0, start) + 1
        line_end = source.find("\n", end)
        line_end = len(source) if line_end < 0 else line_end
        rest = source[end:line_end]
        if not source[line_start:start].strip() and rest.strip() in ("", ";"):
            start, end = line_start, min(line_end + 1, len(source))  # the whole line
        elif rest.lstrip().startswith(";"):  # and its separator, with the blanks after it
            after = rest.lstrip()[1:]
            end += len(rest) - len(after.lstrip(" \t"))
        elif source[line_start:start].rstrip(" \t").endswith(";"):  # the last: the one before
            start = line_start + len(source[line_start:start].rstrip(" \t")) - 1
        cuts.append((start, end))
    out = source
    for start, end in sorted(cuts, reverse=True):
        out = out[:start] + out[end:]
    return out
