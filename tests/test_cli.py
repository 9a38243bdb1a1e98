"""The ``planc`` command line, run for real in subprocesses: exit statuses, hostile
inputs, diagnostics in text and JSON, colour, independence from torch, layout output.

Every run must end with a diagnostic or a success, never a Python traceback, and in a
sane time.
"""

from __future__ import annotations

import json
import os
import pty
import random
import re
import select
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import BAD_TP, PLANS, ROOT, drop_file_capabilities

TINY = PLANS / "gpt-tiny.plan"
TINY_TEXT = TINY.read_text(encoding="utf-8")
SUMMARY = re.compile(r"^\d+ errors? generated\.$|^\d+ error(s)? and \d+ warnings? generated\.$")
HEADLINE = re.compile(r"^(?P<path>[^\n]*?):(?:(?P<line>\d+):(?P<col>\d+):)? "
                      r"(?P<severity>error|warning): (?P<message>.+)$")
SANE_SECONDS = 20


def planc(*args, cwd: Path | None = None, env: dict | None = None,
          timeout: float = SANE_SECONDS, stdin=subprocess.DEVNULL, preexec_fn=None):
    """Run ``python -m planc ARGS``; fail cleanly (no hang) if it takes too long."""
    started = time.monotonic()
    try:
        result = subprocess.run([sys.executable, "-m", "planc", *map(str, args)],
                                capture_output=True, text=True, errors="replace",
                                cwd=cwd or ROOT, env=env, timeout=timeout, stdin=stdin,
                                preexec_fn=preexec_fn)
    except subprocess.TimeoutExpired:
        result = None
    if result is None:
        pytest.fail(f"planc {' '.join(map(str, args))} did not finish in {timeout} s")
    result.elapsed = time.monotonic() - started
    assert "Traceback" not in result.stderr, result.stderr[-1200:]
    assert "Traceback" not in result.stdout, result.stdout[-1200:]
    return result


def no_color_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "NO_COLOR"}
    env.update(extra)
    return env


def assert_diagnosed(result, path_shown: str, *, status: int = 1) -> list[re.Match]:
    """The run failed with well-formed text diagnostics and a summary line, nothing else."""
    assert result.returncode == status, (result.returncode, result.stderr[-2000:])
    assert result.stdout == ""
    lines = result.stderr.rstrip("\n").split("\n")
    assert SUMMARY.match(lines[-1]), lines[-1]
    heads = [m for m in map(HEADLINE.match, lines) if m and m["path"] == path_shown]
    assert heads, result.stderr[:2000]
    assert HEADLINE.match(lines[0]), lines[0][:300]
    errors = int(lines[-1].split()[0])
    assert sum(m["severity"] == "error" for m in heads) == errors
    return heads


# --- exit statuses ---------------------------------------------------------------------


@pytest.mark.parametrize("args", [["check", TINY], ["check", TINY, "-v"], ["layout", TINY],
                                  ["layout", TINY, "--json"]],
                         ids=["check", "check-v", "layout", "layout-json"])
def test_valid_plan_exits_0(args):
    result = planc(*args)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert result.stdout.strip()


@pytest.mark.parametrize("command", ["check", "layout"])
def test_invalid_plan_exits_1_without_output(command, tmp_path):
    (tmp_path / "bad.plan").write_text(BAD_TP)
    result = planc(command, "bad.plan", cwd=tmp_path)
    heads = assert_diagnosed(result, "bad.plan")
    assert [m["message"] for m in heads] == ["heads (12) must divide by tp (8)"]


@pytest.mark.parametrize("args", [
    ["frobnicate", TINY],                 # unknown subcommand
    ["check", "--frobnicate", TINY],      # unknown option
    ["layout", TINY, "--frobnicate"],
    ["check"],                            # missing argument
    ["layout"],
    [],                                   # no arguments at all
    ["check", TINY, "--error-format", "xml"],
    ["check", TINY, "--error-format"],
], ids=["unknown-command", "unknown-option", "unknown-option-layout", "missing-file",
        "missing-file-layout", "nothing", "bad-format", "format-without-value"])
def test_bad_command_line_exits_2(args):
    result = planc(*args)
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert result.stdout == ""
    assert "usage: planc" in result.stderr


def test_missing_file_exits_1(tmp_path):
    result = planc("check", "missing.plan", cwd=tmp_path)
    heads = assert_diagnosed(result, "missing.plan")
    assert heads[0]["message"] == "cannot read file: No such file or directory"


def test_directory_exits_1(tmp_path):
    (tmp_path / "dir.plan").mkdir()
    for command in ("check", "layout"):
        result = planc(command, "dir.plan", cwd=tmp_path)
        heads = assert_diagnosed(result, "dir.plan")
        assert heads[0]["message"] == "is a directory, not a .plan file"


def test_file_without_read_permission_exits_1(tmp_path, permissions_apply):
    path = tmp_path / "secret.plan"
    path.write_text(TINY_TEXT)
    path.chmod(0)
    try:
        result = planc("check", "secret.plan", cwd=tmp_path, preexec_fn=(
            drop_file_capabilities if os.geteuid() == 0 else None))
    finally:
        path.chmod(0o644)
    heads = assert_diagnosed(result, "secret.plan")
    assert heads[0]["message"] == "cannot read file: Permission denied"


def test_unreadable_socket_exits_1(tmp_path):
    """A socket cannot be opened as a file, not even by root."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        server.bind(str(tmp_path / "s.plan"))
        result = planc("check", "s.plan", cwd=tmp_path)
    finally:
        server.close()
    heads = assert_diagnosed(result, "s.plan")
    assert heads[0]["message"].startswith("cannot read file: ")


def test_path_through_a_file_exits_1(tmp_path):
    (tmp_path / "f").write_text("x")
    result = planc("check", "f/a.plan", cwd=tmp_path)
    heads = assert_diagnosed(result, "f/a.plan")
    assert heads[0]["message"] == "cannot read file: Not a directory"


def test_version():
    init = (ROOT / "planc" / "__init__.py").read_text()
    version = re.search(r'^__version__ = "([^"]+)"', init, re.M).group(1)
    result = planc("--version")
    assert result.returncode == 0
    assert result.stdout == f"planc {version}\n"


# --- hostile inputs --------------------------------------------------------------------


def test_empty_file(tmp_path):
    (tmp_path / "empty.plan").write_bytes(b"")
    heads = assert_diagnosed(planc("check", "empty.plan", cwd=tmp_path), "empty.plan")
    assert [(m["line"], m["col"], m["message"]) for m in heads] == [
        ("1", "1", "the file holds no plan")]


def test_only_comments(tmp_path):
    (tmp_path / "c.plan").write_text("# nothing\n\n   # but comments\n")
    heads = assert_diagnosed(planc("check", "c.plan", cwd=tmp_path), "c.plan")
    assert [m["message"] for m in heads] == ["the file holds no plan"]
    assert 1 <= int(heads[0]["line"]) <= 4


def _no_raw_control_characters(text: str) -> None:
    assert not [c for c in text if ord(c) < 32 and c not in "\n\t"], repr(text[:500])


def test_binary_junk(tmp_path):
    rng = random.Random(7)
    junk = bytearray(rng.randrange(256) for _ in range(4096))
    for i in range(0, len(junk), 97):
        junk[i] = 0
    (tmp_path / "junk.plan").write_bytes(bytes(junk))
    result = planc("check", "junk.plan", cwd=tmp_path)
    heads = assert_diagnosed(result, "junk.plan")
    line, column, byte = _first_bad_byte(bytes(junk))
    assert [(int(m["line"]), int(m["col"]), m["message"]) for m in heads] == [
        (line, column, f"file is not valid UTF-8 (byte 0x{byte:02x})")]
    _no_raw_control_characters(result.stderr)


def test_ascii_junk_with_nuls_and_control_characters(tmp_path):
    rng = random.Random(8)
    junk = "".join(rng.choice("\x00\x01\x07\x08\x1b\x7f{}[]=plan x\n\t") for _ in range(3000))
    (tmp_path / "junk.plan").write_text(junk)
    result = planc("check", "junk.plan", cwd=tmp_path)
    assert_diagnosed(result, "junk.plan")
    _no_raw_control_characters(result.stderr)


def _first_bad_byte(data: bytes) -> tuple[int, int, int]:
    """(line, character column, byte value) of the first byte that is not UTF-8."""
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        before = data[:exc.start].decode("utf-8")
        line = before.count("\n") + 1
        column = len(before) - (before.rfind("\n") + 1) + 1
        return line, column, data[exc.start]
    raise AssertionError("valid UTF-8")


@pytest.mark.parametrize("comment", ["# caf\u00e9", "# na\u00efve caf\u00e9"],
                         ids=["ascii-before", "utf8-before"])
def test_latin1_file(tmp_path, comment):
    """The first bad byte is reported with its line and (character) column."""
    text = TINY_TEXT.replace("  model gpt {", f"  model gpt {{\n    {comment}")
    # Only the last character of the comment is written in latin-1.
    data = text.encode("utf-8")
    last = comment[-1].encode("utf-8")
    index = data.index(comment.encode("utf-8")) + len(comment.encode("utf-8")) - len(last)
    data = data[:index] + comment[-1].encode("latin-1") + data[index + len(last):]
    (tmp_path / "latin.plan").write_bytes(data)
    line, column, byte = _first_bad_byte(data)
    assert (line, byte) == (7, 0xE9)
    result = planc("check", "latin.plan", cwd=tmp_path)
    heads = assert_diagnosed(result, "latin.plan")
    assert [(int(m["line"]), int(m["col"]), m["message"]) for m in heads] == [
        (line, column, "file is not valid UTF-8 (byte 0xe9)")]


def test_utf8_bom_before_a_valid_plan(tmp_path):
    (tmp_path / "bom.plan").write_bytes(b"\xef\xbb\xbf" + TINY_TEXT.encode())
    for command in ("check", "layout"):
        result = planc(command, "bom.plan", cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        assert result.stderr == ""


def test_utf8_bom_does_not_shift_columns(tmp_path):
    (tmp_path / "bom.plan").write_bytes(b"\xef\xbb\xbfplan 1x { }\n")
    heads = assert_diagnosed(planc("check", "bom.plan", cwd=tmp_path), "bom.plan")
    assert (heads[0]["line"], heads[0]["col"]) == ("1", "6")


def test_utf8_bom_does_not_shift_the_column_of_a_bad_byte(tmp_path):
    (tmp_path / "bom.plan").write_bytes(b"\xef\xbb\xbfplan \xe9 { }\n")
    heads = assert_diagnosed(planc("check", "bom.plan", cwd=tmp_path), "bom.plan")
    assert [(m["line"], m["col"], m["message"]) for m in heads] == [
        ("1", "6", "file is not valid UTF-8 (byte 0xe9)")]


def test_crlf_line_endings(tmp_path):
    (tmp_path / "crlf.plan").write_bytes(TINY_TEXT.replace("\n", "\r\n").encode())
    for command in ("check", "layout"):
        assert planc(command, "crlf.plan", cwd=tmp_path).returncode == 0
    bad = BAD_TP.replace("\n", "\r\n")
    (tmp_path / "bad.plan").write_bytes(bad.encode())
    result = planc("check", "bad.plan", cwd=tmp_path)
    assert_diagnosed(result, "bad.plan")
    assert result.stderr.split("\n")[:3] == [
        "bad.plan:12:10: error: heads (12) must divide by tp (8)",
        "  12 |     tp = 8",
        "     |          ^",
    ]
    assert "\r" not in result.stderr


def test_tabs_before_an_error_keep_the_caret_under_the_token(tmp_path):
    text = BAD_TP.replace("    tp = 8", "\t\ttp = 8")
    (tmp_path / "tabs.plan").write_text(text)
    result = planc("check", "tabs.plan", cwd=tmp_path)
    assert_diagnosed(result, "tabs.plan")
    assert result.stderr.split("\n")[:4] == [
        "tabs.plan:12:8: error: heads (12) must divide by tp (8)",
        "  12 | \t\ttp = 8",
        "     | \t\t     ^",
        "  hint: tp must divide heads; try tp = 4 or tp = 2",
    ]


def test_a_20_megabyte_file(tmp_path):
    path = tmp_path / "big.plan"
    with open(path, "wb") as handle:
        handle.write(TINY_TEXT.encode())
        line = b"# " + b"x" * 1022 + b"\n"
        handle.write(line * (20 * 1024))
    assert path.stat().st_size > 20 * 10**6
    result = planc("check", "big.plan", cwd=tmp_path)
    heads = assert_diagnosed(result, "big.plan")
    assert "larger than" in heads[0]["message"]
    assert result.elapsed < 10


def _tiny_with(replacement: str) -> str:
    assert "    seed = 0\n" in TINY_TEXT
    return TINY_TEXT.replace("    seed = 0\n", f"    seed = {replacement}\n")


def _seed_line() -> int:
    return TINY_TEXT[:TINY_TEXT.index("    seed = 0")].count("\n") + 1


@pytest.mark.parametrize("opener", ["[", "("])
def test_100000_nested_brackets(tmp_path, opener):
    (tmp_path / "deep.plan").write_text(_tiny_with(opener * 100_000))
    result = planc("check", "deep.plan", cwd=tmp_path)
    heads = assert_diagnosed(result, "deep.plan")
    assert "nested more than" in heads[0]["message"]
    assert int(heads[0]["line"]) == _seed_line()
    assert result.elapsed < 10


def test_50000_nested_blocks(tmp_path):
    (tmp_path / "deep.plan").write_text("plan p {\n" + "a {\n" * 50_000)  # under 256 KiB
    result = planc("check", "deep.plan", cwd=tmp_path)
    heads = assert_diagnosed(result, "deep.plan")
    assert "nested more than" in heads[0]["message"]
    assert result.elapsed < 10


def test_100000_closing_brackets(tmp_path):
    (tmp_path / "close.plan").write_text(_tiny_with("]" * 100_000))
    result = planc("check", "close.plan", cwd=tmp_path)
    assert_diagnosed(result, "close.plan")
    assert result.elapsed < 10


@pytest.mark.parametrize("op", ["+", "-", "*"])
def test_a_50000_term_expression(tmp_path, op):
    (tmp_path / "expr.plan").write_text(_tiny_with(op.join(["1"] * 50_000)))
    result = planc("check", "expr.plan", cwd=tmp_path)
    # Legal (the value is an integer) or refused with a diagnostic: both are fine.
    if result.returncode != 0:
        heads = assert_diagnosed(result, "expr.plan")
        assert int(heads[0]["line"]) == _seed_line()
    assert result.elapsed < 10


def test_a_very_long_line(tmp_path):
    padding = " " * 100_000  # two such lines stay under the 256 KiB file limit
    (tmp_path / "long.plan").write_text(_tiny_with(f"0 {padding}# {'x' * 100_000}"))
    assert planc("check", "long.plan", cwd=tmp_path).returncode == 0
    (tmp_path / "long-bad.plan").write_text(_tiny_with(f"0{padding}oops"))
    result = planc("check", "long-bad.plan", cwd=tmp_path)
    heads = assert_diagnosed(result, "long-bad.plan")
    assert (int(heads[0]["line"]), int(heads[0]["col"])) == (
        _seed_line(), len("    seed = 0") + len(padding) + 1)
    assert result.elapsed < 10


def test_10000_lines_of_comments(tmp_path):
    comments = "".join(f"# comment {i}\n" for i in range(10_000))
    (tmp_path / "c.plan").write_text(comments + TINY_TEXT)
    assert planc("check", "c.plan", cwd=tmp_path).returncode == 0
    (tmp_path / "c-bad.plan").write_text(comments + BAD_TP)
    heads = assert_diagnosed(planc("check", "c-bad.plan", cwd=tmp_path), "c-bad.plan")
    assert [(int(m["line"]), int(m["col"])) for m in heads] == [(10_012, 10)]


@pytest.mark.parametrize("literal", ["1__0", "1_", "0.5_", "9" * 5000, "1" + "0" * 400 + "MB"],
                         ids=["double-underscore", "trailing-underscore", "float-underscore",
                              "5000-digits", "huge-quantity"])
def test_hostile_number_literals(tmp_path, literal):
    text = TINY_TEXT.replace("bucket = 25MB", f"bucket = {literal}")
    (tmp_path / "n.plan").write_text(text)
    heads = assert_diagnosed(planc("check", "n.plan", cwd=tmp_path), "n.plan")
    assert heads[0]["line"] is not None


# --- absurdly large (but well-formed) worlds must not hang the compiler ------------------

HUGE = """\
plan huge {{
  model gpt {{
    layers = {layers}
    hidden = 64
    heads = 4
    vocab = 256
    seq = 32
    batch = {batch}
  }}
  mesh {{ pp = {pp}; dp = {dp} }}
  {topology}
}}
"""
HUGE_CASES = {
    # Two million pipeline stages of one layer each (valid: no rule bounds the world).
    "check-pp": ("check", dict(layers=2_000_000, batch=16, pp=2_000_000, dp=1, topology="")),
    # Two million data-parallel ranks on 250,000 nodes of 8.
    "layout-dp": ("layout", dict(layers=2, batch=2_000_000, pp=1, dp=2_000_000,
                                 topology="topology { devices_per_node = 8 }")),
    # One node of a million devices.
    "layout-one-node": ("layout", dict(layers=2, batch=1_000_000, pp=1, dp=1_000_000,
                                       topology="")),
}
HUGE_SECONDS = 10


@pytest.fixture(scope="module")
def huge_runs(tmp_path_factory):
    """Start every huge case at once (they may hang) and share one deadline."""
    directory = tmp_path_factory.mktemp("huge")
    processes = {}
    for name, (command, values) in HUGE_CASES.items():
        (directory / f"{name}.plan").write_text(HUGE.format(**values))
        processes[name] = subprocess.Popen(
            [sys.executable, "-m", "planc", command, f"{name}.plan"], cwd=directory,
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, errors="replace")
    deadline = time.monotonic() + HUGE_SECONDS
    yield processes, deadline
    for process in processes.values():
        if process.poll() is None:
            process.kill()
        process.wait()


@pytest.mark.parametrize("name", list(HUGE_CASES))
def test_huge_worlds_do_not_hang(huge_runs, name):
    processes, deadline = huge_runs
    process = processes[name]
    try:
        stdout, stderr = process.communicate(timeout=max(deadline - time.monotonic(), 0.1))
    except subprocess.TimeoutExpired:
        stdout = None
    if stdout is None:
        process.kill()
        process.communicate()
        pytest.fail(f"planc {HUGE_CASES[name][0]} on {name}.plan still running after "
                    f"{HUGE_SECONDS} s")
    assert "Traceback" not in stderr
    assert process.returncode in (0, 1), stderr[-2000:]
    if process.returncode == 0:
        assert len(stdout.splitlines()) < 100
    else:
        assert SUMMARY.match(stderr.rstrip("\n").split("\n")[-1])


# --- JSON diagnostics ------------------------------------------------------------------


def test_error_format_json(tmp_path):
    (tmp_path / "bad.plan").write_text(BAD_TP)
    for command in ("check", "layout"):
        result = planc(command, "bad.plan", "--error-format", "json", cwd=tmp_path)
        assert result.returncode == 1
        assert result.stderr == ""
        assert json.loads(result.stdout) == {
            "version": 1,
            "diagnostics": [{
                "severity": "error",
                "message": "heads (12) must divide by tp (8)",
                "file": "bad.plan",
                "line": 12,
                "column": 10,
                "end_line": 12,
                "end_column": 11,
                "hints": ["tp must divide heads; try tp = 4 or tp = 2"],
            }],
            "errors": 1,
            "warnings": 0,
        }


def test_error_format_json_for_a_clean_plan_is_a_document_too(tmp_path):
    """A tool that reads standard output as JSON got nothing for a plan without any
    diagnostic."""
    result = planc("check", str(PLANS / "gpt-tiny.plan"), "--error-format", "json",
                   cwd=tmp_path)
    assert (result.returncode, result.stderr) == (0, "")
    assert json.loads(result.stdout) == {"version": 1, "diagnostics": [], "errors": 0,
                                         "warnings": 0}


def test_error_format_json_for_a_file_level_error(tmp_path):
    result = planc("check", "missing.plan", "--error-format", "json", cwd=tmp_path)
    assert result.returncode == 1
    [item] = json.loads(result.stdout)["diagnostics"]
    assert item["line"] is None and item["column"] is None
    assert sorted(item) == sorted(["severity", "message", "file", "line", "column",
                                   "end_line", "end_column", "hints"])


def test_error_format_json_for_every_syntax_error(tmp_path):
    text = BAD_TP.replace("layers = 2", "layers = = 2").replace("seq    = 32", "seq 32")
    (tmp_path / "s.plan").write_text(text)
    result = planc("check", "s.plan", "--error-format", "json", cwd=tmp_path)
    assert result.returncode == 1
    items = json.loads(result.stdout)["diagnostics"]
    assert [(d["severity"], d["line"]) for d in items] == [("error", 4), ("error", 8)]


def test_text_diagnostics_exactly(tmp_path):
    (tmp_path / "bad.plan").write_text(BAD_TP)
    result = planc("check", "bad.plan", cwd=tmp_path, env=no_color_env())
    assert result.stderr == (
        "bad.plan:12:10: error: heads (12) must divide by tp (8)\n"
        "  12 |     tp = 8\n"
        "     |          ^\n"
        "  hint: tp must divide heads; try tp = 4 or tp = 2\n"
        "1 error generated.\n")


# --- colour ----------------------------------------------------------------------------


def _stderr_on_a_terminal(args, cwd: Path, env: dict) -> tuple[int, bytes]:
    master, slave = pty.openpty()
    try:
        process = subprocess.Popen([sys.executable, "-m", "planc", *args], cwd=cwd, env=env,
                                   stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                   stderr=slave)
    finally:
        os.close(slave)
    chunks, deadline = [], time.monotonic() + SANE_SECONDS
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 0.2)
        if ready:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        elif process.poll() is not None:
            break
    os.close(master)
    process.stdout.read()
    process.stdout.close()
    status = process.wait(timeout=SANE_SECONDS)
    return status, b"".join(chunks)


def test_colour_on_a_terminal(tmp_path):
    (tmp_path / "bad.plan").write_text(BAD_TP)
    status, output = _stderr_on_a_terminal(["check", "bad.plan"], tmp_path,
                                           no_color_env(TERM="xterm-256color"))
    assert status == 1
    assert b"\x1b[" in output
    assert b"must divide by tp" in output
    assert b"Traceback" not in output


def test_no_colour_with_NO_COLOR(tmp_path):
    (tmp_path / "bad.plan").write_text(BAD_TP)
    status, output = _stderr_on_a_terminal(["check", "bad.plan"], tmp_path,
                                           no_color_env(TERM="xterm-256color", NO_COLOR="1"))
    assert status == 1
    assert b"must divide by tp" in output
    assert b"\x1b" not in output


def test_no_colour_through_a_pipe(tmp_path):
    (tmp_path / "bad.plan").write_text(BAD_TP)
    result = planc("check", "bad.plan", cwd=tmp_path, env=no_color_env(TERM="xterm-256color"))
    assert result.returncode == 1
    assert "must divide by tp" in result.stderr
    assert "\x1b" not in result.stderr


# --- no torch, no networkx -------------------------------------------------------------

TORCH_FREE = """
import json, sys
sys.modules["torch"] = None  # any `import torch` now fails
from planc.cli import main
statuses = [main(["check", sys.argv[1]]), main(["layout", sys.argv[1], "--json"])]
loaded = sorted(m for m in sys.modules
                if (m.split(".")[0] == "torch" and sys.modules[m] is not None)
                or m.split(".")[0] == "networkx")
print("RESULT " + json.dumps({"statuses": statuses, "loaded": loaded}), file=sys.stderr)
"""


def test_check_and_layout_work_without_torch_or_networkx():
    result = subprocess.run([sys.executable, "-c", TORCH_FREE, str(TINY)], cwd=ROOT,
                            capture_output=True, text=True, timeout=SANE_SECONDS)
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == 0
    last = result.stderr.strip().split("\n")[-1]
    assert last.startswith("RESULT ")
    assert json.loads(last[len("RESULT "):]) == {"statuses": [0, 0], "loaded": []}
    layout = json.loads(result.stdout.strip().split("\n")[-1])
    assert layout["world"] == 8


# --- layout output ---------------------------------------------------------------------


def test_layout_json_of_gpt_tiny():
    result = planc("layout", TINY, "--json")
    assert result.returncode == 0
    document = json.loads(result.stdout)
    assert document["world"] == 8
    assert len(document["ranks"]) == 8
    assert [r["rank"] for r in document["ranks"]] == list(range(8))
    assert document["sizes"] == {"tp": 2, "cp": 1, "pp": 2, "dp": 2}
    assert document["ranks"][5] == {"rank": 5, "coords": {"tp": 1, "cp": 0, "pp": 0, "dp": 1},
                                    "node": 1}


def test_layout_text_of_a_3072_rank_plan_is_short():
    result = planc("layout", PLANS / "gpt-1t.plan")
    assert result.returncode == 0, result.stderr
    assert "3072" in result.stdout
    assert "more nodes" in result.stdout
    assert len(result.stdout.splitlines()) < 60, len(result.stdout.splitlines())


def test_short_commands_run_without_the_collector_and_give_it_back(tmp_path, capsys):
    """A read-only command pauses CPython's cyclic collector (planc.host.collector: on a
    big build the collections found nothing and cost a third of verify) and leaves it as
    it found it; run, tune and calibrate, which start processes or search for long, keep
    it."""
    import gc
    import traceback

    from planc.cli import commands, main

    assert main(["compile", str(PLANS / "gpt-tiny.plan"), "-o", str(tmp_path / "b")]) == 0
    inside = []  # collections that started while a command's own function ran

    def record(phase, info):
        if phase == "start" and any(f"{os.sep}planc{os.sep}commands{os.sep}" in frame.filename
                                    for frame in traceback.extract_stack()):
            inside.append(info["generation"])

    gc.collect()
    gc.callbacks.append(record)
    try:
        assert gc.isenabled()
        assert main(["verify", str(tmp_path / "b")]) == 0
        assert main(["programs", str(tmp_path / "b"), "--expand"]) == 0
        assert gc.isenabled()
    finally:
        gc.callbacks.remove(record)
    assert inside == []
    assert "no deadlock" in capsys.readouterr().out
    assert sorted(name for name, c in commands().items() if c.keeps_collector) == \
        ["calibrate", "run", "tune"]
