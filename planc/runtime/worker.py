"""One rank of a training run: ``python -m planc.runtime.worker BUILD_DIR [options]``.

Started by ``planc run`` or by torchrun on a cluster, e.g. on each of 2 nodes:

    torchrun --nnodes 2 --node-rank I --nproc-per-node 4 --master-addr HOST \\
        --master-port 29500 -m planc.runtime.worker build/gpt-tiny --steps 10

It reads its rank from the environment torchrun sets, loads the build directory, checks
that the world matches the plan, runs its stage's program for every step, and reports:
the rank of the loss's stage (the last, or stage 0 in a V) with tp = cp = dp = 0 prints
the progress and writes the metrics; rank 0 writes the Chrome trace and, with
``--check``, compares the run with the single-process reference. ``--checkpoint-dir``
writes consolidated checkpoints at step boundaries and ``--resume`` continues from one,
under any layout of the same model (planc.runtime.checkpoint.checkpoints, docs/checkpoints.md).
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist

from planc.build.files import BuildError, read_for_run
from planc.checkpoint import format as checkpoint_format
from planc.runtime.checkpoint.checkpoints import Checkpoints
from planc.runtime.checkpoint.peer_memory import PeerMemory
from planc.runtime.engine.context import RankContext, make_groups
from planc.data.identity import identity_now
from planc.runtime.engine.exchange import (all_gather_json, boolean, broadcast_json, either,
                                    gather_json, integer, list_of, nothing, number, row, text)
from planc.runtime.engine.host_memory import keep_freed_memory
from planc.runtime.launcher.torch_threads import own_intra_op_threads
from planc.runtime.engine.evaluation import Evaluator
from planc.runtime.checkpoint.init_load import InitialWeights
from planc.program.step_code import StepCodeError
from planc.runtime.engine.executor import PEER_GONE, CpuExecutor, CudaExecutor, Hang, PeerLost
from planc.runtime.engine.bound import UnboundInstruction
from planc.runtime.engine.interpreter import Interpreter
from planc.runtime.launcher.protocol import (ERROR_FILE, EXIT_HANG, LOST_PEER_FILE,
                                             REPORT_FILE, STEPS_FILE, TRAINING_FILE)
from planc.runtime.engine.data import DataError
from planc.runtime.launcher.rendezvous import joined_store, launched_rank
from planc.runtime.options import RunOptions
from planc.runtime.step_records import StepRecords
from planc.runtime.engine.store import ParamStore
from planc.data.trace import write as write_trace
from planc.program.program import Opcode

PEER_LOST_GRACE_S = 5.0


class Stuck(Exception):
    """The rank's streams stopped making progress; ``report`` says what each waits for.
    The rank must leave with os._exit: streams blocked inside a transfer cannot be
    joined. ``lost_peer``: it stopped because a peer went away, whose failure is the
    cause."""

    def __init__(self, report: str, linger: float, lost_peer: bool = False):
        super().__init__(report)
        self.report, self.linger, self.lost_peer = report, linger, lost_peer


def _leader(ctx: RankContext) -> bool:
    """The rank that knows the loss first: the stage of the head (the last stage, stage 0
    in a V), tp = cp = dp = 0."""
    return ctx.rank == ctx.leader


class StartupWatch:
    """Reports a rank stuck while it starts, as the executor reports one stuck in a step:
    every collective of the start-up (joining the world, creating groups) waits for every
    other rank, and one that never comes (stopped, or crashed before it joined) would
    leave this rank silent until torch's own timeout. After ``timeout`` seconds in one
    such wait, a thread says what the rank waits for, tells planc run's launcher, and
    leaves (the main thread is blocked inside torch)."""

    def __init__(self, rank: int, timeout: float, log_dir: str | None):
        self.rank, self.timeout, self.log_dir = rank, timeout, log_dir

    @contextmanager
    def waiting(self, what: str):
        timer = threading.Timer(self.timeout, self._report, args=(what,))
        timer.daemon = True
        timer.start()
        try:
            yield
        except RuntimeError as exc:
            # A peer that stopped first (its own one-line error) closes the connections
            # this rank is still making: that failure is the peer's, which the launcher
            # reports; stay until it stops this rank, rather than print a traceback.
            if not any(gone in str(exc) for gone in PEER_GONE):
                raise
            raise Stuck(f"rank {self.rank} lost a peer while {what}",
                        linger=PEER_LOST_GRACE_S, lost_peer=True) from None
        finally:
            timer.cancel()

    def _report(self, what: str) -> None:
        _leave_stuck(f"rank {self.rank} made no progress for {self.timeout:g} s while "
                     f"{what}: it waits for the other ranks there",
                     min(self.timeout, 30.0), self.log_dir)


def train(args: RunOptions, log_dir: str | None = None) -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    built = read_for_run(args.build)  # programs/ and plan.json: no graph, nothing derived
    if rank == 0 and args.trace:  # under torchrun nobody checked it (planc.host.outputs)
        from planc.host.output_kinds import RUN_TRACE
        from planc.host.outputs import existing_problem

        refusal = existing_problem("--trace", args.trace, RUN_TRACE, args.force)
        if refusal is not None:
            raise SystemExit(f"planc: error: {refusal.message}")
    if world != built.table.world:
        raise SystemExit(f"planc: error: the plan needs {built.table.world} ranks, the "
                         f"launch has {world}")
    backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    # On CPU the compute stream's thread gets the rank's intra-op threads and this one
    # runs on one, before its first operator: a second team of OpenMP threads would
    # slow every parallel operator of the compute stream (planc.runtime.engine.executor)
    compute_threads = torch.get_num_threads()
    if backend == "gloo":
        own_intra_op_threads(1)
    device = torch.device("cpu")
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    timeout = timedelta(seconds=args.timeout + 60)
    watch = StartupWatch(rank, args.timeout, log_dir)
    with watch.waiting("joining the process group of the world (init_process_group)"):
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout,
                                store=joined_store(world, timeout))
    torch.manual_seed(0)
    with watch.waiting("creating the process groups of the plan (new_group)"):
        groups = make_groups(built.groups, rank, args.timeout + 60)
    ctx = RankContext(built.model, built.table, rank, groups, device, built.routes,
                      args.data_identity or identity_now(built.model.data),
                      built.groups.devices_per_node, record=built.record)
    program = built.programs[built.table.program_of(rank)]
    store = ParamStore(ctx, program.buckets)
    try:
        interpreter = Interpreter(ctx, program, store, args.unverified)
    except UnboundInstruction as exc:  # a program planc verify refuses, run without it
        raise SystemExit(f"planc: error: rank {rank}: {exc} (planc verify {args.build} "
                         f"says what is wrong with the build)") from None
    steps = args.steps or built.record.steps
    # every stage's parameter buckets: what a checkpoint holds, from the programs
    all_buckets = {bucket: info for name in built.table.names
                   for bucket, info in built.programs[name].buckets.items()}
    checkpoints, first = None, 0
    if args.checkpoint_dir or args.resume:
        with watch.waiting("exchanging where each rank's checkpoint pieces lie"):
            checkpoints = Checkpoints(ctx, all_buckets, interpreter)
    if args.resume:
        with watch.waiting("agreeing on the checkpoint to resume"):
            found = _resumable(args, built.record, all_buckets, steps, checkpoints)
        checkpoints.load(str(found.directory), found.manifest)
        first = found.manifest["step"]
    elif built.model.init is not None:  # a checkpoint of the run wins over train.init
        InitialWeights(ctx, store).load_initial()
    peer = None
    if args.peer_memory:  # a copy after every step in the nodes' memory, with its own group
        with watch.waiting("creating the group of the checkpoints in peer memory"):
            peer = PeerMemory(Checkpoints(ctx, all_buckets, interpreter), args.peer_memory,
                              built.groups.devices_per_node)
        if args.resume:
            peer.follow(checkpoints)
    try:
        executor = CudaExecutor(interpreter, args.timeout, trace=bool(args.trace)) \
            if backend == "nccl" else CpuExecutor(interpreter, args.timeout,
                                                  trace=bool(args.trace),
                                                  threads=compute_threads)
        # on CPU the evaluation runs on the training's stream threads (StreamThreads)
        evaluate_with = (lambda interp: CudaExecutor(interp, args.timeout)) \
            if backend == "nccl" else (lambda interp: CpuExecutor(
                interp, args.timeout, shared=executor.streams))
        evaluator = Evaluator(ctx, program, store, evaluate_with) \
            if built.model.evaluation is not None else None
    except StepCodeError as exc:  # a program planc verify refuses, run without it
        raise SystemExit(f"planc: error: rank {rank}: {exc}") from None
    with watch.waiting("creating the group that gathers the metrics (new_group)"):
        metrics = StepRecords(ctx, steps, args.metrics, built.plan_sha256, built.mfu,
                           built.record.name, args.tensorboard, args.straggler_margin,
                           args.recovery)
    losses, trace, evaluations = [], [], {}
    try:
        if log_dir is not None:  # the launcher's reports tell starting from training
            _tell_launcher(os.path.join(log_dir, TRAINING_FILE), f"step {first}")
        for step in range(first, steps):
            result = executor.run_step(step)
            if result.state.loss is not None:
                losses.append(result.state.loss)
            trace.extend((step, e.stream, e.name, e.start, e.end, e.microbatch, e.op,
                          [list(flow) for flow in e.flows], e.route) for e in result.trace)
            notes = metrics.notes.setdefault(step, {})
            if result.state.grad_norm is not None:  # train { grad_clip }: before clipping
                notes["grad_norm"] = result.state.grad_norm
            done = step + 1
            if evaluator and evaluator.due(done):
                started = time.perf_counter()
                evaluated = evaluator.run(done)
                notes["eval_s"] = time.perf_counter() - started  # what the evaluation cost
                if evaluated is not None:
                    notes["eval_loss"] = evaluations[step] = evaluated
            metrics.step(step, result.times, result.state.loss,
                         interpreter.kernels.take_routed(step),
                         interpreter.kernels.take_dropped(step),
                         result.state.expert_imbalance)
            if log_dir is not None and _leader(ctx):  # what a replanning launcher reports
                _tell_launcher(os.path.join(log_dir, STEPS_FILE), str(done))
            if peer is not None:
                # the step's record first, as before a checkpoint's files: a run that goes
                # on from this copy would never write it
                metrics.flush()
                # what the step boundary cost: the next step's record says it
                metrics.notes.setdefault(done, {})["peer_memory_wait_s"] = peer.save(
                    done, args.checkpoint_async)
            if args.checkpoint_dir and (done == steps or (
                    args.checkpoint_every and done % args.checkpoint_every == 0)):
                metrics.flush()  # this step's progress line before its checkpoint's
                waited = checkpoints.save(args.checkpoint_dir, done, args.checkpoint_async)
                # what the step boundary cost: the next step's record says it
                metrics.notes.setdefault(done, {})["checkpoint_wait_s"] = waited
        if checkpoints is not None:
            checkpoints.wait()  # a checkpoint still being written is committed before the end
        if peer is not None:
            peer.wait()
        metrics.close()
        if evaluator is not None:
            evaluator.close()
    except Hang as hang:
        # Stay a while so that the other ranks notice and report too (leaving would turn
        # their reports into lost peers); planc run's launcher stops every rank once all
        # have reported.
        raise Stuck(str(hang), linger=min(args.timeout, 30.0)) from None
    except PeerLost as lost:
        # The peer that failed may still be exiting; leaving first would make this rank
        # the launcher's first failure and hide the cause. The launcher stops this rank
        # as soon as it sees the peer's failure.
        raise Stuck(str(lost), linger=PEER_LOST_GRACE_S, lost_peer=True) from None
    except RuntimeError as exc:  # a collective outside the executor's (a checkpoint's)
        if not any(gone in str(exc) for gone in PEER_GONE):
            raise
        raise Stuck(f"rank {rank} lost a peer: {exc}".split("\n")[0],
                    linger=PEER_LOST_GRACE_S, lost_peer=True) from None
    except DataError as exc:
        raise SystemExit(f"planc: error: {exc}") from None
    executor.close()
    if backend == "gloo":  # the streams are gone: the check's reference gets the cores
        own_intra_op_threads(compute_threads)
    status = 0
    if args.trace:
        gathered = gather_json([ctx.label, trace], 0, _TRACE_FORM, "its trace events")
        if rank == 0:
            try:
                write_trace(args.trace, {r: label for r, (label, _) in enumerate(gathered)},
                            [[tuple(e[:6]) + (Opcode(e[6]), tuple(map(tuple, e[7])), e[8])
                              for e in events]
                             for _, events in gathered])
            except OSError as exc:  # the training stands: the other ranks meet at the end
                print(f"planc: error: cannot write the trace to {args.trace}: "
                      f"{exc.strerror or exc}", file=sys.stderr, flush=True)
                status = 1
    if args.check:
        from planc.runtime.oracle.check import compare  # the oracle: it alone reads the plan

        status = max(status, compare(ctx, interpreter, built.plan_data,
                                     losses if _leader(ctx) else None, steps, first,
                                     evaluations if _leader(ctx) else None))
    dist.barrier()
    dist.destroy_process_group()
    return status


# A rank's name and trace events as JSON: (step, stream, node, start, end, microbatch
# or null, op, flows) each (planc.runtime.engine.executor.TraceEvent, planc.data.trace.Flow).
_TRACE_FORM = row(text, list_of(row(integer, text, text, number, number,
                                    either(integer, nothing), text,
                                    list_of(row(text, integer, integer, text, boolean)),
                                    either(text, nothing))))


def _resumable(args, record, all_buckets: dict[str, dict], steps: int,
               checkpoints: Checkpoints):
    """The checkpoint to continue from. Rank 0 finds it (and hashes its files, unless planc
    run already did) and tells the others which step directory it chose; every rank then
    checks it against its plan. A problem anywhere stops every rank with one line."""
    first_rank = dist.get_rank() == 0
    problem, found, chosen = None, None, [None, None]
    if first_rank:
        try:
            found = checkpoint_format.find(args.resume, hashes=not args.resume_verified)
            chosen = [str(found.directory), None]
        except checkpoint_format.CheckpointError as exc:
            chosen = [None, str(exc)]
    if checkpoints.group is not None:  # a directory or a problem, never both
        chosen = broadcast_json(chosen, 0, either(row(text, nothing), row(nothing, text)),
                                "the checkpoint it chose", checkpoints.group)
    directory, problem = chosen
    if problem is None:
        try:
            if not first_rank:
                found = checkpoint_format.find(directory, hashes=False)
            problem = checkpoint_format.problems_resuming(found.manifest, record,
                                                          all_buckets, steps)
            if problem is None and args.check:
                problem = checkpoint_format.problems_checking(found.manifest, record)
        except checkpoint_format.CheckpointError as exc:
            problem = str(exc)
    verdicts = [problem]
    if checkpoints.group is not None:
        verdicts = all_gather_json(problem, either(text, nothing),
                                   "its verdict on the checkpoint", checkpoints.group)
    problem = next((v for v in verdicts if v), None)
    if problem:  # every rank stops; one says why
        raise SystemExit(f"planc: error: {problem}" if first_rank else 1)
    if first_rank:
        for skipped in found.skipped:
            print(f"planc: warning: passed over a checkpoint: {skipped}", file=sys.stderr,
                  flush=True)
    return found


def main(argv=None) -> int:
    """One rank started by torchrun (or by hand): its options from the command line."""
    # before any thread and the first tensor, as planc run's ranks do (rank_process):
    # every step reuses the last one's memory (planc.runtime.engine.host_memory)
    keep_freed_memory()
    options = RunOptions.parse(argv)
    launched = launched_rank()
    if isinstance(launched, str):
        print(f"planc: error: {launched}", file=sys.stderr)
        return 2
    problem = unverified(options.build)
    if problem is not None:
        print(f"planc: error: {problem}", file=sys.stderr)
        return 1
    return run(options)


def unverified(directory: str) -> str | None:
    """Why the build's programs must not run, or None: under torchrun nobody else proves
    them (planc run verifies before it starts its ranks). Every rank reads and proves
    the same files, so all of them stop, or none."""
    from planc.build import directory as build
    from planc.verify.report import failed_line
    from planc.verify.verifier import verify_build

    try:
        built = build.read_programs(build.read(directory))
    except build.BuildError as exc:
        return str(exc)
    report = verify_build(built)
    return None if report.ok else f"{failed_line(directory, report)}; nothing was run"


def run(options: RunOptions, log_dir: str | None = None) -> int:
    """One rank; ``log_dir``: where planc run's launcher keeps this rank's files."""
    try:
        return train(options, log_dir)
    except BuildError as exc:
        print(f"planc: error: {exc}", file=sys.stderr)
        return 1
    except Stuck as stuck:
        _leave_stuck(stuck.report, stuck.linger, log_dir, stuck.lost_peer)


def _leave_stuck(report: str, linger: float, log_dir: str | None,
                 lost_peer: bool = False) -> NoReturn:
    """Say what the rank waits for, tell planc run's launcher (which waits for every
    rank's report before it stops them all), stay ``linger`` seconds for the other ranks
    to notice and report too, and leave without joining the blocked streams. A report of
    a lost peer is marked first (where it begins in stderr.log), so that the launcher
    can leave it out when the peer's own failure says why."""
    if lost_peer and log_dir is not None:
        sys.stderr.flush()
        _tell_launcher(os.path.join(log_dir, LOST_PEER_FILE),
                       str(os.fstat(sys.stderr.fileno()).st_size))
    print(report, file=sys.stderr, flush=True)
    if log_dir is not None:
        _tell_launcher(os.path.join(log_dir, REPORT_FILE), report)
    time.sleep(linger)
    os._exit(EXIT_HANG)


def _tell_launcher(path: str, text: str) -> None:
    """A file for the launcher, whole or not at all (it acts on the file's existence)."""
    partial = f"{path}.partial"
    try:
        with open(partial, "w", encoding="utf-8") as handle:
            handle.write(text + "\n")
        os.replace(partial, path)
    except OSError:
        pass  # a full disk: the launcher stops the run after its grace period anyway


def _exit_status(code) -> int:
    """What ``sys.exit(code)`` would exit with, its message printed as Python would."""
    if isinstance(code, str):
        print(code, file=sys.stderr)
        return 1
    return code or 0


def run_rank(options: RunOptions, log_dir: str) -> int:
    """One rank under planc run's launcher: its exit status, with an exception's
    traceback kept in ``LOG_DIR/error.txt`` for the launcher's report, which shows it
    once (printed here only where that file cannot be written)."""
    try:
        return run(options, log_dir)
    except SystemExit as exc:
        return _exit_status(exc.code)
    except BaseException:  # the launcher shows it as the failure's cause
        text = traceback.format_exc()
        try:
            with open(os.path.join(log_dir, ERROR_FILE), "w", encoding="utf-8") as handle:
                handle.write(text)
        except OSError:
            print(text, file=sys.stderr, end="")
        return 1


if __name__ == "__main__":
    # Under torchrun. A rank leaves as planc run's ranks do (planc.runtime.launcher.
    # rank_process): through os._exit once its output is out. A rank that stopped on an
    # error its peers share (a damaged checkpoint) and went through the interpreter's
    # teardown aborted one exit in four here ("terminate called without an active
    # exception", from a C++ thread still running), its report written into the error's.
    try:
        status = main()
    except SystemExit as exc:
        status = _exit_status(exc.code)
    except Exception:  # noqa: BLE001 - the traceback is the report
        traceback.print_exc()
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
