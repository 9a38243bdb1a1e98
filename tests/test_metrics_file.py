"""A ``planc run --metrics`` file read as untrusted input by planc plot and planc report
(docs/metrics.md, issue 34): its text is drawn as text, never as markup; its numbers are
checked before any arithmetic. Files are crafted here; the runs that write real ones are
in tests/test_run_metrics.py."""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

from planc.build.directory import plan_fingerprint
from planc.cli import main
from planc.lang import load_file
from planc.data.metrics_file import read_metrics
from planc.views.curves import METRICS
from tests.conftest import PLANS, ROOT

TINY = str(PLANS / "gpt-tiny.plan")


@pytest.fixture(scope="module")
def fingerprint() -> str:
    """gpt-tiny's build fingerprint, which planc report asks of the metrics it draws."""
    return plan_fingerprint(load_file(TINY).plan)


def _record(step: int, build: str, **values) -> dict:
    return {"step": step, "loss": 3.0 - step / 10, "time_s": 0.02, "exposed_comm_s": 0.001,
            "tokens_per_s": 25600.0, "tflops_per_device": 0.1, "mfu": 1e-4,
            "plan": "gpt_tiny", "build": build, **values}


def _write(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _glyphs(svg: str, label: str) -> int:
    """How many glyphs draw the text ``label`` in an SVG of matplotlib (each Text is
    written as a comment of its string, then one <use> per glyph drawn)."""
    group = re.search(r"<!-- " + re.escape(label) + r" -->\s*<g[^>]*>(.*?)</g>", svg, re.S)
    assert group, label
    return group.group(1).count("<use ")


MARKUP = "$\\frac{a}{$"  # mathtext that does not parse: matplotlib raised on it
DRAWN = "$x^2$"  # mathtext that parses: as markup it is 2 glyphs, as text 5


@pytest.mark.parametrize("plan", [MARKUP, DRAWN])
def test_plot_draws_a_plan_name_as_text_never_as_markup(tmp_path, capsys, plan):
    metrics = _write(tmp_path / "m.jsonl", [_record(k, "f" * 64, plan=plan) for k in range(3)])
    assert main(["plot", str(metrics), "-o", str(tmp_path / "p.svg")]) == 0
    assert capsys.readouterr().err == f"planc: loss of 1 run written to {tmp_path / 'p.svg'}\n"
    svg = (tmp_path / "p.svg").read_text()
    assert _glyphs(svg, plan) == len(plan)  # every character, "$" and "\" included
    assert "Oblique" not in svg  # no math italics anywhere
    assert main(["plot", str(metrics), "-o", str(tmp_path / "p.png")]) == 0


def test_the_report_draws_a_plan_name_of_the_metrics_as_text(tmp_path, capsys, fingerprint):
    metrics = _write(tmp_path / "m.jsonl",
                     [_record(k, fingerprint, plan=MARKUP) for k in range(3)])
    page = tmp_path / "page.html"
    assert main(["report", TINY, "-o", str(page), "--metrics", str(metrics)]) == 0
    assert capsys.readouterr().err.startswith(f"report written to {page} (")
    text = page.read_text()
    assert "<h2>Loss per step (measured)</h2>" in text
    assert _glyphs(text, MARKUP) == len(MARKUP)


def test_a_label_is_printable_short_and_shown_even_when_it_starts_with_an_underscore(
        tmp_path, capsys):
    # matplotlib hides a label that starts with "_" from a legend it makes itself
    long = "_" + "n" * 200
    metrics = _write(tmp_path / "m.jsonl", [_record(k, "f" * 64, plan=long + "\x07")
                                            for k in range(2)])
    assert main(["plot", str(metrics), "-o", str(tmp_path / "p.svg")]) == 0
    shown = long[:47] + "\u2026"
    svg = (tmp_path / "p.svg").read_text()
    assert _glyphs(svg, shown) == 48
    assert capsys.readouterr().err == f"planc: loss of 1 run written to {tmp_path / 'p.svg'}\n"


def test_a_plot_of_many_runs_lists_the_first_and_counts_the_rest(tmp_path, capsys):
    """300 runs' legend collapsed the axes (matplotlib warned, from planc's source): the
    legend lists the first 9 and says how many more were drawn."""
    import warnings

    paths = [str(_write(tmp_path / f"m{k:03d}.jsonl", [_record(s, "f" * 64, plan=f"run{k}")
                                                       for s in range(2)]))
             for k in range(30)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert main(["plot", *paths, "-o", str(tmp_path / "p.svg")]) == 0
    svg = (tmp_path / "p.svg").read_text()
    assert _glyphs(svg, "run8") == 4 and "<!-- run9 -->" not in svg
    assert _glyphs(svg, "and 21 more runs") == len("and 21 more runs")
    assert capsys.readouterr().err == f"planc: loss of 30 runs written to {tmp_path / 'p.svg'}\n"


HUGE = 10**400  # a float of it overflows


@pytest.mark.parametrize("change, problem", ids=[
    "huge step", "step past 10^12", "negative step", "float step", "boolean step",
    "huge tokens_per_s", "huge tflops_per_device", "NaN mfu", "subnormal lr", "text loss",
    "loss past 1e100", "plan a list", "plan an object"], argvalues=[
    ({"step": HUGE}, "line 2 has no step number (a whole number from 0 to 10^12)"),
    ({"step": 10**12 + 1}, "line 2 has no step number (a whole number from 0 to 10^12)"),
    ({"step": -1}, "line 2 has no step number (a whole number from 0 to 10^12)"),
    ({"step": 1.0}, "line 2 has no step number (a whole number from 0 to 10^12)"),
    ({"step": True}, "line 2 has no step number (a whole number from 0 to 10^12)"),
    ({"tokens_per_s": HUGE}, "line 2 (step 2) has a tokens_per_s that is not a number of "
                             "magnitude 0 or 1e-100 to 1e100"),
    ({"tflops_per_device": HUGE}, "line 2 (step 2) has a tflops_per_device that is not a "
                                  "number of magnitude 0 or 1e-100 to 1e100"),
    ({"mfu": float("nan")}, "line 2 (step 2) has a mfu that is not a number of magnitude 0 "
                            "or 1e-100 to 1e100"),
    ({"lr": 1e-300}, "line 2 (step 2) has a lr that is not a number of magnitude 0 or "
                     "1e-100 to 1e100"),
    ({"loss": "2.0"}, "line 2 (step 2) has a loss that is not a number of magnitude 0 or "
                      "1e-100 to 1e100"),
    ({"loss": -1e101}, "line 2 (step 2) has a loss that is not a number of magnitude 0 or "
                       "1e-100 to 1e100"),
    # plot and report group the steps by plan: a plan that is not text has no name
    ({"plan": [1]}, "line 2 (step 2) has a plan name that is not text"),
    ({"plan": {}}, "line 2 (step 2) has a plan name that is not text"),
])
def test_numbers_out_of_range_are_refused_by_plot_and_report(tmp_path, capsys, fingerprint,
                                                             change, problem):
    records = [_record(k, fingerprint) for k in range(3)]
    records[1].update(change)
    metrics = _write(tmp_path / "m.jsonl", records)
    message = f"planc: error: {metrics}: {problem}; it is not what planc run --metrics writes\n"
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(["plot", str(metrics), "-o", str(tmp_path / "p.png")]) == 1
    assert capsys.readouterr().err == message
    assert main(["report", TINY, "-o", str(tmp_path / "page.html"), "--metrics",
                 str(metrics)]) == 1
    assert capsys.readouterr().err == message
    assert sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.mark.parametrize("time_s, shown", [
    (HUGE, "an integer of 401 digits"), (1e-300, "1e-300"), (float("inf"), "Infinity"),
    (float("nan"), "NaN"), (0, "0")],  # spelled as the file spells it, not Python's inf
    ids=["huge", "tiny", "infinite", "nan", "zero"])
def test_a_step_time_out_of_range_is_refused(tmp_path, capsys, time_s, shown):
    records = [_record(k, "f" * 64) for k in range(2)]
    records[1]["time_s"] = time_s
    metrics = _write(tmp_path / "m.jsonl", records)
    assert main(["plot", str(metrics), "-o", str(tmp_path / "p.png")]) == 1
    assert capsys.readouterr().err == (
        f"planc: error: {metrics} is not a planc run metrics file (line 2 has a time_s of "
        f"{shown}; a step's time is above 0, from 1e-100 to 1e100 seconds)\n")


@pytest.mark.parametrize("line, why", [
    ("[1, 2]", "is a JSON array, not a step record"),
    ('"step"', "is a JSON string, not a step record"),
    ('{"step": 1}', "has no time_s, the step's time"),
    ('{"step": 1, "time_s": "0.5"}', "has a time_s that is a JSON string, not a number of "
                                     "seconds"),
    ('{"step": 1, "time_s": true}', "has a time_s that is a JSON boolean, not a number of "
                                    "seconds")])
def test_a_line_that_is_no_step_record_is_named(tmp_path, capsys, line, why):
    metrics = tmp_path / "m.jsonl"
    metrics.write_text(json.dumps(_record(0, "f" * 64)) + "\n" + line + "\n")
    assert main(["plot", str(metrics), "-o", str(tmp_path / "p.png")]) == 1
    assert capsys.readouterr().err == (f"planc: error: {metrics} is not a planc run metrics "
                                       f"file (line 2 {why})\n")
    assert not (tmp_path / "p.png").exists()


def test_a_run_that_diverged_is_drawn_with_gaps(tmp_path, capsys, fingerprint):
    """planc run writes a loss that is NaN or infinite as JSON's NaN, Infinity: the file
    is read, the curve has a gap there."""
    records = [_record(k, fingerprint) for k in range(4)]
    records[2]["loss"], records[3]["loss"] = float("nan"), float("inf")
    records[3]["grad_norm"] = float("-inf")
    metrics = _write(tmp_path / "m.jsonl", records)
    assert "NaN" in metrics.read_text() and "-Infinity" in metrics.read_text()
    assert main(["plot", str(metrics), "-o", str(tmp_path / "p.png")]) == 0
    assert main(["report", TINY, "-o", str(tmp_path / "page.html"), "--metrics",
                 str(metrics)]) == 0
    assert "Loss per step" in (tmp_path / "page.html").read_text()
    assert "warning" not in capsys.readouterr().err  # a gap, among points


def test_a_run_without_one_finite_loss_is_drawn_with_a_warning(tmp_path, capsys, fingerprint):
    records = [_record(k, fingerprint) for k in range(3)]
    for record, loss in zip(records, (float("nan"), float("inf"), float("nan"))):
        record["loss"] = loss
    metrics = _write(tmp_path / "m.jsonl", records)
    assert main(["plot", str(metrics), "-o", str(tmp_path / "p.png")]) == 0
    assert capsys.readouterr().err == (
        f"planc: warning: {metrics}: every step's loss is NaN or infinite (the run diverged "
        f"from its first step): its curve has no point\n"
        f"planc: loss of 1 run written to {tmp_path / 'p.png'}\n")


def test_the_report_measures_mfu_only_where_every_step_has_it_and_its_rate(
        tmp_path, capsys, fingerprint):
    records = [_record(k, fingerprint) for k in range(4)]
    for record in records:
        del record["tflops_per_device"]  # an mfu without its rate: a KeyError drew no page
    page = tmp_path / "page.html"
    metrics = _write(tmp_path / "m.jsonl", records)
    assert main(["report", TINY, "-o", str(page), "--metrics", str(metrics), "--force"]) == 0
    assert "<td>step time</td>" in page.read_text() and "<td>MFU</td>" not in page.read_text()
    _write(metrics, [_record(k, fingerprint) for k in range(4)])
    assert main(["report", TINY, "-o", str(page), "--metrics", str(metrics), "--force"]) == 0
    assert "<td>MFU</td>" in page.read_text()


def test_every_metric_plot_draws_is_checked_by_the_reader():
    from planc.data.metrics_file import NUMBERS

    assert set(METRICS) <= set(NUMBERS)


def test_read_metrics_keeps_what_planc_run_writes(tmp_path):
    records = [_record(k, "f" * 64, lr=0.0, grad_norm=0.5) for k in range(2)]
    records[1]["eval_loss"] = 2.5
    assert read_metrics(str(_write(tmp_path / "m.jsonl", records))) == (records, None, None)


def _bounded_planc(*args) -> subprocess.CompletedProcess:
    """planc in a child held to 4 GiB of address space and a minute: a reader that reads
    /dev/zero without end fails the test, not the machine."""
    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))

    return subprocess.run([sys.executable, "-m", "planc", *map(str, args)],
                          capture_output=True, text=True, cwd=ROOT, timeout=60,
                          preexec_fn=limit)


def _not_regular(tmp_path: Path, kind: str) -> tuple[Path, str]:
    """A path that is no regular file, and what planc says it is."""
    path = tmp_path / f"m-{kind}.jsonl"
    if kind == "zero":
        path.symlink_to("/dev/zero")
        return path, "it is a character device, not a regular file"
    if kind == "fifo":
        os.mkfifo(path)  # no writer: open(2) without O_NONBLOCK waits for one
        return path, "it is a named pipe (FIFO), not a regular file"
    path.mkdir()
    return path, "it is a directory, not a regular file"


@pytest.mark.parametrize("kind", ["zero", "fifo", "directory"])
def test_plot_and_report_read_only_a_regular_file(tmp_path, kind):
    path, what = _not_regular(tmp_path, kind)
    started = time.monotonic()
    for command in (["plot", path, "-o", tmp_path / "p.png"],
                    ["report", TINY, "-o", tmp_path / "page.html", "--metrics", path],
                    ["report", TINY, "-o", tmp_path / "page.html", "--tune", path]):
        done = _bounded_planc(*command)
        assert (done.returncode, done.stderr) == (1, f"planc: error: cannot read {path}: "
                                                     f"{what}\n"), command
    assert time.monotonic() - started < 45  # three starts of planc, none of them waiting
    assert not (tmp_path / "p.png").exists() and not (tmp_path / "page.html").exists()


def test_a_metrics_or_tune_file_past_its_bound_is_refused_unread(tmp_path, capsys):
    big = tmp_path / "big.jsonl"
    with open(big, "wb") as handle:  # sparse: 1 GiB and a byte, nothing written
        handle.truncate((1 << 30) + 1)
    assert main(["plot", str(big), "-o", str(tmp_path / "p.png")]) == 1
    assert capsys.readouterr().err == (f"planc: error: cannot read {big}: it is larger than "
                                       f"1 GiB, more than planc reads of a metrics file\n")
    with open(big, "r+b") as handle:
        handle.truncate((64 << 20) + 1)  # past planc.commands.report.MAX_TUNE_BYTES
    assert main(["report", TINY, "-o", str(tmp_path / "page.html"), "--tune", str(big)]) == 1
    assert capsys.readouterr().err == (f"planc: error: cannot read {big}: it is larger than "
                                       f"{64 << 20} bytes\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.jsonl"]


def test_a_line_longer_than_a_record_can_be_is_refused_unparsed(tmp_path, capsys):
    metrics = tmp_path / "m.jsonl"
    metrics.write_text(json.dumps(_record(0, "f" * 64)) + "\n"
                       + json.dumps(_record(1, "f" * 64, note="n" * (1 << 20))) + "\n")
    assert main(["plot", str(metrics), "-o", str(tmp_path / "p.png")]) == 1
    assert capsys.readouterr().err == (f"planc: error: {metrics} is not a planc run metrics "
                                       f"file (line 2 is longer than 1 MiB)\n")


def _cut(tmp_path: Path, build: str, tail: bytes) -> Path:
    """Three whole records, then ``tail``: what a run stopped while writing leaves."""
    metrics = _write(tmp_path / "m.jsonl", [_record(k, build) for k in range(3)])
    with open(metrics, "ab") as handle:
        handle.write(tail)
    return metrics


CUT_SHORT = [json.dumps(_record(3, "f" * 64)).encode()[:57],  # a record cut in a number
             '{"plan": "gpt_tiny \u00e9'.encode()[:-1]]  # ... in a UTF-8 character


@pytest.mark.parametrize("tail", CUT_SHORT, ids=["in a number", "in a character"])
def test_plot_reads_up_to_a_last_line_cut_short_and_says_so(tmp_path, capsys, tail):
    metrics = _cut(tmp_path, "f" * 64, tail)
    assert main(["plot", str(metrics), "-o", str(tmp_path / "p.png")]) == 0
    assert capsys.readouterr().err == (
        f"planc: warning: {metrics}: line 4, the last, is cut short (a run stopped while "
        f"writing it); read the lines before it\n"
        f"planc: loss of 1 run written to {tmp_path / 'p.png'}\n")
    assert [r["step"] for r in read_metrics(str(metrics)).records] == [0, 1, 2]


def test_the_report_reads_up_to_a_last_line_cut_short_and_says_so(tmp_path, capsys,
                                                                    fingerprint):
    metrics = _cut(tmp_path, fingerprint, json.dumps(_record(3, fingerprint)).encode()[:-1])
    page = tmp_path / "page.html"
    assert main(["report", TINY, "-o", str(page), "--metrics", str(metrics)]) == 0
    assert capsys.readouterr().err.splitlines()[0] == (
        f"planc: warning: {metrics}: line 4, the last, is cut short (a run stopped while "
        f"writing it); read the lines before it")
    assert "median over 1 step of" in page.read_text()  # 3 records, 2 of them warm-up


def test_a_broken_line_before_the_last_is_a_broken_file(tmp_path, capsys):
    metrics = _cut(tmp_path, "f" * 64, CUT_SHORT[0] + b"\n"
                   + json.dumps(_record(4, "f" * 64)).encode() + b"\n")
    assert main(["plot", str(metrics), "-o", str(tmp_path / "p.png")]) == 1
    assert capsys.readouterr().err == (f"planc: error: {metrics} is not a planc run metrics "
                                       f"file (one JSON object per line)\n")
    metrics.write_bytes(CUT_SHORT[0])  # nothing but a line cut short: no step at all
    assert main(["plot", str(metrics), "-o", str(tmp_path / "p.png")]) == 1
    assert capsys.readouterr().err == (f"planc: error: {metrics} is not a planc run metrics "
                                       f"file (no step records)\n")
    assert not (tmp_path / "p.png").exists()


def test_a_whole_last_record_without_its_newline_is_read_without_a_warning(tmp_path, capsys):
    metrics = _cut(tmp_path, "f" * 64, json.dumps(_record(3, "f" * 64)).encode())
    assert read_metrics(str(metrics)).warning is None
    assert main(["plot", str(metrics), "-o", str(tmp_path / "p.png")]) == 0
    assert capsys.readouterr().err == f"planc: loss of 1 run written to {tmp_path / 'p.png'}\n"


def _resumed(tmp_path: Path, build: str, first: range, second: range) -> Path:
    """A run's records of ``first``, then those a run resumed from a checkpoint appended
    for ``second``: other losses (2.0 and on) and other step times (20 ms against 1 s)."""
    return _write(tmp_path / "m.jsonl",
                  [_record(k, build, loss=5.0 - k / 10, time_s=1.0) for k in first]
                  + [_record(k, build, loss=2.0 - k / 10, time_s=0.02) for k in second])


def _line_points(svg: str) -> list[tuple[float, float]]:
    """The vertices of the one curve of a planc plot SVG (clipped to the axes, in the
    first colour; the legend's sample is not clipped, the grid is grey)."""
    (path,) = re.findall(r'<path d="([^"]*)" clip-path="[^"]*" style="[^"]*stroke: #1f77b4',
                         svg)
    return [tuple(map(float, p.split())) for p in re.findall(r"[ML] ([\d.]+ [\d.]+)", path)]


def test_each_step_is_its_last_record_in_step_order(tmp_path, capsys):
    """Steps 0..3 of a run, then 2..5 of a run resumed from its step-2 checkpoint: the
    history is 0, 1 of the first run and 2..5 of the resumed one."""
    metrics = _resumed(tmp_path, "f" * 64, range(0, 4), range(2, 6))
    records = read_metrics(str(metrics)).records
    assert [(r["step"], r["loss"]) for r in records] == [
        (0, 5.0), (1, 4.9), (2, 1.8), (3, 1.7), (4, 1.6), (5, 1.5)]
    assert main(["plot", str(metrics), "-o", str(tmp_path / "p.svg")]) == 0
    assert capsys.readouterr().err == f"planc: loss of 1 run written to {tmp_path / 'p.svg'}\n"
    points = _line_points((tmp_path / "p.svg").read_text())
    assert len(points) == 6  # one vertex a step, left to right, the loss going down
    assert all(a[0] < b[0] for a, b in zip(points, points[1:]))
    assert all(a[1] < b[1] for a, b in zip(points, points[1:]))  # SVG's y grows downwards


def test_steps_a_resumed_run_has_not_reached_yet_are_dropped(tmp_path):
    """Steps 0..5, then 2 and 3 of a run resumed from step 2 (and stopped): 4 and 5 of
    the first run followed the steps the resumed run replaced."""
    metrics = _resumed(tmp_path, "f" * 64, range(0, 6), range(2, 4))
    assert [(r["step"], r["loss"]) for r in read_metrics(str(metrics)).records] == [
        (0, 5.0), (1, 4.9), (2, 1.8), (3, 1.7)]
    twice = _resumed(tmp_path, "f" * 64, range(0, 3), range(1, 3))  # resumed twice from 1
    with open(twice, "a") as handle:
        handle.write("".join(json.dumps(_record(k, "f" * 64, loss=1.0)) + "\n" for k in (1, 2)))
    assert [(r["step"], r["loss"]) for r in read_metrics(str(twice)).records] == [
        (0, 5.0), (1, 1.0), (2, 1.0)]


def test_the_report_measures_the_resumed_history(tmp_path, capsys, fingerprint):
    metrics = _resumed(tmp_path, fingerprint, range(0, 4), range(2, 6))
    page = tmp_path / "page.html"
    assert main(["report", TINY, "-o", str(page), "--metrics", str(metrics)]) == 0
    text = page.read_text()
    # steps 2..5 after 2 warm-up steps, all of the resumed run: 20 ms, not the first run's 1 s
    assert "median over 4 steps" in text and "<td>20 ms</td>" in text
    assert len(_line_points(text)) == 6
