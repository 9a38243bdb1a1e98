"""``planc check`` and ``planc layout``: a plan, its settings, its ranks and its memory."""

from __future__ import annotations

import json

from planc.commands import EXIT_OK, load_plan
from planc.commands.arguments import Command, add_input


def check(args) -> int:
    from planc.estimate import memory
    from planc.views import memory_text
    from planc.views import plan_summary

    loaded, status = load_plan(args)
    if status == EXIT_OK and args.error_format == "json" and not loaded.diagnostics:
        from planc.diagnostics import render_json

        print(render_json((), loaded.path, args.max_errors))  # a clean plan: a document too
    if status != EXIT_OK or args.error_format == "json":
        return status
    plan = loaded.plan
    print(plan_summary.one_line(plan, loaded.path))
    if args.verbose:
        print()
        print(plan_summary.settings(plan))
        print()
        print(memory_text.render(memory.estimate(plan)))
    return EXIT_OK


def layout(args) -> int:
    from planc.estimate import memory
    from planc.plan.layout import Layout
    from planc.views import layout_text, memory_text

    loaded, status = load_plan(args)
    if status != EXIT_OK:
        return status
    layout = Layout.of(loaded.plan)
    if args.json:
        print(json.dumps(layout.to_dict(), separators=(",", ":")))
        return EXIT_OK
    print(layout_text.render(layout, loaded.plan.name))
    print()
    print(memory_text.render(memory.estimate(loaded.plan)))
    return EXIT_OK


def add_check_arguments(parser) -> None:
    """The arguments of planc check."""
    add_input(parser)
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="also print the resolved settings and the memory estimate")


def add_layout_arguments(parser) -> None:
    """The arguments of planc layout."""
    add_input(parser)
    parser.add_argument("--json", action="store_true",
                        help="print the layout as JSON (see README)")


# planc.cli adds these to its command line, in this order.
COMMANDS = (
    Command("check", add_check_arguments, check,
            help="check a plan and report every problem",
            description="Parse and check a .plan file; report every problem with its line and "
                        "column."),
    Command("layout", add_layout_arguments, layout,
            help="show which rank sits where, and the groups",
            description="Show the rank of every device, its mesh coordinates and node, and the "
                        "communication groups."),
)
