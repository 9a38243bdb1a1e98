"""Routes: the cost model's formulas, the route pass's choices, the recipes that lower tree
and hierarchical routes, the verifier's symbolic proof of them, and real runs that force
each route on 4 and 8 ranks over 2 nodes.

Expected times are worked out by hand from the formulas of Thakur, Rabenseifner and
Gropp (2005) on a topology with round numbers, never read back from planc.
"""

from __future__ import annotations

import json
import math
import shutil
import statistics

import pytest

from planc.compile import compile_plan
from planc.estimate.cost import CostModel, Placement, Route, counts_of
from planc.lang import load_text
from planc.vocabulary.units import TIME, format_quantity
from planc.program.groups import group_table
from planc.program.routes import Recipe, Step, hierarchical, tree
from planc.verify.routes import check
from planc.plan.topology import Device, Link, Topology

# intra: 10 us, 10 GB/s; inter: 50 us, 1 GB/s per device.
TOPOLOGY = Topology(2, 4, Device(1e12, None), Link(1e10, 1e-5), Link(1e9, 5e-5))
COST = CostModel(TOPOLOGY)
EIGHT_ON_TWO = Placement(8, 2, 4, 4, 4)

PLAN = """plan routes {{
  model gpt {{ layers = 2; hidden = 32; heads = 4; vocab = 128; seq = 16; batch = 16 }}
  mesh {{ {mesh} }}
  topology {{ nodes = {nodes}; devices_per_node = {dpn}
             intra {{ bandwidth = 10GB/s; latency = 10us }}
             inter {{ bandwidth = 1GB/s; latency = 50us }} }}
  shard {{ {shard} }}
  schedule {{ microbatches = 2 }}
  optimize {{ route = {route} }}
  train {{ steps = 2; optimizer = sgd(lr = 0.5, momentum = 0.9); seed = 3 }}
}}
"""


def plan_of(mesh: str, dpn: int, route: str, shard: str = "", nodes: int = 2):
    loaded = load_text(PLAN.format(mesh=mesh, dpn=dpn, route=route, shard=shard, nodes=nodes))
    assert loaded.ok, [d.message for d in loaded.diagnostics]
    return loaded.plan


def seconds(route: Route, kind: str, nbytes: float, placement: Placement) -> float | None:
    return next(c.seconds for c in COST.candidates(kind, nbytes, placement)
                if c.route == route)


# --- the cost model --------------------------------------------------------------------

def test_ring_all_reduce_across_two_nodes_uses_the_inter_node_link():
    # 2 (n - 1) = 14 steps, of which 2 (nodes - 1) = 2 cross the network (50 us) and 12
    # stay on a node (10 us), as NCCL's tuning model counts them; 2 * 7/8 * 1e8 bytes at
    # 4 NICs of 1 GB/s.
    assert seconds(Route.RING, "all_reduce", 1e8, EIGHT_ON_TWO) == pytest.approx(
        2 * 5e-5 + 12 * 1e-5 + 1.75e8 / 4e9)


def test_hierarchical_all_reduce_is_two_intra_phases_and_an_inter_all_reduce_of_a_quarter():
    intra = 3 * 1e-5 + 0.75 * 1e8 / 1e10  # reduce_scatter over 4, then all_gather over 4
    inter = 2 * 5e-5 + 1.0 * 2.5e7 / 1e9  # all_reduce of 25 MB over 2 nodes, own NIC
    assert seconds(Route.HIERARCHICAL, "all_reduce", 1e8, EIGHT_ON_TWO) == pytest.approx(
        2 * intra + inter)


def test_tree_all_reduce_is_twice_the_depth_of_both_trees():
    intra = 2 * (1e-5 + 2 * 1e8 / 1e10)  # depth 2 of a heap of 4, two children each
    inter = 1 * (5e-5 + 1e8 / 4e9)  # depth 1 between 2 nodes, one child
    assert seconds(Route.TREE, "all_reduce", 1e8, EIGHT_ON_TWO) == pytest.approx(
        2 * (intra + inter))


def test_hierarchical_reduce_scatter_and_all_gather():
    intra = 3 * 1e-5 + 0.75 * 1e8 / 1e10
    inter = 1 * 5e-5 + 0.5 * 2.5e7 / 1e9
    for kind in ("reduce_scatter", "all_gather"):
        assert seconds(Route.HIERARCHICAL, kind, 1e8, EIGHT_ON_TWO) == pytest.approx(
            intra + inter)
        # 7 steps: nodes - 1 = 1 across the network, 6 on a node
        assert seconds(Route.RING, kind, 1e8, EIGHT_ON_TWO) == pytest.approx(
            1 * 5e-5 + 6 * 1e-5 + 0.875 * 1e8 / 4e9)


def test_a_flat_ring_puts_7_4ths_the_bytes_of_hierarchical_on_the_inter_node_link():
    # Byte terms only (no latency): 2 * 7/8 B against 2 * 1/2 * B/4 per NIC, 4 NICs.
    free = CostModel(Topology(2, 4, Device(1e12, None), Link(1e30, 0.0), Link(1e9, 0.0)))
    ring = next(c.seconds for c in free.candidates("all_reduce", 1e8, EIGHT_ON_TWO)
                if c.route == Route.RING)
    hier = next(c.seconds for c in free.candidates("all_reduce", 1e8, EIGHT_ON_TWO)
                if c.route == Route.HIERARCHICAL)
    assert ring / hier == pytest.approx(1.75)


def test_small_messages_prefer_the_tree_and_large_ones_hierarchical():
    def best(nbytes):
        usable = [c for c in COST.candidates("all_reduce", nbytes, EIGHT_ON_TWO)
                  if c.seconds is not None]
        return min(usable, key=lambda c: c.seconds).route

    assert best(1e3) == Route.TREE
    assert best(1e8) == Route.HIERARCHICAL


def test_routes_that_do_not_apply_say_why():
    def reasons(kind, placement):
        return {c.route: c.reason for c in COST.candidates(kind, 1e6, placement)
                if c.seconds is None}

    assert reasons("all_reduce", Placement.within_node(4)) == {
        Route.HIERARCHICAL: "the group lies inside one node"}
    assert reasons("all_reduce", Placement.of([0, 1, 2, 4], 4)) == {
        Route.HIERARCHICAL: "uneven ranks per node (1 to 3)"}
    assert reasons("all_reduce", Placement.of([0, 4], 4)) == {
        Route.HIERARCHICAL: "one rank per node: the hierarchical route is the flat one"}
    assert reasons("all_gather", EIGHT_ON_TWO) == {
        Route.TREE: "tree applies to all_reduce only (as in NCCL); all_gather has no tree "
                    "route"}
    assert set(reasons("all_to_all", EIGHT_ON_TWO)) == {Route.TREE, Route.HIERARCHICAL}


def test_placement_of_members():
    assert Placement.of([0, 1, 4, 5], 4) == Placement(4, 2, 2, 2, 2)
    assert Placement.of([0, 1, 2, 4], 4).text() == "4 ranks on 2 nodes, 1..3 per node"
    assert counts_of([5, 0, 1, 4, 6], 4) == (2, 3)


# --- recipes and their proof -------------------------------------------------------------

@pytest.mark.parametrize("counts", [(2, 2), (4, 4), (2, 2, 2), (3, 3, 3, 3)])
@pytest.mark.parametrize("kind", ["all_reduce", "reduce_scatter", "all_gather"])
def test_hierarchical_recipes_compute_their_collective(kind, counts):
    recipe = hierarchical(kind, counts)
    assert check(recipe) == []
    assert Recipe.from_json(json.loads(json.dumps(recipe.to_json()))) == recipe


@pytest.mark.parametrize("counts", [(1,), (2,), (4, 4), (3, 5), (1, 1, 1, 1, 1), (2, 3, 1)])
def test_tree_recipes_compute_the_all_reduce(counts):
    assert check(tree("all_reduce", counts)) == []


def test_hierarchical_reduce_scatter_keeps_zero_shard_order():
    recipe = hierarchical("reduce_scatter", (2, 2))
    # local index 1 of node 0 (position 1) collects chunks 1 and 3, then keeps chunk 1.
    assert recipe.positions[1] == (
        Step("reduce_scatter", ((0, 2), (1, 3)), "intra"),
        Step("reduce_scatter", ((1,), (3,)), "inter"))


def _with(recipe: Recipe, rows) -> Recipe:
    return Recipe(recipe.kind, recipe.route, recipe.counts, recipe.chunks, tuple(rows))


def test_the_checker_rejects_a_wrong_shard_order():
    recipe = hierarchical("reduce_scatter", (2, 2))
    swapped = Step("reduce_scatter", ((2,), (0,)), "inter")
    rows = [(row[0], swapped) if p in (0, 2) else row for p, row in enumerate(recipe.positions)]
    assert check(_with(recipe, rows), lambda p: 10 + p) == [
        "rank 10 ends with chunk 0 holding the contributions of rank 10, rank 11, not the sum "
        "over the group (its shard)",
        "rank 12 ends with chunk 2 holding the contributions of rank 12, rank 13, not the sum "
        "over the group (its shard)"]


def test_the_checker_rejects_members_that_disagree():
    recipe = hierarchical("reduce_scatter", (2, 2))
    rows = list(recipe.positions)
    rows[0] = (rows[0][0], Step("reduce_scatter", ((2,), (0,)), "inter"))
    assert check(_with(recipe, rows)) == [
        "the inter sub-group of rank 0, rank 2 disagrees: rank 0 is at step 2 (reduce_scatter "
        "on inter of chunks [[2], [0]]) but rank 2 at step 2 (reduce_scatter on inter of "
        "chunks [[0], [2]])"]


def test_the_checker_rejects_a_missing_sub_step():
    recipe = hierarchical("all_reduce", (2, 2))
    rows = [row[:1] + row[2:] for row in recipe.positions]  # no inter-node all_reduce
    assert check(_with(recipe, rows)) == [
        f"rank {p} ends with chunk {c} holding the contributions of rank {q}, rank {q + 1}, "
        f"not the sum over the group"
        for p, q in ((0, 0), (1, 0), (2, 2), (3, 2)) for c in (0, 1)][:6]


def test_the_checker_finds_a_deadlock_and_a_double_count():
    recipe = tree("all_reduce", (4, 4))
    rows = list(recipe.positions)
    rows[5] = rows[5][1:]  # position 5 forgets to receive from its child, position 7
    assert check(_with(recipe, rows)) == [
        "deadlock: no member can move: rank 5 at step 3 (send with position 7 of chunks [0]); "
        "rank 7 at step 1 (send with position 5 of chunks [0])"]
    rows = list(recipe.positions)
    rows[1] = rows[1][:2] + rows[1][1:]  # position 1 sends its partial sum up twice
    rows[0] = rows[0][:1] + rows[0]  # and position 0 adds it twice
    assert check(_with(recipe, rows)) == [
        "rank 0, step 2 (recv_reduce with position 1 of chunks [0]) counts the contribution "
        "of rank 1 twice"]


# --- the route pass and the build -------------------------------------------------------

def _decisions(build):
    entry = next(e for e in build.graph.graph["passes"] if e["name"] == "route")
    return entry


@pytest.mark.parametrize("route", ["ring", "tree", "hierarchical"])
def test_a_forced_route_is_taken_where_it_applies(route):
    build = compile_plan(plan_of("dp = 8", 4, route))
    entry = _decisions(build)
    for decision in entry["decisions"]:
        applies = next(c for c in decision["candidates"] if c["route"] == route)["seconds"]
        if applies is not None:
            assert decision["route"] == route and decision["why"] == f"route = {route}"
        else:
            assert decision["route"] == "ring"
            assert decision["why"].startswith(f"route = {route} does not apply (")


def test_forced_hierarchical_on_one_node_falls_back_with_the_reason():
    build = compile_plan(plan_of("dp = 4", 4, "hierarchical", nodes=1))
    routes = {d["route"] for d in _decisions(build)["decisions"]}
    assert routes == {"ring"}
    assert {d["why"] for d in _decisions(build)["decisions"]} == {
        "route = hierarchical does not apply (the group lies inside one node): ring"}


def test_hierarchical_builds_sub_groups_and_recipes_that_verify():
    build = compile_plan(plan_of("dp = 8", 4, "hierarchical", "dp { zero = 3 }"))
    refs = [r.ref for r in build.groups.rules]
    assert "dp_cp/intra" in refs and "dp_cp/inter" in refs
    intra = build.groups.rule("dp_cp/intra")
    inter = build.groups.rule("dp_cp/inter")
    assert list(build.groups.groups(intra)) == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert list(build.groups.groups(inter)) == [(0, 4), (1, 5), (2, 6), (3, 7)]
    # ZeRO-3's gathers and reduce-scatters over dp, and the loss summed over the stage.
    assert sorted(build.routes.recipes) == ["hierarchical/all_gather/4+4",
                                            "hierarchical/all_reduce/4+4",
                                            "hierarchical/reduce_scatter/4+4"]


def test_sub_groups_of_a_strided_group():
    table = group_table(plan_of("tp = 2; dp = 4", 4, "ring").mesh, 4, False,
                        split=("dp_cp",))
    # dp groups are {0, 2, 4, 6} and {1, 3, 5, 7}: two members on each node.
    assert list(table.groups(table.rule("dp_cp/intra"))) == [(0, 2), (4, 6), (1, 3), (5, 7)]
    assert list(table.groups(table.rule("dp_cp/inter"))) == [(0, 4), (2, 6), (1, 5), (3, 7)]


# A mixture over ep = 2 on tp 4 x dp 2, two nodes of 4: the experts' replicas (edp) are
# {0, 2, 4, 6} and {1, 3, 5, 7}, two on each node, and their gradients' all-reduce takes
# a hierarchical route. groups.json once gave edp no sub-groups (compile stopped at the
# verifier), and then sub-groups of the whole stage rather than of the cut edp group
# (the ranks' reduce-scatter failed): a run of the plan found both.
EXPERT_REPLICAS = PLAN.replace("model gpt {{", "model moe {{ experts = 4; top_k = 2; "
                                                "expert_ffn = 16;").format(
    mesh="tp = 4; dp = 2; ep = 2", nodes=2, dpn=4, route="hierarchical", shard="")


def test_the_expert_replicas_take_a_hierarchical_route_on_their_own_sub_groups():
    from dataclasses import replace

    from planc.verify.routes import check_routes

    loaded = load_text(EXPERT_REPLICAS)
    assert loaded.ok, [d.message for d in loaded.diagnostics]
    build = compile_plan(loaded.plan)  # raises where the verifier finds a problem
    routed = {n for n, d in build.graph.nodes(data=True)
              if d.get("axis") == "edp" and d.get("route") == "hierarchical"}
    assert routed == {"G/c0.e0:all_reduce@edp"}
    groups = build.groups
    assert list(groups.groups(groups.rule("edp"))) == [(0, 2, 4, 6), (1, 3, 5, 7)]
    assert list(groups.groups(groups.rule("edp/intra"))) == [(0, 2), (4, 6), (1, 3), (5, 7)]
    assert list(groups.groups(groups.rule("edp/inter"))) == [(0, 4), (2, 6), (1, 5), (3, 7)]
    assert [groups.members(r, groups.rule("edp/intra")) for r in range(8)] == [
        (0, 2), (1, 3), (0, 2), (1, 3), (4, 6), (5, 7), (4, 6), (5, 7)]
    # the verifier holds groups.json's sub-groups to those the recipe was proven on: a
    # rule that forgot the cut gives rank 0 the node's four ranks
    uncut = tuple(replace(rule, fold=0, across=False) if rule.ref == "edp/intra" else rule
                  for rule in groups.rules)
    assert check_routes(build.graph, replace(groups, rules=uncut), build.routes) == [
        "G/c0.e0:all_reduce@edp: groups.json gives rank 0 the intra-node sub-group "
        "[0, 1, 2, 3] of edp, but its hierarchical route runs on [0, 2], rank 0's "
        "intra-node part of the edp group [0, 2, 4, 6]"]


def test_the_expert_replicas_hierarchical_route_runs_and_matches(tmp_path, run_planc):
    pytest.importorskip("torch")
    source = tmp_path / "experts.plan"
    source.write_text(EXPERT_REPLICAS)
    trace = tmp_path / "trace.json"
    done = run_planc("run", source, "-o", tmp_path / "build", "--check", "--timeout", "60",
                     "--trace", trace, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "every loss and parameter matches" in done.stderr
    # every rank ran the recipe's steps for the replicas' reduction (the trace says so)
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    assert {(e["pid"], e["args"].get("route")) for e in events
            if e["name"] == "G/c0.e0:all_reduce@edp"} == {(r, "hierarchical") for r in range(8)}


def test_the_verifier_rejects_a_tampered_recipe(tmp_path, run_planc):
    source = tmp_path / "p.plan"
    source.write_text(PLAN.format(mesh="dp = 4", nodes=2, dpn=2, route="hierarchical",
                                  shard=""))
    out = tmp_path / "build"
    done = run_planc("compile", source, "-o", out)
    assert done.returncode == 0, done.stderr
    path = out / "programs" / "routes.json"
    data = json.loads(path.read_text())
    recipe = data["recipes"]["hierarchical/all_reduce/2+2"]
    # Drop the inter-node all_reduce: each node would keep only its own sum.
    recipe["positions"] = [[s for s in row if recipe["steps"][s]["op"] != "all_reduce"]
                           for row in recipe["positions"]]
    path.write_text(json.dumps(data))
    done = run_planc("verify", out)
    assert done.returncode == 1
    lines = done.stderr.splitlines()
    assert lines[0] == (
        "planc: error: F/loss:all_reduce@stage, hierarchical all_reduce on stage group "
        "[0, 1, 2, 3]: rank 0 ends with chunk 0 holding the contributions of rank 0, rank 1, "
        "not the sum over the group")
    assert lines[-1] == "6 problems found; these programs must not run."
    done = run_planc("run", out)
    assert done.returncode == 1 and "nothing was run" in done.stderr
    shutil.rmtree(out)


# --- calibrated topologies ------------------------------------------------------------

CALIBRATED = {
    "format": "planc-topology", "version": 1, "name": "test machine", "devices_per_node": 2,
    "device": {"flops": 4e10, "memory": None, "efficiency": 1.0},
    "intra": {"bandwidth": 1e9, "latency": 1e-4,
              "collectives": {"all_reduce": {"bandwidth": 5e8, "latency": 2e-3},
                              "reduce_scatter": {"bandwidth": 2e8, "latency": 1e-3}}},
    "inter": {"bandwidth": 1e8, "latency": 5e-4, "collectives": {}},
    "measured": {},
}


def _with_topology(tmp_path, document, extra: str = "") -> object:
    path = tmp_path / "machine.json"
    path.write_text(json.dumps(document))
    text = PLAN.format(mesh="dp = 4", nodes=2, dpn=2, route="auto", shard="").replace(
        "topology { nodes = 2; devices_per_node = 2",
        f'topology {{ preset = "machine.json"; nodes = 2{extra}')
    source = tmp_path / "p.plan"
    source.write_text(text.replace(
        "intra { bandwidth = 10GB/s; latency = 10us }\n             "
        "inter { bandwidth = 1GB/s; latency = 50us } ", ""))
    return source


def test_a_calibrated_topology_supplies_links_and_measured_collectives(tmp_path):
    from planc.lang import load_file
    from planc.plan.topology import Tuning

    loaded = load_file(_with_topology(tmp_path, CALIBRATED))
    assert loaded.ok, [d.message for d in loaded.diagnostics]
    topology = loaded.plan.topology
    assert (topology.nodes, topology.devices_per_node) == (2, 2)
    assert topology.intra.collectives == (Tuning("all_reduce", 5e8, 2e-3),
                                          Tuning("reduce_scatter", 2e8, 1e-3))
    # A ring all-reduce inside a node of 2: the call, 2 steps, 1 x B at the bus bandwidth.
    cost = CostModel(topology)
    assert cost.ring_seconds("all_reduce", 1e6, Placement.within_node(2)) == pytest.approx(
        2e-3 + 2 * 1e-4 + 1e6 / 5e8)
    # all_gather has no measured figures: the link's bandwidth, no cost per call.
    assert cost.ring_seconds("all_gather", 1e6, Placement.within_node(2)) == pytest.approx(
        1e-4 + 0.5 * 1e6 / 1e9)


@pytest.mark.parametrize("change, message", [
    ({"format": "other"}, "cannot use topology 'machine.json': it is not a planc topology "
                          "(planc calibrate writes them)"),
    ({"version": 9}, "cannot use topology 'machine.json': it is version 9 of the topology "
                     "format; this planc reads version 1"),
    ({"intra": {"bandwidth": -1, "latency": 0}}, "cannot use topology 'machine.json': "
                                                 "intra.bandwidth must be a number from 1 to "
                                                 "1e+30"),
    # a rate that would make a step's time infinite
    ({"intra": {"bandwidth": 5e-324, "latency": 0}}, "cannot use topology 'machine.json': "
                                                     "intra.bandwidth must be a number from "
                                                     "1 to 1e+30"),
    ({"inter": {"bandwidth": 1e9, "latency": 1e9}}, "cannot use topology 'machine.json': "
                                                    "inter.latency must be a number from 0 "
                                                    "to 3600"),
    ({"inter": {"bandwidth": 1e9, "latency": 0, "collectives": {"bcast": {}}}},
     "cannot use topology 'machine.json': inter.collectives names 'bcast'; it holds "
     "all_reduce, reduce_scatter, all_gather and tree"),
    ({"device": {**CALIBRATED["device"], "exp_rate": 0}},
     "cannot use topology 'machine.json': device.exp_rate must be a number from 1 to 1e+30"),
])
def test_a_broken_calibrated_topology_is_an_error_at_the_path(tmp_path, change, message):
    from planc.lang import load_file

    loaded = load_file(_with_topology(tmp_path, {**CALIBRATED, **change}))
    assert not loaded.ok
    [diagnostic] = loaded.diagnostics
    assert diagnostic.message == message
    assert (diagnostic.span.line, diagnostic.span.column) == (4, 23)


@pytest.mark.parametrize("text, message", [
    ('{"devices_per_node": ' + "9" * 5000 + "}",
     "it holds an integer of more than 4,300 digits"),
    ("[" * 100_000 + "]" * 100_000, "it nests its values too deep to be a planc topology"),
    ("{", "it is not JSON")])
def test_a_topology_json_cannot_read_is_named_in_its_words(tmp_path, text, message):
    """What json.loads cannot read, in words about the file (Python's own text for a long
    integer told the user to call sys.set_int_max_str_digits)."""
    from planc.lang import load_file

    source = _with_topology(tmp_path, CALIBRATED)
    (tmp_path / "machine.json").write_text(text)
    [diagnostic] = load_file(source).diagnostics
    assert diagnostic.message == f"cannot use topology 'machine.json': {message}"


OVERHEADS = {"gelu": {"forward": 3e-5, "gradient": 5e-5},
             "qkv": {"forward": 1e-5, "gradient": 2e-5}}


def test_a_calibrated_topology_supplies_each_operators_fixed_cost(tmp_path):
    """device.overheads (planc calibrate, on the runtime's own instructions): an operator
    it names costs its figure, forward or gradient step; any other the device's."""
    from planc.lang import load_file
    from planc.estimate.instruction_cost import InstructionCosts
    from planc.plan.plan import DTYPE_BYTES
    from planc.estimate.roofline import memory_bound_bytes, roofline_seconds, traffic
    from planc.program.operands import GRADIENT_STEPS

    document = {**CALIBRATED, "device": {**CALIBRATED["device"], "overhead": 7e-6,
                                         "backward_overhead": 9e-6,
                                         "overheads": OVERHEADS}}
    loaded = load_file(_with_topology(tmp_path, document))
    assert loaded.ok, [d.message for d in loaded.diagnostics]
    device = loaded.plan.topology.device
    assert device.overheads == (("gelu", 3e-5, 5e-5), ("qkv", 1e-5, 2e-5))
    build = compile_plan(loaded.plan)
    costs = InstructionCosts(loaded.plan, build.groups)
    rate, bandwidth = device.flops * device.efficiency, device.bandwidth
    seen = set()
    for instruction in build.programs[build.table.names[0]].written():
        operands = instruction.operands
        if operands is None or operands.kernel is None or operands.kernel == "moe":
            continue
        gradient = operands.step in GRADIENT_STEPS
        fixed = {("gelu", False): 3e-5, ("gelu", True): 5e-5, ("qkv", False): 1e-5,
                 ("qkv", True): 2e-5}.get((operands.kernel, gradient),
                                          9e-6 if gradient else 7e-6)
        moved = memory_bound_bytes(operands, traffic(
            operands.kernel, loaded.plan.train.optimizer.name) * operands.output_bytes,
            DTYPE_BYTES[loaded.plan.model.dtype])
        arithmetic = roofline_seconds(operands.flops or 0, moved, rate, bandwidth)
        assert costs(instruction, 0) == pytest.approx(arithmetic + fixed, rel=1e-12), \
            instruction.node
        seen.add((operands.kernel, gradient))
    assert {("gelu", False), ("gelu", True), ("qkv", False), ("qkv", True),
            ("fc1", False), ("fc1", True)} <= seen


@pytest.mark.parametrize("overheads, message", [
    ([], "device.overheads must be an object"),
    ({"gelu": {"forward": 1e-5}}, "device.overheads.gelu must hold forward and gradient"),
    ({"gelu": {"forward": -1, "gradient": 0}},
     "device.overheads.gelu.forward must be a number from 0 to 3600"),
    ({"gelu": {"forward": 0, "gradient": float("nan")}},
     "device.overheads.gelu.gradient must be a number from 0 to 3600"),
    ({"not an op": {"forward": 0, "gradient": 0}},
     "device.overheads names 'not an op', not an operator"),
    ({f"op{k}": {"forward": 0, "gradient": 0} for k in range(65)},
     "device.overheads names 65 operators; at most 64"),
])
def test_broken_operator_overheads_are_an_error_at_the_path(tmp_path, overheads, message):
    from planc.lang import load_file

    document = {**CALIBRATED, "device": {**CALIBRATED["device"], "overheads": overheads}}
    loaded = load_file(_with_topology(tmp_path, document))
    assert [d.message for d in loaded.diagnostics] == [
        f"cannot use topology 'machine.json': {message}"]


def test_a_missing_calibrated_topology_is_an_error(tmp_path):
    from planc.lang import load_file

    source = _with_topology(tmp_path, CALIBRATED)
    (tmp_path / "machine.json").unlink()
    loaded = load_file(source)
    assert [(d.message, d.hints) for d in loaded.diagnostics] == [
        (f"cannot read topology 'machine.json' ({tmp_path}/machine.json): No such file or "
         f"directory", ("a topology's path is relative to the plan file",))]


# --- what users see ----------------------------------------------------------------------

def test_compile_prints_the_routes_and_explain_the_route_table(tmp_path, run_planc):
    source = tmp_path / "p.plan"
    source.write_text(PLAN.format(mesh="dp = 8", nodes=2, dpn=4, route="auto", shard=""))
    done = run_planc("compile", source, "-o", tmp_path / "b")
    assert done.returncode == 0, done.stderr
    assert "route (auto): 1 tree, 1 hierarchical of 2 collectives" in done.stdout
    done = run_planc("explain", tmp_path / "b", "--routes")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    # The gradient bucket: 34,176 fp32 parameters, 136,704 bytes, over 8 ranks, 4 per node.
    # ring: 2 x 50 us across nodes + 12 x 10 us on them + 1.75 x B / 4 GB/s = 280 us; tree: 2 x (2 x (10 us + 2 B / 10 GB/s)
    # + (50 us + B / 4 GB/s)) = 318 us; hierarchical: 2 x (3 x 10 us + 0.75 B / 10 GB/s)
    # + 2 x 50 us + (B / 4) / 1 GB/s = 215 us.
    start = lines.index("     route: hierarchical, 215 us predicted (auto: the least predicted "
                        "time)")
    assert lines[start + 1:start + 7] == [
        "       groups: 8 ranks on 2 nodes, 4 per node",
        "       route         predicted  chosen  why",
        "       ------------  ---------  ------  -----------------------------------------------"
        "------",
        "       ring             280 us          the backend's native collective",
        "       tree             318 us          binary trees inside and between nodes, point "
        "to point",
        "       hierarchical     215 us  yes     inside nodes of 4, then between 2 nodes"]


def test_calibrate_fits_a_line_through_every_size_and_bounds_a_slope_noise_flattened():
    """A collective's bandwidth is the slope of the least-squares line through its sizes;
    where the largest size took no longer than the others (noise larger than the
    transfer), the slope is bounded by the largest size's whole time, never a bandwidth
    of 1e6 GB/s."""
    from planc.runtime.calibrate_fit import slope_fit as _slope_fit

    # exactly t = 1 ms + bytes / 1 GB/s
    line = [(n, 1e-3 + n / 1e9) for n in (4 << 10, 256 << 10, 1 << 20)]
    slope, at_zero = _slope_fit(line)
    assert slope == pytest.approx(1e-9) and at_zero == pytest.approx(1e-3)
    # a calibration's all_reduce on 8 ranks of 2 cores: the line through all three
    # (statistics.linear_regression's), not the slope of the two largest
    points = [(4 << 10, 17.36e-3), (256 << 10, 21.61e-3), (1 << 20, 24.14e-3)]
    slope, at_zero = _slope_fit(points)
    fitted = statistics.linear_regression(*zip(*points))
    assert (slope, at_zero) == (pytest.approx(fitted.slope), pytest.approx(fitted.intercept))
    assert 1 / slope == pytest.approx(174.67e6, rel=1e-4)
    # the 1 MB call as fast as the 256 KB one and faster than the 4 KB one: bounded
    slope, at_zero = _slope_fit([(4 << 10, 12e-3), (256 << 10, 10e-3), (1 << 20, 10e-3)])
    assert slope == 10e-3 / (1 << 20)
    assert at_zero == pytest.approx(12e-3 - 10e-3 * 4 / 1024)  # 11.96 ms


def test_calibrate_measures_a_step_s_calls_on_every_pair_of_a_level():
    pytest.importorskip("torch")
    from planc.runtime.calibrate import level_pairs

    assert level_pairs("intra", 8, 1) == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert level_pairs("intra", 3, 2) == [(0, 1)]  # the third rank computes meanwhile
    assert level_pairs("inter", 4, 2) == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert level_pairs("inter", 4, 1) == []


def test_calibrate_refuses_a_bad_command_line(tmp_path, run_planc):
    done = run_planc("calibrate", "-o", tmp_path / "t.json", "--ranks", "4", "--nodes", "3")
    assert (done.returncode, done.stderr) == (2, "planc: error: --nodes must divide --ranks "
                                                 "(4)\n")
    done = run_planc("calibrate", "-o", tmp_path / "missing" / "t.json")
    assert done.returncode == 1
    assert done.stderr == (f"planc: error: -o {tmp_path / 'missing' / 't.json'}: cannot write "
                           f"there ({tmp_path / 'missing'} does not exist)\n")
    assert not (tmp_path / "t.json").exists()


@pytest.mark.slow
def _kernels_of_the_tiny_plans(world: int) -> set[str]:
    """The operators of calibrate's tiny plans' compute instructions."""
    from planc.program.program import Opcode
    from planc.runtime.calibrate_instructions import FAMILIES, plan_text

    kernels = set()
    for family in FAMILIES:
        loaded = load_text(plan_text(family, world, world, 3))
        assert loaded.ok, [d.message for d in loaded.diagnostics]
        for program in compile_plan(loaded.plan).programs.values():
            kernels |= {item.operands.kernel for item in program.written()
                        if item.op is Opcode.COMPUTE and item.operands.kernel is not None}
    return kernels


def test_calibrate_measures_every_pair_of_two_nodes_under_load(tmp_path, run_planc):
    """4 ranks as 2 nodes of 2: the figures measured while the others compute come from
    the node's pair and from both pairs across the nodes, and make a topology."""
    pytest.importorskip("torch")
    from planc.plan.presets import calibrated_preset

    output = tmp_path / "machine.json"
    done = run_planc("calibrate", "-o", output, "--ranks", "4", "--nodes", "2", "--quick",
                     "--repeats", "1", timeout=300)
    assert done.returncode == 0, done.stderr
    data = json.loads(output.read_text())
    assert data["measured"]["intra"]["pairs_under_load"] == [[0, 1]]
    assert data["measured"]["inter"]["pairs_under_load"] == [[0, 2], [1, 3]]
    preset = calibrated_preset(data, "machine.json")
    for level, latency in (("intra", preset.intra_latency), ("inter", preset.inter_latency)):
        assert latency == data["measured"][level]["calls_under_load"]["all_gather"] > 0
    for tuning in preset.intra_collectives + preset.inter_collectives:
        assert math.isfinite(tuning.bandwidth) and tuning.bandwidth > 0
    # each line says whether its bandwidth is a steady figure, and its interval from
    # the timings kept beside the medians it was fitted to
    from planc.commands.calibrate import UNSTEADY, fixed_cost_bound, interval_text

    lines = done.stdout.splitlines()
    tunings = {"intra": preset.intra_collectives, "inter": preset.inter_collectives}
    links = {"intra": preset.intra_bandwidth, "inter": preset.inter_bandwidth}
    for level, heading in (("intra", "intra-node: "), ("inter", "inter-node: ")):
        measured = data["measured"][level]
        assert set(measured["timings"]) == {"point_to_point", "all_gather", "all_reduce",
                                            "reduce_scatter", "tree"}
        for kind, timings in measured["timings"].items():
            assert [[size, statistics.median(times)] for size, times in timings] == \
                measured[kind]
            assert [len(times) for _, times in timings] == [1, 1, 1]  # --repeats 1
        start = next(k for k, line in enumerate(lines) if line.startswith(heading))
        assert interval_text(links[level], measured["timings"]["point_to_point"]) in \
            lines[start]
        by_kind = {tuning.kind: tuning.bandwidth for tuning in tunings[level]}
        for line in lines[start + 1:start + 5]:
            kind = line.split(":")[0].strip()
            assert line.endswith(UNSTEADY) == fixed_cost_bound(measured[kind]), line
            shown = interval_text(by_kind[kind], measured["timings"][kind])
            assert shown.startswith(" (95 % interval: ") and shown in line, line


def test_calibrate_says_when_a_bandwidth_is_the_slope_of_noise():
    from planc.commands.calibrate import fixed_cost_bound

    # an all_reduce of 8 ranks on 2 cores (2026-12-01): 18.7, 18.0 and 22.4 ms for 4 KB,
    # 256 KB and 1 MB; its bandwidth was 15.8x apart over eight calibrations
    assert fixed_cost_bound([[4096, 0.0187], [262144, 0.0180], [1048576, 0.0224]])
    # planc's tree all-reduce in the same calibration: 1.8, 3.9 and 8.8 ms
    assert not fixed_cost_bound([[4096, 0.00178], [262144, 0.00390], [1048576, 0.00883]])
    assert not fixed_cost_bound(None) and not fixed_cost_bound([[4096, 0.001]])


def test_a_bandwidth_s_interval_is_the_slope_s_through_every_timing():
    """The 95 % interval of a bandwidth: Student's t times the least-squares standard
    error of the slope through every timing, around the slope of the medians (no torch:
    planc.runtime.calibrate_fit)."""
    from planc.runtime.calibrate_fit import bandwidth_interval, t_975

    # sizes 1, 2 and 3 bytes, two timings each, 0.1 s either side of t = 0.1 + bytes:
    # the medians' slope is 1; through the six timings the residual variance is
    # 6 x 0.01 / 4 and the spread of the sizes 4, so the slope's standard error is
    # sqrt(0.015 / 4), times t at 4 degrees of freedom (2.776)
    timings = [[1, [1.0, 1.2]], [2, [2.0, 2.2]], [3, [3.0, 3.2]]]
    margin = 2.776 * math.sqrt(0.015 / 4)
    count, lowest, highest = bandwidth_interval(timings)
    assert count == 6
    assert lowest == pytest.approx(1 / (1 + margin)) and lowest == pytest.approx(0.8547,
                                                                                 abs=1e-4)
    assert highest == pytest.approx(1 / (1 - margin)) and highest == pytest.approx(1.2048,
                                                                                   abs=1e-4)
    # times that do not grow with size: the slope's interval reaches zero, so the
    # timings allow any bandwidth above the lowest (an all_reduce of 8 ranks on 2 cores)
    flat = [[4096, [0.0187, 0.0150, 0.0210]], [262144, [0.0180, 0.0230, 0.0160]],
            [1048576, [0.0224, 0.0170, 0.0190]]]
    count, lowest, highest = bandwidth_interval(flat)
    assert (count, highest) == (9, None) and 0 < lowest < 1
    # too few timings, one size, or a topology calibrated before timings were kept
    assert bandwidth_interval([[1, [1.0]], [2, [2.0]]]) is None
    assert bandwidth_interval([[1, [1.0, 1.1, 1.2]]]) is None
    assert bandwidth_interval(None) is None and bandwidth_interval([[1, "x"]]) is None
    # Student's t: the table's ends, and the expansion beyond it
    assert (t_975(1), t_975(4), t_975(30)) == (12.706, 2.776, 2.042)
    assert t_975(31) == pytest.approx(2.0395, abs=2e-4)
    assert t_975(120) == pytest.approx(1.9799, abs=2e-4)


def test_calibrate_writes_a_topology_that_a_plan_can_use(tmp_path, run_planc):
    pytest.importorskip("torch")
    from planc.plan.presets import calibrated_preset

    output = tmp_path / "machine.json"
    done = run_planc("calibrate", "-o", output, "--ranks", "2", "--repeats", "1",
                     timeout=300)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    data = json.loads(output.read_text())
    # a noisy machine's figures may be its calls' fixed cost alone, said beside them
    from planc.commands.calibrate import UNSTEADY, fixed_cost_bound
    unsteady = UNSTEADY if fixed_cost_bound(data["measured"]["intra"]["point_to_point"]) \
        else ""
    assert lines[0].startswith("intra-node: ") and lines[0].endswith(" per message" + unsteady)
    assert [line.split(":")[0].strip() for line in lines[1:5]] == [
        "all_gather", "all_reduce", "reduce_scatter", "tree"]
    assert lines[5].endswith("(not measured: the other link's figures)" + unsteady)
    assert lines[-1] == (f'written to {output}; use it with topology {{ preset = "PATH" }}, '
                         f'PATH relative to the plan file ({output} from anywhere)')
    preset = calibrated_preset(data, "machine.json")
    assert lines[-2] == (f"overlap: {data['device']['overlap']:.2f} of an all_reduce hidden "
                         f"behind a matrix multiply")
    figures = data["measured"]["overlap"]
    share = (figures["gemm"] + figures["all_reduce"] - figures["together"]) / \
        min(figures["gemm"], figures["all_reduce"])
    assert data["device"]["overlap"] == min(1.0, max(0.0, share))
    # a compute instruction's fixed cost: the tiny step's forward for a forward
    # instruction, its backward for a backward one
    overhead = data["measured"]["overhead"]
    assert data["device"]["overhead"] == overhead["forward"] > 0
    assert data["device"]["backward_overhead"] == overhead["backward"] > 0
    assert (preset.overhead, preset.backward_overhead) == (overhead["forward"],
                                                           overhead["backward"])
    # exponentials a second, as a loss computes them (Device.exp_rate)
    assert data["device"]["exp_rate"] == preset.exp_rate > 0
    assert preset.topology(1).device.exp_rate == preset.exp_rate
    assert lines[-4] == f"exponentials: {preset.exp_rate / 1e9:.3g} billion a second per rank"
    assert lines[-6].endswith(
        f"GFLOP/s per rank, {format_quantity(preset.overhead, TIME)} per forward "
        f"instruction and {format_quantity(preset.backward_overhead, TIME)} per backward "
        f"one beyond its arithmetic")
    # each operator's own instructions (planc.runtime.calibrate_instructions): every
    # operator of the three families' tiny plans, forward and gradient step
    overheads = data["device"]["overheads"]
    assert overheads == data["measured"]["overheads"]
    assert set(overheads) == _kernels_of_the_tiny_plans(2)
    assert {"attention", "qkv", "swiglu", "moe", "loss", "optimizer"} <= set(overheads)
    for figures in overheads.values():
        assert set(figures) == {"forward", "gradient"}
        assert all(math.isfinite(v) and v >= 0 for v in figures.values())
    assert preset.overheads == tuple((kernel, figures["forward"], figures["gradient"])
                                     for kernel, figures in sorted(overheads.items()))
    forward = [figures["forward"] for figures in overheads.values()]
    gradient = [figures["gradient"] for figures in overheads.values()]
    slowest = max(overheads, key=lambda k: overheads[k]["forward"] + overheads[k]["gradient"])
    assert lines[-5] == (
        f"operators: {len(overheads)} timed on the runtime's own instructions, "
        f"{format_quantity(min(forward), TIME)} to {format_quantity(max(forward), TIME)} "
        f"forward and {format_quantity(min(gradient), TIME)} to "
        f"{format_quantity(max(gradient), TIME)} a gradient step beyond their arithmetic "
        f"(the most: {slowest})")
    # a transfer's hand-off between the runtime's stream threads, measured while the
    # other rank computes
    assert data["device"]["handoff"] == preset.handoff == data["measured"]["handoff"] > 0
    assert lines[-3] == (f"hand-off: {format_quantity(preset.handoff, TIME)} per transfer "
                         f"between the runtime's stream threads")
    # a message's latency in a step: a pair's all_gather of 4 KB while the others compute
    under_load = data["measured"]["intra"]["calls_under_load"]
    assert set(under_load) == {"all_reduce", "reduce_scatter", "all_gather", "tree"}
    assert data["measured"]["intra"]["pairs_under_load"] == [[0, 1]]
    assert preset.intra_latency == under_load["all_gather"] > 0
    assert preset.devices_per_node == 2 and "inter" not in data["measured"]
    assert preset.inter_bandwidth == preset.intra_bandwidth
    assert {t.kind for t in preset.intra_collectives} == {"all_reduce", "reduce_scatter",
                                                          "all_gather", "tree"}
    source = _with_topology(tmp_path, data)
    done = run_planc("compile", source, "-o", tmp_path / "b")
    assert done.returncode == 0, done.stderr


def test_auto_takes_the_simpler_route_within_one_percent():
    from planc.estimate.cost import Candidate
    from planc.passes.route import choose

    candidates = [Candidate(Route.RING, 30e-6, ""), Candidate(Route.TREE, 14.0001e-6, ""),
                  Candidate(Route.HIERARCHICAL, 14.00005e-6, "")]
    assert choose(candidates, "auto")[0].route == Route.TREE
    candidates[2] = Candidate(Route.HIERARCHICAL, 13.8e-6, "")  # 1.4 % faster: a real win
    assert choose(candidates, "auto")[0].route == Route.HIERARCHICAL
    candidates[1] = Candidate(Route.TREE, None, "no tree")
    assert choose(candidates, "tree") == (candidates[0], "route = tree does not apply (no "
                                                         "tree): ring")


@pytest.mark.parametrize("sizes, order, per_node", [
    (dict(tp=2, dp=4), ("tp", "cp", "pp", "dp"), 4),
    (dict(tp=2, dp=4), ("dp", "tp", "cp", "pp"), 4),
    (dict(tp=2, pp=2, dp=3), ("tp", "cp", "pp", "dp"), 3),
    (dict(tp=3, cp=2, dp=5), ("cp", "dp", "tp", "pp"), 4),
    (dict(pp=4, dp=6), ("pp", "dp", "tp", "cp"), 8),
])
def test_group_shapes_are_those_of_every_group(sizes, order, per_node):
    """The residue walk of GroupTable.shapes finds exactly the placements that walking
    every group finds."""
    from planc.plan.plan import Mesh

    mesh = Mesh(**{"tp": 1, "cp": 1, "pp": 1, "dp": 1, **sizes}, order=order)
    table = group_table(mesh, per_node, True)
    layout = table.ranks
    for rule in table.rules:
        if rule.ref == "pp":
            continue
        for stage in range(mesh.pp):
            every = {counts_of(m, per_node) for m in table.groups(rule)
                     if stage in {layout.coords(r)["pp"] for r in m}}
            shapes = table.shapes(rule.ref, stage)
            assert set(shapes) == every, (rule.ref, stage)
            assert all(counts_of(m, per_node) == c for c, m in shapes.items())


def test_ring_and_all_to_all_times_by_hand():
    """The cost model on 2 nodes of 4 (NVLink 10 GB/s 10 us, network 1 GB/s 50 us): a
    ring is bounded by its slowest link, the node with the fewest members sending over
    its NICs alone; an all-to-all keeps a rank's own 1/n."""
    from planc.estimate.cost import CostModel
    from planc.plan.mesh import Placement
    from planc.plan.topology import Device, Link, Topology

    slow = CostModel(Topology(2, 4, Device(1e12, None), Link(1e10, 1e-5), Link(1e9, 5e-5)))
    # all_gather over 3 + 1 ranks: 3 steps, 1 of them over the network; 3/4 of 1e8
    # bytes through the lone rank's one NIC
    assert slow.ring_seconds("all_gather", 1e8, Placement.of_counts((3, 1))) == \
        pytest.approx(2 * 1e-5 + 5e-5 + 0.75e8 / 1e9, rel=1e-12)
    fast = CostModel(Topology(2, 4, Device(1e12, None), Link(1e10, 1e-5), Link(1e10, 5e-5)))
    # all_reduce over 4 + 4: 14 steps, 2 over the network; four NICs a node outrun one
    # NVLink, which then bounds the ring
    assert fast.ring_seconds("all_reduce", 1e8, Placement.of_counts((4, 4))) == \
        pytest.approx(12 * 1e-5 + 2 * 5e-5 + 1.75e8 / 1e10, rel=1e-12)
    assert slow.all_to_all_seconds(8e6, Placement.within_node(4)) == \
        pytest.approx(1e-5 + 0.75 * 8e6 / 1e10, rel=1e-12)
    assert slow.all_to_all_seconds(8e6, Placement.of_counts((4, 4))) == \
        pytest.approx(5e-5 + 0.5 * 8e6 / 1e9, rel=1e-12)
