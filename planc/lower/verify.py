"""Prove, without running anything, that the rank programs cannot go wrong.

The invariants of semantics.md section 5:

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

from planc.layout import Layout as RankLayout
from planc.lower.program import COLLECTIVES, Instruction, Program, RankTable
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
        receive_events = {(f"done:{node}", mb) for items in program.receives.values()
                          for node, mb in items}
        records_by_block: dict[str, set[str]] = {}
        for block, instructions in program.blocks.items():
            records_by_block[block] = self._check_sequence(
                instructions, _Lazy(lambda b=block: f"{ranks} ({name}, block {b})"),
                external=True)
        # Events a block waits for from outside itself: recorded by a receive of the same
        # microbatch, or by a block that ran earlier for that microbatch.
        recorded: dict[int, set[str]] = {}
        for block, mb in program.schedule:
            if block not in program.blocks:
                self.report.add(f"{ranks} ({name}) schedule names block {block}, which does "
                                f"not exist")
                return
            own: set[str] = set()
            for instruction in program.blocks[block]:
                if instruction.op == "record":
                    own.add(instruction.event)
                if instruction.op != "wait" or instruction.event in own:
                    continue
                event = instruction.event
                if instruction.per_microbatch and ((event, mb) in receive_events or
                                                   event in recorded.get(mb, ())):
                    continue
                if not instruction.per_microbatch and event in recorded.get(None, ()):
                    continue
                self.report.add(f"{ranks} ({name}): {_describe(instruction, mb)} in block "
                                f"{block} waits for an event no earlier instruction records")
            recorded.setdefault(mb, set()).update(
                i.event for i in program.blocks[block] if i.op == "record" and
                i.per_microbatch)
            recorded.setdefault(None, set()).update(
                i.event for i in program.blocks[block] if i.op == "record" and
                not i.per_microbatch)
        self._check_sequence(program.epilogue, _Lazy(lambda: f"{ranks} ({name}, epilogue)"),
                             external=False)

    def _check_sequence(self, instructions, where: str, external: bool) -> set[str]:
        """Vector clocks over the streams of one block (or the epilogue)."""
        clock: dict[str, dict[str, int]] = {}
        events: dict[str, dict[str, int]] = {}
        writer: dict[str, tuple[int, Instruction]] = {}  # buffer -> (position, instruction)
        readers: dict[str, list[tuple[int, Instruction]]] = {}  # in-flight transfers
        produced = {i.node for i in instructions if i.node}
        for position, instruction in enumerate(instructions):
            stream = instruction.stream
            mine = clock.setdefault(stream, {})
            if instruction.op == "sync":
                everything = {s: max(c.get(s, -1) for c in clock.values()) for s in clock}
                for c in clock.values():
                    c.update(everything)
                continue
            if instruction.op == "wait":
                if instruction.event in events:
                    for s, value in events[instruction.event].items():
                        mine[s] = max(mine.get(s, -1), value)
                elif not external:
                    self.report.add(f"{where}: {_describe(instruction)} (instruction "
                                    f"{position}) waits for an event no earlier instruction "
                                    f"records")
                continue
            if instruction.op == "record":
                events[instruction.event] = dict(mine)
                continue

            def happened(before: int, before_stream: str) -> bool:
                return before_stream == stream or mine.get(before_stream, -1) >= before

            for buffer in instruction.reads:
                if buffer in writer:
                    at, source = writer[buffer]
                    if not happened(at, source.stream):
                        self.report.add(f"{where}: {_describe(instruction)} (instruction "
                                        f"{position}) reads {buffer} while {_describe(source)} "
                                        f"(instruction {at}) may still be writing it: no wait "
                                        f"on its event")
                elif buffer in produced:
                    self.report.add(f"{where}: {_describe(instruction)} (instruction "
                                    f"{position}) reads {buffer} before it is written")
            for buffer in instruction.writes:
                for at, reader in readers.get(buffer, []):
                    if not happened(at, reader.stream):
                        self.report.add(
                            f"{where}: {_describe(instruction)} (instruction {position}) "
                            f"overwrites {buffer} while {_describe(reader)} (instruction {at}) "
                            f"may still be reading it")
                if buffer in writer and writer[buffer][1] is not instruction:
                    self.report.add(f"{where}: {buffer} is written twice, by instruction "
                                    f"{writer[buffer][0]} and {position}")
                writer[buffer] = (position, instruction)
            if instruction.op != "compute":
                for buffer in instruction.reads:
                    readers.setdefault(buffer, []).append((position, instruction))
            mine[stream] = position
        return set(events)

    # --- 1. collective order ------------------------------------------------------------

    def collective_order(self) -> None:
        table = self.table
        if not self.uniform:  # some ranks run a program of their own: compare their groups
            for rank in sorted(table.overrides):
                for axis in ("tp", "cp", "dp_cp"):
                    self._compare_members(axis, self.layout.group(rank, axis))
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

    @staticmethod
    def _same_collective(x, y, axis: str) -> bool:
        if x is None or y is None:
            return x == y
        if axis == "tied":  # the two stages' nodes differ only in their #s suffix
            return x[0] == y[0] and x[1].split("#")[0] == y[1].split("#")[0] and x[2] == y[2]
        return x == y

    # --- 2. point to point, and deadlock ------------------------------------------------

    def pipeline(self) -> None:
        pp = self.plan.mesh.pp
        if pp == 1:
            return
        actors = self._actors()
        for actor in actors.values():
            actor.sends = {stream: [] for stream in ("send_next", "send_prev")}
        self._check_matching(actors)
        if self.report.ok:
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
        self.collective_order()
        self.pipeline()
        return self.report


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
