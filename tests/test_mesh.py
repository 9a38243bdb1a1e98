"""The mesh registry (planc/plan/mesh.py) against groups worked out by hand.

Every list below was written from the mixed-radix rule on paper (the order's first axis
varies fastest), not computed by planc: ranks ``r = tp + 2 cp + 4 pp + 8 dp`` for the
default order of a 2 x 2 x 2 x 2 mesh, ``r = pp + 2 tp + 4 dp + 8 cp`` for the order
pp, tp, dp, cp, with 4 devices per node (node n holds ranks 4n .. 4n + 3).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from planc.plan import mesh as mesh_module
from planc.plan.mesh import AXES, GROUPS, LAYOUT_GROUPS, PlacedAxis, RankMesh, sub_group

TWOS = {"tp": 2, "cp": 2, "pp": 2, "dp": 2}
DEFAULT = RankMesh.of(TWOS, AXES, devices_per_node=4)
REORDERED = RankMesh.of(TWOS, ("pp", "tp", "dp", "cp"), devices_per_node=4)


def test_the_registry_lists_the_axes_and_groups_in_their_order():
    assert AXES == ("tp", "cp", "pp", "dp")
    assert list(GROUPS) == ["tp", "cp", "pp", "dp", "dp_cp", "tied", "stage", "ep", "edp",
                            "sequence", "world"]
    assert LAYOUT_GROUPS == ("tp", "cp", "pp", "dp", "dp_cp")
    assert GROUPS["dp_cp"].axes == ("dp", "cp")
    assert GROUPS["stage"].axes == ("tp", "cp", "dp")
    assert GROUPS["tied"].axes == ("pp",)
    assert [n for n, g in GROUPS.items() if g.in_graph] == \
        ["tp", "cp", "pp", "dp_cp", "tied", "stage", "ep", "edp", "world"]
    assert [n for n, g in GROUPS.items() if g.within_stage] == \
        ["tp", "cp", "dp", "dp_cp", "stage", "ep", "edp", "sequence"]
    assert GROUPS["sequence"].axes == ("tp", "cp")
    assert GROUPS["world"].axes == ("tp", "cp", "pp", "dp")
    assert [(n, g.experts) for n, g in GROUPS.items() if g.experts] == \
        [("ep", "runs"), ("edp", "across")]
    assert GROUPS["tied"].coordinates({"pp": 4}) == {"pp": (0, 3)}
    assert GROUPS["tp"].coordinates({"tp": 4}) == {}


def test_axes_know_their_degree_position_and_stride():
    assert DEFAULT.axes == (PlacedAxis("tp", 2, 0, 1), PlacedAxis("cp", 2, 1, 2),
                            PlacedAxis("pp", 2, 2, 4), PlacedAxis("dp", 2, 3, 8))
    assert REORDERED.axes == (PlacedAxis("tp", 2, 1, 2), PlacedAxis("cp", 2, 3, 8),
                              PlacedAxis("pp", 2, 0, 1), PlacedAxis("dp", 2, 2, 4))
    assert list(REORDERED.strides) == ["pp", "tp", "dp", "cp"]  # the plan's order
    assert (DEFAULT.world, DEFAULT.nodes) == (16, 4)
    assert REORDERED.coords(13) == {"tp": 0, "cp": 1, "pp": 1, "dp": 1}
    assert REORDERED.rank({"tp": 0, "cp": 1, "pp": 1, "dp": 1}) == 13
    assert DEFAULT.coords(13) == {"tp": 1, "cp": 0, "pp": 1, "dp": 1}


DEFAULT_GROUPS = {
    "tp": [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]],
    "cp": [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]],
    "pp": [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]],
    "dp": [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]],
    "dp_cp": [[0, 2, 8, 10], [1, 3, 9, 11], [4, 6, 12, 14], [5, 7, 13, 15]],
    "tied": [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]],
    "stage": [[0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]],
}
REORDERED_GROUPS = {
    "tp": [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]],
    "cp": [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]],
    "pp": [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]],
    "dp": [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]],
    "dp_cp": [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]],
    "tied": [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]],
    "stage": [[0, 2, 4, 6, 8, 10, 12, 14], [1, 3, 5, 7, 9, 11, 13, 15]],
}


@pytest.mark.parametrize("ranks, expected", [(DEFAULT, DEFAULT_GROUPS),
                                             (REORDERED, REORDERED_GROUPS)])
def test_every_group_of_every_kind(ranks, expected):
    for kind, groups in expected.items():
        assert [list(g) for g in ranks.groups(kind)] == groups, kind
        for group in groups:
            for rank in group:
                assert list(ranks.group(rank, kind)) == group


def test_intra_and_inter_node_sub_groups():
    assert [list(g) for g in DEFAULT.level_groups("dp_cp", "intra")] == \
        [[0, 2], [8, 10], [1, 3], [9, 11], [4, 6], [12, 14], [5, 7], [13, 15]]
    assert [list(g) for g in DEFAULT.level_groups("dp_cp", "inter")] == \
        [[0, 8], [2, 10], [1, 9], [3, 11], [4, 12], [6, 14], [5, 13], [7, 15]]
    assert [list(g) for g in DEFAULT.level_groups("stage", "intra")] == \
        [[0, 1, 2, 3], [8, 9, 10, 11], [4, 5, 6, 7], [12, 13, 14, 15]]
    assert [list(g) for g in DEFAULT.level_groups("stage", "inter")] == \
        [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]]
    # Reordered, a dp_cp group has one member per node: intra is each rank alone.
    assert [list(g) for g in REORDERED.level_groups("dp_cp", "intra")] == \
        [[r] for r in (0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15)]
    assert [list(g) for g in REORDERED.level_groups("dp_cp", "inter")] == \
        REORDERED_GROUPS["dp_cp"]
    assert [list(g) for g in REORDERED.level_groups("stage", "intra")] == \
        [[0, 2], [4, 6], [8, 10], [12, 14], [1, 3], [5, 7], [9, 11], [13, 15]]
    assert [list(g) for g in REORDERED.level_groups("stage", "inter")] == \
        [[0, 4, 8, 12], [2, 6, 10, 14], [1, 5, 9, 13], [3, 7, 11, 15]]
    assert DEFAULT.level_group(10, "dp_cp", "inter") == (2, 10)
    assert DEFAULT.level_group(10, "dp_cp", "whole") == (0, 2, 8, 10)
    # Uneven nodes: 3 members on node 0, 1 on node 1; local index 1 exists on node 0 only.
    assert sub_group((1, 2, 3, 4), 2, "inter", 4) == (2,)
    assert sub_group((1, 2, 3, 4), 4, "inter", 4) == (1, 4)
    with pytest.raises(ValueError):
        sub_group((0, 1), 0, "across", 4)


def test_ring_neighbours():
    assert DEFAULT.ring_neighbours(0) == (2, 2)
    assert REORDERED.ring_neighbours(3) == (11, 11)
    ring = RankMesh.of({"tp": 2, "cp": 4}, AXES, 8)  # r = tp + 2 cp
    assert [ring.ring_neighbours(r) for r in (1, 3, 5, 7)] == \
        [(7, 3), (1, 5), (3, 7), (5, 1)]
    assert ring.ring_neighbours(2, "tp") == (3, 3)
    assert (ring.ring_peer(7, "next"), ring.ring_peer(7, "prev")) == (1, 5)
    with pytest.raises(ValueError):
        ring.ring_peer(7, "left")


def test_stages_and_pipeline_peers():
    assert [DEFAULT.first_rank_of_stage(s) for s in (0, 1)] == [0, 4]
    assert [REORDERED.first_rank_of_stage(s) for s in (0, 1)] == [0, 1]
    assert DEFAULT.pipeline_column(3) == [3, 7]
    assert DEFAULT.pipeline_column(15) == [11, 15] == DEFAULT.pipeline_column(11)
    assert REORDERED.pipeline_column(6) == [6, 7]
    assert DEFAULT.pipeline_neighbours(5) == (1, None)
    assert DEFAULT.pipeline_neighbours(1) == (None, 5)
    assert DEFAULT.pipeline_neighbours(5, wrap=True) == (1, 1)
    deep = RankMesh.of({"pp": 4, "dp": 2}, AXES, 4)  # r = pp + 4 dp
    assert deep.pipeline_neighbours(6) == (5, 7)
    assert deep.pipeline_neighbours(7, wrap=True) == (6, 4)
    assert [list(g) for g in deep.groups("tied")] == [[0, 3], [4, 7]]
    assert deep.group(5, "tied") == ()
    assert deep.stage_of(6) == 2


def test_rejects_what_is_not_a_mesh():
    with pytest.raises(ValueError):
        RankMesh.of(TWOS, ("tp", "cp", "pp"))
    with pytest.raises(ValueError):
        RankMesh.of({"tp": 0})
    with pytest.raises(ValueError):
        DEFAULT.coords(16)


def test_imports_only_the_standard_library():
    """The bottom of the compiler: importing it loads no other planc module."""
    code = ("import sys, planc.plan.mesh; "
            "print(sorted(m for m in sys.modules if m.startswith('planc')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "['planc', 'planc.plan', 'planc.plan.mesh']"
    assert mesh_module.__name__ == "planc.plan.mesh"
