"""``planc run``: compile if needed, verify, and start every rank on this machine."""

from __future__ import annotations

import os
import sys

from planc.commands import (EXIT_OK, EXIT_USAGE, MAX_LOCAL_RANKS, counted, fail, load_plan,
                            overrides_need_a_plan)


def main(args) -> int:
    refused = _refused(args)
    if refused is not None:
        return refused
    directory, status = _build_directory(args)
    if directory is None:
        return status
    built, status = _verified_build(args, directory)
    if built is None:
        return status
    try:
        from planc.runtime.launch import gpus, launch
        from planc.runtime.model import data_problem
    except ImportError:
        return fail("planc run needs PyTorch: pip install 'planc[run]'")
    problem = data_problem(built.plan)
    if problem:
        return fail(f"{problem}; nothing was run")
    devices = gpus()
    backend = args.backend or ("nccl" if devices else "gloo")
    if backend == "nccl" and devices < built.plan.world:
        return fail(f"the nccl backend needs a GPU per rank: the plan has "
                    f"{built.plan.world} ranks, this machine {devices} GPUs; use --backend "
                    f"gloo or torchrun across nodes", EXIT_USAGE)
    steps = args.steps or built.plan.train.steps
    print(f"planc: running {built.plan.name} on {counted(built.plan.world, 'rank')} "
          f"({backend}), {counted(steps, 'step')}", file=sys.stderr)
    return launch(os.path.abspath(directory), built.plan.world, _worker_arguments(args),
                  backend)


def _refused(args) -> int | None:
    """The exit status of a command line that cannot run, before anything is compiled."""
    if args.set and os.path.isdir(args.file):
        return overrides_need_a_plan(args.file)
    if args.steps is not None and args.steps < 1:
        return fail("--steps must be at least 1", EXIT_USAGE)
    if args.timeout <= 0:
        return fail("--timeout must be positive", EXIT_USAGE)
    for flag, path in (("--metrics", args.metrics), ("--trace", args.trace)):
        parent = os.path.dirname(os.path.abspath(path)) if path else None
        if path and os.path.isdir(path):
            return fail(f"{flag} {path}: is a directory; name a file")
        if parent and not (os.path.isdir(parent) and os.access(parent, os.W_OK)):
            return fail(f"{flag} {path}: cannot write there ({parent} is not a writable "
                        f"directory)")
    return None


def _build_directory(args) -> tuple[str | None, int]:
    """The build directory to run: the one given, or the plan file compiled into one."""
    from planc import build
    from planc.compile import CompileError, compile_plan

    if os.path.isdir(args.file):
        return args.file, EXIT_OK
    loaded, status = load_plan(args)
    if status != EXIT_OK:
        return None, status
    directory = args.output or os.path.join(
        "build", os.path.splitext(os.path.basename(args.file))[0])
    try:
        build.write(compile_plan(loaded.plan), directory, loaded.path, loaded.source)
    except (build.BuildError, CompileError) as exc:
        return None, fail(str(exc))
    return directory, EXIT_OK


def _verified_build(args, directory: str):
    """The build with its programs, verified unless --no-verify, small enough to run here."""
    from planc import build
    from planc.lower.verify import verify

    try:
        built = build.read_programs(build.read(directory))
    except build.BuildError as exc:
        return None, fail(str(exc))
    if not args.no_verify:
        report = verify(built.plan, built.graph, built.programs, built.table, built.groups,
                        built.routes)
        if not report.ok:
            for problem in report.problems:
                print(f"planc: error: {problem}", file=sys.stderr)
            return None, fail("the programs failed verification; nothing was run")
    if built.plan.world > MAX_LOCAL_RANKS:
        return None, fail(f"the plan needs {built.plan.world} ranks and planc run starts "
                          f"every rank on this machine (at most {MAX_LOCAL_RANKS}); on a "
                          f"cluster start `torchrun ... -m planc.runtime.worker {directory}` "
                          f"on every node (docs/programs.md)")
    return built, EXIT_OK


def _worker_arguments(args) -> list[str]:
    out = ["--timeout", str(args.timeout)]
    if args.steps:
        out += ["--steps", str(args.steps)]
    for flag, value in (("--metrics", args.metrics), ("--trace", args.trace)):
        if value:
            out += [flag, os.path.abspath(value)]
    if args.check:
        out.append("--check")
    return out
