"""Every instruction's reads and writes name what it runs on.

The proofs of the verifier (events, buffers, frees: planc.verify.streams) order an
instruction after the writers of what it ``reads`` and before the readers of what it
``writes``; the runtime, though, takes its values from its operands (planc.lower.bind).
A build whose reads left out a value its operands take (a build is untrusted input)
would pass those proofs without the wait that value needs, and the runtime would read
it while it is still being computed. So, for each instruction:

- it writes its own node's value;
- it reads every buffer its operands take; a gradient's reduction and an optimizer step
  take theirs through the bucket's gradient buffers (a tp sum: the leading range only),
  which they read, and a reduction also writes;
- a backward or weight step that makes its parameters' gradients (not one that leaves
  them to a later W step) writes the gradient buffers of the buckets holding them, into
  which it adds: the reductions are ordered after it by those writes;
- a backward step reads what the step it differentiates (its forward, or the forward's
  recomputation) kept for it, ``NODE:saved``, a split backward's W step what its input
  half kept, and what any step reads so was written:
  the runtime takes that state from the step that kept it, which nothing else would order
  it after.
"""

from __future__ import annotations

from planc.lower.lower import accumulated_into, gradient_buffers
from planc.program.operands import StepKind
from planc.program.program import Program, saved_for_weights


def reads_and_writes_problem(name: str, program: Program) -> str | None:
    """The first instruction of ``program`` whose reads or writes leave out what its
    operands say it reads or writes, as a report line; None if there is none."""
    owner = None
    written = {buffer for i in program.written() for buffer in i.writes}
    # a split backward's W step, and the input half whose saved state it differentiates
    halves = {i.operands.weight_step: i.node for i in program.written()
              if i.operands is not None and i.operands.weight_step}
    for instruction in program.written():
        operands = instruction.operands
        if operands is None:
            continue
        what = f"{name}: {instruction.op} {instruction.node}"
        if instruction.node is not None and instruction.node not in instruction.writes:
            return f"{what} does not list its own value among its writes"
        reads = set(instruction.reads)
        if operands.kernel == "optimizer" or operands.payload == "grad":
            info = program.buckets.get(operands.bucket)
            if info is None:
                return f"{what} names bucket {operands.bucket}, which the program does not hold"
            names = gradient_buffers(operands.bucket, info)
            taken = names[:1] if operands.payload == "grad" and operands.elements else names
            missing = [b for b in taken if b not in reads]
            if not missing and operands.payload == "grad":
                missing = [b for b in taken if b not in instruction.writes]
            if missing:
                return (f"{what} runs on the gradient buffer {missing[0]} but does not list "
                        f"it among its reads and writes")
        elif operands.payload != "param":  # a ZeRO gather reads the store, not a buffer
            missing = [i.buffer for i in operands.inputs if i.buffer not in reads]
            if missing:
                return (f"{what} takes {missing[0]} (its operands) but does not list it "
                        f"among its reads: nothing would order it after its writer")
        kept = saved_for_weights(operands.saved_from) if operands.saved_from else None
        if operands.step is StepKind.WEIGHT and instruction.node in halves:
            kept = saved_for_weights(halves[instruction.node])
            if kept not in reads:
                return (f"{what} differentiates what {halves[instruction.node]} kept but "
                        f"does not list it ({kept}) among its reads: nothing would order it "
                        f"after that step")
        if operands.step is StepKind.BACKWARD and kept not in reads:
            return (f"{what} continues {operands.saved_from} but does not list what it kept "
                    f"({kept}) among its reads: nothing would order it after that step")
        unwritten = sorted(b for b in reads if b.endswith(saved_for_weights(""))
                           and b not in written)
        if unwritten:
            return (f"{what} reads {unwritten[0]}, which no instruction of the program "
                    f"writes")
        if operands.step in (StepKind.BACKWARD, StepKind.WEIGHT) and operands.params and \
                not operands.weight_step:
            owner = accumulated_into(program.buckets) if owner is None else owner
            missing = sorted({owner[p] for p in operands.params if p in owner} -
                             set(instruction.writes))
            if missing:
                return (f"{what} adds its parameters' gradients into {missing[0]} but does "
                        f"not list it among its writes: their reduction could run before it")
    return None
