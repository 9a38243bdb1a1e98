"""``train { grad_clip = C }``: the global gradient norm as steps and a transfer of the graph.

``torch.nn.utils.clip_grad_norm_(parameters, C)`` on one process computes
``total = ||(||g_p||_2)_p||_2``, the square root of the sum of every gradient element's
square, then ``coef = C / (total + 1e-6)`` and multiplies every gradient by
``min(coef, 1)``. Distributed, each parameter's gradient lies in pieces (tp slices,
ZeRO shards, an expert's ep rows) and in copies (a layer norm's on every tp rank, a
bucket's on every dp x cp replica under ZeRO 0, an expert's on its edp replicas, a tied
embedding's on both its stages), and the sum must count every element exactly once.

Each stage gets three once-per-step nodes, after every reduction of its gradients (over
tp, dp x cp or edp, and between tied stages: the nodes each optimizer step waited for)
and before any of its optimizer steps:

- ``N/grad_norm#sS`` (compute, :attr:`Op.GRAD_NORM`): this rank's share of the sum of
  squares, over the gradients it holds as its optimizer will read them, each element
  weighted 1/(the number of ranks holding the same value). The weights are written into
  the program by the lowering from the final buckets (planc.lower.bind); weighting
  rather than electing one holder keeps a stage's program the same on all its ranks;
  the copies' weights 1/2, 1/4, ... are exact in binary, and the sum is taken in fp64.
- ``N/grad_norm:all_reduce@world#sS`` (transfer over the ``world`` group): the shares
  summed, one fp64 number, by one collective for the whole mesh (one latency, on gloo
  about a millisecond; a sum over a stage and then over pp would take two). Every stage
  names it the same ``collective``, as the tied embedding's two stages do.
- ``N/grad_clip#sS`` (compute, :attr:`Op.GRAD_CLIP`): ``sqrt``, the coefficient and
  the scaling of every gradient the stage's optimizer steps read, which wait for it.
"""

from __future__ import annotations

import networkx as nx

from planc.graph import reasons
from planc.graph.ir import Axis, EdgeKind, Kind, Level, NodeType, Op, Payload, Phase, buckets
from planc.plan.plan import Plan

NORM_BYTES = 8  # one fp64 number
COLLECTIVE = "N/grad_norm:all_reduce@world"


def norm_nodes(stage: int) -> tuple[str, str, str]:
    """The names of ``stage``'s three nodes: its share, the all-reduce, the clip."""
    return f"N/grad_norm#s{stage}", f"{COLLECTIVE}#s{stage}", f"N/grad_clip#s{stage}"


def add_grad_norm(plan: Plan, graph: nx.DiGraph) -> nx.DiGraph:
    """Add the gradient norm's nodes to the derived ``graph`` of ``plan`` (in place) when
    ``train.grad_clip`` is set; returns the graph."""
    clip = plan.train.grad_clip
    if clip is None:
        return graph
    optimizers: dict[int, list[str]] = {}
    for node, data in graph.nodes(data=True):
        if data["type"] == NodeType.COMPUTE and data["op"] == Op.OPTIMIZER:
            optimizers.setdefault(data["stage"], []).append(node)
    elements: dict[int, int] = {}
    for info in buckets(graph).values():
        held = info["shard"] if info["sharded"] else info["numel"]
        elements[info["stage"]] = elements.get(info["stage"], 0) + held
    reason = reasons.grad_norm(plan)
    for stage in range(plan.mesh.pp):
        share, reduce, scale = norm_nodes(stage)
        held = elements.get(stage, 0)
        common = dict(phase=Phase.OPTIMIZER, stage=stage,
                      chunk=plan.chunks_of_stage(stage)[0], layer=None, repeat=1,
                      microbatch=None, per_microbatch=False)
        graph.add_node(share, type=NodeType.COMPUTE, op=Op.GRAD_NORM, flops=2.0 * held,
                       bytes=4 * held, recompute=False, params=[], **common)
        graph.add_node(reduce, type=NodeType.TRANSFER, kind=Kind.ALL_REDUCE, axis=Axis.WORLD,
                       level=Level.WHOLE, payload=Payload.GRAD_NORM, group_size=plan.world,
                       bytes=NORM_BYTES, dtype="fp64", reason=reason, collective=COLLECTIVE,
                       reduce_op="sum", tensor="grad_norm", **common)
        graph.add_node(scale, type=NodeType.COMPUTE, op=Op.GRAD_CLIP, flops=float(held),
                       bytes=4 * held, recompute=False, params=[], max_norm=float(clip),
                       **common)
        for optimizer in sorted(optimizers.get(stage, ())):
            # what the step waited for (its gradient's last reduction, or the backward
            # steps writing it) the norm waits for; the step waits for the clip
            for source in list(graph.predecessors(optimizer)):
                graph.add_edge(source, share, kind=EdgeKind.ORDER)
            graph.add_edge(scale, optimizer, kind=EdgeKind.ORDER)
        graph.add_edge(share, reduce, kind=EdgeKind.DATA)
        graph.add_edge(reduce, scale, kind=EdgeKind.DATA)
    return graph


def copies(bucket: dict, member: dict, sizes: dict[str, int]) -> int:
    """How many ranks hold the same value of ``member``'s gradient in ``bucket`` once it
    is reduced: its tp copies (a parameter replicated over tp; its partial sums were
    summed over tp), its replicas (dp x cp, or an expert's edp group) unless ZeRO shards
    it, and the two stages of a tied embedding."""
    tp, replicas = sizes["tp"], sizes["dp"] * sizes["cp"]
    if bucket.get("over"):  # experts: split over ep, replicated over the stage's edp
        held = 1 if bucket["sharded"] else tp * replicas // member["ep_split"]
    else:
        held = (tp if member["tp_split"] is None else 1) * \
            (1 if bucket["sharded"] else replicas)
    return held * (2 if bucket["tied"] else 1)


def norm_ranges(graph: nx.DiGraph, stage: int) -> tuple[tuple[str, int, int, float], ...]:
    """The (bucket, start, end, weight) ranges of ``stage``'s buckets whose squares a
    rank's share of the norm sums: every member, weighted 1/its copies, neighbours of one
    weight joined. Padding is in no range."""
    sizes = graph.graph["sizes"]
    out: list[list] = []
    for bucket_id, bucket in sorted(buckets(graph).items()):
        if bucket["stage"] != stage:
            continue
        for member in sorted(bucket["members"], key=lambda m: m["offset"]):
            start, end = member["offset"], member["offset"] + member["numel"]
            weight = 1.0 / copies(bucket, member, sizes)
            last = out[-1] if out else None
            if last and last[0] == bucket_id and last[2] == start and last[3] == weight:
                last[2] = end
            else:
                out.append([bucket_id, start, end, weight])
    return tuple(tuple(item) for item in out)
