"""The ``planc`` command line: argument parsing and dispatch, nothing else.

Exit status (README, "Exit status"): 0 success (warnings allowed), 1 an input is wrong or
the work failed, 2 a wrong command line, 128 + N stopped by signal N.
Diagnostics go to standard error (or, with ``--error-format json``, to standard
output as one JSON document); requested output goes to standard output.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import TYPE_CHECKING, Sequence

from planc import __version__
from planc.host.collector import paused
from planc.host.interrupts import Interrupted, Interrupts

if TYPE_CHECKING:  # annotations only
    from planc.commands.arguments import Command

EXIT_OK, EXIT_USAGE = 0, 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's own usage errors: status 2, no traceback
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


# The modules of planc.commands, in the order the help lists their commands. Each declares
# its commands (planc.commands.arguments.Command) and their arguments; the work a command
# does is imported by its function when it runs, so check and layout never load what
# compile and run need.
COMMAND_MODULES = ("check", "compile", "graph", "explain", "programs", "run", "simulate",
                   "tune", "report", "export", "diff", "plot", "calibrate", "data")


def commands() -> dict[str, "Command"]:
    """Every command by name, in the help's order."""
    found = {}
    for module in COMMAND_MODULES:
        for command in importlib.import_module(f"planc.commands.{module}").COMMANDS:
            found[command.name] = command
    return found


def build_parser(named: str | None = None) -> argparse.ArgumentParser:
    """The command line's parser: every command's, or only that of the command ``named``
    (the one a command line names: argparse spends about 1 ms on each command's parser, a
    third of a read-only command on a small build)."""
    # allow_abbrev off: a prefix of a long option (diff's --set for --set-b) is an error,
    # never silently another option
    parser = _Parser(prog="planc", description="planc: a declarative parallel-plan compiler "
                     "for training transformer models.", allow_abbrev=False)
    parser.add_argument("--version", action="version", version=f"planc {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for command in commands().values():
        if named is None or command.name == named:
            command.add_arguments(subparsers.add_parser(command.name, help=command.help,
                                                        description=command.description,
                                                        allow_abbrev=False))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    # A path is printed as the user gave it, bytes that are no UTF-8 included (Python
    # holds them as surrogates): as \xff escapes, where a strict stream would raise.
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    # Signals first: a Ctrl-C at any moment stops the command with 128 + its number and
    # one line, never a traceback; the imports below are inside the handling too.
    with Interrupts() as interrupts:
        try:
            status = _dispatch(argv, interrupts)
            if interrupts.received is not None and status != 128 + interrupts.received:
                interrupts.check()  # a signal recorded where it could not be raised
            return status
        except BrokenPipeError:  # `planc layout big.plan | head`
            sys.stderr.close()
            return EXIT_OK
        except Interrupted as stop:
            print(f"\nplanc: interrupted by signal {stop.signum}", file=sys.stderr)
            return stop.status
        except KeyboardInterrupt:  # raised by Python's own handler, before ours
            print("\nplanc: interrupted by signal 2", file=sys.stderr)
            return 130
        except Exception:
            # Python wraps what some hooks raise in another exception (3.11 turns an
            # exception from __set_name__, a dataclass field's, into RuntimeError), so a
            # signal raised while a module defines its classes comes up as an error: once a
            # signal was received, whatever ends the command is that signal's doing.
            if interrupts.received is None:
                raise
            print(f"\nplanc: interrupted by signal {interrupts.received}", file=sys.stderr)
            return 128 + interrupts.received


def _dispatch(argv: Sequence[str] | None, interrupts: Interrupts) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(words[0] if words and words[0] in commands() else None)
    args = parser.parse_args(words)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    args.interrupts = interrupts  # commands that start processes defer signals with it
    args.argv = words  # named in the locks it holds
    command = commands()[args.command]
    if command.keeps_collector:
        return command.run(args)
    with paused():
        return command.run(args)
