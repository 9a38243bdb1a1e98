"""``planc run --check``: compare a distributed run with the single-process reference.

Every rank sends rank 0 its parameters (each bucket gathered from its ZeRO shards) with
how each is split over tp (from its bucket); rank 0 trains the reference
(planc.runtime.oracle.reference) and compares every loss and every copy of every parameter:
each replica (dp x cp), each tp rank's copy of what is replicated over tp, and both
stages' copies of a tied embedding.
"""

from __future__ import annotations

import math
import sys

import torch

from planc.estimate.memory import total_parameters
from planc.models import family_of
from planc.plan.plan import Plan
from planc.plan.plan_json import plan_from_dict
from planc.runtime.engine.context import RankContext
from planc.runtime.engine import fp8
from planc.runtime.engine.data import DataChanged
from planc.runtime.engine.exchange import (PeerDataError, either, gather_flat, gather_json, integer,
                                    list_of, nothing, number, one_of, record, row, text)
from planc.runtime.engine.interpreter import Interpreter
from planc.runtime.engine.model import join_feature
from planc.diagnostics import counted
from planc.vocabulary.model_options import fp8_tile
from planc.runtime.engine.collectives import all_gather_single


def local_parameters(ctx: RankContext, interpreter: Interpreter) -> dict:
    """name -> (tp-local tensor, tp split or None), ZeRO shards gathered per bucket, and
    experts split over ep gathered whole from the ep group (every rank's copy of every
    expert is then compared)."""
    store, groups = interpreter.store, ctx.groups
    out = {}
    for bucket_id in sorted(store.buckets):
        bucket = store.buckets[bucket_id]
        if bucket["sharded"]:
            flat = torch.empty(bucket["padded"], dtype=torch.float32, device=ctx.device)
            group = groups.handles.get(bucket.get("over", "dp_cp"))
            if group is None:
                flat.copy_(store.shard[bucket_id])
            else:
                all_gather_single(flat, store.shard[bucket_id], group=group)
        else:
            flat = store.full[bucket_id]
        for member in bucket["members"]:
            value = store.view(flat, member["param"]).detach()
            if member.get("ep_split"):
                whole = value.new_empty((member["ep_split"] * value.shape[0],
                                         *value.shape[1:]))
                all_gather_single(whole, value.contiguous(), group=groups.handles["ep"])
                value = whole
            out[member["param"]] = (value.to("cpu", torch.float32).clone(),
                                    member["tp_split"])
    return out


def _gather_parameters(ctx: RankContext, interpreter: Interpreter, plan: Plan,
                       losses: list[float] | None,
                       evaluations: dict[int, float] | None = None) -> tuple | None:
    """On rank 0: the run's losses (from the rank that knows them), every rank's
    parameters as {(name, dp, cp): {pp: {tp: tensor}}}, and each parameter's tp split;
    None on the other ranks. Names, shapes, splits and losses travel as JSON, the values
    as one flat fp32 tensor per rank (planc.runtime.engine.exchange: nothing is unpickled), and
    a rank's coordinates are the rank table's, not what it says."""
    params = local_parameters(ctx, interpreter)
    about = {"losses": losses,
             "evaluations": None if evaluations is None else sorted(
                 [step, loss] for step, loss in evaluations.items()),
             "params": [[name, list(value.shape), split]
                                          for name, (value, split) in params.items()]}
    flat = torch.cat([value.reshape(-1) for value, _ in params.values()]) if params \
        else torch.zeros(0)
    full = {p.name: p.shape for p in family_of(plan).all_parameters(plan.model)}
    form = record(losses=either(nothing, list_of(number)),
                  evaluations=either(nothing, list_of(row(integer, number))),
                  params=list_of(row(one_of(full), list_of(integer),
                                     either(nothing, row(text, integer)))))
    described = gather_json(about, 0, form, "the names and shapes of its parameters")
    # a rank holds at most every parameter once, and a tied embedding's second copy
    values = gather_flat(flat, 0, "its parameters", 2 * total_parameters(plan))
    if described is None:
        return None
    leader = ctx.leader
    if described[leader]["losses"] is None:
        raise PeerDataError(f"rank {leader}, the first rank of the stage with the loss, sent "
                            f"no losses; the run was stopped")
    copies: dict[tuple[str, int, int], dict[int, dict[int, torch.Tensor]]] = {}
    splits: dict[str, list | None] = {}
    for rank, (about, flat) in enumerate(zip(described, values)):
        c = ctx.ranks.coords(rank)
        fits = all(len(shape) == len(full[name]) and all(0 <= n <= whole for n, whole in
                                                         zip(shape, full[name]))
                   for name, shape, _ in about["params"])
        sizes = [math.prod(shape) for _, shape, _ in about["params"]]
        if not fits or sum(sizes) != flat.numel():
            raise PeerDataError(f"rank {rank} sent parameters whose shapes do not fit the "
                                f"model or its {flat.numel()} values; the run was stopped")
        offset = 0
        for (name, shape, split), size in zip(about["params"], sizes):
            copies.setdefault((name, c["dp"], c["cp"]), {}).setdefault(c["pp"], {})[c["tp"]] \
                = flat[offset:offset + size].view(shape)
            splits[name] = split
            offset += size
    evaluated = {step: loss for step, loss in described[leader]["evaluations"] or ()}
    return described[leader]["losses"], copies, splits, evaluated


def compare(ctx: RankContext, interpreter: Interpreter, plan_data: dict,
            losses: list[float] | None, steps: int, first: int = 0,
            evaluations: dict[int, float] | None = None) -> int:
    """Gather every parameter to rank 0 and compare with the single-process run of the
    plan (``plan_data``: the build's plan.json, which the build's reader checked against
    its fingerprint). A run resumed from a checkpoint ran steps ``first`` to ``steps`` - 1:
    its losses are compared with those steps of the single process, which trains from
    step 0."""
    plan = plan_from_dict(plan_data)  # the oracle, and only it, builds from the plan
    gathered = _gather_parameters(ctx, interpreter, plan, losses, evaluations)
    if gathered is None:  # not rank 0
        return 0
    from planc.runtime.oracle.reference import train as reference_train

    try:
        expected_evaluations: dict[int, float] = {}
        expected_losses, expected = reference_train(plan, steps, ctx.data_identity,
                                                    expected_evaluations)
    except DataChanged as exc:  # the run trained on the file as it was; this would not
        print(f"planc: error: --check: data file {exc.path} changed after the run read it "
              f"({exc.detail} when the single-process run read step {exc.step}); the run "
              f"was not compared", file=sys.stderr, flush=True)
        return 1
    run_losses, copies, splits, evaluations = gathered
    replicas = [(d, c) for d in range(plan.mesh.dp) for c in range(plan.mesh.cp)]
    tolerance = 1e-5 if exact(plan) else 2e-2
    tile = fp8_tile(plan.model)
    on_tensor_cores = tile is not None and fp8.tensor_cores(ctx.device, tile)
    floor = update_floor(plan, steps)
    report, failed = loss_report(run_losses, expected_losses, first,
                                 [first_step_tolerance(plan, step, tolerance, on_tensor_cores)
                                  for step in range(len(expected_losses))])
    lines, bad = evaluation_report(evaluations, expected_evaluations, first, tolerance)
    report += lines
    failed |= bad
    compare_parameters = floor is not None
    worst = (0.0, 0.0, "")  # (share of the allowed difference, difference, parameter)
    amplified: list[str] = []
    if compare_parameters:
        worst, mismatches, amplified = parameter_report(
            ctx.model, expected, copies, splits, replicas, tolerance, floor,
            amplified_ceiling(plan, steps))
        report += mismatches
        failed |= bool(mismatches)
    what = (f"{len(expected)} parameters" + (f" on each of {len(replicas)} replicas"
                                             if len(replicas) > 1 else "")
            if compare_parameters else f"no parameters ({_rounding(plan)} with AdamW, see "
                                       f"below)")
    resumed = f" (from step {first}, resumed)" if first else ""
    evaluated = sum(1 for step in expected_evaluations if step >= first)
    what += f" and {counted(evaluated, 'evaluation')}" if evaluated else ""
    first_tolerance = first_step_tolerance(plan, 0, tolerance, on_tensor_cores)
    header = (f"check: {counted(len(expected_losses) - first, 'step')}{resumed} and {what} "
              f"against the single-process run (relative tolerance {tolerance:g}"
              + (f", step 0's loss {first_tolerance:g}"
                 if first == 0 and first_tolerance != tolerance else "")
              + (f", AdamW slack {floor:.1e}" if floor else "") + "): ")
    if failed:
        print(header + "FAILED", file=sys.stderr)
        print("\n".join(report), file=sys.stderr, flush=True)
        return 1
    if not compare_parameters:
        print(header + f"every loss matches. AdamW turns {_rounding(plan)} rounding "
              f"differences into parameter differences of up to lr per step, as large as an "
              f"error, so only the losses are compared; check parameters in fp32"
              + (" without fp8" if plan.model.options.get("fp8") else "") + ".",
              file=sys.stderr, flush=True)
        return 0
    print(header + f"every loss and parameter matches (closest: {worst[2]}, difference "
          f"{worst[1]:.1e}, {100 * worst[0]:.0f}% of what is allowed)", file=sys.stderr,
          flush=True)
    if amplified:
        print(f"check: past the AdamW slack but within what AdamW makes of rounding where a "
              f"gradient is near zero (at most {AMPLIFIED_SHARE:.2%} of a parameter's "
              f"elements, each within {amplified_ceiling(plan, steps):.1e}, twice Adam's "
              f"largest step over {counted(steps, 'step')}): " + "; ".join(amplified),
              file=sys.stderr, flush=True)
    return 0


def loss_report(run_losses: list[float], expected: list[float], first: int,
                tolerances: list[float]) -> tuple[list[str], bool]:
    """A line per step of the run (from ``first``) against the single process's loss of
    that step, within ``tolerances[step]``, relative; and whether any is off."""
    lines, failed = [], False
    for step, (got, want) in enumerate(zip(run_losses, expected[first:]), first):
        error = abs(got - want) / max(abs(want), 1e-12)
        bad = error > tolerances[step]
        failed |= bad
        lines.append(f"  step {step}: loss {got:.8f}, single process {want:.8f}, relative "
                     f"error {error:.2e}{'  MISMATCH' if bad else ''}")
    if len(run_losses) != len(expected) - first:  # a rank that stopped early
        failed = True
        lines.append(f"  the run reported {len(run_losses)} losses for steps {first} to "
                     f"{len(expected) - 1}  MISMATCH")
    return lines, failed


def evaluation_report(evaluations: dict[int, float] | None, expected: dict[int, float],
                      first: int, tolerance: float) -> tuple[list[str], bool]:
    """A line per evaluation after step ``first`` or later (a missing one is a mismatch);
    and whether any is off."""
    lines, failed = [], False
    for step, want in sorted(expected.items()):
        if step < first:
            continue
        got = (evaluations or {}).get(step)
        error = abs(got - want) / max(abs(want), 1e-12) if got is not None else float("inf")
        bad = error > tolerance
        failed |= bad
        lines.append(f"  evaluation after step {step}: loss "
                     + (f"{got:.8f}" if got is not None else "missing")
                     + f", single process {want:.8f}, relative error {error:.2e}"
                     + ("  MISMATCH" if bad else ""))
    return lines, failed


# At most this share of a parameter's elements may pass AdamW's slack up to its ceiling
# (amplified_ceiling): the few elements of a large tensor (an embedding's million) whose
# gradient is rounding noise. None of a tensor under 10,000 elements may: a layer norm's
# one wrong element out of 32 (a tp sum one element short) is an error. An error of the
# kind a parallel run can make (a collective or a shard wrong or missing, an optimizer
# state not updated) reaches whole tensors, shards or rows.
AMPLIFIED_SHARE = 1e-4


def parameter_report(model, expected: dict, copies: dict, splits: dict, replicas: list,
                     tolerance: float, floor: float, ceiling: float | None = None
                     ) -> tuple[tuple, list[str], list[str]]:
    """Each run copy of each expected parameter against it: the closest call as (share of
    the allowed difference, difference, name), a report line per mismatch, and a line per
    parameter some of whose elements passed the slack ``floor`` within ``ceiling``: few
    enough (:data:`AMPLIFIED_SHARE`) to be AdamW's amplified rounding (update_floor)."""
    worst, mismatches, amplified = (0.0, 0.0, ""), [], []
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
            try:
                if split is not None and len(ordered) > 1:
                    dim, axis = split
                    candidates = [join_feature(ordered, dim, model, axis)]
                else:
                    candidates = ordered  # every tp rank's whole copy
            except (RuntimeError, IndexError):  # pieces a rank sent that do not join
                candidates = []
            if any(got.shape != want.shape for got in candidates) or not candidates:
                copy = f" (stage {stage})" if len(by_stage) > 1 else ""
                mismatches.append(f"  {name}{where}{copy}: the run's copy does not have "
                                  f"the shape {list(want.shape)}  MISMATCH")
                continue
            for got in candidates:
                differences = (got - want).abs()
                difference = float(differences.max())
                beyond = int((differences > allowed).sum()) if difference > allowed else 0
                copy = f" (stage {stage})" if len(by_stage) > 1 else ""
                if beyond and ceiling is not None and \
                        difference <= tolerance * scale + ceiling and \
                        beyond <= int(AMPLIFIED_SHARE * differences.numel()):
                    amplified.append(f"{name}{where}{copy}: {beyond:,} of "
                                     f"{differences.numel():,} elements, up to "
                                     f"{difference:.1e}")
                    continue
                if difference / allowed > worst[0]:
                    worst = (difference / allowed, difference, name)
                if difference > allowed:
                    mismatches.append(f"  {name}{where}{copy}: largest difference "
                                      f"{difference:.2e}, relative "
                                      f"{difference / max(scale, 1e-12):.2e}  MISMATCH")
                    break
    return worst, mismatches, amplified


def exact(plan) -> bool:
    """Whether the plan computes in fp32 throughout, where a sharded run and one process
    differ only by the order of their sums. In bf16 or fp16, and with FP8 GEMMs
    (model { fp8 }), a difference in the last place before a rounding can move a value by
    a whole step of the narrower type: FP8's quantisation is discontinuous, and a 1e-7
    relative perturbation of the weights moves its gradients by about 1% of their largest
    element (a one-process run of a 2-layer llama, 1-rank runtime against the reference),
    so such runs agree to their precision, not to fp32's."""
    return plan.model.dtype == "fp32" and plan.model.options.get("fp8") is None


# DeepSeek-V3's report (section 3.3.2): Hopper's FP8 tensor cores accumulate with about
# 14 bits, where the reference's emulation sums exactly in fp32. Measured on an H200:
# step 0's loss of a 2-layer llama 1.25e-5 from the CPU reference's
TENSOR_CORES_FIRST_STEP = 1e-4


def first_step_tolerance(plan, step: int, tolerance: float, tensor_cores: bool = False
                         ) -> float:
    """The tolerance of ``step``'s loss. In fp32 with FP8 GEMMs, step 0's is fp32's: its
    forward starts from the weights the reference starts from, and only a rounding
    flipped by the order of a sum, one element in thousands, separates the two (1e-7
    relative on a 2-layer llama at tp 2 x pp 2 x dp 2, where leaving out the FP8
    quantisation moves it by 3e-5): the check's hold on the recipe itself. With the
    GEMMs on FP8 tensor cores (``tensor_cores``), whose sums keep fewer bits than the
    reference's, :data:`TENSOR_CORES_FIRST_STEP`; the recipe is then held by
    tests/test_fp8.py's GPU test of the GEMMs themselves."""
    fp32_fp8 = plan.model.dtype == "fp32" and plan.model.options.get("fp8") is not None
    if fp32_fp8 and step == 0:
        return TENSOR_CORES_FIRST_STEP if tensor_cores else 1e-5
    return tolerance


def _rounding(plan) -> str:
    """The rounding that keeps a run from fp32's agreement, as the check names it."""
    return "FP8" if plan.model.options.get("fp8") else "bf16/fp16"


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
    if not exact(plan):
        return None  # half precision or FP8: no slack below an error exists (see compare)
    return 0.1 * optimizer.lr * steps


def amplified_ceiling(plan, steps: int) -> float | None:
    """How far AdamW can carry one element of two correct fp32 runs apart: where its
    gradient is rounding noise, each run's update may take either sign at its largest,
    lr (or lr (1 - beta1) / sqrt(1 - beta2) when that is larger: Kingma and Ba 2015,
    section 2.1's bound on Adam's step), so twice that per step. None where the
    parameters are not compared, or without AdamW."""
    optimizer = plan.train.optimizer
    if optimizer.name != "adamw" or not exact(plan):
        return None
    beta1, beta2 = optimizer.betas
    return 2 * optimizer.lr * steps * max(1.0, (1 - beta1) / (1 - beta2) ** 0.5)
