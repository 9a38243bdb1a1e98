"""The typed schema of the communication graph: every node and edge attribute, one place.

Every stage after the derivation reads and writes a ``networkx.DiGraph`` whose nodes
and edges follow this module. Meaning lives in attributes, never in node ids: a
backward step names its forward step in ``forward_of``, a recomputed step in
``recompute_of``, a transfer says what it carries in ``payload`` and over which group
in ``axis`` and ``level``. :func:`validate` checks a graph against the schema; the
tests run it after every pass, and ``planc`` runs it on every graph it reads.

This module is what the rest of planc imports: the vocabulary (enums, the attributes of
nodes and edges) lives in :mod:`planc.graph.vocabulary`, the checks of graphs read back
from untrusted files in :mod:`planc.graph.ir_validate`.

The enums are ``StrEnum`` so that a graph serialises to plain JSON strings and a
value read back compares equal to its member.

Node kinds (``type``):

- compute: one operator of one chunk, forward (F), backward (B) or recomputed (R),
  or an optimizer step over one bucket of parameters (O);
- transfer: a collective over a group, or one side of a point-to-point transfer.

Parameters live in *buckets* (``graph.graph["buckets"]``): flat buffers holding one or
more parameters at fixed offsets, padded so that a ZeRO shard is an equal slice of the
bucket, as in Megatron-LM's param-and-grad buffer. The derivation makes one bucket per
parameter; the fuse pass merges them.
"""

from __future__ import annotations

from planc.graph.ir_validate import (
    bucket_problems,
    pass_report_problems,
    validate,
)
from planc.graph.vocabulary import (
    COMMON_ATTRIBUTES,
    COMPUTE_ATTRIBUTES,
    GRAPH_FORMAT_VERSION,
    OPTIONAL,
    OPTIONAL_TYPES,
    PARAMETER_PORTS,
    PAYLOAD_ATTRIBUTES,
    TRANSFER_ATTRIBUTES,
    Axis,
    EdgeKind,
    GraphGroup,
    GroupRef,
    Kind,
    Level,
    NodeType,
    Op,
    Payload,
    Phase,
    Port,
    buckets,
    coerce,
    is_pipeline_receive,
    node_is,
    shard_numel,
    transfers,
)

__all__ = [
    "Axis", "COMMON_ATTRIBUTES", "COMPUTE_ATTRIBUTES", "EdgeKind", "GRAPH_FORMAT_VERSION",
    "GraphGroup", "GroupRef", "Kind", "Level", "NodeType", "OPTIONAL", "OPTIONAL_TYPES",
    "Op", "PARAMETER_PORTS", "PAYLOAD_ATTRIBUTES", "Payload", "Phase", "Port",
    "TRANSFER_ATTRIBUTES", "bucket_problems", "buckets", "coerce", "is_pipeline_receive", "node_is",
    "pass_report_problems", "shard_numel", "transfers", "validate",
]
