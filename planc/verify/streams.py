"""The verifier's rules for one program: events, buffers, guards and buckets, block by
block with vector clocks over the streams (Lamport 1978; Mattern 1989), and what crosses
blocks along the stage's schedule (planc.verify.across_blocks; docs/programs.md, the
verifier, rules 3 to 9)."""

from __future__ import annotations

from planc.program.pair_orders import merged
from planc.program.program import (
    STATE,
    Instruction,
    Opcode,
    Program,
    done_event,
    guard_microbatch,
)
from planc.verify.across_blocks import AcrossBlocksChecks
from planc.verify.report import Lazy, describe
from planc.passes.overlap import unit_of


class StreamChecks(AcrossBlocksChecks):
    """Mixed into the verifier: needs ``self.graph``, ``self.report``, ``ranks_text``."""

    # --- 3 and 4. events and buffers, block by block ------------------------------------

    def events_and_buffers(self, name: str, program: Program) -> None:
        ranks = Lazy(lambda: self.ranks_text(name))
        for block in {b for b, _ in program.schedule} - set(program.blocks):
            self.report.add(f"{ranks} ({name}) schedule names block {block}, which does not "
                            f"exist")
            return
        prologue = self._check_sequence(program.prologue,
                                        Lazy(lambda: f"{ranks} ({name}, prologue)"),
                                        external=False)
        step_events = {e for e, per_mb in prologue.records if not per_mb}
        summaries = {}
        for block, instructions in program.blocks.items():
            where = Lazy(lambda b=block: f"{ranks} ({name}, block {b})")
            summaries[block] = self._check_sequence(instructions, where, external=True,
                                                    clocks=self._gathers(instructions))
            self._guards(where, instructions, summaries[block])
            self._prefetch(where, instructions, summaries[block])
        self._paired_weights(ranks, name, program)
        positions: dict[tuple[str, int], int] = {}  # each block run's first position
        last_run: dict[str, int] = {}  # the last of a block's runs' first positions
        first_run: dict[str, int] = {}
        runs: dict[str, list[tuple[int, int]]] = {}  # block -> its (position, microbatch)
        for k, entry in enumerate(program.schedule):
            if entry not in positions:
                positions[entry] = last_run[entry[0]] = k
                first_run.setdefault(entry[0], k)
            runs.setdefault(entry[0], []).append((k, entry[1]))
        # Events a block waits for from outside itself: recorded by a receive of the same
        # microbatch, by a block that ran earlier for that microbatch, or, once per step,
        # by the prologue or by a block's guarded instance that ran earlier. Checked per
        # run of a block without walking its records: where each event is recorded, and
        # where each block first runs for each microbatch, say whether it ran earlier.
        m, never = program.microbatches, len(program.schedule)
        interned: dict[frozenset, frozenset] = {}
        arrivals: dict[str, set[int]] = {}
        for items in program.receives.values():
            for node, mb in items:
                arrivals.setdefault(done_event(node), set()).add(mb)
        received = {event: interned.setdefault(frozenset(mbs), frozenset(mbs))
                    for event, mbs in arrivals.items()}
        recorders: dict[tuple[str, bool], set[tuple[str, str | None]]] = {}
        for block, summary in summaries.items():
            for instruction in summary.record_instructions:
                recorders.setdefault((instruction.event, instruction.per_microbatch),
                                     set()).add((block, instruction.guard))

        def step_run(block: str, guard: str | None) -> int:
            """The position of the first run of a once-per-step record."""
            if guard is None:
                return first_run.get(block, never)
            return positions.get((block, guard_microbatch(guard, m)), never)

        def satisfied(instruction: Instruction, mb: int, k: int) -> bool:
            event = instruction.event
            if instruction.per_microbatch:
                return mb in received.get(event, ()) or any(
                    guard_microbatch(guard, m) in (None, mb) and
                    positions.get((block, mb), never) < k
                    for block, guard in recorders.get((event, True), ()))
            return event in step_events or any(
                step_run(block, guard) < k for block, guard in recorders.get((event, False), ()))

        # Waits that the same records and receives satisfy are checked once per run.
        kinds: dict[str, list[Instruction]] = {}
        for block, summary in summaries.items():
            alike: dict[tuple, Instruction] = {}
            for instruction in summary.external:
                key = (instruction.per_microbatch, instruction.guard,
                       tuple(sorted(recorders.get((instruction.event,
                                                   instruction.per_microbatch), ()),
                                    key=lambda r: (r[0], r[1] or ""))),
                       id(received.get(instruction.event)) if instruction.per_microbatch
                       else instruction.event in step_events)
                alike.setdefault(key, instruction)
            kinds[block] = list(alike.values())
        failing: set[int] = set()
        for block, alike in kinds.items():
            every = runs.get(block, [])
            microbatches = {mb for _, mb in every}
            for instruction in alike:
                if instruction.per_microbatch and instruction.guard is None and \
                        microbatches <= received.get(instruction.event, frozenset()):
                    continue  # a receive's event, recorded for every microbatch: the usual
                failing.update(k for k, mb in every if program.runs(instruction, mb)
                               and not satisfied(instruction, mb, k))
        for k in sorted(failing):
            block, mb = program.schedule[k]
            for instruction in summaries[block].external:
                if program.runs(instruction, mb) and not satisfied(instruction, mb, k):
                    self.report.add(f"{ranks} ({name}): {describe(instruction, mb)} in block "
                                    f"{block} waits for an event no earlier instruction "
                                    f"records")
        step_events |= {event for (event, per_mb), where in recorders.items() if not per_mb
                        and any(step_run(block, guard) < never for block, guard in where)}
        epilogue = self._check_sequence(program.epilogue,
                                        Lazy(lambda: f"{ranks} ({name}, epilogue)"),
                                        external=True)
        for instruction in epilogue.external:
            if instruction.per_microbatch or instruction.event not in step_events:
                self.report.add(f"{ranks} ({name}, epilogue): {describe(instruction)} waits "
                                f"for an event no earlier instruction records")
        self._accumulations(ranks, name, program, positions, last_run)
        self._frees(ranks, name, program, positions)
        self._gathered_first(ranks, name, program)
        self._written_before_read(ranks, name, program, positions)

    def _paired_weights(self, ranks, name: str, program: Program) -> None:
        """A pair that takes its weight gradients (planc.program.pairs), or an input
        gradient run with the weight gradients after it (``weighted``: its own
        microbatch's, or an earlier one's), moves them among the input gradient's
        instructions: checked as one sequence, by buffer names, the two blocks free
        nothing a transfer may still read, and read nothing before it is written (each
        instance once: the first, the last and any other microbatch)."""
        seen = set()
        for k, first in [(k, 1) for k in program.paired_weights] + \
                [(k, 0) for k in program.weighted]:
            entries = program.schedule[k:k + program.together(k)]
            if len(entries) != 3 - first:  # overlapping positions: the pairs' rule says so
                continue
            key = tuple((b, mb == 0, mb == program.microbatches - 1) for b, mb in entries)
            if key in seen:
                continue
            seen.add(key)
            both = [instruction for side, instruction in merged(program, entries)
                    if side >= first]
            self._check_sequence(both, Lazy(lambda e=entries[first:]: (
                f"{ranks} ({name}, blocks {e[0][0]} and {e[1][0]} interleaved, "
                + (f"microbatch {e[0][1]})" if e[0][1] == e[1][1] else
                   f"microbatches {e[0][1]} and {e[1][1]})"))), external=True)

    def _guards(self, where, instructions, summary: "_Sequence") -> None:
        """A once-per-step record must be guarded (else it is recorded every microbatch),
        and a wait must run only where its record runs."""
        guard_of = {}
        for instruction in instructions:
            if instruction.op is Opcode.RECORD:
                if not instruction.per_microbatch and instruction.guard is None:
                    self.report.add(f"{where}: {describe(instruction)} records a once-per-step "
                                    f"event on every microbatch; it needs a guard")
                guard_of[(instruction.event, instruction.per_microbatch)] = instruction.guard
            elif instruction.op is Opcode.WAIT:
                key = (instruction.event, instruction.per_microbatch)
                if key in guard_of and guard_of[key] not in (None, instruction.guard):
                    self.report.add(f"{where}: {describe(instruction)} runs on microbatches "
                                    f"where its event is not recorded (the record is guarded "
                                    f"'{guard_of[key]}')")

    def _prefetch(self, where, instructions, summary: "_Sequence") -> None:
        """ZeRO-3: the gathers of unit k + 2 start only after every reader of unit k
        finished, so at most two units are gathered at once. A unit a forward's gather
        keeps for this backward (the head's: planc.estimate.memory.head_unit_kept) is
        whole when the block starts: its first unit."""
        position = {instructions[k].node: k for k in self._gathers(instructions)}
        units: dict[str, list[str]] = {}
        for node in position:
            units.setdefault(unit_of(self.graph, node), []).append(node)
        kept: dict[str, dict[str, None]] = {}  # unit -> its gathers, in order of reading
        for reader in instructions:
            for buffer in reader.reads:
                if buffer not in position and self._parameter_gather(buffer) and \
                        self.graph.nodes[buffer].get("per_microbatch"):
                    kept.setdefault(unit_of(self.graph, buffer), {})[buffer] = None
        order = [list(unit) for unit in kept.values()] + list(units.values())
        if len(order) < 3:
            return
        readers: dict[str, list[int]] = {}  # a gathered buffer -> the instructions reading it
        gathered_nodes = {node for unit in order for node in unit}
        for r, reader in enumerate(instructions):
            for buffer in set(reader.reads) & gathered_nodes:
                readers.setdefault(buffer, []).append(r)
        for n, unit in enumerate(order[2:], start=2):
            earlier = set(order[n - 2])
            reading = sorted({r for node in earlier for r in readers.get(node, ())})
            for k in map(position.__getitem__, unit):
                for r in reading:
                    reader = instructions[r]
                    if not summary.before(r, k):
                        gathered = sorted(earlier.intersection(reader.reads))[0]
                        self.report.add(
                            f"{where}: {describe(instructions[k])} (instruction {k}) "
                            f"prefetches a third ZeRO-3 unit while {describe(reader)} "
                            f"(instruction {r}) may still read {gathered}, whose buffer it "
                            f"reuses")
                        return

    def _gathers(self, instructions) -> list[int]:
        """Positions of a block's ZeRO-3 parameter gathers."""
        return [k for k, i in enumerate(instructions) if i.op is Opcode.ALL_GATHER and
                self._parameter_gather(i.node) and i.per_microbatch]

    def _parameter_gather(self, node: str | None) -> bool:
        """Whether graph node ``node`` gathers parameters (ZeRO's)."""
        return node in self.graph and self.graph.nodes[node].get("payload") == "param"

    def _check_sequence(self, instructions, where, external: bool,
                        clocks: list[int] | None = None) -> "_Sequence":
        """Vector clocks over the streams of one block (or the prologue or epilogue);
        each instruction's clock is kept when ``clocks`` says the block needs them."""
        keep = bool(clocks)
        clock: dict[str, dict[str, int]] = {}
        events: dict[tuple[str, bool], dict[str, int]] = {}
        writer: dict[str, tuple[int, Instruction]] = {}  # buffer -> (position, instruction)
        readers: dict[str, list[tuple[int, Instruction]]] = {}
        freed: dict[str, int] = {}
        produced = {w for i in instructions for w in i.writes}
        sequence = _Sequence()
        for position, instruction in enumerate(instructions):
            stream = instruction.stream
            mine = clock.setdefault(stream, {})
            if instruction.op is Opcode.SYNC:
                everything = {s: max(c.get(s, -1) for c in clock.values()) for s in clock}
                for c in clock.values():
                    c.update(everything)
                sequence.clocks.append(dict(mine) if keep else None)
                continue
            key = (instruction.event, instruction.per_microbatch)
            if instruction.op is Opcode.WAIT:
                if key in events:
                    for s, value in events[key].items():
                        mine[s] = max(mine.get(s, -1), value)
                elif external:
                    sequence.external.append(instruction)
                else:
                    self.report.add(f"{where}: {describe(instruction)} (instruction "
                                    f"{position}) waits for an event no earlier instruction "
                                    f"records")
                sequence.clocks.append(dict(mine) if keep else None)
                continue
            if instruction.op is Opcode.RECORD:
                events[key] = dict(mine)
                sequence.records.add(key)
                sequence.record_instructions.append(instruction)
                sequence.clocks.append(dict(mine) if keep else None)
                continue

            def happened(before: int, before_stream: str) -> bool:
                return before_stream == stream or mine.get(before_stream, -1) >= before

            for buffer in instruction.reads:
                if buffer in freed:
                    self.report.add(f"{where}: {describe(instruction)} (instruction "
                                    f"{position}) reads {buffer} after instruction "
                                    f"{freed[buffer]} freed it")
                if buffer in writer:
                    at, source = writer[buffer]
                    if not happened(at, source.stream):
                        self.report.add(f"{where}: {describe(instruction)} (instruction "
                                        f"{position}) reads {buffer} while {describe(source)} "
                                        f"(instruction {at}) may still be writing it: no wait "
                                        f"on its event")
                elif buffer in produced and not buffer.startswith(STATE):
                    self.report.add(f"{where}: {describe(instruction)} (instruction "
                                    f"{position}) reads {buffer} before it is written")
            for buffer in instruction.writes:
                for at, reader in readers.get(buffer, []):
                    if not happened(at, reader.stream):
                        self.report.add(
                            f"{where}: {describe(instruction)} (instruction {position}) "
                            f"overwrites {buffer} while {describe(reader)} (instruction {at}) "
                            f"may still be reading it")
                if buffer.startswith(STATE):  # accumulated into: ordered, not unique
                    at = writer.get(buffer)
                    if at is not None and not happened(at[0], at[1].stream):
                        self.report.add(f"{where}: {describe(instruction)} (instruction "
                                        f"{position}) writes {buffer} while "
                                        f"{describe(at[1])} (instruction {at[0]}) may still "
                                        f"be writing it")
                elif buffer in writer and writer[buffer][1] is not instruction:
                    self.report.add(f"{where}: {buffer} is written twice, by instruction "
                                    f"{writer[buffer][0]} and {position}")
                writer[buffer] = (position, instruction)
            for buffer in instruction.reads:
                readers.setdefault(buffer, []).append((position, instruction))
            for buffer in instruction.frees:
                freed[buffer] = position
                for at, reader in readers.get(buffer, []):
                    if reader is not instruction and not happened(at, reader.stream):
                        self.report.add(f"{where}: {describe(instruction)} (instruction "
                                        f"{position}) frees {buffer} while "
                                        f"{describe(reader)} (instruction {at}) may still "
                                        f"be reading it")
            mine[stream] = position
            sequence.clocks.append(dict(mine) if keep else None)
        sequence.streams = [i.stream for i in instructions]
        if external:
            self._closed(where, instructions, clock)
        return sequence

    def _closed(self, where, instructions, clock) -> None:
        """The next microbatch's instance of a block writes its state buffers again: by
        the block's end, each stream that writes one has seen every per-microbatch read of
        it on another stream finish."""
        last_read: dict[tuple[str, str], tuple[int, Instruction]] = {}
        writers: dict[str, set[str]] = {}
        for position, instruction in enumerate(instructions):
            for buffer in instruction.reads:
                if buffer.startswith(STATE) and instruction.per_microbatch:
                    last_read[(buffer, instruction.stream)] = (position, instruction)
            for buffer in instruction.writes:
                if buffer.startswith(STATE):
                    writers.setdefault(buffer, set()).add(instruction.stream)
        for (buffer, stream), (position, reader) in last_read.items():
            for writer in writers.get(buffer, ()):
                if writer != stream and clock.get(writer, {}).get(stream, -1) < position:
                    self.report.add(f"{where}: the block ends while {describe(reader)} "
                                    f"(instruction {position}) may still read {buffer}, which "
                                    f"stream {writer} writes again for the next microbatch")


class _Sequence:
    """What the check of one instruction sequence learned: the waits it could not match
    inside itself, the events it records, and each instruction's vector clock."""

    def __init__(self):
        self.external: list[Instruction] = []
        self.records: set[tuple[str, bool]] = set()
        self.record_instructions: list[Instruction] = []
        self.clocks: list[dict[str, int]] = []
        self.streams: list[str] = []

    def before(self, a: int, b: int) -> bool:
        """Whether instruction a finished before instruction b starts."""
        if a >= b:
            return False
        return self.streams[a] == self.streams[b] or \
            self.clocks[b].get(self.streams[a], -1) >= a
