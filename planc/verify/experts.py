"""Prove that a mixture of experts' all-to-alls over its ep group match and cannot
deadlock.

A mixture over ep (a compute instruction whose graph node has ``experts_over``, its
operands naming the ep group: planc.lower.bind) runs its all-to-alls inside: the token
counts, the (token, expert) rows and their experts to the experts' ranks, the outputs
back, and in backward the gradients the same ways reversed (GShard's dispatch and
combine, Lepikhin et al. 2021). Each is a collective every member of the group enters,
and none waits on anything outside the instruction, so the instructions match and no
member waits for one that another never enters when

1. every mixture names the plan's ep group, over ``ep`` ranks, and nothing else runs on
   that group: the experts it dispatches to are the ones its peers hold;
2. a program issues everything on the ep group from one stream, so in program order;
3. every member of an ep group runs the same mixtures in the same order, for the same
   microbatches: the members are ranks of one stage, which share a program; a rank with a
   program of its own is compared with its group by :meth:`planc.verify.verifier._Verifier.
   collective_order`, which counts the mixtures among the ep group's collectives.
"""

from __future__ import annotations

from planc.program.groups import EXPERTS
from planc.program.program import Instruction, Opcode, Program
from planc.verify.report import describe


def is_expert_exchange(instruction: Instruction) -> bool:
    """A mixture dispatching over its ep group: a compute instruction on that group."""
    return instruction.op is Opcode.COMPUTE and instruction.operands is not None and \
        instruction.operands.group == EXPERTS


class ExpertChecks:
    """Mixed into the verifier, which provides ``plan``, ``graph``, ``programs`` and
    ``report``."""

    def experts(self, name: str, program: Program) -> None:
        ep = self.plan.mesh.ep
        instructions = list(program.written())
        mixtures = [i for i in instructions if i.op is Opcode.COMPUTE and i.node in self.graph
                    and self.graph.nodes[i.node].get("experts_over")]
        for instruction in mixtures:
            over = self.graph.nodes[instruction.node]["experts_over"]
            if instruction.operands is None or instruction.operands.group != EXPERTS or \
                    over != ep:
                group = instruction.operands.group if instruction.operands else None
                self.report.add(
                    f"program {name}: {describe(instruction)} dispatches over {over} ranks "
                    f"of group {group}; a mixture dispatches over the plan's ep group "
                    f"({ep} ranks), whose members hold the other experts")
        on_group = [i for i in instructions if i.operands is not None and
                    (i.operands.group or "").partition("/")[0] == EXPERTS]
        strangers = [i for i in on_group if i not in mixtures]
        for instruction in strangers:
            self.report.add(f"program {name}: {describe(instruction)} runs on the ep group, "
                            f"which only the mixtures' all-to-alls use")
        streams = sorted({str(i.stream) for i in on_group})
        if len(streams) > 1:
            self.report.add(
                f"program {name}: the ep group is used from streams {streams}; its "
                f"all-to-alls must leave from one stream in program order, or two ranks "
                f"could wait in different all-to-alls")
