"""Ranks, coordinates, groups and nodes of the 4-D mesh (planc/plan/layout.py).

Every expectation here is computed independently of planc: by a mixed-radix reading
written in this file, by brute force over coordinates, or by hand (the spec's example
and the examples in the docstrings of Megatron-LM's megatron/core/parallel_state.py,
whose RankGenerator reads an order string such as "tp-cp-ep-dp-pp" fastest axis first).
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from collections import Counter
from math import prod

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planc.lang import load_file
from planc.plan.layout import Layout
from planc.plan.plan import Mesh
from tests.conftest import PLANS, ROOT

AXES = ("tp", "cp", "pp", "dp")
GROUP_AXES = {"tp": ("tp",), "cp": ("cp",), "pp": ("pp",), "dp": ("dp",), "dp_cp": ("dp", "cp")}


# --- an independent model of the mesh ------------------------------------------------

def ref_coords(rank: int, sizes: dict[str, int], order) -> dict[str, int]:
    """Digits of ``rank`` in the mixed radix of ``order``, first axis fastest."""
    coords = {}
    for axis in order:
        rank, coords[axis] = divmod(rank, sizes[axis])
    assert rank == 0
    return coords


def ref_rank(coords: dict[str, int], sizes: dict[str, int], order) -> int:
    """Horner's rule from the slowest axis down."""
    rank = 0
    for axis in reversed(order):
        rank = rank * sizes[axis] + coords[axis]
    return rank


def ref_groups(sizes: dict[str, int], order, axes) -> list[list[int]]:
    """Brute force: bucket every rank by its coordinates on the axes *not* in ``axes``."""
    world = prod(sizes.values())
    buckets: dict[tuple, list[int]] = {}
    for r in range(world):
        c = ref_coords(r, sizes, order)
        buckets.setdefault(tuple(c[a] for a in AXES if a not in axes), []).append(r)
    return sorted(sorted(g) for g in buckets.values())


def megatron_groups(sizes: dict[str, int], order, axes) -> list[list[int]]:
    """Megatron's masked orthogonal rank groups, rewritten: group index over the
    unmasked axes and rank-in-group over the masked axes, both read fastest-first."""
    strides, step = {}, 1
    for axis in order:
        strides[axis] = step
        step *= sizes[axis]
    masked = [a for a in order if a in axes]
    unmasked = [a for a in order if a not in axes]

    def digits(index, names):
        out = []
        for a in names:
            index, d = divmod(index, sizes[a])
            out.append(d)
        return out

    groups = []
    for g in range(prod(sizes[a] for a in unmasked)):
        base = sum(d * strides[a] for d, a in zip(digits(g, unmasked), unmasked))
        groups.append([base + sum(d * strides[a] for d, a in zip(digits(i, masked), masked))
                       for i in range(prod(sizes[a] for a in masked))])
    return groups


# --- property tests --------------------------------------------------------------------

def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def layouts(draw):
    sizes = draw(st.tuples(*[st.integers(1, 6)] * 4).filter(lambda s: prod(s) <= 512))
    order = tuple(draw(st.permutations(AXES)))
    world = prod(sizes)
    per_node = draw(st.sampled_from(_divisors(world)))
    return dict(zip(AXES, sizes)), order, per_node


def _make(sizes, order, per_node) -> Layout:
    return Layout(Mesh(sizes["tp"], sizes["cp"], sizes["pp"], sizes["dp"], order), per_node)


PROPERTY = settings(max_examples=150, deadline=None)


@PROPERTY
@given(layouts())
def test_groups_partition_the_world(case):
    sizes, order, per_node = case
    layout = _make(sizes, order, per_node)
    world = prod(sizes.values())
    for axis, axes in GROUP_AXES.items():
        groups = layout.groups(axis)
        counts = Counter(r for g in groups for r in g)
        assert sorted(counts) == list(range(world)), axis
        assert set(counts.values()) == {1}, axis
        size = prod(sizes[a] for a in axes)
        assert len(groups) == world // size
        assert all(len(g) == size for g in groups)


@PROPERTY
@given(layouts())
def test_each_group_varies_exactly_its_axes(case):
    sizes, order, per_node = case
    layout = _make(sizes, order, per_node)
    for axis, axes in GROUP_AXES.items():
        for group in layout.groups(axis):
            coords = [ref_coords(r, sizes, order) for r in group]
            for other in AXES:
                if other not in axes:
                    assert len({c[other] for c in coords}) == 1, (axis, other, group)
            seen = sorted(tuple(c[a] for a in axes) for c in coords)
            assert seen == sorted(itertools.product(*[range(sizes[a]) for a in axes]))


@PROPERTY
@given(layouts())
def test_group_of_a_rank_is_the_group_that_contains_it(case):
    sizes, order, per_node = case
    layout = _make(sizes, order, per_node)
    for axis, axes in GROUP_AXES.items():
        expected = {r: tuple(g) for g in ref_groups(sizes, order, axes) for r in g}
        for r in range(prod(sizes.values())):
            assert layout.group(r, axis) == expected[r]


@PROPERTY
@given(layouts())
def test_rank_and_coords_are_inverse_and_in_range(case):
    sizes, order, per_node = case
    layout = _make(sizes, order, per_node)
    world = prod(sizes.values())
    for r in range(world):
        c = layout.coords(r)
        assert set(c) == set(AXES)
        assert all(0 <= c[a] < sizes[a] for a in AXES)
        assert layout.rank(c) == r
    for r in (-1, world):
        with pytest.raises(ValueError):
            layout.coords(r)


@PROPERTY
@given(layouts())
def test_default_order_is_the_specs_formula(case):
    sizes, _, per_node = case
    layout = _make(sizes, AXES, per_node)
    tp, cp, pp = sizes["tp"], sizes["cp"], sizes["pp"]
    for r in range(prod(sizes.values())):
        c = layout.coords(r)
        assert r == c["tp"] + tp * (c["cp"] + cp * (c["pp"] + pp * c["dp"]))
    for t, c_, p, d in itertools.product(*[range(sizes[a]) for a in AXES]):
        assert layout.rank({"tp": t, "cp": c_, "pp": p, "dp": d}) == t + tp * (c_ + cp * (p + pp * d))


@PROPERTY
@given(layouts())
def test_coords_are_the_mixed_radix_digits_of_the_order(case):
    sizes, order, per_node = case
    layout = _make(sizes, order, per_node)
    for r in range(prod(sizes.values())):
        expected = ref_coords(r, sizes, order)
        assert layout.coords(r) == expected
        assert ref_rank(expected, sizes, order) == r
    # Adjacent ranks differ in the first axis of the order (when it has size > 1).
    first = next((a for a in order if sizes[a] > 1), None)
    if first is not None:
        c0, c1 = layout.coords(0), layout.coords(1)
        assert [a for a in AXES if c0[a] != c1[a]] == [first]


@PROPERTY
@given(layouts())
def test_groups_are_sorted_and_match_megatron(case):
    sizes, order, per_node = case
    layout = _make(sizes, order, per_node)
    for axis, axes in GROUP_AXES.items():
        groups = [list(g) for g in layout.groups(axis)]
        for g in groups:
            assert g == sorted(g) and len(set(g)) == len(g)
        leaders = [g[0] for g in groups]
        assert leaders == sorted(leaders) and len(set(leaders)) == len(leaders)
        assert groups == ref_groups(sizes, order, axes)
        assert groups == [sorted(g) for g in megatron_groups(sizes, order, axes)]


@PROPERTY
@given(layouts())
def test_nodes_and_placement(case):
    sizes, order, per_node = case
    layout = _make(sizes, order, per_node)
    world = prod(sizes.values())
    assert layout.nodes == world // per_node
    for r in range(world):
        assert layout.node(r) == r // per_node
    for axis, axes in GROUP_AXES.items():
        groups = ref_groups(sizes, order, axes)
        all_on_one_node = all(len({r // per_node for r in g}) == 1 for g in groups)
        at_most_one_per_node = all(len({r // per_node for r in g}) == len(g) for g in groups)
        placement = layout.placement(axis)
        assert placement.count == len(groups)
        assert placement.size == prod(sizes[a] for a in axes)
        assert (placement.kind == "intra-node") == all_on_one_node
        assert (placement.kind == "inter-node") == (at_most_one_per_node and not all_on_one_node)
        assert (placement.kind == "mixed") == (not all_on_one_node and not at_most_one_per_node)
        per_node_counts = {c for g in groups for c in Counter(r // per_node for r in g).values()}
        assert placement.ranks_per_node == tuple(sorted(per_node_counts))


# --- golden tests ------------------------------------------------------------------------

def test_the_specs_example_tp2_pp2_dp2_on_two_nodes_of_four():
    plan = load_file(PLANS / "gpt-tiny.plan").plan
    layout = Layout.of(plan)
    assert layout.world == 8 and layout.devices_per_node == 4 and layout.nodes == 2
    # r = tp_i + 2 * (pp_i + 2 * dp_i)
    assert [tuple(layout.coords(r)[a] for a in AXES) for r in range(8)] == [
        (0, 0, 0, 0), (1, 0, 0, 0), (0, 0, 1, 0), (1, 0, 1, 0),
        (0, 0, 0, 1), (1, 0, 0, 1), (0, 0, 1, 1), (1, 0, 1, 1)]
    assert layout.groups("tp") == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert layout.groups("cp") == [(0,), (1,), (2,), (3,), (4,), (5,), (6,), (7,)]
    assert layout.groups("pp") == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert layout.groups("dp") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert layout.groups("dp_cp") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert [layout.node(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert layout.placement("tp").kind == "intra-node"
    assert layout.placement("pp").kind == "intra-node"
    assert layout.placement("cp").kind == "intra-node"
    assert layout.placement("dp").kind == "inter-node"
    assert layout.placement("dp_cp").kind == "inter-node"
    assert layout.placement("dp").ranks_per_node == (1,)
    assert layout.placement("tp").ranks_per_node == (2,)


def test_order_dp_tp_cp_pp_by_hand():
    # tp 2, cp 2, pp 2, dp 3 with order [dp, tp, cp, pp]: strides dp 1, tp 3, cp 6, pp 12,
    # so r = dp_i + 3 tp_i + 6 cp_i + 12 pp_i over 24 ranks, 4 nodes of 6.
    layout = Layout(Mesh(tp=2, cp=2, pp=2, dp=3, order=("dp", "tp", "cp", "pp")), 6)
    assert layout.coords(0) == {"tp": 0, "cp": 0, "pp": 0, "dp": 0}
    assert layout.coords(1) == {"tp": 0, "cp": 0, "pp": 0, "dp": 1}
    assert layout.coords(3) == {"tp": 1, "cp": 0, "pp": 0, "dp": 0}
    assert layout.coords(6) == {"tp": 0, "cp": 1, "pp": 0, "dp": 0}
    assert layout.coords(12) == {"tp": 0, "cp": 0, "pp": 1, "dp": 0}
    assert layout.coords(23) == {"tp": 1, "cp": 1, "pp": 1, "dp": 2}
    assert layout.coords(17) == {"tp": 1, "cp": 0, "pp": 1, "dp": 2}  # 17 = 2 + 3 + 12
    assert layout.rank({"tp": 1, "cp": 1, "pp": 0, "dp": 2}) == 11
    assert layout.groups("dp") == [(0, 1, 2), (3, 4, 5), (6, 7, 8), (9, 10, 11),
                                   (12, 13, 14), (15, 16, 17), (18, 19, 20), (21, 22, 23)]
    assert layout.groups("tp") == [(0, 3), (1, 4), (2, 5), (6, 9), (7, 10), (8, 11),
                                   (12, 15), (13, 16), (14, 17), (18, 21), (19, 22), (20, 23)]
    assert layout.groups("cp") == [(0, 6), (1, 7), (2, 8), (3, 9), (4, 10), (5, 11),
                                   (12, 18), (13, 19), (14, 20), (15, 21), (16, 22), (17, 23)]
    assert layout.groups("pp") == [(0, 12), (1, 13), (2, 14), (3, 15), (4, 16), (5, 17),
                                   (6, 18), (7, 19), (8, 20), (9, 21), (10, 22), (11, 23)]
    assert layout.groups("dp_cp") == [(0, 1, 2, 6, 7, 8), (3, 4, 5, 9, 10, 11),
                                      (12, 13, 14, 18, 19, 20), (15, 16, 17, 21, 22, 23)]
    # Nodes of 6: dp and tp stay inside a node; cp and pp cross nodes.
    assert layout.placement("dp").kind == "intra-node"
    assert layout.placement("tp").kind == "intra-node"
    assert layout.placement("cp").kind == "inter-node"
    assert layout.placement("pp").kind == "inter-node"
    # dp_cp = {0,1,2} on node 0 and {6,7,8} on node 1: three members per node.
    assert layout.placement("dp_cp").kind == "mixed"
    assert layout.placement("dp_cp").ranks_per_node == (3,)


def test_megatron_initialize_model_parallel_docstring_example():
    # parallel_state.initialize_model_parallel: 16 GPUs, tp 2, pp 4 (so dp 2), default
    # order "tp-cp-ep-dp-pp", i.e. planc's order [tp, cp, dp, pp].
    layout = Layout(Mesh(tp=2, cp=1, pp=4, dp=2, order=("tp", "cp", "dp", "pp")), 8)
    assert layout.groups("dp") == [(0, 2), (1, 3), (4, 6), (5, 7), (8, 10), (9, 11),
                                   (12, 14), (13, 15)]
    assert layout.groups("tp") == [(0, 1), (2, 3), (4, 5), (6, 7), (8, 9), (10, 11),
                                   (12, 13), (14, 15)]
    assert layout.groups("pp") == [(0, 4, 8, 12), (1, 5, 9, 13), (2, 6, 10, 14),
                                   (3, 7, 11, 15)]


def test_megatron_masked_orthogonal_groups_docstring_example():
    # generate_masked_orthogonal_rank_groups: order tp-dp-pp, sizes [2, 3, 4], dp mask.
    layout = Layout(Mesh(tp=2, cp=1, pp=4, dp=3, order=("tp", "dp", "pp", "cp")), 24)
    assert layout.groups("dp") == [(0, 2, 4), (1, 3, 5), (6, 8, 10), (7, 9, 11),
                                   (12, 14, 16), (13, 15, 17), (18, 20, 22), (19, 21, 23)]
    # ... and order tp-pp-dp, sizes 2-2-2: dp groups [[0, 4], [1, 5], [2, 6], [3, 7]].
    layout = Layout(Mesh(tp=2, cp=1, pp=2, dp=2), 8)
    assert layout.groups("dp") == [(0, 4), (1, 5), (2, 6), (3, 7)]


def test_megatron_context_parallel_docstring_example():
    # initialize_model_parallel, context_parallel_size: 8 GPUs, tp 4, cp 2: cp groups
    # [GPU0, GPU4], [GPU1, GPU5], [GPU2, GPU6], [GPU3, GPU7].
    layout = Layout(Mesh(tp=4, cp=2), 8)
    assert layout.groups("cp") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert layout.groups("tp") == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert layout.groups("dp_cp") == [(0, 4), (1, 5), (2, 6), (3, 7)]


# --- planc layout --json ---------------------------------------------------------------

JSON_PLAN = """\
plan layout_json {
  model gpt { layers = 3; hidden = 16; heads = 2; vocab = 32; seq = 8; batch = 4 }
  mesh { tp = 2; cp = 2; pp = 3; dp = 2; order = [pp, dp, tp, cp] }
  topology { nodes = 4; devices_per_node = 6 }
}
"""


def test_layout_json_from_the_command_line(tmp_path):
    path = tmp_path / "layout.plan"
    path.write_text(JSON_PLAN)
    done = subprocess.run([sys.executable, "-m", "planc", "layout", str(path), "--json"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    sizes = {"tp": 2, "cp": 2, "pp": 3, "dp": 2}
    order = ["pp", "dp", "tp", "cp"]
    world, per_node = 24, 6
    # The keys asked for, plus the documented format version, node shape and placement.
    assert set(doc) == {"world", "order", "sizes", "ranks", "groups",
                        "version", "nodes", "devices_per_node", "placement"}
    assert doc["world"] == world
    assert doc["order"] == order
    assert doc["sizes"] == sizes
    assert (doc["version"], doc["nodes"], doc["devices_per_node"]) == (1, 4, 6)
    assert [entry["rank"] for entry in doc["ranks"]] == list(range(world))
    for entry in doc["ranks"]:
        assert set(entry) == {"rank", "coords", "node"}
        assert entry["coords"] == ref_coords(entry["rank"], sizes, order)
        assert entry["node"] == entry["rank"] // per_node
    # Spot check by hand: strides pp 1, dp 3, tp 6, cp 12; 17 = 2 + 3 + 12.
    assert doc["ranks"][17]["coords"] == {"tp": 0, "cp": 1, "pp": 2, "dp": 1}
    assert set(doc["groups"]) == {"tp", "cp", "pp", "dp", "dp_cp", "stage"}
    for axis, axes in {**GROUP_AXES, "stage": ("tp", "cp", "dp")}.items():
        assert doc["groups"][axis] == ref_groups(sizes, order, axes), axis
    assert doc["groups"]["pp"][:3] == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert doc["groups"]["dp_cp"][0] == [0, 3, 12, 15]
    assert set(doc["placement"]) == {*GROUP_AXES, "stage"}
    # pipeline stage 0: every rank with pp 0 (pp varies fastest: multiples of 3)
    assert doc["groups"]["stage"][0] == list(range(0, 24, 3))
    assert doc["placement"]["pp"]["kind"] == "intra-node"
    assert doc["placement"]["cp"]["kind"] == "inter-node"


# --- a large mesh ----------------------------------------------------------------------

def test_16384_rank_layout():
    # tp 8, cp 2, pp 16, dp 64 = 16,384 ranks on 2,048 nodes of 8, default order.
    layout = Layout(Mesh(tp=8, cp=2, pp=16, dp=64), 8)
    assert layout.world == 16384 and layout.nodes == 2048
    counts = {axis: len(layout.groups(axis)) for axis in GROUP_AXES}
    assert counts == {"tp": 2048, "cp": 8192, "pp": 1024, "dp": 256, "dp_cp": 128}
    # 12345 = 1 + 8 * (1 + 2 * (3 + 16 * 48)): tp 1, cp 1, pp 3, dp 48.
    assert layout.coords(12345) == {"tp": 1, "cp": 1, "pp": 3, "dp": 48}
    assert layout.rank({"tp": 1, "cp": 1, "pp": 3, "dp": 48}) == 12345
    assert layout.group(12345, "tp") == (12344, 12345, 12346, 12347, 12348, 12349, 12350,
                                         12351)
    assert layout.group(12345, "cp") == (12337, 12345)
    # pp stride 16, base 12345 - 3 * 16 = 12297; dp stride 256, base 12345 - 48 * 256 = 57.
    assert layout.group(12345, "pp") == tuple(12297 + 16 * k for k in range(16))
    assert layout.group(12345, "dp") == tuple(57 + 256 * k for k in range(64))
    assert layout.group(12345, "dp_cp") == tuple(sorted(49 + 8 * c + 256 * d
                                                        for c in range(2) for d in range(64)))
    assert layout.groups("dp")[-1] == tuple(255 + 256 * k for k in range(64))
    assert layout.groups("tp")[2047] == tuple(range(16376, 16384))
    assert layout.placement("tp").kind == "intra-node"
    assert layout.placement("dp").kind == "inter-node"
    assert layout.placement("cp").kind == "inter-node"


# --- the stage group, and tp groups that span nodes ----------------------------------------


@PROPERTY
@given(layouts())
def test_stage_groups_are_the_ranks_of_one_pipeline_stage(case):
    sizes, order, per_node = case
    layout = _make(sizes, order, per_node)
    groups = layout.groups("stage")
    assert [list(g) for g in groups] == ref_groups(sizes, order, ("tp", "cp", "dp"))
    assert sorted(len({layout.coords(r)["pp"] for r in g}) for g in groups) == \
        [1] * len(groups)


@PROPERTY
@given(layouts())
def test_the_first_tp_group_that_spans_nodes_is_found(case):
    from planc.lang.group_spans import crossing_tp_group

    sizes, order, per_node = case
    layout = _make(sizes, order, per_node)
    spanning = [g for g in ref_groups(sizes, order, ("tp",))
                if len({r // per_node for r in g}) > 1]
    assert crossing_tp_group(layout) == (tuple(spanning[0]) if spanning else None)
    assert (crossing_tp_group(layout) is None) == (layout.placement("tp").kind == "intra-node")


def test_a_tp_group_straddling_two_nodes_is_found():
    """tp first, but nodes of 6 cut the tp groups of 4 at ranks 4..7."""
    from planc.lang.group_spans import crossing_tp_group

    assert crossing_tp_group(Layout(Mesh(tp=4, dp=3), 6)) == (4, 5, 6, 7)
    assert crossing_tp_group(Layout(Mesh(tp=4, dp=3), 12)) is None


def test_layout_lists_the_stage_group_and_says_what_stage_means(run_planc):
    done = run_planc("layout", PLANS / "gpt-tiny.plan")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    at = lines.index("group  size  groups  placement   ranks/node  group of rank 0")
    assert lines[at + 7:at + 10] == [
        "stage     4       2  mixed       2           [0, 1, 4, 5]",
        "stage: every rank of one pipeline stage (tp x cp x dp), a row of the memory table; "
        "compile and explain name the loss's all-reduce over it",
        ""]
    assert lines[at + 10].startswith("memory per device")


TP_ACROSS_NODES = """\
plan tp_across {
  model gpt { layers = 2; hidden = 64; heads = 4; vocab = 256; seq = 32; batch = 8 }
  mesh { tp = 2; dp = 2; order = [dp, tp, cp, pp] }
  topology { nodes = 2; devices_per_node = 2 }
}
"""
TP_ACROSS_NODES_WARNING = """\
tp.plan:3:15: warning: tp group [0, 2] spans nodes 0 and 1: the tensor-parallel all-reduces \
of every layer cross the inter-node link
   3 |   mesh { tp = 2; dp = 2; order = [dp, tp, cp, pp] }
     |               ^
  hint: estimated 181 us per step on each device for 8 all-reduces of 32.8 KB (2 per layer \
in the forward and 2 in the backward, per microbatch), against 82.6 us inside one node, 2.2 \
times as long
  hint: put tp first in the mesh order (order = [tp, dp, cp, pp]), so that each tp group is \
2 consecutive ranks of one node, as Megatron-LM places them
1 warning generated.
"""


def test_a_tp_group_across_nodes_is_a_warning_with_its_cost(tmp_path, run_planc):
    (tmp_path / "tp.plan").write_text(TP_ACROSS_NODES)
    env = {**os.environ, "NO_COLOR": "1"}
    check = run_planc("check", "tp.plan", cwd=tmp_path, env=env)
    assert (check.returncode, check.stderr) == (0, TP_ACROSS_NODES_WARNING)
    assert check.stdout.startswith("tp.plan: ok: plan tp_across, ")
    compiled = run_planc("compile", "tp.plan", "-o", tmp_path / "build", cwd=tmp_path, env=env)
    assert compiled.returncode == 0
    assert compiled.stderr.startswith(TP_ACROSS_NODES_WARNING)
    # Nodes smaller than tp: no order keeps a tp group on one node.
    small = run_planc("check", "tp.plan", "--set", "mesh.order=[tp, cp, pp, dp]", "--set",
                      "topology.devices_per_node=1", "--set", "topology.nodes=4", cwd=tmp_path,
                      env=env)
    assert small.returncode == 0
    assert small.stderr.splitlines()[-2] == (
        "  hint: a node has 1 device and a tp group 2: use nodes of 2 or more devices "
        "(devices_per_node) or a smaller tp, as Megatron-LM keeps tensor parallelism inside "
        "a node")
    # Megatron's placement, tp first: no warning.
    megatron = run_planc("check", "tp.plan", "--set", "mesh.order=[tp, cp, pp, dp]",
                         cwd=tmp_path, env=env)
    assert (megatron.returncode, megatron.stderr) == (0, "")


def test_the_text_on_every_stage_colour_reads_at_wcags_aa_ratio():
    """White 9 px text on a Tableau teal read at 2.6:1; the ink is now whichever of black
    and white contrasts more by WCAG 2's relative luminance, which is always at least
    4.5:1 (AA) on any colour, for a few stages and for thousands (hsl() tones)."""
    from planc.views.rank_picture import TABLEAU_10, _text_on, contrast, stage_colours

    assert contrast("#000", "#fff") == 21.0 and contrast("#777", "#777") == 1.0
    assert _text_on("#76b7b2") == "#000" and _text_on("#333333") == "#fff"
    colours = [*TABLEAU_10, *stage_colours(64), *stage_colours(5000)[:100]]
    assert min(contrast(c, _text_on(c)) for c in colours) >= 4.5
