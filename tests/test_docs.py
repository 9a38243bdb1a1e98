"""The documentation cannot drift from the code.

Every ```plan block of docs/language.md and README.md is a complete plan: a valid one
must check without a single diagnostic, and one preceded by ``<!-- invalid -->`` must be
followed by a ```text block holding exactly what ``planc check`` prints for it
(diagnostics on standard error, then the summary on standard output, if any). The
language reference must also mention every key and block of the schema, every unit,
every preset, every enum word and every optimizer argument.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from planc.lang import load_text
from planc.plan.presets import PRESETS
from planc.lang.schema import OPTIMIZER_ARGUMENTS, PLAN_SCHEMA, BlockSchema, Choice
from planc.vocabulary.units import UNITS
from tests.conftest import ROOT

LANGUAGE = ROOT / "docs" / "language.md"
README = ROOT / "README.md"
INVALID_MARKER = "<!-- invalid -->"
_FENCE = re.compile(r"^(```+)\s*([A-Za-z0-9_+-]*)\s*$")
_SHOWN_FILE = re.compile(r"^([^\s:]+\.plan):")


@dataclass(frozen=True)
class Fence:
    """One fenced code block of a markdown file."""

    path: Path
    line: int  # 1-based line of the opening fence
    language: str
    text: str
    marker: str  # the last non-blank line before the block ("" at the top)


@dataclass(frozen=True)
class PlanExample:
    fence: Fence
    invalid: bool
    expected: Fence | None  # the ```text block after an invalid example

    @property
    def name(self) -> str:
        return f"{self.fence.path.name}:{self.fence.line}"


def fences(path: Path) -> list[Fence]:
    """Every fenced block of ``path``, in order."""
    lines = path.read_text(encoding="utf-8").split("\n")
    found: list[Fence] = []
    i, previous = 0, ""
    while i < len(lines):
        opening = _FENCE.match(lines[i].strip())
        if opening is None:
            if lines[i].strip():
                previous = lines[i].strip()
            i += 1
            continue
        ticks, language = opening.groups()
        body: list[str] = []
        j = i + 1
        while j < len(lines) and lines[j].strip() != ticks:
            body.append(lines[j])
            j += 1
        assert j < len(lines), f"{path.name}:{i + 1}: code block is never closed"
        found.append(Fence(path, i + 1, language, "\n".join(body) + "\n", previous))
        previous = ticks
        i = j + 1
    return found


def plan_examples(path: Path) -> list[PlanExample]:
    blocks = fences(path)
    examples = []
    for index, fence in enumerate(blocks):
        if fence.language != "plan":
            continue
        invalid = fence.marker == INVALID_MARKER
        expected = blocks[index + 1] if invalid and index + 1 < len(blocks) else None
        examples.append(PlanExample(fence, invalid, expected))
    return examples


EXAMPLES = [e for path in (LANGUAGE, README) if path.exists() for e in plan_examples(path)]
VALID = [e for e in EXAMPLES if not e.invalid]
INVALID = [e for e in EXAMPLES if e.invalid]


def test_the_language_reference_has_examples_of_both_kinds():
    assert LANGUAGE.exists()
    in_language = [e for e in EXAMPLES if e.fence.path == LANGUAGE]
    assert sum(not e.invalid for e in in_language) >= 5
    assert sum(e.invalid for e in in_language) >= 5


@pytest.mark.parametrize("example", VALID, ids=lambda e: e.name)
def test_valid_example_checks_without_diagnostics(example):
    loaded = load_text(example.fence.text, "example.plan")
    shown = [(d.severity, d.message, d.span) for d in loaded.diagnostics]
    assert loaded.ok, shown
    assert loaded.diagnostics == (), shown


@pytest.mark.parametrize("example", INVALID, ids=lambda e: e.name)
def test_invalid_example_prints_exactly_the_text_shown(example, tmp_path):
    expected = example.expected
    assert expected is not None and expected.language == "text", (
        f"{example.name}: an invalid example must be followed by a ```text block")
    assert expected.marker.startswith("```"), (
        f"{example.name}: nothing but blank lines may separate the example from its output")
    shown = _SHOWN_FILE.match(expected.text)
    assert shown, f"{example.name}: the output must start with the file name"
    name = shown.group(1)
    (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / name).write_text(example.fence.text, encoding="utf-8")
    env = {**os.environ, "NO_COLOR": "1"}
    result = subprocess.run([sys.executable, "-m", "planc", "check", name], cwd=tmp_path,
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.stderr + result.stdout == expected.text
    has_error = re.search(r"^\S+: error: ", expected.text, re.M) is not None
    assert result.returncode == (1 if has_error else 0)


def test_invalid_examples_really_are_invalid():
    """An example marked invalid must produce at least one diagnostic."""
    for example in INVALID:
        assert load_text(example.fence.text, "bad.plan").diagnostics, example.name


# --- the reference names everything the code accepts ---------------------------------


def _schema_names(schema: BlockSchema) -> set[str]:
    names = set(schema.keys)
    for name, block in schema.blocks.items():
        names.add(name)
        names |= _schema_names(block)
    return names


def _choice_words(schema: BlockSchema) -> set[str]:
    words = {w for key in schema.keys.values() if isinstance(key.kind, Choice)
             for w in key.kind.words}
    for block in schema.blocks.values():
        words |= _choice_words(block)
    return words


def _code_spans(text: str) -> set[str]:
    """The contents of every `inline code` span of a markdown text."""
    outside_blocks = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return set(re.findall(r"`([^`\n]+)`", outside_blocks))


def _mentioned(name: str, text: str, spans: set[str]) -> bool:
    """``name`` is inline code on its own, or a key (``name =``) or block (``name {``)
    inside a code span."""
    return name in spans or any(re.search(rf"(^|[\s{{(]){re.escape(name)}(\s+\w+)?\s*[={{}}]", s)
                                for s in spans)


DOC_TEXT = LANGUAGE.read_text(encoding="utf-8") if LANGUAGE.exists() else ""
DOC_SPANS = _code_spans(DOC_TEXT)


@pytest.mark.parametrize("name", sorted(_schema_names(PLAN_SCHEMA)))
def test_every_key_and_block_of_the_schema_is_documented(name):
    assert _mentioned(name, DOC_TEXT, DOC_SPANS), f"docs/language.md never mentions `{name}`"


@pytest.mark.parametrize("unit", sorted(UNITS))
def test_every_unit_is_documented(unit):
    assert unit in DOC_SPANS, f"docs/language.md does not list the unit `{unit}`"


@pytest.mark.parametrize("word", sorted(_choice_words(PLAN_SCHEMA)))
def test_every_enum_word_is_documented(word):
    assert word in DOC_SPANS, f"docs/language.md does not list the value `{word}`"


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_is_documented(name):
    assert name in DOC_SPANS


@pytest.mark.parametrize("optimizer, argument",
                         [(o, a) for o, args in OPTIMIZER_ARGUMENTS.items() for a in args])
def test_every_optimizer_argument_is_documented(optimizer, argument):
    assert optimizer in DOC_SPANS and argument in DOC_SPANS



def test_the_simulate_example_is_what_simulate_prints():
    """docs/simulate.md opens with planc simulate's summary of plans/gpt-1t.plan: the
    lines it shows are the command's own, as the cost model prices them now."""
    from planc.compile import compile_plan
    from planc.lang import load_file
    from planc.simulate import simulate
    from planc.simulate.accuracy import expected
    from planc.views.simulate_text import render

    text = (ROOT / "docs" / "simulate.md").read_text()
    block = text.split("$ planc simulate plans/gpt-1t.plan\n", 1)[1].split("  ...\n```", 1)[0]
    plan = load_file(ROOT / "plans" / "gpt-1t.plan").plan
    printed = render(simulate(compile_plan(plan)), expected(plan)).splitlines()
    shown = block.splitlines()
    assert printed[:len(shown)] == shown


@pytest.mark.parametrize("page", sorted((ROOT / "docs").glob("*.md")) + [README],
                         ids=lambda p: p.name)
def test_every_table_has_its_header(page):
    """A table's rows follow its header and separator without a blank line: a row after a
    blank line starts a table of no header, which Markdown shows as text with pipes."""
    lines = page.read_text().splitlines()
    fenced = False
    headless = []
    for number, line in enumerate(lines, 1):
        if line.startswith("```"):
            fenced = not fenced
        starts = line.startswith("|") and (number == 1 or not lines[number - 2].startswith("|"))
        if starts and not fenced and not (number < len(lines) and
                                          re.match(r"^\|[-:| ]+\|$", lines[number])):
            headless.append(number)
    assert headless == [], f"{page.name}: table rows without a header at lines {headless}"


def test_every_attribute_of_graph_json_is_documented():
    """docs/build.md lists every attribute a compiled graph's nodes and the graph itself
    carry (a few plans that use the most features) and every optional one the graph's
    vocabulary knows."""
    from planc.compile import compile_plan
    from planc.graph.vocabulary import OPTIONAL, OPTIONAL_TYPES
    from planc.lang import load_file

    text = (ROOT / "docs" / "build.md").read_text()
    words = set()
    for span in _code_spans(text):
        words |= set(re.split(r"[,\s]+", span))
    graph_attributes, node_attributes = set(), set(OPTIONAL) | set(OPTIONAL_TYPES)
    for name in ("gpt-tiny", "moe-tiny", "cp-ring-attention", "zero3", "llama-tiny"):
        graph = compile_plan(load_file(ROOT / "plans" / f"{name}.plan").plan).graph
        graph_attributes |= set(graph.graph)
        for _, data in graph.nodes(data=True):
            node_attributes |= set(data)
    assert sorted(graph_attributes - words) == []
    assert sorted(node_attributes - words) == []


def test_the_readme_shows_every_option_of_every_command():
    """Each command's row of the README's table names every option its --help lists;
    --error-format and --max-errors, which every command reading a plan takes, are said
    once below the table."""
    import argparse

    from planc.cli import build_parser

    text = README.read_text()
    rows = {m[1]: re.split(r"(?<!\\)\|", line)[1]
            for line in text.splitlines() if (m := re.match(r"\| `planc (\w+)", line))}
    assert "also takes\n`--error-format text|json` and `--max-errors N`" in text
    commands = next(a for a in build_parser()._actions
                    if isinstance(a, argparse._SubParsersAction)).choices
    missing = []
    for name, parser in commands.items():
        for action in parser._actions:
            flags = [f for f in action.option_strings if f not in ("-h", "--help")]
            if not flags or "--error-format" in flags or "--max-errors" in flags:
                continue
            if not any(re.search(re.escape(f) + r"(?![\w-])", rows.get(name, ""))
                       for f in flags):
                missing.append(f"{name} {flags[-1]}")
    assert missing == []
