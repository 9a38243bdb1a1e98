"""The V schedules, zbv and dualpipev: their chunk placement, their orders against the
orders torch.distributed.pipelining generates, their activations and their rules."""

from __future__ import annotations

import copy
import json

import pytest
from torch.distributed.pipelining import schedules as torch_schedules

from planc import schedules
from planc.compile import compile_plan
from planc.lang import load_text
from planc.program.program import Program
from planc.verify.verifier import verify
from planc.estimate.memory import layer_parameters, stage_parameters
from planc.schedules import Action, ActionKind, PipelineShape

TORCH_KIND = {torch_schedules.FORWARD: ActionKind.FORWARD,
              torch_schedules.BACKWARD_INPUT: ActionKind.BACKWARD_INPUT,
              torch_schedules.BACKWARD_WEIGHT: ActionKind.BACKWARD_WEIGHT,
              torch_schedules.FULL_BACKWARD: ActionKind.BACKWARD}


def torch_order(cls, rank: int, pp: int, microbatches: int) -> tuple[list[Action], set[int]]:
    """Rank ``rank``'s actions as torch's schedule class computes them (its own method,
    on an instance that needs no process group), idle slots dropped, an overlapped pair
    written as its forward then its backward; and the positions of those forwards."""
    schedule = object.__new__(cls)
    schedule.pp_group_size, schedule._n_microbatches = pp, microbatches
    schedule.num_stages = schedule._num_stages = 2 * pp
    actions, pairs = [], set()
    for step in schedule._calculate_single_rank_operations(rank):
        if step is None:
            continue
        parts = step.sub_actions or (step,)
        if step.sub_actions:
            pairs.add(len(actions))
        for part in parts:
            kind = TORCH_KIND[part.computation_type]
            actions.append(Action(kind, part.microbatch_index, part.stage_index))
    return actions, pairs


@pytest.mark.parametrize("pp, microbatches", [(2, 1), (2, 2), (2, 4), (2, 8), (3, 5),
                                              (4, 4), (4, 8), (4, 16)])
def test_zbv_orders_each_stage_as_torch_does(pp, microbatches):
    for stage in range(pp):
        expected, _ = torch_order(torch_schedules.ScheduleZBVZeroBubble, stage, pp,
                                  microbatches)
        assert schedules.order("zbv", stage, pp, microbatches, 2) == expected


@pytest.mark.parametrize("pp, microbatches", [(2, 4), (2, 5), (2, 8), (3, 6), (4, 8),
                                              (4, 12)])
def test_dualpipev_orders_and_pairs_each_stage_as_torch_does(pp, microbatches):
    dualpipev = schedules.named("dualpipev")
    for stage in range(pp):
        expected, pairs = torch_order(torch_schedules.ScheduleDualPipeV, stage, pp,
                                      microbatches)
        assert dualpipev.order(stage, pp, microbatches, 2) == expected
        assert dualpipev.overlapped(stage, pp, microbatches, 2) == pairs


def test_a_v_places_the_first_and_last_chunk_on_stage_0():
    zbv = schedules.named("zbv")
    assert [zbv.stage_of_chunk(c, 4, 2) for c in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert [zbv.chunks_of_stage(s, 4, 2) for s in range(4)] == [(0, 7), (1, 6), (2, 5),
                                                                (3, 4)]
    interleaved = schedules.named("interleaved")
    assert [interleaved.stage_of_chunk(c, 4, 2) for c in range(8)] == [0, 1, 2, 3] * 2
    assert schedules.named("dualpipev").placement is schedules.V
    assert interleaved.placement is schedules.LOOP


def test_the_v_orders_run_to_the_end_on_the_timeline():
    """Every action's inputs come before it on its own or another stage (no deadlock)."""
    for name, pp, m, makespan in (("zbv", 2, 4, 25), ("zbv", 4, 8, 51),
                                  ("dualpipev", 2, 4, 25), ("dualpipev", 4, 8, 51)):
        orders = {s: schedules.order(name, s, pp, m, 2) for s in range(pp)}
        timeline = schedules.simulate(orders, pp, 2)
        # forward 1, backward 2 (I and W 1 each): a stage's busy time is 3 per
        # microbatch and chunk, 3 x 2 x m; the V's leaves 1 unit idle at pp 2, 3 at pp 4
        assert timeline.makespan == makespan == 3 * 2 * m + (1 if pp == 2 else 3)


def test_a_v_order_that_waits_for_a_gradient_not_yet_made_deadlocks():
    """Stage 0's input gradient of its first chunk needs the second chunk's (on stage
    1), which needs the forward of every chunk before it: taken right after its own
    forward, stage 0 waits for what waits for stage 0."""
    orders = {s: list(schedules.order("zbv", s, 2, 4, 2)) for s in range(2)}
    early = orders[0].pop(orders[0].index(Action(ActionKind.BACKWARD_INPUT, 0, 0)))
    orders[0].insert(orders[0].index(Action(ActionKind.FORWARD, 0, 0)) + 1, early)
    with pytest.raises(ValueError, match="^the pipeline schedules deadlock$"):
        schedules.simulate(orders, 2, 2)


@pytest.mark.parametrize("name, pp, m, expected", [
    ("zbv", 2, 4, [4, 4]),
    ("zbv", 4, 8, [8, 8, 8, 8]),  # 2pp microbatch-chunks of half a stage: 1F1B's memory
    ("dualpipev", 2, 4, [5, 5]),
    ("dualpipev", 4, 8, [9, 9, 9, 9]),
])
def test_in_flight_is_the_peak_of_the_order(name, pp, m, expected):
    rule = schedules.named(name).in_flight
    assert [rule(s, pp, m, 2) for s in range(pp)] == expected


def test_the_v_rules_say_what_to_change():
    (virtual,) = schedules.problems("zbv", PipelineShape(2, 3, 4, 12))
    assert (virtual.message, virtual.keys, virtual.hint) == (
        "pipeline = zbv needs virtual = 2 (two chunks per stage, in a V), not 3",
        ("shard.pp.virtual", "schedule.pipeline"), "set shard { pp { virtual = 2 } }")
    (single,) = schedules.problems("dualpipev", PipelineShape(1, 2, 4, 4))
    assert single.message == "pipeline = dualpipev needs pp > 1"
    (few,) = schedules.problems("dualpipev", PipelineShape(2, 2, 3, 4))
    assert (few.message, few.hint) == (
        "pipeline = dualpipev needs at least 2 x pp = 4 microbatches, not 3",
        "set schedule { microbatches = 4 }")
    assert schedules.problems("zbv", PipelineShape(2, 2, 1, 4)) == []


def _plan(pipeline: str, virtual: str = "virtual = 2", microbatches: int = 4) -> str:
    return f"""plan p {{
  model gpt {{ layers = 4; hidden = 32; heads = 4; vocab = 128; seq = 16; batch = 8 }}
  mesh {{ pp = 2 }}
  shard {{ pp {{ {virtual} }} }}
  schedule {{ microbatches = {microbatches}; pipeline = {pipeline} }}
}}"""


def test_the_checker_places_a_v_and_points_at_virtual():
    loaded = load_text(_plan("zbv"))
    assert loaded.ok, loaded.diagnostics
    plan = loaded.plan
    assert [plan.stage_of_chunk(c) for c in range(4)] == [0, 1, 1, 0]
    assert plan.layers_of_stage(0) == (0, 3) and plan.layers_of_stage(1) == (1, 2)
    assert plan.head_stage == 0
    # the memory estimate follows: stage 0 holds both ends of the model, stage 1 two layers
    interleaved = load_text(_plan("interleaved")).plan
    v_counts = [stage_parameters(plan, s) for s in range(2)]
    assert v_counts[1] == 2 * layer_parameters(plan)
    assert sum(v_counts) == sum(stage_parameters(interleaved, s) for s in range(2))
    loaded = load_text(_plan("zbv", "virtual = 1"))
    (error,) = [d for d in loaded.diagnostics if d.severity == "error"]
    assert error.message == "pipeline = zbv needs virtual = 2 (two chunks per stage, in a " \
        "V), not 1"
    assert (error.span.line, error.hints) == (4, ("set shard { pp { virtual = 2 } }",))
    loaded = load_text(_plan("zbv", "virtual = 2; stages = [0..1, 2..3]"))
    (error,) = [d for d in loaded.diagnostics if d.severity == "error"]
    assert error.hints == ("give one range per model chunk (chunk c runs on stage c, or "
                           "2pp - 1 - c once c >= pp: a V)",)
    loaded = load_text(_plan("zbv", "virtual = 2; stages = [0..0, 1..2, 3..3, 4..5]")
                       .replace("layers = 4", "layers = 6"))
    assert loaded.ok and loaded.plan.layers_of_stage(0) == (0, 4, 5)  # explicit, uneven
    loaded = load_text(_plan("dualpipev", microbatches=2))
    (error,) = [d for d in loaded.diagnostics if d.severity == "error"]
    assert (error.span.line, error.span.column) == (5, 29)  # the value of microbatches


@pytest.mark.parametrize("pipeline, pp, microbatches", [("zbv", 4, 8), ("zbv", 3, 2),
                                                         ("dualpipev", 4, 8),
                                                         ("dualpipev", 2, 5)])
def test_the_verifier_proves_the_v_programs_and_finds_a_deadlock(pipeline, pp, microbatches):
    plan = load_text(_plan(pipeline, microbatches=microbatches).replace(
        "layers = 4", f"layers = {2 * pp}").replace("pp = 2", f"pp = {pp}").replace(
        "batch = 8", f"batch = {microbatches}")).plan
    build = compile_plan(plan)  # raises if the verifier finds a problem
    last = build.programs[f"stage{pp - 1}.json"]
    # the turn of the V is local: the last stage receives only from the stage before it
    assert set(last.receives) == {"recv_prev"}
    assert build.graph.graph["schedule"][str(pp - 1)].split() == [
        f"{b[0]}{mb}.c{b[1:]}" for b, mb in last.schedule]
    data = copy.deepcopy(build.programs["stage0.json"].to_json())
    # stage 0 runs chunk 0's first input gradient before anything else: it waits for a
    # gradient that comes back only after its own first forward went round the V
    first_input = next(s for s in data["schedule"] if s[0] == "I0")
    data["schedule"] = [first_input] + [s for s in data["schedule"] if s != first_input]
    programs = {**build.programs, "stage0.json": Program.from_json(data)}
    found = verify(build.plan, build.graph, programs, build.table, build.groups,
                   build.routes).problems
    assert any(p.startswith("the programs deadlock") for p in found), found


def test_programs_bracket_dualpipes_pairs_and_the_trace_draws_the_blocks(tmp_path, capsys):
    from planc.cli import main

    plan = tmp_path / "v.plan"
    plan.write_text(_plan("dualpipev"))
    build = tmp_path / "build"
    assert main(["compile", str(plan), "-o", str(build)]) == 0
    capsys.readouterr()
    assert main(["programs", str(build), "--rank", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[3] == (
        "schedule (24 blocks, block.microbatch): F1.0 F2.0 F1.1 F2.1 F1.2 I2.0 W2.0 "
        "[F2.2 I1.0 W1.0] [F1.3 I2.1 W2.1] [F2.3 I1.1 W1.1] I2.2 W2.2 I1.2 W1.2 I2.3 I1.3 "
        "W2.3 W1.3")
    trace = tmp_path / "trace.json"
    assert main(["simulate", str(build), "--trace", str(trace)]) == 0
    events = json.loads(trace.read_text())["traceEvents"]
    blocks = [e["name"] for e in events if e.get("args", {}).get("op") == "block"
              and e["pid"] == 1]
    assert blocks == lines[3].split(": ")[1].replace("[", "").replace("]", "").split()
