"""Pass 1 of the checker: each block of a plan read against the schema.

Unknown and duplicate keys and blocks, missing required keys, and every value read by
its kind (types, units, expressions). What was read, and where it was written, is what
pass 2 (:mod:`planc.lang.check`) checks across keys and blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from planc.diagnostics import Diagnostic, Span, error
from planc.vocabulary import ast
from planc.lang.schema import (BlockSchema, Scope, Unresolved, block_syntax, did_you_mean,
                               where_key_lives)


def _where_given(span: Span) -> str:
    """'at line 3' in the file, 'by --set mesh.tp=8' in an override."""
    return f"by {span.source.name}" if span.source is not None else f"at line {span.line}"


@dataclass
class BlockReader:
    """What a plan's blocks hold, by dotted key, and what was found wrong."""

    path: str
    diagnostics: list[Diagnostic] = field(default_factory=list)
    values: dict[str, Any] = field(default_factory=dict)  # "mesh.tp" -> value or None
    spans: dict[str, Span] = field(default_factory=dict)  # "mesh.tp" -> value span
    given: set[str] = field(default_factory=set)  # keys and blocks the user wrote
    labels: dict[str, str] = field(default_factory=dict)  # "model" -> "llama"

    def report(self, diagnostic: Diagnostic) -> None:
        self.diagnostics.append(diagnostic)

    def _syntax(self, path: str) -> str:
        """How a message writes the block at ``path``: the model block with the family
        the plan gives it (``model deepseek { }``), once its header has been read."""
        return block_syntax(path, self.labels.get("model"))

    def _home_of(self, key: str) -> str | None:
        """The syntax of the first block that has ``key``, for a hint; None if none has."""
        homes = where_key_lives(key)
        return self._syntax(homes[0]) if homes else None

    # --- pass 1: blocks and keys -----------------------------------------------------

    def _read_block(self, schema: BlockSchema, entries, path: str, header: Span) -> None:
        keys: dict[str, ast.Assign] = {}
        blocks: dict[str, ast.Block] = {}
        where = f"in {self._syntax(path)}" if path else "at the top of the plan"
        for entry in entries:
            if isinstance(entry, ast.Assign):
                self._index_key(schema, entry, keys, path, where)
            else:
                self._index_block(schema, entry, blocks, path, where)
        # A misspelt key is reported once, as unknown, not again as missing.
        unknown = [e.key for e in entries if isinstance(e, ast.Assign) and e.key not in schema.keys]
        for name, sub in schema.blocks.items():
            inner = f"{path}.{name}" if path else name
            if name in blocks:
                block = blocks[name]
                self.given.add(inner)
                self.spans[inner] = block.name_span
                if block.label in sub.variants:
                    self.labels[inner] = block.label
                self._read_block(sub.variant(block.label), block.entries, inner,
                                 block.name_span)
            else:
                if sub.required:
                    self.report(error(f"the plan has no {name} block", header,
                                      f"add {self._syntax(inner)} with its keys"))
                self._read_block(sub, (), inner, header)
        self._read_keys(schema, keys, path, header, unknown)

    def _index_key(self, schema, entry: ast.Assign, keys, path, where) -> None:
        if entry.key in schema.keys:
            if entry.key in keys:
                first = keys[entry.key].key_span
                self.report(error(f"duplicate key '{entry.key}' (first given "
                                  f"{_where_given(first)})", entry.key_span))
            else:
                keys[entry.key] = entry
        elif entry.key in schema.blocks:
            homes = [h for h in where_key_lives(entry.key) if h != path]
            self.report(error(f"'{entry.key}' is a block, not a key", entry.key_span,
                              *[f"'{entry.key}' belongs in {self._syntax(h)}" for h in homes],
                              f"write {entry.key} {{ ... }}"))
        else:
            self.report(error(f"unknown key '{entry.key}' {where}", entry.key_span,
                              *self._unknown_hints(entry.key, schema, path)))

    def _index_block(self, schema, entry: ast.Block, blocks, path, where) -> None:
        if entry.name in schema.blocks:
            sub = schema.blocks[entry.name]
            if entry.name in blocks:
                first = blocks[entry.name].name_span
                self.report(error(f"duplicate block '{entry.name}' (first given "
                                  f"{_where_given(first)})", entry.name_span))
                return
            if sub.labels and entry.label is None:
                self.report(error(f"{entry.name} needs its family: write "
                                  f"{entry.name} {sub.labels[0]} {{ ... }}", entry.name_span))
            elif sub.labels and entry.label not in sub.labels:
                self.report(error(f"unknown {entry.name} family '{entry.label}'; planc knows "
                                  f"{', '.join(sub.labels)}", entry.label_span,
                                  did_you_mean(entry.label, sub.labels)))
            elif not sub.labels and entry.label is not None:
                meant = next((k for k, key in sub.keys.items()
                              if entry.label in getattr(key.kind, "words", ())), None)
                self.report(error(f"block '{entry.name}' takes no second word",
                                  entry.label_span,
                                  f"write {entry.name} {{ {meant} = {entry.label}; ... }}"
                                  if meant else f"write {entry.name} {{ ... }}"))
            blocks[entry.name] = entry
        elif entry.name in schema.keys:
            self.report(error(f"'{entry.name}' is a key, not a block", entry.name_span,
                              f"write {entry.name} = ..."))
        else:
            self.report(error(f"unknown block '{entry.name}' {where}", entry.name_span,
                              *self._unknown_hints(entry.name, schema, path)))

    def _unknown_hints(self, name: str, schema: BlockSchema, path: str) -> list[str]:
        near = did_you_mean(name, list(schema.keys) + list(schema.blocks))
        if near:
            return [near]
        homes = [h for h in where_key_lives(name) if h != path]
        if homes:
            return [f"'{name}' belongs in " + " or ".join(self._syntax(h) for h in homes)]
        return []

    def _read_keys(self, schema: BlockSchema, entries: dict[str, ast.Assign], path: str,
                   header: Span, unknown: list[str]) -> None:
        required = frozenset(k for k, key in schema.keys.items() if key.required)
        misspelt: set[str] | None = None  # found only if a required key is missing
        scope = Scope(entries, {k: key.kind for k, key in schema.keys.items()},
                      {k: key.default for k, key in schema.keys.items()}, required,
                      home_of=self._home_of)
        for name, key in schema.keys.items():
            dotted = f"{path}.{name}"
            if name in entries:
                self.given.add(dotted)
                self.spans[dotted] = entries[name].value.span
            elif key.required and path in self.given:
                if misspelt is None:
                    misspelt = {did_you_mean(word, schema.keys) for word in unknown}
                if f"did you mean '{name}'?" not in misspelt:
                    self.report(error(f"{self._syntax(path).split(' {')[0]} is missing the "
                                      f"key '{name}'", header, f"add {name} = ..."))
            try:
                self.values[dotted] = scope.value(name)
            except Unresolved:
                self.values[dotted] = None
        for problem in scope.problems:
            self.report(error(problem.message, problem.span, *problem.hints))

    # --- what was read ------------------------------------------------------------

    def value(self, dotted: str) -> Any:
        return self.values.get(dotted)

    def span(self, *dotted: str) -> Span | None:
        for key in dotted:
            if key in self.spans:
                return self.spans[key]
        return self.spans.get("plan")

    def ready(self, *dotted: str) -> bool:
        """Whether every named value was read successfully."""
        return all(self.values.get(key) is not None for key in dotted)

    def _fail(self, message: str, span: Span | None, hint: str | None = None) -> bool:
        """Report an error; False, for ``ok = self._fail(...)``."""
        self.report(error(message, span, *([hint] if hint else [])))
        return False

    def _reject(self, message: str, span: Span | None, hint: str | None = None) -> None:
        """Report an error; None, for ``return self._reject(...)``."""
        self._fail(message, span, hint)
