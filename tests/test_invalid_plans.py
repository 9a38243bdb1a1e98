"""Golden tests: every plan in tests/invalid/ is rejected (or warned about) exactly as its
header says.

Each file starts with comment lines naming every diagnostic the file must produce, in
the order planc reports them (source order), then the plan itself:

    # expect: 14:10: error: heads (12) must divide by tp (8)
    # hint: tp must divide heads; try tp = 4 or tp = 2
    # expect: 20:5: warning: ...
    plan bad { ... }

``# expect: LINE:COLUMN: SEVERITY: MESSAGE`` gives one diagnostic; the list of them
must equal planc's list exactly (no diagnostic missing, none extra). ``# hint:`` lines
belong to the ``# expect:`` line above them; when a diagnostic has any, they must equal
its hints exactly and in order (when it has none, its hints are not checked). Other
comment lines before the plan are free text. Line numbers count the header itself.

A file whose expectations hold an error must yield no plan; a file that expects only
warnings must yield a valid plan. A handful of files also go through the real command
line, which must exit with status 1 and print the first error first, without a traceback.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from planc.diagnostics import Diagnostic
from planc.lang import load_file, load_text

ROOT = Path(__file__).resolve().parents[1]
INVALID = ROOT / "tests" / "invalid"
FILES = sorted(INVALID.glob("*.plan"))

MINIMUM_FILES = 45

_EXPECT = re.compile(r"# expect: (\d+):(\d+): (error|warning): (\S.*)")
_HINT = re.compile(r"# hint: (\S.*)")


@dataclass
class Expected:
    line: int
    column: int
    severity: str
    message: str
    hints: list[str] | None = None  # None: not checked

    def text(self) -> str:
        return f"{self.line}:{self.column}: {self.severity}: {self.message}"


def _text_of(diagnostic: Diagnostic) -> str:
    span = diagnostic.span
    where = f"{span.line}:{span.column}" if span else "-:-"
    return f"{where}: {diagnostic.severity}: {diagnostic.message}"


def read_expectations(path: Path) -> list[Expected]:
    """The ``# expect:`` / ``# hint:`` lines of the comment header at the top of ``path``."""
    # Decoded leniently: one of the files is deliberately not UTF-8 (after its header).
    text = path.read_bytes().decode("utf-8", errors="replace")
    expected: list[Expected] = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.startswith("#"):
            break
        line = line.rstrip()
        if line.startswith("# expect:"):
            match = _EXPECT.fullmatch(line)
            if not match:
                raise ValueError(f"{path.name}:{number}: malformed expect line {line!r}; "
                                 f"write '# expect: LINE:COL: error|warning: message'")
            expected.append(Expected(int(match[1]), int(match[2]), match[3], match[4]))
        elif line.startswith("# hint:"):
            match = _HINT.fullmatch(line)
            if not match or not expected:
                raise ValueError(f"{path.name}:{number}: a '# hint:' line must follow an "
                                 f"'# expect:' line")
            if expected[-1].hints is None:
                expected[-1].hints = []
            expected[-1].hints.append(match[1])
    return expected


def test_there_are_enough_invalid_plans():
    assert len(FILES) >= MINIMUM_FILES, f"only {len(FILES)} files in {INVALID}"


def test_every_invalid_plan_has_an_expectation():
    missing = [p.name for p in FILES if not read_expectations(p)]
    assert not missing, f"files without a '# expect:' line: {missing}"


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_invalid_plan(path: Path):
    expected = read_expectations(path)
    assert expected, f"{path.name} has no '# expect:' line"
    loaded = load_file(path)

    # Every diagnostic, in order, at its exact line and column, with its exact message.
    assert [_text_of(d) for d in loaded.diagnostics] == [e.text() for e in expected]

    for want, got in zip(expected, loaded.diagnostics):
        if want.hints is not None:
            assert list(got.hints) == want.hints, f"hints of {want.text()}"

    if any(e.severity == "error" for e in expected):
        assert loaded.plan is None, "a plan with errors must not produce a Plan"
        assert not loaded.ok
    else:
        assert loaded.plan is not None and loaded.ok, "warnings alone must not reject a plan"


def test_a_text_of_old_mac_line_ends_is_told_so():
    """CR alone ends no line: a comment first makes the whole file one comment."""
    loaded = load_text("# mine\rplan x {\r  model gpt { layers = 2 }\r}\r", "cr.plan")
    assert [_text_of(d) for d in loaded.diagnostics] == [
        "1:46: error: the file holds no plan; its lines end in CR alone (old Mac), which the "
        "language reads as one line: save it with LF line ends"]


def test_an_empty_text_holds_no_plan():
    loaded = load_text("", "empty.plan")
    assert [_text_of(d) for d in loaded.diagnostics] == ["1:1: error: the file holds no plan"]
    assert loaded.plan is None


# --- through the real command line ----------------------------------------------------

CLI_SAMPLES = [
    "heads-not-divisible-by-tp",  # the example of the language spec, at 14:10
    "several-syntax-errors",
    "several-semantic-errors",
    "unterminated-string",
    "world-size-not-matching-topology",
    "not-utf8",
    "empty-file",
]


def test_the_cli_samples_exist_and_start_with_an_error():
    for name in CLI_SAMPLES:
        path = INVALID / f"{name}.plan"
        assert path.is_file(), name
        assert read_expectations(path)[0].severity == "error", name


@pytest.fixture(scope="module")
def cli_runs() -> dict[str, subprocess.CompletedProcess]:
    """``python -m planc check FILE`` for every sample, started together to save time."""
    env = {**os.environ, "NO_COLOR": "1", "PYTHONIOENCODING": "utf-8"}
    started = {}
    for name in CLI_SAMPLES:
        relative = (INVALID / f"{name}.plan").relative_to(ROOT)
        started[name] = (relative, subprocess.Popen(
            [sys.executable, "-m", "planc", "check", str(relative)], cwd=ROOT, env=env,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    runs = {}
    for name, (relative, process) in started.items():
        out, err = process.communicate(timeout=60)
        runs[name] = subprocess.CompletedProcess(
            process.args, process.returncode, out.decode("utf-8", "replace"),
            err.decode("utf-8", "replace"))
    return runs


@pytest.mark.parametrize("name", CLI_SAMPLES)
def test_cli_reports_the_first_error_and_exits_1(name, cli_runs):
    run = cli_runs[name]
    relative = (INVALID / f"{name}.plan").relative_to(ROOT)
    first = read_expectations(INVALID / f"{name}.plan")[0]
    assert "Traceback" not in run.stderr and "Traceback" not in run.stdout, run.stderr
    assert run.returncode == 1, run.stderr
    assert run.stderr.splitlines()[0] == f"{relative}:{first.text()}"
