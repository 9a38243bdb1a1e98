"""``planc run --check``: compare a distributed run with the single-process reference.

Every rank sends rank 0 its parameters (each bucket gathered from its ZeRO shards) with
how each is split over tp (from its bucket); rank 0 trains the reference
(planc.runtime.reference) and compares every loss and every copy of every parameter:
each replica (dp x cp), each tp rank's copy of what is replicated over tp, and both
stages' copies of a tied embedding.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from planc.runtime.context import RankContext
from planc.runtime.interpreter import Interpreter
from planc.runtime.model import join_feature
from planc.words import counted


def local_parameters(ctx: RankContext, interpreter: Interpreter) -> dict:
    """name -> (tp-local tensor, tp split or None), ZeRO shards gathered per bucket."""
    store, groups = interpreter.store, ctx.groups
    out = {}
    for bucket_id in sorted(store.buckets):
        bucket = store.buckets[bucket_id]
        if bucket["sharded"]:
            flat = torch.empty(bucket["padded"], dtype=torch.float32, device=ctx.device)
            group = groups.handles.get("dp_cp")
            if group is None:
                flat.copy_(store.shard[bucket_id])
            else:
                dist.all_gather_single(flat, store.shard[bucket_id], group=group)
        else:
            flat = store.full[bucket_id]
        for member in bucket["members"]:
            value = store.view(flat, member["param"]).detach().to("cpu", torch.float32)
            out[member["param"]] = (value.clone(), member["tp_split"])
    return out


def compare(ctx: RankContext, interpreter: Interpreter, losses: list[float] | None,
            steps: int, first: int = 0) -> int:
    """Gather every parameter to rank 0 and compare with the single-process run. A run
    resumed from a checkpoint ran steps ``first`` to ``steps`` - 1: its losses are compared
    with those steps of the single process, which trains from step 0."""
    mine = {"coords": ctx.coords, "params": local_parameters(ctx, interpreter),
            "losses": losses}
    gathered = [None] * dist.get_world_size() if ctx.rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    if ctx.rank != 0:
        return 0
    from planc.runtime.reference import train as reference_train

    plan = ctx.plan
    expected_losses, expected = reference_train(plan, steps)
    run_losses = next(g["losses"] for g in gathered if g["losses"] is not None)
    copies: dict[tuple[str, int, int], dict[int, dict[int, torch.Tensor]]] = {}
    splits: dict[str, tuple | None] = {}
    for g in gathered:
        c = g["coords"]
        for name, (value, split) in g["params"].items():
            copies.setdefault((name, c["dp"], c["cp"]), {}).setdefault(c["pp"], {})[c["tp"]] \
                = value
            splits[name] = split
    replicas = [(d, c) for d in range(plan.mesh.dp) for c in range(plan.mesh.cp)]
    report, failed = [], False
    tolerance = 1e-5 if plan.model.dtype == "fp32" else 2e-2
    floor = update_floor(plan, steps)
    for step, (got, want) in enumerate(zip(run_losses, expected_losses[first:]), first):
        error = abs(got - want) / max(abs(want), 1e-12)
        bad = error > tolerance
        failed |= bad
        report.append(f"  step {step}: loss {got:.8f}, single process {want:.8f}, relative "
                      f"error {error:.2e}{'  MISMATCH' if bad else ''}")
    compare_parameters = floor is not None
    worst = (0.0, 0.0, "")  # (share of the allowed difference, difference, parameter)
    if compare_parameters:
        worst, mismatches = _compare_parameters(plan, expected, copies, splits, replicas,
                                                tolerance, floor)
        report += mismatches
        failed |= bool(mismatches)
    what = (f"{len(expected)} parameters" + (f" on each of {len(replicas)} replicas"
                                             if len(replicas) > 1 else "")
            if compare_parameters else "no parameters (bf16/fp16 with AdamW, see below)")
    resumed = f" (from step {first}, resumed)" if first else ""
    header = (f"check: {counted(len(expected_losses) - first, 'step')}{resumed} and {what} "
              f"against the single-process run (relative tolerance {tolerance:g}"
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


def _compare_parameters(plan, expected: dict, copies: dict, splits: dict, replicas: list,
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
        split = splits.get(name)
        scale = float(want.abs().max())
        allowed = tolerance * scale + floor
        for stage, by_tp in sorted(by_stage.items()):
            ordered = [by_tp[k] for k in sorted(by_tp)]
            if split is not None and len(ordered) > 1:
                dim, axis = split
                candidates = [join_feature(ordered, dim, plan.model, axis)]
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
        return None  # half precision: no slack below an error exists (see compare)
    return 0.1 * optimizer.lr * steps
