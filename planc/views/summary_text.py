"""``planc compile``'s table: per pipeline stage, what one device does in one step."""

from __future__ import annotations

import textwrap

from planc.vocabulary.units import TIME, format_bytes, format_flops, format_quantity
from planc.views.tables import table

MAX_STAGES_SHOWN = 6


def _stage_ids(summary: dict) -> list[int | None]:
    count = len(summary["stages"])
    if count <= MAX_STAGES_SHOWN:
        return list(range(count))
    return [0, 1, None, count - 2, count - 1]


def _layers(layers: list[int]) -> str:
    if not layers:
        return "no layers"
    if layers == list(range(layers[0], layers[-1] + 1)):
        return f"layers {layers[0]}-{layers[-1]}" if len(layers) > 1 else f"layer {layers[0]}"
    return "layers " + ", ".join(map(str, layers))


def passes(summary: dict) -> str:
    """One line per pass, in the order they ran."""
    return "".join(f"{record['line']}\n" for record in summary.get("passes", []))


# what a mixture's all-to-alls in the table are (planc.graph.summary: one row whichever
# the mixture; cut into transfers of their own, planc.passes.split_dispatch, they are
# counted as any transfer and this line still holds of the rest)
INNER_ALL_TO_ALLS = ("ep all_to_all: a mixture's counts, dispatch and combine, inside its "
                     "compute instruction unless cut into transfers of their own (at "
                     "uniform routing)")


def render(summary: dict) -> str:
    out = []
    for stage_id in _stage_ids(summary):
        if stage_id is None:
            out.append(f"... {len(summary['stages']) - 4} more stages ...\n")
            continue
        s = summary["stages"][stage_id]
        out.append(
            f"stage {s['stage']}: {_layers(s['layers'])}; {format_flops(s['flops'])} per step; "
            f"estimated compute {format_quantity(s['compute_seconds'], TIME)}, transfers "
            f"{format_quantity(s['transfer_seconds'], TIME)}; memory "
            f"{format_bytes(s['memory']['total_bytes'])}")
        rows = [[t["axis"], t["kind"], t["phase"], f"{t['count']:,}", format_bytes(t["bytes"]),
                 format_bytes(t["bus_bytes"])] for t in s["transfers"]]
        if rows:
            out.append(table(["axis", "kind", "phase", "count", "bytes", "bus bytes"], rows,
                             indent="  "))
            if any(t["axis"] == "ep" and t["kind"] == "all_to_all" for t in s["transfers"]):
                out.extend(textwrap.wrap(INNER_ALL_TO_ALLS, width=88, initial_indent="  ",
                                         subsequent_indent="    "))
        else:
            out.append("  no transfers")
        out.append("")
    return "\n".join(out).rstrip() + "\n"
