"""``planc graph``'s pictures: the page, the SVG and the DOT, grouped by stage and layer.

The first part checks what the views say, in process: every collective of a selection,
with ``planc explain``'s reason and human units; a layer's view holds its bucket
collectives; the SVG and DOT stay a readable size for whole big steps. The second part
opens the page in a real Chromium (playwright, the dev extra; Chromium from the system
package, as .ci/run installs it) for llama-small on tp 2, pp 2, dp 2 with ZeRO 1 and for
the 64-rank korthikanti-175b: it searches a transfer, opens its panel, and checks what
the panel shows.

Run as a script, it writes the screenshots of docs/graph.md:
``.venv/bin/python tests/test_graph_page.py docs``.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script
    sys.path.insert(0, str(ROOT))

from planc.compile import compile_plan  # noqa: E402
from planc.graph.select import Selection, default_selection, select  # noqa: E402
from planc.lang import load_file  # noqa: E402
from planc.views import html  # noqa: E402
from planc.views.graph import dot  # noqa: E402
from planc.views.graph import svg as graph_svg  # noqa: E402
from planc.views.explain_text import explain  # noqa: E402
from planc.views.graph.facts import lane_labels  # noqa: E402
from planc.views.graph.groups import groups_of  # noqa: E402

PLANS = ROOT / "plans"
LLAMA = (PLANS / "llama-small.plan",
         ("mesh.tp=2", "mesh.pp=2", "mesh.dp=2", "shard.dp.zero=1"))
WIDE = (PLANS / "korthikanti-175b.plan", ())  # tp 8 x pp 8: 64 ranks
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


@lru_cache(maxsize=None)
def built(path: Path, overrides: tuple[str, ...] = ()):
    loaded = load_file(path, overrides)
    assert loaded.ok, loaded.diagnostics
    return loaded.plan, compile_plan(loaded.plan).graph


def view(plan_spec, selection: Selection | None = None):
    plan, graph = built(*plan_spec)
    chosen = default_selection(graph) if selection is None else selection
    return plan, select(graph, chosen)


def page_data(plan, graph) -> dict:
    return html.payload(graph, plan.name, plan)


# --- what the views say --------------------------------------------------------------------


def test_every_node_is_in_exactly_one_group_of_its_stage():
    plan, graph = view(LLAMA)
    assert graph.number_of_nodes() == 158
    groups = groups_of(graph)
    placed = [n for g in groups for n in g.nodes]
    assert sorted(placed) == sorted(graph.nodes)
    assert all(graph.nodes[n]["stage"] == g.stage for g in groups for n in g.nodes)
    titles = [g.title for g in groups if g.stage == 0]
    # The stage runs its forward layers, sends, receives, then its backward layers.
    assert titles.index("layer 0 forward") < titles.index("layer 1 forward") \
        < titles.index("layer 1 backward") < titles.index("layer 0 backward") \
        < titles.index("gradient buckets") < titles.index("optimizer")


def test_the_page_holds_every_transfer_with_explains_reason_in_human_units():
    plan, graph = view(LLAMA)
    data = page_data(plan, graph)
    transfers = {n: d for n, d in graph.nodes(data=True) if d["type"] == "transfer"}
    shown = {n["id"]: n for n in data["nodes"] if n["t"] == "t"}
    assert set(shown) == set(transfers) and len(shown) == 54
    for node, item in shown.items():
        assert data["strings"][item["reason"]] == transfers[node]["reason"] != ""
        rows = dict(item["rows"])
        assert re.fullmatch(r"\d+(\.\d+)? (B|KB|MB|GB) per rank, fp32", rows["size"]), rows
        assert re.fullmatch(r"\d+(\.\d+)? (ns|µs|ms|s) each( \(\w+ route\))?, "
                            r"\d+(\.\d+)? (ns|µs|ms|s) per step", rows["estimated time"]), rows
    bucket = shown["G/c0.b0:reduce_scatter@dp_cp"]
    assert dict(bucket["rows"])["size"] == "1.06 MB per rank, fp32"
    assert bucket["params"] == [["layers.1.down.weight", "352 KB"],
                                ["layers.1.gate.weight", "352 KB"],
                                ["layers.1.up.weight", "352 KB"]]
    assert data["lanes"] == {"0": ["stage 0", "ranks 0-1, 4-5"],
                             "1": ["stage 1", "ranks 2-3, 6-7"]}


def test_a_layers_view_has_the_bucket_collectives_explain_lists():
    """Before, ``--layers 0`` dropped the gradient buckets' collectives (layer None)."""
    plan, graph = built(*LLAMA)
    layer = select(graph, Selection(layers=(1, 1)))
    kinds = sorted(f"{d['kind']}@{d['axis']}" for _, d in layer.nodes(data=True)
                   if d["type"] == "transfer")
    text = explain(plan, graph, layer=1)
    listed = int(re.search(r"layer 1 \(stage 0\): (\d+) transfers", text)[1])
    assert len(kinds) == listed == 13
    # Layer 1's parameters are in two buckets: each is reduce-scattered and gathered.
    assert kinds.count("reduce_scatter@dp_cp") == 2 and kinds.count("all_gather@dp_cp") == 2
    assert "G/c0.b0:reduce_scatter@dp_cp" in layer and "O/c0.b0:all_gather@dp_cp" in layer


def _svg_size(text: str) -> tuple[float, float]:
    root = ET.fromstring(text)
    return float(root.get("width")), float(root.get("height"))


@pytest.mark.parametrize("name, lanes, most", [
    ("pp-interleaved", 4, (6000, 1200)), ("gpt3-175b", 16, (6000, 2400))])
def test_the_svg_of_a_whole_big_step_is_lanes_of_cards(name, lanes, most):
    """Before, Graphviz drew one column (2,073 x 8,439 pt for one layer) and gave up on
    --all after 5 minutes; now planc lays it out: a lane per stage, big groups as cards."""
    plan, graph = view((PLANS / f"{name}.plan", ()), Selection())
    stages = sorted({d["stage"] for _, d in graph.nodes(data=True)})
    text = graph_svg.to_svg(graph, name, lane_labels(plan, stages))
    width, height = _svg_size(text)
    assert len(stages) == lanes
    assert width <= most[0] and height <= most[1], (width, height)
    assert all(f">stage {s}</text>" in text for s in stages)
    layers = plan.model.layers
    assert all(f"layer {i} forward</text>" in text and f"layer {i} backward</text>" in text
               for i in range(layers))


def test_the_svg_of_one_layer_reads_across_not_down():
    plan, graph = view(LLAMA)
    stages = sorted({d["stage"] for _, d in graph.nodes(data=True)})
    width, height = _svg_size(graph_svg.to_svg(graph, "t", lane_labels(plan, stages)))
    assert height < width < 4000 and height < 2500, (width, height)


def test_the_dot_has_a_cluster_per_stage_and_per_group_left_to_right():
    plan, graph = view(LLAMA)
    text = dot.to_dot(graph, "t", lane_labels(plan, [0, 1]))
    assert "rankdir=LR" in text
    assert text.count("subgraph cluster_stage_0 {") == 1
    assert text.count("subgraph cluster_stage_1 {") == 1
    groups = [g for g in groups_of(graph) if g.boxed]
    assert len(re.findall(r"subgraph cluster_stage_\d+_\d+ \{", text)) == len(groups)
    assert 'label="stage 0\\nranks 0-1, 4-5"' in text


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz's dot is not installed")
def test_graphviz_lays_out_the_dot_of_a_whole_big_step():
    plan, graph = view((PLANS / "gpt3-175b.plan", ()), Selection())
    text = dot.to_dot(graph, "gpt3", lane_labels(plan, range(16)))
    cards = text.count('shape="box", style="rounded,filled", fillcolor=')
    assert graph.number_of_nodes() == 4560 and 0 < cards < 600
    result = subprocess.run(["dot", "-Tsvg"], input=text.encode(), capture_output=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-500:]
    width, height = (float(v[:-2]) for v in re.search(
        rb'<svg width="([\d.]+pt)" height="([\d.]+pt)"', result.stdout).groups())
    assert width < 25000 and height < 6000, (width, height)


# --- in a real browser ---------------------------------------------------------------------


def _browser():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed (pip install -e '.[dev]')")
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is not installed (apt-get install chromium; .ci/run does)")
    return sync_playwright


def write_page(directory: Path, spec, selection: Selection | None, name: str) -> Path:
    plan, graph = view(spec, selection)
    path = directory / f"{name}.html"
    path.write_text(html.to_html(graph, f"{plan.name}: {graph.graph['selection']}", plan),
                    encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def browser():
    sync_playwright = _browser()
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


def open_page(browser, path: Path):
    page = browser.new_page(viewport={"width": 1600, "height": 1000})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.goto(path.as_uri())
    page.wait_for_function("window.plancGraph !== undefined")
    return page, errors


def search_and_pick(page, query: str) -> None:
    page.fill("#search", "")
    page.click("#search")
    page.keyboard.type(query)
    page.wait_for_selector("#results li[data-hit]")
    page.keyboard.press("Enter")
    page.wait_for_selector("#panel .reason")


def panel_rows(page) -> dict[str, str]:
    return page.eval_on_selector_all(
        "#panel table tr", "rows => Object.fromEntries(rows.map(r => "
        "[r.cells[0].textContent, r.cells[1].textContent]))")


def selected_is_on_screen(page) -> bool:
    return page.evaluate("""() => {
        const node = document.querySelector('.node.selected rect');
        if (!node) return false;
        const r = node.getBoundingClientRect(), c = document.getElementById('canvas')
            .getBoundingClientRect();
        return r.left >= c.left && r.right <= c.right && r.top >= c.top
            && r.bottom <= c.bottom && r.width > 100;
    }""")


def test_the_llama_page_finds_a_bucket_collective_and_explains_it(browser, tmp_path):
    plan, graph = view(LLAMA)
    path = write_page(tmp_path, LLAMA, None, "llama")
    page, errors = open_page(browser, path)
    # The page places groups as planc.views.graph.positions.place does (the SVG's layout).
    placed = page.evaluate("() => Object.fromEntries([...plancGraph.layout().boxes]"
                           ".map(([k, b]) => [k, [b.x, b.y]]))")
    assert placed == page_data(plan, graph)["placed"]
    assert page.locator("#laneLabels text.name").all_text_contents() == ["stage 0", "stage 1"]
    search_and_pick(page, "reduce_scatter dp_cp L1")
    node = "G/c0.b0:reduce_scatter@dp_cp"
    assert page.text_content("#panel h2") == node
    assert page.text_content("#panel .reason") == "Why it exists: " + graph.nodes[node]["reason"]
    rows = panel_rows(page)
    assert rows["kind"] == "reduce_scatter" and rows["axis"] == "dp_cp"
    assert rows["size"] == "1.06 MB per rank, fp32"
    assert rows["how often"] == "once per step"
    assert rows["layers.1.down.weight"] == "352 KB"
    assert rows["members"] == "0, 4" and rows["placement"] == "intra-node"
    assert selected_is_on_screen(page)
    # One rank's lane: rank 6 is on stage 1; its tp all-reduce joins ranks 6 and 7.
    page.fill("#rank", "6")
    page.dispatch_event("#rank", "change")
    assert page.locator("#laneLabels text.name").all_text_contents() == ["rank 6"]
    search_and_pick(page, "all_reduce tp bucket c1.b1")
    rows = panel_rows(page)
    assert page.text_content("#panel h2") == "G/c1.b1:all_reduce@tp"
    assert rows["members"] == "6, 7"
    assert page.text_content("#panel h3:last-of-type") == "Its ranks, seen from rank 6"
    # Transfers only: laid out again, every drawn node a transfer, no gaps.
    page.fill("#rank", "")
    page.dispatch_event("#rank", "change")
    page.check("#transfersOnly")
    drawn = page.eval_on_selector_all(".node", "ns => ns.map(n => n.classList.contains("
                                                "'transfer'))")
    assert drawn and all(drawn)
    width = page.evaluate("() => plancGraph.layout().width")
    page.uncheck("#transfersOnly")
    assert page.evaluate("() => plancGraph.layout().width") > width
    assert errors == []


def test_the_64_rank_page_finds_a_transfer_of_a_deep_layer(browser, tmp_path):
    plan, graph = view(WIDE, Selection())
    assert plan.world == 64 and graph.number_of_nodes() == 4214
    path = write_page(tmp_path, WIDE, Selection(), "wide")
    page, errors = open_page(browser, path)
    names = page.locator("#laneLabels text.name").all_text_contents()
    assert names == [f"stage {s}" for s in range(8)]
    # Layer 45 is a collapsed card of stage 3 until the search opens it.
    search_and_pick(page, "all_reduce tp L45 fc2")
    node = page.text_content("#panel h2")
    data = graph.nodes[node]
    assert (data["kind"], data["axis"], data["layer"], data["stage"]) == \
        ("all_reduce", "tp", 45, 3)
    rows = panel_rows(page)
    assert rows["members"] == "24, 25, 26, 27, 28, 29, 30, 31"
    assert rows["placement"] == "intra-node"
    assert rows["size"] == "50.3 MB per rank, fp16"
    assert selected_is_on_screen(page)
    assert errors == []


def screenshots(directory: Path) -> list[Path]:
    """The pictures of docs/graph.md, taken as the tests above drive the page."""
    from playwright.sync_api import sync_playwright

    out = []
    with sync_playwright() as p, __import__("tempfile").TemporaryDirectory() as tmp:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        for spec, selection, name, query in [
                (LLAMA, None, "graph-llama-small", "reduce_scatter dp_cp L1"),
                (WIDE, Selection(), "graph-korthikanti-175b", "all_reduce tp L45 fc2")]:
            page, _ = open_page(chromium, write_page(Path(tmp), spec, selection, name))
            page.screenshot(path=directory / f"{name}.png")
            search_and_pick(page, query)
            page.screenshot(path=directory / f"{name}-found.png")
            out += [directory / f"{name}.png", directory / f"{name}-found.png"]
        chromium.close()
    return out


if __name__ == "__main__":
    for written in screenshots(Path(sys.argv[1] if len(sys.argv) > 1 else "docs")):
        print(written)


def test_tp_overlap_pieces_are_told_apart_in_their_labels():
    """tp_overlap cuts a step into pieces of its tokens: each piece's label says which, so
    that four boxes reading "F qkv · L0" do not look like the same step four times."""
    from planc.compile import compile_plan
    from planc.lang import load_file
    from planc.views.graph.facts import node_lines

    graph = compile_plan(load_file(PLANS / "pp-interleaved.plan").plan).graph
    pieces = [(n, d) for n, d in graph.nodes(data=True)
              if d.get("token_piece") is not None and n.startswith("F/L0/qkv#")]
    assert [node_lines(d)[0] for _, d in sorted(pieces)] == [
        "F qkv \u00b7 L0 \u00b7 piece 1/2", "F qkv \u00b7 L0 \u00b7 piece 2/2"]
