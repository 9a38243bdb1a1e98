"""The balance loss (aux_loss) over a sequence that several ranks hold: the count
all-reduce the compiler writes on the mixture's instruction, its group, the verifier's
proof, what planc explain says of it and what the simulator charges for it. That every
such plan trains as one process does is tests/test_moe.py's --check matrix."""

from __future__ import annotations

import copy
import dataclasses

import pytest

from planc.compile import compile_plan
from planc.lang import load_text
from planc.program.groups import SEQUENCE
from planc.program.program import Program
from planc.verify.verifier import verify
from tests.test_moe import plan_text

AUX = "; aux_loss = 0.01"


def built(mesh: str, shard: str = "", m: int = 2, batch: int = 8):
    loaded = load_text(plan_text(extra=AUX, mesh=mesh, shard=shard, m=m, batch=batch))
    assert loaded.ok, loaded.diagnostics
    return compile_plan(loaded.plan)


def mixture_steps(build) -> list:
    return [i for p in build.programs.values()
            for part in (p.prologue, *p.blocks.values(), p.epilogue) for i in part
            if i.op == "compute" and i.operands.kernel == "moe"]


@pytest.mark.parametrize("mesh, shard, over", [
    ("cp = 2", "cp { attention = ring }", 2),
    ("cp = 2", "cp { attention = allgather }", 2),
    ("tp = 2; cp = 2", "tp { sequence_parallel = on }", 4),
    ("tp = 2; dp = 2; ep = 2", "tp { sequence_parallel = off }", 2),
    ("dp = 2", "", None),
])
def test_a_balance_loss_sums_its_counts_over_the_ranks_of_each_sequence(mesh, shard, over):
    """Every plan with aux_loss compiles (the refusals of cp and of ep with tp are gone):
    the mixture's instruction names the sequence group (tp x cp), whose members hold the
    same sequences' other tokens, and the bytes of a microbatch's counts (fp32 sequences x
    experts); on every step of the mixture alike (only the forward runs it)."""
    build = built(mesh, shard)
    plan = build.plan
    steps = [i.operands for i in mixture_steps(build)]
    assert "forward" in {o.step for o in steps}
    counts = 4 * plan.microbatch_size * 4  # fp32, the microbatch's sequences x 4 experts
    assert {(o.counts_group, o.counts_bytes) for o in steps} == (
        {(None, None)} if over is None else {(SEQUENCE, counts)})
    rule = build.groups.rule(SEQUENCE)
    if over is None:
        assert rule is None
        return
    assert rule.axes == ("tp", "cp")
    groups = list(build.groups.groups(rule))
    assert all(len(g) == over for g in groups) and \
        sorted(r for g in groups for r in g) == list(range(plan.world))
    coords = build.groups.ranks.coords
    assert all(len({(coords(r)["dp"], coords(r)["pp"]) for r in g}) == 1 for g in groups)




# --- the verifier -----------------------------------------------------------------------

def problems(build, programs=None, table=None) -> list[str]:
    return verify(build.plan, build.graph, programs or build.programs, table or build.table,
                  build.groups, build.routes).problems


def changed(build, name: str, change) -> Program:
    data = copy.deepcopy(build.programs[name].to_json())
    change(data)
    return Program.from_json(data)


def test_the_count_all_reduces_verify():
    for mesh, shard in (("tp = 2; cp = 2", "cp { attention = ring }"),
                        ("tp = 2; dp = 2; ep = 2", "")):
        assert problems(built(mesh, shard)) == []


def test_count_all_reduces_out_of_order_on_one_rank_are_refused():
    """Rank 1 of a tp pair runs the two mixtures' forwards the other way round: their
    count all-reduces would meet the other layer's on rank 0."""
    build = built("tp = 2", "tp { sequence_parallel = on }")

    def swap(data):
        block = data["blocks"]["F0"]
        first, second = [i for i, x in enumerate(block) if x.get("node", "").endswith(
            "/moe")][:2]
        block[first], block[second] = block[second], block[first]

    name = build.table.program_of(1)
    programs = {**build.programs, "broken.json": changed(build, name, swap)}
    table = dataclasses.replace(build.table, overrides={1: "broken.json"})
    found = [p for p in problems(build, programs, table) if p.startswith(SEQUENCE)]
    assert found == [f"{SEQUENCE} group [0, 1]: collective 1 on this group is compute "
                     "F/L0/moe (microbatch 0) on rank 0 but compute F/L1/moe (microbatch 0) "
                     "on rank 1: the group would deadlock or mix up data"]


def test_count_all_reduces_on_two_streams_are_refused():
    build = built("cp = 2", "cp { attention = allgather }")
    (name,) = build.programs

    def move(data):
        for item in data["blocks"]["F0"]:
            if item.get("node") == "F/L1/moe":
                item["stream"] = "comm"

    programs = {**build.programs, name: changed(build, name, move)}
    found = [p for p in problems(build, programs) if f"the {SEQUENCE} group" in p]
    assert found == [f"program {name}: the {SEQUENCE} group is used from streams ['comm', "
                     "'compute']; its count all-reduces must leave from one stream in "
                     "program order, or two ranks could wait on each other's counts"]


def test_counts_over_another_group_or_from_every_token_are_refused():
    """A program whose mixture would sum its counts over the cp group only while tp
    splits the tokens (some left out), or would run on every token of its tp group while
    summing over tp x cp (each counted tp times)."""
    build = built("tp = 2; cp = 2", "tp { sequence_parallel = on }")
    (name,) = build.programs
    node = "F/L0/moe"

    def rewritten(**operands) -> list[str]:
        def rewrite(data):
            for part in data["blocks"].values():
                for item in part:
                    if item.get("node") == node:
                        item["operands"].update(operands)
        programs = {**build.programs, name: changed(build, name, rewrite)}
        return [p for p in problems(build, programs) if "balance loss" in p]

    assert rewritten(counts_group="cp") == [
        f"program {name}: compute {node} on stream compute sums its balance loss's counts "
        f"over group cp; they are summed over the ranks holding parts of each sequence, "
        f"the {SEQUENCE} group (tp x cp), or some tokens are left out or counted twice"]
    assert rewritten(seq_sharded=False, replicated=True) == [
        f"program {name}: compute {node} on stream compute runs on every token of its tp "
        f"group but sums its balance loss's counts over tp x cp, counting each token 2 "
        f"times; it must run on its 1/tp share"]


# --- planc explain and the simulator -----------------------------------------------------

def test_explain_names_the_count_all_reduce_its_group_and_bytes(tmp_path, capsys):
    """tp 2 x cp 2 hold parts of each sequence: 4 sequences per microbatch x 4 experts of
    fp32 counts, 64 bytes, all-reduced over the 4 ranks of the sequence group."""
    from planc.cli import main

    source = tmp_path / "aux.plan"
    source.write_text(plan_text(extra=AUX, mesh="tp = 2; cp = 2", m=2, batch=8,
                                shard="tp { sequence_parallel = on }; cp { attention = ring }"))
    assert main(["explain", str(source), "--layer", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[:2] == [
        f"layer 1: the balance loss's count all-reduce over {SEQUENCE} (4 ranks: [0, 1, 2, "
        "3]), inside the mixture's instruction",
        f"  F  all_reduce over {SEQUENCE}  64 B per microbatch  [the tokens each expert got in "
        "each sequence: fp32, sequences x experts]"]
    assert "tp (2) x cp (2) split each sequence's tokens over these ranks" in \
        " ".join(line.strip() for line in lines[2:7])


def test_without_a_split_sequence_explain_names_no_count_all_reduce(tmp_path, capsys):
    from planc.cli import main

    source = tmp_path / "aux.plan"
    source.write_text(plan_text(extra=AUX, mesh="dp = 2", m=2, batch=8))
    assert main(["explain", str(source), "--layer", "1"]) == 0
    assert "count all-reduce" not in capsys.readouterr().out


def test_the_simulator_charges_the_count_all_reduce_to_the_forward_only():
    from planc.graph.ir import Kind
    from planc.estimate.instruction_cost import InstructionCosts

    build = built("cp = 2", "cp { attention = allgather }")
    costs = InstructionCosts(build.plan, build.groups)
    size, crosses = build.groups.size(SEQUENCE), build.groups.crosses_nodes(SEQUENCE)
    assert size == 2
    by_step = {i.operands.step: i for i in mixture_steps(build) if i.node.endswith("L1/moe")}
    assert set(by_step) == {"forward", "backward"}
    for step, instruction in by_step.items():
        without = dataclasses.replace(instruction, node=instruction.node + "#bare",
                                      operands=dataclasses.replace(instruction.operands,
                                                                   counts_group=None))
        extra = costs(instruction, 0) - costs(without, 0)
        expected = costs.cost.transfer_seconds(Kind.ALL_REDUCE.value, 4 * 4 * 4, size,
                                               crosses) if step == "forward" else 0.0
        assert extra == pytest.approx(expected, rel=1e-12) and (expected > 0) == \
            (step == "forward")
