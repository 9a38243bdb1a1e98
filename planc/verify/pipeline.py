"""The verifier's rules across stages: every send matched by one receive of the same size,
in the same order, and no deadlock, proven by simulating each stage's blocks, sends and
receives with rendezvous semantics (a send and its receive complete together, as NCCL's
do): the programs are deadlock-free exactly when the simulation finishes."""

from __future__ import annotations

from collections import deque

from planc.program.program import Opcode, Program, node_of_done
from planc.verify.report import Lazy


class PipelineChecks:
    """Mixed into the verifier: needs ``self.plan``, ``self.graph``, ``self.programs``,
    ``self.table``, ``self.layout``, ``self.report``, ``uniform``, ``ranks_text`` and
    ``receive_of_send`` (a dict, the cache of :meth:`_receive_of`)."""

    # --- 2. point to point, and deadlock ------------------------------------------------

    def pipeline(self) -> None:
        pp = self.plan.mesh.pp
        if pp == 1:
            return
        actors = self._actors()
        before = len(self.report.problems)
        self._check_matching(actors)
        if len(self.report.problems) == before:  # only matched transfers can be simulated
            self._simulate(actors)

    def _actors(self) -> dict[int, "_Actor"]:
        """One actor per stage, standing for all its ranks, when every rank runs its
        stage's program; otherwise also one per rank along the pp column of each rank
        that runs another program."""
        pp = self.plan.mesh.pp
        column = self.layout.ranks.pipeline_column
        columns = [(column(0), self.uniform)]
        for rank in sorted(self.table.overrides):
            columns.append((column(rank), False))
        actors = {}
        for ranks, representative in columns:
            for s, r in enumerate(ranks):
                name = self.table.program_of(r)
                text = Lazy(lambda n=name: self.ranks_text(n)) if representative else \
                    Lazy(lambda r=r: f"rank {r}")
                actors[r] = _Actor(r, s, name, self.programs[name], text)
            for s, r in enumerate(ranks):
                actors[r].next = ranks[(s + 1) % pp]
                actors[r].prev = ranks[(s - 1) % pp]
        return actors

    def _sends_of(self, program: Program) -> dict[str, list[tuple[str, int]]]:
        """Per send stream, what the program sends in one step, in order, as (the receive
        node it matches, microbatch)."""
        sends: dict[str, list[tuple[str, int]]] = {"send_next": [], "send_prev": []}
        per_block = {name: [(sends.setdefault(i.stream, []), self._receive_of(i.node))
                            for i in block if i.op is Opcode.SEND]
                     for name, block in program.blocks.items()}
        for block, mb in program.schedule:
            for into, receive in per_block.get(block, ()):
                into.append((receive, mb))
        return sends

    def _check_matching(self, actors: dict[int, "_Actor"]) -> None:
        checked: set[tuple[str, str, str]] = set()
        sends: dict[str, dict[str, list[tuple[str, int]]]] = {}  # program -> its sends
        for actor in actors.values():
            if actor.name not in sends:
                sends[actor.name] = self._sends_of(actor.program)
        for actor in actors.values():
            for stream, peer_id, receive_stream in (("send_next", actor.next, "recv_prev"),
                                                    ("send_prev", actor.prev, "recv_next")):
                peer = actors[peer_id]
                key = (actor.name, peer.name, stream)
                if key in checked:
                    continue
                checked.add(key)
                sent = sends[actor.name].get(stream, [])
                received = list(peer.program.receives.get(receive_stream, ()))
                self._compare_p2p(actor, peer, stream, receive_stream, sent, received)

    def _receive_of(self, send: str) -> str:
        cache = self.receive_of_send
        if send not in cache:
            cache[send] = next((n for n in self.graph.successors(send)
                                if self.graph.nodes[n].get("kind") == "recv"), send) \
                if send in self.graph else send
        return cache[send]

    def _compare_p2p(self, actor, peer, stream, receive_stream, sent, received) -> None:
        if sent == received:  # the common case, compared at C speed; then sizes, once each
            for node in dict.fromkeys(node for node, _ in sent):
                self._compare_size(actor, peer, node)
            return
        sized: set[str] = set()  # receives whose size was compared (once, not per microbatch)
        for k in range(max(len(sent), len(received))):
            x = sent[k] if k < len(sent) else None
            y = received[k] if k < len(received) else None
            if x == y:
                if x is not None and x[0] not in sized:
                    sized.add(x[0])
                    self._compare_size(actor, peer, x[0])
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

    def _compare_size(self, actor, peer, receive: str) -> None:
        if receive in self.graph and (self.graph.nodes[receive]["bytes"] !=
                                      self.graph.nodes[self._send_of(receive)]["bytes"]):
            self.report.add(f"{actor.text()} and {peer.text()} disagree on the size of "
                            f"{receive}")

    def _send_of(self, receive: str) -> str:
        return next(iter(self.graph.predecessors(receive)), receive)

    def _simulate(self, actors: dict[int, "_Actor"]) -> None:
        """Rendezvous simulation of blocks, sends and receives along the pipeline. An
        actor runs blocks until one waits for a receive that has not completed. Sends and
        receives were just found to match in order, so a send completes with the peer's
        next receive as soon as it is issued: a receive stream only counts. Only an actor
        whose receive just completed can move again, so a work list visits each block
        once: linear in the schedules, and the same end state as sweeping over every
        actor until none moves."""
        for actor in actors.values():
            actor.start()
        work = deque(actors.values())
        queued = set(actors)
        while work:
            actor = work.popleft()
            queued.discard(actor.rank)
            sent = actor.run_blocks()
            for stream, peer_id, receive_stream in (("send_next", actor.next, "recv_prev"),
                                                    ("send_prev", actor.prev, "recv_next")):
                if sent.get(stream):
                    peer = actors[peer_id]
                    peer.received[receive_stream] += sent[stream]
                    if peer.rank not in queued:
                        work.append(peer)
                        queued.add(peer.rank)
        for actor in actors.values():
            actor.try_finish(actors)
        stuck = [a for a in actors.values() if not a.finished]
        if not stuck:
            return
        waits = {a.rank: a.waiting_for(actors, self._receive_of) for a in stuck}
        cycle = _find_cycle({r: w[0] for r, w in waits.items() if w[0] is not None})
        detail = "; ".join(f"{actors[r].text()} {waits[r][1]}" for r in (cycle or
                                                                          list(waits)[:4]))
        kind = "a cycle of waits" if cycle else "ranks that wait forever"
        self.report.add(f"the programs deadlock ({kind}): {detail}")


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

    def __init__(self, rank: int, stage: int, name: str, program: Program, ranks: "Lazy"):
        self.rank, self.stage, self.name, self.program, self.ranks = rank, stage, name, \
            program, ranks
        self.next = self.prev = rank
        self.finished = False

    def text(self) -> str:
        return f"stage {self.stage} ({self.ranks})"

    def start(self) -> None:
        self.position = 0
        self.received = {stream: 0 for stream in self.program.receives}
        self.receive_index = {stream: {item: i for i, item in enumerate(items)}
                              for stream, items in self.program.receives.items()}
        receive_stream = {node: stream for stream, items in self.program.receives.items()
                          for node, _ in items}
        # per block: the receives (stream, node) it waits for
        self.block_waits = {
            name: [(receive_stream[node], node)
                   for node in (node_of_done(i.event) for i in block if i.op is Opcode.WAIT)
                   if node in receive_stream]
            for name, block in self.program.blocks.items()}
        self.block_sends = {}  # per block: how many sends it issues on each stream
        for name, block in self.program.blocks.items():
            counts: dict[str, int] = {}
            for i in block:
                if i.op is Opcode.SEND:
                    counts[i.stream] = counts.get(i.stream, 0) + 1
            self.block_sends[name] = tuple(counts.items())

    def _blocked_on(self) -> tuple[str, tuple[str, int]] | None:
        """The receive the next block waits for and has not got, if any."""
        block, mb = self.program.schedule[self.position]
        for stream, node in self.block_waits[block]:
            i = self.receive_index[stream].get((node, mb))
            if i is not None and i >= self.received[stream]:
                return stream, (node, mb)
        return None

    def run_blocks(self) -> dict[str, int]:
        """Run scheduled blocks until one waits for a receive not yet completed (what
        :meth:`_blocked_on` finds, inlined: this loop runs once per block and microbatch);
        returns how many sends they issued on each stream."""
        schedule, received, sent = self.program.schedule, self.received, {}
        waits, sends, index = self.block_waits, self.block_sends, self.receive_index
        p, end = self.position, len(schedule)
        while p < end:
            block, mb = schedule[p]
            for stream, node in waits[block]:
                i = index[stream].get((node, mb))
                if i is not None and i >= received[stream]:
                    self.position = p
                    return sent
            for stream, count in sends[block]:
                sent[stream] = sent.get(stream, 0) + count
            p += 1
        self.position = p
        return sent

    def receive_head(self, stream: str):
        items = self.program.receives.get(stream, ())
        i = self.received.get(stream, 0)
        return items[i] if i < len(items) else None

    def drained(self) -> bool:
        return (self.position >= len(self.program.schedule)
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
        for stream in self.program.receives:
            head = self.receive_head(stream)
            if head is not None:
                peer = self.prev if stream == "recv_prev" else self.next
                return peer, f"waits on {stream} for {_p2p_text(head)}"
        return None, "is done"
