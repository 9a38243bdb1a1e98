"""What ``planc run`` settles before its ranks start, and again before each launch of
``--on-failure replan`` (planc.commands.replan): the checkpoint to resume, verified; the
build, verified and small enough for this machine; what the ranks are asked."""

from __future__ import annotations

import os
import sys
import time

from planc.commands import EXIT_OK, EXIT_USAGE, MAX_LOCAL_RANKS, fail, missing_runtime


def checkpoint_found(args):
    """The checkpoint --resume names, found and verified (every file against its sha256,
    every value finite) before anything is compiled or started; (None, EXIT_OK) without
    --resume. A checkpoint is an input: a problem with it is exit status 1."""
    if not args.resume:
        return None, EXIT_OK
    from planc.checkpoint import format as checkpoint

    try:
        return verified_checkpoint(args.resume, args.interrupts), EXIT_OK
    except checkpoint.CheckpointError as exc:
        return None, fail(f"--resume: {exc}")


def verified_checkpoint(path: str, interrupts):
    """The checkpoint at ``path`` (planc.checkpoint.format.find), every file checked
    against its sha256 and every value finite, with a ``note`` saying so; CheckpointError
    if it is not whole."""
    from planc.checkpoint import format as checkpoint

    try:
        with interrupts.deferred():  # torch swallows a Ctrl-C during its import
            from planc.runtime.checkpoint.values import check_values
    except ImportError as exc:  # no torch: the files are checked, planc run says it needs it
        if not missing_runtime(exc):
            raise
        check_values = None
    start = time.perf_counter()
    found = checkpoint.find(path)
    if check_values is not None:
        check_values(found.directory, found.manifest)
    files = found.manifest["files"]
    size = sum(info["bytes"] for info in files.values())
    found.note = (f"planc: checkpoint {found.directory} (step {found.manifest['step']}): "
                  f"{len(files)} files, {size / 1e6:.2f} MB, sha256 and values verified in "
                  f"{time.perf_counter() - start:.3f} s")
    return found


def verified_build(args, directory: str):
    """The build with its programs, verified unless --no-verify, small enough to run here."""
    from planc.build import directory as build
    from planc.verify.verifier import verify_build

    try:
        built = build.read_programs(build.read(directory))
    except build.BuildError as exc:
        return None, fail(str(exc))
    if not args.no_verify:
        report = verify_build(built)
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


def run_options(args, directory: str, backend: str, found=None, identity=None):
    """What the ranks are asked (planc.runtime.options.RunOptions), every path absolute."""
    from planc.runtime.options import RunOptions

    absolute = lambda path: os.path.abspath(path) if path else None  # noqa: E731
    return RunOptions(
        build=os.path.abspath(directory), backend=backend, steps=args.steps or None,
        timeout=args.timeout, metrics=absolute(args.metrics), trace=absolute(args.trace),
        tensorboard=absolute(args.tensorboard), check=args.check,
        checkpoint_dir=absolute(args.checkpoint_dir),
        checkpoint_every=args.checkpoint_every or None, checkpoint_async=args.checkpoint_async,
        straggler_margin=args.straggler_margin,
        # the step directory checked here, its files hashed already
        resume=absolute(found.directory) if found is not None else None,
        resume_verified=found is not None, data_identity=identity,
        peer_memory=getattr(args, "peer_memory_root", None),
        unverified=args.no_verify,
        force=args.force)  # what planc run checked may be replaced: the trace, at its end


def resume_problem(args, found, plan, buckets: dict | None) -> str | None:
    """Why ``plan`` cannot continue from the checkpoint ``found`` (None: from step 0): another
    model or optimizer, no step left to run; with ``buckets`` (the build's), parameters of
    other names or shapes; with --check, steps of the checkpoint trained on other data. None
    if it can."""
    if found is None:
        return None
    from planc.checkpoint import format as checkpoint
    from planc.checkpoint.training_record import TrainingRecord

    record = TrainingRecord.of(plan.to_dict())
    steps = args.steps or plan.train.steps
    problem = checkpoint.problems_resuming(found.manifest, record, buckets, steps)
    if problem is None and args.check:
        problem = checkpoint.problems_checking(found.manifest, record)
    return problem


def before_compiling(args, found, plan) -> int:
    """EXIT_OK if the plan file can run as far as it can be told before it is compiled:
    the checkpoint to resume fits it, and its token files are there, readable and hold a
    sample (their ids are scanned once the build is verified). Else no build is written."""
    status = resumable(args, found, plan)
    if status != EXIT_OK:
        return status
    from planc.data.tokens import DataError, check_file
    from planc.runtime.engine.data import data_files

    evaluation, training = data_files(plan)
    try:
        for token_file in (*training, *evaluation):
            check_file(token_file, seq=plan.model.seq)
    except DataError as exc:
        return fail(f"{exc}; nothing was run")
    return EXIT_OK


def resumable(args, found, plan, buckets=None) -> int:
    """EXIT_OK if ``plan`` can continue from the checkpoint found (None: no --resume), else
    EXIT_ERRORS after saying why: another model or optimizer, no step left to run; with
    --check, steps of the checkpoint trained on other data. Checked on the plan before it
    is compiled, and again on the build's parameters."""
    if found is None:
        return EXIT_OK
    from planc.checkpoint import format as checkpoint
    from planc.checkpoint.training_record import TrainingRecord

    problem = resume_problem(args, found, plan, buckets)
    if problem is not None:
        return fail(f"--resume {found.directory}: {problem}; nothing was run")
    if args.metrics and os.path.isfile(args.metrics) and os.path.getsize(args.metrics):
        from planc.data.metrics_file import read_metrics

        records = read_metrics(args.metrics).records or []  # its problems: _refused's
        other = next((r.get("plan") for r in reversed(records) if r.get("plan")), None)
        if other is not None and other != plan.name:
            return fail(f"--metrics {args.metrics}: holds the steps of plan {other}, and this "
                        f"run trains plan {plan.name}: a resumed run continues its own "
                        f"run's metrics; name another file", EXIT_USAGE)
    if buckets is not None:
        record = TrainingRecord.of(plan.to_dict())
        for note in checkpoint.resume_notes(found.manifest, record):
            print(f"planc: warning: {note}", file=sys.stderr)
    return EXIT_OK
