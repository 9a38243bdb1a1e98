"""Prove that a mixture's balance-loss counts are summed once per token, without deadlock.

A mixture of experts with a balance loss over sequences that several ranks hold (a
compute instruction with ``counts_group``, planc.program.operands) all-reduces the
per-(sequence, expert) counts of its tokens inside its forward (and inside its
recomputed forward; its backward communicates nothing for them). Each rank then adds
its own tokens' share of the loss, and the shares sum to DeepSeek-V3's sequence-wise
loss (planc.runtime.families.moe.balance_loss) when

1. the counts are summed over the sequence group (planc.program.groups.SEQUENCE), whose
   members differ along tp and cp only: the ranks holding the other parts of the same
   sequences of the same microbatch, one rank per part (same dp and pp coordinates);
2. the mixture runs on its 1/tp share of the tokens (or tp = 1), so that no two members
   hold the same token: a mixture whole on every tp rank would count each token tp times;
3. a program issues everything it runs on that group from one stream (the compiler gives
   the group to the mixtures alone), so that its
   all-reduces leave in program order, one per mixture and microbatch, in the same order
   on every member (the ranks of a stage share a program; a rank with a program of its
   own is compared with its group by :meth:`planc.verify.verifier._Verifier.
   collective_order`, which counts these all-reduces among the group's collectives).
"""

from __future__ import annotations

from planc.program.groups import SEQUENCE
from planc.program.operands import FORWARD_STEPS
from planc.program.program import Instruction, Opcode, Program
from planc.verify.report import describe
from planc.plan.mesh import GROUPS


def sums_counts(instruction: Instruction) -> bool:
    """A mixture step whose forward all-reduces its balance loss's counts (a forward or a
    recomputed forward with ``counts_group``)."""
    operands = instruction.operands
    return instruction.op is Opcode.COMPUTE and operands is not None and \
        operands.counts_group is not None and operands.step in FORWARD_STEPS


class CountsChecks:
    """Mixed into the verifier, which provides ``plan``, ``groups`` and ``report``."""

    def counts(self, name: str, program: Program) -> None:
        instructions = [i for i in program.written() if i.operands is not None]
        summing = [i for i in instructions if i.op is Opcode.COMPUTE and
                   i.operands.counts_group is not None]
        if not summing:
            return
        tp = self.plan.mesh.tp
        rule = self.groups.rule(SEQUENCE) if self.groups is not None else None
        for instruction in summing:
            operands = instruction.operands
            if operands.counts_group != SEQUENCE or rule is None or \
                    rule.axes != GROUPS[SEQUENCE].axes or rule.fold or rule.coordinates:
                self.report.add(
                    f"program {name}: {describe(instruction)} sums its balance loss's counts "
                    f"over group {operands.counts_group}; they are summed over the ranks "
                    f"holding parts of each sequence, the {SEQUENCE} group (tp x cp), or "
                    f"some tokens are left out or counted twice")
            elif tp > 1 and not operands.seq_sharded:
                self.report.add(
                    f"program {name}: {describe(instruction)} runs on every token of its tp "
                    f"group but sums its balance loss's counts over tp x cp, counting each "
                    f"token {tp} times; it must run on its 1/tp share")
        on_group = [i for i in instructions if i.operands.group == SEQUENCE or
                    i.operands.counts_group == SEQUENCE]
        streams = sorted({str(i.stream) for i in on_group})
        if len(streams) > 1:
            self.report.add(
                f"program {name}: the {SEQUENCE} group is used from streams {streams}; its "
                f"count all-reduces must leave from one stream in program order, or two "
                f"ranks could wait on each other's counts")
