"""``planc diff A B``: two plans or builds side by side."""

from __future__ import annotations

import argparse

import os

from planc.commands import EXIT_OK, EXIT_USAGE, fail, load_programs
from planc.commands.arguments import Command, override_of_b, path


def main(args) -> int:
    from planc.simulate import simulate
    from planc.views import diff_text

    if args.set_b and os.path.isdir(args.b):
        return fail(f"--set-b needs B to be a .plan file, but {args.b} is a directory; "
                    f"name the plan file instead", EXIT_USAGE)
    sides = []
    for given, overrides in ((args.a, []), (args.b, args.set_b or [])):
        side = argparse.Namespace(file=given, set=overrides, error_format=args.error_format)
        built, status = load_programs(side, verified=True)
        if built is None:
            return status
        sides.append((given, built, simulate(built), overrides))
    print(diff_text.render(sides), end="")
    return EXIT_OK


def add_arguments(parser) -> None:
    """The arguments of planc diff."""
    parser.add_argument("a", metavar="A", type=path, help="a .plan file or a build directory")
    parser.add_argument("b", metavar="B", type=path, help="a .plan file or a build directory")
    parser.add_argument("--set-b", action="append", type=override_of_b, metavar="KEY=VALUE",
                        help="override a key of B (a .plan file), as --set does")
    parser.add_argument("--error-format", choices=("text", "json"), default="text",
                        help=argparse.SUPPRESS)


# planc.cli adds these to its command line, in this order.
COMMANDS = (
    Command("diff", add_arguments, main,
            help="two plans or builds side by side: layout, memory, transfers, time",
            description="Compare two plans or builds: world, mesh, nodes, memory per stage, "
                        "transfers and bytes per axis, and the simulated step time, MFU and "
                        "bubble. --set-b changes B only, to compare a plan with a variant of "
                        "itself."),
)
