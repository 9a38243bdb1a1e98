"""fuse: pack per-parameter gradient and parameter collectives into flat buckets.

The derivation gives every parameter a bucket of its own, with its own reductions and
optimizer step. This pass merges buckets of one model chunk, as PyTorch DDP (Li et al.,
VLDB 2020) and Megatron-LM's param-and-grad buffer do:

- Gradients are packed in the order they become final in the backward pass (reverse
  layer order); a bucket closes once it holds ``optimize.bucket`` bytes, so it passes
  the cap by at most its last member (PyTorch DDP's rule); the first bucket of a chunk
  closes at 1 MB (DDP's first bucket) so that communication starts early.
- A bucket is one flat buffer: its members sit at fixed offsets, members whose
  gradients are partial sums over tp first (one tp all-reduce of that leading range
  sums them all), and the buffer is padded so that every ZeRO shard is an equal slice
  of the bucket, not of each parameter.
- Each bucket has one reduction over dp x cp (all-reduce, or reduce-scatter under
  ZeRO-1/2/3), one optimizer step, and under ZeRO-1/2 one all-gather of its updated
  parameters.
- Under ZeRO-3 a bucket is an FSDP unit: one layer (or the embedding, or the final
  LayerNorm and head), gathered whole once per use and phase.
- A tied embedding keeps a bucket of its own on both stages, so that its shards line
  up for the reduction between the two stages.

The result is the same computation: only the grouping of collectives changes.
"""

from __future__ import annotations

from collections import defaultdict

import networkx as nx

from planc.graph import reasons
from planc.graph.ir import Axis, EdgeKind, Kind, NodeType, Op, Payload, Phase, buckets, shard_numel
from planc.vocabulary.units import format_bytes
from planc.passes.context import PassContext, PassRecord, record

FIRST_BUCKET_BYTES = 1_000_000  # torch.distributed's _DEFAULT_FIRST_BUCKET_BYTES

# What the census counts: (label, predicate over node data).
CATEGORIES = (
    ("gradient all-reduces", lambda d: d["payload"] == Payload.GRAD and
     d["axis"] == Axis.DP_CP and d["kind"] == Kind.ALL_REDUCE),
    ("gradient reduce-scatters", lambda d: d["payload"] == Payload.GRAD and
     d["axis"] == Axis.DP_CP and d["kind"] == Kind.REDUCE_SCATTER),
    ("expert gradient all-reduces", lambda d: d["payload"] == Payload.GRAD and
     d["axis"] == Axis.EDP and d["kind"] == Kind.ALL_REDUCE),
    ("expert gradient reduce-scatters", lambda d: d["payload"] == Payload.GRAD and
     d["axis"] == Axis.EDP and d["kind"] == Kind.REDUCE_SCATTER),
    ("tp gradient sums", lambda d: d["payload"] == Payload.GRAD and d["axis"] == Axis.TP and
     d["kind"] == Kind.ALL_REDUCE),
    ("parameter all-gathers", lambda d: d["payload"] == Payload.PARAM and
     d["phase"] == Phase.OPTIMIZER),
    ("ZeRO-3 all-gathers", lambda d: d["payload"] == Payload.PARAM and
     d["phase"] != Phase.OPTIMIZER),
)


def census(graph: nx.DiGraph) -> dict[str, dict]:
    """Executions per step and bytes per step of each category, over all stages."""
    out = {label: {"count": 0, "bytes": 0} for label, _ in CATEGORIES}
    out["optimizer steps"] = {"count": 0, "bytes": 0}
    for _, data in graph.nodes(data=True):
        if data["type"] == NodeType.COMPUTE:
            if data["op"] == Op.OPTIMIZER:
                out["optimizer steps"]["count"] += 1
                out["optimizer steps"]["bytes"] += data["bytes"]
            continue
        for label, matches in CATEGORIES:
            if matches(data):
                out[label]["count"] += data["repeat"]
                out[label]["bytes"] += data["repeat"] * data["bytes"]
    return out


def _chain(graph: nx.DiGraph) -> dict[str, list[str]]:
    """Bucket id -> the nodes working on it (reductions, optimizer, gathers)."""
    nodes: dict[str, list[str]] = defaultdict(list)
    for node, data in graph.nodes(data=True):
        if "bucket" in data:
            nodes[data["bucket"]].append(node)
    return nodes


def _readiness(graph: nx.DiGraph, chain: list[str], forward: dict[str, int]) -> int:
    """When a bucket's gradient is final, as a rank: the backward runs the forward in
    reverse, so the gradient is final after the backward of its earliest forward use."""
    members = set(chain)
    # (the backward steps writing it: not the gradient clip an optimizer step waits for)
    uses = [forward.get(graph.nodes[p].get("forward_of"), 0) for node in chain
            for p in graph.predecessors(node)
            if p not in members and graph.nodes[p]["type"] == NodeType.COMPUTE and
            graph.nodes[p]["phase"] == Phase.BACKWARD]
    return -min(uses, default=0)


def zero3_unit(layer: int | None, embedding: bool) -> str:
    """The FSDP unit (ZeRO-3's gather-and-free unit, as torch's FSDP wraps a transformer
    block) that a parameter or its consumer belongs to: its layer, the embedding, or the
    head. A node name carries it without spaces (:func:`unit_tag`)."""
    if layer is not None:
        return f"layer {layer}"
    return "embedding" if embedding else "head"


def unit_tag(unit: str) -> str:
    """``layer 3`` -> ``L3``: a unit as node names write it."""
    return "L" + unit.removeprefix("layer ") if unit.startswith("layer ") else unit


def _region(graph: nx.DiGraph, bucket: dict) -> str:
    """The unit of a bucket: its first member's."""
    first = bucket["members"][0]
    return zero3_unit(first["layer"], first["param"].startswith(("embedding.", "position.")))


def _units(graph: nx.DiGraph, ids: list[str], ready: dict[str, int], cap: float,
           dtype_bytes: int) -> list[tuple[list[str], str]]:
    """Raw buckets of one chunk grouped into fused buckets, each with why it closed."""
    table = buckets(graph)
    alone = [b for b in ids if table[b]["tied"]]
    units: list[tuple[list[str], str]] = [
        ([b], "the tied embedding keeps a bucket of its own on both stages, so that its "
              "shards line up for the reduction between them") for b in alone]
    rest = sorted((b for b in ids if not table[b]["tied"]), key=lambda b: (ready[b], b))
    if rest and table[rest[0]]["zero3"]:
        regions: dict[str, list[str]] = {}
        for b in rest:
            regions.setdefault(_region(graph, table[b]), []).append(b)
        for region, members in regions.items():
            units.append((members, f"ZeRO-3 unit of the {region}: gathered whole before each "
                                   f"use, as an FSDP unit is (the bucket size does not apply)"))
        return units
    # PyTorch DDP's rule (compute_bucket_assignment_by_size in c10d's reducer.cpp): add
    # each gradient to the open bucket and close the bucket once it reaches its limit, so
    # a bucket passes the cap by at most its last member and a large gradient shares its
    # bucket with the small ones before it instead of splitting them off.
    current: list[str] = []
    size = 0.0
    limit = min(FIRST_BUCKET_BYTES, cap)
    for b in rest:
        nbytes = table[b]["numel"] * dtype_bytes
        current.append(b)
        size += nbytes
        if size < limit:
            continue
        added = f"{table[b]['members'][0]['param']} ({format_bytes(nbytes)}) brought it to " \
                f"{format_bytes(size)}"
        if limit < cap:
            why = (f"the first bucket of a chunk closes once it holds {format_bytes(limit)}, so "
                   f"that communication starts early (as PyTorch DDP's does): {added}")
        else:
            why = (f"full: {added}, at least bucket = {format_bytes(cap)} (a bucket closes once "
                   f"it reaches the cap, as PyTorch DDP's do)")
        units.append((current, why))
        current, size, limit = [], 0.0, cap
    if current:
        units.append((current, "the last gradient of the chunk"))
    return units


def _merged_bucket(graph: nx.DiGraph, raw: list[str], reason: str) -> dict:
    table = buckets(graph)
    members = [dict(m) for b in raw for m in table[b]["members"]]
    summed = {m["param"] for b in raw if table[b]["tp_sum_numel"] for m in table[b]["members"]}
    ordered = [m for m in members if m["param"] in summed] + \
        [m for m in members if m["param"] not in summed]
    offset = 0
    for m in ordered:
        m["offset"] = offset
        offset += m["numel"]
    first = table[raw[0]]
    parts = first["parts"]
    shard = shard_numel(offset, parts)
    return {**first, "members": ordered, "numel": offset, "shard": shard,
            "padded": shard * parts,
            "tp_sum_numel": sum(m["numel"] for m in ordered if m["param"] in summed),
            "reason": reason}


def _role(data: dict) -> tuple:
    """Nodes of the same role in a unit become one node; slice gathers stay per
    parameter; ZeRO-3 gathers merge per phase and unit use."""
    if data["type"] == NodeType.COMPUTE:
        return ("optimizer",)
    if data["payload"] == Payload.GRAD and data["kind"] == Kind.ALL_GATHER:
        return ("slice", data["tensor"])
    return (data["kind"], data["axis"], data["payload"], data["phase"])


def _merge(graph: nx.DiGraph, raw: list[str], bucket_id: str, bucket: dict,
           chain: dict[str, list[str]], ctx: PassContext) -> None:
    plan = ctx.plan
    nbytes = bucket["numel"] * plan.model.dtype_bytes
    groups: dict[tuple, list[str]] = defaultdict(list)
    for b in raw:
        for node in chain[b]:
            data = graph.nodes[node]
            key = _role(data)
            if data["type"] == NodeType.TRANSFER and data["payload"] == Payload.PARAM and \
                    data["phase"] != Phase.OPTIMIZER:
                key += tuple(sorted({unit_tag(_consumer_region(graph, s)) for s in
                                     graph.successors(node)}))
            groups[key].append(node)
    renamed: dict[str, str] = {}
    inside = {node for b in raw for node in chain[b]}
    producers = {p for node in inside for p in graph.predecessors(node)
                 if p not in inside and graph.nodes[p]["type"] == NodeType.COMPUTE
                 and graph.nodes[p]["phase"] == Phase.BACKWARD}
    layers = {m["layer"] for m in bucket["members"]}
    layer = layers.pop() if len(layers) == 1 else None
    for key, nodes in groups.items():
        first = graph.nodes[nodes[0]]
        if key[0] == "slice":
            # It rewrites its member's gradient in the bucket's buffer: it waits, as the
            # bucket's reduction does, for every backward step writing that buffer.
            for node in nodes:
                graph.nodes[node]["bucket"] = bucket_id
                for producer in producers:
                    graph.add_edge(producer, node, kind=EdgeKind.ORDER)
            continue
        attrs = {k: v for k, v in first.items() if k != "tensor"}
        attrs.update(bucket=bucket_id, layer=layer)
        if key[0] == "optimizer":
            name = f"O/{bucket_id}/optimizer"
            elements = bucket["shard"]
            attrs.update(params=[m["param"] for m in bucket["members"]],
                         flops=sum(graph.nodes[n]["flops"] for n in nodes),
                         bytes=elements * plan.model.dtype_bytes)
        else:
            kind, axis, payload, phase = key[:4]
            if axis == Axis.TP:
                size = bucket["tp_sum_numel"] * plan.model.dtype_bytes
            elif payload == Payload.GRAD:  # the dp or tied reduction, in the reduce dtype
                size = bucket["numel"] * plan.reduce_dtype_bytes
            else:
                size = nbytes
            kept = payload == Payload.PARAM and phase == Phase.FORWARD and \
                kept_for_backward(graph, nodes)
            attrs.update(bytes=int(size), reason=reasons.bucket(plan, bucket_id, bucket,
                                                                kind, axis, phase, kept))
            if "elements" in attrs:  # the partial sums: the bucket's leading range
                attrs["elements"] = [0, bucket["tp_sum_numel"]]
            if payload == Payload.PARAM and phase != Phase.OPTIMIZER:
                letter = "F" if phase == Phase.FORWARD else "B"
                name = f"{letter}/{bucket_id}>{key[4]}:all_gather@{axis}"
            else:
                letter = "O" if phase == Phase.OPTIMIZER else "G"
                name = f"{letter}/{bucket_id}:{kind}@{axis}"
        _replace(graph, nodes, name, attrs, renamed)


def kept_for_backward(graph: nx.DiGraph, gathers) -> bool:
    """Whether a forward's ZeRO-3 gathers (``gathers``, of one unit) are read by its
    backward too: the unit kept whole between them (planc.estimate.memory.head_unit_kept)."""
    return any(graph.nodes[s]["phase"] == Phase.BACKWARD for g in gathers
               for s in graph.successors(g))


def _consumer_region(graph: nx.DiGraph, node: str) -> str:
    """The unit of a compute step that reads a gathered parameter."""
    data = graph.nodes[node]
    return zero3_unit(data["layer"], data["op"] in (Op.EMBEDDING, Op.POSITION))


def _replace(graph: nx.DiGraph, nodes: list[str], name: str, attrs: dict,
             renamed: dict[str, str]) -> None:
    """Replace ``nodes`` by one node ``name``, keeping every outside edge."""
    inside = set(nodes)
    incoming, outgoing = {}, {}
    for node in nodes:
        for u, _, data in graph.in_edges(node, data=True):
            if u not in inside:
                incoming.setdefault(renamed.get(u, u), data)
        for _, v, data in graph.out_edges(node, data=True):
            if v not in inside:
                outgoing.setdefault(renamed.get(v, v), data)
    graph.remove_nodes_from(nodes)
    graph.add_node(name, **attrs)
    for node in nodes:
        renamed[node] = name
    for u, data in incoming.items():
        if u in graph:
            graph.add_edge(u, name, **data)
    for v, data in outgoing.items():
        if v in graph:
            graph.add_edge(name, v, **data)


def fuse(graph: nx.DiGraph, ctx: PassContext) -> nx.DiGraph:
    out = ctx.working_copy(graph)
    before = census(out)
    if not ctx.plan.optimize.fuse:
        line = "fuse: off (fuse = off): " + _headline(before, before, None)
        return record(out, PassRecord("fuse", False, line))
    table = buckets(out)
    chain = _chain(out)
    forward = {n: i for i, (n, d) in enumerate(out.nodes(data=True))
               if d["type"] == NodeType.COMPUTE and d["phase"] == Phase.FORWARD}
    ready = {b: _readiness(out, chain[b], forward) for b in table}
    # A bucket is reduced over one group: the experts split over ep (reduced over their
    # replicas, edp) are packed apart from the rest (Megatron-Core's expert buffers).
    by_chunk: dict[tuple[int, str], list[str]] = defaultdict(list)
    for b, info in table.items():
        by_chunk[(info["chunk"], info.get("over", ""))].append(b)
    decisions = []
    merged: dict[str, dict] = {}
    plan = ctx.plan
    for chunk, over in sorted(by_chunk):
        units = _units(out, by_chunk[(chunk, over)], ready, plan.optimize.bucket,
                       plan.model.dtype_bytes)
        for index, (raw, why) in enumerate(units):
            bucket_id = f"c{chunk}.{'e' if over else 'b'}{index}"
            bucket = _merged_bucket(out, raw, why)
            merged[bucket_id] = bucket
            # Work on the raw chain with the merged layout in place.
            table[bucket_id] = bucket
            _merge(out, raw, bucket_id, bucket, chain, ctx)
            decisions.append({"bucket": bucket_id, "stage": bucket["stage"],
                              "members": [m["param"] for m in bucket["members"]],
                              "bytes": bucket["numel"] * plan.model.dtype_bytes,
                              "padding": bucket["padded"] - bucket["numel"], "closed": why})
    out.graph["buckets"] = merged
    after = census(out)
    sizes = [d["bytes"] for d in decisions]
    changes = [{"what": label, "before": before[label], "after": after[label]}
               for label in before if before[label]["count"]]
    line = "fuse: " + _headline(before, after, sizes)
    return record(out, PassRecord("fuse", True, line, changes, decisions))


def _headline(before: dict, after: dict, sizes: list[float] | None) -> str:
    """'53 gradient all-reduces -> 2; 53 optimizer steps -> 2 (2 buckets: 1 MB, 15.9 MB)'."""
    parts = [f"{before[label]['count']} {label}" + (
        f" -> {after[label]['count']}" if sizes is not None else "")
        for label in before if before[label]["count"]]
    text = "; ".join(parts) or "nothing to fuse"
    if sizes:
        shown = ", ".join(format_bytes(s) for s in sizes[:4])
        more = f", ... {len(sizes) - 4} more" if len(sizes) > 4 else ""
        text += f" ({len(sizes)} buckets: {shown}{more})"
    return text
