"""Prove that the events a program waits on say what they claim, and that the values a
step reads from another stream outside its own block are waited for.

The proofs of :mod:`planc.verify.streams` order instructions inside one block (or the
prologue, or the epilogue) by its waits and records, and take every wait as running
and every ``done:NODE`` as meaning that NODE has finished. A run of single changes to
compiled programs found each of those assumptions unchecked, with a run that trained
other numbers or stopped with a traceback behind it (docs/programs.md, rule 15):

1. a record of ``done:NODE`` runs on NODE's stream, after NODE, in the same part and on
   the microbatches NODE runs on (a record moved before its all-gather, or onto another
   stream, signalled a transfer still in flight);
2. a wait guarded to one microbatch's instance serves only the instruction after it on
   its stream, which runs on that instance alone (a guard added to a wait left every
   other microbatch's reader unordered);
3. an instruction that reads a pipeline receive waits for it earlier in its part, on
   its stream, on every instance it runs on (the receive streams run beside it);
4. an instruction of the epilogue that reads a gradient buffer a reduction on another
   stream writes waits for the last such reduction (or the epilogue syncs its stream
   first): the optimizer step read a gradient still being reduced.
"""

from __future__ import annotations

import networkx as nx

from planc.program.program import (COLLECTIVES, STATE, Guard, Instruction, Opcode, Program,
                                   done_event, node_of_done)
from planc.verify.report import part_text


class EventChecks:
    """Mixed into the verifier, which provides ``graph``, ``report`` and ``ranks_text``."""

    def events(self, name: str, program: Program) -> None:
        where = f"{self.ranks_text(name)} ({name})"
        parts = [("prologue", program.prologue), *program.blocks.items(),
                 ("epilogue", program.epilogue)]
        for part, instructions in parts:
            self._records_follow_their_node(where, part, instructions)
            self._guarded_waits(where, part, instructions)
        received = {node for items in program.receives.values() for node, _ in items}
        for part, instructions in parts:
            self._receives_waited(where, part, instructions, received)
        self._reductions_waited(where, program)

    def _records_follow_their_node(self, where: str, part: str, instructions) -> None:
        """Rule 1."""
        seen: dict[str, Instruction] = {}
        for instruction in instructions:
            if instruction.op is not Opcode.RECORD:
                if instruction.node is not None:
                    seen[instruction.node] = instruction
                continue
            node = node_of_done(instruction.event or "")
            if node is None:
                continue
            source = seen.get(node)
            if source is None or source.stream != instruction.stream:
                self.report.add(f"{where}: {part_text(part)} records {instruction.event} on "
                                f"stream {instruction.stream} where {node} has not run on "
                                f"that stream before it: the event would say {node} "
                                f"finished while it may still run")
                continue
            # a guarded node's record runs where it runs; an unguarded one's runs on every
            # microbatch, or once, on the last (the lowering's once-per-step records)
            allowed = (source.guard,) if source.guard else (None, Guard.LAST)
            if instruction.guard not in allowed:
                runs = "every microbatch" if source.guard is None else \
                    f"the {source.guard} one"
                self.report.add(f"{where}: {part_text(part)} records {instruction.event} "
                                f"guarded to the {instruction.guard} microbatch, where "
                                f"{node} runs on {runs}")

    def _guarded_waits(self, where: str, part: str, instructions) -> None:
        """Rule 2."""
        following: dict[str, Instruction] = {}  # stream -> the next instruction it runs
        for instruction in reversed(instructions):
            if instruction.op not in (Opcode.WAIT, Opcode.RECORD):
                following[instruction.stream] = instruction
                continue
            if instruction.op is not Opcode.WAIT or instruction.guard is None:
                continue
            served = following.get(instruction.stream)
            if served is None or served.guard != instruction.guard:
                head = (f"{where}: {part_text(part)}: wait {instruction.event} on stream "
                        f"{instruction.stream} runs on the {instruction.guard} microbatch "
                        f"only")
                if served is None:
                    self.report.add(f"{head}, and nothing of its stream follows it")
                else:
                    runs = "every microbatch" if served.guard is None else \
                        f"the {served.guard} one"
                    self.report.add(f"{head}, before {served.op} {served.node} on {runs}: "
                                    f"the others' are not ordered")

    def _receives_waited(self, where: str, part: str, instructions, received: set) -> None:
        """Rule 3."""
        waited: dict[str, set] = {}  # stream -> {(event, guard)}
        for instruction in instructions:
            if instruction.op is Opcode.WAIT:
                waited.setdefault(instruction.stream, set()).add(
                    (instruction.event, instruction.guard))
                continue
            if instruction.op in (Opcode.RECORD, Opcode.SYNC):
                continue
            for buffer in instruction.reads:
                if buffer not in received:
                    continue
                mine = waited.get(instruction.stream, set())
                event = done_event(buffer)
                if (event, None) not in mine and (event, instruction.guard) not in mine:
                    self.report.add(f"{where}: {part_text(part)}: {instruction.op} "
                                    f"{instruction.node} on stream {instruction.stream} reads "
                                    f"the receive {buffer} without waiting for {event}")

    def _reductions_waited(self, where: str, program: Program) -> None:
        """Rule 4. A wait for a later instruction of the reduction's stream, or for one
        the graph orders after it, covers it: the lowering waits for the latest source on
        each stream only (planc.lower.lower._waits)."""
        ordered = _run_order(program)
        reached: dict[str, dict[str, tuple[int, int]]] = {}  # writer -> stream -> earliest
        writers: dict[str, list[Instruction]] = {}  # state buffer -> reductions writing it
        for instruction in program.written():
            if instruction.op in COLLECTIVES:
                for buffer in instruction.writes:
                    if buffer.startswith(STATE):
                        writers.setdefault(buffer, []).append(instruction)
        waited: dict[str, list[Instruction]] = {}
        synced: set[str] = set()
        for instruction in program.epilogue:
            stream = instruction.stream
            if instruction.op is Opcode.SYNC:
                synced.add(stream)
                continue
            if instruction.op is Opcode.WAIT:
                node = node_of_done(instruction.event or "")
                if node in ordered:
                    waited.setdefault(stream, []).append(ordered[node][1])
                continue
            if instruction.op is Opcode.RECORD or stream in synced:
                continue
            for buffer in instruction.reads:
                for writer in writers.get(buffer, ()):
                    if writer.stream == stream or any(
                            self._covers(ordered, reached, done, writer)
                            for done in waited.get(stream, ())):
                        continue
                    self.report.add(f"{where}: epilogue: {instruction.op} {instruction.node}"
                                    f" on stream {stream} reads {buffer} without waiting "
                                    f"for its reduction {writer.node} on stream "
                                    f"{writer.stream}")

    def _covers(self, ordered: dict, reached: dict, done: Instruction,
                writer: Instruction) -> bool:
        """Whether ``done`` having finished implies ``writer`` has: ``done`` runs on a
        stream no earlier than the writer or something the graph orders after it (the
        reduce-scatter a tp sum feeds, then the later reductions of that stream).
        ``reached``: each writer's earliest place on each stream, found once."""
        first = reached.get(writer.node)
        if first is None:
            first = {}
            after = {writer.node}
            if writer.node in self.graph:
                after |= nx.descendants(self.graph, writer.node)
            for node in after:
                if node in ordered:
                    place, instruction = ordered[node]
                    stream = instruction.stream
                    first[stream] = min(first.get(stream, place), place)
            reached[writer.node] = first
        place = first.get(done.stream)
        return place is not None and place <= ordered[done.node][0]


def _run_order(program: Program) -> dict[str, tuple[tuple[int, int], Instruction]]:
    """Each node's instruction with its place in a step's run: the prologue, then the
    blocks by the last schedule entry that runs them, then the epilogue."""
    last = {block: k for k, (block, _) in enumerate(program.schedule)}
    parts = [(-1, program.prologue)] + \
        [(last.get(b, -1), program.blocks[b]) for b in program.blocks] + \
        [(len(program.schedule), program.epilogue)]
    return {i.node: ((rank, k), i) for rank, part in parts for k, i in enumerate(part)
            if i.node is not None}

