"""The schedule registry: its schedules, their block orders written out by hand, the
activations each holds, their rules, and block names that print and parse exactly."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from planc import schedules
from planc.compile import compile_plan
from planc.lang import load_file, load_text
from planc.estimate.in_flight import microbatches_in_flight
from planc.schedules import Action, ActionKind, Block, PipelineShape
from tests.conftest import PLANS, ROOT


def plan_text(pp=2, microbatches=4, pipeline="1f1b", virtual=1, layers=4, batch=8):
    return f"""plan p {{
  model gpt {{ layers = {layers}; hidden = 32; heads = 4; vocab = 128; seq = 16; batch = {batch} }}
  mesh {{ pp = {pp} }}
  shard {{ pp {{ virtual = {virtual} }} }}
  schedule {{ microbatches = {microbatches}; pipeline = {pipeline} }}
}}"""


def texts(name, stage, pp, m, virtual=1):
    return [a.text(virtual) for a in schedules.order(name, stage, pp, m, virtual)]


def test_the_registry_lists_exactly_its_schedules_in_the_languages_order():
    assert schedules.names() == ("gpipe", "1f1b", "interleaved", "zb1p", "interleaved_zb",
                                 "zbv", "dualpipev")
    assert schedules.DEFAULT_SCHEDULE == "1f1b"
    assert [s.name for s in schedules.SCHEDULES.values()] == list(schedules.names())
    assert [s.chunks_per_stage for s in schedules.SCHEDULES.values()] == [False, False, True,
                                                                          False, True, True,
                                                                          True]
    assert [s.splits_backward for s in schedules.SCHEDULES.values()] == [False, False, False,
                                                                         True, True, True,
                                                                         True]
    with pytest.raises(TypeError):
        schedules.SCHEDULES["zigzag"] = schedules.SCHEDULES["1f1b"]  # read-only
    with pytest.raises(ValueError, match="unknown pipeline schedule 'zigzag'"):
        schedules.named("zigzag")


def test_gpipe_runs_every_forward_then_every_backward():
    assert texts("gpipe", 1, 2, 3) == ["F0", "F1", "F2", "B0", "B1", "B2"]
    assert schedules.order("gpipe", 1, 2, 1) == [Action(ActionKind.FORWARD, 0, 1),
                                                   Action(ActionKind.BACKWARD, 0, 1)]


def test_1f1b_warms_up_alternates_and_drains():
    assert texts("1f1b", 0, 3, 4) == ["F0", "F1", "F2", "B0", "F3", "B1", "B2", "B3"]
    assert texts("1f1b", 1, 3, 4) == ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"]
    assert texts("1f1b", 2, 3, 4) == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"]
    assert texts("1f1b", 0, 4, 2) == ["F0", "F1", "B0", "B1"]  # fewer microbatches than pp


def test_interleaved_goes_through_the_chunks_in_groups_of_pp():
    # pp = 2, 4 microbatches, 2 chunks per stage: stage 0 holds chunks 0 and 2.
    assert texts("interleaved", 0, 2, 4, 2) == [
        "F0.c0", "F1.c0", "F0.c2", "F1.c2",
        "F2.c0", "B0.c2", "F3.c0", "B1.c2", "F2.c2", "B0.c0", "F3.c2", "B1.c0",
        "B2.c2", "B3.c2", "B2.c0", "B3.c0"]
    assert texts("interleaved", 1, 2, 4, 2) == [
        "F0.c1", "F1.c1",
        "F0.c3", "B0.c3", "F1.c3", "B1.c3", "F2.c1", "B0.c1", "F3.c1", "B1.c1",
        "F2.c3", "B2.c3", "F3.c3", "B3.c3",
        "B2.c1", "B3.c1"]


@pytest.mark.parametrize("name, pp, m, virtual, expected", [
    ("gpipe", 4, 8, 1, [8, 8, 8, 8]),
    ("1f1b", 4, 8, 1, [4, 3, 2, 1]),
    ("1f1b", 4, 2, 1, [2, 2, 2, 1]),
    ("interleaved", 2, 4, 2, [5, 3]),  # (pp - s - 1) * 2 + (v - 1) * pp + 1
    ("interleaved", 4, 4, 2, [8, 8, 7, 5]),  # at most m * v
])
def test_in_flight_microbatch_chunks(name, pp, m, virtual, expected):
    rule = schedules.named(name).in_flight
    assert [rule(s, pp, m, virtual) for s in range(pp)] == expected


def test_memory_asks_the_registry():
    loaded = load_text(plan_text(pp=2, microbatches=4, pipeline="interleaved", virtual=2))
    assert loaded.ok, loaded.diagnostics
    assert [microbatches_in_flight(loaded.plan, s) for s in range(2)] == [5, 3]


def test_an_unknown_schedule_is_reported_as_before():
    loaded = load_text(plan_text(pipeline="zigzag"))
    assert not loaded.ok
    (diagnostic,) = [d for d in loaded.diagnostics if d.severity == "error"]
    assert diagnostic.message == ("unknown value 'zigzag'; expected gpipe, 1f1b, interleaved, "
                                  "zb1p, interleaved_zb, zbv or dualpipev")


def test_each_schedules_rules_give_the_checkers_words():
    assert schedules.problems("1f1b", PipelineShape(2, 1, 3, 4)) == []
    (virtual,) = schedules.problems("gpipe", PipelineShape(2, 2, 4, 4))
    assert (virtual.message, virtual.keys, virtual.hint) == (
        "virtual = 2 needs pipeline = interleaved, interleaved_zb, zbv or dualpipev",
        ("shard.pp.virtual",),
        "set schedule { pipeline = interleaved }")
    (single,) = schedules.problems("interleaved", PipelineShape(1, 2, 4, 4))
    assert single.message == "pipeline = interleaved needs pp > 1"
    # Uneven chunks are the checker's business (tests/test_uneven_stages.py), not the rule's.
    (groups,) = schedules.problems("interleaved", PipelineShape(2, 2, 3, 6))
    assert groups.keys == ("schedule.microbatches", "schedule.pipeline")
    loaded = load_text(plan_text(pp=2, microbatches=3, pipeline="interleaved", virtual=2,
                                 layers=6, batch=6))
    errors = [d for d in loaded.diagnostics if d.severity == "error"]
    assert [d.message for d in errors] == [groups.message]
    assert errors[0].span.line == 5  # on microbatches, the first key of the problem


@pytest.mark.parametrize("text", ["F0", "B1", "F12", "I3", "W0", "B999999999"])
def test_a_block_name_round_trips(text):
    assert Block.parse(text).name == text
    assert str(Block.parse(text)) == text


@pytest.mark.parametrize("text", ["F", "Fx", "F01", "X1", "F-1", "f1", " F1", "F1.c0",
                                  "B1000000000", 7])
def test_a_name_that_is_no_block_is_refused(text):
    with pytest.raises(ValueError):
        Block.parse(text)
    assert Block.parse_or_none(text) is None


def test_an_action_text_round_trips_and_needs_the_chunk_exactly_when_virtual():
    assert Action.parse("F3", stage=1) == Action(ActionKind.FORWARD, 3, 1)
    assert Action.parse("B3.c5", stage=1, virtual=2) == Action(ActionKind.BACKWARD, 3, 5)
    assert Action(ActionKind.BACKWARD, 3, 5).block == Block(ActionKind.BACKWARD, 5)
    for text, virtual in (("F3.c1", 1), ("F3", 2), ("F03", 1)):
        with pytest.raises(ValueError):
            Action.parse(text, 0, virtual)


@pytest.mark.parametrize("path", [PLANS / "pp-interleaved.plan", PLANS / "gpt-tiny.plan",
                                  PLANS / "llama-tiny.plan"], ids=lambda p: p.stem)
def test_every_block_of_a_build_round_trips(path):
    build = compile_plan(load_file(path).plan)
    virtual = build.plan.shard.pp.virtual
    for program in build.programs.values():
        names = set(program.blocks) | {block for block, _ in program.schedule}
        assert names and all(Block.parse(n).name == n for n in names)
        text = build.graph.graph["schedule"][str(program.stage)].split()
        actions = [Action.parse(t, program.stage, virtual) for t in text]
        assert [a.text(virtual) for a in actions] == text
        assert [(a.block.name, a.microbatch) for a in actions] == list(program.schedule)


def test_the_timeline_takes_typed_actions_and_letters_alike():
    typed = {s: schedules.order("1f1b", s, 2, 4) for s in range(2)}
    letters = {s: [(a.kind.letter, a.microbatch, a.chunk) for a in typed[s]] for s in range(2)}
    assert schedules.simulate(typed, 2, 1) == schedules.simulate(letters, 2, 1)
    assert schedules.simulate(typed, 2, 1).bubble(0) == pytest.approx(1 / 5)


def test_the_registry_imports_neither_torch_nor_the_rest_of_planc():
    code = ("import json, sys, planc.schedules; print(json.dumps(sorted(m for m in sys.modules "
            "if m == 'torch' or m.startswith('planc.'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout
    assert all(m.startswith("planc.schedules") for m in json.loads(out))


def _live(name: str, stage: int, pp: int, microbatches: int, virtual: int,
          sizes: tuple[int, ...]) -> tuple[int, int]:
    """(peak, left at the end) of the layers a stage holds, replaying its order: a
    forward makes its chunk's layers live, a whole backward or a weight gradient frees
    them."""
    live = peak = 0
    for action in schedules.order(name, stage, pp, microbatches, virtual):
        if action.kind.is_forward:
            live += sizes[action.chunk]
        elif action.kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_WEIGHT):
            live -= sizes[action.chunk]
        peak = max(peak, live)
    return peak, live


def _runnable(name: str, pp: int, virtual: int, microbatches: int) -> bool:
    return not schedules.problems(name, PipelineShape(pp, virtual, microbatches, 1000))


STEADY_CASES = [(name, pp, virtual) for name in ("1f1b", "interleaved", "zb1p",
                                                 "interleaved_zb", "zbv", "dualpipev")
                for pp in (2, 3, 4) for virtual in (1, 2, 3)
                if (virtual > 1) == schedules.named(name).chunks_per_stage
                and (virtual == 2 or schedules.named(name).placement is schedules.LOOP)]


@pytest.mark.parametrize("name,pp,virtual", STEADY_CASES)
def test_fewer_microbatches_reach_the_same_peak_on_every_stage(name, pp, virtual):
    """planc tune replays orders of peak_microbatches(...) microbatches instead of all of
    them: the peak live layers (of uneven chunks too) and the in-flight count agree."""
    schedule = schedules.named(name)
    sizes = tuple(1 + (7 * c) % 5 for c in range(pp * virtual))
    compared = 0
    for microbatches in range(1, 10 * pp * virtual + 1):
        fewer = schedule.peak_microbatches(pp, microbatches, virtual)
        if fewer == microbatches or not _runnable(name, pp, virtual, microbatches):
            continue
        assert _runnable(name, pp, virtual, fewer)
        for stage in range(pp):
            compared += 1
            assert _live(name, stage, pp, microbatches, virtual, sizes)[0] == \
                _live(name, stage, pp, fewer, virtual, sizes)[0], (microbatches, stage)
            assert schedule.in_flight(stage, pp, microbatches, virtual) == \
                schedule.in_flight(stage, pp, fewer, virtual)
    assert compared > 0


def test_gpipe_keeps_every_microbatch():
    assert schedules.named("gpipe").peak_microbatches(2, 1000, 1) == 1000
    # 1F1B on 2 stages: at least 8, keeping the count modulo 4
    assert [schedules.named("1f1b").peak_microbatches(2, m, 1) for m in (11, 12, 1000, 1001)] \
        == [11, 8, 8, 9]


@pytest.mark.parametrize("name", schedules.names())
def test_every_stage_frees_all_it_held_by_the_end_of_its_order(name):
    """DualPipeV runs whole backwards beside split ones: both free a chunk's layers."""
    schedule = schedules.named(name)
    pp, virtual = 4, 2 if schedule.chunks_per_stage else 1
    sizes = tuple(1 + c for c in range(pp * virtual))
    for stage in range(pp):
        assert _live(name, stage, pp, 16, virtual, sizes)[1] == 0
