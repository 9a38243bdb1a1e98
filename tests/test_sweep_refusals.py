"""Inputs a sweep of hostile command lines, builds and output paths found mishandled
(a traceback, a user's file replaced, a hang or unbounded work), each now refused with
one line and nothing changed. Every test runs ``planc`` in this process and checks the
status, the message and that the victim is intact."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from planc.cli import main
from tests.conftest import ROOT

TINY = ROOT / "plans" / "gpt-tiny.plan"


def planc(capsys, *args) -> tuple[int, str]:
    """Status and standard error of ``planc ARGS``."""
    status = main([*map(str, args)])
    return status, capsys.readouterr().err


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def build(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("sweep") / "b"
    assert main(["compile", str(TINY), "-o", str(directory)]) == 0
    return directory


@pytest.mark.parametrize("value", ["nope", "=3", "mesh.tp="])
def test_diff_set_b_malformed_is_a_usage_error(capsys, value):
    with pytest.raises(SystemExit) as stopped:
        main(["diff", str(TINY), str(TINY), "--set-b", value])
    assert stopped.value.code == 2
    assert "argument --set-b:" in capsys.readouterr().err


def test_a_prefix_of_an_option_is_not_taken_for_it(capsys):
    # diff has --set-b and no --set: argparse took --set for --set-b before
    with pytest.raises(SystemExit) as stopped:
        main(["diff", str(TINY), str(TINY), "--set", "mesh.tp=1"])
    assert stopped.value.code == 2
    assert "unrecognized arguments: --set mesh.tp=1" in capsys.readouterr().err


def test_compile_refuses_a_directory_whose_build_json_is_not_planc(capsys, tmp_path):
    target = tmp_path / "project"
    (target / "programs").mkdir(parents=True)
    (target / "build.json").write_text('{"name": "my-js-project"}')
    (target / "programs" / "mine.py").write_text("important\n")
    before = {p: digest(p) for p in target.rglob("*") if p.is_file()}
    for force in ([], ["--force"]):
        status, err = planc(capsys, "compile", TINY, "-o", target, *force)
        assert status == 2
        assert err == (f"planc: error: {target} holds files planc did not write where a "
                       f"build's own go (build.json, plan.json, graph.json, summary.json, "
                       f"programs/); refusing to replace them: compile elsewhere with -o "
                       f"DIR\n")
    assert {p: digest(p) for p in target.rglob("*") if p.is_file()} == before


def test_compile_refuses_an_unreadable_build_json_beside_files_of_the_user(capsys, tmp_path):
    target = tmp_path / "b"
    target.mkdir()
    (target / "build.json").write_text("garbage")
    (target / "plan.json").write_text("my notes\n")  # not a JSON object: not compile's
    status, err = planc(capsys, "compile", TINY, "-o", target, "--force")
    assert status == 2
    assert err.startswith(f"planc: error: {target} holds files planc did not write where a "
                          f"build's own go")
    assert (target / "plan.json").read_text() == "my notes\n"


def test_compile_still_replaces_a_damaged_build_of_its_own(capsys, tmp_path, build):
    target = tmp_path / "b"
    shutil.copytree(build, target)
    (target / "build.json").write_text("{ truncated")
    (target / "summary.json").write_bytes(b"")  # as a power cut leaves an unsynced file
    status, err = planc(capsys, "compile", TINY, "-o", target)
    assert status == 0
    assert err == f"planc: replaced {target}, whose build.json could not be read\n"
    assert json.loads((target / "build.json").read_text())["format"] == "planc-build"


@pytest.mark.parametrize("kind", ["text", "hard link", "fifo", "symbolic link", "directory"])
def test_a_file_in_the_lock_files_place_is_never_written(capsys, tmp_path, kind):
    tmp_path = Path(os.path.realpath(tmp_path))  # planc names the lock by its real path
    lock = tmp_path / ".b.lock"
    victim = tmp_path / "victim.txt"
    victim.write_text("important data\n")
    if kind == "text":
        lock.write_text("my precious notes\n")
        why = "it does not hold a planc holder's record"
    elif kind == "hard link":
        os.link(victim, lock)
        why = "it is a hard link to another file"
    elif kind == "fifo":
        os.mkfifo(lock)
        why = "it is not a regular file"
    elif kind == "directory":
        lock.mkdir()
        (lock / "mine").write_text("kept\n")
        why = "it is a directory"
    else:
        lock.symlink_to(victim)
        why = "it is a symbolic link"
    status, err = planc(capsys, "compile", TINY, "-o", tmp_path / "b")
    assert status == 2
    assert err == (f"planc: error: planc locks through {lock}, but that file is not planc's "
                   f"({why}) and planc will not write over it: move it away\n")
    assert victim.read_text() == "important data\n"
    assert os.path.lexists(lock) and not (tmp_path / "b").exists()
    if kind == "text":
        assert lock.read_text() == "my precious notes\n"
    if kind == "directory":
        assert (lock / "mine").read_text() == "kept\n"


def test_a_held_lock_is_in_use_whatever_its_file_holds_at_that_moment(tmp_path):
    """What the file holds is judged only once the lock is taken: a holder truncates it
    before writing its record, so a second command that read it then would call a live
    planc's lock a file of someone else's."""
    from planc.host.locks import LockHeld, build_lock_path, lock_build

    target = str(tmp_path / "b")
    with lock_build(target, "planc run b"):
        path = build_lock_path(target)
        for held in (b"", b"not yet a record"):
            with open(path, "r+b") as file:  # as between the holder's truncate and write
                file.truncate(0)
                file.write(held)
            with pytest.raises(LockHeld):
                lock_build(target, "planc compile x.plan -o b")


def test_a_lock_file_a_killed_holder_left_is_taken(capsys, tmp_path):
    (tmp_path / ".b.lock").write_text("pid 123: planc run x.plan\n")
    status, _ = planc(capsys, "compile", TINY, "-o", tmp_path / "b")
    assert status == 0 and not (tmp_path / ".b.lock").exists()  # removed as it let go


MANY_MICROBATCHES = ["--set", "mesh.tp=2", "--set", "mesh.pp=2", "--set", "mesh.dp=2",
                     "--set", "model.batch=131072", "--set", "schedule.microbatches=65536"]


def test_graph_refuses_to_unfold_millions_of_nodes(capsys, tmp_path):
    status, err = planc(capsys, "graph", TINY, *MANY_MICROBATCHES, "--microbatch", "all",
                        "--layers", "0", "--stage", "0", "-o", tmp_path / "g.svg")
    assert status == 2
    assert err == ("planc: error: unfolding stage 0; layer 0; microbatches 0-65535 makes "
                   "1,703,939 nodes, more than planc graph draws (200,000); name fewer "
                   "microbatches (--microbatch 0,1), layers (--layers) or stages (--stage)\n")
    assert not (tmp_path / "g.svg").exists()


def test_graph_unfolds_only_what_it_keeps(monkeypatch, build):
    from planc.build import directory
    from planc.graph import select as module
    from planc.graph.select import Selection, expand, select, unfolded_size

    graph = directory.read(build).graph
    selection = Selection(stages=(1,), layers=(1, 1), microbatches=(1, 3))
    whole = expand(graph, (1, 3))
    given = []
    monkeypatch.setattr(module, "expand", lambda g, mb: given.append(g) or expand(g, mb))
    kept = select(graph, selection)
    assert given[0].number_of_nodes() < graph.number_of_nodes() / 4  # the kept ones only
    monkeypatch.undo()
    # the same nodes and edges as selecting from the whole graph unfolded
    reference = select(whole, Selection(stages=(1,), layers=(1, 1)))
    assert sorted(kept.nodes) == sorted(reference.nodes)
    assert sorted(kept.edges) == sorted(reference.edges)
    assert unfolded_size(graph, selection) < whole.number_of_nodes()


def test_export_refuses_traces_of_millions_of_instructions(capsys, tmp_path):
    status, err = planc(capsys, "export", TINY, *MANY_MICROBATCHES, "-o", tmp_path / "t")
    assert status == 2
    assert err == ("planc: error: the traces would hold 14,614,544 instructions, more than "
                   "planc export writes (1,000,000, about a minute); export a plan with "
                   "fewer microbatches or layers (a plan file takes --set "
                   "schedule.microbatches=N)\n")
    assert not (tmp_path / "t").exists()


def test_export_writes_nothing_when_a_trace_cannot_be_written(capsys, tmp_path, build):
    out = tmp_path / "t"
    (out / "planc.2.et").mkdir(parents=True)  # stage 1's trace (rank 2) is a directory
    status, err = planc(capsys, "export", build, "-o", out, "--force")
    assert status == 2
    assert err == (f"planc: error: -o {out}/planc.2.et: is a directory, not a Chakra trace "
                   f"that planc wrote; planc never replaces it: name another path, or remove "
                   f"it first\n")
    assert sorted(os.listdir(out)) == ["planc.2.et"]  # stage 0's was not written either


def test_export_refuses_a_dangling_link_in_a_traces_place(capsys, tmp_path, build):
    out = tmp_path / "t"
    out.mkdir()
    (out / "planc.0.et").symlink_to(tmp_path / "nowhere")
    status, err = planc(capsys, "export", build, "-o", out)
    assert status == 2  # written through, it would land outside the directory
    assert err == (f"planc: error: -o {out}/planc.0.et: is a symbolic link, not a Chakra "
                   f"trace that planc wrote; planc never replaces it: name another path, or "
                   f"remove it first\n")
    assert not (tmp_path / "nowhere").exists()


def test_verify_refuses_a_route_recipe_of_more_chunks_than_members(capsys, tmp_path, build):
    damaged = tmp_path / "b"
    shutil.copytree(build, damaged)
    routes = damaged / "programs" / "routes.json"
    data = json.loads(routes.read_text())
    key = next(iter(data["recipes"]))
    data["recipes"][key]["chunks"] = 10 ** 40
    routes.write_text(json.dumps(data))
    status, err = planc(capsys, "verify", damaged)
    assert status == 1
    members = sum(data["recipes"][key]["counts"])
    assert err == (f"planc: error: {routes} is not a valid route table (route recipe chunks "
                   f"({10 ** 40}) exceed its members ({members})); run planc compile "
                   f"again\n")


def test_programs_code_refuses_a_program_that_cannot_become_code(capsys, tmp_path, build):
    damaged = tmp_path / "b"
    shutil.copytree(build, damaged)
    path = damaged / "programs" / "stage1.json"
    data = json.loads(path.read_text())
    waits = [i for i in data["blocks"]["B1"] if i.get("op") == "wait"]
    waits[0]["event"] = "x"  # a wait for an event nothing records
    path.write_text(json.dumps(data))
    status, err = planc(capsys, "programs", damaged, "--code", "--rank", 3)
    assert status == 1
    assert err.startswith("planc: error: rank 3's program stage1.json cannot become step "
                          "code (")
    assert err.endswith(f"planc verify {damaged} says what is wrong with it\n")


# a page showed "tp 10000000000000000000000000000000000000000, pp 2, dp 1" for 2 devices
@pytest.mark.parametrize("change, field", [
    ({"order": [1, 2]}, "order"),
    ({"order": ["tp", "tp", "x"]}, "order"),
    ({"mesh": {"tp": 10**40, "cp": 1, "pp": 2, "dp": 2, "ep": 1}}, "mesh"),
    ({"mesh": {"tp": 2, "cp": 1, "pp": -1, "dp": 2, "ep": 1}}, "mesh"),
    ({"mesh": {"tp": 1024, "cp": 1, "pp": 1024, "dp": 1, "ep": 1}}, "mesh"),  # > 524,288
    ({"microbatches": -1}, "microbatches"),
    ({"virtual": 0}, "virtual"),
    ({"zero": 10**40}, "zero"),
    ({"order": [1, "tp"]}, "order"),
    ({"order": [["tp"]]}, "order"),
    ({"mesh": {"tp": 2, "cp": 1, "pp": 2, "dp": 2, "ep": 1, "zz": "x"}}, "mesh"),
    ({"mesh": {"tp": 2, "cp": 1, "pp": 2, "dp": 2, "ep": 1, "zz": None}}, "mesh"),
    ({"pipeline": "\ud800"}, "pipeline"),
    ({"recompute": "\ud800"}, "recompute"),
    ({"pipeline": "<b>1f1b</b>"}, "pipeline"),
    ({"recompute": "everything"}, "recompute"),
], ids=["order-numbers", "order-repeated", "tp-huge", "pp-negative", "world-past-limit",
        "microbatches-negative", "virtual-zero", "zero-huge", "order-mixed", "order-lists",
        "mesh-text-axis", "mesh-null-axis", "pipeline-lone-surrogate",
        "recompute-lone-surrogate", "pipeline-no-schedule", "recompute-no-such-mode"])
def test_report_refuses_a_tune_file_whose_layout_no_plan_could_have(change, field, capsys,
                                                                     tmp_path, build):
    tune = tmp_path / "t.json"
    candidate = {"mesh": {"tp": 2, "cp": 1, "pp": 2, "dp": 2, "ep": 1},
                 "order": ["tp", "cp", "pp", "dp"],
                 "virtual": 1, "microbatches": 4, "pipeline": "1f1b", "zero": 0,
                 "sequence_parallel": False, "recompute": "none", "step_seconds": 1.0,
                 "tflops_per_gpu": 1.0, "mfu": 0.1, "bubble": 0.1, "memory_bytes": 1.0}
    for good in (True, False):
        tune.write_text(json.dumps({"format": "planc-tune", "version": 1,
                                    "candidates": [candidate if good else
                                                   {**candidate, **change}]}))
        status, err = planc(capsys, "report", build, "-o", tmp_path / "r.html", "--tune",
                            tune, "--force")
        if good:
            assert status == 0, err
            (tmp_path / "r.html").unlink()
    assert status == 1
    assert err == (f"planc: error: {tune}: candidate 1 has no valid {field}; it is not what "
                   f"planc tune --json writes\n")
    assert not (tmp_path / "r.html").exists()


def test_a_named_pipe_beside_a_token_file_is_an_error_not_a_hang(run_planc, tmp_path):
    from planc.data.tokens import write_tokens

    tokens = tmp_path / "c.tokens"
    shutil.copy(ROOT / "plans" / "demo.plan", tmp_path / "demo.plan")
    write_tokens(tokens, range(1000))
    os.mkfifo(tmp_path / "c.tokens.json")
    # in a child with a deadline: a hang is a failure (TimeoutExpired), not a stuck suite
    result = run_planc("check", tmp_path / "demo.plan", "--set", f'train.data="{tokens}"',
                       timeout=60)
    assert result.returncode == 1
    assert "'" + str(tmp_path / "c.tokens.json") + "' cannot be read (it is a named pipe" in \
        result.stderr


def test_calibrate_repeats_are_bounded(capsys, tmp_path):
    status, err = planc(capsys, "calibrate", "-o", tmp_path / "m.json", "--repeats",
                        "100000000000000000000")
    assert status == 2
    assert err == "planc: error: --repeats must be between 1 and 1000\n"
    assert not (tmp_path / "m.json").exists()


def test_a_build_whose_mfu_would_overflow_is_refused(tmp_path, build):
    from planc.build.files import BuildError, StepFlops

    for section in ({"model_flops_per_step": 1.7e308, "peak_flops_per_device": 1e12},
                    {"model_flops_per_step": 1e9, "peak_flops_per_device": 5e-324}):
        with pytest.raises(BuildError, match="numbers from 1 to 1e\\+30"):
            StepFlops.of({"mfu": section}, build)
    assert StepFlops.of({"mfu": {"model_flops_per_step": 1e9, "peak_flops_per_device": None}},
                        build).model_flops_per_step == 1e9


def test_a_token_files_width_holds_the_tokenizers_largest_id(capsys, tmp_path):
    pytest.importorskip("tokenizers")
    (tmp_path / "a.txt").write_text("hello world\n")
    tokenizer = tmp_path / "tk.json"
    # two entries, the largest id 70,000: past what uint16 holds
    tokenizer.write_text(json.dumps({"version": "1.0", "model": {
        "type": "WordLevel", "vocab": {"a": 70000, "<|endoftext|>": 1}, "unk_token": "a"}}))
    status = main(["data", "prepare", str(tmp_path / "a.txt"), "-o", str(tmp_path / "t.tokens"),
                   "--tokenizer", str(tokenizer)])
    assert status == 0
    assert "(2 tokens of uint32, end-of-text id 1)" in capsys.readouterr().err


def test_tune_stops_estimating_at_half_its_budget_once_k_fit(capsys):
    # 110,345 candidates on 4,096 devices: minutes of estimates before the budget applied
    status = main(["tune", str(ROOT / "plans" / "gpt3-175b.plan"), "--gpus", "4096",
                   "--budget", "0.5", "--top", "2", "--json"])
    assert status == 0
    search = json.loads(capsys.readouterr().out)
    assert search["pruned"]["unestimated"] > 100_000
    assert search["simulated"] >= 2  # at least K, as ever
    assert search["searched"] == sum(search["pruned"].values()) + search["simulated"]


def test_a_named_pipe_as_tokenizer_config_is_not_waited_on_but_refused(run_planc, tmp_path):
    pytest.importorskip("tokenizers")
    (tmp_path / "a.txt").write_text("hello world\n")
    tokenizer = tmp_path / "tok"
    tokenizer.mkdir()
    (tokenizer / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {
        "type": "WordLevel", "vocab": {"hello": 0, "world": 1, "<|endoftext|>": 2},
        "unk_token": "hello"}, "pre_tokenizer": {"type": "Whitespace"}}))
    os.mkfifo(tokenizer / "tokenizer_config.json")
    # in a child with a deadline: a hang is a failure, not a stuck suite
    result = run_planc("data", "prepare", tmp_path / "a.txt", "-o", tmp_path / "t.tokens",
                       "--tokenizer", tokenizer, timeout=60)
    assert (result.returncode, result.stderr) == (1, (
        f"planc: error: {tokenizer / 'tokenizer_config.json'} cannot be read (it is a named "
        f"pipe (FIFO), not a regular file): repair or remove it, or name the end-of-text "
        f"token with --eos\n"))
    assert not (tmp_path / "t.tokens").exists()


RUN_PLAN = """plan t2 {
  model gpt { layers = 2; hidden = 32; heads = 4; vocab = 256; seq = 16; batch = 8 }
  mesh { dp = 2 }
  topology { nodes = 1; devices_per_node = 2 }
  train { steps = 3; optimizer = adamw(lr = 1e-3, weight_decay = 0) }
}
"""


def test_run_checks_the_evaluations_data_before_any_rank_starts(run_planc, tmp_path):
    pytest.importorskip("torch")
    (tmp_path / "t2.plan").write_text(RUN_PLAN)
    # before: steps 1 and 2 trained (and checkpointed), then the first evaluation failed
    result = run_planc("run", tmp_path / "t2.plan", "-o", tmp_path / "b", "--steps", 6,
                       "--set", "train.eval_every=3", "--set", 'train.eval_data="nope.tokens"',
                       cwd=tmp_path, timeout=300)
    assert result.returncode == 1
    assert result.stderr.endswith(f"planc: error: data file {tmp_path}/nope.tokens does not "
                                  f"exist; nothing was run\n")
    assert not (tmp_path / "b" / "logs").exists() or not os.listdir(tmp_path / "b" / "logs")


def test_a_resumed_check_refuses_a_checkpoint_trained_under_another_grad_clip():
    from planc.checkpoint.format import history_segment, problems_checking, resume_notes
    from planc.checkpoint.training_record import TrainingRecord

    layout = {"tp": 1, "cp": 1, "pp": 1, "dp": 2, "zero": 0, "microbatches": 1}
    unclipped = TrainingRecord("t2", {}, {}, 0, None, 3, layout)
    clipped = TrainingRecord("t2", {}, {}, 0, None, 5, layout, grad_clip=0.001)
    manifest = {"history": [history_segment(unclipped, 0, 2)], "step": 3,
                "data": {"seed": 0, "source": None}}
    assert "grad_clip" not in manifest["history"][0]  # segments of plans without it
    assert problems_checking(manifest, clipped) == (
        "--check with --resume compares with one process trained from step 0 under this "
        "plan, but steps 0..2 of the checkpoint were trained with grad_clip off (the plan: "
        "0.001)")
    assert resume_notes(manifest, clipped) == [
        "the checkpoint was trained with grad_clip off, the plan has 0.001: steps from 3 "
        "on clip as the plan says"]
    manifest["history"] = [history_segment(clipped, 0, 2)]
    assert manifest["history"][0]["grad_clip"] == 0.001
    assert problems_checking(manifest, clipped) is None and resume_notes(manifest,
                                                                         clipped) == []


def test_a_killed_runs_temporary_of_latest_is_removed(tmp_path):
    from planc.checkpoint.format import remove_stray_temporaries

    (tmp_path / ".planc-xk_3uisz").write_text("step-000001\n")  # a rank killed mid-replace
    (tmp_path / ".planc-dir").mkdir()  # not a file write_atomically leaves: kept
    (tmp_path / "latest").write_text("step-000001\n")
    (tmp_path / "notes.planc-x").write_text("kept\n")
    remove_stray_temporaries(tmp_path)
    assert sorted(os.listdir(tmp_path)) == [".planc-dir", "latest", "notes.planc-x"]
