"""train { eval_every; eval_batches; eval_data } (issue 26): the forward-only evaluation
the compiler writes into each program, its verification, and its loss, the same under
every plan as in one process."""

from __future__ import annotations

import json

import pytest

from planc.compile import compile_plan
from planc.lang import load_text
from planc.lower.program import Program
from planc.lower.verify import verify_evaluation
from tests.runtime_matrix import plan_text, run

EVALUATED = "; eval_every = 2; eval_batches = 2"


def evaluated_plan(name: str, data: str = "", **case) -> str:
    """A matrix plan of 4 steps that evaluates after steps 2 and 4."""
    return plan_text(name, **case).replace(
        "seed = 3 }", f"seed = 3{EVALUATED}{data} }}").replace("steps = 2", "steps = 4")


def _plan(text: str):
    loaded = load_text(text)
    assert loaded.ok, loaded.diagnostics
    return loaded.plan


def test_each_stage_runs_its_forward_blocks_chunk_by_chunk():
    plan = _plan(evaluated_plan("ev", mesh="pp = 2", shard="pp { virtual = 2 }", m=2,
                                schedule="; pipeline = interleaved"))
    build = compile_plan(plan)
    stage0, stage1 = build.programs["stage0.json"], build.programs["stage1.json"]
    assert stage0.evaluation == (("F0", 0), ("F0", 1), ("F2", 0), ("F2", 1))
    assert stage1.evaluation == (("F1", 0), ("F1", 1), ("F3", 0), ("F3", 1))
    # only activations come back: stage 0 receives chunk 1's output for chunk 2
    assert {s: [mb for _, mb in items] for s, items in stage0.evaluation_receives.items()} \
        == {"recv_prev": [0, 1]}
    evaluation = stage1.for_evaluation()
    assert set(evaluation.blocks) == {"F1", "F3"} and evaluation.epilogue == ()
    assert Program.from_json(json.loads(json.dumps(stage0.to_json()))) == stage0


def test_a_plan_without_evaluation_writes_none():
    build = compile_plan(_plan(plan_text("plain", mesh="pp = 2", m=2)))
    assert all(not p.evaluation and "evaluation" not in p.to_json()
               for p in build.programs.values())
    assert build.model.evaluation is None


def test_the_verifier_finds_an_evaluation_that_would_deadlock():
    plan = _plan(evaluated_plan("ev", mesh="pp = 2", m=2))
    build = compile_plan(plan)
    programs = dict(build.programs)
    last = programs["stage1.json"]
    # stage 1 waits for microbatch 1 first, stage 0 sends microbatch 0 first
    programs["stage1.json"] = Program(**{**last.__dict__, "evaluation": (("F1", 1), ("F1", 0))})
    report = verify_evaluation(plan, build.graph, programs, build.table, build.groups,
                               build.routes)
    assert report.problems and all(p.startswith("the evaluation: ") for p in report.problems)
    assert any("microbatch" in p for p in report.problems), report.problems


def test_a_damaged_evaluation_is_refused():
    build = compile_plan(_plan(evaluated_plan("ev", mesh="pp = 2", m=2)))
    data = build.programs["stage0.json"].to_json()
    data["evaluation"]["schedule"][0][0] = "B0"
    with pytest.raises(ValueError, match="names a block that is no forward block"):
        Program.from_json(data)


@pytest.mark.parametrize("key,value,message", [
    ("eval_every", "-1", "expected an integer >= 0, got -1"),
    ("eval_batches", "0", "expected a positive integer, got 0"),
    ("eval_data", "sometimes", "unknown value 'sometimes'; expected synthetic or a file "
                               "path in quotes"),
])
def test_bad_evaluation_keys_are_errors_at_their_place(key, value, message):
    text = plan_text("bad").replace("seed = 3 }", f"seed = 3; {key} = {value} }}")
    loaded = load_text(text)
    (error,) = [d for d in loaded.diagnostics if d.severity == "error"]
    assert error.message == message and error.span.line == 8


CASES = {
    # (tp with sequence parallelism, pp and ZeRO-1: llama-tiny, below; interleaved pp:
    # the file's case) a V schedule over cp with ZeRO-3 and a tied head
    "cp-zbv-zero3-tied": dict(mesh="cp = 2; pp = 2", m=2, model="; tie_embeddings = on",
                              shard="pp { virtual = 2 }", schedule="; pipeline = zbv"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_the_evaluation_loss_is_the_single_process_one(name, tmp_path, capfd):
    plan = tmp_path / f"{name}.plan"
    plan.write_text(evaluated_plan(name, **CASES[name]))  # synthetic: the seed's next
    metrics = tmp_path / "metrics.jsonl"
    status, err = run([plan, "-o", tmp_path / "build", "--check", "--metrics", metrics,
                       "--timeout", "60"], capfd)
    assert status == 0, err
    assert "and 2 evaluations against the single-process run" in err
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records if "eval_loss" in r] == [1, 3]


def test_evaluation_reads_its_own_file(tmp_path, capfd):
    """eval_data: a token file of its own, relative to the plan; the check compares it."""
    from planc.tokens import write_tokens

    write_tokens(tmp_path / "held-out.tokens", [(7 * i) % 128 for i in range(400)])
    plan = tmp_path / "file.plan"
    plan.write_text(evaluated_plan("file", data='; eval_data = "held-out.tokens"',
                                   mesh="dp = 2; pp = 2", m=2, schedule="; pipeline = "
                                   "interleaved", shard="dp { zero = 2 }; pp { virtual = 2 }"))
    status, err = run([plan, "-o", tmp_path / "build", "--check", "--timeout", "60"], capfd)
    assert status == 0, err
    assert "and 2 evaluations against the single-process run" in err
    assert json.loads((tmp_path / "build" / "programs" / "model.json").read_text())[
        "evaluation"]["source"] == str(tmp_path / "held-out.tokens")


@pytest.mark.parametrize("plan", ["llama-tiny", "moe-tiny"])
def test_llama_and_mixture_evaluations_match_one_process(plan, tmp_path, capfd):
    """tp 2 x pp 2 x dp 2 (the mixture over ep 4 with its balance loss, which the
    evaluation's loss leaves out as the step's reported loss does, and a cosine
    schedule: the mixture's row of the lr schedule's --check matrix)."""
    from tests.conftest import PLANS

    status, err = run([PLANS / f"{plan}.plan", "-o", tmp_path / "build", "--check",
                       "--timeout", "60", "--set", "train.steps=2", "--set",
                       "train.eval_every=1", "--set", "train.eval_batches=2",
                       *(["--set", "model.aux_loss=0.01", "--set",
                          "train.lr_schedule=cosine(warmup = 1, min_lr = 1e-4)"]
                         if plan == "moe-tiny" else [])],
                      capfd)
    assert status == 0, err
    assert "and 2 evaluations against the single-process run" in err


def test_a_resumed_run_evaluates_at_the_same_steps(tmp_path, capfd):
    """Evaluations count steps from the run's start: 2 steps, then 2 more resumed under
    another layout, evaluate after steps 2 and 4 as the whole run does."""
    a, b = tmp_path / "a.plan", tmp_path / "b.plan"
    a.write_text(evaluated_plan("a", mesh="dp = 2", m=1))
    b.write_text(evaluated_plan("b", mesh="pp = 2", m=2))
    status, err = run([a, "-o", tmp_path / "build-a", "--steps", 2, "--metrics",
                       tmp_path / "first.jsonl", "--checkpoint-dir", tmp_path / "ckpt"], capfd)
    assert status == 0, err
    status, err = run([b, "-o", tmp_path / "build-b", "--resume", tmp_path / "ckpt",
                       "--metrics", tmp_path / "second.jsonl", "--check"], capfd)
    assert status == 0, err
    assert "check: 2 steps (from step 2, resumed) and " in err
    assert "and 1 evaluation against the single-process run" in err
    evaluated = [json.loads(line)["step"] for name in ("first", "second")
                 for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()
                 if "eval_loss" in json.loads(line)]
    assert evaluated == [1, 3]


def test_without_eval_data_the_evaluation_reads_the_training_file(tmp_path):
    from planc.tokens import write_tokens

    write_tokens(tmp_path / "train.tokens", [(3 * i) % 128 for i in range(400)])
    text = evaluated_plan("file", data='; data = "train.tokens"')
    (tmp_path / "p.plan").write_text(text)
    from planc.lang import load_file

    plan = load_file(tmp_path / "p.plan").plan
    assert plan.train.eval_data == plan.train.data == str(tmp_path / "train.tokens")
    # nothing evaluates: eval_data keeps its default, which plan.json leaves out
    quiet = load_text(plan_text("quiet")).plan
    assert quiet.train.eval_data == "synthetic" and "eval_data" not in quiet.to_dict()["train"]
