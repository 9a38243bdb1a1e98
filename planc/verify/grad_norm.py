"""Prove that ``train { grad_clip }`` clips by the global norm, the same on every rank.

The gradient norm (planc.graph.grad_norm) is right when

1. every program runs its three steps exactly once per step, in the epilogue, in the
   order: every gradient reduction and every step writing a gradient, this rank's share
   of the squared norm, the all-reduce of the shares, the clip, every optimizer step
   (so the norm covers final gradients and every step updates with clipped ones); a
   plan that does not clip runs none of them;
2. the share reads, and the clip rewrites, every gradient buffer of the program's
   buckets, so that the buffer checks (:mod:`planc.verify.streams`) prove the
   waits between them and the reductions and optimizer steps on other streams;
3. the share counts every element of every bucket once over the world: its ranges cover
   each member, and each weight times the number of ranks holding the same value
   (:func:`planc.graph.grad_norm.copies`) is 1;
4. the shares are summed over the ``world`` group (every rank: tp x cp x pp x dp), which
   every program reaches once per step with the same collective, compared across the
   stages as the tied embedding's is (:meth:`planc.verify.verifier._Verifier.
   collective_order`), and which :mod:`planc.verify.progress` runs to the end with
   the rest of the step.
"""

from __future__ import annotations

from planc.graph.grad_norm import copies
from planc.graph.ir import Axis
from planc.lower.lower import gradient_buffers
from planc.program.operands import GRADIENT_STEPS, StepKind
from planc.program.program import STATE, Instruction, Opcode, Program
from planc.verify.report import describe
from planc.plan.mesh import GROUPS

SHARE, CLIP = "grad_norm", "grad_clip"


def _role(instruction: Instruction) -> str | None:
    """share, sum or clip: the part of the gradient norm an instruction runs, if any."""
    operands = instruction.operands
    if operands is None:
        return None
    if instruction.op is Opcode.COMPUTE and operands.kernel in (SHARE, CLIP):
        return "share" if operands.kernel == SHARE else "clip"
    if operands.payload == "grad_norm":
        return "sum"
    return None


class GradNormChecks:
    """Mixed into the verifier, which provides ``plan``, ``graph``, ``groups``, ``table``
    and ``report``."""

    def grad_norm(self, name: str, program: Program) -> None:
        parts = {"share": [], "sum": [], "clip": []}
        for instruction in program.written():
            role = _role(instruction)
            if role is not None:
                parts[role].append(instruction)
        clipping = self.plan.train.grad_clip is not None
        if not clipping:
            found = [i for items in parts.values() for i in items]
            if found:
                self.report.add(f"program {name}: {describe(found[0])} works on the gradient "
                                f"norm, but the plan does not clip (grad_clip = off)")
            return
        for role, what in (("share", "sums its share of the squared gradient norm"),
                           ("sum", "all-reduces the gradient norm"),
                           ("clip", "clips the gradients")):
            found = parts[role]
            outside = [i for i in found if i not in program.epilogue or i.per_microbatch]
            if len(found) != 1 or outside:
                self.report.add(f"program {name}: {len(found)} instructions {what} once per "
                                f"step in the epilogue; grad_clip = {self.plan.train.grad_clip:g} "
                                f"needs exactly one, after the gradients are final and before "
                                f"the optimizer steps")
                return
        share, total, clip = parts["share"][0], parts["sum"][0], parts["clip"][0]
        self._norm_order(name, program, share, total, clip)
        self._norm_buffers(name, program, share, clip)
        self._norm_weights(name, program, share)
        rule = self.groups.rule(Axis.WORLD.value) if self.groups is not None else None
        whole = rule is not None and rule.axes == GROUPS[Axis.WORLD.value].axes and \
            not rule.coordinates and not rule.fold
        if total.operands.group != Axis.WORLD.value or (self.plan.world > 1 and not whole):
            self.report.add(f"program {name}: {describe(total)} sums the shares of the "
                            f"gradient norm over group {total.operands.group}; every rank "
                            f"holds a share, so they are summed over the world group "
                            f"(tp x cp x pp x dp), or some gradients are left out")

    def _norm_order(self, name: str, program: Program, share: Instruction,
                    total: Instruction, clip: Instruction) -> None:
        epilogue = program.epilogue
        at = {id(i): k for k, i in enumerate(epilogue)}
        for k, instruction in enumerate(epilogue):
            operands = instruction.operands
            if operands is None or instruction is clip:
                continue
            writes_gradient = operands.payload == "grad" or instruction.op is Opcode.COMPUTE and \
                operands.step in GRADIENT_STEPS
            if writes_gradient and k > at[id(share)]:
                self.report.add(f"program {name}: {describe(share)} sums the squared "
                                f"gradient norm before {describe(instruction)} makes the "
                                f"gradients final")
                return
            if operands.step == StepKind.OPTIMIZER and k < at[id(clip)]:
                self.report.add(f"program {name}: {describe(instruction)} updates with "
                                f"gradients that {describe(clip)} has not clipped yet")
                return
        if not at[id(share)] < at[id(total)] < at[id(clip)]:
            self.report.add(f"program {name}: the gradient norm runs out of order: its share "
                            f"(instruction {at[id(share)]}), the all-reduce (instruction "
                            f"{at[id(total)]}) and the clip (instruction {at[id(clip)]}) of "
                            f"the epilogue must run in that order")

    def _norm_buffers(self, name: str, program: Program, share: Instruction,
                      clip: Instruction) -> None:
        held = {n for b, info in program.buckets.items() for n in gradient_buffers(b, info)}
        for instruction, side, what in ((share, share.reads, "read"),
                                        (clip, clip.writes, "rewrite")):
            missing = sorted(held - {b for b in side if b.startswith(STATE)})
            if missing:
                self.report.add(f"program {name}: {describe(instruction)} does not {what} "
                                f"{', '.join(missing)}: no wait orders it with the steps "
                                f"writing those gradients")

    def _norm_weights(self, name: str, program: Program, share: Instruction) -> None:
        sizes = self.graph.graph["sizes"]
        ranges: dict[str, list] = {}
        for bucket, start, end, weight in share.operands.norm_ranges:
            ranges.setdefault(bucket, []).append((start, end, weight))
        for bucket_id, bucket in sorted(program.buckets.items()):
            for member in bucket["members"]:
                start, end = member["offset"], member["offset"] + member["numel"]
                held = copies(bucket, member, sizes)
                cover = [(s, e, w) for s, e, w in ranges.get(bucket_id, ())
                         if s < end and start < e]
                counted = sum(min(e, end) - max(s, start) for s, e, _ in cover)
                wrong = [w for _, _, w in cover if abs(w * held - 1) > 1e-12]
                if counted != end - start or wrong:
                    times = f"{wrong[0] * held:g} times" if wrong else "not at all or twice"
                    self.report.add(
                        f"program {name}: {describe(share)} counts {member['param']} "
                        f"(bucket {bucket_id}, elements {start}..{end - 1}, held alike by "
                        f"{held} rank{'s' * (held > 1)}) {times} in the gradient norm; "
                        f"every element counts once")
                    return
