"""What the commands' arguments share: the input file, output paths declared with their
kind, ``--force``, ``--set``, and the value types argparse checks (a bad value exits with
status 2 and one line, never a traceback).

Each command module declares its own arguments (``add_arguments``) and lists itself in
its ``COMMANDS``; :mod:`planc.cli` adds them to the command line in order.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable

from planc.host.outputs import path  # noqa: F401 (the commands' type of a path)


@dataclass(frozen=True)
class Command:
    """One ``planc`` command: its name, its arguments and the function that runs it
    (which takes the parsed arguments and returns the exit status)."""

    name: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    help: str
    description: str
    # A command that starts processes or searches for long (run, tune, calibrate) keeps
    # CPython's cyclic collector; every other one is short and runs with it paused
    # (planc.host.collector): on a build of a thousand layers, verify spent a third of
    # its time in collections that found nothing.
    keeps_collector: bool = False


def add_input(parser: argparse.ArgumentParser, metavar: str = "FILE") -> None:
    from planc.diagnostics import MAX_SHOWN

    parser.add_argument("file", metavar=metavar, type=path,
                        help="a .plan file" + (" or a build directory" if "DIR" in metavar
                                               else ""))
    parser.add_argument("--error-format", choices=("text", "json"), default="text",
                        help="how to print diagnostics (json: one document on stdout)")
    parser.add_argument("--max-errors", type=count, metavar="N", default=None,
                        help=f"print at most N diagnostics, then count the rest (default: "
                        f"{MAX_SHOWN} as text, all as json; 0: all)")
    add_overrides(parser)


def output(parser: argparse.ArgumentParser, *flags: str, kind: str, **options) -> None:
    """An output path: declared with its kind (planc.host.outputs), so that the command
    checks it before any work and no output flag escapes the rule (tests/test_outputs.py)."""
    action = parser.add_argument(*flags, type=path, **options)
    declared = parser.get_default("outputs") or ()
    parser.set_defaults(outputs=(*declared, (action.dest, flags[0], kind)))


def force(parser: argparse.ArgumentParser, what: str = "an output of the same kind that "
          "planc wrote earlier") -> None:
    parser.add_argument("--force", action="store_true", help=f"replace {what} (README, "
                        f"\"Outputs\")")




def add_overrides(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--set", action="append", type=override, metavar="KEY=VALUE",
                        help="override a key of the plan, such as --set mesh.tp=4 or --set "
                        "'train.optimizer=adamw(lr = 3e-4)' (repeatable; docs/language.md)")


def count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} is negative")
    return value


def override(text: str) -> str:
    from planc.lang.overrides import override_argument  # a malformed one exits with 2

    return override_argument(text)


def override_of_b(text: str) -> str:
    """diff's ``--set-b``: an override whose diagnostics name that option."""
    from planc.lang.overrides import override_argument

    return override_argument(text, "--set-b")


def int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, got "
                                         f"{text!r}") from None
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected non-negative integers, got {text!r}")
    return values


def layer_range(text: str) -> tuple[int, int]:
    first, _, last = text.partition("..")
    try:
        low, high = int(first), int(last or first)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a layer N or a range A..B, got "
                                         f"{text!r}") from None
    if low < 0 or high < low:
        raise argparse.ArgumentTypeError(f"{text!r} is not a range of layers")
    return low, high


def microbatches(text: str) -> tuple[int, ...] | str:
    return "all" if text == "all" else int_list(text)
