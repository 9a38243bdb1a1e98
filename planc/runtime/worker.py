"""One rank of a training run: ``python -m planc.runtime.worker BUILD_DIR [options]``.

Started by ``planc run`` or by torchrun on a cluster, e.g. on each of 2 nodes:

    torchrun --nnodes 2 --node-rank I --nproc-per-node 4 --master-addr HOST \\
        --master-port 29500 -m planc.runtime.worker build/gpt-tiny --steps 10

It reads its rank from the environment torchrun sets, loads the build directory, checks
that the world matches the plan, runs its stage's program for every step, and reports:
the rank of the last stage with tp = cp = dp = 0 prints the progress and writes the
metrics; rank 0 writes the Chrome trace and, with ``--check``, compares the run with
the single-process reference.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from planc import build as build_module
from planc.files import write_atomically
from planc.runtime.context import RankContext, make_groups
from planc.runtime.executor import CpuExecutor, CudaExecutor, Hang, Interpreter, PeerLost
from planc.runtime.model import DataError, join_feature

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
    return parser.parse_args(argv)


def _leader(ctx: RankContext) -> bool:
    """The rank that knows the loss first: last stage, tp = cp = dp = 0."""
    c = ctx.coords
    return c["pp"] == ctx.plan.mesh.pp - 1 and c["tp"] == c["cp"] == c["dp"] == 0


def _progress(step: int, steps: int, loss: float, seconds: float, tokens_per_s: float) -> None:
    width = 24
    filled = int(width * (step + 1) / steps)
    bar = "#" * filled + "-" * (width - filled)
    text = (f"[{bar}] step {step + 1}/{steps}  loss {loss:.6f}  {seconds * 1000:.0f} ms  "
            f"{tokens_per_s:,.0f} tokens/s")
    end = "\r" if sys.stderr.isatty() and step + 1 < steps else "\n"
    print(text, end=end, file=sys.stderr, flush=True)


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
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout)
    torch.manual_seed(0)
    ctx = RankContext(plan, rank, None, device)
    ctx.groups = make_groups(plan, ctx.layout, rank, args.timeout + 60)
    program = built.programs[built.table.program_of(rank)]
    interpreter = Interpreter(ctx, built.graph, program)
    executor = (CudaExecutor if backend == "nccl" else CpuExecutor)(interpreter, args.timeout)
    steps = args.steps or plan.train.steps
    losses, trace = [], []
    metrics = open(args.metrics, "w") if args.metrics and _leader(ctx) else None
    try:
        for step in range(steps):
            start = time.perf_counter()
            state = executor.run_step(step)
            seconds = time.perf_counter() - start
            trace.extend(state.trace)
            if state.loss is not None:
                losses.append(state.loss)
            if _leader(ctx):
                tokens_per_s = plan.model.batch * plan.model.seq / seconds
                _progress(step, steps, state.loss, seconds, tokens_per_s)
                if metrics:
                    metrics.write(json.dumps({"step": step, "loss": state.loss,
                                              "time_s": seconds,
                                              "tokens_per_s": tokens_per_s}) + "\n")
                    metrics.flush()
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
    finally:
        if metrics:
            metrics.close()
    if args.trace:
        _write_trace(ctx, trace, args.trace)
    status = 0
    if args.check:
        status = _check(ctx, interpreter, losses, steps)
    dist.barrier()
    dist.destroy_process_group()
    return status


def _write_trace(ctx: RankContext, events, path: str) -> None:
    """Chrome trace (Perfetto): a process per rank, a thread per program stream."""
    mine = [(e.stream, e.name, e.start, e.end, e.microbatch) for e in events]
    gathered = [None] * dist.get_world_size() if ctx.rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    if ctx.rank != 0:
        return
    origin = min((e[2] for rank_events in gathered for e in rank_events), default=0.0)
    trace = []
    streams = ("compute", "comm", "send_next", "send_prev", "recv_prev", "recv_next")
    for rank, rank_events in enumerate(gathered):
        coords = ctx.layout.coords(rank)
        trace.append({"ph": "M", "name": "process_name", "pid": rank,
                      "args": {"name": f"rank {rank} (stage {coords['pp']}, tp "
                                       f"{coords['tp']}, cp {coords['cp']}, dp {coords['dp']})"}})
        for tid, stream in enumerate(streams):
            trace.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid,
                          "args": {"name": stream}})
        for stream, name, start, end, microbatch in rank_events:
            trace.append({"ph": "X", "name": name, "pid": rank,
                          "tid": streams.index(stream) if stream in streams else len(streams),
                          "ts": (start - origin) * 1e6, "dur": max((end - start) * 1e6, 0.01),
                          "args": {"microbatch": microbatch}})
    write_atomically(path, json.dumps({"traceEvents": trace, "displayTimeUnit": "ms"}).encode())


def _local_parameters(ctx: RankContext, interpreter: Interpreter) -> dict:
    """This rank's tp-local parameters (gathered from ZeRO shards where needed)."""
    store = interpreter.store
    out = {}
    for name in sorted(ctx.storage):
        if name in store.full and not (ctx.zero == 3 and ctx.replicas > 1):
            value = store.full[name]
        else:
            value = interpreter.transfers.flat_all_gather(store.shard[name], store.shape[name])
        out[name] = value.detach().to("cpu", torch.float32)
    return out


def _check(ctx: RankContext, interpreter: Interpreter, losses: list[float], steps: int) -> int:
    """Gather every parameter to rank 0 and compare with the single-process run."""
    local = _local_parameters(ctx, interpreter)
    mine = {"coords": ctx.coords, "params": local, "losses": losses if _leader(ctx) else None}
    gathered = [None] * dist.get_world_size() if ctx.rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    if ctx.rank != 0:
        return 0
    from planc.runtime.reference import train as reference_train

    plan = ctx.plan
    expected_losses, expected = reference_train(plan, steps)
    run_losses = next(g["losses"] for g in gathered if g["losses"] is not None)
    # Every copy is compared: each replica (dp x cp), each tp rank's copy of what is
    # replicated over tp, and both stages' copies of a tied embedding.
    copies: dict[tuple[str, int, int], dict[int, dict[int, torch.Tensor]]] = {}
    for g in gathered:
        c = g["coords"]
        for name, value in g["params"].items():
            copies.setdefault((name, c["dp"], c["cp"]), {}).setdefault(c["pp"], {})[c["tp"]] \
                = value
    replicas = [(d, c) for d in range(plan.mesh.dp) for c in range(plan.mesh.cp)]
    report, failed = [], False
    tolerance = 1e-5 if plan.model.dtype == "fp32" else 2e-2
    floor = update_floor(plan, steps)
    for step, (got, want) in enumerate(zip(run_losses, expected_losses)):
        error = abs(got - want) / max(abs(want), 1e-12)
        bad = error > tolerance
        failed |= bad
        report.append(f"  step {step}: loss {got:.8f}, single process {want:.8f}, relative "
                      f"error {error:.2e}{'  MISMATCH' if bad else ''}")
    compare_parameters = floor is not None
    worst = (0.0, 0.0, "")  # (share of the allowed difference, difference, parameter)
    if compare_parameters:
        worst, mismatches = _compare_parameters(ctx, expected, copies, replicas, tolerance,
                                                floor)
        report += mismatches
        failed |= bool(mismatches)
    what = (f"{len(expected)} parameters" + (f" on each of {len(replicas)} replicas"
                                             if len(replicas) > 1 else "")
            if compare_parameters else "no parameters (bf16/fp16 with AdamW, see below)")
    header = (f"check: {len(expected_losses)} steps and {what} against the single-process run "
              f"(relative tolerance {tolerance:g}"
              + (f", AdamW slack {floor:.1e}" if floor else "") + "): ")
    if failed:
        print(header + "FAILED", file=sys.stderr)
        print("\n".join(report), file=sys.stderr, flush=True)
        return 1
    if not compare_parameters:
        print(header + "every loss matches. AdamW turns bf16/fp16 rounding differences into "
              "parameter differences of up to lr per step, as large as an error, so only the "
              "losses are compared; check parameters in fp32.", file=sys.stderr, flush=True)
        return 0
    print(header + f"every loss and parameter matches (closest: {worst[2]}, difference "
          f"{worst[1]:.1e}, {100 * worst[0]:.0f}% of what is allowed)", file=sys.stderr,
          flush=True)
    return 0


def _compare_parameters(ctx: RankContext, expected: dict, copies: dict, replicas: list,
                        tolerance: float, floor: float) -> tuple[tuple, list[str]]:
    """Each run copy of each expected parameter against it: the closest call as (share of
    the allowed difference, difference, name), and a report line per mismatch."""
    worst, mismatches = (0.0, 0.0, ""), []
    for (name, want), (dp, cp) in ((item, r) for item in expected.items() for r in replicas):
        by_stage = copies.get((name, dp, cp), {})
        where = f" (replica dp {dp}, cp {cp})" if len(replicas) > 1 else ""
        if not by_stage:
            mismatches.append(f"  {name}{where}: no rank holds it  MISMATCH")
            continue
        use = ctx.storage.get(name) or _use_of(ctx, name)
        scale = float(want.abs().max())
        allowed = tolerance * scale + floor
        for stage, by_tp in sorted(by_stage.items()):
            ordered = [by_tp[k] for k in sorted(by_tp)]
            if use.storage.is_sharded and len(ordered) > 1:
                candidates = [join_feature(ordered, use.storage.dim, ctx.plan.model.heads,
                                           use.storage_axis)]
            else:
                candidates = ordered  # every tp rank's whole copy
            for got in candidates:
                difference = float((got - want).abs().max())
                if difference / allowed > worst[0]:
                    worst = (difference / allowed, difference, name)
                if difference > allowed:
                    copy = f" (stage {stage})" if len(by_stage) > 1 else ""
                    mismatches.append(f"  {name}{where}{copy}: largest difference "
                                      f"{difference:.2e}, relative "
                                      f"{difference / max(scale, 1e-12):.2e}  MISMATCH")
                    break
    return worst, mismatches


def update_floor(plan, steps: int) -> float | None:
    """Absolute slack for parameters under AdamW: 10% of the largest update AdamW can make
    (lr per step). AdamW divides each gradient by its running magnitude, so where a
    gradient is as small as eps (or is rounding noise along a null direction, such as the
    key bias, whose true gradient is zero) it turns a rounding difference d into an update
    difference of lr * d / eps: in fp32, up to about 1% of lr per step between two correct
    computations that round differently. A real error moves parameters by the order of
    lr, ten times the slack and more."""
    optimizer = plan.train.optimizer
    if optimizer.name != "adamw":
        return 0.0
    if plan.model.dtype != "fp32":
        return None  # half precision: no slack below an error exists (see _check)
    return 0.1 * optimizer.lr * steps


def _use_of(ctx: RankContext, name: str):
    """How a parameter of another stage is stored over tp."""
    from planc.graph.tensor_parallel import ParamUse

    short = name.split(".", 2)[2] if name.startswith("layers.") else name
    for layout in ctx.tpp.ops.values():
        for use in layout.params:
            if use.name == short:
                return use
    return ParamUse(short, ctx.tpp.stream.__class__("R"), ctx.tpp.stream, ())


@record
def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        return train(args)
    except build_module.BuildError as exc:
        print(f"planc: error: {exc}", file=sys.stderr)
        return 1


def entry(argv: list[str]) -> None:
    """Entry point for torch.distributed's launcher (planc run)."""
    status = main(argv)
    if status:
        sys.stderr.flush()
        raise SystemExit(status)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except SystemExit:
        raise
    except BaseException:
        traceback.print_exc()
        raise
