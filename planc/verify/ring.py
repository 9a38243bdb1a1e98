"""Prove that ring attention's cp ring cannot deadlock or mix up blocks.

A ring attention step (a compute instruction with ``ring_steps``, planc.program.operands)
runs its ring steps inside: each step posts the send of the block in hand to the next
cp rank and the receive from the previous one together, and only then waits (Liu et al.
2023). Within one instruction the cross-rank wait-for graph therefore has no cycle:
rank r waits only for the send of rank r - 1, which r - 1 posted before waiting on
anything. The instructions are then deadlock-free and match block for block when

1. every ring runs on the plan's cp group, with one step per member (``ring_steps`` =
   cp), so that every block visits every rank and the dK/dV accumulators come home;
2. a program issues everything it runs on the cp group from one stream, so that its
   point-to-point messages on that group leave in program order;
3. every member of a cp group runs the same ring instructions, in the same order, for
   the same microbatches (ranks of a stage share a program; a rank with a program of
   its own is compared with its group by :meth:`planc.verify.verifier._Verifier.
   collective_order`, which counts ring attention among the cp group's collectives).
"""

from __future__ import annotations

from planc.program.program import Instruction, Opcode, Program
from planc.verify.report import describe

CP_GROUP = "cp"


def is_ring(instruction: Instruction) -> bool:
    """A ring attention step: a compute instruction that runs cp ring steps."""
    return instruction.op is Opcode.COMPUTE and instruction.operands is not None and \
        bool(instruction.operands.ring_steps)


class RingChecks:
    """Mixed into the verifier, which provides ``plan``, ``programs`` and ``report``."""

    def ring(self, name: str, program: Program) -> None:
        cp = self.plan.mesh.cp
        instructions = list(program.written())
        rings = [i for i in instructions if is_ring(i)]
        if not rings:
            return
        for instruction in rings:
            operands = instruction.operands
            if operands.group != CP_GROUP or operands.ring_steps != cp:
                self.report.add(
                    f"program {name}: {describe(instruction)} runs {operands.ring_steps} "
                    f"ring steps over group {operands.group}; ring attention runs one step "
                    f"per cp rank ({cp}) over cp, or some blocks never meet every query")
        streams = {str(i.stream) for i in rings}
        on_group = [i for i in instructions if i.operands is not None and
                    (i.operands.group or "").partition("/")[0] == CP_GROUP]
        others = sorted({str(i.stream) for i in on_group} - {str(rings[0].stream)})
        if len(streams) > 1 or others:
            self.report.add(
                f"program {name}: the cp group is used from streams "
                f"{sorted(streams | set(others))}; its ring steps must leave from one stream "
                f"in program order, or two ranks could wait on each other's blocks")
