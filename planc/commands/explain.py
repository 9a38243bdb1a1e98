"""``planc explain``: why each transfer exists, and what the passes did."""

from __future__ import annotations

from planc.commands import EXIT_OK, EXIT_USAGE, fail, load_build
from planc.commands.arguments import Command, add_input
from planc.program.names import Axis


def main(args) -> int:
    from planc.lang.schema import did_you_mean
    from planc.views import explain_text

    if args.layer is not None and args.param is not None:  # one was taken, silently
        return fail("--layer and --param each choose what to explain; give one of them",
                    EXIT_USAGE)
    chosen = [flag for flag, value in (("--layer", args.layer), ("--param", args.param),
                                       ("--axis", args.axis), ("--routes", args.routes or None))
              if value is not None]
    if args.buckets and chosen:  # --buckets lists every bucket: the others went unread
        return fail(f"--buckets lists every bucket of the build; {chosen[0]} chooses what "
                    f"else to explain: give one of them", EXIT_USAGE)
    built, status = load_build(args)
    if built is None:
        return status
    graph, plan = built.graph, built.plan
    if args.layer is not None and not 0 <= args.layer < plan.model.layers:
        return fail(f"layer {args.layer} does not exist; the plan has layers "
                    f"0..{plan.model.layers - 1}", EXIT_USAGE)
    if args.param is not None:
        params = {p for n in graph.nodes for p in graph.nodes[n].get("params", [])}
        if args.param not in params:
            hint = did_you_mean(args.param, params)
            return fail(f"the plan has no parameter {args.param!r}" +
                         (f"; {hint}" if hint else ""), EXIT_USAGE)
    print(explain_text.explain(plan, graph, args.layer, args.param, args.axis, args.buckets,
                               args.routes), end="")
    return EXIT_OK


def add_arguments(parser) -> None:
    """The arguments of planc explain."""
    axes = tuple(axis.value for axis in Axis)
    add_input(parser, "FILE|DIR")
    parser.add_argument("--layer", type=int, metavar="N", help="a layer")
    parser.add_argument("--param", metavar="NAME",
                        help="a parameter, such as layers.3.qkv.weight or embedding.weight")
    parser.add_argument("--axis", choices=axes, help="only transfers over this axis")
    parser.add_argument("--buckets", action="store_true",
                        help="every parameter bucket: its members and why it closed")
    parser.add_argument("--routes", action="store_true",
                        help="for each collective, every route (ring, tree, hierarchical) "
                        "with its predicted time and why it was or was not chosen")


# planc.cli adds these to its command line, in this order.
COMMANDS = (
    Command("explain", add_arguments, main,
            help="why each transfer exists: kind, group, size, reason",
            description="List the transfers of one layer (default: the first) or of one "
                        "parameter's gradient, with kind, group, size and the reason for each, "
                        "and totals per step."),
)
