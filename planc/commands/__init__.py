"""The commands of ``planc``, one module each; ``planc.cli`` parses the command line and
calls them. Each takes the parsed arguments and returns the exit status: 0 success
(warnings allowed), 1 errors in the input, 2 a wrong command line.

Diagnostics go to standard error (or, with ``--error-format json``, to standard output
as one JSON document); requested output goes to standard output.
"""

from __future__ import annotations

import os
import sys
from typing import TextIO

from planc.collector import without_collector
from planc.diagnostics import MAX_SHOWN, render_json, render_text, summary_line
from planc.words import counted

EXIT_OK, EXIT_ERRORS, EXIT_USAGE = 0, 1, 2
MAX_LOCAL_RANKS = 64
GRAPH_FORMATS = ("dot", "svg", "png", "graphml", "json", "html")


def use_color(stream: TextIO) -> bool:
    """Colour only on a terminal, and never when NO_COLOR is set (no-color.org)."""
    if os.environ.get("NO_COLOR"):
        return False
    return hasattr(stream, "isatty") and stream.isatty() and os.environ.get("TERM") != "dumb"


@without_collector  # the plan, and its diagnostics as they are printed (planc.collector)
def load_plan(args) -> tuple[object, int]:
    """Load the plan named on the command line and print its diagnostics."""
    from planc.lang import load_file

    loaded = load_file(args.file, getattr(args, "set", None) or ())
    limit = getattr(args, "max_errors", None)
    if args.error_format == "json":
        if loaded.diagnostics or not loaded.ok:
            print(render_json(loaded.diagnostics, loaded.path, limit))
    elif loaded.diagnostics:
        text = render_text(loaded.diagnostics, loaded.path, loaded.source, use_color(sys.stderr),
                           MAX_SHOWN if limit is None else limit)
        print(text, file=sys.stderr)
        print(summary_line(loaded.diagnostics), file=sys.stderr)
    return loaded, (EXIT_OK if loaded.ok else EXIT_ERRORS)


def overrides_need_a_plan(directory: str) -> int:
    return fail(f"--set needs a .plan file, but {directory} is a directory (a build is "
                f"already compiled); run the plan file with --set instead", EXIT_USAGE)


def fail(message: str, status: int = EXIT_ERRORS) -> int:
    print(f"planc: error: {message}", file=sys.stderr)
    return status


def load_build(args):
    """A build from a directory, or compiled in memory from a plan file."""
    from planc import build
    from planc.compile import CompileError, compile_plan

    if os.path.isdir(args.file):
        if args.set:
            return None, overrides_need_a_plan(args.file)
        try:
            return build.read(args.file), EXIT_OK
        except build.BuildError as exc:
            return None, fail(str(exc))
    loaded, status = load_plan(args)
    if status != EXIT_OK:
        return None, status
    try:
        return compile_plan(loaded.plan), EXIT_OK
    except (build.BuildError, CompileError) as exc:
        return None, fail(str(exc))


def load_programs(args, verified: bool = False):
    """The build with its programs. ``verified``: programs read from a build directory
    (untrusted input) must pass planc verify first, for commands that replay them (the
    simulator assumes programs that can run a whole step)."""
    from planc import build

    built, status = load_build(args)
    if built is None:
        return None, status
    if built.programs is None:
        try:
            built = build.read_programs(built)
        except build.BuildError as exc:
            return None, fail(str(exc))
        if verified:
            from planc.lower.verify import verify

            report = verify(built.plan, built.graph, built.programs, built.table,
                            built.groups, built.routes)
            if not report.ok:
                count = len(report.problems)
                return None, fail(f"the programs of {built.path} fail verification: "
                                  f"{report.problems[0]}" + (
                                      f" (and {counted(count - 1, 'more problem')}; planc "
                                      f"verify {built.path} lists them)" if count > 1 else
                                      ""))
    return built, EXIT_OK


def verified_line(built) -> str:
    return (f"verified {counted(len(built.programs), 'program')} for "
            f"{counted(built.plan.world, 'rank')}: collectives in the same order on every "
            f"group, every send matched, no deadlock, every wait after its record, no buffer "
            f"overwritten in flight")
