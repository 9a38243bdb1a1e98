"""``planc run``: compile if needed, verify, and start every rank on this machine."""

from __future__ import annotations

import errno
import os
import sys

from planc.commands import (EXIT_OK, EXIT_USAGE, command_line, counted, fail,
                            load_plan, missing_runtime, outputs_refused, overrides_need_a_plan,
                            replaceable, say_replaced, take_lock, the_input)
from planc.commands.run_outputs import prepare_outputs
from planc.commands.run_prepare import (before_compiling, checkpoint_found, resumable,
                                       run_options, verified_build)
from planc.commands.arguments import Command, add_input, force, output, path
from planc.data.metrics_file import MAX_STEP
from planc.host.files import held_pipe


def main(args) -> int:
    refused = _refused(args)
    if refused is not None:
        return refused
    # The build directory and the checkpoint directory are this run's until the launch
    # returns: another run or compile would replace them, logs and checkpoints included.
    locks, status = _locks(args)
    if locks is None:
        return status
    pipes = []
    try:
        # the reader of a metrics or trace pipe, found before any work rather than by the
        # rank that writes to it, and held so that it sees one end of file, the run's
        for flag, given in (("--metrics", args.metrics), ("--trace", args.trace)):
            try:
                pipes.append(held_pipe(given) if given else None)
            except OSError as exc:
                return fail(f"{flag} {given}: {exc.strerror}; nothing was run")
        return _run(args)
    finally:
        for pipe in pipes:
            if pipe is not None:
                os.close(pipe)
        if args.checkpoint_dir:  # still locked: no other run can be writing there
            from planc.commands.run_outputs import remove_staging

            remove_staging(args.checkpoint_dir)
        for lock in reversed(locks):
            lock.release()


def _run(args) -> int:
    """Everything after the command line was accepted and the directories were locked."""
    found, status = checkpoint_found(args)
    if status != EXIT_OK:
        return status
    directory, status = _build_directory(args, lambda plan: before_compiling(args, found,
                                                                               plan))
    if directory is None:
        return status
    built, status = verified_build(args, directory)
    if built is None:
        return status
    status = resumable(args, found, built.plan, built.graph.graph["buckets"])
    if status != EXIT_OK:
        return status
    if found is None and built.plan.train.init is not None:
        # the checkpoint to start from, as it is now, before any rank starts: a build
        # compiled earlier was checked against the files of then
        from planc.hf.init import HFCheckpointError, check_init

        try:
            check_init(built.plan.train.init, built.plan.model)
        except HFCheckpointError as exc:
            return fail(f"{exc}; nothing was run")
    try:
        # torch swallows a KeyboardInterrupt raised while it imports numpy: signals wait
        # until the import is done (planc.host.interrupts)
        with args.interrupts.deferred():
            from planc.runtime.engine.data import DataError, check_data, import_scanner
            from planc.runtime.launcher.launch import fork_server_problem, gpus, launch

            devices = gpus()  # imports torch on a CUDA build: here, with signals deferred
            import_scanner(built.plan)  # and to scan a token file
    except ImportError as exc:
        if not missing_runtime(exc):
            raise
        return fail(f"planc run needs PyTorch ({exc}): pip install 'planc[run]'")
    try:  # the file as it is now is what every rank must read (issue 20)
        identity = check_data(built.plan)
    except DataError as exc:
        return fail(f"{exc}; nothing was run")
    backend = args.backend or ("nccl" if devices else "gloo")
    if backend == "nccl" and devices < built.plan.world:
        return fail(f"the nccl backend needs a GPU per rank: the plan has "
                    f"{built.plan.world} ranks, this machine {devices} GPUs; use --backend "
                    f"gloo or torchrun across nodes")
    problem = fork_server_problem(backend)
    if problem:
        return fail(problem)
    logs = os.path.join(directory, "logs")
    if os.path.islink(logs) or (os.path.lexists(logs) and not os.path.isdir(logs)):
        return fail(f"{logs} is {'a symbolic link' if os.path.islink(logs) else 'not a directory'}"
                    f"; every rank's output is written there, inside the build only: remove "
                    f"it")
    steps = args.steps or built.plan.train.steps
    first = found.manifest["step"] if found else 0
    resumed = f" (steps {first}..{steps - 1}, resumed from {found.directory})" if found else ""
    if found:
        for skipped in found.skipped:
            print(f"planc: warning: --resume passed over a checkpoint: {skipped}",
                  file=sys.stderr)
        print(found.note, file=sys.stderr)
    if args.checkpoint_peer_memory and \
            built.plan.world // built.plan.topology.devices_per_node < 2:
        return fail(f"--checkpoint-peer-memory keeps each copy on another node, and the "
                    f"plan's {counted(built.plan.world, 'rank')} are one node (topology "
                    f"devices_per_node {built.plan.topology.devices_per_node}); nothing "
                    f"was run")
    source = None
    if args.on_failure == "replan":  # the text its layouts are searched from, checked now
        from planc.commands.replan import plan_source

        source = plan_source(args, built)
        if isinstance(source, str):
            return fail(f"--on-failure replan: {source}; nothing was run")
    if args.checkpoint_peer_memory:
        from planc.checkpoint import peer_copy

        try:
            args.peer_memory_root = peer_copy.make_root()
        except OSError as exc:
            return fail(f"--checkpoint-peer-memory: {exc}; nothing was run")
    try:
        prepare_outputs(args)  # the last step before the ranks: nothing failed before it
    except OSError as exc:
        _forget_peer_memory(args)
        return fail(f"cannot prepare {exc.filename or 'the outputs'} ({exc.strerror or exc});"
                    f" nothing was run")
    print(f"planc: running {built.plan.name} from {directory} on "
          f"{counted(built.plan.world, 'rank')} ({backend}), "
          f"{counted(steps - first, 'step')}{resumed}", file=sys.stderr)
    try:
        options = run_options(args, directory, backend, found, identity)
        if args.on_failure == "replan":
            from planc.commands.replan import keep_training

            return keep_training(args, built, directory, options, found, source,
                                 args.interrupts)
        return launch(options, built.plan.world, args.interrupts)
    finally:
        _forget_peer_memory(args)


def _forget_peer_memory(args) -> None:
    """--checkpoint-peer-memory: the run's host memory is gone with it."""
    if getattr(args, "peer_memory_root", None):
        from planc.checkpoint.peer_copy import remove

        remove(args.peer_memory_root)


MAX_TIMEOUT_S = 7 * 24 * 3600


def _refused(args) -> int | None:
    """The exit status of a command line that cannot run, before anything is compiled."""
    if args.set and os.path.isdir(args.file):
        return overrides_need_a_plan(args.file)
    if args.output and os.path.isdir(args.file):
        return fail(f"-o names the build directory a plan file is compiled into, but "
                    f"{args.file} is a build directory already; run it without -o",
                    EXIT_USAGE)
    if args.steps is not None and not 1 <= args.steps <= MAX_STEP:  # what metrics record
        return fail("--steps must be a number of steps from 1 to 10^12", EXIT_USAGE)
    if not 0 < args.timeout <= MAX_TIMEOUT_S:  # also refuses nan
        return fail(f"--timeout must be a number of seconds above 0 and at most "
                    f"{MAX_TIMEOUT_S} (a week), not {args.timeout:g}", EXIT_USAGE)
    if args.checkpoint_every is not None:
        if not args.checkpoint_dir:
            return fail("--checkpoint-every needs --checkpoint-dir", EXIT_USAGE)
        if not 1 <= args.checkpoint_every <= MAX_STEP:
            return fail("--checkpoint-every must be a number of steps from 1 to 10^12",
                        EXIT_USAGE)
    if args.checkpoint_async and not args.checkpoint_dir:
        return fail("--checkpoint-async needs --checkpoint-dir", EXIT_USAGE)
    if args.checkpoint_peer_memory and not args.checkpoint_dir:
        return fail("--checkpoint-peer-memory needs --checkpoint-dir", EXIT_USAGE)
    if args.on_failure == "replan" and not args.checkpoint_dir:
        return fail("--on-failure replan needs --checkpoint-dir: a run goes on from its "
                    "newest checkpoint (with --checkpoint-every N, at most N steps back)",
                    EXIT_USAGE)
    if not 0 < args.straggler_margin <= 100:  # also refuses nan
        return fail(f"--straggler-margin must be above 0 and at most 100 (a fraction: 0.2 "
                    f"is 20 % slower than the peers), not {args.straggler_margin:g}",
                    EXIT_USAGE)
    build_dir = _build_path(args)
    for flag, path in (("--checkpoint-dir", args.checkpoint_dir), ("--resume", args.resume)):
        if path and _inside(path, build_dir):
            return fail(f"{flag} {path} is inside the build directory {build_dir}, which "
                        f"compiling replaces as a whole; keep checkpoints elsewhere",
                        EXIT_USAGE)
    for flag, path in (("--metrics", args.metrics), ("--trace", args.trace),
                       ("--tensorboard", args.tensorboard)):
        if path and args.checkpoint_dir and _inside(path, args.checkpoint_dir):
            return fail(f"{flag} {path}: is inside --checkpoint-dir {args.checkpoint_dir}, "
                        f"which holds only checkpoints; name a path outside it", EXIT_USAGE)
    if args.tensorboard:
        from planc.commands.run_outputs import tensorboard_missing

        problem = tensorboard_missing()
        if problem:
            return fail(problem)
    # every output path at once (planc.host.outputs): a resumed run continues its metrics and
    # TensorBoard logs; a build directory given to run is its input, not an output
    given = os.path.isdir(args.file)
    # (--resume is no input here: a run continues the checkpoint directory it resumed from)
    refused = outputs_refused(args, (the_input(args.file),),
                              {} if given else {"output": build_dir}, append=bool(args.resume),
                              made=None if given else build_dir)
    if refused is not None:
        return refused
    if args.resume and args.metrics and os.path.isfile(args.metrics) and \
            os.path.getsize(args.metrics):
        # the file this run continues must stay one that plot and report read
        from planc.data.metrics_file import read_metrics

        problem = read_metrics(args.metrics).problem
        if problem:
            return fail(f"--metrics: {problem}; a resumed run appends only to a metrics "
                        f"file planc plot and planc report can read", EXIT_USAGE)
    if args.checkpoint_dir:
        from planc.commands.run_outputs import checkpoint_dir_problem

        problem = checkpoint_dir_problem(args.checkpoint_dir, args.resume, args.force)
        if problem:
            return fail(problem, EXIT_USAGE)
    for flag, path in (("--metrics", args.metrics), ("--trace", args.trace)):
        parent = os.path.dirname(os.path.realpath(path)) if path else None
        if parent and _full(parent):
            return fail(f"{flag} {path}: the file system of {parent} is full (less than "
                        f"{MIN_FREE_BYTES // 2**20} MiB free)")
    if args.tensorboard:
        existing = os.path.abspath(args.tensorboard)  # the directory, or what will hold it
        while not os.path.exists(existing):
            existing = os.path.dirname(existing)
        if _full(existing):  # as --metrics: a full disk at the start is refused
            return fail(f"--tensorboard {args.tensorboard}: the file system of {existing} is "
                        f"full (less than {MIN_FREE_BYTES // 2**20} MiB free)")
    logs = os.path.abspath(build_dir if os.path.isdir(build_dir) else
                           os.path.dirname(os.path.abspath(build_dir)) or ".")
    if os.path.isdir(logs) and _full(logs):
        return fail(f"the file system of {logs} is full (less than "
                    f"{MIN_FREE_BYTES // 2**20} MiB free): the build and every rank's log "
                    f"are written there")
    return None


MIN_FREE_BYTES = 2**20  # a run writes its logs, metrics and trace: refuse a full disk first


def _full(directory: str) -> bool:
    try:
        info = os.statvfs(directory)
    except OSError:
        return False
    return info.f_bavail * info.f_frsize < MIN_FREE_BYTES


def _inside(path: str, directory: str) -> bool:
    path, directory = os.path.realpath(path), os.path.realpath(directory)
    return os.path.commonpath([path, directory]) == directory


def _build_path(args) -> str:
    """The build directory the run uses: the one given, or where the plan compiles to."""
    if os.path.isdir(args.file):
        return args.file
    return args.output or os.path.join("build", os.path.splitext(os.path.basename(
        args.file))[0])


def _locks(args):
    """The locks of the build directory, of --checkpoint-dir and of the metrics, trace
    and TensorBoard paths (planc.host.locks), or (None, the status after saying who holds
    one)."""
    from planc.commands.run_outputs import output_locks
    from planc.host.locks import LockError, lock_beside, lock_build, lock_inside

    holder, directory = command_line(args), _build_path(args)
    given = os.path.isdir(args.file)

    def build_lock():
        try:
            return lock_build(directory, holder)
        except LockError as exc:
            # A build whose parent this user cannot write cannot be replaced by a compile
            # of this user either: a lock inside it keeps two runs of it apart.
            if given and exc.errno in (errno.EACCES, errno.EPERM):
                return lock_inside(directory, holder)
            raise

    hint = "wait for it to finish" + ("" if given else " or use another -o")
    builds, status = take_lock(build_lock, directory, hint)
    if builds is None:
        return None, status
    held = [builds]
    wanted = [(lambda: lock_inside(args.checkpoint_dir, holder), f"--checkpoint-dir "
               f"{args.checkpoint_dir}", "wait for it to finish or use another "
               "--checkpoint-dir")] if args.checkpoint_dir else []
    wanted += [(lambda path=path: lock_beside(path, holder), f"{flag} {path}",
                f"wait for it to finish or use another {flag}")
               for flag, path in output_locks(args, directory)]
    for lock, what, hint in wanted:
        taken, status = take_lock(lock, what, hint)
        if taken is None:
            for lock in reversed(held):
                lock.release()
            return None, status
        held.append(taken)
    return held, EXIT_OK


def _build_directory(args, precheck=None) -> tuple[str | None, int]:
    """The build directory to run: the one given, or the plan file compiled into one
    (once ``precheck(plan)`` found nothing wrong with the plan). A build of the same plan
    already there is run as it is (its logs stay); one of another plan file is not
    replaced without --force."""
    from planc.build import directory as build
    from planc.compile import CompileError, compile_plan

    if os.path.isdir(args.file):
        return args.file, EXIT_OK
    loaded, status = load_plan(args)
    if status != EXIT_OK:
        return None, status
    if precheck is not None:
        status = precheck(loaded.plan)
        if status != EXIT_OK:
            return None, status
    directory = _build_path(args)
    earlier, status = replaceable(directory, loaded, args.force)
    if status != EXIT_OK:
        return None, status
    if earlier is not None and earlier.kind == "same":
        return directory, EXIT_OK
    try:
        build.write(compile_plan(loaded.plan), directory, loaded.path, loaded.source)
    except (build.BuildError, CompileError) as exc:
        return None, fail(str(exc))
    say_replaced(directory, earlier)
    return directory, EXIT_OK


def add_arguments(parser) -> None:
    """The arguments of planc run."""
    add_input(parser, "FILE|DIR")
    output(parser, "-o", "--output", kind="build", metavar="DIR",
           help="where to compile a plan file [build/NAME]")
    force(parser, "a build of another plan file in DIR, or an earlier run's metrics, trace, "
          "TensorBoard logs or checkpoints at the paths given")
    parser.add_argument("--steps", type=int, metavar="N",
                        help="steps from the start of training, also with --resume [the plan's "
                        "train.steps]")
    parser.add_argument("--backend", choices=("gloo", "nccl"),
                        help="[nccl where CUDA is present, else gloo]")
    output(parser, "--metrics", kind="metrics", metavar="M.jsonl",
           help="one JSON object per step (a resumed run continues the file)")
    output(parser, "--trace", kind="run-trace", metavar="T.json",
           help="Chrome trace of every rank's streams")
    parser.add_argument("--check", action="store_true",
                        help="also train in one process and compare every loss and parameter")
    parser.add_argument("--timeout", type=float, default=120.0, metavar="S",
                        help="seconds without progress before every rank reports a hang [120]")
    parser.add_argument("--no-verify", action="store_true",
                        help="run programs without verifying them (to debug a broken build)")
    output(parser, "--checkpoint-dir", kind="checkpoints", metavar="D",
           help="write a consolidated checkpoint (whole fp32 tensors in safetensors, "
           "optimizer state, data position) into D/step-NNNNNN after the last step, and "
           "after every N-th with --checkpoint-every; any plan of the same model can "
           "resume from it (docs/checkpoints.md)")
    parser.add_argument("--checkpoint-every", type=int, metavar="N",
                        help="with --checkpoint-dir: also after every N-th step")
    parser.add_argument("--straggler-margin", type=float, default=0.2, metavar="F",
                        help="name, on the progress line and in the metrics, a rank whose "
                        "compute stream is busy more than 1 + F times its "
                        "stage peers' for 5 steps in a row [0.2]")
    parser.add_argument("--checkpoint-async", action="store_true",
                        help="with --checkpoint-dir: copy each checkpoint's state out at the "
                        "step boundary and write it from a background thread while the next "
                        "steps train (committed atomically as ever; the next checkpoint waits "
                        "for it)")
    parser.add_argument("--checkpoint-peer-memory", action="store_true",
                        help="with --checkpoint-dir: also a checkpoint after every step in host "
                        "memory, each stage's part on its writer's node and on the next node "
                        "(Gemini); --on-failure replan goes on from it when it is newer than "
                        "the file system's")
    parser.add_argument("--on-failure", choices=("stop", "replan"), default="stop",
                        help="when a rank is lost (killed, or stopped for --timeout): stop "
                        "every rank, or replan: go on by itself on the fastest layout of the "
                        "devices left that resumes from the newest checkpoint, and grow back "
                        "onto all of them at the checkpoint after a SIGUSR1 [stop]")
    parser.add_argument("--resume", metavar="D", type=path,
                        help="continue from the newest complete checkpoint in D (or from D, a "
                        "step-NNNNNN directory), under any layout of the same model; steps "
                        "count from the start of training: with train.steps = 4 (or --steps "
                        "4) a step-2 checkpoint runs steps 2 and 3")
    output(parser, "--tensorboard", kind="tensorboard", metavar="DIR",
           help="write every step's loss, lr, grad norm, tokens/s, TFLOP/s, MFU, exposed "
           "communication and step time as TensorBoard scalars into DIR (docs/metrics.md)")


# planc.cli adds these to its command line, in this order.
COMMANDS = (
    Command("run", add_arguments, main,
            help="train for real: every rank on this machine, torch.distributed",
            description="Compile the plan if given a file, verify its programs, and run every "
                        "rank on this machine with torch.distributed (NCCL with CUDA streams on "
                        "GPUs, gloo on CPUs). For a cluster, start `torchrun ... -m "
                        "planc.runtime.worker DIR` on every node instead.",
            keeps_collector=True),
)
