"""train { eval_every; eval_batches; eval_data } (issue 26): the forward-only evaluation
the compiler writes into each program, its verification, and its loss, the same under
every plan as in one process."""

from __future__ import annotations

import json

import pytest

from planc.compile import compile_plan
from planc.lang import load_text
from planc.program.program import Program
from planc.verify.verifier import verify_evaluation
from tests.runtime_matrix import plan_text

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
    # no backward comes: a forward keeps neither autograd's graph nor its saved state
    steps = [i for block in evaluation.blocks.values() for i in block
             if i.operands is not None and i.operands.step == "forward"]
    assert steps and not any(i.operands.keeps_graph for i in steps)
    assert not any(w.endswith(":saved") for i in steps for w in i.writes)
    training = [i for i in stage1.blocks["F1"] if i.operands is not None and
                i.operands.step == "forward"]
    assert all(i.operands.keeps_graph and f"{i.node}:saved" in i.writes for i in training)


def test_without_overlap_the_evaluation_reduces_its_loss_after_the_sync():
    """With overlap off the loss's reduction runs once per step in the epilogue, after
    every stream's sync: an evaluation keeps it, and nothing else of the epilogue (no
    gradient reduction, no optimizer). It once kept nothing, and every evaluation of
    such a plan reported no loss; the verifier now refuses a head stage whose evaluation
    reduces no loss."""
    from planc.program.program import Opcode

    plan = _plan(evaluated_plan("ev", mesh="pp = 2; dp = 2", m=2,
                                optimize="overlap = off"))
    build = compile_plan(plan)
    head = build.programs["stage1.json"]
    kept = head.for_evaluation().epilogue
    assert [(i.op, i.node) for i in kept] == [(Opcode.SYNC, None),
                                              (Opcode.ALL_REDUCE, "F/loss:all_reduce@stage")]
    assert kept[1] in head.epilogue and len(head.epilogue) > len(kept)  # the optimizer's
    assert build.programs["stage0.json"].for_evaluation().epilogue == ()
    # a head stage whose evaluation loses the reduction
    programs = dict(build.programs)
    programs["stage1.json"] = Program(**{**head.__dict__, "epilogue": head.epilogue[:1]})
    report = verify_evaluation(plan, build.graph, programs, build.table, build.groups,
                               build.routes)
    assert report.problems == ["the evaluation: ranks 1, 3 (stage1.json): no instruction "
                               "reduces the loss, so an evaluation would report none"]


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


# The evaluation's loss against the single process under every layout: the evaluating
# runs of tests/test_runtime.py's FEATURE_RUNS (tp with sequence parallelism, pp
# interleaved on a token file of its own (eval_data, relative to the plan), cp with ZeRO-1,
# pp with a tied head and ZeRO-3, the V schedule, which evaluates chunk 0 and the last
# chunk on stage 0, over ZeRO-3 with a tied head) and tests/test_grad_clip.py's llama and
# mixture runs (the mixture's balance loss, which the evaluation's loss leaves out as the
# step's reported loss does).


# (A resumed run evaluates at the same steps as the whole run: tests/test_checkpoint.py's
# resumed run under the lr schedule.)


def test_without_eval_data_the_evaluation_reads_the_training_file(tmp_path):
    from planc.data.tokens import write_tokens

    write_tokens(tmp_path / "train.tokens", [(3 * i) % 128 for i in range(400)])
    text = evaluated_plan("file", data='; data = "train.tokens"')
    (tmp_path / "p.plan").write_text(text)
    from planc.lang import load_file

    plan = load_file(tmp_path / "p.plan").plan
    assert plan.train.eval_data == plan.train.data == str(tmp_path / "train.tokens")
    # nothing evaluates: eval_data keeps its default, which plan.json leaves out
    quiet = load_text(plan_text("quiet")).plan
    assert quiet.train.eval_data == "synthetic" and "eval_data" not in quiet.to_dict()["train"]
