"""The verifier's rules for what crosses a program's blocks along the stage's schedule
(docs/programs.md, the verifier): a value is read only after the block that writes it ran
for that microbatch, once-per-step work reads sums over every microbatch, a forward waits
for the buckets gathered at the start of the step, and no buffer is read after the block
that frees it."""

from __future__ import annotations

from planc.program.program import (
    EVENT_OPS,
    STATE,
    Opcode,
    Program,
    done_event,
    guard_microbatch,
)
from planc.program.happens_before import vector_clocks
from planc.verify.report import describe


class AcrossBlocksChecks:
    """Mixed into the verifier: needs ``self.graph`` and ``self.report``."""

    def _written_before_read(self, ranks, name: str, program: Program, positions) -> None:
        """A block that reads a value another block writes for the same microbatch (a
        backward its forward's activations, a weight gradient what its input gradient
        saved) runs after that block: on one stream no event orders them, the schedule
        alone does."""
        writer: dict[str, str] = {}
        for block, instructions in program.blocks.items():
            for instruction in instructions:
                if instruction.per_microbatch:
                    for value in instruction.writes:
                        if not value.startswith(STATE):  # accumulated by many blocks
                            writer.setdefault(value, block)
        needs: dict[str, dict[str, str]] = {}  # block -> {the block it reads from: a value}
        for block, instructions in program.blocks.items():
            for instruction in instructions:
                if instruction.per_microbatch:
                    for value in instruction.reads:
                        source = writer.get(value, block)
                        if source != block:
                            needs.setdefault(block, {}).setdefault(source, value)
        never = len(program.schedule)
        for k, (block, mb) in enumerate(program.schedule):
            for source, value in needs.get(block, {}).items():
                if positions.get((source, mb), never) > k:
                    self.report.add(f"{ranks} ({name}): block {block} (microbatch {mb}) "
                                    f"reads {value}, which block {source} writes for that "
                                    f"microbatch only later in the schedule")

    def _accumulations(self, ranks, name: str, program: Program, positions, last_run) -> None:
        """Once-per-step work that reads a per-microbatch value reads its sum over every
        microbatch: it must run after the last microbatch of the block that writes it."""
        home = {i.node: block for block, items in program.blocks.items() for i in items
                if i.node is not None}
        writers: dict[str, set[str]] = {}  # a state buffer -> the blocks writing it
        for block, items in program.blocks.items():
            for i in items:
                for buffer in i.writes:
                    if buffer.startswith(STATE) and i.per_microbatch:
                        writers.setdefault(buffer, set()).add(block)
        for block, instructions in program.blocks.items():
            for instruction in instructions:
                if instruction.per_microbatch or instruction.op in EVENT_OPS:
                    continue
                mb = guard_microbatch(instruction.guard, program.microbatches)
                at = positions.get((block, mb))
                for source in instruction.reads:
                    if source.startswith(STATE):
                        producers = writers.get(source, set())
                    else:
                        data = self.graph.nodes.get(source, {})
                        producers = {home[source]} if source in home and \
                            data.get("per_microbatch") else set()
                    for producer in sorted(producers):
                        if at is None or last_run.get(producer, -1) > at:
                            when = "never runs" if at is None else \
                                f"runs on microbatch {mb} (guard '{instruction.guard}')"
                            self.report.add(
                                f"{ranks} ({name}): {describe(instruction)} in block {block} "
                                f"{when} but reads {source} summed over every microbatch, and "
                                f"block {producer} still runs for later microbatches")
        for instruction in program.prologue:
            for source in instruction.reads:
                if source in home and self.graph.nodes.get(source, {}).get("per_microbatch"):
                    self.report.add(f"{ranks} ({name}, prologue): {describe(instruction)} "
                                    f"reads {source} before any microbatch ran")

    def _gathered_first(self, ranks, name: str, program: Program) -> None:
        """A bucket gathered at the start of the step on another stream (ZeRO-1/2 with
        overlap): each forward step reading one of its parameters waits for the gather."""
        gathers, order = {}, {}
        for k, instruction in enumerate(program.prologue):
            data = self.graph.nodes.get(instruction.node or "", {})
            if data.get("payload") == "param":
                order[done_event(instruction.node)] = (instruction.stream, k)
                for member in program.buckets.get(data["bucket"], {}).get("members", ()):
                    gathers[member["param"]] = (instruction, k)
        if not gathers:
            return
        for block, instructions in program.blocks.items():
            # per waiting stream and gathering stream: the latest gather waited for (its
            # stream ran every earlier one before it)
            waited: dict[tuple[str, str], int] = {}
            reported: set[str] = set()
            for instruction in instructions:
                if instruction.op is Opcode.WAIT and not instruction.per_microbatch and \
                        instruction.event in order:
                    stream, k = order[instruction.event]
                    key = (instruction.stream, stream)
                    waited[key] = max(waited.get(key, -1), k)
                if instruction.op is not Opcode.COMPUTE:
                    continue
                data = self.graph.nodes.get(instruction.node, {})
                if data.get("phase") != "forward":
                    continue  # later work of the stream follows the forward that waited
                for param in data.get("params", ()):
                    gather, k = gathers.get(param, (None, 0))
                    if gather is None or gather.stream == instruction.stream:
                        continue
                    if waited.get((instruction.stream, gather.stream), -1) < k and \
                            gather.node not in reported:
                        reported.add(gather.node)
                        self.report.add(
                            f"{ranks} ({name}, block {block}): {describe(instruction)} reads "
                            f"{param} without waiting for {describe(gather)}, which gathers "
                            f"it at the start of the step")
                        break

    def _frees(self, ranks, name: str, program: Program, positions) -> None:
        """No block reads a buffer after the block that frees it ran, for one microbatch;
        and a reader in an earlier block finished, on the freeing stream, before that
        block ended (else the free could overtake it)."""
        readers: dict[str, list[tuple[str, int]]] = {}
        for block, instructions in program.blocks.items():
            for k, instruction in enumerate(instructions):
                for buffer in instruction.reads:
                    readers.setdefault(buffer, []).append((block, k))
        finals = {}
        late: dict[tuple[str, str, int], list[str]] = {}
        runs: dict[str, list[tuple[int, int]]] = {}  # block -> (microbatch, position)
        for (b, mb), at in positions.items():
            runs.setdefault(b, []).append((mb, at))
        first_late: dict[tuple[str, str], int | None] = {}  # (block, other) -> microbatch
        for block, instructions in program.blocks.items():
            for instruction in instructions:
                for buffer in instruction.frees:
                    for other, k in readers.get(buffer, []):
                        if other == block:
                            continue  # checked with the block's own clocks
                        if (block, other) not in first_late:  # once per pair of blocks
                            first_late[(block, other)] = next(
                                (mb for mb, at in runs.get(block, ())
                                 if positions.get((other, mb), -1) > at), None)
                        mb = first_late[(block, other)]
                        if mb is not None:
                            late.setdefault((other, block, mb), []).append(buffer)
                        if other not in finals:
                            finals[other] = vector_clocks(program.blocks[other])[1]
                        reader = program.blocks[other][k]
                        if finals[other].get(instruction.stream, {}).get(reader.stream,
                                                                          -1) < k:
                            self.report.add(
                                f"{ranks} ({name}): {describe(instruction)} in block "
                                f"{block} frees {buffer}, which {describe(reader)} in block "
                                f"{other} may still be reading: stream {instruction.stream} "
                                f"never waits for it")
        for (other, block, mb), buffers in late.items():
            shown = ", ".join(buffers[:3]) + (f" and {len(buffers) - 3} more"
                                              if len(buffers) > 3 else "")
            self.report.add(f"{ranks} ({name}): block {other} reads {shown} (microbatch {mb}) "
                            f"after block {block} freed {'them' if len(buffers) > 1 else 'it'}")
