"""Build directories are untrusted input (issue 12): damaged files are refused with one
line naming the file and the cause, never a traceback, a hang or gigabytes read."""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path

import pytest

from planc.cli import main
from tests.conftest import PLANS, resigned_plan, unprivileged


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("pristine")
    assert main(["compile", str(PLANS / "gpt-tiny.plan"), "-o", str(directory / "b")]) == 0
    return directory / "b"


@pytest.fixture
def build(pristine, tmp_path, capsys) -> Path:
    copy = tmp_path / "b"
    shutil.copytree(pristine, copy)
    capsys.readouterr()
    return copy


def _refused(capsys, *args) -> str:
    status = main([str(a) for a in args])
    out, err = capsys.readouterr()
    assert status == 1, (out, err)
    assert "Traceback" not in err
    return err


def test_an_integer_of_4301_digits(build, capsys):
    path = build / "plan.json"
    path.write_text(path.read_text().replace('"layers": 4', '"layers": ' + "9" * 4301, 1))
    assert _refused(capsys, "verify", build) == (
        f"planc: error: {path} holds an integer of more than 4,300 digits, which no planc "
        f"build file holds; run planc compile again\n")


def test_json_nested_100000_deep(build, capsys):
    path = build / "summary.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    assert _refused(capsys, "verify", build) == (
        f"planc: error: {path} nests its values too deep to be a planc build file; run planc "
        f"compile again\n")


def test_a_program_file_that_is_a_named_pipe(build, capsys):
    path = build / "programs" / "stage0.json"
    path.unlink()
    os.mkfifo(path)
    done = []
    thread = threading.Thread(target=lambda: done.append(
        _refused(capsys, "programs", build, "--expand")))
    thread.start()
    thread.join(timeout=60)
    assert done == [f"planc: error: cannot read {path}: it is a named pipe (FIFO), not a "
                    f"regular file\n"]


def test_a_program_file_that_links_to_dev_zero(build, capsys):
    path = build / "programs" / "stage0.json"
    path.unlink()
    path.symlink_to(os.devnull.replace("null", "zero"))
    assert _refused(capsys, "verify", build) == (
        f"planc: error: {path} is a symbolic link, and a build holds none; run planc compile "
        f"again\n")


@pytest.mark.parametrize("name", ["build.json", "plan.json", "graph.json", "summary.json",
                                  "programs/ranks.json", "programs/stage0.json", "programs"])
def test_a_build_file_that_links_to_a_valid_file_outside_the_build(build, capsys, tmp_path,
                                                                   name):
    """Issue 20: programs/stage0.json, a link to a file outside the build, was read and
    executed. Every file and directory of a build is its own: a link is refused, wherever
    it points, by every command that reads the build, before any rank starts."""
    path = build / name
    outside = tmp_path / "outside" / name.replace("/", "-")
    outside.parent.mkdir()
    shutil.move(path, outside)  # still valid, only no longer inside the build
    path.symlink_to(outside)
    expected = (f"planc: error: {path} is a symbolic link, and a build holds none; run planc "
                f"compile again\n")
    assert _refused(capsys, "verify", build) == expected
    if name.startswith("programs"):
        assert _refused(capsys, "programs", build, "--expand") == expected
    else:
        assert _refused(capsys, "explain", build) == expected
    assert _refused(capsys, "run", build, "--steps", "1") == expected
    assert not (build / "logs").exists()  # no rank started


def test_the_build_directory_itself_may_be_a_link(build, capsys, tmp_path):
    link = tmp_path / "link"
    link.symlink_to(build)
    assert main(["verify", str(link)]) == 0
    assert main(["programs", str(link), "--rank", "7"]) == 0


def test_a_schedule_naming_a_block_that_does_not_exist(build, capsys):
    path = build / "programs" / "stage0.json"
    data = json.loads(path.read_text())
    data["schedule"][0][0] = "F99"
    path.write_text(json.dumps(data))
    assert _refused(capsys, "programs", build, "--expand") == (
        f"planc: error: {path} schedules block 'F99', which it does not define; run planc "
        f"compile again\n")


@pytest.mark.parametrize("name, key, value, what, why", [
    ("ranks.json", "stages", None, "rank table", "a JSON null where an object belongs"),
    ("stage0.json", "streams", 7, "program", "a JSON number where an array or an object "
                                             "belongs"),
    ("stage0.json", "blocks", [], "program", "a JSON array where an object belongs"),
    ("groups.json", "mesh", "x", "group table", "a JSON string where an object or an array "
                                                "belongs"),
    ("model.json", "model", None, "model table", "a JSON null where an object or an array "
                                                 "belongs")])
def test_a_value_of_the_wrong_json_type_is_named_in_json_s_words(build, capsys, name, key,
                                                                   value, what, why):
    """Python's own message ('NoneType' object is not iterable) named its types."""
    path = _edit_json(build / "programs" / name, lambda data: data.update({key: value}))
    assert _refused(capsys, "verify", build) == (
        f"planc: error: {path} is not a valid {what} ({why}); run planc compile again\n")


@pytest.mark.parametrize("kind", ["file", "symlink"])
def test_logs_that_is_not_a_directory_of_the_build(build, capsys, tmp_path, kind):
    pytest.importorskip("torch")
    logs = build / "logs"
    if logs.exists():
        shutil.rmtree(logs)
    if kind == "file":
        logs.write_text("")
    else:
        (tmp_path / "elsewhere").mkdir()
        logs.symlink_to(tmp_path / "elsewhere")
    status = main(["run", str(build), "--steps", "1"])
    err = capsys.readouterr().err
    assert status == 1  # the build is an input, and this one cannot be used
    what = "a symbolic link" if kind == "symlink" else "not a directory"
    assert err.endswith(f"planc: error: {logs} is {what}; every rank's output is written "
                        f"there, inside the build only: remove it\n")
    assert list((tmp_path / "elsewhere").iterdir() if kind == "symlink" else []) == []


@pytest.mark.parametrize("change, reason", [
    (lambda d: d["model"].update(dtype="fp64"),
     "plan.model.dtype is 'fp64', not one of fp32, bf16, fp16"),
    (lambda d: d["topology"]["intra"].update(bandwidth=0.0),
     "plan.topology.intra.bandwidth is 0.0, not a positive finite number"),
    (lambda d: d["train"]["optimizer"].update(lr=-1.0),
     "plan.train.optimizer.lr is -1.0, not a positive finite number"),
    (lambda d: d["train"]["optimizer"].update(lr=float("nan")),
     "plan.train.optimizer.lr is NaN, not a positive finite number"),
    # a topology's numbers in a calibrated topology's range, rows of numbers included
    # (each of these once reached the cost model: math domain error, StopIteration,
    # ZeroDivisionError, or a step of 1e300 s printed)
    (lambda d: d["topology"]["intra"].update(latency=1e300),
     "plan.topology.intra.latency is 1e+300, not a number from 0 to 3600"),
    (lambda d: d["topology"]["intra"].update(sweep=[[0, 1e9], [1e6, 2e9]]),
     "plan.topology.intra.sweep[0][0] is 0, not a number from 1 to 1e+30"),
    (lambda d: d["topology"]["intra"].update(sweep=[[1e3, 1e-300]]),
     "plan.topology.intra.sweep[0][1] is 1e-300, not a number from 1 to 1e+30"),
    (lambda d: d["topology"]["intra"].update(sweep=[[1e6, 1e9], [1e6, 2e9]]),
     "plan.topology.intra.sweep[1][0] is 1000000.0, not above "
     "plan.topology.intra.sweep[0][0] (1000000.0): a sweep's buffer sizes increase"),
    (lambda d: d["topology"]["device"].update(overheads=[["matmul", float("nan"), 1.0]]),
     "plan.topology.device.overheads[0][1] is NaN, not a number from 0 to 3600"),
    (lambda d: d["schedule"].update(microbatches=10**9),
     "plan's microbatches (1000000000) is more than planc's limit of 65536"),
    (lambda d: d["optimize"].update(grad_accumulation="separate"),
     "plan.optimize.grad_accumulation is 'separate', not one of fused, buffer, autograd"),
    (lambda d: d["shard"]["dp"].update(reduce_dtype="fp8"),
     "plan.shard.dp.reduce_dtype is 'fp8', not one of model, fp32"),
    (lambda d: d["shard"]["dp"].update(grad_reduce="all_gather"),
     "plan.shard.dp.grad_reduce is 'all_gather', not one of reduce_scatter, all_reduce"),
    (lambda d: d["shard"]["dp"].update(grad_reduce="all_reduce", zero=2),
     "plan.shard.dp.grad_reduce is all_reduce with zero = 2"),
    (lambda d: d["optimize"].update(kernels="compiled"),
     "plan.optimize.kernels is 'compiled', not one of fused, eager"),
    (lambda d: d["train"].update(data='[[0.5, "a.tokens"]]'),
     "plan.train.data is '[[0.5, \"a.tokens\"]]', neither a path nor a mixture of [weight, "
     "path] pairs"),
    # what planc check refuses, word for word or by range (each once reached a pass:
    # ValueError, StopIteration, KeyError, ZeroDivisionError, MemoryError or no end)
    (lambda d: d["schedule"].update(pipeline="x"),
     "plan.schedule.pipeline is 'x', not one of gpipe, 1f1b, interleaved, zb1p, "
     "interleaved_zb, zbv or dualpipev"),
    (lambda d: d["optimize"].update(route="x"),
     "plan.optimize.route is 'x', not one of ring, tree, hierarchical or auto"),
    (lambda d: d["optimize"].update(recompute="x"),
     "plan.optimize.recompute is 'x', not one of none, selective, attention_inputs or full"),
    (lambda d: d["mesh"].update(ep=0), "plan.mesh.ep must be at least 1, got 0"),
    (lambda d: d["mesh"].update(ep=10**9),
     "plan.mesh.ep (1000000000) does not divide a stage's tp x cp x dp ranks"),
    (lambda d: d["optimize"].update(tp_overlap=10**9),
     "plan.optimize.tp_overlap (1000000000) does not cut seq / cp by tp"),
    (lambda d: d["model"].update(family="moe"),
     "plan.model.options has no experts, a key of model moe"),
    # a key every model holds, written among the options too, is read by its kind there
    (lambda d: d["model"].update(options={"heads": 0}),
     "plan.model.options.heads is 0, not a positive integer"),
], ids=["dtype-fp64", "bandwidth-0", "lr-negative", "lr-nan", "latency-1e300", "sweep-size-0",
        "sweep-bandwidth-1e-300", "sweep-sizes-equal", "overhead-nan", "microbatches-1e9",
        "grad-accumulation", "reduce-dtype", "grad-reduce", "grad-reduce-zero2", "kernels",
        "one-source-mixture", "pipeline-word", "route-word", "recompute-word", "ep-0",
        "ep-1e9", "tp-overlap-1e9", "family-without-its-keys", "core-key-in-options"])
def test_a_resigned_plan_json_is_checked_again(build, capsys, change, reason):
    path = resigned_plan(build, change)
    assert _refused(capsys, "verify", build) == (
        f"planc: error: {path} is not a valid plan ({reason}); run planc compile again\n")


def test_a_topology_planc_check_accepts_is_read_back_from_its_build(tmp_path, capsys):
    """plan.json's ranges are the language's: an efficiency of 1e-7, which planc check
    takes, was refused on read-back ('not a number from 1e-06 to 1', a calibrated
    topology's floor), in every command of the build, and compiling again could not
    help."""
    build = tmp_path / "b"
    assert main(["compile", str(PLANS / "dp-only.plan"), "--set",
                 "topology.device.efficiency=1e-7", "-o", str(build)]) == 0
    assert main(["verify", str(build)]) == 0, capsys.readouterr().err


def _edit_json(path: Path, change) -> Path:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))
    return path


def _first_compute(block: list) -> dict:
    return next(i for i in block if i["op"] == "compute")


@pytest.mark.parametrize("change, reason", [
    (lambda d: _first_compute(d["blocks"]["F0"]).update(op="exec"),
     "instruction with an unknown op or stream"),
    (lambda d: _first_compute(d["blocks"]["F0"]).update(stream="exec"),
     "block F0 uses stream 'exec', which the program does not declare"),
    (lambda d: _first_compute(d["blocks"]["F0"]).update(node="exec"),
     None),
], ids=["op", "stream", "node"])
def test_an_instruction_planc_did_not_write(build, capsys, change, reason):
    path = _edit_json(build / "programs" / "stage0.json", change)
    err = _refused(capsys, "verify", build)
    if reason is None:
        assert err == (f"planc: error: {build / 'programs'} names node 'exec', which "
                       f"graph.json does not have; run planc compile again\n")
    else:
        assert err.startswith(f"planc: error: {path} is not a valid program ({reason}")


def test_a_graph_node_with_an_op_no_kernel_runs(build, capsys):
    def change(data):
        node = next(n for n in data["nodes"] if n.get("op") == "gelu")
        node["op"] = "exec"

    _edit_json(build / "graph.json", change)
    assert _refused(capsys, "verify", build) == (
        f"planc: error: {build / 'graph.json'}: node 'F/L0/gelu': missing or invalid op; run "
        f"planc compile again\n")


def test_a_graph_in_another_json_layout_reads_as_the_one_compile_wrote(build, capsys):
    """A graph.json byte for byte as compile writes it for plan.json is read without its
    schema checked again; the same graph in another layout (indented, keys sorted) has its
    schema checked and its content compared, and is the plan's all the same: both read
    into equal graphs, and every command prints the same."""
    import networkx as nx

    from planc.build.directory import read

    as_written = read(build)
    printed = [main(["programs", str(build), "--expand"]), capsys.readouterr()]
    path = build / "graph.json"
    path.write_text(json.dumps(json.loads(path.read_text()), indent=2, sort_keys=True))
    relaid = read(build)
    assert nx.utils.graphs_equal(as_written.graph, relaid.graph)
    assert as_written.graph.graph == relaid.graph.graph
    assert [main(["programs", str(build), "--expand"]), capsys.readouterr()] == printed
    assert printed[0] == 0 and printed[1].out.count("\n") > 100


def test_a_graph_edited_along_with_its_programs_is_not_the_plans(tmp_path, capsys):
    """The verifier proves the programs against graph.json; with the optimizer step of a
    bucket taken out of both (its edge too; without ZeRO nothing reads its output), every
    rule held, and the run would have trained with those parameters frozen. The graph
    must be the one plan.json derives."""
    build, step = tmp_path / "b", "O/c0.b0/optimizer"
    assert main(["compile", str(PLANS / "gpt-tiny.plan"), "--set", "shard.dp.zero=0", "-o",
                 str(build)]) == 0
    capsys.readouterr()

    def without_the_step(data):
        data["nodes"] = [n for n in data["nodes"] if n["id"] != step]
        data["edges"] = [e for e in data["edges"] if step not in (e["source"], e["target"])]

    def without_its_instruction(data):
        data["epilogue"] = [i for i in data["epilogue"] if i.get("node") != step]

    _edit_json(build / "graph.json", without_the_step)
    _edit_json(build / "programs" / "stage0.json", without_its_instruction)
    assert _refused(capsys, "verify", build) == (
        f"planc: error: {build / 'graph.json'} is not the graph this planc derives from "
        f"plan.json (it was edited, or written by another version); run planc compile "
        f"again\n")


def test_a_worker_under_torchrun_verifies_the_build_before_it_trains(tmp_path):
    """planc run proves the programs before it starts its ranks; a rank that torchrun
    starts had nobody to, and trained whatever programs/ held: here, stage 0 without its
    optimizer steps (no rule but the verifier's sees that)."""
    import subprocess
    import sys

    from tests.conftest import ONE_RANK_PLAN, ROOT

    pytest.importorskip("torch")
    plan, build, metrics = tmp_path / "one.plan", tmp_path / "b", tmp_path / "m.jsonl"
    plan.write_text(ONE_RANK_PLAN)
    assert main(["compile", str(plan), "-o", str(build)]) == 0
    steps = []

    def without_the_optimizer(data):
        steps.extend(i["node"] for i in data["epilogue"] if i.get("node", "").startswith("O/"))
        data["epilogue"] = [i for i in data["epilogue"] if i.get("node") not in steps]

    _edit_json(build / "programs" / "stage0.json", without_the_optimizer)
    environment = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                   "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1",
                   "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "planc.runtime.worker", str(build),
                           "--metrics", str(metrics)], capture_output=True, text=True,
                          cwd=ROOT, env=environment, timeout=300)
    assert (done.returncode, done.stderr) == (1, (
        f"planc: error: the programs of {build} fail verification: rank 0 (stage0.json): "
        f"{steps[0]} is never issued; every node of stage 0 runs exactly once per step (per "
        f"microbatch in its block); nothing was run\n"))
    assert not metrics.exists()


# --- a build that cannot be read (mode 000) ------------------------------------------------
# Every command that reads a build directory (planc/cli.py), and whether it reads programs/.
READERS = {
    "verify": (["verify", "{b}"], True),
    "programs": (["programs", "{b}"], True),
    "programs-expand": (["programs", "{b}", "--expand"], True),
    "graph": (["graph", "{b}", "--format", "dot"], False),
    "explain": (["explain", "{b}"], False),
    "simulate": (["simulate", "{b}"], True),
    "report": (["report", "{b}", "-o", "{out}/report.html"], True),
    "export": (["export", "{b}", "-o", "{out}/chakra"], True),
    "diff": (["diff", "{b}", "{b}"], True),
    "run": (["run", "{b}", "--steps", "1"], True),  # refused before any rank starts
}


@pytest.mark.parametrize("locked, denied", [
    ("", ""), ("plan.json", "plan.json"), ("programs/stage0.json", "programs/stage0.json"),
    ("programs", "programs"),
], ids=["the-directory", "plan.json", "a-program", "programs-dir"])
def test_a_build_that_cannot_be_read(pristine, tmp_path, permissions_apply, locked, denied):
    """Each command says which path it cannot read and why, exits with 1 (an error in
    its input, planc/cli.py) and prints no traceback; commands that do not read the
    locked file still work."""
    import sys
    from concurrent.futures import ThreadPoolExecutor

    build = tmp_path / "b"
    shutil.copytree(pristine, build)
    path = build / locked
    expected = f"planc: error: cannot read {build / denied if denied else build}: " \
               f"Permission denied\n"
    commands = {name: [a.format(b=build, out=tmp_path) for a in argv]
                for name, (argv, _) in READERS.items()}
    path.chmod(0)
    try:
        with ThreadPoolExecutor(4) as pool:
            done = dict(zip(commands, pool.map(
                lambda argv: unprivileged([sys.executable, "-m", "planc", *argv]),
                commands.values())))
    finally:
        path.chmod(0o755 if path.is_dir() else 0o644)
    for name, result in done.items():
        output = result.stdout + result.stderr
        assert "Traceback" not in output, (name, output[-2000:])
        reads_it = locked in ("", "plan.json") or READERS[name][1]
        if reads_it:
            assert (result.returncode, result.stderr) == (1, expected), (name, output[-2000:])
            assert result.stdout == "", name
        else:  # graph and explain read no program
            assert result.returncode == 0, (name, output[-2000:])
    assert not (tmp_path / "report.html").exists()


def _readers():
    from planc.compile import compile_plan
    from planc.lang import load_file
    from planc.plan.plan_json import plan_from_dict
    from planc.plan.presets import calibrated_preset
    from planc.program.groups import GroupTable
    from planc.program.model_table import ModelTable
    from planc.program.program import Program
    from planc.program.ranks import RankTable
    from planc.program.routes import RouteTable

    built = compile_plan(load_file(PLANS / "gpt-tiny.plan").plan)
    return [("program", Program.from_json, built.programs["stage0.json"].to_json()),
            ("ranks", RankTable.from_json, built.table.to_json()),
            ("groups", GroupTable.from_json, built.groups.to_json()),
            ("routes", RouteTable.from_json, built.routes.to_json()),
            ("model", ModelTable.from_json, built.model.to_json()),
            ("plan", plan_from_dict, built.plan.to_dict()),
            ("topology", lambda data: calibrated_preset(data, "t.json"),
             json.loads((PLANS / "demo-machine.json").read_text()))]


@pytest.mark.parametrize("version", [True, 1.0])
def test_a_version_planc_never_writes_is_refused(version):
    """JSON's true equals 1 in Python, and so does 1.0: a routes.json with "version":
    true once verified (the damage corpus found it). Every reader of a version takes the
    integer only; each document as written is read."""
    for what, read, document in _readers():
        read(json.loads(json.dumps(document)))  # as written: read
        damaged = {**json.loads(json.dumps(document)), "version": version}
        with pytest.raises(ValueError, match="version"):
            read(damaged)
