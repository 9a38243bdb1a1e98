"""The commands of ``planc``, one module each; ``planc.cli`` parses the command line and
calls them. Each takes the parsed arguments and returns the exit status (README, "Exit
status"): 0 success (warnings allowed), 1 an input is wrong or the work failed (a plan,
build, checkpoint or data file that cannot be used, a held lock, a failed rank), 2 a
wrong command line (a malformed or out-of-range value, options that need or exclude
each other); a signal gives 128 + its number (planc.cli).

Diagnostics go to standard error (or, with ``--error-format json``, to standard output
as one JSON document); requested output goes to standard output.
"""

from __future__ import annotations

import os
import sys
from typing import TextIO

from planc.host.collector import without_collector
from planc.diagnostics import MAX_SHOWN, render_json, render_text, summary_line
from planc.diagnostics import counted

EXIT_OK, EXIT_ERRORS, EXIT_USAGE = 0, 1, 2
MAX_LOCAL_RANKS = 64
GRAPH_FORMATS = ("dot", "svg", "png", "graphml", "json", "html")


def use_color(stream: TextIO) -> bool:
    """Colour only on a terminal, and never when NO_COLOR is set (no-color.org)."""
    if os.environ.get("NO_COLOR"):
        return False
    return hasattr(stream, "isatty") and stream.isatty() and os.environ.get("TERM") != "dumb"


@without_collector  # the plan, and its diagnostics as they are printed (planc.host.collector)
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


RUNTIME_PACKAGES = ("torch", "numpy", "safetensors")  # the optional extra planc[run]


def missing_runtime(exc: ImportError) -> bool:
    """Whether an ImportError says that the runtime's packages are not installed (rather
    than a failure inside planc, which must not pass for a missing torch)."""
    return (exc.name or "").split(".")[0] in RUNTIME_PACKAGES


def overrides_need_a_plan(directory: str) -> int:
    return fail(f"--set needs a .plan file, but {directory} is a directory (a build is "
                f"already compiled); run the plan file with --set instead", EXIT_USAGE)


def fail(message: str, status: int = EXIT_ERRORS) -> int:
    print(f"planc: error: {message}", file=sys.stderr)
    return status


def load_build(args):
    """A build from a directory, or compiled in memory from a plan file."""
    from planc.build import directory as build
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


def load_programs(args, verified: bool = False, rank: int | None = None):
    """The build with its programs. ``verified``: programs read from a build directory
    (untrusted input) must pass planc verify first, for commands that replay them (the
    simulator assumes programs that can run a whole step). ``rank``: the one rank whose
    program is wanted (the others are not read from a directory); a rank outside the
    plan's world is a wrong command line."""
    from planc.build import directory as build

    built, status = load_build(args)
    if built is None:
        return None, status
    world = built.plan.world
    if rank is not None and not 0 <= rank < world:
        return None, fail(f"rank {rank} does not exist; the world has {world} ranks "
                          f"(0..{world - 1})", EXIT_USAGE)
    if built.programs is None:
        try:
            built = build.read_programs(built, rank)
        except build.BuildError as exc:
            return None, fail(str(exc))
        if verified:
            from planc.verify.report import failed_line
            from planc.verify.verifier import verify_build

            report = verify_build(built)
            if not report.ok:
                return None, fail(failed_line(built.path, report))
    return built, EXIT_OK


def command_line(args) -> str:
    """The command line that started this command, for the lock file it holds."""
    import shlex

    argv = getattr(args, "argv", None)
    return shlex.join(["planc", *(argv if argv is not None else [args.command, args.file])])


def take_lock(lock, what: str, hint: str):
    """``lock()`` (planc.host.locks): (the lock, EXIT_OK), or (None, EXIT_ERRORS) after saying
    that ``what`` is in use, by whom, and ``hint``; (None, EXIT_USAGE) where a file of
    someone else's is in the lock file's place (README, "Outputs": status 2)."""
    from planc.host.locks import ForeignLockFile, LockError, LockHeld

    try:
        return lock(), EXIT_OK
    except LockHeld as exc:
        return None, fail(f"{what} is in use by planc ({exc.holder}); {hint}")
    except ForeignLockFile as exc:
        return None, fail(str(exc), EXIT_USAGE)
    except LockError as exc:
        return None, fail(str(exc))


def replaceable(directory: str, loaded, force: bool):
    """Whether compiling the plan ``loaded`` into ``directory`` may replace what it holds:
    (planc.build.directory.Earlier or None, EXIT_OK), or (None, EXIT_USAGE) after saying why
    not (README, "Outputs": a refused output is status 2).
    The build of another plan file is never replaced without ``--force``; an earlier
    version of the same plan is (the edit-compile loop)."""
    from planc.build import directory as build

    manifest = os.path.join(directory, build.MANIFEST)
    if os.path.isdir(directory) and not os.path.isfile(manifest) and os.listdir(directory):
        # a directory of your own, whatever the flags
        return None, fail(f"{directory} exists and is not a planc build directory (no "
                          f"{build.MANIFEST}); refusing to overwrite it", EXIT_USAGE)
    earlier = build.earlier_build(directory, loaded.plan, loaded.path, loaded.source)
    if earlier is not None and earlier.kind == "foreign":  # whatever the flags
        return None, fail(f"{directory} holds files planc did not write where a build's own "
                          f"go (build.json, plan.json, graph.json, summary.json, programs/); "
                          f"refusing to replace them: compile elsewhere with -o DIR",
                          EXIT_USAGE)
    if earlier is not None and earlier.kind == "other" and not force:
        return None, fail(f"{directory} holds the build of {_shown(earlier.source)} (another "
                          f"plan); compile elsewhere with -o DIR, or replace it with --force",
                          EXIT_USAGE)
    return earlier, EXIT_OK


def say_replaced(directory: str, earlier) -> None:
    """One line on standard error after a build replaced another (``earlier``)."""
    if earlier is None or earlier.kind == "same":
        return
    what = {"earlier": f"which held an earlier build of {_shown(earlier.source)}",
            "other": f"which held the build of {_shown(earlier.source)} (another plan; "
                     f"--force)",
            "damaged": "whose build.json could not be read"}[earlier.kind]
    kept = [(name if name.isprintable() else repr(name)) + "/" * os.path.isdir(
        os.path.join(directory, name)) for name in earlier.kept]
    logs = ""
    if kept:
        shown = kept[0] if len(kept) == 1 else ", ".join(kept[:-1][:4]) + (
            f" and {kept[-1]}" if len(kept) <= 5 else f" and {len(kept) - 4} more")
        verb = "is" if len(kept) == 1 and not kept[0].endswith("/") else "are"
        logs = f"; its {shown} {verb} kept in the new build"
    print(f"planc: replaced {directory}, {what}{logs}", file=sys.stderr)


def _shown(path: str | None) -> str:
    """A path read from a build (untrusted): as it is, or quoted if it holds control
    characters."""
    return path if path and path.isprintable() else repr(path)


def outputs_refused(args, inputs: tuple[tuple[str, str | None], ...] = (),
                    paths: dict[str, str] | None = None, append: bool = False,
                    members=None, made: str | None = None) -> int | None:
    """Check every output path of the command line against planc.host.outputs' rule, before
    any work: None if all may be written, else the exit status after saying why.
    ``inputs``: (what, path) of what the command reads; ``paths``: the path an output
    takes when its flag is not given (a build's default directory); ``append``: a
    resumed run continues its metrics and logs; ``members``: for a directory output, the
    names of the files it writes there; ``made``: a directory the command creates
    first (a run's build), in which an output may be named."""
    from planc.host import outputs
    from planc.host.output_kinds import BY_KEY

    declared = []
    for dest, flag, key in getattr(args, "outputs", ()):
        path = getattr(args, dest, None) or (paths or {}).get(dest)
        if path is None:
            continue
        if key == "export":
            key = "hf" if args.format == "hf" else "chakra"
        declared.append(outputs.Output(flag, path, BY_KEY[key], members))
    refusal = outputs.first_problem(declared, getattr(args, "force", False), append,
                                    [(what, path) for what, path in inputs if path],
                                    None if made is None else os.path.realpath(made))
    return None if refusal is None else fail(refusal.message, refusal.status)


def the_input(path: str) -> tuple[str, str]:
    """(what, path) of a command's plan file or build directory, for outputs_refused."""
    return ("the build directory" if os.path.isdir(path) else "the plan file", path)


def verified_line(built) -> str:
    return (f"verified {counted(len(built.programs), 'program')} for "
            f"{counted(built.plan.world, 'rank')}: collectives in the same order on every "
            f"group, every send matched, no deadlock, every wait after its record, no buffer "
            f"overwritten in flight")
