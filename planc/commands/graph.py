"""``planc graph``: the communication graph, selected, in one of its formats."""

from __future__ import annotations

import os
import sys

from planc.commands import (EXIT_OK, EXIT_USAGE, GRAPH_FORMATS, fail, load_build,
                            outputs_refused, the_input)
from planc.commands.arguments import (Command, add_input, force, int_list, layer_range,
                                      microbatches, output)
from planc.program.names import Axis


def main(args) -> int:
    from planc.host.files import write_atomically
    from planc.host.output_kinds import GRAPH, marked
    from planc.graph.select import (MAX_UNFOLDED_NODES, Selection, default_selection, select,
                                    unfolded_size, why_empty)
    from planc.views.graph import render as render_graph

    fmt = args.format or (os.path.splitext(args.output)[1].lstrip(".").lower()
                          if args.output else "dot")
    if fmt not in GRAPH_FORMATS:
        return fail(f"cannot tell the format from {args.output!r}; give --format "
                    f"({', '.join(GRAPH_FORMATS)})", EXIT_USAGE)
    if fmt == "png" and not args.output:
        return fail("png output needs -o FILE", EXIT_USAGE)
    refused = outputs_refused(args, (the_input(args.file),))
    if refused is not None:
        return refused
    built, status = load_build(args)
    if built is None:
        return status
    graph = built.graph
    total = graph.graph.get("microbatches", 1)
    microbatches = args.microbatch
    if microbatches == "all":
        microbatches = tuple(range(total))
    if microbatches is not None and any(k >= total for k in microbatches):
        return fail(f"microbatch {max(microbatches)} does not exist; the plan has "
                    f"{total} (0..{total - 1})", EXIT_USAGE)
    layers = sorted({d["layer"] for _, d in graph.nodes(data=True) if d["layer"] is not None})
    if args.layers and layers and args.layers[1] > layers[-1]:
        return fail(f"layer {args.layers[1]} does not exist; the plan has layers "
                    f"0..{layers[-1]}", EXIT_USAGE)
    stages = graph.graph.get("sizes", {}).get("pp", 1)
    if args.stage and max(args.stage) >= stages:
        return fail(f"stage {max(args.stage)} does not exist; the plan has {stages} "
                    f"(0..{stages - 1})", EXIT_USAGE)
    selection = Selection(args.stage, args.layers, microbatches,
                          tuple(args.phase) if args.phase else None,
                          tuple(args.axis) if args.axis else None, args.transfers_only)
    if selection.is_empty and not args.all:
        selection = default_selection(graph)
        if not selection.is_empty:
            print(f"planc: note: the graph has {graph.number_of_nodes():,} nodes; showing "
                  f"{selection.describe()} (choose with --layers, --microbatch, --stage, or "
                  f"--all)", file=sys.stderr)
    unfolded = unfolded_size(graph, selection)
    if selection.microbatches is not None and unfolded > MAX_UNFOLDED_NODES:
        return fail(f"unfolding {selection.describe()} makes {unfolded:,} nodes, more than "
                    f"planc graph draws ({MAX_UNFOLDED_NODES:,}); name fewer microbatches "
                    f"(--microbatch 0,1), layers (--layers) or stages (--stage)", EXIT_USAGE)
    view = select(graph, selection)
    if view.number_of_nodes() == 0 and graph.number_of_nodes():  # an empty drawing, exit 0
        return fail(f"the selection ({selection.describe()}) is empty: "
                    f"{why_empty(graph, selection)}", EXIT_USAGE)
    title = f"{built.plan.name}: {view.graph['selection']}"
    try:
        data = marked(render_graph.render(view, fmt, title, built.plan), fmt,
                      GRAPH.generator)
    except render_graph.RenderError as exc:
        return fail(str(exc))
    if args.output:
        try:
            write_atomically(args.output, data)
        except OSError as exc:
            return fail(f"cannot write {args.output}: {exc.strerror}")
    else:
        sys.stdout.buffer.write(data)
        sys.stdout.flush()
    return EXIT_OK


def add_arguments(parser) -> None:
    """The arguments of planc graph."""
    axes = tuple(axis.value for axis in Axis)
    add_input(parser, "FILE|DIR")
    parser.add_argument("--format", choices=GRAPH_FORMATS, default=None,
                        help="output format [from -o's extension, else dot]")
    output(parser, "-o", "--output", kind="graph", metavar="OUT",
           help="output file [standard output]")
    force(parser)
    parser.add_argument("--stage", type=int_list, metavar="S[,S...]", help="pipeline stages")
    parser.add_argument("--layers", type=layer_range, metavar="A..B", help="layer or range")
    parser.add_argument("--microbatch", type=microbatches, metavar="K[,K...]|all",
                        help="unfold these microbatches (default: folded, or 0 for big graphs)")
    parser.add_argument("--phase", choices=("forward", "backward", "optimizer"),
                        action="append", help="keep this phase (repeatable)")
    parser.add_argument("--axis", choices=axes, action="append",
                        help="keep transfers over this axis (repeatable)")
    parser.add_argument("--transfers-only", action="store_true",
                        help="only transfers, connected through the computation between them")
    parser.add_argument("--all", action="store_true",
                        help="the whole graph, even when it is big")


# planc.cli adds these to its command line, in this order.
COMMANDS = (
    Command("graph", add_arguments, main,
            help="draw the communication graph (dot, svg, png, graphml, json, html)",
            description="Draw the communication graph of a plan file or a build directory. Big "
                        "graphs show one layer and one microbatch unless told otherwise."),
)
