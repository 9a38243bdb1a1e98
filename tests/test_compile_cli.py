"""``planc compile``, ``planc graph`` and ``planc explain``, run for real in subprocesses.

The build directory (its four files, atomic replacement, refusal to clobber what is
not a build), every way a build directory can be broken (always exit 1 with one line
``planc: error: ...`` naming the file, never a traceback), the output formats of
``planc graph`` and their filters, ``planc explain``'s rows and totals, and a scale
smoke test on the 1T-parameter plan. Numbers are checked against the graph that
:func:`planc.graph.derive.derive` gives in this process.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict
from functools import lru_cache
from pathlib import Path

import networkx as nx
import pytest

from planc.build.directory import graph_from_json
from planc.estimate.cost import bus_factor
from planc.compile import compile_plan
from planc.lang import load_file, load_text
from planc.vocabulary.units import format_bytes
from planc.plan.plan_json import plan_from_dict
from planc.views import explain_text, summary_text
from tests.conftest import BAD_TP, PLANS, ROOT

TINY = PLANS / "gpt-tiny.plan"
BIG = PLANS / "gpt3-175b.plan"
ONE_T = PLANS / "gpt-1t.plan"
BUILD_FILES = ["build.json", "graph.json", "plan.json", "programs", "summary.json"]
TIMEOUT = 120


# --- helpers ------------------------------------------------------------------------------


def _umask_022() -> None:
    os.umask(0o022)


def _command(args) -> list[str]:
    return [sys.executable, "-m", "planc", *map(str, args)]


def planc(*args, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run ``python -m planc ARGS`` under umask 022; bytes out, no traceback allowed."""
    result = subprocess.run(_command(args), capture_output=True, cwd=cwd or ROOT,
                            timeout=TIMEOUT, preexec_fn=_umask_022)
    result.out = result.stdout.decode("utf-8", errors="replace")
    result.err = result.stderr.decode("utf-8", errors="replace")
    assert "Traceback" not in result.err, result.err[-2000:]
    return result


def planc_many(*commands, cwd: Path | None = None) -> list[subprocess.CompletedProcess]:
    """Run several planc commands at once (independent ones; saves wall time)."""
    processes = [subprocess.Popen(_command(args), stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, cwd=cwd or ROOT,
                                  preexec_fn=_umask_022) for args in commands]
    results = []
    for args, process in zip(commands, processes):
        out, err = process.communicate(timeout=TIMEOUT)
        result = subprocess.CompletedProcess(_command(args), process.returncode, out, err)
        result.out = out.decode("utf-8", errors="replace")
        result.err = err.decode("utf-8", errors="replace")
        results.append(result)
    return results


@lru_cache(maxsize=None)
def _loaded(path: Path):
    loaded = load_file(path)
    assert loaded.ok, loaded.diagnostics
    return loaded


@lru_cache(maxsize=None)
def _derived(path: Path) -> nx.DiGraph:
    """The graph a build holds: derived, then optimised by the passes."""
    return compile_plan(_loaded(path).plan).graph


def tiny_graph() -> nx.DiGraph:
    return _derived(TINY)


def graph_json(*args, plan: Path = TINY) -> dict:
    result = planc("graph", plan, "--format", "json", *args)
    assert result.returncode == 0, result.err
    return json.loads(result.out)


def ids(data: dict) -> list[str]:
    return [node["id"] for node in data["nodes"]]


def canonical(data: dict) -> dict:
    """A node-link document with its nodes and edges in a fixed order."""
    return {**data, "nodes": sorted(data["nodes"], key=lambda n: n["id"]),
            "edges": sorted(data["edges"], key=lambda e: (e["source"], e["target"]))}


def snapshot(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture(scope="module")
def tiny_build(tmp_path_factory) -> Path:
    """A valid build of gpt-tiny, compiled once; tests copy it before changing it."""
    directory = tmp_path_factory.mktemp("tiny") / "build"
    result = planc("compile", TINY, "-o", directory)
    assert result.returncode == 0, result.err
    return directory


# --- 1. compile -----------------------------------------------------------------------------


def test_compile_writes_the_build_files(tmp_path):
    out = tmp_path / "out"
    result = planc("compile", TINY, "-o", out)
    assert result.returncode == 0, result.err
    assert result.err == ""
    assert sorted(os.listdir(out)) == BUILD_FILES
    assert sorted(os.listdir(tmp_path)) == ["out"]  # no temporary siblings left

    manifest = json.loads((out / "build.json").read_text())
    assert manifest["format"] == "planc-build"
    assert manifest["version"] == 4
    assert manifest["source_sha256"] == hashlib.sha256(TINY.read_bytes()).hexdigest()
    assert manifest["plan"] == "gpt_tiny"

    plan = _loaded(TINY).plan
    assert plan_from_dict(json.loads((out / "plan.json").read_text())) == plan

    expected = tiny_graph()
    graph = graph_from_json(json.loads((out / "graph.json").read_text()))
    assert nx.is_directed_acyclic_graph(graph)
    assert graph.number_of_nodes() == expected.number_of_nodes()
    assert graph.number_of_edges() == expected.number_of_edges()
    assert dict(graph.nodes(data=True)) == dict(expected.nodes(data=True))
    assert set(graph.edges) == set(expected.edges)

    nodes, edges = expected.number_of_nodes(), expected.number_of_edges()
    first = (f"gpt_tiny: {nodes:,} nodes and {edges:,} edges for one step (4 microbatches "
             f"folded); build written to {out}/")
    summary = json.loads((out / "summary.json").read_text())
    verified = ("verified 2 programs for 8 ranks: collectives in the same order on every "
                "group, every send matched, no deadlock, every wait after its record, no "
                "buffer overwritten in flight")
    passes = ("fuse: 53 gradient reduce-scatters -> 2; 53 parameter all-gathers -> 2; 53 "
              "optimizer steps -> 2 (2 buckets: 242 KB, 235 KB)\n"
              "route (auto): 26 ring, 1 tree of 27 collectives\n"
              "overlap: 2 once-per-step gradient reductions issued in the last microbatch's "
              "backward as soon as their inputs are final; 2 ZeRO parameter all-gathers moved "
              "to the start of the next step, each waited for by its first forward use; 9 weight "
              "gradients computed while the collective of their input gradient is in flight\n"
              "tp_overlap: 0 of 16 tp GEMMs split: the cost model predicts no gain from "
              "chunking on this topology\n")
    assert summary_text.passes(summary) == passes
    assert result.out == (first + "\n" + verified + "\n\n" + passes + "\n"
                          + summary_text.render(summary))


@pytest.mark.parametrize("section, key, value, message", [
    ("mesh", "tp", 2.0, "plan.mesh.tp is 2.0 where a whole number (no decimal point) belongs"),
    ("model", "layers", None, "plan.model.layers is a JSON null where a whole number (no "
                              "decimal point) belongs"),
    ("model", "tie_embeddings", 1, "plan.model.tie_embeddings is a JSON number where true or "
                                   "false belongs"),
    ("model", "kv_heads", "4", "plan.model.kv_heads is a JSON string where a whole number "
                               "(no decimal point) or null belongs"),
    ("model", "norm_eps", [], "plan.model.norm_eps is a JSON array where a number belongs")])
def test_a_plan_json_field_of_the_wrong_type_says_what_belongs_there(section, key, value,
                                                                     message):
    data = json.loads(json.dumps(_loaded(TINY).plan.to_dict()))
    data[section][key] = value
    with pytest.raises(TypeError) as refused:
        plan_from_dict(data)
    assert str(refused.value) == message


@pytest.mark.parametrize("where, value, message", [
    (("intra", "collectives", 0, "bandwidth"), "x", "plan.topology.intra.collectives[0]."
     "bandwidth is a JSON string where a number belongs"),
    (("intra", "collectives", 0, "latency"), None, "plan.topology.intra.collectives[0]."
     "latency is a JSON null where a number belongs"),
    (("inter", "collectives", 1, "bandwidth"), True, "plan.topology.inter.collectives[1]."
     "bandwidth is a JSON boolean where a number belongs"),
    (("intra", "collectives", 0, "kind"), "x", "plan.topology.intra.collectives[0].kind is "
     "'x', not one of all_reduce, reduce_scatter, all_gather, tree"),
    (("device", "overheads", 0, 1), "x", "plan.topology.device.overheads[0][1] is a JSON "
     "string where a number belongs")])
def test_a_calibrated_topology_s_damaged_item_in_plan_json_is_named(where, value, message):
    """Items of a tuple were checked as a whole (a Tuning whose bandwidth was text passed,
    and the cost model raised on it in every command that read the build)."""
    data = json.loads(json.dumps(_loaded(PLANS / "demo.plan").plan.to_dict()))
    holder = data["topology"]
    for key in where[:-1]:
        holder = holder[key]
    holder[where[-1]] = value
    with pytest.raises((TypeError, ValueError)) as refused:
        plan_from_dict(data)
    assert str(refused.value) == message


def test_compile_summary_totals_are_sums_over_graph_json(tmp_path):
    out = tmp_path / "out"
    assert planc("compile", TINY, "-o", out).returncode == 0
    data = json.loads((out / "graph.json").read_text())
    summary = json.loads((out / "summary.json").read_text())
    transfers: dict[int, dict] = defaultdict(lambda: defaultdict(lambda: [0, 0, 0.0]))
    flops: dict[int, float] = defaultdict(float)
    for node in data["nodes"]:
        if node["type"] == "compute":
            flops[node["stage"]] += node["repeat"] * node["flops"]
            continue
        bucket = transfers[node["stage"]][(node["axis"], node["kind"], node["phase"])]
        bucket[0] += node["repeat"]
        bucket[1] += node["repeat"] * node["bytes"]
        bucket[2] += node["repeat"] * node["bytes"] * bus_factor(node["kind"],
                                                                  node["group_size"])
    assert summary["nodes"] == len(data["nodes"])
    assert summary["edges"] == len(data["edges"])
    assert summary["world"] == 8 and summary["microbatches"] == 4
    assert [s["stage"] for s in summary["stages"]] == [0, 1]
    assert [s["layers"] for s in summary["stages"]] == [[0, 1], [2, 3]]
    for entry in summary["stages"]:
        stage = entry["stage"]
        got = {(t["axis"], t["kind"], t["phase"]): [t["count"], t["bytes"], t["bus_bytes"]]
               for t in entry["transfers"]}
        assert len(got) == len(entry["transfers"])  # one row per (axis, kind, phase)
        assert got == {key: list(value) for key, value in transfers[stage].items()}
        assert entry["flops"] == flops[stage]
    # The hand-checked gpt-tiny numbers: one forward and one backward pp transfer per
    # microbatch on each stage, zero 1's reduce-scatter and all-gather per parameter.
    stage0 = {(t["axis"], t["kind"], t["phase"]): t["count"]
              for t in summary["stages"][0]["transfers"]}
    assert stage0[("pp", "send", "forward")] == 4
    assert stage0[("pp", "recv", "backward")] == 4
    assert stage0[("dp_cp", "reduce_scatter", "backward")] == \
        stage0[("dp_cp", "all_gather", "optimizer")]


def test_compile_default_directory_is_build_slash_stem(tmp_path):
    shutil.copy(TINY, tmp_path / "gpt-tiny.plan")
    result = planc("compile", "gpt-tiny.plan", cwd=tmp_path)
    assert result.returncode == 0, result.err
    assert result.out.split("\n")[0].endswith("; build written to build/gpt-tiny/")
    assert sorted(os.listdir(tmp_path)) == ["build", "gpt-tiny.plan"]
    assert sorted(os.listdir(tmp_path / "build")) == ["gpt-tiny"]
    assert sorted(os.listdir(tmp_path / "build" / "gpt-tiny")) == BUILD_FILES


def test_compile_build_permissions_follow_the_umask(tmp_path):
    out = tmp_path / "out"
    assert planc("compile", TINY, "-o", out).returncode == 0  # under umask 022
    assert mode(out) == 0o755
    assert {name: mode(out / name) for name in BUILD_FILES} == \
        {name: 0o755 if name == "programs" else 0o644 for name in BUILD_FILES}
    assert {mode(p) for p in (out / "programs").iterdir()} == {0o644}


# --- 2. compile failures and atomicity -------------------------------------------------------


def test_invalid_plan_writes_nothing(tmp_path):
    (tmp_path / "bad.plan").write_text(BAD_TP)
    result = planc("compile", "bad.plan", "-o", "out", cwd=tmp_path)
    assert result.returncode == 1
    assert result.out == ""
    assert result.err.startswith("bad.plan:12:10: error: heads (12) must divide by tp (8)\n")
    assert result.err.endswith("1 error generated.\n")
    assert not (tmp_path / "out").exists()
    assert sorted(os.listdir(tmp_path)) == ["bad.plan"]


def test_invalid_plan_leaves_an_earlier_build_untouched(tmp_path):
    out = tmp_path / "out"
    assert planc("compile", TINY, "-o", out).returncode == 0
    before = snapshot(out)
    (tmp_path / "bad.plan").write_text(BAD_TP)
    result = planc("compile", "bad.plan", "-o", "out", cwd=tmp_path)
    assert result.returncode == 1
    assert "heads (12) must divide by tp (8)" in result.err
    assert snapshot(out) == before
    assert sorted(os.listdir(tmp_path)) == ["bad.plan", "out"]


def test_refuses_a_non_empty_directory_that_is_not_a_build(tmp_path):
    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("precious\n")
    result = planc("compile", TINY, "-o", other)
    assert result.returncode == 2  # a refused output (README, "Outputs")
    assert result.out == ""
    assert result.err == (f"planc: error: {other} exists and is not a planc build directory "
                          f"(no build.json); refusing to overwrite it\n")
    assert snapshot(other) == {"notes.txt": b"precious\n"}
    assert sorted(os.listdir(tmp_path)) == ["mine"]


def test_output_path_that_is_a_regular_file_exits_2(tmp_path):
    target = tmp_path / "file"
    target.write_text("keep\n")
    result = planc("compile", TINY, "-o", target)
    assert result.returncode == 2  # a path of the wrong kind (README, "Exit status")
    assert result.out == ""
    assert result.err == f"planc: error: -o {target}: is not a directory\n"
    assert target.read_text() == "keep\n"
    assert sorted(os.listdir(tmp_path)) == ["file"]


def test_recompiling_an_edited_plan_replaces_its_build_and_keeps_the_logs(tmp_path):
    """The edit-compile loop: the same plan file, changed, replaces its build (said on
    standard error); logs/ and whatever else compile did not write (issue 34: a run's
    metrics, a user's notes) are carried into the new build."""
    plan = tmp_path / "gpt-tiny.plan"
    plan.write_text(TINY.read_text())
    out = tmp_path / "out"
    assert planc("compile", "gpt-tiny.plan", "-o", "out", cwd=tmp_path).returncode == 0
    (out / "stale.txt").write_text("from an older build\n")
    (out / "logs" / "planc-1234abcd" / "0").mkdir(parents=True)
    (out / "logs" / "planc-1234abcd" / "0" / "stderr.log").write_text("a run's output\n")
    changed = TINY.read_text().replace("microbatches = 4", "microbatches = 2")
    assert changed != TINY.read_text()
    plan.write_text(changed)
    result = planc("compile", "gpt-tiny.plan", "-o", "out", cwd=tmp_path)
    assert result.returncode == 0, result.err
    assert result.err == (f"planc: replaced out, which held an earlier build of {plan}; its "
                          f"logs/ and stale.txt are kept in the new build\n")
    assert sorted(os.listdir(out)) == sorted(BUILD_FILES + ["logs", "stale.txt"])
    assert (out / "stale.txt").read_text() == "from an older build\n"
    assert snapshot(out / "logs") == {"planc-1234abcd/0/stderr.log": b"a run's output\n"}
    manifest = json.loads((out / "build.json").read_text())
    assert manifest["source_sha256"] == hashlib.sha256(changed.encode()).hexdigest()
    assert json.loads((out / "plan.json").read_text())["schedule"]["microbatches"] == 2
    assert sorted(os.listdir(tmp_path)) == ["gpt-tiny.plan", "out"]  # no .out.tmp-/.out.old-
    again = planc("compile", "gpt-tiny.plan", "-o", "out", cwd=tmp_path)  # the same plan
    assert (again.returncode, again.err) == (0, "")
    assert snapshot(out / "logs") == {"planc-1234abcd/0/stderr.log": b"a run's output\n"}


def test_the_build_of_another_plan_is_replaced_only_with_force(tmp_path):
    """Issue 20: a build compiled from another plan file (an edited copy being inspected,
    logs included) is not replaced without --force, and never loses its logs."""
    out = tmp_path / "out"
    assert planc("compile", TINY, "-o", out).returncode == 0
    (out / "logs" / "planc-1234abcd").mkdir(parents=True)
    (out / "logs" / "planc-1234abcd" / "note.txt").write_text("keep me\n")
    before = snapshot(out)
    copy = tmp_path / "gpt-tiny.plan"
    copy.write_text(TINY.read_text().replace("microbatches = 4", "microbatches = 2"))
    refused = planc("compile", copy, "-o", out)
    assert (refused.returncode, refused.out) == (2, "")
    assert refused.err == (f"planc: error: {out} holds the build of {TINY} (another plan); "
                           f"compile elsewhere with -o DIR, or replace it with --force\n")
    assert snapshot(out) == before
    assert sorted(os.listdir(tmp_path)) == ["gpt-tiny.plan", "out"]
    forced = planc("compile", copy, "-o", out, "--force")
    assert forced.returncode == 0, forced.err
    assert forced.err == (f"planc: replaced {out}, which held the build of {TINY} (another "
                          f"plan; --force); its logs/ are kept in the new build\n")
    assert json.loads((out / "build.json").read_text())["source"] == str(copy)
    assert snapshot(out / "logs") == {"planc-1234abcd/note.txt": b"keep me\n"}
    same_text = tmp_path / "same.plan"  # another file, the same text: the same plan
    same_text.write_text(copy.read_text())
    assert planc("compile", same_text, "-o", out).returncode == 0


def test_recompiling_into_an_empty_directory_and_with_a_trailing_slash(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    first = planc("compile", TINY, "-o", "out", cwd=tmp_path)
    assert first.returncode == 0, first.err
    again = planc("compile", TINY, "-o", "out/", cwd=tmp_path)
    assert again.returncode == 0, again.err
    assert sorted(os.listdir(out)) == BUILD_FILES
    assert sorted(os.listdir(tmp_path)) == ["out"]
    assert again.out.split("\n")[0].endswith("; build written to out/")


# --- 3. broken build directories -------------------------------------------------------------


def _edit(name: str, change):
    def apply(directory: Path) -> None:
        path = directory / name
        data = json.loads(path.read_text())
        change(data)
        path.write_text(json.dumps(data))
    return apply


def _truncate(name: str):
    def apply(directory: Path) -> None:
        text = (directory / name).read_text()
        (directory / name).write_text(text[:len(text) // 2])
    return apply


def _remove(name: str):
    return lambda directory: (directory / name).unlink()


def _as_list(name: str):
    return lambda directory: (directory / name).write_text("[1, 2, 3]\n")


def _node(kind: str, key: str, value=None, delete: bool = False):
    """Change the first node of type ``kind`` in graph.json."""
    def change(data: dict) -> None:
        node = next(n for n in data["nodes"] if n["type"] == kind)
        if delete:
            del node[key]
        else:
            node[key] = value
    return _edit("graph.json", change)


def _plan(change, refingerprint: bool = True):
    """Change plan.json; by default also its fingerprint in build.json, so that what is
    tested is the reading of a plan.json that claims to be the compiled one."""
    def apply(directory: Path) -> None:
        from planc.build.directory import _fingerprint

        _edit("plan.json", change)(directory)
        if refingerprint:
            plan = json.loads((directory / "plan.json").read_text())
            _edit("build.json", lambda d: d.update(plan_sha256=_fingerprint(plan)))(directory)
    return apply


def _plan_field(section: str, key: str, value):
    return _plan(lambda data: data[section].__setitem__(key, value))


BROKEN = {
    # name: (how to break the copied build, file the message must name, extra graph args)
    "build.json-missing": (_remove("build.json"), "build.json", ()),
    "build.json-truncated": (_truncate("build.json"), "build.json", ()),
    "build.json-list": (_as_list("build.json"), "build.json", ()),
    "build.json-version-1": (_edit("build.json", lambda d: d.update(version=1)),
                             "build.json", ()),
    "build.json-other-format": (_edit("build.json", lambda d: d.update(format="other")),
                                "build.json", ()),
    **{f"{name}-{how}": (make(name), name, ())
       for name in ("plan.json", "graph.json", "summary.json")
       for how, make in (("missing", _remove), ("truncated", _truncate), ("list", _as_list))},
    "graph.json-no-stage": (_node("transfer", "stage", delete=True), "graph.json", ()),
    "graph.json-no-reason": (_node("transfer", "reason", delete=True), "graph.json", ()),
    "graph.json-no-layer": (_node("transfer", "layer", delete=True), "graph.json", ()),
    "graph.json-no-type": (_node("compute", "type", delete=True), "graph.json", ()),
    "graph.json-no-flops": (_node("compute", "flops", delete=True), "graph.json", ()),
    "graph.json-stage-str": (_node("transfer", "stage", "0"), "graph.json", ()),
    "graph.json-stage-bool": (_node("transfer", "stage", True), "graph.json", ()),
    "graph.json-bytes-str": (_node("transfer", "bytes", "16 KB"), "graph.json", ()),
    "graph.json-repeat-float": (_node("transfer", "repeat", 1.5), "graph.json", ()),
    "graph.json-per-microbatch-int": (_node("transfer", "per_microbatch", 1), "graph.json",
                                      ()),
    "graph.json-phase-null": (_node("compute", "phase", None), "graph.json", ()),
    "graph.json-flops-str": (_node("compute", "flops", "1"), "graph.json", ()),
    "graph.json-layer-str": (_node("compute", "layer", "0"), "graph.json", ()),
    "graph.json-version-9": (_edit("graph.json", lambda d: d["graph"].update(version=9)),
                             "graph.json", ()),
    "graph.json-cycle": (_edit("graph.json", lambda d: d["edges"].append(
        {"source": d["edges"][0]["target"], "target": d["edges"][0]["source"]})),
        "graph.json", ()),
    # Values of the right type but impossible: the commands must not crash on them.
    "graph.json-stage-out-of-range": (_node("transfer", "stage", 7), "graph.json", ()),
    "graph.json-stage-negative": (_node("transfer", "stage", -1), "graph.json", ()),
    "graph.json-phase-unknown": (_node("transfer", "phase", "sideways"), "graph.json", ()),
    # Malformed structure.
    "graph.json-graph-list": (_edit("graph.json", lambda d: d.update(graph=[])),
                              "graph.json", ()),
    "graph.json-node-not-object": (_edit("graph.json", lambda d: d["nodes"].append("x")),
                                   "graph.json", ()),
    "graph.json-microbatches-str": (_edit("graph.json", lambda d: d["graph"].update(
        microbatches="4")), "graph.json", ("--microbatch", "0")),
    "graph.json-sizes-pp-str": (_edit("graph.json", lambda d: d["graph"]["sizes"].update(
        pp="2")), "graph.json", ("--stage", "1")),
    "plan.json-tp-str": (_plan_field("mesh", "tp", "x"), "plan.json", ()),
    "plan.json-tp-0": (_plan_field("mesh", "tp", 0), "plan.json", ()),
    "plan.json-layers-float": (_plan_field("model", "layers", 4.0), "plan.json", ()),
    "plan.json-microbatches-str": (_plan_field("schedule", "microbatches", "4"), "plan.json",
                                   ()),
    "plan.json-mesh-list": (_plan(lambda d: d.update(mesh=[2])), "plan.json", ()),
    "plan.json-no-model": (_plan(lambda d: d.pop("model")), "plan.json", ()),
    "plan.json-order-unknown-axis": (_plan_field("mesh", "order", ["a", "b", "c", "d"]),
                                     "plan.json", ()),
    "plan.json-sources-list": (_plan(lambda d: d.update(sources=[])), "plan.json", ()),
    "plan.json-hidden-edited": (_plan(lambda d: d["model"].update(hidden=128), False),
                                "plan.json is not the plan this build was compiled from", ()),
    "plan.json-hidden-edited-and-fingerprinted": (
        _plan(lambda d: d["model"].update(hidden=128)), "graph.json does not match plan.json",
        ()),
    "summary.json-no-stages": (_edit("summary.json", lambda d: d.pop("stages")),
                               "summary.json", ()),
}


def _assert_one_line_error(result, *names: str) -> None:
    assert result.returncode == 1, (result.returncode, result.err[-2000:])
    assert "Traceback" not in result.err, result.err[-2000:]
    assert result.out == ""
    assert result.err.startswith("planc: error: "), result.err[-2000:]
    assert result.err.endswith("\n") and result.err.count("\n") == 1, result.err[-2000:]
    for name in names:
        assert name in result.err, result.err


@pytest.fixture(scope="module")
def broken_runs(tiny_build, tmp_path_factory) -> dict:
    """Every case of BROKEN: its build directory, the directory's files before, and
    planc graph and planc explain run on it, each command a process of its own forked
    from one driver that imported planc once (tests/build_damages.py), 2 at a time."""
    from tests import hostile_inputs as hostile
    from tests.build_damages import TIME_LIMIT, run

    root = tmp_path_factory.mktemp("broken")
    cases, jobs = {}, []
    for case in sorted(BROKEN):
        breaking, _, extra = BROKEN[case]
        directory = root / case / "b"
        shutil.copytree(tiny_build, directory)
        breaking(directory)
        cases[case] = (directory, snapshot(directory))
        for argv in (["graph", str(directory), *map(str, extra)], ["explain", str(directory)]):
            jobs.append(hostile.Job(f"{case}: planc {argv[0]}", argv, str(ROOT), "fork",
                                    TIME_LIMIT))
    results = iter(zip(jobs, run(jobs, root / "driver")))
    return {case: (directory, before, [next(results), next(results)])
            for case, (directory, before) in cases.items()}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_broken_build_directory(case, broken_runs):
    directory, before, runs = broken_runs[case]
    named = BROKEN[case][1]
    problems = []
    for job, ran in runs:
        assert not ran.harness_error and not ran.timed_out and ran.signal is None, \
            (job.name, ran)
        result = subprocess.CompletedProcess(job.argv, ran.status, ran.stdout, ran.stderr)
        result.out, result.err = ran.stdout, ran.stderr
        try:
            _assert_one_line_error(result, str(directory), named)
        except AssertionError as exc:
            problems.append(f"planc {job.argv[0]}: exit {ran.status}: "
                            f"{ran.stderr.strip()[-600:]!r} ({str(exc).splitlines()[0]})")
    assert not problems, "\n".join(problems)
    assert snapshot(directory) == before  # reading never writes


def test_empty_directory(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    for result in planc_many(["graph", empty], ["explain", empty]):
        _assert_one_line_error(result, str(empty), "build.json")
        assert result.err == (f"planc: error: {empty} is not a planc build directory (no "
                              f"build.json); make one with planc compile FILE -o {empty}\n")


def test_not_a_directory(tiny_build, tmp_path):
    from planc.build import directory as build

    manifest = tmp_path / "build.json"
    shutil.copy(tiny_build / "build.json", manifest)
    with pytest.raises(build.BuildError) as caught:
        build.read(manifest)
    assert str(caught.value) == f"{manifest} is not a directory"
    # On the command line a path that is not a directory is a plan file: a JSON file is
    # then a plan with a syntax error (exit 1, the file named, no traceback).
    for result in planc_many(["graph", manifest], ["explain", manifest]):
        assert result.returncode == 1
        assert result.out == ""
        assert result.err.startswith(f"{manifest}:1:1: error: ")
        assert "Traceback" not in result.err


def test_a_valid_copy_reads_fine(tiny_build, tmp_path):
    """The control for the broken cases: the unmodified copy works."""
    directory = tmp_path / "b"
    shutil.copytree(tiny_build, directory)
    graph, explain = planc_many(["graph", directory, "--format", "json"],
                                ["explain", directory])
    assert graph.returncode == 0 and explain.returncode == 0, graph.err + explain.err
    assert len(json.loads(graph.out)["nodes"]) == tiny_graph().number_of_nodes()


# --- 4. graph formats -------------------------------------------------------------------------

DOT_NODE = re.compile(r'^\s+"((?:[^"\\]|\\.)*)" \[', re.M)


def test_graph_dot(tiny_build):
    dot, data = planc_many(["graph", TINY], ["graph", tiny_build, "--format", "json"])
    assert dot.returncode == 0 and data.returncode == 0, dot.err + data.err
    assert dot.err == ""
    text = dot.out
    assert text.startswith("// written by planc graph\ndigraph planc {\n")  # its mark
    assert text.rstrip().endswith("}")
    assert text.count("subgraph cluster_stage_0 {") == 1
    assert text.count("subgraph cluster_stage_1 {") == 1
    assert "subgraph cluster_stage_2 " not in text
    declared = Counter(m.replace('\\"', '"').replace("\\\\", "\\")
                       for m in DOT_NODE.findall(text))
    expected = ids(json.loads(data.out))
    assert len(expected) == tiny_graph().number_of_nodes()
    assert declared == Counter(expected)  # each node of the selection exactly once
    assert set(declared.values()) == {1}
    edges = re.findall(r'^\s+"((?:[^"\\]|\\.)*)" -> "((?:[^"\\]|\\.)*)"', text, re.M)
    assert len(edges) == tiny_graph().number_of_edges()


def test_graph_json_is_node_link(tmp_path):
    stdout = planc("graph", TINY, "--format", "json")
    written = planc("graph", TINY, "-o", tmp_path / "g.json")  # format from the extension
    assert stdout.returncode == 0 and written.returncode == 0
    assert written.out == ""
    data = json.loads(stdout.out)
    assert list(data)[0] == "generator" and data["generator"] == "planc graph"  # its mark
    assert set(data) == {"generator", "directed", "multigraph", "graph", "nodes", "edges"}
    assert data["directed"] is True
    assert sorted(ids(data)) == sorted(tiny_graph().nodes)
    assert {(e["source"], e["target"]) for e in data["edges"]} == set(tiny_graph().edges)
    assert canonical(json.loads((tmp_path / "g.json").read_text())) == canonical(data)


@pytest.mark.parametrize("fmt", ["dot", "json", "graphml", "html"])
def test_graph_output_is_reproducible(fmt):
    """The same input gives the same bytes, whatever the interpreter's hash seed."""
    env = [{**os.environ, "PYTHONHASHSEED": seed} for seed in ("1", "2")]
    first, second = (subprocess.run(_command(["graph", TINY, "--format", fmt]),
                                    capture_output=True, env=e, cwd=ROOT, timeout=TIMEOUT)
                     for e in env)
    assert first.returncode == 0 and second.returncode == 0
    assert first.stdout == second.stdout


def test_graph_graphml(tmp_path):
    result = planc("graph", TINY, "-o", tmp_path / "g.graphml")
    assert result.returncode == 0, result.err
    graph = nx.read_graphml(tmp_path / "g.graphml")
    assert graph.is_directed()
    assert graph.number_of_nodes() == tiny_graph().number_of_nodes()
    assert set(graph.nodes) == set(tiny_graph().nodes)
    assert graph.number_of_edges() == tiny_graph().number_of_edges()


def test_graph_html_is_self_contained(tmp_path):
    result, data = planc_many(["graph", TINY, "-o", tmp_path / "g.html"],
                              ["graph", TINY, "--format", "json"])
    assert result.returncode == 0 and data.returncode == 0, result.err + data.err
    page = (tmp_path / "g.html").read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>")
    assert set(re.findall(r"https?://[^\s\"'<>)]+", page)) == {"http://www.w3.org/2000/svg"}
    assert not re.search(r"<script[^>]*\bsrc=|<link\b|<iframe\b|<img\b|@import", page)
    embedded = re.findall(r'<script type="application/json" id="data">(.*?)</script>', page,
                          re.S)
    assert len(embedded) == 1
    payload = json.loads(embedded[0])
    expected = json.loads(data.out)
    assert sorted(n["id"] for n in payload["nodes"]) == sorted(ids(expected))
    assert len(payload["nodes"]) == len(expected["nodes"])
    names = [n["id"] for n in payload["nodes"]]
    assert {(names[u], names[v]) for u, v, _ in payload["edges"]} == \
        {(e["source"], e["target"]) for e in expected["edges"]}


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz's dot is not installed")
def test_graph_svg_and_png(tmp_path):
    svg, png = planc_many(
        ["graph", TINY, "--layers", "1", "--microbatch", "0", "-o", tmp_path / "g.svg"],
        ["graph", TINY, "--layers", "1", "--microbatch", "0", "-o", tmp_path / "g.png"])
    assert svg.returncode == 0 and png.returncode == 0, svg.err + png.err
    root = ET.fromstring((tmp_path / "g.svg").read_bytes())
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    assert (tmp_path / "g.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert mode(tmp_path / "g.svg") == 0o644 and mode(tmp_path / "g.png") == 0o644


def test_graph_png_without_output_exits_2():
    result = planc("graph", TINY, "--format", "png")
    assert result.returncode == 2
    assert result.out == ""
    assert result.err == "planc: error: png output needs -o FILE\n"


def test_graph_unknown_extension_exits_2(tmp_path):
    result = planc("graph", TINY, "-o", tmp_path / "g.foo")
    assert result.returncode == 2
    assert result.err == (f"planc: error: cannot tell the format from "
                          f"{str(tmp_path / 'g.foo')!r}; give --format (dot, svg, png, graphml, "
                          f"json, html)\n")
    assert os.listdir(tmp_path) == []
    explicit = planc("graph", TINY, "-o", tmp_path / "g.foo", "--format", "json")
    assert explicit.returncode == 0
    assert json.loads((tmp_path / "g.foo").read_text())["directed"] is True


def test_graph_output_files_are_0644(tmp_path):
    names = ["g.dot", "g.json", "g.graphml", "g.html"]
    old = tmp_path / "g.dot"
    assert planc("graph", TINY, "--layers", "1", "-o", old).returncode == 0
    old.chmod(0o600)  # replaced with --force, not kept with its old mode
    results = planc_many(*[["graph", TINY, "--layers", "0", "-o", tmp_path / n, "--force"]
                           for n in names])
    assert [r.returncode for r in results] == [0] * len(names), [r.err for r in results]
    assert {n: mode(tmp_path / n) for n in names} == {n: 0o644 for n in names}
    assert sorted(os.listdir(tmp_path)) == sorted(names)  # no .planc-* temporaries
    assert (tmp_path / "g.dot").read_text().startswith("// written by planc graph\n"
                                                       "digraph planc {")


# --- 5. filters ---------------------------------------------------------------------------------


def of_layer(graph: nx.DiGraph, data: dict, layer: int) -> bool:
    """In layer ``layer``'s view: its own nodes, and the collectives and optimizer steps
    of the gradient buckets that hold its parameters (as planc explain --layer)."""
    buckets = graph.graph.get("buckets", {})
    if data.get("bucket") in buckets and not data.get("tensor"):
        return any(m["layer"] == layer for m in buckets[data["bucket"]]["members"])
    return data["layer"] == layer


def test_filter_layer_and_microbatch():
    data = graph_json("--layers", "1", "--microbatch", "0")
    graph = tiny_graph()
    expected = {f"{n}#mb0" if d["per_microbatch"] else n
                for n, d in graph.nodes(data=True) if of_layer(graph, d, 1)}
    assert sorted(ids(data)) == sorted(expected)
    assert any(node.get("bucket") for node in data["nodes"])
    for node in data["nodes"]:
        assert node["layer"] == 1 or node["bucket"]
        assert node["microbatch"] == (0 if node["per_microbatch"] else None)
    assert data["graph"]["selection"] == "layer 1; microbatch 0"


def test_filter_microbatch_all_unfolds_every_microbatch():
    data = graph_json("--microbatch", "all")
    graph = tiny_graph()
    total = graph.graph["microbatches"]
    assert total == 4
    per = [n for n, d in graph.nodes(data=True) if d["per_microbatch"]]
    once = [n for n, d in graph.nodes(data=True) if not d["per_microbatch"]]
    assert len(data["nodes"]) == len(once) + total * len(per)
    assert sorted(ids(data)) == sorted(once + [f"{n}#mb{k}" for n in per for k in range(total)])
    for node in data["nodes"]:
        base = node["id"].split("#mb")[0]
        if node["per_microbatch"]:
            assert node["repeat"] == graph.nodes[base]["repeat"] // total
            assert node["id"] == f"{base}#mb{node['microbatch']}"
        else:
            assert node["repeat"] == graph.nodes[base]["repeat"]


@pytest.mark.parametrize("args, keep", [
    (("--stage", "1"), lambda d: d["stage"] == 1),
    (("--phase", "backward"), lambda d: d["phase"] == "backward"),
    (("--axis", "tp"), lambda d: d["type"] == "compute" or d["axis"] == "tp"),
    (("--axis", "tp", "--transfers-only"), lambda d: d["type"] == "transfer"
     and d["axis"] == "tp"),
], ids=["stage-1", "backward", "axis-tp", "axis-tp-transfers-only"])
def test_filter_keeps_exactly_the_matching_nodes(args, keep):
    data = graph_json(*args)
    graph = tiny_graph()
    expected = sorted(n for n, d in graph.nodes(data=True) if keep(d))
    assert expected and len(expected) < graph.number_of_nodes()
    assert sorted(ids(data)) == expected


def test_transfers_only_connects_transfers_through_computation():
    data = graph_json("--axis", "tp", "--transfers-only")
    graph = tiny_graph()
    kept = set(ids(data))
    edges = {(e["source"], e["target"]) for e in data["edges"]}
    assert ("F/L0/proj>attn_residual:all_reduce@tp", "F/L0/fc2>mlp_residual:all_reduce@tp") \
        in edges
    # Every edge stands for a path through dropped nodes only, and every direct edge
    # between two kept transfers is there.
    dropped = set(graph.nodes) - kept
    for u, v in edges:
        assert u in kept and v in kept
        assert nx.has_path(graph.subgraph(dropped | {u, v}), u, v), (u, v)
    for u, v in graph.edges:
        if u in kept and v in kept:
            assert (u, v) in edges
    assert nx.is_directed_acyclic_graph(graph_from_json(data))


@pytest.mark.parametrize("args, message", [
    (("--layers", "99"), "planc: error: layer 99 does not exist; the plan has layers 0..3\n"),
    (("--stage", "5"), "planc: error: stage 5 does not exist; the plan has 2 (0..1)\n"),
    (("--microbatch", "7"),
     "planc: error: microbatch 7 does not exist; the plan has 4 (0..3)\n"),
    (("--layers", "x"), "planc graph: error: argument --layers: expected a layer N or a "
                        "range A..B, got 'x'\n"),
    (("--stage", "-1"), "planc graph: error: argument --stage: expected non-negative "
                        "integers, got '-1'\n"),
    (("--stage", "1", "--layers", "0"), "planc: error: the selection (stage 1; layer 0) is "
     "empty: no node of stage 1 is in layer 0 (stage 1: layers 2-3)\n"),
    (("--axis", "cp", "--transfers-only"), "planc: error: the selection (axis cp; "
     "transfers only) is empty: no transfer of the graph is on axis cp (its transfers are "
     "on axis dp_cp, pp, stage, tp)\n"),
    (("--stage", "0", "--axis", "stage", "--transfers-only"), "planc: error: the selection "
     "(stage 0; axis stage; transfers only) is empty: no transfer of stage 0 is on axis "
     "stage (its transfers are on axis dp_cp, pp, tp)\n"),
    (("--phase", "optimizer", "--axis", "pp", "--transfers-only"), "planc: error: the "
     "selection (optimizer; axis pp; transfers only) is empty: no transfer of the "
     "optimizer phase is on axis pp (its transfers are on axis dp_cp)\n"),
], ids=["layers-99", "stage-5", "microbatch-7", "layers-x", "stage-minus-1",
        "a-layer-of-another-stage", "an-axis-with-no-transfer", "an-axis-of-another-stage",
        "an-axis-of-another-phase"])
def test_bad_filter_values_exit_2(args, message):
    result = planc("graph", TINY, *args)
    assert result.returncode == 2
    assert result.out == ""
    assert result.err.endswith(message), result.err


def test_an_interleaved_stage_s_layers_are_named_as_runs():
    """Stage 2 of an interleaved schedule holds layers 6-8 and 18-20: layer 11 lies
    between, and the reason named them as "6-20", which holds it."""
    result = planc("graph", PLANS / "pp-interleaved.plan", "--stage", "2", "--layers", "11")
    assert (result.returncode, result.err) == (2, (
        "planc: error: the selection (stage 2; layer 11) is empty: no node of stage 2 is in "
        "layer 11 (stage 2: layers 6-8, 18-20)\n"))


def test_three_options_that_keep_nothing_only_together_are_named():
    """dp-only's layer 0 has forward nodes and transfers, and its forward has transfers,
    but its layer 0's forward has none: the reason was "the options choose nothing
    together"."""
    result = planc("graph", PLANS / "dp-only.plan", "--layers", "0", "--phase", "forward",
                   "--transfers-only")
    assert (result.returncode, result.err) == (2, (
        "planc: error: the selection (layer 0; forward; transfers only) is empty: layer 0 "
        "in the forward phase holds no transfer\n"))


def test_big_plan_defaults_to_one_layer_and_one_microbatch():
    result = planc("graph", BIG, "--format", "json")
    assert result.returncode == 0, result.err
    total = _derived(BIG).number_of_nodes()
    assert result.err == (f"planc: note: the graph has {total:,} nodes; showing layer 0; "
                          f"microbatch 0 (choose with --layers, --microbatch, --stage, or "
                          f"--all)\n")
    data = json.loads(result.out)
    assert 0 < len(data["nodes"]) < 100
    expected = {f"{n}#mb0" if d["per_microbatch"] else n
                for n, d in _derived(BIG).nodes(data=True) if of_layer(_derived(BIG), d, 0)}
    assert sorted(ids(data)) == sorted(expected)


def test_big_plan_all_gives_the_whole_graph():
    result = planc("graph", BIG, "--format", "json", "--all")
    assert result.returncode == 0
    assert result.err == ""
    data = json.loads(result.out)
    assert len(data["nodes"]) == _derived(BIG).number_of_nodes()
    assert len(data["edges"]) == _derived(BIG).number_of_edges()


# --- 6. explain -----------------------------------------------------------------------------

ROW = re.compile(r"^  ([FBO])  (\S+) over (\S+) \(.*\)  .* (per microbatch|per step)  "
                 r"\[(.*)\]$")
LETTER = {"forward": "F", "backward": "B", "optimizer": "O"}


ROUTE_LINE = "     route: "
SHARED_LINE = "     not "  # explain --param: a transfer of a bucket shared with others


def _parse_explain(text: str):
    """Transfer rows with their reasons, and the totals tables, of explain's output."""
    lines = text.rstrip("\n").split("\n")
    rows, tables, i = [], [], 0
    while i < len(lines):
        line = lines[i]
        if line[:5] in ("  F  ", "  B  ", "  O  "):
            match = ROW.match(line)
            assert match, line
            reason = []
            i += 1
            if i < len(lines) and lines[i].startswith(SHARED_LINE):
                i += 1
                while i < len(lines) and lines[i].startswith("       "):
                    i += 1
            while i < len(lines) and lines[i].startswith("     ") and lines[i][5] != " " \
                    and not lines[i].startswith(ROUTE_LINE):
                reason.append(lines[i].strip())
                i += 1
            # Every collective over a group of two or more says which route it takes.
            kind, size = match.group(2), int(re.search(r" \((\d+) ranks?", line).group(1))
            routed = kind in ("all_reduce", "all_gather", "reduce_scatter") and size > 1
            assert (i < len(lines) and lines[i].startswith(ROUTE_LINE)) == routed, line
            i += routed
            rows.append((*match.groups(), " ".join(reason)))
            continue
        if line == "  per step, on each device:":
            assert lines[i + 1].split() == ["axis", "kind", "phase", "count/step",
                                            "bytes/step"]
            assert set(lines[i + 2].replace(" ", "")) == {"-"}
            i += 3
            table = {}
            while i < len(lines) and lines[i].startswith("  ") and lines[i].strip():
                axis, kind, phase, count, *size = lines[i].split()
                table[(axis, kind, phase)] = (count, " ".join(size))
                i += 1
            tables.append(table)
            continue
        i += 1
    return rows, tables


def _expected_rows(nodes):
    graph = tiny_graph()
    rows = []
    for node in nodes:
        d = graph.nodes[node]
        where = explain_text.what_it_moves(d)
        rows.append((LETTER[d["phase"]], d["kind"], d["axis"],
                     "per microbatch" if d["per_microbatch"] else "per step", where,
                     " ".join(d["reason"].split())))
    return rows


def _expected_totals(nodes):
    graph = tiny_graph()
    sums = defaultdict(lambda: [0, 0])
    for node in nodes:
        d = graph.nodes[node]
        sums[(d["axis"], d["kind"], d["phase"])][0] += d["repeat"]
        sums[(d["axis"], d["kind"], d["phase"])][1] += d["repeat"] * d["bytes"]
    return {key: (f"{c:,}", format_bytes(b)) for key, (c, b) in sums.items()}


def _transfers(predicate):
    return [n for n, d in tiny_graph().nodes(data=True)
            if d["type"] == "transfer" and predicate(d)]


def _holds_layer(d: dict, layer: int | None) -> bool:
    """A transfer of the layer, or one that moves a bucket holding its parameters."""
    if d.get("bucket") and not d.get("tensor"):
        return layer in {m["layer"] for m in
                         tiny_graph().graph["buckets"][d["bucket"]]["members"]}
    return d["layer"] == layer


def test_explain_layer(tiny_build):
    result = planc("explain", TINY, "--layer", "2")
    assert result.returncode == 0, result.err
    assert result.err == ""
    nodes = _transfers(lambda d: _holds_layer(d, 2))
    assert len(nodes) == 6  # 2 + 2 tp all-reduces; the stage's bucket, reduced and gathered
    assert result.out.split("\n")[0] == f"layer 2 (stage 1): {len(nodes)} transfers"
    rows, tables = _parse_explain(result.out)
    assert len(rows) == len(nodes)
    assert sum(line[:5] in ("  F  ", "  B  ", "  O  ") for line in result.out.split("\n")) \
        == len(nodes)
    assert all(row[-1] for row in rows)  # every row is followed by its reason
    assert Counter(rows) == Counter(_expected_rows(nodes))
    assert tables == [_expected_totals(nodes)]
    assert "outside the layers" not in result.out
    assert "  bucket c1.b0 (stage 1): 27 parameters, 235 KB, 0 elements of padding, 2 shards " \
           "of 29,344 elements" in result.out
    assert "     closed: the last gradient of the chunk" in result.out


def test_explain_marks_a_recomputed_forwards_transfers_R(tmp_path):
    """With recompute = full each layer's forward runs again in the backward, its tp
    transfers and its cp all-gather with it: explain lists them R (recomputed), between
    the forward's F and the backward's B, each with its reason."""
    source = tmp_path / "r.plan"
    source.write_text(
        "plan r { model llama { layers = 2; hidden = 64; heads = 4; ffn = 96; vocab = 128; "
        "seq = 32; batch = 8 }\n mesh { tp = 2; cp = 2 } shard { tp { sequence_parallel = on "
        "}; cp { attention = allgather } } optimize { recompute = full } }\n")
    result = planc("explain", source, "--layer", "1")
    assert result.returncode == 0, result.err
    letters = [line[2] for line in result.out.split("\n") if re.match(r"  [FBRO]  ", line)]
    assert letters == ["F"] * 5 + ["R"] * 5 + ["B"] * 7
    graph = compile_plan(load_text(source.read_text()).plan).graph
    assert sorted(n for n, d in graph.nodes(data=True) if d.get("recomputes")) == sorted(
        f"R/L{layer}/{name}" for layer in (0, 1) for name in (
            "ln1>qkv:all_gather@tp", "kv:all_gather@cp", "proj>attn_residual:reduce_scatter@tp",
            "ln2>fc1:all_gather@tp", "fc2>mlp_residual:reduce_scatter@tp"))


def test_explain_param():
    result = planc("explain", TINY, "--param", "layers.0.qkv.weight")
    assert result.returncode == 0, result.err
    rows, tables = _parse_explain(result.out)
    assert result.out.split("\n")[0] == ("transfers of layers.0.qkv.weight: 2 transfers, of "
                                         "bucket c0.b0, which it shares with 25 other "
                                         "parameters")
    assert [(r[0], r[1], r[2], r[3], r[4]) for r in rows] == [
        ("B", "reduce_scatter", "dp_cp", "per step", "bucket c0.b0"),
        ("O", "all_gather", "dp_cp", "per step", "bucket c0.b0")]
    nodes = _transfers(lambda d: d.get("bucket") == "c0.b0")
    assert Counter(rows) == Counter(_expected_rows(nodes))
    assert tables == [_expected_totals(nodes)]
    assert all("(zero 1)" in r[-1] for r in rows)
    lines = result.out.splitlines()
    assert "     layers.0.qkv.weight holds elements 44,096..50,239" in lines
    assert lines[2:5] == [
        "     not layers.0.qkv.weight's own: bucket c0.b0's reduce_scatter, shared by 26 "
        "parameters;",
        "       layers.0.qkv.weight is 24.6 KB of its 242 KB, with layers.1.fc2.bias,",
        "       layers.1.fc2.weight, layers.1.fc1.bias and 22 more"]


def test_explain_param_says_an_all_reduce_is_its_buckets():
    """A fused bucket's all-reduce is not the parameter's own: explain --param says whose
    it is, the parameter's share of it, and which parameters share it."""
    result = planc("explain", PLANS / "dp-only.plan", "--param", "layers.0.qkv.weight")
    assert result.returncode == 0, result.err
    assert result.out.splitlines()[:5] == [
        "transfers of layers.0.qkv.weight: 1 transfer, of bucket c0.b1, which it shares with "
        "39 other parameters",
        "  B  all_reduce over dp_cp (4 ranks, intra-node: [0, 1, 2, 3])  2.68 MB per step  "
        "[bucket c0.b1]",
        "     not layers.0.qkv.weight's own: bucket c0.b1's all_reduce, shared by 40 "
        "parameters;",
        "       layers.0.qkv.weight is 197 KB of its 2.68 MB, with layers.3.ln1.bias,",
        "       layers.3.ln1.weight, layers.2.fc2.bias and 36 more"]
    # Unfused, the all-reduce is the parameter's own: nothing is shared.
    alone = planc("explain", PLANS / "dp-only.plan", "--param", "layers.0.qkv.weight",
                  "--set", "optimize.fuse=off")
    assert alone.out.splitlines()[:3] == [
        "transfers of layers.0.qkv.weight: 1 transfer",
        "  B  all_reduce over dp_cp (4 ranks, intra-node: [0, 1, 2, 3])  197 KB per step  "
        "[bucket layers.0.qkv.weight]",
        "     layers.0.qkv.weight is replicated on dp = 4 ranks that each computed its gradient "
        "on their"]


def test_explain_param_lists_only_the_part_of_a_bucket_that_moves_it():
    """The all-reduce over tp of a bucket's partial sums moves its first elements only:
    the layer norm's, not the embedding's behind them."""
    plan = PLANS / "tp-sequence-parallel.plan"
    norm = planc("explain", plan, "--param", "layers.0.ln1.weight").out.splitlines()
    assert norm[0] == ("transfers of layers.0.ln1.weight: 1 transfer, of bucket c0.b4, which "
                       "it shares with 1 other parameter")
    assert norm[2:4] == [
        "     not layers.0.ln1.weight's own: bucket c0.b4's all_reduce, shared by 2 "
        "parameters;",
        "       layers.0.ln1.weight is 2.05 KB of its 4.1 KB, with layers.0.ln1.bias"]
    embedding = planc("explain", plan, "--param", "embedding.weight").out.splitlines()
    assert embedding[:2] == ["transfers of embedding.weight: 0 transfers", "  none"]


def test_explain_buckets_lists_every_bucket_and_why_it_closed():
    result = planc("explain", TINY, "--buckets")
    assert result.returncode == 0, result.err
    lines = result.out.splitlines()
    assert lines[0] == "2 buckets:"
    assert lines[1] == ("  bucket c0.b0 (stage 0): 26 parameters, 242 KB, 0 elements of "
                        "padding, 2 shards of 30,304 elements")
    assert "passes:" in lines


@pytest.mark.parametrize("chosen", [["--layer", "2"], ["--param", "embedding.weight"],
                                    ["--axis", "dp_cp"], ["--routes"]])
def test_explain_buckets_with_a_choice_it_would_not_read_is_refused(chosen):
    """--buckets lists every bucket and returned before the other options were read."""
    result = planc("explain", TINY, "--buckets", *chosen)
    assert (result.returncode, result.out) == (2, "")
    assert result.err == (f"planc: error: --buckets lists every bucket of the build; "
                          f"{chosen[0]} chooses what else to explain: give one of them\n")


def test_explain_axis_filter():
    result = planc("explain", TINY, "--axis", "tp")
    assert result.returncode == 0, result.err
    rows, tables = _parse_explain(result.out)
    layer0 = _transfers(lambda d: d["layer"] == 0 and d["axis"] == "tp")
    outside = _transfers(lambda d: d["layer"] is None and d["axis"] == "tp")
    assert {r[2] for r in rows} == {"tp"}
    assert len(rows) == len(layer0) + len(outside)
    assert Counter(rows) == Counter(_expected_rows(layer0 + outside))
    assert tables == [_expected_totals(layer0), _expected_totals(outside)]
    headers = [line for line in result.out.split("\n") if line and not line.startswith(" ")]
    assert headers == [
        f"layer 0 (stage 0): every layer has the same transfers; showing the first: "
        f"{len(layer0)} transfers over tp",
        f"outside the layers: embedding, head, loss and pipeline: {len(outside)} transfers "
        f"over tp", "passes:"]


@pytest.mark.parametrize("args, message", [
    (("--layer", "99"), "planc: error: layer 99 does not exist; the plan has layers 0..3\n"),
    (("--param", "nope"), "planc: error: the plan has no parameter 'nope'\n"),
    (("--param", "layers.0.qkv.weigth"), "planc: error: the plan has no parameter "
     "'layers.0.qkv.weigth'; did you mean 'layers.0.qkv.weight'?\n"),
    # one of the two was taken, the other ignored without a word
    (("--layer", "1", "--param", "embedding.weight"), "planc: error: --layer and --param each "
     "choose what to explain; give one of them\n"),
], ids=["layer-99", "param-nope", "param-typo", "layer-and-param"])
def test_explain_bad_values_exit_2(args, message):
    result = planc("explain", TINY, *args)
    assert result.returncode == 2
    assert result.out == ""
    assert result.err == message


@pytest.mark.parametrize("args", [(), ("--layer", "2"), ("--param", "embedding.weight"),
                                  ("--axis", "dp_cp")],
                         ids=["default", "layer-2", "param", "axis"])
def test_explain_build_directory_equals_plan_file(args, tiny_build):
    from_dir, from_file = planc_many(["explain", tiny_build, *args],
                                     ["explain", TINY, *args])
    assert from_dir.returncode == 0 and from_file.returncode == 0, from_dir.err + from_file.err
    assert from_dir.out == from_file.out
    assert from_dir.out.strip()


# --- 7. scale smoke ---------------------------------------------------------------------------


def _compile_nodes(result, directory: Path) -> set[str]:
    assert result.returncode == 0, result.err[-2000:]
    data = json.loads((directory / "graph.json").read_text())
    count = len(data["nodes"])
    assert result.out.split("\n")[0].startswith(f"gpt_1t: {count:,} nodes and ")
    return {node["id"] for node in data["nodes"]}


def test_gpt_1t_compiles_and_the_graph_does_not_grow_with_dp_or_tp(tmp_path):
    text = ONE_T.read_text()
    assert "    dp = 6\n" in text and "    tp = 8\n" in text and "batch  = 3072" in text
    dp600 = text.replace("    dp = 6\n", "    dp = 600\n").replace(
        "batch  = 3072", "batch  = 307200")  # keeps the microbatch at one sequence
    tp16 = text.replace("    tp = 8\n", "    tp = 16\n").replace(
        "topology { preset = dgx-a100 }", "topology { devices_per_node = 8 }")
    assert dp600 != text and tp16 != text and "preset" not in tp16
    (tmp_path / "dp600.plan").write_text(dp600)
    (tmp_path / "tp16.plan").write_text(tp16)
    results = planc_many(["compile", ONE_T, "-o", "base"], ["compile", "dp600.plan", "-o", "dp"],
                         cwd=tmp_path)
    results.append(planc("compile", "tp16.plan", "-o", "tp", cwd=tmp_path))
    base, dp, tp = (_compile_nodes(r, tmp_path / d) for r, d in zip(results, ["base", "dp", "tp"]))
    assert len(base) < 20_000
    assert len(dp) == len(base)
    assert len(tp) == len(base)
    assert dp == base and tp == base
    worlds = [json.loads((tmp_path / d / "summary.json").read_text())["world"]
              for d in ("base", "dp", "tp")]
    assert worlds == [8 * 64 * 6, 8 * 64 * 600, 16 * 64 * 6]


def test_the_summary_counts_a_mixtures_all_to_alls_inside_its_instruction(tmp_path):
    """moe-tiny: layer 1 of stage 0 is a mixture over ep 4, run in one instruction that
    exchanges its counts (8 experts x 8 bytes), dispatches and combines (3 all-to-alls a
    forward, 2 a backward) 2 microbatches of 16,384 bytes (8 x 32 tokens x top_k 2 x
    hidden 32 x fp32 at uniform routing); each rank's all-to-all keeps 1/4 of its buffer,
    so the bus moves 3/4. They were missing from compile's table and the report's; cut
    into transfers of their own (overlap_all_to_all), they are counted once, as
    transfers."""
    from planc.graph.summary import summarize
    from planc.compile import compile_plan
    from planc.lang import load_file

    source = ROOT / "plans" / "moe-tiny.plan"
    done = planc("compile", source, "-o", tmp_path / "out")
    assert done.returncode == 0, done.err
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    rows = {(t["axis"], t["kind"], t["phase"]): (t["count"], t["bytes"], t["bus_bytes"])
            for t in summary["stages"][0]["transfers"] if t["axis"] == "ep"}
    assert rows == {("ep", "all_to_all", "forward"): (6, 65536 + 2 * 64, 49152.0 + 2 * 48),
                    ("ep", "all_to_all", "backward"): (4, 65536, 49152.0)}
    assert "\n  ep all_to_all: a mixture's counts, dispatch and combine, inside its compute\n" \
           "    instruction unless cut into transfers of their own (at uniform routing)\n" \
           in done.out
    page = tmp_path / "report.html"
    assert planc("report", source, "-o", page).returncode == 0
    html = page.read_text()
    # the busiest stage's: stage 1, whose two layers are mixtures
    assert "<td>ep</td><td>all_to_all</td><td>backward</td><td>8</td><td>131 KB</td>" \
           "<td>98.3 KB</td><td>1</td>" in html
    assert "<code>ep all_to_all</code>: a mixture&#x27;s counts, dispatch and combine, inside its " \
           "compute instruction unless cut into transfers of their own (at uniform " \
           "routing).</p>" in html
    # model { fp8 }: what goes toward the experts (a dispatch, a combine's gradient) in
    # FP8, 1 + 4/16 bytes an element beside bf16's 2, in every mixture step alike, cut
    # or not (the cut's forward adds the counts and the routing's bytes)
    fp8 = ["model.fp8=blockwise", "model.fp8_tile=16", "model.dtype=bf16"]
    for cut_too in ([], ["schedule.overlap_all_to_all=on"]):
        loaded = load_file(source, fp8 + cut_too)
        rows = {t["phase"]: t for t in summarize(loaded.plan, compile_plan(
            loaded.plan).graph)["stages"][0]["transfers"] if t["axis"] == "ep"}
        moved = {phase: rows[phase]["bytes"] for phase in ("forward", "backward")}
        if not cut_too:
            assert moved == {"forward": 2 * (64 + 8192 * 1.25 / 2 + 8192),
                             "backward": 2 * (8192 * 1.25 / 2 + 8192)}
        else:  # a cut dispatch carries its rows' routing too: 8,320 bytes, not 8,192
            assert moved["backward"] == 2 * (8192 * 1.25 / 2 + 8320)
            assert moved["forward"] > moved["backward"]
    loaded = load_file(source, ["schedule.overlap_all_to_all=on"])
    cut = compile_plan(loaded.plan)
    inner = [n for n, d in cut.graph.nodes(data=True) if d.get("experts_over")]
    assert inner == []  # every mixture cut: its all-to-alls are transfers
    stage0 = summarize(loaded.plan, cut.graph)["stages"][0]["transfers"]
    counted = sum(t["count"] for t in stage0 if t["axis"] == "ep")
    cut_nodes = sum(d["repeat"] for _, d in cut.graph.nodes(data=True)
                    if d["type"] == "transfer" and d["axis"] == "ep" and d["stage"] == 0)
    assert counted == cut_nodes > 0
