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


class Stream(StrEnum):
    COMPUTE = "compute"
    COMM = "comm"
    DP = "dp"
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
