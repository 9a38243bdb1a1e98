"""One rank of a training run: ``python -m planc.runtime.worker BUILD_DIR [options]``.

Started by ``planc run`` or by torchrun on a cluster, e.g. on each of 2 nodes:

    torchrun --nnodes 2 --node-rank I --nproc-per-node 4 --master-addr HOST \\
        --master-port 29500 -m planc.runtime.worker build/gpt-tiny --steps 10

It reads its rank from the environment torchrun sets, loads the build directory, checks
that the world matches the plan, runs its stage's program for every step, and reports:
the rank of the last stage with tp = cp = dp = 0 prints the progress and writes the
metrics; rank 0 writes the Chrome trace and, with ``--check``, compares the run with
the single-process reference. ``--checkpoint-dir`` writes consolidated checkpoints at
step boundaries and ``--resume`` continues from one, under any layout of the same model
(planc.runtime.checkpoint, docs/checkpoints.md).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from planc import build as build_module
from planc import checkpoint as checkpoint_format
from planc.runtime.check import compare
from planc.runtime.checkpoint import Checkpoints
from planc.runtime.context import RankContext, make_groups
from planc.runtime.executor import CpuExecutor, CudaExecutor, Hang, PeerLost
from planc.runtime.interpreter import Interpreter
from planc.runtime.model import DataError
from planc.runtime.store import ParamStore
from planc.runtime.trace import write as write_trace

EXIT_HANG = 3
PEER_LOST_GRACE_S = 5.0


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="planc.runtime.worker",
                                     description="One rank of a planc training run.")
    parser.add_argument("build", metavar="DIR", help="a build directory (planc compile)")
    parser.add_argument("--steps", type=int, help="optimizer steps [the plan's train.steps]")
    parser.add_argument("--backend", choices=("gloo", "nccl"))
    parser.add_argument("--metrics", metavar="M.jsonl", help="one JSON object per step")
    parser.add_argument("--trace", metavar="T.json", help="Chrome trace of every rank")
    parser.add_argument("--check", action="store_true",
                        help="compare with the single-process reference")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds without progress before a rank reports a hang")
    parser.add_argument("--checkpoint-dir", metavar="D",
                        help="write consolidated checkpoints into D (docs/checkpoints.md)")
    parser.add_argument("--checkpoint-every", type=int, metavar="N",
                        help="with --checkpoint-dir: after every N-th step (and the last)")
    parser.add_argument("--resume", metavar="D",
                        help="continue from the newest complete checkpoint in D, or from the "
                        "step directory D; --steps counts from the start of training")
    parser.add_argument("--resume-verified", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.checkpoint_every is not None and args.checkpoint_every < 1:
        parser.error("--checkpoint-every must be at least 1")
    if args.checkpoint_every is not None and not args.checkpoint_dir:
        parser.error("--checkpoint-every needs --checkpoint-dir")
    return args


def _leader(ctx: RankContext) -> bool:
    """The rank that knows the loss first: last stage, tp = cp = dp = 0."""
    c = ctx.coords
    return c["pp"] == ctx.plan.mesh.pp - 1 and c["tp"] == c["cp"] == c["dp"] == 0


def _progress(step: int, steps: int, record: dict) -> None:
    width = 24
    filled = int(width * (step + 1) / steps)
    bar = "#" * filled + "-" * (width - filled)
    exposed = record["exposed_comm_s"] / max(record["time_s"], 1e-12)
    text = (f"[{bar}] step {step + 1}/{steps}  loss {record['loss']:.6f}  "
            f"{record['time_s'] * 1000:.0f} ms  exposed comm {record['exposed_comm_s'] * 1000:.0f}"
            f" ms ({100 * exposed:.0f}%)  {record['tokens_per_s']:,.0f} tokens/s")
    end = "\r" if sys.stderr.isatty() and step + 1 < steps else "\n"
    print(text, end=end, file=sys.stderr, flush=True)


class _Metrics:
    """Every step's times, gathered from every rank to the leader without holding up the
    next step: the gather of step k is issued when step k ends and completed when step
    k + 1 does. ``time_s`` is the slowest rank's step; the other times are that rank's;
    ``max_rss_mb`` the largest peak resident memory of any rank so far."""

    FIELDS = ("time_s", "compute_s", "comm_s", "exposed_comm_s", "pipeline_wait_s")

    def __init__(self, ctx: RankContext, steps: int, path: str | None):
        self.ctx, self.steps = ctx, steps
        self.leader = ctx.layout.rank({"tp": 0, "cp": 0, "dp": 0, "pp": ctx.plan.mesh.pp - 1})
        self.world = dist.get_world_size()
        self.group = dist.new_group(list(range(self.world)), backend="gloo") \
            if self.world > 1 else None
        self.file = open(path, "w") if path and ctx.rank == self.leader else None
        self.pending = None
        self.records: list[dict] = []

    def step(self, step: int, times, loss: float | None) -> None:
        self.flush()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
        mine = torch.tensor(times.as_list() + [peak], dtype=torch.float64)
        if self.world == 1:
            self.pending = (step, None, [mine], loss)
            return
        gathered = [torch.empty_like(mine) for _ in range(self.world)] \
            if self.ctx.rank == self.leader else None
        work = dist.gather(mine, gathered, dst=self.leader, group=self.group, async_op=True)
        self.pending = (step, work, gathered, loss)

    def flush(self) -> None:
        if self.pending is None:
            return
        step, work, gathered, loss = self.pending
        self.pending = None
        if work is not None:
            work.wait()
        if self.ctx.rank != self.leader:
            return
        table = torch.stack(gathered)
        slowest = int(table[:, 0].argmax())
        values = dict(zip(self.FIELDS, (float(v) for v in table[slowest])))
        values["max_rss_mb"] = round(float(table[:, -1].max()), 1)
        plan = self.ctx.plan
        record = {"step": step, "loss": loss, **values,
                  "tokens_per_s": plan.model.batch * plan.model.seq / values["time_s"],
                  "slowest_rank": slowest}
        self.records.append(record)
        _progress(step, self.steps, record)
        if self.file:
            try:
                self.file.write(json.dumps(record) + "\n")
                self.file.flush()
            except OSError as exc:  # a full disk: say so once and train on
                print(f"planc: warning: cannot write the metrics of step {step + 1} "
                      f"({exc.strerror}); no more metrics are written", file=sys.stderr)
                self.file = None

    def close(self) -> None:
        self.flush()
        if self.file:
            self.file.close()


def train(args: argparse.Namespace) -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    built = build_module.read_programs(build_module.read(args.build))
    plan = built.plan
    if world != plan.world:
        raise SystemExit(f"planc: error: the plan needs {plan.world} ranks, the launch has "
                         f"{world}")
    backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    device = torch.device("cpu")
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    timeout = timedelta(seconds=args.timeout + 60)
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout,
                            store=_launcher_store(world, timeout))
    torch.manual_seed(0)
    groups = make_groups(built.groups, rank, args.timeout + 60)
    ctx = RankContext(plan, built.groups, rank, groups, device, built.routes)
    program = built.programs[built.table.program_of(rank)]
    shard_index = groups.index("dp_cp", rank)
    store = ParamStore(ctx, program.buckets, shard_index)
    interpreter = Interpreter(ctx, built.graph, program, store)
    steps = args.steps or plan.train.steps
    checkpoints, first = None, 0
    if args.checkpoint_dir or args.resume:
        checkpoints = Checkpoints(ctx, built.graph, interpreter, shard_index)
    if args.resume:
        found = _resumable(args, plan, built.graph, steps, checkpoints)
        checkpoints.load(str(found.directory), found.manifest)
        first = found.manifest["step"]
    executor = (CudaExecutor if backend == "nccl" else CpuExecutor)(
        interpreter, args.timeout, trace=bool(args.trace))
    metrics = _Metrics(ctx, steps, args.metrics)
    losses, trace = [], []
    try:
        for step in range(first, steps):
            result = executor.run_step(step)
            if result.state.loss is not None:
                losses.append(result.state.loss)
            trace.extend((step, e.stream, e.name, e.start, e.end, e.microbatch, e.op)
                         for e in result.trace)
            metrics.step(step, result.times, result.state.loss)
            done = step + 1
            if args.checkpoint_dir and (done == steps or (
                    args.checkpoint_every and done % args.checkpoint_every == 0)):
                checkpoints.save(args.checkpoint_dir, done)
        metrics.close()
    except Hang as hang:
        print(str(hang), file=sys.stderr, flush=True)
        # Give the other ranks time to notice and report too, then stop: streams blocked
        # inside a transfer cannot be joined.
        time.sleep(min(args.timeout, 30.0))
        os._exit(EXIT_HANG)
    except PeerLost as lost:
        print(str(lost), file=sys.stderr, flush=True)
        # The peer that failed may still be exiting; leaving first would make this rank
        # the launcher's first failure and hide the cause. The launcher stops this rank
        # as soon as it sees the peer's failure.
        time.sleep(PEER_LOST_GRACE_S)
        os._exit(EXIT_HANG)
    except DataError as exc:
        raise SystemExit(f"planc: error: {exc}") from None
    executor.close()
    if args.trace:
        gathered = [None] * world if rank == 0 else None
        dist.gather_object(trace, gathered, dst=0)
        if rank == 0:
            write_trace(args.trace, ctx.layout, built.graph, gathered)
    status = 0
    if args.check:
        status = compare(ctx, interpreter, losses if _leader(ctx) else None, steps, first)
    dist.barrier()
    dist.destroy_process_group()
    return status


def _resumable(args, plan, graph, steps: int, checkpoints: Checkpoints):
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
    if checkpoints.group is not None:
        dist.broadcast_object_list(chosen, src=0, group=checkpoints.group)
    directory, problem = chosen
    if problem is None:
        try:
            if not first_rank:
                found = checkpoint_format.find(directory, hashes=False)
            problem = checkpoint_format.problems_resuming(found.manifest, plan,
                                                          graph.graph["buckets"], steps)
            if problem is None and args.check:
                problem = checkpoint_format.problems_checking(found.manifest, plan)
        except checkpoint_format.CheckpointError as exc:
            problem = str(exc)
    verdicts = [problem]
    if checkpoints.group is not None:
        verdicts = [None] * dist.get_world_size()
        dist.all_gather_object(verdicts, problem, group=checkpoints.group)
    problem = next((v for v in verdicts if v), None)
    if problem:  # every rank stops; one says why
        raise SystemExit(f"planc: error: {problem}" if first_rank else 1)
    if first_rank:
        for skipped in found.skipped:
            print(f"planc: warning: passed over {skipped}", file=sys.stderr, flush=True)
    return found


def _launcher_store(world: int, timeout: timedelta):
    """The store of ``planc run``'s launcher (PLANC_STORE, on loopback), joined as a
    client; None under torchrun, whose environment names the store instead."""
    address = os.environ.get("PLANC_STORE")
    if not address:
        return None
    host, port = address.rsplit(":", 1)
    return dist.TCPStore(host, int(port), world, False, timeout)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        return train(args)
    except build_module.BuildError as exc:
        print(f"planc: error: {exc}", file=sys.stderr)
        return 1


def run_rank(argv: list[str], error_path: str) -> int:
    """One rank under planc run's launcher: its exit status, with an exception's
    traceback printed and kept in ``error_path`` for the launcher's report."""
    try:
        return main(argv)
    except SystemExit as exc:
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
            return 1
        return exc.code or 0
    except BaseException:  # the launcher shows it as the failure's cause
        text = traceback.format_exc()
        print(text, file=sys.stderr, end="")
        with open(error_path, "w", encoding="utf-8") as handle:
            handle.write(text)
        return 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except SystemExit:
        raise
    except BaseException:
        traceback.print_exc()
        raise
