"""``planc explain``: every transfer of a layer or a parameter, with its group and reason,
and the buckets the fuse pass made: their members and why each closed where it did."""

from __future__ import annotations

import textwrap
from collections import defaultdict

import networkx as nx

from planc.graph.ir import Axis
from planc.graph.vocabulary import Op, Phase
from planc.vocabulary.units import TIME, format_bytes, format_quantity
from planc.plan.layout import Layout
from planc.lower.tables import plan_group_table
from planc.plan.plan import Plan
from planc.vocabulary.model_options import gemm_input_bytes
from planc.views.tables import table
from planc.diagnostics import counted

PHASE_LETTER = {"forward": "F", "backward": "B", "optimizer": "O"}
MEMBERS_SHOWN = 8


def _members(plan: Plan, ranks: Layout, data: dict) -> list[int]:
    """The group of the first rank of the transfer's stage, by the build's group rules."""
    first = ranks.first_rank_of_stage(data["stage"])
    if data["axis"] == Axis.PP:
        return sorted({first, ranks.first_rank_of_stage(data["peer_stage"])})
    table = plan_group_table(plan)  # with the world group when the plan clips gradients
    return list(table.members(first, table.rule(data["axis"])))


def _group_text(plan: Plan, ranks: Layout, data: dict) -> str:
    members = _members(plan, ranks, data)
    nodes = {ranks.node(r) for r in members}
    where = "intra-node" if len(nodes) == 1 else (
        "inter-node" if len(nodes) == len(members) else "mixed")
    shown = (", ".join(map(str, members)) if len(members) <= 6 else
             ", ".join(map(str, members[:4])) + f", ... {members[-1]}")
    return f"{counted(len(members), 'rank')}, {where}: [{shown}]"


def what_it_moves(data: dict, arrow: str = "->") -> str:
    """What a transfer moves: producer -> consumer, the tensor, or the bucket (the
    bracketed subject of an explain row; planc graph's labels draw the arrow as one)."""
    if data.get("producer"):
        return f"{data['producer']} {arrow} {data['consumer']}"
    if data.get("tensor"):
        return str(data["tensor"])
    return f"bucket {data['bucket']}" if data.get("bucket") else ""


def sharing(data: dict, bucket: dict) -> list[dict]:
    """The members of ``bucket`` that a transfer of it moves: those whose elements meet
    its range (an all-reduce of the partial sums over tp moves the bucket's first
    elements only), in the order they are laid out."""
    first, end = data.get("elements") or (0, bucket["padded"])
    return [m for m in bucket["members"]
            if m["offset"] < end and first < m["offset"] + m["numel"]]


def _shared_lines(data: dict, bucket: dict, param: str) -> list[str]:
    """For ``planc explain --param``: a transfer of a bucket that ``param`` shares with
    other parameters is not the parameter's own; how much of it is, and who else is in."""
    moved = sharing(data, bucket)
    first, end = data.get("elements") or (0, bucket["padded"])
    mine = next(m for m in moved if m["param"] == param)
    share = data["bytes"] * mine["numel"] / (end - first)
    others = [m["param"] for m in moved if m["param"] != param]
    named = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3
                                     else "")
    text = (f"not {param}'s own: bucket {data['bucket']}'s {data['kind']}, shared by "
            f"{counted(len(moved), 'parameter')}; {param} is {format_bytes(share)} of its "
            f"{format_bytes(data['bytes'])}, with {named}")
    return textwrap.wrap(text, width=96, initial_indent="     ", subsequent_indent="       ",
                         break_on_hyphens=False)


def _shared_heading(graph: nx.DiGraph, nodes: list[str], buckets: dict, param: str) -> str:
    """', of bucket c0.b1, which it shares with 39 other parameters' after the count of
    a parameter's transfers, when they move a bucket it shares."""
    shared = [n for n in nodes if _is_shared(graph.nodes[n], buckets)]
    if not shared:
        return ""
    ids = sorted({graph.nodes[n]["bucket"] for n in shared})
    some = "" if len(shared) == len(nodes) else f"{len(shared)} "
    if len(ids) > 1:
        return (f", {some}of buckets {', '.join(ids[:-1])} and {ids[-1]}, which it shares "
                f"with other parameters")
    others = {m["param"] for n in shared
              for m in sharing(graph.nodes[n], buckets[ids[0]])} - {param}
    return (f", {some}of bucket {ids[0]}, which it shares with "
            f"{counted(len(others), 'other parameter')}")


def _is_shared(data: dict, buckets: dict) -> bool:
    """A transfer of a bucket (not of one tensor) that moves more than one parameter."""
    return (data.get("bucket") in buckets and not data.get("tensor")
            and len(sharing(data, buckets[data["bucket"]])) > 1)


def route_decisions(graph: nx.DiGraph) -> dict[str, dict]:
    """The route pass's decision for each transfer it routed, by node."""
    for entry in graph.graph.get("passes", []):
        if entry["name"] == "route":
            return {d["node"]: d for d in entry["decisions"]}
    return {}


def route_lines(decision: dict, full: bool) -> list[str]:
    """The route a transfer takes; with ``full``, every candidate's predicted time and why
    it was or was not taken."""
    chosen = next(c for c in decision["candidates"] if c["route"] == decision["route"])
    head = (f"     route: {decision['route']}, {format_quantity(chosen['seconds'], TIME)} "
            f"predicted ({decision['why']})")
    if not full:
        others = ", ".join(
            f"{c['route']} " + (format_quantity(c["seconds"], TIME) if c["seconds"] is not None
                                else "n/a")
            for c in decision["candidates"] if c["route"] != decision["route"])
        return [head + (f"; {others}" if others else "")]
    rows = [[c["route"], "-" if c["seconds"] is None else format_quantity(c["seconds"], TIME),
             "yes" if c["route"] == decision["route"] else "", c["reason"]]
            for c in decision["candidates"]]
    groups = "; ".join(decision["placements"])
    return [head, f"       groups: {groups}",
            table(["route", "predicted", "chosen", "why"], rows, indent="       ")]


def _rows(plan: Plan, graph: nx.DiGraph, nodes: list[str], routes: bool = False,
          param: str | None = None) -> list[str]:
    ranks = Layout.of(plan)
    decisions = route_decisions(graph)
    buckets = graph.graph.get("buckets", {})
    lines = []
    for node in nodes:
        data = graph.nodes[node]
        per = "per microbatch" if data["per_microbatch"] else "per step"
        times = data["repeat"] // (plan.schedule.microbatches if data["per_microbatch"] else 1)
        count = f"x{times} " if times > 1 else ""
        # a recomputed forward's transfers redo the forward's, in the backward
        letter = "R" if data.get("recomputes") else PHASE_LETTER[data["phase"]]
        lines.append(f"  {letter}  {data['kind']} over {data['axis']} "
                     f"({_group_text(plan, ranks, data)})  {format_bytes(data['bytes'])} "
                     f"{count}{per}  [{what_it_moves(data)}]")
        if param is not None and _is_shared(data, buckets):
            lines.extend(_shared_lines(data, buckets[data["bucket"]], param))
        lines.extend(textwrap.wrap(data["reason"], width=96, initial_indent="     ",
                                   subsequent_indent="     ", break_on_hyphens=False))
        if "token_piece" in data:
            index, count, _ = data["token_piece"]
            lines.append(f"     chunk {index + 1} of {count} along the tokens (tp_overlap): in "
                         f"flight while another chunk's partial GEMM computes")
        if node in decisions:
            lines.extend(route_lines(decisions[node], routes))
    return lines


def _totals(graph: nx.DiGraph, nodes: list[str]) -> str:
    sums: dict[tuple[str, str, str], list[float]] = defaultdict(lambda: [0, 0])
    for node in nodes:
        data = graph.nodes[node]
        key = (data["axis"], data["kind"], data["phase"])
        sums[key][0] += data["repeat"]
        sums[key][1] += data["repeat"] * data["bytes"]
    rows = [[axis, kind, phase, f"{int(c):,}", format_bytes(b)]
            for (axis, kind, phase), (c, b) in sorted(sums.items())]
    return table(["axis", "kind", "phase", "count/step", "bytes/step"], rows, indent="  ")


def bucket_lines(plan: Plan, bucket_id: str, bucket: dict, param: str | None = None
                 ) -> list[str]:
    """A bucket: where it lives, its members in gradient order, why it closed."""
    dtype_bytes = plan.model.dtype_bytes
    names = [m["param"] for m in bucket["members"]]
    padding = bucket["padded"] - bucket["numel"]
    shards = (f", {bucket['parts']} shards of {bucket['shard']:,} elements"
              if bucket["parts"] > 1 else "")
    lines = [f"  bucket {bucket_id} (stage {bucket['stage']}): "
             f"{counted(len(names), 'parameter')}, "
             f"{format_bytes(bucket['numel'] * dtype_bytes)}, "
             f"{counted(padding, 'element')} of padding{shards}"]
    shown = ", ".join(names[:MEMBERS_SHOWN]) + (
        f", ... and {len(names) - MEMBERS_SHOWN} more" if len(names) > MEMBERS_SHOWN else "")
    lines.extend(textwrap.wrap(f"members, in the order they are laid out: {shown}", width=96,
                               initial_indent="     ", subsequent_indent="       "))
    if bucket.get("tp_sum_numel"):
        lines.append(f"     elements 0..{bucket['tp_sum_numel'] - 1} are partial sums over tp, "
                     f"summed by one all-reduce")
    if param is not None:
        member = next(m for m in bucket["members"] if m["param"] == param)
        lines.append(f"     {param} holds elements {member['offset']:,}.."
                     f"{member['offset'] + member['numel'] - 1:,}")
    lines.extend(textwrap.wrap(f"closed: {bucket['reason']}", width=96, initial_indent="     ",
                               subsequent_indent="       "))
    return lines


def explain(plan: Plan, graph: nx.DiGraph, layer: int | None = None, param: str | None = None,
            axis: str | None = None, all_buckets: bool = False, routes: bool = False) -> str:
    buckets = graph.graph.get("buckets", {})
    if all_buckets:
        out = [f"{counted(len(buckets), 'bucket')}:"]
        for bucket_id, bucket in buckets.items():
            out.extend(bucket_lines(plan, bucket_id, bucket))
        return "\n".join(out + [""] + _passes(graph)).rstrip() + "\n"
    order = {node: i for i, node in enumerate(nx.topological_sort(graph))}
    phase_rank = {"forward": 0, "backward": 1, "optimizer": 2}
    layers_of = {b: {m["layer"] for m in info["members"]} for b, info in buckets.items()}
    holding = {b for b, info in buckets.items() if any(m["param"] == param
                                                        for m in info["members"])}

    def pick(predicate) -> list[str]:
        # the gradient norm's all-reduce: one collective of every rank, though each stage
        # has its node: shown once
        found = [n for n, d in graph.nodes(data=True) if d["type"] == "transfer" and predicate(d)
                 and (axis is None or d["axis"] == axis)
                 and not (d["axis"] == Axis.WORLD and d["stage"] != 0)]
        # Per-microbatch transfers first, in dataflow order; once-per-step ones after.
        return sorted(found, key=lambda n: (phase_rank[graph.nodes[n]["phase"]],
                                            not graph.nodes[n]["per_microbatch"], order[n]))

    def of_layer(d: dict, which: int | None) -> bool:
        if d.get("bucket") in buckets and not d.get("tensor"):
            return which in layers_of[d["bucket"]]
        return d["layer"] == which

    sections, experts = [], []
    if param is not None:
        chosen = pick(lambda d: d.get("tensor") == param or (
            d.get("bucket") in holding and not d.get("tensor")
            and any(m["param"] == param for m in sharing(d, buckets[d["bucket"]]))))
        sections.append((f"transfers of {param}", chosen, param))
    else:
        if layer is None:
            layers = sorted({d["layer"] for _, d in graph.nodes(data=True)
                             if d["layer"] is not None})
            layer = layers[0] if layers else None
            note = "every layer has the same transfers; showing the first"
        else:
            note = ""
        if layer is not None:
            stage = next(d["stage"] for _, d in graph.nodes(data=True) if d["layer"] == layer)
            sections.append((f"layer {layer} (stage {stage})" + (f": {note}" if note else ""),
                             pick(lambda d: of_layer(d, layer)), None))
            mixture = _mixture(graph, layer)
            experts = expert_lines(plan, mixture, layer)
            counts = counts_lines(plan, mixture, layer)
            experts += [""] + counts if experts and counts else counts
        if not (param or (layer is not None and note == "")):
            sections.append(("outside the layers: embedding, head, loss and pipeline",
                             pick(lambda d: of_layer(d, None)), None))
    out = []
    if param is None and layer is not None and experts:
        out.extend(experts + [""])
    for title, nodes, subject in sections:
        out.append(f"{title}: {counted(len(nodes), 'transfer')}"
                   + (f" over {axis}" if axis else "")
                   + (_shared_heading(graph, nodes, buckets, subject) if subject else ""))
        out.extend(_rows(plan, graph, nodes, routes, subject) if nodes else ["  none"])
        if nodes:
            out.append("  per step, on each device:")
            out.append(_totals(graph, nodes))
        used = sorted({graph.nodes[n]["bucket"] for n in nodes if graph.nodes[n].get("bucket")
                       in buckets and not graph.nodes[n].get("tensor")})
        if used:
            out.append("")
            out.append("  the buckets these transfers move (planc explain --buckets lists "
                       "them all):")
            for bucket_id in used:
                out.extend(bucket_lines(plan, bucket_id, buckets[bucket_id], subject))
        out.append("")
    return "\n".join(out + _passes(graph) + training_lines(plan)).rstrip() + "\n"


def training_lines(plan: Plan) -> list[str]:
    """The lr schedule's landmarks and the order of the samples, when the plan sets
    them (planc.plan.lr_schedule, planc.data.sample_order)."""
    from planc.plan.lr_schedule import LrSchedule, describe

    train, lines = plan.train, []
    if train.lr_schedule != LrSchedule():
        lines.append("  " + describe(train.lr_schedule, train.optimizer.lr, train.steps))
    if train.shuffle:
        lines.append("  shuffle: " + ("on, but the synthetic batches do not depend on it"
                                      if train.data == "synthetic" else
                                      "each epoch's samples in a permutation of the seed "
                                      "and the epoch (docs/data.md)"))
    return ["", "training:", *lines] if lines else []


def _mixture(graph: nx.DiGraph, layer: int) -> dict:
    """The forward mixture-of-experts node of ``layer`` (its attributes), or {} for a
    dense layer: found by what the node is, not by its id."""
    return next((data for _, data in graph.nodes(data=True)
                 if data.get("op") == Op.MOE and data.get("phase") == Phase.FORWARD
                 and data.get("layer") == layer and not data.get("recompute")), {})


def expert_lines(plan: Plan, data: dict, layer: int) -> list[str]:
    """A mixture over ep: the all-to-alls its instruction runs over its ep group, what
    they move at uniform routing and at the most (every row of the group sent to one
    rank's experts), and why they exist. ``data``: the layer's mixture node
    (:func:`_mixture`)."""
    from planc.program.groups import EXPERTS
    from planc.lower.tables import plan_group_table

    if not data.get("experts_over"):
        return []
    m, ep = plan.model, data["experts_over"]
    table = plan_group_table(plan)
    members = table.members(table.ranks.rank({"pp": data["stage"]}), table.rule(EXPERTS))
    per_rank = m.experts // ep
    rows = data["dispatch_bytes"]
    most = rows * ep * min(m.top_k, per_rank) / m.top_k
    lines = [f"layer {layer}: the mixture's all-to-alls over ep ({ep} ranks: "
             f"{list(members)}), inside its instruction"]
    # model { fp8 }: the dispatch moves E4M3 bytes and a scale a tile
    share = gemm_input_bytes(m) / m.dtype_bytes
    dispatch = "dispatch in FP8" if share != 1.0 else "dispatch"
    for phase, what, part in (
            ("F", f"{dispatch}: each (token, expert) row to its expert's rank", share),
            ("F", "combine: each expert's output back to its token's rank", 1.0),
            ("B", "the gradients of the combine, reversed", 1.0),
            ("B", "the gradients of the dispatch, reversed", 1.0)):
        lines.append(f"  {phase}  all_to_all over ep  {format_bytes(rows * part)} per "
                     f"microbatch at uniform routing, at most {format_bytes(most * part)} "
                     f"received  [{what}]")
    lines.extend(textwrap.wrap(
        f"the {m.experts} experts of each mixture are spread over the ep group, {per_rank} "
        f"per rank (rank j runs experts j x {per_rank} to (j + 1) x {per_rank} - 1); each of "
        f"this rank's tokens goes to its top_k = {m.top_k} experts' ranks and comes back "
        f"weighted by its routing probability. The counts are exchanged first, an all-to-all "
        f"of {m.experts} integers (the rows for each expert), since they change with every "
        f"step", width=96,
        initial_indent="     ", subsequent_indent="     ", break_on_hyphens=False))
    return lines


def counts_lines(plan: Plan, data: dict, layer: int) -> list[str]:
    """A mixture whose balance loss spans the ranks of a sequence: the all-reduce of its
    per-(sequence, expert) counts that its instruction runs over the sequence group, what
    it moves, and why it exists."""
    from planc.program.groups import SEQUENCE
    from planc.lower.tables import plan_group_table

    if not data.get("counts_over"):
        return []
    table = plan_group_table(plan)
    members = table.members(table.ranks.rank({"pp": data["stage"]}), table.rule(SEQUENCE))
    parts = " x ".join(f"{axis} ({size})" for axis, size in
                       (("tp", data["counts_over"] // plan.mesh.cp), ("cp", plan.mesh.cp))
                       if size > 1)
    lines: list[str] = []

    def block(head: str, line: str, why: str) -> None:
        lines.extend([head, line])
        lines.extend(textwrap.wrap(why, width=96, initial_indent="     ",
                                   subsequent_indent="     ", break_on_hyphens=False))

    where = f"over {SEQUENCE} ({data['counts_over']} ranks: {list(members)})"
    if data.get("counts_bytes"):
        block(f"layer {layer}: the balance loss's count all-reduce {where}, inside the "
              f"mixture's instruction",
              f"  F  all_reduce over {SEQUENCE}  {format_bytes(data['counts_bytes'])} per "
              f"microbatch  [the tokens each expert got in each sequence: fp32, sequences x "
              f"experts]",
              f"aux_loss (DeepSeek-V3's sequence-wise balance loss) weighs each expert's "
              f"mean probability over a sequence by the share of the sequence's tokens "
              f"routed to it; {parts} split each sequence's tokens over these ranks, so they "
              f"sum their counts (the counts carry no gradient: the backward moves nothing "
              f"for them, a recomputed forward sums them again) and each adds its own "
              f"tokens' part of the loss")
    if data.get("capacity_bytes"):
        block(f"layer {layer}: the capacity's all-gathers {where}, inside the mixture's "
              f"instruction",
              f"  F  all_gather over {SEQUENCE}  {format_bytes(data['capacity_bytes'])} per "
              f"microbatch from each rank  [its choices of experts and its tokens' "
              f"positions: int64]",
              f"capacity = {plan.model.options['capacity']:g} lets each expert take only the "
              f"first tokens of a sequence, by position; {parts} split each sequence's "
              f"tokens over these ranks, so each gathers the others' choices to drop the "
              f"same pairs as one process would")
    return lines


def _passes(graph: nx.DiGraph) -> list[str]:
    records = graph.graph.get("passes", [])
    out = ["passes:"] if records else []
    for r in records:
        out.append(f"  {r['line']}")
        if r["name"] == "tp_overlap":
            out.extend(tp_overlap_lines(r["decisions"]))
    return out


def tp_overlap_lines(decisions: list[dict]) -> list[str]:
    """tp_overlap's choice per linear operator, alike over the layers: the chunk count,
    why, and the cost model's predicted seconds (per microbatch) of each count."""
    by_op: dict[tuple, list[dict]] = {}
    for d in decisions:
        op = d["node"].rsplit("/", 1)[-1]
        by_op.setdefault((op, d["chunks"], d["reason"]), []).append(d)
    lines = []
    for (op, chunks, reason), items in by_op.items():
        seconds = ", ".join(f"{k}: {format_quantity(v, TIME)}"
                            for k, v in items[0]["predicted_seconds"].items())
        lines.append(f"    {op} ({counted(len(items), 'layer')}): {chunks} "
                     f"chunk{'s' if chunks > 1 else ''}, {reason} (predicted per "
                     f"microbatch, by chunks: {seconds})")
    return lines
