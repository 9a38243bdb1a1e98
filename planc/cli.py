"""The ``planc`` command line: argument parsing and dispatch, nothing else.

Exit status: 0 success (warnings allowed), 1 errors in the input, 2 bad command line.
Diagnostics go to standard error (or, with ``--error-format json``, to standard
output as one JSON document); requested output goes to standard output.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Sequence, TextIO

from planc import __version__
from planc.diagnostics import render_json, render_text, summary_line

EXIT_OK, EXIT_ERRORS, EXIT_USAGE = 0, 1, 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's own usage errors: status 2, no traceback
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def use_color(stream: TextIO) -> bool:
    """Colour only on a terminal, and never when NO_COLOR is set (no-color.org)."""
    if os.environ.get("NO_COLOR"):
        return False
    return hasattr(stream, "isatty") and stream.isatty() and os.environ.get("TERM") != "dumb"


def _add_input(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", metavar="FILE", help="a .plan file")
    parser.add_argument("--error-format", choices=("text", "json"), default="text",
                        help="how to print diagnostics (json: one document on stdout)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="planc", description="planc: a declarative parallel-plan compiler "
                     "for training transformer models.")
    parser.add_argument("--version", action="version", version=f"planc {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    check = commands.add_parser("check", help="check a plan and report every problem",
                                description="Parse and check a .plan file; report every "
                                "problem with its line and column.")
    _add_input(check)
    check.add_argument("-v", "--verbose", action="store_true",
                       help="also print the resolved settings and the memory estimate")

    layout = commands.add_parser("layout", help="show which rank sits where, and the groups",
                                 description="Show the rank of every device, its mesh "
                                 "coordinates and node, and the communication groups.")
    _add_input(layout)
    layout.add_argument("--json", action="store_true",
                        help="print the layout as JSON (see docs/cli.md)")
    return parser


def _load(args) -> tuple[object, int]:
    """Load the plan named on the command line and print its diagnostics."""
    from planc.lang import load_file

    loaded = load_file(args.file)
    if args.error_format == "json":
        if loaded.diagnostics or not loaded.ok:
            print(render_json(loaded.diagnostics, loaded.path))
    elif loaded.diagnostics:
        text = render_text(loaded.diagnostics, loaded.path, loaded.source, use_color(sys.stderr))
        print(text, file=sys.stderr)
        print(summary_line(loaded.diagnostics), file=sys.stderr)
    return loaded, (EXIT_OK if loaded.ok else EXIT_ERRORS)


def cmd_check(args) -> int:
    from planc import memory
    from planc.views import memory_text, plan_text

    loaded, status = _load(args)
    if status != EXIT_OK or args.error_format == "json":
        return status
    plan = loaded.plan
    print(plan_text.one_line(plan, loaded.path))
    if args.verbose:
        print()
        print(plan_text.settings(plan))
        print()
        print(memory_text.render(memory.estimate(plan)))
    return EXIT_OK


def cmd_layout(args) -> int:
    from planc import memory
    from planc.layout import Layout
    from planc.views import layout_text, memory_text

    loaded, status = _load(args)
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


COMMANDS = {"check": cmd_check, "layout": cmd_layout}


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        return COMMANDS[args.command](args)
    except BrokenPipeError:  # `planc layout big.plan | head`
        sys.stderr.close()
        return EXIT_OK
    except KeyboardInterrupt:
        return 130


def run() -> None:
    sys.exit(main())
