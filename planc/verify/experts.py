"""Prove that a mixture of experts' all-to-alls over its ep group match and cannot
deadlock.

A mixture over ep (a compute instruction whose graph node has ``experts_over``, its
operands naming the ep group: planc.lower.bind) runs its all-to-alls inside: the token
counts per expert, the (token, expert) rows to the experts' ranks, the outputs
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

A mixture cut at its all-to-alls (schedule { overlap_all_to_all }: planc.passes.
split_dispatch) has them as transfers of their own, on the ep stream: rule 1 holds them
to the ep group, rule 2 to one stream, and

4. in each block, a cut mixture's two all-to-alls come in the order its data needs them,
   each between the compute pieces it joins (:meth:`ExpertChecks._cut_order`);
5. the blocks a program interleaves (planc.program.pairs) are the pairs the plan's
   schedule makes, a forward and another microbatch's backward
   (:meth:`ExpertChecks._pairs`; the orders a program writes for its pairs are checked
   before anything reads them: planc.verify.verifier's ``pair_orders``).
"""

from __future__ import annotations

from planc import schedules
from planc.lower.paired import overlapped_blocks
from planc.program.groups import EXPERTS

CUT_PAYLOADS = ("counts", "dispatch", "combine")  # a cut mixture's all-to-alls
# what each of its all-to-alls comes after and before, by payload and direction: the
# pieces' names after the mixture's (planc.passes.split_dispatch)
_BETWEEN = {("counts", "forward"): ("", ":dispatch"),
            ("dispatch", "forward"): (":counts", ":experts"),
            ("combine", "forward"): (":experts", ":sum"),
            ("combine", "backward"): (":sum", ":experts"),
            ("dispatch", "backward"): (":experts", "")}


def _neighbours(mixture: str, payload: str, direction: str | None) -> tuple[str, str]:
    first, then = _BETWEEN[(payload, direction or "forward")]
    return mixture + first, mixture + then


def _op_of(node: str) -> Opcode:
    """A neighbour's opcode: another of the mixture's all-to-alls, or a compute piece."""
    return Opcode.ALL_TO_ALL if node.rpartition(":")[2] in CUT_PAYLOADS else Opcode.COMPUTE
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
        cut = [i for i in instructions if i.op is Opcode.ALL_TO_ALL and
               i.operands is not None and i.operands.payload in CUT_PAYLOADS]
        on_group = [i for i in instructions if i.operands is not None and
                    (i.operands.group or "").partition("/")[0] == EXPERTS]
        for instruction in cut:
            if instruction.operands.group != EXPERTS:
                self.report.add(
                    f"program {name}: {describe(instruction)} moves a mixture's rows over "
                    f"group {instruction.operands.group}; they go to the ranks of the ep "
                    f"group, which hold the other experts")
        self._cut_order(name, program)
        self._pairs(name, program)
        strangers = [i for i in on_group if i not in mixtures and i not in cut]
        for instruction in strangers:
            self.report.add(f"program {name}: {describe(instruction)} runs on the ep group, "
                            f"which only the mixtures' all-to-alls use")
        streams = sorted({str(i.stream) for i in on_group})
        if len(streams) > 1:
            self.report.add(
                f"program {name}: the ep group is used from streams {streams}; its "
                f"all-to-alls must leave from one stream in program order, or two ranks "
                f"could wait in different all-to-alls")

    def _cut_order(self, name: str, program: Program) -> None:
        """Rule 4: in each block, a cut mixture's two all-to-alls come in the order its
        data needs them (the forward's dispatch before its combine, the backward's
        combine before its dispatch) and each between the compute pieces it joins: an
        all-to-all on the wrong side of its pair would wait for rows its own rank has not
        sent yet."""
        for block, items in program.blocks.items():
            at = {(i.op, i.node): k for k, i in enumerate(items) if i.node is not None}
            for (op, node), k in at.items():
                if op is not Opcode.ALL_TO_ALL:
                    continue
                operands = items[k].operands
                if operands is None or operands.payload not in CUT_PAYLOADS:
                    continue
                mixture, _, payload = node.rpartition(":")
                before, after = _neighbours(mixture, payload, operands.direction)
                for other, must in ((before, "after"), (after, "before")):
                    k_other = at.get((_op_of(other), other))
                    if k_other is None:
                        continue
                    if (must == "after") != (k > k_other):
                        self.report.add(
                            f"program {name}: block {block}: all_to_all {node} comes "
                            f"{'before' if must == 'after' else 'after'} {other}; a "
                            f"mixture's {payload} runs {must} it, or it would move rows "
                            f"that are not there yet")

    def _pairs(self, name: str, program: Program) -> None:
        """Rule 5: the interleaved pairs are those the plan's schedule makes
        (planc.lower.paired): a forward and the backward of another microbatch, whose
        instructions read nothing of each other."""
        expected, weights, weighted = overlapped_blocks(
            self.plan, schedules.named(self.plan.schedule.pipeline), program.stage,
            program.blocks)
        if program.paired != expected:
            self.report.add(f"program {name}: it interleaves the blocks at positions "
                            f"{list(program.paired)} of its schedule with the next; the "
                            f"plan's schedule pairs {list(expected)}")
        elif program.paired_weights != weights:
            self.report.add(f"program {name}: its pairs at positions "
                            f"{list(program.paired_weights)} take the weight gradients "
                            f"after them; the plan's schedule has them after "
                            f"{list(weights)}")
        elif program.weighted != weighted:
            self.report.add(f"program {name}: it interleaves the input gradients at "
                            f"positions {list(program.weighted)} of its schedule with "
                            f"their weight gradients; the plan's schedule has "
                            f"{list(weighted)}")
