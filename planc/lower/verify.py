"""Prove, without running anything, that the rank programs cannot go wrong.

The invariants of docs/semantics.md, section 5:

1. every group issues its collectives in the same order on all its members;
2. every send has exactly one matching receive of the same size, and the ranks cannot
   deadlock (the cross-rank wait-for graph has no cycle);
3. every wait names an event recorded earlier on some stream of the same rank;
4. every buffer is written before it is read, and never overwritten while a transfer
   still reads it.

Programs are folded (blocks run per microbatch, see program.py), and so is most of the
proof: events and buffers are checked once per block, with vector clocks over the
streams (Lamport 1978; Mattern 1989) giving the happens-before order; what crosses
blocks is checked along each stage's schedule. Point-to-point matching and deadlock are
checked along the pipeline by simulating each stage's blocks, sends and receives with
rendezvous semantics (a send and its receive complete together, as NCCL's do): the
programs are deadlock-free exactly when the simulation finishes.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import networkx as nx

from planc.graph.ir import Axis, bucket_problems
from planc.layout import Layout as RankLayout
from planc.lower.program import (
    COLLECTIVES,
    STATE,
    Instruction,
    Program,
    RankTable,
    guard_microbatch,
    vector_clocks,
)
from planc.passes.overlap import unit_of
from planc.plan import Plan

MAX_PROBLEMS = 20


@dataclass
class Report:
    problems: list[str] = field(default_factory=list)

    def add(self, message: str) -> None:
        if len(self.problems) < MAX_PROBLEMS and message not in self.problems:
            self.problems.append(message)

    @property
    def ok(self) -> bool:
        return not self.problems


def _ranks_text(ranks) -> str:
    ranks = sorted(ranks)
    shown = ", ".join(map(str, ranks[:6])) + (f", ... {ranks[-1]}" if len(ranks) > 6 else "")
    return f"rank{'s' if len(ranks) > 1 else ''} {shown}"


def _describe(instruction: Instruction, microbatch: int | None = None) -> str:
    what = instruction.event if instruction.op in ("record", "wait") else instruction.node
    mb = f" (microbatch {microbatch})" if microbatch is not None and \
        instruction.per_microbatch else ""
    return f"{instruction.op} {what}{mb} on stream {instruction.stream}"


class _Verifier:
    def __init__(self, plan: Plan, graph: nx.DiGraph, programs: dict[str, Program],
                 table: RankTable):
        self.plan, self.graph, self.programs, self.table = plan, graph, programs, table
        self.report = Report()
        self.layout = RankLayout.of(plan)
        self._texts: dict[str, str] = {}

    # --- 0. the rank table ------------------------------------------------------------

    def rank_table(self) -> bool:
        table, pp = self.table, self.plan.mesh.pp
        if (table.world, table.pp, table.stride) != (self.plan.world, pp,
                                                      self.layout.strides["pp"]):
            self.report.add("the rank table was made for another mesh")
            return False
        for name in table.names:
            if name not in self.programs:
                self.report.add(f"the rank table names {name}, which does not exist")
                return False
        covered = sorted(table.stages.values())
        if covered != list(range(pp)):
            self.report.add(f"the rank table gives stages {covered} a program; the pipeline "
                            f"has stages 0..{pp - 1}, one program each")
            return False
        for name, stage in table.stages.items():
            if self.programs[name].stage != stage:
                self.report.add(f"the rank table runs {name}, the program of stage "
                                f"{self.programs[name].stage}, on stage {stage}")
                return False
        for rank, name in table.overrides.items():
            if not 0 <= rank < self.plan.world:
                self.report.add(f"the rank table lists rank {rank}, outside the world of "
                                f"{self.plan.world}")
                return False
            if self.programs[name].stage != table.stage_of(rank):
                self.report.add(f"rank {rank} is on pipeline stage {table.stage_of(rank)} but "
                                f"runs {name}, the program of stage {self.programs[name].stage}")
                return False
        return True

    @property
    def uniform(self) -> bool:
        """Whether every rank of a stage runs that stage's program."""
        return all(self.table.stages.get(name) == self.table.stage_of(rank)
                   for rank, name in self.table.overrides.items())

    def ranks_text(self, name: str) -> str:
        """'ranks 0, 1, 4, 5' for a program (walks the world, so only for reports)."""
        if name not in self._texts:
            self._texts[name] = _ranks_text(list(self.table.ranks(name)))
        return self._texts[name]

    # --- 3 and 4. events and buffers, block by block ------------------------------------

    def events_and_buffers(self, name: str, program: Program) -> None:
        ranks = _Lazy(lambda: self.ranks_text(name))
        for block in {b for b, _ in program.schedule} - set(program.blocks):
            self.report.add(f"{ranks} ({name}) schedule names block {block}, which does not "
                            f"exist")
            return
        receive_events = {(f"done:{node}", mb) for items in program.receives.values()
                          for node, mb in items}
        prologue = self._check_sequence(program.prologue,
                                        _Lazy(lambda: f"{ranks} ({name}, prologue)"),
                                        external=False)
        step_events = {e for e, per_mb in prologue.records if not per_mb}
        summaries = {}
        for block, instructions in program.blocks.items():
            where = _Lazy(lambda b=block: f"{ranks} ({name}, block {b})")
            summaries[block] = self._check_sequence(instructions, where, external=True,
                                                    clocks=self._gathers(instructions))
            self._guards(where, instructions, summaries[block])
            self._prefetch(where, instructions, summaries[block])
        positions: dict[tuple[str, int], int] = {}
        for k, (block, mb) in enumerate(program.schedule):
            positions.setdefault((block, mb), k)
        last_run = {block: max(k for (b, _), k in positions.items() if b == block)
                    for block in {b for b, _ in positions}}
        # Events a block waits for from outside itself: recorded by a receive of the same
        # microbatch, by a block that ran earlier for that microbatch, or, once per step,
        # by the prologue or by a block's guarded instance that ran earlier.
        recorded: dict[int, set[str]] = {}
        for block, mb in program.schedule:
            summary = summaries[block]
            for instruction in summary.external:
                if not program.runs(instruction, mb):
                    continue
                event = instruction.event
                if instruction.per_microbatch and ((event, mb) in receive_events or
                                                   event in recorded.get(mb, ())):
                    continue
                if not instruction.per_microbatch and event in step_events:
                    continue
                self.report.add(f"{ranks} ({name}): {_describe(instruction, mb)} in block "
                                f"{block} waits for an event no earlier instruction records")
            for instruction in summary.record_instructions:
                if program.runs(instruction, mb):
                    if instruction.per_microbatch:
                        recorded.setdefault(mb, set()).add(instruction.event)
                    else:
                        step_events.add(instruction.event)
        epilogue = self._check_sequence(program.epilogue,
                                        _Lazy(lambda: f"{ranks} ({name}, epilogue)"),
                                        external=True)
        for instruction in epilogue.external:
            if instruction.per_microbatch or instruction.event not in step_events:
                self.report.add(f"{ranks} ({name}, epilogue): {_describe(instruction)} waits "
                                f"for an event no earlier instruction records")
        self._accumulations(ranks, name, program, positions, last_run)
        self._frees(ranks, name, program, positions)
        self._gathered_first(ranks, name, program)

    def _guards(self, where, instructions, summary: "_Sequence") -> None:
        """A once-per-step record must be guarded (else it is recorded every microbatch),
        and a wait must run only where its record runs."""
        guard_of = {}
        for instruction in instructions:
            if instruction.op == "record":
                if not instruction.per_microbatch and instruction.guard is None:
                    self.report.add(f"{where}: {_describe(instruction)} records a once-per-step "
                                    f"event on every microbatch; it needs a guard")
                guard_of[(instruction.event, instruction.per_microbatch)] = instruction.guard
            elif instruction.op == "wait":
                key = (instruction.event, instruction.per_microbatch)
                if key in guard_of and guard_of[key] not in (None, instruction.guard):
                    self.report.add(f"{where}: {_describe(instruction)} runs on microbatches "
                                    f"where its event is not recorded (the record is guarded "
                                    f"'{guard_of[key]}')")

    def _prefetch(self, where, instructions, summary: "_Sequence") -> None:
        """ZeRO-3: the gathers of unit k + 2 start only after every reader of unit k
        finished, so at most two units are gathered at once (their buffers are reused)."""
        units: dict[str, list[int]] = {}
        for k in self._gathers(instructions):
            units.setdefault(unit_of(self.graph, instructions[k].node), []).append(k)
        order = list(units.values())
        for n, unit in enumerate(order[2:], start=2):
            earlier = {instructions[k].node for k in order[n - 2]}
            for k in unit:
                for r, reader in enumerate(instructions):
                    if earlier.intersection(reader.reads) and not summary.before(r, k):
                        gathered = sorted(earlier.intersection(reader.reads))[0]
                        self.report.add(
                            f"{where}: {_describe(instructions[k])} (instruction {k}) "
                            f"prefetches a third ZeRO-3 unit while {_describe(reader)} "
                            f"(instruction {r}) may still read {gathered}, whose buffer it "
                            f"reuses")
                        return

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
                if instruction.per_microbatch or instruction.op in ("record", "wait", "sync"):
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
                                f"{ranks} ({name}): {_describe(instruction)} in block {block} "
                                f"{when} but reads {source} summed over every microbatch, and "
                                f"block {producer} still runs for later microbatches")
        for instruction in program.prologue:
            for source in instruction.reads:
                if source in home and self.graph.nodes.get(source, {}).get("per_microbatch"):
                    self.report.add(f"{ranks} ({name}, prologue): {_describe(instruction)} "
                                    f"reads {source} before any microbatch ran")

    def _gathered_first(self, ranks, name: str, program: Program) -> None:
        """A bucket gathered at the start of the step on another stream (ZeRO-1/2 with
        overlap): each forward step reading one of its parameters waits for the gather."""
        gathers, order = {}, {}
        for k, instruction in enumerate(program.prologue):
            data = self.graph.nodes.get(instruction.node or "", {})
            if data.get("payload") == "param":
                order[f"done:{instruction.node}"] = (instruction.stream, k)
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
                if instruction.op == "wait" and not instruction.per_microbatch and \
                        instruction.event in order:
                    stream, k = order[instruction.event]
                    key = (instruction.stream, stream)
                    waited[key] = max(waited.get(key, -1), k)
                if instruction.op != "compute":
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
                            f"{ranks} ({name}, block {block}): {_describe(instruction)} reads "
                            f"{param} without waiting for {_describe(gather)}, which gathers "
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
        for block, instructions in program.blocks.items():
            for instruction in instructions:
                for buffer in instruction.frees:
                    for other, k in readers.get(buffer, []):
                        if other == block:
                            continue  # checked with the block's own clocks
                        for (b, mb), at in positions.items():
                            if b == block and positions.get((other, mb), -1) > at:
                                late.setdefault((other, block, mb), []).append(buffer)
                                break
                        if other not in finals:
                            finals[other] = vector_clocks(program.blocks[other])[1]
                        reader = program.blocks[other][k]
                        if finals[other].get(instruction.stream, {}).get(reader.stream,
                                                                          -1) < k:
                            self.report.add(
                                f"{ranks} ({name}): {_describe(instruction)} in block "
                                f"{block} frees {buffer}, which {_describe(reader)} in block "
                                f"{other} may still be reading: stream {instruction.stream} "
                                f"never waits for it")
        for (other, block, mb), buffers in late.items():
            shown = ", ".join(buffers[:3]) + (f" and {len(buffers) - 3} more"
                                              if len(buffers) > 3 else "")
            self.report.add(f"{ranks} ({name}): block {other} reads {shown} (microbatch {mb}) "
                            f"after block {block} freed {'them' if len(buffers) > 1 else 'it'}")

    def _gathers(self, instructions) -> list[int]:
        """Positions of a block's ZeRO-3 parameter gathers."""
        return [k for k, i in enumerate(instructions) if i.op == "all_gather" and
                i.node in self.graph and self.graph.nodes[i.node].get("payload") == "param"
                and i.per_microbatch]

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
            if instruction.op == "sync":
                everything = {s: max(c.get(s, -1) for c in clock.values()) for s in clock}
                for c in clock.values():
                    c.update(everything)
                sequence.clocks.append(dict(mine) if keep else None)
                continue
            key = (instruction.event, instruction.per_microbatch)
            if instruction.op == "wait":
                if key in events:
                    for s, value in events[key].items():
                        mine[s] = max(mine.get(s, -1), value)
                elif external:
                    sequence.external.append(instruction)
                else:
                    self.report.add(f"{where}: {_describe(instruction)} (instruction "
                                    f"{position}) waits for an event no earlier instruction "
                                    f"records")
                sequence.clocks.append(dict(mine) if keep else None)
                continue
            if instruction.op == "record":
                events[key] = dict(mine)
                sequence.records.add(key)
                sequence.record_instructions.append(instruction)
                sequence.clocks.append(dict(mine) if keep else None)
                continue

            def happened(before: int, before_stream: str) -> bool:
                return before_stream == stream or mine.get(before_stream, -1) >= before

            for buffer in instruction.reads:
                if buffer in freed:
                    self.report.add(f"{where}: {_describe(instruction)} (instruction "
                                    f"{position}) reads {buffer} after instruction "
                                    f"{freed[buffer]} freed it")
                if buffer in writer:
                    at, source = writer[buffer]
                    if not happened(at, source.stream):
                        self.report.add(f"{where}: {_describe(instruction)} (instruction "
                                        f"{position}) reads {buffer} while {_describe(source)} "
                                        f"(instruction {at}) may still be writing it: no wait "
                                        f"on its event")
                elif buffer in produced and not buffer.startswith(STATE):
                    self.report.add(f"{where}: {_describe(instruction)} (instruction "
                                    f"{position}) reads {buffer} before it is written")
            for buffer in instruction.writes:
                for at, reader in readers.get(buffer, []):
                    if not happened(at, reader.stream):
                        self.report.add(
                            f"{where}: {_describe(instruction)} (instruction {position}) "
                            f"overwrites {buffer} while {_describe(reader)} (instruction {at}) "
                            f"may still be reading it")
                if buffer.startswith(STATE):  # accumulated into: ordered, not unique
                    at = writer.get(buffer)
                    if at is not None and not happened(at[0], at[1].stream):
                        self.report.add(f"{where}: {_describe(instruction)} (instruction "
                                        f"{position}) writes {buffer} while "
                                        f"{_describe(at[1])} (instruction {at[0]}) may still "
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
                        self.report.add(f"{where}: {_describe(instruction)} (instruction "
                                        f"{position}) frees {buffer} while "
                                        f"{_describe(reader)} (instruction {at}) may still "
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
                    self.report.add(f"{where}: the block ends while {_describe(reader)} "
                                    f"(instruction {position}) may still read {buffer}, which "
                                    f"stream {writer} writes again for the next microbatch")

    # --- bucket layouts --------------------------------------------------------------

    def buckets(self, name: str, program: Program) -> None:
        """The program's buckets are the graph's, with consistent layouts, and every
        bucket an instruction works on is among them."""
        table = self.graph.graph.get("buckets", {})
        for bucket_id, bucket in program.buckets.items():
            if table.get(bucket_id) != bucket:
                self.report.add(f"{name}: bucket {bucket_id} differs from the graph's")
            for problem in bucket_problems(bucket):
                self.report.add(f"{name}: bucket {bucket_id}: {problem}")
        used = {self.graph.nodes[i.node].get("bucket") for part in
                (*program.blocks.values(), program.prologue, program.epilogue)
                for i in part if i.node in self.graph}
        for bucket_id in sorted(b for b in used if b is not None and
                                b not in program.buckets):
            self.report.add(f"{name}: instructions work on bucket {bucket_id}, which the "
                            f"program does not hold")

    # --- 1. collective order ------------------------------------------------------------

    def collective_order(self) -> None:
        table = self.table
        if not self.uniform:  # some ranks run a program of their own: compare their groups
            for rank in sorted(table.overrides):
                for axis in Axis:
                    if axis.within_stage and axis != Axis.STAGE:
                        self._compare_members(axis.value, self.layout.group(rank, axis.value))
        if self.plan.model.tie_embeddings and self.plan.mesh.pp > 1:
            last = self.plan.mesh.pp - 1
            pairs = {(0, self.layout.rank({"tp": 0, "cp": 0, "pp": last, "dp": 0}))}
            for rank in table.overrides:  # and every pair involving an override
                coords = self.layout.coords(rank)
                pairs.add((self.layout.rank({**coords, "pp": 0}),
                           self.layout.rank({**coords, "pp": last})))
            for pair in sorted(pairs):
                self._compare_members("tied", pair)

    def _collectives(self, name: str, axis: str) -> list[tuple[str, str, int | None]]:
        program = self.programs[name]
        axis_of = {n: self.graph.nodes[n].get("axis") for n in self.graph.nodes}
        out = []
        for item in program.expand():
            if item.op in COLLECTIVES and axis_of.get(item.node) == axis:
                out.append((item.op, item.node, item.microbatch))
        return out

    def _compare_members(self, axis: str, members) -> None:
        names = {r: self.table.program_of(r) for r in members}
        if len(set(names.values())) == 1 and axis != "tied":
            return
        sequences = {r: self._collectives(names[r], axis) for r in members}
        first = members[0]
        for r in members[1:]:
            a, b = sequences[first], sequences[r]
            for k in range(max(len(a), len(b))):
                x = a[k] if k < len(a) else None
                y = b[k] if k < len(b) else None
                if self._same_collective(x, y, axis):
                    continue
                self.report.add(
                    f"{axis} group {list(members)}: collective {k + 1} on this group is "
                    f"{_collective_text(x)} on rank {first} but {_collective_text(y)} on "
                    f"rank {r}: the group would deadlock or mix up data")
                break

    def _same_collective(self, x, y, axis: str) -> bool:
        if x is None or y is None:
            return x == y
        if axis == "tied":  # the two stages' nodes share the name of their collective
            name = lambda node: self.graph.nodes[node].get("collective", node) \
                if node in self.graph else node  # noqa: E731
            return x[0] == y[0] and name(x[1]) == name(y[1]) and x[2] == y[2]
        return x == y

    # --- 2. point to point, and deadlock ------------------------------------------------

    def pipeline(self) -> None:
        pp = self.plan.mesh.pp
        if pp == 1:
            return
        actors = self._actors()
        for actor in actors.values():
            actor.sends = {stream: [] for stream in ("send_next", "send_prev")}
        before = len(self.report.problems)
        self._check_matching(actors)
        if len(self.report.problems) == before:  # only matched transfers can be simulated
            self._simulate(actors)

    def _actors(self) -> dict[int, "_Actor"]:
        """One actor per stage, standing for all its ranks, when every rank runs its
        stage's program; otherwise also one per rank along the pp column of each rank
        that runs another program."""
        pp = self.plan.mesh.pp

        def column(coords) -> list[int]:
            return [self.layout.rank({**coords, "pp": s}) for s in range(pp)]

        columns = [(column({"tp": 0, "cp": 0, "dp": 0}), self.uniform)]
        for rank in sorted(self.table.overrides):
            columns.append((column(self.layout.coords(rank)), False))
        actors = {}
        for ranks, representative in columns:
            for s, r in enumerate(ranks):
                name = self.table.program_of(r)
                text = _Lazy(lambda n=name: self.ranks_text(n)) if representative else \
                    _Lazy(lambda r=r: f"rank {r}")
                actors[r] = _Actor(r, s, name, self.programs[name], text)
            for s, r in enumerate(ranks):
                actors[r].next = ranks[(s + 1) % pp]
                actors[r].prev = ranks[(s - 1) % pp]
        return actors

    def _sends_of(self, program: Program) -> dict[str, list[tuple[str, int]]]:
        sends: dict[str, list[tuple[str, int]]] = {"send_next": [], "send_prev": []}
        per_block = {name: [(i.stream, i.node) for i in block if i.op == "send"]
                     for name, block in program.blocks.items()}
        for block, mb in program.schedule:
            for stream, node in per_block.get(block, ()):
                sends.setdefault(stream, []).append((node, mb))
        return sends

    def _check_matching(self, actors: dict[int, "_Actor"]) -> None:
        cache: dict[tuple[str, str, str], None] = {}
        for actor in actors.values():
            actor.sends = self._sends_of(actor.program)
        for actor in actors.values():
            for stream, peer_id, receive_stream in (("send_next", actor.next, "recv_prev"),
                                                    ("send_prev", actor.prev, "recv_next")):
                peer = actors[peer_id]
                key = (actor.name, peer.name, stream)
                if key in cache:
                    continue
                cache[key] = None
                sent = [(self._receive_of(node), mb) for node, mb in actor.sends.get(stream, [])]
                received = list(peer.program.receives.get(receive_stream, ()))
                self._compare_p2p(actor, peer, stream, receive_stream, sent, received)

    def _receive_of(self, send: str) -> str:
        return next((n for n in self.graph.successors(send)
                     if self.graph.nodes[n].get("kind") == "recv"), send) \
            if send in self.graph else send

    def _compare_p2p(self, actor, peer, stream, receive_stream, sent, received) -> None:
        for k in range(max(len(sent), len(received))):
            x = sent[k] if k < len(sent) else None
            y = received[k] if k < len(received) else None
            if x == y:
                if x is not None and x[0] in self.graph and (
                        self.graph.nodes[x[0]]["bytes"] !=
                        self.graph.nodes[self._send_of(x[0])]["bytes"]):
                    self.report.add(f"{actor.text()} and {peer.text()} disagree on the size "
                                    f"of {x[0]}")
                continue
            if y is None:
                self.report.add(f"{actor.text()} sends {_p2p_text(x)} on {stream} to "
                                f"{peer.text()}, which has no matching receive")
            elif x is None:
                self.report.add(f"{peer.text()} waits on {receive_stream} for {_p2p_text(y)} "
                                f"that {actor.text()} never sends")
            else:
                self.report.add(f"{actor.text()} sends {_p2p_text(x)} as send {k + 1} on "
                                f"{stream}, but {peer.text()} expects {_p2p_text(y)} as its "
                                f"receive {k + 1} on {receive_stream}")
            return

    def _send_of(self, receive: str) -> str:
        return next(iter(self.graph.predecessors(receive)), receive)

    def _simulate(self, actors: dict[int, "_Actor"]) -> None:
        """Rendezvous simulation of blocks, sends and receives along the pipeline."""
        for actor in actors.values():
            actor.start()
        progress = True
        while progress:
            progress = False
            for actor in actors.values():
                while actor.try_block():
                    progress = True
            for actor in actors.values():
                for stream, peer_id, receive_stream in (("send_next", actor.next, "recv_prev"),
                                                        ("send_prev", actor.prev, "recv_next")):
                    peer = actors[peer_id]
                    queue = actor.pending[stream]
                    while queue and peer.receive_head(receive_stream) == \
                            (self._receive_of(queue[0][0]), queue[0][1]):
                        queue.popleft()
                        peer.receive_done(receive_stream)
                        progress = True
            for actor in actors.values():
                if actor.try_finish(actors):
                    progress = True
        stuck = [a for a in actors.values() if not a.finished]
        if not stuck:
            return
        waits = {a.rank: a.waiting_for(actors, self._receive_of) for a in stuck}
        cycle = _find_cycle({r: w[0] for r, w in waits.items() if w[0] is not None})
        detail = "; ".join(f"{actors[r].text()} {waits[r][1]}" for r in (cycle or
                                                                          list(waits)[:4]))
        kind = "a cycle of waits" if cycle else "ranks that wait forever"
        self.report.add(f"the programs deadlock ({kind}): {detail}")

    def run(self) -> Report:
        if not self.rank_table():
            return self.report
        for name, program in self.programs.items():
            if name in self.table.names:
                self.events_and_buffers(name, program)
                self.buckets(name, program)
        self.collective_order()
        self.pipeline()
        return self.report


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


class _Lazy:
    """Text computed the first time a report needs it."""

    def __init__(self, make):
        self.make, self.value = make, None

    def __str__(self) -> str:
        if self.value is None:
            self.value = self.make()
        return self.value

    __format__ = lambda self, spec: format(str(self), spec)  # noqa: E731


def _collective_text(item) -> str:
    if item is None:
        return "nothing (it stops earlier)"
    op, node, mb = item
    return f"{op} {node}" + (f" (microbatch {mb})" if mb is not None else "")


def _p2p_text(item) -> str:
    node, mb = item
    return f"{node} (microbatch {mb})"


def _find_cycle(edges: dict[int, int]) -> list[int] | None:
    for start in edges:
        seen, node = [], start
        while node in edges and node not in seen:
            seen.append(node)
            node = edges[node]
        if node in seen:
            return seen[seen.index(node):]
    return None


class _Actor:
    """A rank (or a stage, standing for its ranks) in the pipeline simulation."""

    def __init__(self, rank: int, stage: int, name: str, program: Program, ranks: "_Lazy"):
        self.rank, self.stage, self.name, self.program, self.ranks = rank, stage, name, \
            program, ranks
        self.next = self.prev = rank
        self.sends: dict[str, list] = {}
        self.finished = False

    def text(self) -> str:
        return f"stage {self.stage} ({self.ranks})"

    def start(self) -> None:
        self.position = 0
        self.pending = {"send_next": deque(), "send_prev": deque()}
        self.received = {stream: 0 for stream in self.program.receives}
        self.receive_index = {stream: {item: i for i, item in enumerate(items)}
                              for stream, items in self.program.receives.items()}
        receive_stream = {node: stream for stream, items in self.program.receives.items()
                          for node, _ in items}
        # per block: the receives (stream, node) it waits for
        self.block_waits = {
            name: [(receive_stream[i.event[len("done:"):]], i.event[len("done:"):])
                   for i in block if i.op == "wait" and i.event.startswith("done:")
                   and i.event[len("done:"):] in receive_stream]
            for name, block in self.program.blocks.items()}
        self.block_sends = {name: [(i.stream, i.node) for i in block if i.op == "send"]
                            for name, block in self.program.blocks.items()}

    def _blocked_on(self) -> tuple[str, tuple[str, int]] | None:
        """The receive the next block waits for and has not got, if any."""
        block, mb = self.program.schedule[self.position]
        for stream, node in self.block_waits[block]:
            i = self.receive_index[stream].get((node, mb))
            if i is not None and i >= self.received[stream]:
                return stream, (node, mb)
        return None

    def try_block(self) -> bool:
        if self.position >= len(self.program.schedule) or self._blocked_on() is not None:
            return False
        block, mb = self.program.schedule[self.position]
        for stream, node in self.block_sends[block]:
            self.pending[stream].append((node, mb))
        self.position += 1
        return True

    def receive_head(self, stream: str):
        items = self.program.receives.get(stream, ())
        i = self.received.get(stream, 0)
        return items[i] if i < len(items) else None

    def receive_done(self, stream: str) -> None:
        self.received[stream] += 1

    def drained(self) -> bool:
        return (self.position >= len(self.program.schedule)
                and not any(self.pending.values())
                and all(self.received[s] == len(items)
                        for s, items in self.program.receives.items()))

    def try_finish(self, actors) -> bool:
        if self.finished or not self.drained():
            return False
        self.finished = True
        return True

    def waiting_for(self, actors, receive_of) -> tuple[int | None, str]:
        if self.position < len(self.program.schedule):
            blocked = self._blocked_on()
            if blocked is not None:
                stream, item = blocked
                peer = self.prev if stream == "recv_prev" else self.next
                return peer, (f"waits in block {self.program.schedule[self.position][0]} "
                              f"(microbatch {self.program.schedule[self.position][1]}) for "
                              f"{_p2p_text(item)} from stage {actors[peer].stage}")
        for stream, queue in self.pending.items():
            if queue:
                peer = self.next if stream == "send_next" else self.prev
                return peer, (f"waits to send {_p2p_text(queue[0])} on {stream} until stage "
                              f"{actors[peer].stage} receives it")
        for stream in self.program.receives:
            head = self.receive_head(stream)
            if head is not None:
                peer = self.prev if stream == "recv_prev" else self.next
                return peer, f"waits on {stream} for {_p2p_text(head)}"
        return None, "is done"


def verify(plan: Plan, graph: nx.DiGraph, programs: dict[str, Program],
           table: RankTable) -> Report:
    return _Verifier(plan, graph, programs, table).run()
