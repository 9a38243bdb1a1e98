"""planc report (issue 21): memory bars scaled to what is drawn, a readable layout picture
of a big world with a colour per stage, the per-device figures every command prints, the
plan text inside its box, a hint where the prediction is far from the run, and metrics of
another build refused. The page itself: tests/test_simulate.py."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import xml.etree.ElementTree as ElementTree

import pytest

from planc.estimate import memory
from planc.build.directory import plan_fingerprint
from planc.cli import main
from planc.compile import compile_plan
from planc.lang import load_file, load_text
from planc.vocabulary.units import format_bytes
from planc.simulate import simulate
from planc.views.plan_summary import settings
from planc.views.report_html import BAR_SPACE, BAR_START
from planc.views.rank_picture import layout_svg, stage_colours
from tests.conftest import PLANS, resigned_plan

SMALL = (str(PLANS / "llama-small.plan"), "--set", "mesh.tp=2", "--set", "mesh.pp=2",
         "--set", "mesh.dp=2")


def _report(tmp_path, capsys, *args: str) -> str:
    page = tmp_path / "report.html"
    assert main(["report", *args, "-o", str(page), "--force"]) == 0, capsys.readouterr().err
    return page.read_text()


def _svg(page: str, label: str) -> ElementTree.Element:
    """The picture of ``page`` whose aria-label starts with ``label``."""
    for match in re.finditer(r"<svg .*?</svg>", page, re.S):
        element = ElementTree.fromstring(match.group(0))
        if element.get("aria-label", "").startswith(label):
            return element
    raise AssertionError(f"no picture {label!r}")


def _bar_ends(svg: ElementTree.Element) -> list[float]:
    """Where each stage's memory bar ends (its last rectangle's right edge), top down."""
    ends: dict[float, float] = {}
    for rect in svg.iter("rect"):
        y = float(rect.get("y"))
        ends[y] = max(ends.get(y, 0.0), round(float(rect.get("x")) + float(rect.get("width")),
                                               1))
    return [ends[y] for y in sorted(ends)]


def test_memory_bars_are_scaled_to_the_largest_stage_not_to_the_device(tmp_path, capsys):
    # gpt-tiny needs 1.61 MB of an 80 GB device: on an 80 GB axis its bars were 0.0 px.
    page = _report(tmp_path, capsys, str(PLANS / "gpt-tiny.plan"))
    estimate = memory.estimate(load_file(PLANS / "gpt-tiny.plan").plan)
    ends = _bar_ends(_svg(page, "memory"))
    peak = estimate.peak.total_bytes
    assert ends == [BAR_START + BAR_SPACE,
                    round(BAR_START + estimate.stages[1].total_bytes * BAR_SPACE / peak, 1)]
    assert ends == [860.0, 670.4]
    assert "<line" not in ElementTree.tostring(_svg(page, "memory"), encoding="unicode")
    assert ("The device has 80 GB; the largest stage uses &lt;0.1% of it, too small a share "
            "to draw on the device&#x27;s scale.") in page


def test_a_capacity_near_the_bars_is_drawn_as_a_line(tmp_path, capsys):
    # llama3-405b: 74.9 GB of 80 GB at peak (stage 1; the head's stage 15 holds the
    # logits of the one microbatch its last chunk has in flight); the axis is the
    # device, the line at its end.
    plan = load_file(PLANS / "llama3-405b.plan").plan
    estimate = memory.estimate(plan)
    page = _report(tmp_path, capsys, str(PLANS / "llama3-405b.plan"))
    svg = _svg(page, "memory")
    assert max(_bar_ends(svg)) == round(BAR_START + estimate.peak.total_bytes * BAR_SPACE
                                        / 80e9, 1) == 818.9
    (line,) = svg.iter("line")
    assert (line.get("x1"), line.get("x2")) == ("860.0", "860.0")
    assert "The dashed line is the device&#x27;s memory, 80 GB." in page


def _stage_fills(svg: ElementTree.Element) -> dict[int, set[str]]:
    """Per stage (as each cell's or block's tooltip names it), the colours it is drawn in."""
    fills: dict[int, set[str]] = {}
    for rect in svg.iter("rect"):
        stage = int(re.search(r"stage (\d+)", rect.find("title").text).group(1))
        fills.setdefault(stage, set()).add(rect.get("fill"))
    return fills


def test_a_big_world_is_drawn_as_stages_by_replicas_each_stage_its_own_colour(tmp_path,
                                                                               capsys):
    page = _report(tmp_path, capsys, str(PLANS / "llama3-405b.plan"))
    svg = _svg(page, "pipeline stages by data-parallel replicas")
    rects = list(svg.iter("rect"))
    assert len(rects) == 16 * 7  # 16 stages x (dp 0-5 and dp 127); 512 rank cells before
    fills = _stage_fills(svg)
    assert sorted(fills) == list(range(16))
    assert all(len(colours) == 1 for colours in fills.values())
    assert len({colour for colours in fills.values() for colour in colours}) == 16
    texts = [t.text for t in svg.iter("text")]
    assert texts[:8] == ["dp 0", "dp 1", "dp 2", "dp 3", "dp 4", "dp 5", "... 121 more",
                         "dp 127"]
    assert texts[8:11] == ["stage 0", "ranks 0-7", "node 0"]
    assert texts[-2:] == ["ranks 16376-16383", "node 2047"]
    assert rects[-1].find("title").text == ("stage 15 of data-parallel replica 127: 8 ranks "
                                            "(tp 8 x cp 1), ranks 16376-16383, on node 2047")


def test_a_long_pipeline_is_elided_and_its_drawn_stages_stay_distinct():
    plan = load_file(PLANS / "gpt-1t.plan").plan  # pp 64, dp 6
    svg = ElementTree.fromstring(re.search(r"<svg .*?</svg>", layout_svg(plan), re.S)
                                 .group(0))
    fills = _stage_fills(svg)
    assert sorted(fills) == list(range(12)) + [61, 62, 63]
    assert len({colour for colours in fills.values() for colour in colours}) == 15
    assert "... 49 more stages" in [t.text for t in svg.iter("text")]


def test_a_small_world_with_more_stages_than_ten_has_a_colour_per_stage():
    # The old palette had ten colours: stage 10 looked like stage 0.
    plan = load_text("plan deep { model gpt { layers = 12; hidden = 32; heads = 2; vocab = 64;"
                     " seq = 16; batch = 12 } mesh { pp = 12 } schedule { microbatches = 12 }"
                     " }").plan
    svg = ElementTree.fromstring(re.search(r"<svg .*?</svg>", layout_svg(plan), re.S)
                                 .group(0))
    assert svg.get("aria-label") == "ranks on nodes, coloured by pipeline stage"
    fills = _stage_fills(svg)
    assert sorted(fills) == list(range(12))
    assert len({colour for colours in fills.values() for colour in colours}) == 12


def test_stage_colours_never_repeat():
    for count in range(1, 1025):
        assert len(set(stage_colours(count))) == count, count


def _cli(capsys, *args: str) -> str:
    assert main(list(args)) == 0
    return capsys.readouterr().out


def test_every_command_prints_the_same_per_device_figures(tmp_path, capsys):
    """Memory: per device of a stage, the largest stage where one number is shown.
    Transfers: what one device of a stage moves, as planc compile prints it; the report
    and diff summed the stages (38.3 MB of dp_cp reduction where compile said 19.2 MB)."""
    plan = load_file(SMALL[0], SMALL[2::2]).plan
    estimate = memory.estimate(plan)
    peak, other = format_bytes(estimate.stages[1].total_bytes), format_bytes(
        estimate.stages[0].total_bytes)
    assert (peak, other, estimate.peak.stage) == ("136 MB", "112 MB", 1)
    check = _cli(capsys, "check", *SMALL)
    assert check.endswith(", 136 MB per device at peak (3 overrides applied)\n")
    verbose = _cli(capsys, "check", "-v", *SMALL).splitlines()
    # sequence parallelism: what planc run holds beyond the estimate, after the table
    held = format_bytes(estimate.planc_run_peak.planc_run_total_bytes)
    assert verbose[-1].startswith(f"as planc run holds it stage 1 would need {held} (")
    assert verbose[-3].endswith("  112 MB") and verbose[-2].endswith("  136 MB")
    layout = _cli(capsys, "layout", *SMALL).splitlines()
    assert layout[-1] == verbose[-1]
    assert layout[-3].endswith("  112 MB") and layout[-2].endswith("  136 MB")
    compiled = _cli(capsys, "compile", *SMALL, "-o", str(tmp_path / "b"))
    assert "; memory 112 MB\n" in compiled and "; memory 136 MB\n" in compiled
    assert compiled.count("  dp_cp  all_reduce      backward      2  19.2 MB    19.2 MB\n") == 2
    simulated = _cli(capsys, "simulate", *SMALL)
    assert "  memory: 136 MB at peak (stage 1)\n" in simulated
    assert f"  memory as planc run holds it: {held} (stage 1; sequence parallelism: " \
        in simulated
    diff = _cli(capsys, "diff", SMALL[0], SMALL[0], "--set-b", "mesh.tp=2", "--set-b",
                "mesh.pp=2", "--set-b", "mesh.dp=2").splitlines()
    a_at, b_at, ratio_at = (diff[0].index(title) for title in ("A: ", "B: ", "B / A"))
    b_column = {line[:a_at].strip(): line[b_at:ratio_at].strip() for line in diff[2:]}
    assert b_column["memory at peak"] == "136 MB (stage 1)"  # B: tp 2 x pp 2 x dp 2
    assert b_column["transfers over dp_cp"] == "2, 19.2 MB (stage 1)"  # was 4, 38.3 MB
    page = _report(tmp_path, capsys, str(tmp_path / "b"))
    assert "<b>136 MB</b>" in page
    memory_texts = [t.text for t in _svg(page, "memory").iter("text")]
    assert memory_texts == ["stage 0", "112 MB", "stage 1", "136 MB"]
    assert ("<tr><td>dp_cp</td><td>all_reduce</td><td>backward</td><td>2</td>"
            "<td>19.2 MB</td><td>19.2 MB</td><td>1</td></tr>") in page


def test_the_plan_text_wraps_inside_its_box(tmp_path, capsys):
    plan = load_file(SMALL[0], SMALL[2::2]).plan
    page = _report(tmp_path, capsys, *SMALL)
    style = re.search(r"<style>(.*)</style>", page, re.S).group(1)
    rule = re.search(r"\.plan \{([^}]*)\}", style).group(1)
    assert "white-space: pre-wrap" in rule and "overflow-wrap: anywhere" in rule
    assert "overflow-x" not in rule and "overflow:" not in rule and "<pre" not in page
    # Every line of the settings is in the box, whole and in order.
    box = re.search(r'<div class="plan" style="--key: 13ch">(.*?)</div></div>', page,
                    re.S).group(0)
    lines = re.findall(r'<div class="line">(.*?)</div>', box)
    assert [line.replace("&#x27;", "'") for line in lines] == settings(plan).splitlines()


def test_the_page_has_nothing_to_scroll_sideways_in_a_browser(tmp_path, capsys):
    """The longest settings line of llama-small is 158 characters; in a 1100 px window the
    old <pre> hid half of it behind a scroll bar."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("Chromium is not installed (apt-get install chromium)")
    page = _report(tmp_path, capsys, *SMALL)
    probe = tmp_path / "probe.html"
    probe.write_text(page.replace("</body>", """<script>
document.body.setAttribute("data-clipped", [...document.querySelectorAll(".plan, pre")]
  .filter(box => box.scrollWidth > box.clientWidth).length);
document.body.setAttribute("data-page-wider", document.documentElement.scrollWidth >
  window.innerWidth);
</script></body>"""))
    for width in (1100, 500):  # a laptop's window, and a phone's: the charts scale down
        done = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu",
                               f"--window-size={width},2000", "--dump-dom", probe.as_uri()],
                              capture_output=True, text=True, timeout=120)
        body = re.search(r"<body[^>]*>", done.stdout).group(0)
        assert 'data-clipped="0"' in body and 'data-page-wider="false"' in body, width


def _metrics(path, times, build: str | None = None) -> None:
    path.write_text("".join(json.dumps({"step": i, "time_s": t, "exposed_comm_s": 0.0,
                                        **({"build": build} if build else {})}) + "\n"
                            for i, t in enumerate(times)))


HINT = ('<p class="hint">The prediction is {times} times off: planc simulates a step on the '
        'plan&#x27;s topology (989 TFLOP/s per device at efficiency 0.5), and the run that '
        'wrote the metrics was on a slower machine. To predict the machine you ran on, '
        'measure it with <code>planc calibrate -o FILE</code> and name the result in the '
        'plan with <code>topology { preset = "FILE" }</code> (docs/routes.md).</p>')


def test_a_prediction_far_from_the_run_points_to_calibrate(tmp_path, capsys):
    plan = load_file(PLANS / "gpt-tiny.plan").plan
    predicted = simulate(compile_plan(plan)).step_seconds
    build = plan_fingerprint(plan)
    far, near = tmp_path / "far.jsonl", tmp_path / "near.jsonl"
    _metrics(far, [1.0, 1.0, 0.02, 0.02, 0.02], build)  # a CPU: 20 ms a step
    _metrics(near, [1.0, 1.0, predicted * 1.5, predicted * 1.5], build)
    page = _report(tmp_path, capsys, str(PLANS / "gpt-tiny.plan"), "--metrics", str(far))
    assert HINT.replace("{times}", f"{0.02 / predicted:,.0f}") in page
    assert f"{0.02 / predicted:,.0f}" == "78"
    # a percentage would read -99%, whatever the miss: the error is the ratio
    assert "<td>78x too low</td>" in page
    page = _report(tmp_path, capsys, str(PLANS / "gpt-tiny.plan"), "--metrics", str(near))
    assert "<td>-33%</td>" in page and 'class="hint"' not in page and "calibrate" not in page


def test_metrics_of_another_build_are_refused(tmp_path, capsys):
    tiny = str(PLANS / "gpt-tiny.plan")
    mine = plan_fingerprint(load_file(tiny).plan)
    other = plan_fingerprint(load_file(SMALL[0], SMALL[2::2]).plan)
    metrics, page = tmp_path / "m.jsonl", tmp_path / "report.html"
    _metrics(metrics, [0.03, 0.02], other)
    assert main(["report", tiny, "-o", str(page), "--metrics", str(metrics)]) == 1
    assert capsys.readouterr().err == (
        f"planc: error: {metrics} holds the metrics of another build (fingerprint "
        f"{other[:12]}), not of {tiny} (fingerprint {mine[:12]}); report the build that "
        f"ran, or run this one with planc run {tiny} --metrics FILE\n")
    assert not page.exists()
    metrics.write_text(json.dumps({"step": 0, "time_s": 0.03, "build": mine}) + "\n"
                       + json.dumps({"step": 1, "time_s": 0.02, "build": other}) + "\n")
    assert main(["report", tiny, "-o", str(page), "--metrics", str(metrics)]) == 1
    assert capsys.readouterr().err == (
        f"planc: error: {metrics} mixes the metrics of 2 runs (build fingerprints "
        f"{', '.join(sorted([mine[:12], other[:12]]))}); give the file of one run\n")
    _metrics(metrics, [0.03, 0.02], mine)
    assert main(["report", tiny, "-o", str(page), "--metrics", str(metrics)]) == 0
    assert capsys.readouterr().err == f"report written to {page} (13 KB, self-contained)\n"


def test_metrics_without_a_fingerprint_are_used_with_a_warning(tmp_path, capsys):
    tiny = str(PLANS / "gpt-tiny.plan")
    metrics, page = tmp_path / "m.jsonl", tmp_path / "report.html"
    _metrics(metrics, [0.03, 0.02])  # what planc run wrote before fingerprints
    assert main(["report", tiny, "-o", str(page), "--metrics", str(metrics)]) == 0
    why = (f"{metrics} has no build fingerprint (a planc run older than fingerprints wrote "
           f"it), so it cannot be checked against {tiny}; it is compared as it is")
    assert capsys.readouterr().err.splitlines()[0] == f"planc: warning: {why}"
    assert f'<p class="hint">{why}</p>' in page.read_text()


def test_a_run_writes_its_build_fingerprint_and_report_checks_it(tmp_path, capsys):
    pytest.importorskip("torch")
    plan = tmp_path / "one.plan"
    plan.write_text("plan one_rank {\n  model gpt { layers = 2; hidden = 32; heads = 2; "
                    "vocab = 64; seq = 16; batch = 4 }\n  train { steps = 2 }\n}\n")
    build, metrics = tmp_path / "build", tmp_path / "m.jsonl"
    assert main(["run", str(plan), "-o", str(build), "--metrics", str(metrics)]) == 0
    manifest = json.loads((build / "build.json").read_text())
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["build"] for r in records] == [manifest["plan_sha256"]] * 2
    capsys.readouterr()
    page = tmp_path / "report.html"
    assert main(["report", str(build), "-o", str(page), "--metrics", str(metrics)]) == 0
    assert "warning" not in capsys.readouterr().err
    assert main(["report", str(plan), "--set", "model.layers=4", "-o", str(page),
                 "--metrics", str(metrics), "--force"]) == 1
    assert "holds the metrics of another build" in capsys.readouterr().err


def test_a_build_of_an_older_planc_keeps_its_metrics(tmp_path, capsys):
    """A build whose plan.json an older planc wrote lacks the keys added since (here
    shard.dp.grad_reduce): read back, its plan's fingerprint today differs from the one
    in build.json, which its runs wrote into their metrics; report refused them as
    another build's."""
    build = tmp_path / "b"
    assert main(["compile", str(PLANS / "gpt-tiny.plan"), "-o", str(build)]) == 0
    # as planc wrote it before the key existed
    resigned_plan(build, lambda data: data["shard"]["dp"].pop("grad_reduce"))
    old = json.loads((build / "build.json").read_text())["plan_sha256"]
    assert plan_fingerprint(load_file(PLANS / "gpt-tiny.plan").plan) != old
    metrics, page = tmp_path / "m.jsonl", tmp_path / "report.html"
    _metrics(metrics, [0.03, 0.02], old)
    capsys.readouterr()
    assert main(["report", str(build), "-o", str(page), "--metrics", str(metrics)]) == 0
    assert capsys.readouterr().err == f"report written to {page} (13 KB, self-contained)\n"


def test_report_and_diff_take_transfers_from_the_verified_graph(tmp_path, capsys):
    """summary.json is not checked when a build is read (planc uses the graph): a damaged
    one made report and diff fail with a traceback."""
    build = tmp_path / "b"
    assert main(["compile", str(PLANS / "gpt-tiny.plan"), "-o", str(build)]) == 0
    summary = json.loads((build / "summary.json").read_text())
    summary["stages"][0]["transfers"][0]["bytes"] = "x"
    (build / "summary.json").write_text(json.dumps(summary))
    capsys.readouterr()
    page = _report(tmp_path, capsys, str(build))
    assert ("<tr><td>dp_cp</td><td>all_gather</td><td>optimizer</td><td>1</td>"
            "<td>242 KB</td><td>121 KB</td><td>0</td></tr>") in page
    diff = _cli(capsys, "diff", str(build), str(build)).splitlines()
    assert [re.split(r"\s{2,}", line) for line in diff
            if line.startswith("transfers over dp_cp")] == [
        ["transfers over dp_cp", "2, 485 KB (stage 0)", "2, 485 KB (stage 0)", "1.00x"]]


def test_a_calibrated_topology_far_from_the_run_says_which_machine_it_measured(tmp_path,
                                                                              capsys):
    machine = tmp_path / "machine.json"
    machine.write_text(json.dumps({
        "format": "planc-topology", "version": 1, "name": "test machine",
        "devices_per_node": 1, "device": {"flops": 4e10, "memory": None, "efficiency": 1.0},
        "intra": {"bandwidth": 1e9, "latency": 1e-4, "collectives": {}},
        "inter": {"bandwidth": 1e8, "latency": 5e-4, "collectives": {}}, "measured": {}}))
    source = tmp_path / "one.plan"
    source.write_text("plan one_rank {\n  model gpt { layers = 2; hidden = 32; heads = 2; "
                      "vocab = 64; seq = 16; batch = 4 }\n  topology { preset = "
                      "\"machine.json\" }\n}\n")
    plan = load_file(source).plan
    predicted = simulate(compile_plan(plan)).step_seconds
    metrics = tmp_path / "m.jsonl"
    _metrics(metrics, [predicted / 10] * 3, plan_fingerprint(plan))
    page = _report(tmp_path, capsys, str(source), "--metrics", str(metrics))
    assert ('<p class="hint">The prediction is 10 times off: planc simulates a step on the '
            'machine measured into machine.json, and the run that wrote the metrics was on a '
            'faster machine. To predict the machine you ran on') in page


def _candidate(**change) -> dict:
    """A layout as planc tune --json ranks it."""
    return {"mesh": {"tp": 1, "cp": 1, "pp": 2, "dp": 2, "ep": 1},
            "order": ["tp", "cp", "dp", "pp"], "virtual": 1, "microbatches": 2,
            "pipeline": "1f1b", "zero": 1, "sequence_parallel": False, "recompute": "none",
            "step_seconds": 2.7e-05, "tflops_per_gpu": 6.5, "mfu": 0.0066, "bubble": 0.33,
            "memory_bytes": 1.6e6, **change}


@pytest.mark.parametrize("key, value", [
    ("step_seconds", 10**400), ("tflops_per_gpu", 10**400), ("mfu", 10**400),
    ("bubble", 10**400), ("memory_bytes", 10**400), ("step_seconds", float("nan")),
    ("memory_bytes", -1.0)], ids=["huge step_seconds", "huge tflops_per_gpu", "huge mfu",
                                  "huge bubble", "huge memory_bytes", "NaN step_seconds",
                                  "negative memory_bytes"])
def test_a_tune_file_whose_numbers_are_out_of_range_is_refused(tmp_path, capsys, key, value):
    # each is formatted as a float: 10**400 raised OverflowError
    ranked, page = tmp_path / "tune.json", tmp_path / "report.html"
    ranked.write_text(json.dumps({"format": "planc-tune", "version": 1, "candidates": [
        _candidate(), _candidate(**{key: value})]}))
    assert main(["report", str(PLANS / "gpt-tiny.plan"), "--tune", str(ranked), "-o",
                 str(page)]) == 1
    assert capsys.readouterr().err == (f"planc: error: {ranked}: candidate 2 has no valid "
                                       f"{key}; it is not what planc tune --json writes\n")
    assert not page.exists()
    ranked.write_text(json.dumps({"format": "planc-tune", "version": 1,
                                  "candidates": [_candidate()]}))
    assert main(["report", str(PLANS / "gpt-tiny.plan"), "--tune", str(ranked), "-o",
                 str(page)]) == 0
    assert "<h2>Layouts planc tune ranked</h2>" in page.read_text()

