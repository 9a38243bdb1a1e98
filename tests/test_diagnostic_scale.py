"""Hostile text stays cheap and exact (issue 11): one notion of a line for the parser,
the snippet and the JSON; every syntax error counted in one pass; printing capped with
a count of the rest; snippets of very long lines cut to a window.

Speed itself is measured in bench/diagnostics.py; these tests pin the behaviour that
made it quadratic (every diagnostic printing a whole 50 KB line, N parses for N
syntax errors)."""

from __future__ import annotations

import json

import pytest

from planc.cli import main
from planc.diagnostics import (EXCERPT_WIDTH, MAX_MESSAGE, render_json, render_text,
                               source_lines)
from planc.lang import load_text
from tests.conftest import PLANS

BASE = (PLANS / "gpt-tiny.plan").read_text()
MESH = "    tp = 2\n"

# Everything str.splitlines() breaks at, and the two line ends planc knows.
SEPARATORS = {
    "form feed": "\f", "vertical tab": "\v", "file separator": "\x1c",
    "group separator": "\x1d", "record separator": "\x1e", "next line": "\x85",
    "line separator": "\u2028", "paragraph separator": "\u2029", "lone CR": "\r",
    "CRLF": "\r\n", "LF": "\n",
}
# tp = 8 does not divide heads = 12: an error on the mesh line, whatever comes before.
PLAN = ("# one{sep}# comment\n"
        "plan p {{ model gpt {{ layers = 4; hidden = 96; heads = 12; vocab = 256; seq = 32;"
        " batch = 8 }}\n"
        "  mesh {{ tp = 8 }}\n"
        "}}\n")


def _shown_lines(rendered: str) -> list[tuple[int, str, int]]:
    """(line number, the source text shown, the caret's offset in it) of each excerpt."""
    lines = rendered.splitlines()
    found = []
    for i, line in enumerate(lines):
        number, bar, text = line.partition(" | ")
        if bar and number.strip().isdigit():
            caret = lines[i + 1].partition(" | ")[2]
            found.append((int(number), text, len(caret) - len(caret.lstrip(" "))))
    return found


@pytest.mark.parametrize("sep", SEPARATORS.values(), ids=SEPARATORS.keys())
def test_parser_snippet_and_json_agree_on_the_line_after_any_separator_in_a_comment(sep):
    text = PLAN.format(sep=sep)
    loaded = load_text(text, "sep.plan")
    # Only LF ends a line: the separator stays in line 1's comment, except a real new line.
    mesh_line = 4 if sep in ("\n", "\r\n") else 3
    error = next(d for d in loaded.diagnostics if "tp" in d.message)
    assert (error.span.line, error.span.column) == (mesh_line, 15)
    assert error.message == "heads (12) must divide by tp (8)"
    [(number, shown, caret)] = _shown_lines(render_text([error], "sep.plan", text))
    assert (number, shown, caret) == (mesh_line, "  mesh { tp = 8 }", 14)
    item = json.loads(render_json([error], "sep.plan"))["diagnostics"][0]
    assert (item["line"], item["column"]) == (mesh_line, 15)
    assert source_lines(text)[item["line"] - 1][item["column"] - 1] == "8"


@pytest.mark.parametrize("sep", [s for s in SEPARATORS.values() if s not in "\f\r\n\r\n"],
                         ids=[k for k, s in SEPARATORS.items() if s not in "\f\r\n\r\n"])
def test_a_separator_between_tokens_is_an_unexpected_character_on_its_own_line(sep):
    text = PLAN.format(sep="").replace("tp = 8", f"tp = 4{sep}")
    loaded = load_text(text, "sep.plan")
    [error] = loaded.diagnostics
    assert (error.span.line, error.span.column) == (3, 16)
    assert error.message == f"unexpected character U+{ord(sep):04X}"
    assert error.hints == ("only a new line (LF) ends a line of a plan; this character may "
                           "appear in comments and strings only",)
    [(number, shown, caret)] = _shown_lines(render_text([error], "sep.plan", text))
    assert (number, shown, caret) == (3, "  mesh { tp = 4\ufffd }", 15)


@pytest.mark.parametrize("sep", ["\f", "\r"], ids=["form feed", "lone CR"])
def test_form_feed_and_lone_cr_are_blanks_between_tokens(sep):
    text = PLAN.format(sep="").replace("tp = 8", f"tp ={sep}8")
    error = load_text(text, "sep.plan").diagnostics[0]
    assert (error.span.line, error.span.column, error.message) == (
        3, 15, "heads (12) must divide by tp (8)")


def test_the_issue_form_feed_case_shows_the_line_it_counts_in():
    """The reported defect: a form feed in a comment on line 1 made the snippet of an
    error on line 3 show line 2."""
    text = "# \f\nplan p {\n  mesh { tp = 8 }\n}\n"
    loaded = load_text(text, "ff.plan")
    rendered = render_text(loaded.diagnostics, "ff.plan", text)
    assert [(n, shown) for n, shown, _ in _shown_lines(rendered)] == [
        (d.span.line, source_lines(text)[d.span.line - 1]) for d in loaded.diagnostics]
    assert source_lines(text) == ["# \f", "plan p {", "  mesh { tp = 8 }", "}", ""]


# --- every syntax error, in one pass --------------------------------------------------


def test_ten_thousand_syntax_errors_are_all_counted():
    bad = "".join(f"    k{i} = = {i}\n" for i in range(10_000))
    loaded = load_text(BASE.replace(MESH, MESH + bad, 1), "bad.plan")
    assert len(loaded.diagnostics) == 10_000
    assert {d.message for d in loaded.diagnostics} == {"unexpected '='; expected a value"}
    first_line = BASE.splitlines().index(MESH.rstrip("\n")) + 2
    assert [(d.span.line, d.span.column) for d in loaded.diagnostics[:3]] == [
        (first_line, 10), (first_line + 1, 10), (first_line + 2, 10)]


def test_recovery_skips_only_the_broken_entry():
    text = BASE.replace(MESH, "    tp = = 2\n    pp 2\n    dp = (2\n", 1)
    loaded = load_text(text, "bad.plan")
    line = BASE.splitlines().index(MESH.rstrip("\n")) + 1
    assert [(d.span.line, d.message) for d in loaded.diagnostics] == [
        (line, "unexpected '='; expected a value"),
        (line + 1, "unexpected '2'; expected '=', '{' or a name"),
        # a new line inside ( ) means nothing: the next entry is read inside the bracket
        (line + 3, "unexpected 'pp'; expected ')'")]


# --- printing is capped, the count is not ------------------------------------------------


def _unknown_keys(n: int) -> str:
    return BASE.replace(MESH, MESH.rstrip("\n") + "; " + "; ".join(
        f"k{i} = {i}" for i in range(n)) + "\n", 1)


def test_thousands_of_unknown_keys_on_one_line_print_twenty_windows_and_a_count(
        tmp_path, capsys):
    """The reported defect: 4,000 unknown keys on one 54 KB line printed that line under
    each of them (216 MB of text, 29 s)."""
    path = tmp_path / "keys.plan"
    path.write_text(_unknown_keys(4000))
    assert main(["check", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.count("error: unknown key") == 20
    assert err.endswith("\u2026 and 3980 more errors (--max-errors 0 shows them all)\n"
                        "4000 errors generated.\n")
    assert len(err) < 20 * 500
    # the windows are bounded; the location before each message is the file's path
    assert max(len(line.replace(str(path), "keys.plan")) for line in err.splitlines()) \
        <= EXCERPT_WIDTH + 20


@pytest.mark.parametrize("limit, printed, rest", [
    ("5", 5, "\u2026 and 95 more errors (--max-errors 0 shows them all)\n"),
    ("0", 100, ""), ("100", 100, ""), ("99", 99, "\u2026 and 1 more error (--max-errors 0 "
                                                   "shows them all)\n")])
def test_max_errors(tmp_path, capsys, limit, printed, rest):
    path = tmp_path / "keys.plan"
    path.write_text(_unknown_keys(100))
    assert main(["check", str(path), "--max-errors", limit]) == 1
    err = capsys.readouterr().err
    assert err.count("error: unknown key") == printed
    assert err.endswith(rest + "100 errors generated.\n")


def test_max_errors_in_json_keeps_the_counts(tmp_path, capsys):
    path = tmp_path / "keys.plan"
    path.write_text(_unknown_keys(100))
    assert main(["check", str(path), "--error-format", "json"]) == 1
    document = json.loads(capsys.readouterr().out)
    assert (len(document["diagnostics"]), document["errors"], document["warnings"]) == (
        100, 100, 0)
    assert main(["check", str(path), "--error-format", "json", "--max-errors", "3"]) == 1
    document = json.loads(capsys.readouterr().out)
    assert [d["message"] for d in document["diagnostics"]] == [
        "unknown key 'k0' in mesh { }", "unknown key 'k1' in mesh { }",
        "unknown key 'k2' in mesh { }"]
    assert (document["errors"], document["warnings"]) == (100, 0)


@pytest.mark.parametrize("value, why", [("-1", "-1 is negative"),
                                        ("x", "'x' is not a whole number")])
def test_a_bad_max_errors_is_a_usage_error(tmp_path, capsys, value, why):
    path = tmp_path / "p.plan"
    path.write_text(BASE)
    with pytest.raises(SystemExit) as exit_:
        main(["check", str(path), "--max-errors", value])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.endswith(
        f"planc check: error: argument --max-errors: {why}\n")


# --- long lines and long values --------------------------------------------------------


def test_a_diagnostic_on_a_ten_megabyte_line_shows_a_window_around_its_span():
    long = "x" * 10_000_000
    text = BASE.replace(MESH, f'    tp = 2; notes = "{long}"; tp = 2\n', 1)
    loaded = load_text(text, "long.plan")
    rendered = render_text(loaded.diagnostics, "long.plan", text)
    assert [d.message for d in loaded.diagnostics] == [
        "unknown key 'notes' in mesh { }",
        "duplicate key 'tp' (first given at line 18)"]
    excerpts = _shown_lines(rendered)
    assert [(n, len(shown)) for n, shown, _ in excerpts] == [
        (18, EXCERPT_WIDTH + 3), (18, EXCERPT_WIDTH + 3)]
    assert excerpts[0][1] == ('    tp = 2; notes = "' + "x" * 79 + "...")
    assert excerpts[0][1][excerpts[0][2]:].startswith("notes")
    assert excerpts[1][1].endswith('x"; tp = 2')
    assert excerpts[1][1][excerpts[1][2]:] == "tp = 2"


def test_a_message_quoting_a_long_value_shows_its_two_ends():
    path = "d" * 1_000_000
    loaded = load_text(BASE.replace("seed = 0", f'seed = 0; data = "{path}"'), "p.plan")
    [message] = [d.message for d in loaded.diagnostics if "data" in d.message]
    assert len(message) < MAX_MESSAGE + 40
    assert message.startswith("data file 'ddd") and "characters) \u2026" in message


def test_wide_characters_keep_the_caret_under_the_text():
    text = BASE.replace(MESH, '    tp = 2; x = "\u65e5\u672c"; y = 1\n    \u65e5 = 1\n', 1)
    loaded = load_text(text, "wide.plan")
    assert [d.message for d in loaded.diagnostics] == [
        "unexpected character '\u65e5'"]
    rendered = render_text(loaded.diagnostics, "w.plan", text).splitlines()
    assert rendered[2] == "     |     ^~"  # one character, two columns
    text = text.replace("    \u65e5 = 1\n", "")
    loaded = load_text(text, "wide.plan")
    assert [d.message for d in loaded.diagnostics] == [
        "unknown key 'x' in mesh { }", "unknown key 'y' in mesh { }"]
    rendered = render_text(loaded.diagnostics[1:], "w.plan", text).splitlines()
    assert rendered[1] == '  18 |     tp = 2; x = "\u65e5\u672c"; y = 1'
    # 'y' is the 23rd character but sits at the 25th column: each of 日本 takes two
    assert rendered[2] == "     | " + " " * 24 + "^"
