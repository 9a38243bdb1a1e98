"""Names the compiler writes into rank programs and the runtime reads back, defined
once (torch-free: the compiler, the verifier, the simulator and the runtime import it).
A block's letters (F, B) are planc.schedules.ActionKind's.

Routes (planc.estimate.cost chooses one per collective, docs/programs.md lists their recipes):
``ring`` is the backend's own collective, ``tree`` and ``hierarchical`` planc's recipes.

Streams (docs/programs.md): ``compute`` runs every compute step, ``comm`` the tensor-
and context-parallel collectives the overlap pass moves off it, ``dp`` the gradient and
parameter collectives of the buckets, ``send_*``/``recv_*`` the pipeline transfers.
"""

from __future__ import annotations

from enum import StrEnum

from planc.plan.mesh import GROUPS


class Stream(StrEnum):
    COMPUTE = "compute"
    COMM = "comm"
    DP = "dp"
    EP = "ep"  # a mixture's dispatch and combine (schedule { overlap_all_to_all })
    SEND_NEXT = "send_next"
    SEND_PREV = "send_prev"
    RECV_PREV = "recv_prev"
    RECV_NEXT = "recv_next"


STREAM_ORDER = tuple(Stream)  # the order programs declare their streams in
RECEIVE_STREAMS = (Stream.RECV_PREV, Stream.RECV_NEXT)
SEND_STREAMS = (Stream.SEND_NEXT, Stream.SEND_PREV)


class Route(StrEnum):
    RING = "ring"
    TREE = "tree"
    HIERARCHICAL = "hierarchical"


class Kind(StrEnum):
    """Transfer kinds: the collectives of semantics section 3, and point to point."""

    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    BROADCAST = "broadcast"
    SEND = "send"
    RECV = "recv"

    @property
    def is_collective(self) -> bool:
        return self not in (Kind.SEND, Kind.RECV)


class GraphGroup(StrEnum):
    """What every group the graph names knows of itself, from planc.plan.mesh's registry."""

    @property
    def mesh_axes(self) -> tuple[str, ...]:
        """The mesh axes along which members of one group differ (``tied`` is the first
        and last stage, ``stage`` every rank of a stage)."""
        return GROUPS[self.value].axes

    @property
    def within_stage(self) -> bool:
        """Every member of a group runs the same program (the group lies in one stage)."""
        return GROUPS[self.value].within_stage


# Groups of the graph, one member per group of planc.plan.mesh.GROUPS that transfers name:
# TP, CP and PP (the mesh axes); DP_CP, the ranks holding replicas of a parameter
# (dp x cp), over which gradients are reduced; TIED, the first and last stage sharing a
# tied embedding; STAGE, every rank of a stage. A new axis is a new registry entry.
Axis = GraphGroup("Axis", [(name.upper(), name) for name, kind in GROUPS.items()
                           if kind.in_graph], module=__name__)
