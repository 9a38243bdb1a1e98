"""What ``planc run`` does with its outputs besides checking their paths
(planc.host.outputs): the tensorboard package it needs, the checkpoint directory's history,
and, once everything else has passed, the metrics, logs and checkpoints an explicit
``--force`` replaces or a resumed run continues. Without torch or tensorboard."""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys

from planc.host.output_kinds import TENSORBOARD_SUFFIX, checkpoint_directory


def tensorboard_missing() -> str | None:
    """Why --tensorboard cannot work at all here, or None."""
    if importlib.util.find_spec("tensorboard") is None:
        return ("--tensorboard needs the tensorboard package, which is not installed: "
                "pip install 'planc[run]'")
    return None


def _within(path: str, directory: str) -> bool:
    path, directory = os.path.realpath(path), os.path.realpath(directory)
    return os.path.commonpath([path, directory]) == directory


def _steps(directory: str) -> list[str]:
    from planc.checkpoint.format import STEP_DIR

    return sorted((e for e in os.listdir(directory) if STEP_DIR.fullmatch(e)),
                  key=lambda e: int(STEP_DIR.fullmatch(e).group(1)))


def continues(directory: str, resume: str | None) -> bool:
    """Whether a run writing checkpoints into ``directory`` continues the checkpoints
    there: it resumes from that directory or one of its step directories."""
    return bool(resume) and _within(resume, directory)


def checkpoint_dir_problem(directory: str, resume: str | None, force: bool) -> str | None:
    """Why ``--checkpoint-dir`` cannot take this run's checkpoints, or None: a directory
    of other files (planc.checkpoint.format.writable_problem), or the checkpoints of another
    run, which only a run resumed from them continues and only --force replaces."""
    from planc.checkpoint.format import writable_problem

    problem = writable_problem(directory)
    if problem or not os.path.isdir(directory) or not checkpoint_directory(directory):
        return problem
    if continues(directory, resume) or force:
        return None
    steps = _steps(directory)
    held = (f"{len(steps)} checkpoint{'s' * (len(steps) != 1)} of another run (the newest: "
            f"{steps[-1]})" if steps else "the checkpoints of another run")
    return (f"--checkpoint-dir {directory}: holds {held}; continue them with --resume "
            f"{directory}, replace them with --force, or name another directory")


def output_locks(args, build: str) -> list[tuple[str, str]]:
    """(flag, path) of the run's outputs that it locks while it runs (planc.host.locks, a
    sibling lock file): files and directories, not devices or pipes it writes into, and
    not those inside its build directory, which the build's own lock holds."""
    out = []
    for flag, path in (("--metrics", args.metrics), ("--trace", args.trace),
                       ("--tensorboard", args.tensorboard)):
        if not path or _within(path, build):
            continue
        real = os.path.realpath(path)
        if os.path.exists(real) and not (os.path.isfile(real) or os.path.isdir(real)):
            continue
        out.append((flag, real))
    return out


def prepare_outputs(args) -> None:
    """Just before the ranks start, with every check passed and every lock held: a
    resumed run's metrics lose a partial last record (a run stopped while writing it)
    so that its own records follow whole lines; --force empties what it replaces: an
    earlier run's metrics file, its TensorBoard event files, the checkpoints of another
    run in --checkpoint-dir."""
    from planc.host.files import write_atomically

    if args.metrics and os.path.isfile(args.metrics) and os.path.getsize(args.metrics):
        if args.resume:
            drop_partial_record(args.metrics)
        else:  # --force (planc.host.outputs refused it otherwise): a new, empty file
            write_atomically(args.metrics, b"")
    if args.tensorboard and args.force and not args.resume and os.path.isdir(args.tensorboard):
        for name in os.listdir(args.tensorboard):
            if "tfevents" in name and name.endswith(TENSORBOARD_SUFFIX):
                os.unlink(os.path.join(args.tensorboard, name))
    directory = args.checkpoint_dir
    if directory and args.force and os.path.isdir(directory) and \
            checkpoint_directory(directory) and not continues(directory, args.resume):
        from planc.checkpoint.format import LATEST

        steps = _steps(directory)
        for name in [*steps, LATEST]:
            path = os.path.join(directory, name)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            elif os.path.lexists(path):
                os.unlink(path)
        print(f"planc: --force: removed the {len(steps)} checkpoint"
              f"{'s' * (len(steps) != 1)} of another run from {directory}", file=sys.stderr)


def remove_staging(directory: str) -> None:
    """After a run, while its lock on ``directory`` is still held: the staging
    directories of checkpoints it did not finish (a full disk, a failed or stopped rank),
    which nothing reads and which would hold the space (planc.checkpoint.format)."""
    from pathlib import Path

    from planc.checkpoint.format import STAGING, not_ours

    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        path = os.path.join(directory, name)
        # only what a checkpoint's writing leaves: never a file of yours put there
        if STAGING.fullmatch(name) and not os.path.islink(path) \
                and not_ours(Path(directory), name) is None:
            shutil.rmtree(path, ignore_errors=True)


def drop_partial_record(path: str) -> None:
    with open(path, "rb+") as handle:
        size = handle.seek(0, os.SEEK_END)
        tail = b""
        while b"\n" not in tail and len(tail) < size:  # back to the last whole line
            step = min(size - len(tail), 1 << 16)
            handle.seek(size - len(tail) - step)
            tail = handle.read(step) + tail
        keep = size - len(tail) + tail.rfind(b"\n") + 1
        if keep < size:
            handle.truncate(keep)
            print(f"planc: warning: --metrics {path} ended with a partial record (a run "
                  f"stopped while writing it); it was dropped before this run's records",
                  file=sys.stderr)
