"""Rank programs: their shape, and a verifier that rejects every kind of broken program."""

from __future__ import annotations

import copy
import dataclasses
import json
import subprocess
import sys

import pytest

from planc.build.directory import read, read_programs, write
from planc.compile import compile_plan
from planc.lang import load_file, load_text
from planc.program.expansion import expand
from planc.program.operands import Input, Operands, StepKind
from planc.program.program import (
    Guard,
    Instruction,
    Opcode,
    Program,
    RankTable,
    done_event,
    node_of_done,
)
from planc.verify.verifier import verify
from tests.conftest import PLANS
from tests.test_passes import validated_example

EXAMPLES = sorted(PLANS.glob("*.plan"))
# The plans of the simulator's tables (Narayanan et al.'s, Korthikanti et al.'s and the
# Megatron H100 plans) are each compiled, validated after every pass and lowered to
# verified programs by tests/test_simulate.py, which replays them: the rest here, so that
# the suite compiles each once.
TABLES = ("narayanan-", "korthikanti-", "megatron-h100-")
DISTINCT_EXAMPLES = [p for p in EXAMPLES if not p.stem.startswith(TABLES)]

PP_PLAN = """plan pp {
  model gpt { layers = 4; hidden = 32; heads = 4; vocab = 128; seq = 16; batch = 8 }
  mesh { tp = 2; pp = 2 }
  schedule { microbatches = 4 }
}"""


def built(text: str = PP_PLAN):
    loaded = load_text(text)
    assert loaded.ok, loaded.diagnostics
    return compile_plan(loaded.plan)


def problems(build, programs=None, table=None) -> list[str]:
    return verify(build.plan, build.graph, programs or build.programs,
                  table or build.table, build.groups, build.routes).problems


# Each example's graph validated after the derivation and after every pass
# (tests/test_passes.py), then its programs verified.
@pytest.mark.parametrize("path", DISTINCT_EXAMPLES, ids=lambda p: p.stem)
def test_every_example_passes_the_validator_after_every_pass_and_lowers_to_verified_programs(
        path):
    validated_example(load_file(path).plan)


def test_the_ranks_of_a_program_are_its_stages_with_the_overrides_applied():
    """RankTable.ranks visits the stage's ranks (runs of ``stride`` every ``stride * pp``),
    not the world's; the overrides add and remove ranks in order."""
    table = RankTable(world=12, pp=3, stride=2,
                      stages={"stage0.json": 0, "stage1.json": 1, "stage2.json": 2},
                      overrides={2: "hand.json", 4: "stage1.json", 11: "stage1.json",
                                 20: "stage1.json"})
    assert list(table.ranks("stage0.json")) == [0, 1, 6, 7]
    assert list(table.ranks("stage1.json")) == [3, 4, 8, 9, 11]  # 20 is past the world
    assert list(table.ranks("stage2.json")) == [5, 10]
    assert list(table.ranks("hand.json")) == [2]
    assert list(table.ranks("none.json")) == []
    # every rank in exactly one program, the one program_of names
    everyone = sorted(r for name in table.names for r in table.ranks(name))
    assert everyone == list(range(12))
    assert all(table.program_of(r) == name for name in table.names for r in table.ranks(name))


def test_every_table_plan_is_one_the_simulator_tests_compile():
    from bench.published_runs import KORTHIKANTI_TABLE_5, MEGATRON_H100, NARAYANAN_TABLE_1

    compiled_there = {*(f"narayanan-{n}" for n in NARAYANAN_TABLE_1),
                      *(f"korthikanti-{n}" for n in KORTHIKANTI_TABLE_5),
                      *(f"megatron-h100-{n}" for n in MEGATRON_H100)}
    assert {p.stem for p in EXAMPLES if p.stem.startswith(TABLES)} == compiled_there


def test_program_shape_of_a_two_stage_pipeline():
    build = built()
    stage0, stage1 = build.programs["stage0.json"], build.programs["stage1.json"]
    assert {name: list(build.table.ranks(name)) for name in build.table.names} == {
        "stage0.json": [0, 1], "stage1.json": [2, 3]}
    assert build.table.to_json() == {"format": "planc-ranks", "version": 2, "world": 4,
                                     "pp": 2, "pp_stride": 2,
                                     "stages": {"stage0.json": 0, "stage1.json": 1},
                                     "overrides": {},
                                     "axes": {"tp": [2, 1], "cp": [1, 2], "dp": [1, 4],
                                              "pp": [2, 2]},
                                     "leader": 2}
    assert stage0.streams == ("compute", "comm", "send_next", "recv_next")
    assert stage1.streams == ("compute", "comm", "send_prev", "recv_prev")
    # 1F1B on 4 microbatches: one warm-up forward on stage 0
    assert [f"{b}.{m}" for b, m in stage0.schedule] == [
        "F0.0", "F0.1", "B0.0", "F0.2", "B0.1", "F0.3", "B0.2", "B0.3"]
    assert stage1.receives == {"recv_prev": tuple(("F/c0>c1:recv@pp", k) for k in range(4))}
    # each tp all-reduce is bracketed by events across the compute and comm streams
    block = stage0.blocks["F0"]
    index = next(i for i, x in enumerate(block) if x.node == "F/L0/proj>attn_residual:"
                 "all_reduce@tp")
    assert [(x.op, x.stream, x.event) for x in block[index - 2:index + 3]] == [
        ("record", "compute", "done:F/L0/proj"), ("wait", "comm", "done:F/L0/proj"),
        ("all_reduce", "comm", None),
        ("record", "comm", "done:F/L0/proj>attn_residual:all_reduce@tp"),
        ("wait", "compute", "done:F/L0/proj>attn_residual:all_reduce@tp")]
    expanded = list(expand(stage0))
    assert sum(1 for x in expanded if x.op == "send") == 4
    assert [x.op for x in expanded if x.stream == "recv_next"] == ["recv", "record"] * 4


def test_programs_round_trip_through_json():
    build = built()
    for program in build.programs.values():
        again = Program.from_json(json.loads(json.dumps(program.to_json())))
        assert again == program
    assert RankTable.from_json(build.table.to_json()) == build.table


def test_overlap_off_keeps_collectives_on_the_compute_stream():
    build = built(PP_PLAN.replace("schedule {", "optimize { overlap = off }\n  schedule {"))
    streams = {x.stream for p in build.programs.values() for b in p.blocks.values() for x in b
               if x.op == "all_reduce"}
    assert streams == {"compute"}
    assert problems(build) == []


# --- the verifier against hand-broken programs -------------------------------------------


def _split_rank(build, rank: int, change) -> tuple[dict, RankTable]:
    """Give ``rank`` a program of its own, changed by ``change(program_dict)``."""
    name = build.table.program_of(rank)
    data = copy.deepcopy(build.programs[name].to_json())
    change(data)
    programs = dict(build.programs)
    programs["broken.json"] = Program.from_json(data)
    t = build.table
    return programs, dataclasses.replace(t, overrides={rank: "broken.json"})


def _replace_program(build, name: str, change) -> dict:
    data = copy.deepcopy(build.programs[name].to_json())
    change(data)
    return {**build.programs, name: Program.from_json(data)}


def test_two_collectives_swapped_on_one_rank():
    build = built()

    def swap(data):
        block = data["blocks"]["F0"]
        first, second = [i for i, x in enumerate(block) if x["op"] == "all_reduce"][:2]
        block[first], block[second] = block[second], block[first]

    programs, table = _split_rank(build, 1, swap)
    found = [p for p in problems(build, programs, table) if p.startswith("tp group [0, 1]")]
    assert found == ["tp group [0, 1]: collective 1 on this group is all_reduce "
                     "F/embedding>position:all_reduce@tp (microbatch 0) on rank 0 but "
                     "all_reduce F/L0/proj>attn_residual:all_reduce@tp (microbatch 0) on rank 1: "
                     "the group would deadlock or mix up data"]


def test_a_missing_receive():
    build = built()

    def drop(data):
        data["receives"]["recv_prev"] = data["receives"]["recv_prev"][:-1]

    programs = _replace_program(build, "stage1.json", drop)
    assert "stage 0 (ranks 0, 1) sends F/c0>c1:recv@pp (microbatch 3) on send_next to stage 1 " \
           "(ranks 2, 3), which has no matching receive" in problems(build, programs)


def test_a_send_recv_cycle_deadlocks():
    build = built()

    def backward_first(data):
        # stage 0 runs microbatch 0's backward before its forward: it waits for a gradient
        # that stage 1 can only send after stage 0's activation, which never comes.
        data["schedule"] = [["B0", 0], ["F0", 0]] + [s for s in data["schedule"]
                                                     if s not in (["B0", 0], ["F0", 0])]

    programs = _replace_program(build, "stage0.json", backward_first)
    found = [p for p in problems(build, programs) if "deadlock" in p]
    assert found == [
        "the programs deadlock (a cycle of waits): stage 0 (ranks 0, 1) waits in block B0 "
        "(microbatch 0) for B/c1>c0:recv@pp (microbatch 0) from stage 1; stage 1 (ranks 2, 3) "
        "waits in block F1 (microbatch 0) for F/c0>c1:recv@pp (microbatch 0) from stage 0"]


TIED_ZERO3 = """plan t {
  model gpt { layers = 4; hidden = 32; heads = 4; vocab = 128; seq = 16; batch = 8
              tie_embeddings = on }
  mesh { pp = 2; dp = 2 }
  shard { dp { zero = 3 } }
  schedule { microbatches = 2 }
}"""


def test_a_collective_over_stages_that_holds_its_stream_deadlocks():
    """The tied embedding's all-reduce joins stage 0 and stage 1. Issued on the last
    microbatch inside stage 1's backward (where planc issued it before it moved to the
    epilogue, as Megatron-LM's finalize_model_grads does), it holds the dp stream until
    stage 0 issues it in its epilogue; issued there just before ZeRO 3's gather for
    layer 2's backward (the first unit stage 1's backward gathers: the head's and the
    last block's, kept from their forward, are the two units gathered at once), that
    gather waits behind it, stage 1's backward behind that, and stage 0's last backward
    for stage 1's gradient. Each stage's blocks and sends alone are fine: only the
    streams show it."""
    build = built(TIED_ZERO3)
    assert problems(build) == []
    tied = "G/c1.b0:all_reduce@tied"

    def in_the_backward(data):
        moved = [x for x in data["epilogue"] if x.get("node") == tied or
                 x["op"] == "record" and x["event"] == f"done:{tied}"]
        data["epilogue"] = [x for x in data["epilogue"] if x not in moved]
        block = data["blocks"]["B1"]
        before = next(i for i, x in enumerate(block)
                      if x.get("node") == "B/c1.b3>L2:all_gather@dp_cp")
        block[before:before] = [{**x, "guard": "last"} for x in moved]

    programs = _replace_program(build, "stage1.json", in_the_backward)
    assert problems(build, programs) == [
        "the programs deadlock (run stream by stream, the step cannot finish): "
        "stage 0 #135 recv_next: recv B/c1>c0:recv@pp mb 1 (recv_next) waits for the peer "
        "stage to send it; "
        "stage 1 #159 dp: all_reduce G/c1.b0:all_reduce@tied (B1 mb 1) waits for stage 0 to "
        "join this tied all_reduce; "
        "stage 0 #137 compute: wait done:B/c1>c0:recv@pp#1 mb 1 (B0 mb 1) waits for event "
        "done:B/c1>c0:recv@pp#1; "
        "stage 0 #166 dp: wait done:B/L1/ln1#1 mb 1 (B0 mb 1) waits for event "
        "done:B/L1/ln1#1; "
        "stage 1 #163 compute: wait done:B/c1.b3>L2:all_gather@dp_cp#1 mb 1 (B1 mb 1) "
        "waits for event done:B/c1.b3>L2:all_gather@dp_cp#1"]


def test_a_wait_before_its_record():
    build = built()

    def early(data):
        block = data["blocks"]["F0"]
        wait = next(i for i, x in enumerate(block) if x["op"] == "wait" and
                    x["stream"] == "comm")
        record = next(i for i, x in enumerate(block) if x["op"] == "record" and
                      x["event"] == block[wait]["event"])
        block[record], block[wait] = block[wait], block[record]

    programs = _replace_program(build, "stage0.json", early)
    found = [p for p in problems(build, programs) if "no earlier instruction records" in p]
    assert found == [f"ranks 0, 1 (stage0.json): wait done:F/embedding (microbatch {k}) on "
                     f"stream comm in block F0 waits for an event no earlier instruction "
                     f"records" for k in range(4)]


def test_a_buffer_overwritten_while_a_transfer_reads_it():
    build = built()

    def reuse(data):
        block = data["blocks"]["F0"]
        collective = next(i for i, x in enumerate(block)
                          if x.get("node") == "F/L0/proj>attn_residual:all_reduce@tp")
        # right after the all-reduce is issued, a compute step writes its output into the
        # buffer the all-reduce is still reading
        ln2 = next(x for x in block if x.get("node") == "F/L0/ln2")
        block.insert(collective + 1, {"op": "compute", "stream": "compute", "node": "F/L0/ln2",
                                      "reads": ["F/L0/ln1"], "writes": ["F/L0/proj"],
                                      "operands": ln2["operands"]})

    programs = _replace_program(build, "stage0.json", reuse)
    assert problems(build, programs) == [
        "ranks 0, 1 (stage0.json): F/L0/ln2 is issued twice; every node of stage 0 runs "
        "exactly once per step (per microbatch in its block)",
        # a step that writes another's buffer instead of its own value
        "stage0.json: compute F/L0/ln2 does not list its own value among its writes",
        # ln1's value, apart from what it kept for its backward, is freed by its last reader
        "ranks 0, 1 (stage0.json, block F0): compute F/L0/ln2 on stream compute (instruction "
        "14) reads F/L0/ln1 after instruction 8 freed it",
        "ranks 0, 1 (stage0.json, block F0): compute F/L0/ln2 on stream compute (instruction "
        "14) overwrites F/L0/proj while all_reduce F/L0/proj>attn_residual:all_reduce@tp on "
        "stream comm (instruction 13) may still be reading it",
        "ranks 0, 1 (stage0.json, block F0): F/L0/proj is written twice, by instruction 10 "
        "and 14"]


EVERY_NODE = "every node of stage {} runs exactly once per step (per microbatch in its block)"
EVERY_BLOCK = "every block runs once for each of the 4"


def _drop_optimizer(data):
    data["epilogue"] = [i for i in data["epilogue"] if not i.get("node", "").startswith("O/")]


def _move_to(part: str, node: str, guard: str | None = None):
    """Move ``node``'s instruction from block F0 to ``part`` (a block or the epilogue)."""
    def move(data):
        (instruction,) = [i for i in data["blocks"]["F0"] if i.get("node") == node]
        data["blocks"]["F0"].remove(instruction)
        if guard is not None:
            instruction["guard"] = guard
        (data["epilogue"] if part == "epilogue" else data["blocks"][part]).append(instruction)
    return move


@pytest.mark.parametrize("name, change, message", [
    # no ordering or buffer rule sees these two: the run would train with stage 0's
    # parameters frozen, or with microbatch 3's gradient added twice
    ("stage0.json", _drop_optimizer,
     f"ranks 0, 1 (stage0.json): O/c0.b0/optimizer is never issued; {EVERY_NODE.format(0)}"),
    ("stage0.json", lambda data: data["schedule"].append(["B0", 3]),
     f"ranks 0, 1 (stage0.json): the schedule runs block B0 twice for microbatch 3; "
     f"{EVERY_BLOCK}"),
    ("stage0.json", lambda data: data["schedule"].remove(["F0", 2]),
     f"ranks 0, 1 (stage0.json): the schedule never runs block F0 for microbatch 2; "
     f"{EVERY_BLOCK}"),
    ("stage0.json", lambda data: data["blocks"]["F0"].remove(
        [i for i in data["blocks"]["F0"] if i.get("node") == "F/L1/mlp_residual"][0]),
     f"ranks 0, 1 (stage0.json): F/L1/mlp_residual is never issued; {EVERY_NODE.format(0)}"),
    ("stage0.json", lambda data: data["blocks"]["F0"].append(
        [i for i in data["blocks"]["F0"] if i.get("node") == "F/L0/ln1"][0]),
     f"ranks 0, 1 (stage0.json): F/L0/ln1 is issued twice; {EVERY_NODE.format(0)}"),
    ("stage0.json", _move_to("B0", "F/L0/ln1"),
     "ranks 0, 1 (stage0.json): compute F/L0/ln1 in block B0 belongs to model chunk 0's "
     "forward"),
    ("stage0.json", _move_to("epilogue", "F/L0/ln1"),
     "ranks 0, 1 (stage0.json): compute F/L0/ln1 in epilogue runs once per microbatch, not "
     "once per step"),
    ("stage0.json", _move_to("F0", "F/L0/ln1", guard="last"),
     "ranks 0, 1 (stage0.json): compute F/L0/ln1 in block F0 runs once per microbatch but "
     "is guarded to the last one"),
    ("stage1.json", lambda data: data["receives"]["recv_prev"].pop(),
     "ranks 2, 3 (stage1.json): F/c0>c1:recv@pp is received for microbatches 0, 1, 2; a "
     "receive is taken once for each of the 4"),
    ("stage1.json", lambda data: data["receives"]["recv_prev"].append(["F/c0>c1:recv@pp", 1]),
     "ranks 2, 3 (stage1.json): F/c0>c1:recv@pp is received for microbatches 0, 1 (twice), "
     "2, 3; a receive is taken once for each of the 4"),
], ids=["optimizer-dropped", "block-run-twice", "block-never-run", "forward-dropped",
        "forward-doubled", "forward-in-backward", "forward-in-epilogue", "forward-guarded",
        "receive-dropped", "receive-doubled"])
def test_a_program_that_drops_doubles_or_misplaces_work_is_refused(name, change, message):
    """Rules of planc.verify.coverage: the program runs its stage's step whole."""
    build = built()
    assert problems(build) == []
    found = problems(build, _replace_program(build, name, change))
    assert message in found, found
    if name == "stage0.json" and change is _drop_optimizer:
        assert found == [message]  # nothing else would have refused it


@pytest.mark.parametrize("change, said", [
    (lambda schedule: schedule.append(["F0", 1]), "runs block F0 twice for microbatch 1"),
    (lambda schedule: schedule.pop(), "never runs block F0 for microbatch 3"),
])
def test_an_evaluation_that_runs_a_forward_twice_or_never_is_refused(change, said):
    build = built(PP_PLAN.replace("schedule {", "train { eval_every = 2; eval_batches = 2 }\n"
                                  "  schedule {"))
    assert problems(build) == []

    def damage(data):
        change(data["evaluation"]["schedule"])

    assert problems(build, _replace_program(build, "stage0.json", damage)) == [
        f"ranks 0, 1 (stage0.json): the evaluation's schedule {said}; every forward block "
        f"runs once for each of the 4"]


def test_verify_proves_the_evaluation_of_a_build_too():
    """planc verify, planc run and the commands that replay a build called verify alone,
    which proved the training step: an evaluation whose receives came in another order
    than stage 0 sends them passed (only compile proved the evaluation)."""
    build = built(PP_PLAN.replace("schedule {", "train { eval_every = 2; eval_batches = 2 }\n"
                                  "  schedule {"))

    def reversed_receives(data):
        (stream, items), = data["evaluation"]["receives"].items()
        data["evaluation"]["receives"][stream] = items[::-1]

    assert problems(build, _replace_program(build, "stage1.json", reversed_receives)) == [
        "the evaluation: stage 0 (ranks 0, 1) sends F/c0>c1:recv@pp (microbatch 0) as send 1 "
        "on send_next, but stage 1 (ranks 2, 3) expects F/c0>c1:recv@pp (microbatch 3) as "
        "its receive 1 on recv_prev"]


DP_PLAN = PP_PLAN.replace("mesh { tp = 2; pp = 2 }", "mesh { tp = 2; pp = 2; dp = 2 }")


def _record_moved_early(data):  # done:B/L1/fc1 recorded before B/L1/fc1 has run
    block = data["blocks"]["B0"]
    block.insert(6, block.pop(8))


@pytest.mark.parametrize("name, change, expected", [
    ("stage0.json", _record_moved_early,
     "ranks 0, 1, 4, 5 (stage0.json): block B0 records done:B/L1/fc1 on stream compute where "
     "B/L1/fc1 has not run on that stream before it: the event would say B/L1/fc1 finished "
     "while it may still run"),
    ("stage0.json", lambda data: data["blocks"]["B0"][9].update(guard="last"),
     "ranks 0, 1, 4, 5 (stage0.json): block B0: wait done:B/L1/fc1 on stream comm runs on the "
     "last microbatch only, before all_reduce B/L1/fc1>ln2:all_reduce@tp on every "
     "microbatch: the others' are not ordered"),
    ("stage1.json", lambda data: data["blocks"]["F1"].pop(0),
     "ranks 2, 3, 6, 7 (stage1.json): block F1: all_gather F/c0>c1:all_gather@tp on stream "
     "comm reads the receive F/c0>c1:recv@pp without waiting for done:F/c0>c1:recv@pp"),
    ("stage0.json", lambda data: data["epilogue"].pop(0),
     "ranks 0, 1, 4, 5 (stage0.json): epilogue: compute O/c0.b0/optimizer on stream compute "
     "reads @grad:c0.b0 without waiting for its reduction G/c0.b0:all_reduce@dp_cp on stream "
     "dp"),
    ("stage0.json", lambda data: next(i for i in data["blocks"]["F0"]
                                      if i.get("node") == "F/L0/ln1").update(op="all_reduce"),
     "ranks 0, 1, 4, 5 (stage0.json): all_reduce F/L0/ln1 in block F0 is a compute node of "
     "the graph"),
    ("stage0.json", lambda data: next(i for i in data["blocks"]["F0"] if i.get("node") ==
                                      "F/L0/ln1").update(per_microbatch=False),
     "ranks 0, 1, 4, 5 (stage0.json): compute F/L0/ln1 in block F0 runs once per microbatch, "
     "not as per_microbatch = false says"),
], ids=["record-before-its-node", "guarded-wait", "receive-not-waited",
        "reduction-not-waited", "op-not-the-nodes", "per-microbatch-flag"])
def test_events_that_do_not_say_what_they_claim_are_refused(name, change, expected):
    """Single changes a run of mutated programs found accepted, each of which trained other
    numbers or stopped a rank with a KeyError (planc.verify.events, and the op and
    per_microbatch of planc.verify.coverage): the first problem reported is the rule's."""
    build = built(DP_PLAN)
    assert problems(build) == []
    assert problems(build, _replace_program(build, name, change))[0] == expected


def test_an_instruction_of_another_stage_is_refused():
    build = built()
    borrowed = next(i for i in build.programs["stage1.json"].blocks["F1"] if i.node).to_json()

    def borrow(data):
        data["blocks"]["F0"].append(borrowed)

    found = problems(build, _replace_program(build, "stage0.json", borrow))
    assert found == [f"ranks 0, 1 (stage0.json): {borrowed['op']} {borrowed['node']} in block "
                     f"F0 is a node of stage 1"]


def test_a_transfer_whose_reads_leave_out_its_operands_is_refused():
    """The proofs order an instruction by its reads; the runtime takes its operands. A
    build whose all-reduce lists no reads and lost the wait before it would race the
    computation of what it reduces: refused (planc.verify.reads_writes)."""
    build = built()
    node = "F/L0/proj>attn_residual:all_reduce@tp"

    def unlisted(data):
        block = data["blocks"]["F0"]
        k = next(i for i, x in enumerate(block) if x.get("node") == node)
        block[k]["reads"] = []
        del block[k - 1]  # its wait for done:F/L0/proj

    programs = _replace_program(build, "stage0.json", unlisted)
    assert problems(build, programs) == [
        f"stage0.json: all_reduce {node} takes F/L0/proj (its operands) but does not list "
        f"it among its reads: nothing would order it after its writer"]

    def unreduced(data):  # a gradient reduction that lists none of its bucket's buffers
        for part in (*data["blocks"].values(), data["epilogue"]):
            for x in part:
                if x.get("operands", {}).get("payload") == "grad":
                    x["reads"] = x["writes"] = [x["node"]]
                    return x["node"]

    build = built(PP_PLAN.replace("tp = 2; pp = 2", "pp = 2; dp = 2"))
    programs = _replace_program(build, "stage0.json", unreduced)
    assert problems(build, programs) == [
        "stage0.json: all_reduce G/c0.b0:all_reduce@dp_cp runs on the gradient buffer "
        "@grad:c0.b0 but does not list it among its reads and writes",
        "ranks 0, 2 (stage0.json, block B0): all_reduce G/c0.b0:all_reduce@dp_cp on stream "
        "dp (instruction 25) reads G/c0.b0:all_reduce@dp_cp before it is written"]

    def unaccumulated(data):  # a backward step that no longer says it adds into a bucket
        step = next(x for x in data["blocks"]["B0"] if x["op"] == "compute" and
                    "@grad:c0.b0" in x.get("writes", ()))
        step["writes"] = [step["node"]]

    programs = _replace_program(build, "stage0.json", unaccumulated)
    assert problems(build, programs) == [
        "stage0.json: compute B/L1/fc2 adds its parameters' gradients into @grad:c0.b0 but "
        "does not list it among its writes: their reduction could run before it"]


def test_planc_verify_rejects_a_broken_build_directory(tmp_path, run_planc):
    build = built()
    loaded_text = PP_PLAN
    directory = write(build, tmp_path / "b", str(tmp_path / "pp.plan"), loaded_text)
    program = json.loads((directory / "programs" / "stage1.json").read_text())
    program["receives"]["recv_prev"] = program["receives"]["recv_prev"][:-1]
    (directory / "programs" / "stage1.json").write_text(json.dumps(program))
    result = run_planc("verify", directory)
    assert result.returncode == 1
    assert "which has no matching receive" in result.stderr
    assert "Traceback" not in result.stderr
    assert read_programs(read(directory)).programs["stage1.json"].receives != \
        build.programs["stage1.json"].receives


def test_planc_programs_lists_a_rank(tmp_path, run_planc):
    result = run_planc("programs", PLANS / "gpt-tiny.plan", "--rank", "5")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "rank 5: stage 0 (tp 1, cp 0, dp 1) runs stage0.json, shared with " \
                       "ranks 0, 1, 4"
    assert lines[1] == "groups: tp [4, 5]  dp_cp [1, 5]"
    assert "block F0: forward of chunk 0 (layers 0-1), once per microbatch" in lines
    expanded = run_planc("programs", PLANS / "gpt-tiny.plan", "--rank", "5", "--expand",
                         "--microbatch", "1")
    assert expanded.returncode == 0
    assert "(mb 1)" in expanded.stdout and "(mb 2)" not in expanded.stdout
    assert run_planc("programs", PLANS / "gpt-tiny.plan", "--rank", "8").returncode == 2
    alone = run_planc("programs", PLANS / "gpt-tiny.plan", "--microbatch", "1")
    assert (alone.returncode, alone.stderr) == (2, "planc: error: --microbatch needs --expand "
                                                   "(programs are listed folded over "
                                                   "microbatches otherwise)\n")


def test_planc_programs_lists_each_forward_before_its_backward(tmp_path, run_planc):
    """A build stores blocks by name (B0 before F0); the listing goes chunk by chunk,
    forward first, from a plan file and from a build directory alike."""
    expected = ["block F1: forward of chunk 1 (layers 3-5), once per microbatch",
                "block B1: backward of chunk 1 (layers 3-5), once per microbatch",
                "block F5: forward of chunk 5 (layers 15-17), once per microbatch",
                "block B5: backward of chunk 5 (layers 15-17), once per microbatch"]
    plan = PLANS / "pp-interleaved.plan"
    assert run_planc("compile", plan, "-o", tmp_path / "b").returncode == 0
    for source in (plan, tmp_path / "b"):
        result = run_planc("programs", source, "--rank", "2")
        assert result.returncode == 0, result.stderr
        assert [line for line in result.stdout.splitlines() if line.startswith("block ")] == \
            expected
    # A build is untrusted: a block that is not a chunk's forward or backward is listed
    # by its name, not a traceback.
    stage = tmp_path / "b" / "programs" / "stage1.json"
    program = json.loads(stage.read_text())
    program["blocks"]["Fx"] = program["blocks"].pop("F1")
    program["schedule"] = [["Fx" if b == "F1" else b, m] for b, m in program["schedule"]]
    stage.write_text(json.dumps(program))
    result = run_planc("programs", tmp_path / "b", "--rank", "2")
    assert result.returncode == 0, result.stderr
    assert [line for line in result.stdout.splitlines() if line.startswith("block ")] == \
        expected[1:] + ["block Fx, once per microbatch"]


def test_instruction_json_carries_explicit_writes():
    operands = Operands(inputs=(Input("F/L0/ln1"),), kernel="qkv", step="forward")
    instruction = Instruction("compute", "compute", "F/L0/qkv", reads=("F/L0/ln1",),
                              writes=("elsewhere",), operands=operands)
    assert Instruction.from_json(instruction.to_json()) == instruction
    assert Instruction.from_json({"op": "compute", "stream": "compute", "node": "n",
                                  "operands": {}}).writes == ("n",)
    for broken in (["x"], {"op": "x", "stream": "compute"}, {"op": "wait", "stream": "s"},
                   {"op": "compute", "stream": "s", "node": "n", "guard": "middle"},
                   {"op": "compute", "stream": "s", "node": "n", "what": 1},
                   {"op": "compute", "stream": "s", "node": "n"},  # no operands
                   {"op": "compute", "stream": "s", "node": "n", "operands": {"step": "x"}},
                   {"op": "compute", "stream": "s", "node": "n",
                    "operands": {"inputs": [{"buffer": 1}]}},
                   {"op": "wait", "stream": "s", "event": "e", "operands": {}}):
        with pytest.raises(ValueError):
            Instruction.from_json(broken)


def test_instructions_read_back_typed_and_write_the_same_text():
    item = {"op": "wait", "stream": "compute", "event": done_event("F/L0/qkv"),
            "guard": "last"}
    instruction = Instruction.from_json(item)
    assert instruction.op is Opcode.WAIT and instruction.guard is Guard.LAST
    assert node_of_done(instruction.event) == "F/L0/qkv"
    assert node_of_done("gathered:x") is None
    assert json.dumps(instruction.to_json()) == json.dumps(item)
    compute = Instruction.from_json({"op": "compute", "stream": "compute", "node": "n",
                                     "operands": {"step": "recompute"}})
    assert compute.operands.step is StepKind.RECOMPUTE
    assert json.dumps(compute.to_json()["operands"]) == '{"step": "recompute"}'


def test_verification_of_the_largest_plan_is_folded(tmp_path):
    # 3072 ranks, 64 stages, 512 microbatches: verified without expanding every rank
    build = compile_plan(load_file(PLANS / "gpt-1t.plan").plan)
    assert problems(build) == []
    assert len(build.programs) == 64


def test_compile_runs_the_verifier(tmp_path):
    result = subprocess.run([sys.executable, "-m", "planc", "compile", str(PLANS / "gpt-tiny.plan"),
                             "-o", str(tmp_path / "b")], capture_output=True, text=True)
    assert result.returncode == 0
    assert result.stdout.splitlines()[1].startswith("verified 2 programs for 8 ranks")


def test_one_rank_is_counted_in_the_singular(tmp_path):
    (tmp_path / "one.plan").write_text("plan one { model gpt { layers = 2; hidden = 32; "
                                       "heads = 4; vocab = 64; seq = 8; batch = 2 } }")
    result = subprocess.run([sys.executable, "-m", "planc", "compile", str(tmp_path / "one.plan"),
                             "-o", str(tmp_path / "b")], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "edges for one step (1 microbatch folded)" in lines[0]
    assert lines[1].startswith("verified 1 program for 1 rank: ")


@pytest.mark.parametrize("change, message", [
    (dict(pp=0), "is not a valid rank table (its world, pp, pp_stride, stages or overrides "
                 "are inconsistent); run planc compile again"),
    (dict(pp_stride=0), "is not a valid rank table (its world, pp, pp_stride, stages or "
                        "overrides are inconsistent); run planc compile again"),
    (dict(overrides={"9": "stage0.json"}), "is not a valid rank table (its world, pp, "
                                           "pp_stride, stages or overrides are inconsistent)"),
    (dict(world=6), "is for 6 ranks and 2 stages, plan.json for 4 and 2; run planc compile "
                    "again"),
    (dict(stages="x"), "is not a valid rank table ("),
    (dict(leader=4), "is not a valid rank table (its axes or its leader are inconsistent"),
    (dict(axes={"tp": [2, 1], "cp": [1, 2], "dp": [1, 4], "pp": [2, 3]}),
     "is not a valid rank table (its axes or its leader are inconsistent"),
    (dict(version=1), "is not a valid rank table (not a version 2 planc rank table)"),
])
def test_a_damaged_rank_table_is_refused(change, message, tmp_path, run_planc):
    directory = write(built(), tmp_path / "b", str(tmp_path / "pp.plan"), PP_PLAN)
    path = directory / "programs" / "ranks.json"
    table = json.loads(path.read_text())
    table.update(change)
    path.write_text(json.dumps(table))
    result = run_planc("verify", directory)
    assert result.returncode == 1
    assert result.stderr.startswith(f"planc: error: {path} ")
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def _first_of(program: dict, node_part: str) -> dict:
    return next(i for block in program["blocks"].values() for i in block
                if node_part in i.get("node", ""))


@pytest.mark.parametrize("change, message", [
    # the program format before a step's kept state was a buffer of its own
    (lambda p: p.update(version=3), "is not a valid program (program format version 3; "
     "this planc reads version 4, whose steps write what they keep for their backward "
     "apart from their values); run planc compile again"),
    (lambda p: _first_of(p, "qkv").pop("operands"), "has no operands"),
    (lambda p: _first_of(p, "qkv")["operands"].update(kernel="exec"),
     "are not those graph.json implies"),
    (lambda p: _first_of(p, ":all_reduce@tp")["operands"].update(group="dp_cp"),
     "are not those graph.json implies"),
    # what the simulator and the Chakra export cost a compute step by
    (lambda p: _first_of(p, "qkv")["operands"].update(flops=1.0),
     "are not those graph.json implies"),
    (lambda p: _first_of(p, "qkv")["operands"].update(flops="many"),
     "expected a finite number, got 'many'"),
    (lambda p: p["received"].clear(), "its receives and the operands of its receives name "
     "different nodes"),
])
def test_a_program_whose_operands_are_not_the_graphs_is_refused(change, message, tmp_path,
                                                                run_planc):
    directory = write(built(), tmp_path / "b", str(tmp_path / "pp.plan"), PP_PLAN)
    path = directory / "programs" / "stage1.json"
    program = json.loads(path.read_text())
    change(program)
    path.write_text(json.dumps(program))
    result = run_planc("verify", directory)
    assert result.returncode == 1
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_planc_programs_reads_only_the_program_of_its_rank(tmp_path, run_planc):
    """`planc programs --rank R` on a build of a thousand stages reads one program, not a
    thousand: R's own is read and checked, the others not at all; planc verify reads them
    all."""
    directory = write(built(), tmp_path / "b", str(tmp_path / "pp.plan"), PP_PLAN)
    (directory / "programs" / "stage0.json").write_text("{}")
    listed = run_planc("programs", directory, "--rank", "2")  # tp 2: rank 2 is stage 1's
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.startswith("rank 2: stage 1 ")
    for command in (("programs", directory, "--rank", "0"), ("verify", directory)):
        refused = run_planc(*command)
        assert refused.returncode == 1
        assert refused.stderr.startswith(f"planc: error: {directory / 'programs' / 'stage0.json'}"
                                         f" is not a valid program"), refused.stderr


def test_a_shared_binding_still_catches_operands_on_the_wrong_instruction():
    """compile_plan hands the verifier the lowering's Binding, so that operands are derived
    once; the check still compares each instruction with its own node's operands."""
    from planc.lower.bind import Binding
    from planc.lower.lower import lower

    build = built()
    binding = Binding(build.graph)
    programs, table = lower(build.plan, build.graph, binding)
    assert verify(build.plan, build.graph, programs, table, build.groups, build.routes,
                  binding).problems == []
    program = programs["stage0.json"]
    block = list(program.blocks["F0"])
    first, second = [k for k, i in enumerate(block) if i.op is Opcode.COMPUTE][:2]
    block[first] = dataclasses.replace(block[first], operands=block[second].operands)
    swapped = {**programs, "stage0.json": dataclasses.replace(
        program, blocks={**program.blocks, "F0": tuple(block)})}
    assert verify(build.plan, build.graph, swapped, table, build.groups, build.routes,
                  binding).problems == [
        f"stage0.json: the operands of compute {block[first].node} are not those graph.json "
        f"implies"]


def test_a_piece_of_the_tokens_other_than_the_graph_says_is_refused():
    """tp_overlap's pieces are operands: a partial GEMM reading another slice of the
    tokens than its all-gather brought would compute wrong rows, silently."""
    build = built(PP_PLAN.replace("  schedule", "  optimize { tp_overlap = 2 }\n  schedule"))
    assert problems(build) == []

    def shift(data):
        for block in data["blocks"].values():
            for x in block:
                for item in x.get("operands", {}).get("inputs", []):
                    if item.get("tokens") == [0, 2, 2]:
                        item["tokens"] = [1, 2, 2]
                        return

    assert problems(build, _replace_program(build, "stage0.json", shift)) == [
        "stage0.json: the operands of compute B/L1/fc2#t0 are not those graph.json implies"]


# --- ring attention -------------------------------------------------------------------------

RING_PLAN = """plan ring {
  model gpt { layers = 2; hidden = 32; heads = 4; vocab = 128; seq = 16; batch = 8 }
  mesh { cp = 2 }
  shard { cp { attention = ring } }
  schedule { microbatches = 2 }
}"""


def _instructions(program: Program):
    return [i for part in (program.prologue, *program.blocks.values(), program.epilogue)
            for i in part]


def test_ring_attention_lowers_to_ring_steps_on_the_compute_stream():
    build = built(RING_PLAN)
    (program,) = build.programs.values()
    block = 4 * 8 * 2 * 32 * 4  # 4 rows, 8 tokens per cp rank, K and V, 32 wide, fp32
    rings = [(i.stream, i.node, i.operands.step, i.operands.ring_steps, i.operands.group,
              i.operands.bytes) for i in _instructions(program)
             if i.operands is not None and i.operands.ring_steps]
    assert sorted(rings) == sorted(
        [("compute", f"{letter}/L{layer}/attention", step, 2, "cp", block)
         for letter, step in (("F", "forward"), ("B", "backward")) for layer in range(2)])
    # nothing else moves K or V: no transfer runs on the cp group itself
    assert [i.node for i in _instructions(program) if i.op != "compute" and
            i.operands is not None and i.operands.group == "cp"] == []
    assert problems(build) == []


def test_ring_attention_out_of_order_on_one_cp_rank_is_refused():
    build = built(RING_PLAN)

    def swap(data):
        block = data["blocks"]["F0"]
        first, second = [i for i, x in enumerate(block) if x.get("node", "").endswith(
            "/attention")]
        block[first], block[second] = block[second], block[first]

    programs, table = _split_rank(build, 1, swap)
    found = [p for p in problems(build, programs, table) if p.startswith("cp group")]
    assert found == ["cp group [0, 1]: collective 1 on this group is compute F/L0/attention "
                     "(microbatch 0) on rank 0 but compute F/L1/attention (microbatch 0) on "
                     "rank 1: the group would deadlock or mix up data"]


def test_ring_attention_on_two_streams_is_refused():
    build = built(RING_PLAN)
    (name,) = build.programs

    def move(data):
        for item in data["blocks"]["B0"]:
            if item.get("node") == "B/L1/attention":
                item["stream"] = "comm"

    found = [p for p in problems(build, _replace_program(build, name, move))
             if "cp group is used from" in p]
    assert found == [f"program {name}: the cp group is used from streams ['comm', "
                     "'compute']; its ring steps must leave from one stream in program "
                     "order, or two ranks could wait on each other's blocks"]


def test_a_forward_value_is_freed_by_its_last_reader_and_what_it_kept_by_its_backward():
    """What a forward step kept for its backward is a buffer of its own (NODE:saved): the
    logits (a vocabulary wide, fp32 on the loss) are freed once the loss has read them,
    not held until the head's backward."""
    build = built()
    steps = {i.node: i for block in build.programs["stage1.json"].blocks.values()
             for i in block if i.node in ("F/head", "F/loss", "B/loss", "B/head")}
    assert steps["F/head"].writes == ("F/head", "F/head:saved")
    assert "F/head" in steps["F/loss"].frees
    assert steps["B/head"].reads == ("F/head:saved", "B/loss")
    assert "F/head:saved" in steps["B/head"].frees
    assert steps["B/loss"].reads == ("F/loss:saved",)
    assert [i.node for block in build.programs["stage1.json"].blocks.values() for i in block
            if "F/head" in i.reads] == ["F/loss_max", "F/loss_sum_exp", "F/loss"]


def test_a_backward_must_read_what_its_forward_kept_and_that_must_be_written():
    build = built()

    def unordered(data):  # the head's backward without its read of what the forward kept
        step = next(x for x in data["blocks"]["B1"] if x.get("node") == "B/head")
        step["reads"] = ["B/loss"]
        step["frees"] = ["B/loss"]

    assert problems(build, _replace_program(build, "stage1.json", unordered)) == [
        "stage1.json: compute B/head continues F/head but does not list what it kept "
        "(F/head:saved) among its reads: nothing would order it after that step"]

    def unwritten(data):  # the forward no longer says it keeps anything
        step = next(x for x in data["blocks"]["F1"] if x.get("node") == "F/head")
        del step["writes"]

    assert problems(build, _replace_program(build, "stage1.json", unwritten))[0] == \
        "stage1.json: compute B/head reads F/head:saved, which no instruction of the " \
        "program writes"


def test_each_per_microbatch_buffer_is_freed_by_its_last_reader():
    """Guards with_frees (planc/lower/block_buffers.py): one rank, one layer. A forward
    value is freed by its last forward reader (the residual sums free both their
    inputs; the loss, the logits); what a forward kept for its backward (F/X:saved) by
    that backward; a gradient by the last backward step that reads it (the residual
    branches read two), B/embedding, which nothing reads, by its writer. F/loss, which
    the loss's once-a-step all-reduce reads, is kept for the step, and so are the
    gradient buckets (@grad), which the optimizer reads."""
    build = built("""plan f {
  model gpt { layers = 1; hidden = 32; heads = 4; vocab = 64; seq = 16; batch = 8 }
  schedule { microbatches = 2 }
}""")
    program = build.programs["stage0.json"]
    assert {i.node: i.frees for i in program.blocks["F0"] if i.node} == {
        "F/embedding": (), "F/position": ("F/embedding",), "F/L0/ln1": (),
        "F/L0/qkv": ("F/L0/ln1",), "F/L0/attention": ("F/L0/qkv",),
        "F/L0/proj": ("F/L0/attention",), "F/L0/attn_residual": ("F/L0/proj", "F/position"),
        "F/L0/ln2": (), "F/L0/fc1": ("F/L0/ln2",), "F/L0/gelu": ("F/L0/fc1",),
        "F/L0/fc2": ("F/L0/gelu",), "F/L0/mlp_residual": ("F/L0/attn_residual", "F/L0/fc2"),
        "F/final_ln": ("F/L0/mlp_residual",), "F/head": ("F/final_ln",),
        "F/loss": ("F/head",), "F/loss:all_reduce@stage": ()}
    assert {i.node: i.frees for i in program.blocks["B0"]} == {
        "B/loss": ("F/loss:saved",),
        "B/head": ("B/loss", "F/head:saved"),
        "B/final_ln": ("B/head", "F/final_ln:saved"),
        "B/L0/mlp_residual": ("B/final_ln", "F/L0/mlp_residual:saved"),
        "B/L0/fc2": ("F/L0/fc2:saved",),
        "B/L0/gelu": ("B/L0/fc2", "F/L0/gelu:saved"),
        "B/L0/fc1": ("B/L0/gelu", "F/L0/fc1:saved"),
        "B/L0/ln2": ("B/L0/fc1", "F/L0/ln2:saved"),
        "B/L0/attn_residual": ("B/L0/ln2", "B/L0/mlp_residual", "F/L0/attn_residual:saved"),
        "B/L0/proj": ("F/L0/proj:saved",),
        "B/L0/attention": ("B/L0/proj", "F/L0/attention:saved"),
        "B/L0/qkv": ("B/L0/attention", "F/L0/qkv:saved"),
        "B/L0/ln1": ("B/L0/qkv", "F/L0/ln1:saved"),
        "B/position": ("B/L0/attn_residual", "B/L0/ln1", "F/position:saved"),
        "B/embedding": ("B/embedding", "B/position", "F/embedding:saved")}
    assert problems(build) == []


def test_a_weight_step_must_read_what_its_input_half_kept():
    """A split backward's W step differentiates what its input half kept (B/...:saved):
    without that read nothing orders it after the input half (the lowering once left it
    out under recomputation, and only a pair's order noticed)."""
    build = built()

    def unordered(data):
        step = next(x for x in data["blocks"]["B1"] if x.get("node") == "W/head")
        step["reads"] = []
        step["frees"] = []

    assert problems(build, _replace_program(build, "stage1.json", unordered))[0] == (
        "stage1.json: compute W/head differentiates what B/head kept but does not list it "
        "(B/head:saved) among its reads: nothing would order it after that step")


def test_a_recomputed_forward_keeps_only_the_inputs_its_recomputation_does_not_get_again():
    """Full recomputation (Chen et al. 2016) keeps a layer's input: of the layer's
    forward steps, the two reading it keep that port alone (the residual sum not the
    projection's output, which the recomputation brings again), the others keep no input
    and write nothing kept; without recomputation every step keeps what autograd needs."""
    build = built("""plan r {
  model gpt { layers = 2; hidden = 32; heads = 4; vocab = 64; seq = 16; batch = 8 }
  optimize { recompute = full }
}""")
    block = build.programs["stage0.json"].blocks["F0"]
    kept = {i.node: (i.operands.keeps_inputs, f"{i.node}:saved" in i.writes) for i in block
            if i.node and i.node.startswith("F/L1/")}
    assert kept == {"F/L1/ln1": (("x",), True), "F/L1/qkv": ((), False),
                    "F/L1/attention": ((), False), "F/L1/proj": ((), False),
                    "F/L1/attn_residual": (("skip",), True), "F/L1/ln2": ((), False),
                    "F/L1/fc1": ((), False), "F/L1/gelu": ((), False),
                    "F/L1/fc2": ((), False), "F/L1/mlp_residual": ((), False)}
    assert all(i.operands.keeps_inputs is None for i in built().programs["stage0.json"]
               .blocks["F0"] if i.operands is not None)
    assert problems(build) == []
