"""The zero-bubble schedules, zb1p (ZB-H1) and interleaved_zb: their orders against the
ones torch.distributed.pipelining generates, the activations they hold, their rules and
the programs they lower to (I and W blocks)."""

from __future__ import annotations

import copy

import pytest

from planc import schedules
from planc.compile import compile_plan
from planc.lang import load_file, load_text
from planc.program.program import Program
from planc.verify.verifier import verify
from planc.schedules import Action, ActionKind, PipelineShape
from planc.schedules.zero_bubble import held_at_peak
from planc.simulate import simulate
from tests.conftest import PLANS
from tests.test_schedules import plan_text as schedule_plan_text

torch_schedules = pytest.importorskip("torch.distributed.pipelining.schedules")


def torch_order(cls, pp: int, microbatches: int, virtual: int) -> dict[int, list[str]]:
    """Each rank's actions as torch's schedule class computes them (its pipeline_order
    without the idle slots), built without the stages and process group that its
    constructor runs with: the order depends on these numbers only."""
    schedule = object.__new__(cls)
    schedule.pp_group_size, schedule.n_local_stages = pp, virtual
    schedule._n_microbatches = microbatches
    schedule.number_of_rounds = max(1, microbatches // pp)
    schedule.microbatches_per_round = microbatches // schedule.number_of_rounds
    schedule.pipeline_order = {r: schedule._calculate_single_rank_operations(r)
                               for r in range(pp)}
    if hasattr(schedule, "_add_bubbles_to_actions"):
        schedule.pipeline_order = schedule._add_bubbles_to_actions(pp * virtual)
    return {r: [f"{a.computation_type.value}{a.microbatch_index}.c{a.stage_index}"
                for a in actions if a is not None]
            for r, actions in schedule.pipeline_order.items()}


def planc_order(name: str, pp: int, microbatches: int, virtual: int) -> dict[int, list[str]]:
    return {s: [f"{a.kind.letter}{a.microbatch}.c{a.chunk}"
                for a in schedules.order(name, s, pp, microbatches, virtual)]
            for s in range(pp)}


SHAPES_ONE_CHUNK = [(2, 1), (2, 4), (3, 5), (4, 2), (4, 8), (5, 7)]
SHAPES_INTERLEAVED = [(2, 2, 2), (2, 4, 2), (2, 6, 3), (4, 4, 2), (4, 8, 2), (3, 9, 2)]


@pytest.mark.parametrize("pp, m", SHAPES_ONE_CHUNK)
def test_zb1p_is_torchs_zero_bubble_schedule_with_one_chunk_per_rank(pp, m):
    assert planc_order("zb1p", pp, m, 1) == torch_order(
        torch_schedules.ScheduleInterleavedZeroBubble, pp, m, 1)


@pytest.mark.parametrize("pp, m, virtual", SHAPES_INTERLEAVED)
def test_interleaved_zb_is_torchs_interleaved_zero_bubble(pp, m, virtual):
    assert planc_order("interleaved_zb", pp, m, virtual) == torch_order(
        torch_schedules.ScheduleInterleavedZeroBubble, pp, m, virtual)


@pytest.mark.parametrize("pp, m, virtual", SHAPES_INTERLEAVED)
def test_interleaved_is_torchs_interleaved_1f1b(pp, m, virtual):
    assert planc_order("interleaved", pp, m, virtual) == torch_order(
        torch_schedules.ScheduleInterleaved1F1B, pp, m, virtual)


def test_zb1p_written_out():
    # 1F1B's warm-up; the last stage holds its first weight gradient back one pair.
    texts = {s: [a.text(1) for a in schedules.order("zb1p", s, 2, 4)] for s in range(2)}
    assert texts[0] == ["F0", "F1", "I0", "W0", "F2", "I1", "W1", "F3", "I2", "W2", "I3", "W3"]
    assert texts[1] == ["F0", "I0", "F1", "I1", "W0", "F2", "I2", "W1", "F3", "I3", "W2", "W3"]
    assert schedules.order("zb1p", 1, 2, 1) == [
        Action(ActionKind.FORWARD, 0, 1), Action(ActionKind.BACKWARD_INPUT, 0, 1),
        Action(ActionKind.BACKWARD_WEIGHT, 0, 1)]


@pytest.mark.parametrize("name, pp, m, virtual, expected", [
    ("zb1p", 4, 8, 1, [4, 4, 4, 4]),  # 1F1B's peak (its first stage's) on every stage
    ("zb1p", 4, 2, 1, [2, 2, 2, 2]),
    ("zb1p", 3, 5, 1, [3, 3, 3]),
    ("interleaved_zb", 2, 4, 2, [4, 4]),
    ("interleaved_zb", 4, 8, 2, [8, 8, 8, 8]),
    ("interleaved_zb", 2, 6, 3, [6, 6]),
])
def test_in_flight_microbatch_chunks(name, pp, m, virtual, expected):
    rule = schedules.named(name).in_flight
    assert [rule(s, pp, m, virtual) for s in range(pp)] == expected


@pytest.mark.parametrize("name, shapes", [
    ("zb1p", [(pp, m, 1) for pp in range(2, 7) for m in range(1, 13)]),
    ("interleaved_zb", [(pp, m, v) for pp in range(2, 6) for m in range(pp, 13, pp)
                        for v in range(2, 5)]),
])
def test_the_in_flight_rule_is_the_peak_of_the_order(name, shapes):
    for pp, m, virtual in shapes:
        for stage in range(pp):
            assert schedules.named(name).in_flight(stage, pp, m, virtual) == held_at_peak(
                schedules.order(name, stage, pp, m, virtual)), (pp, m, virtual, stage)


def test_weight_gradients_fill_the_bubble():
    # Uniform blocks, F = 1, B = 2 = I + W: ZB-H1's bubble is (p - 1)(F + B - 2W), a
    # third of 1F1B's (p - 1)(F + B) (Qi et al., section 3.1); interleaving shrinks both.
    def makespan(name, virtual):
        timeline = schedules.simulate(
            {s: schedules.order(name, s, 4, 8, virtual) for s in range(4)}, 4, virtual,
            forward_time=1 / virtual, backward_time=2 / virtual)
        return timeline.makespan

    assert makespan("1f1b", 1) == 8 * 3 + 3 * 3
    assert makespan("zb1p", 1) == 8 * 3 + 3 * 1
    assert makespan("interleaved", 2) == 28.5
    assert makespan("interleaved_zb", 2) == 25.5


def plan_text(pipeline="zb1p", **keys) -> str:
    """test_schedules' small pipeline plan, under a zero-bubble schedule unless told."""
    return schedule_plan_text(pipeline=pipeline, **keys)


def errors_of(text: str) -> list[tuple]:
    loaded = load_text(text)
    return [(d.span.line, d.span.column, d.message, *d.hints) for d in loaded.diagnostics
            if d.severity == "error"]


def test_the_rules_in_the_checkers_words():
    assert schedules.problems("zb1p", PipelineShape(2, 1, 3, 4)) == []
    assert errors_of(plan_text(pp=1)) == [(5, 43, (
        "pipeline = zb1p needs pp > 1: with one stage there is no bubble for the weight "
        "gradients to fill"), "use pipeline = 1f1b with pp = 1, or set mesh { pp = 2 }")]
    assert errors_of(plan_text(virtual=2)) == [(
        4, 26, "virtual = 2 needs pipeline = interleaved, interleaved_zb, zbv or dualpipev",
        "set schedule { pipeline = interleaved }")]
    assert errors_of(plan_text(pipeline="interleaved_zb")) == [(
        5, 43, "pipeline = interleaved_zb needs virtual > 1",
        "set shard { pp { virtual = 2 } }, or use pipeline = zb1p")]
    # The interleaved order's own needs hold for its zero-bubble form (its rounds of pp).
    assert errors_of(plan_text(pipeline="interleaved_zb", virtual=2, microbatches=3,
                               batch=6)) == [
        (5, 29, "the interleaved schedule needs microbatches (3) to divide by pp (2)",
         "Megatron's interleaved 1F1B runs microbatches in groups of pp")]
    assert errors_of(plan_text(pipeline="interleaved_zb", virtual=2)) == []


@pytest.mark.parametrize("pipeline, virtual", [("zb1p", 1), ("interleaved_zb", 2)])
def test_the_programs_run_the_input_and_weight_halves_in_their_own_blocks(pipeline, virtual):
    build = compile_plan(load_text(plan_text(pipeline=pipeline, virtual=virtual)).plan)
    (split,) = [p for p in build.graph.graph["passes"] if p["name"] == "split_backward"]
    weights = [n for n, d in build.graph.nodes(data=True) if d.get("weight_grad_of")]
    assert len(split["decisions"]) == len(weights) == 28  # 4 layers x 6, 2 embeddings, head
    for program in build.programs.values():
        chunks = [program.stage + pp_chunk * 2 for pp_chunk in range(virtual)]
        assert sorted(program.blocks) == sorted(f"{k}{c}" for k in "FIW" for c in chunks)
        for chunk in chunks:
            steps = [i.node for i in program.blocks[f"W{chunk}"] if i.op == "compute"]
            assert steps and all(s.startswith("W/") for s in steps)
            assert not any(i.node and i.node.startswith("W/")
                           for i in program.blocks[f"I{chunk}"])
        assert [f"{b}.{m}" for b, m in program.schedule] == [
            f"{a.block.name}.{a.microbatch}"
            for a in schedules.order(pipeline, program.stage, 2, 4, virtual)]


def _problems(build, programs) -> list[str]:
    return verify(build.plan, build.graph, programs, build.table, build.groups,
                  build.routes).problems


@pytest.mark.parametrize("pipeline, virtual", [("zb1p", 1), ("interleaved_zb", 2)])
def test_the_verifier_proves_the_programs_and_catches_a_weight_block_run_too_early(
        pipeline, virtual):
    build = compile_plan(load_text(plan_text(pipeline=pipeline, virtual=virtual)).plan)
    assert _problems(build, build.programs) == []
    data = copy.deepcopy(build.programs["stage1.json"].to_json())
    # The first weight gradient runs before its input gradient saved what it reads.
    first_input = next(k for k, (b, _) in enumerate(data["schedule"]) if b.startswith("I"))
    first_weight = next(k for k, (b, _) in enumerate(data["schedule"]) if b.startswith("W"))
    entry = data["schedule"].pop(first_weight)
    data["schedule"].insert(first_input, entry)
    broken = {**build.programs, "stage1.json": Program.from_json(data)}
    found = _problems(build, broken)
    block, saved = (("W1", "I1"), ("W3", "I3"))[virtual - 1]
    reads = [p for p in found if " reads B/" in p and "only later" in p]
    assert len(reads) == 1 and reads[0].startswith(
        f"rank 1 (stage1.json): block {block} (microbatch 0) reads B/")
    assert reads[0].endswith(f"which block {saved} writes for that microbatch only later in "
                             f"the schedule")
    assert ":saved, which block" in reads[0]  # what the input gradient left for it
    # The W block frees only that stash, which no other block reads: the input gradient's
    # own reads are untouched by running it early.
    assert not any(p.startswith(f"rank 1 (stage1.json): block {saved} reads ") for p in found)


def test_the_simulator_replays_the_weight_blocks_into_the_bubble():
    # Megatron's pp-interleaved example: 4 stages of a 24-layer model on A100s.
    def simulated(pipeline: str, virtual: int):
        loaded = load_file(PLANS / "pp-interleaved.plan", overrides=[
            f"schedule.pipeline={pipeline}", f"shard.pp.virtual={virtual}"])
        assert loaded.ok, loaded.diagnostics
        return simulate(compile_plan(loaded.plan))

    one_f_one_b, zb1p = simulated("1f1b", 1), simulated("zb1p", 1)
    interleaved, interleaved_zb = simulated("interleaved", 2), simulated("interleaved_zb", 2)
    assert zb1p.bubble < one_f_one_b.bubble - 0.03
    assert zb1p.step_seconds < one_f_one_b.step_seconds
    assert interleaved_zb.bubble < interleaved.bubble - 0.02


def test_planc_programs_shows_the_input_and_weight_blocks(tmp_path, run_planc):
    plan = tmp_path / "zb.plan"
    plan.write_text(plan_text())
    assert run_planc("compile", plan, "-o", tmp_path / "build").returncode == 0
    shown = run_planc("programs", tmp_path / "build")
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert "schedule (12 blocks, block.microbatch): F0.0 F0.1 I0.0 W0.0 F0.2 I0.1 W0.1 " \
           "F0.3 I0.2 W0.2 I0.3 W0.3" in lines
    assert "block I0: backward-input of chunk 0 (layers 0-1), once per microbatch" in lines
    assert "block W0: backward-weight of chunk 0 (layers 0-1), once per microbatch" in lines
    weights = lines[lines.index("block W0: backward-weight of chunk 0 (layers 0-1), once per "
                                "microbatch") + 1:]
    assert weights[0].split() == ["0", "compute", "compute", "W/embedding", "<-",
                                  "B/embedding:saved"]
