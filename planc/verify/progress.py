"""The verifier's proof that a step reaches its end when collectives span stages.

:mod:`planc.verify.pipeline` simulates the stages block by block, with receives
as the only thing a block waits for. That is exact while every collective lies inside
one stage: all members of such a group run the same program, so they reach each
collective together. A collective whose group spans stages (the tied embedding's
gradient all-reduce between the first and the last stage, Megatron-LM's embedding
group; anything over ``pp``) couples the stages through the streams: it holds its
stream, and everything queued behind it, until every member stage issues it. Issued
inside the last stage's backward it once held the dp stream, and the ZeRO-3 gathers
behind it, until the first stage's last backward, which those gathers fed (a deadlock
found by running pp 2 x dp 2 with tied embeddings under ZeRO 3).

So here the whole step is executed as the runtime executes it, one actor per stage
(standing for its ranks, which are symmetric): each program stream is a FIFO queue,
in the program's issue order (:func:`planc.program.expansion.expand`), and its head completes when

- compute, a record, or a collective inside the stage: at once;
- a wait: once its event was recorded on the stage;
- a sync: once every other stream finished what was issued before it;
- a send: together with its receive, at the head of the peer's receive stream
  (rendezvous, as NCCL's point-to-point);
- a collective over stages: together with the same collective, microbatch for
  microbatch, at the head of a stream of every member stage.

The step ends exactly when every queue drains; otherwise the heads that wait are the
deadlock, reported with what each waits for. Linear in the expanded programs times the
number of sweeps, so it runs only where some collective spans stages, and on what can
hold a stream only (:meth:`ProgressChecks._can_hold`).
"""

from __future__ import annotations

from collections import deque

from planc.graph.ir import Axis
from planc.program.expansion import Expanded, expand
from planc.program.program import COLLECTIVES, Opcode


MAX_SHOWN = 5  # heads named in the report


class ProgressChecks:
    """Mixed into the verifier: needs ``self.plan``, ``self.graph``, ``self.programs``,
    ``self.table``, ``self.layout``, ``self.report``, ``uniform`` and ``_receive_of``;
    :meth:`progress` keeps, for its one proof, each axis's stages and each node's axis."""

    def _stages_of(self, axis: str) -> tuple[int, ...]:
        if axis not in self._stages_by_axis:
            self._stages_by_axis[axis] = self._stages_of_group(axis)
        return self._stages_by_axis[axis]

    def _stages_of_group(self, axis: str) -> tuple[int, ...]:
        if axis == Axis.TIED.value:
            return tuple(sorted({0, self.plan.head_stage}))
        rank = self.layout.first_rank_of_stage(0)
        return tuple(sorted({self.table.stage_of(r) for r in self.layout.group(rank, axis)}))

    def _spans_stages(self, node: str | None) -> str | None:
        """The axis of a collective whose group spans stages, else None; once per node,
        as the proof asks at every head."""
        if node not in self._axis_of_node:
            data = self.graph.nodes[node] if node in self.graph else {}
            axis = data.get("axis")
            spans = axis is not None and not Axis(axis).within_stage
            self._axis_of_node[node] = str(axis) if spans else None
        return self._axis_of_node[node]

    def _can_hold(self, instruction) -> bool:
        """Whether an instruction can hold its stream: not a compute or a collective
        inside the stage, which complete at once and change nothing else. Left out of the
        queues, they change neither what completes nor the heads of a deadlock: a sync
        behind one waits for nothing it would not wait for otherwise."""
        op = instruction.op
        if op is Opcode.COMPUTE:
            return False
        return op not in COLLECTIVES or self._spans_stages(instruction.node) is not None

    def progress(self) -> None:
        if self.plan.mesh.pp == 1 or not self.uniform:
            return  # one stage, or programs per rank: verify_pipeline's proof stands
        self._stages_by_axis: dict[str, tuple[int, ...]] = {}
        self._axis_of_node: dict[str | None, str | None] = {}
        self._collective_names: dict[str | None, str | None] = {}
        stage_program = {stage: name for name, stage in self.table.stages.items()}
        spanning = any(i.op in COLLECTIVES and self._spans_stages(i.node)
                       for program in self.programs.values() for i in program.written())
        # blocks run interleaved (overlapped pairs, an input gradient with its weight
        # gradients): the block-by-block simulation runs each whole, which a merged
        # order is not, so a pair whose backward waits, through another stage, for its
        # own forward's send is found only stream by stream
        merged = any(p.paired or p.weighted for p in self.programs.values())
        if not spanning and not merged:
            return
        stages = {s: _Stage(s, expand(self.programs[stage_program[s]], operands=False,
                                    keep=self._can_hold))
                  for s in sorted(stage_program)}
        # each receive by (node, microbatch): one per step, so a send finds its receive
        # by looking at the head of one stream
        receiver = {(i.node, i.microbatch): (stage, stream, i) for stage in stages.values()
                    for stream, queue in stage.queues.items() for i in queue
                    if i.op is Opcode.RECV}
        # each collective over stages by (stage, key): where a member's instance waits
        holders: dict[tuple[int, tuple], list[tuple[str, Expanded]]] = {}
        for stage in stages.values():
            for stream, queue in stage.queues.items():
                for i in queue:
                    if i.op in COLLECTIVES and self._spans_stages(i.node):
                        holders.setdefault((stage.number, self._collective_key(i)),
                                           []).append((stream, i))
        moved = True
        while moved:
            moved = False
            for stage in stages.values():
                for stream in list(stage.queues):
                    while stage.queues[stream] and self._advance(stage, stream, stages,
                                                                 receiver, holders):
                        moved = True
        # the transfers that wait first (the cause), then the waits behind them
        stuck = sorted(((s, queue[0]) for s, stage in stages.items()
                        for queue in stage.queues.values() if queue),
                       key=lambda item: (item[1].op in (Opcode.WAIT, Opcode.SYNC), item[0],
                                         item[1].index))
        if stuck:
            detail = "; ".join(f"stage {s} {head.text()} ({head.where}) waits for "
                               f"{self._awaited(stages[s], head)}"
                               for s, head in stuck[:MAX_SHOWN])
            self.report.add(f"the programs deadlock (run stream by stream, the step cannot "
                            f"finish): {detail}")

    def _advance(self, stage: "_Stage", stream: str, stages: dict, receiver: dict,
                 holders: dict) -> bool:
        """Complete the head of ``stage``'s ``stream`` if it can; whether it did."""
        head = stage.queues[stream][0]
        if head.op is Opcode.WAIT:
            if head.event not in stage.recorded:
                return False
        elif head.op is Opcode.SYNC:
            if any(q and q[0].index < head.index for name, q in stage.queues.items()
                   if name != stream):
                return False
        elif head.op is Opcode.SEND:
            found = receiver.get((self._receive_of(head.node), head.microbatch))
            if found is None:
                return False
            peer, peer_stream, match = found
            queue = peer.queues[peer_stream]
            if not queue or queue[0] is not match:
                return False
            peer.pop(peer_stream)
        elif head.op is Opcode.RECV:
            return False  # completes with its send
        elif head.op in COLLECTIVES and (axis := self._spans_stages(head.node)):
            key = self._collective_key(head)
            found = []  # (member stage, the stream where it holds the collective)
            for number in self._stages_of(axis):
                if number != stage.number:
                    match = stages[number].holding(holders.get((number, key), ()))
                    if match is None:
                        return False
                    found.append((stages[number], match))
            for member, match in found:
                member.pop(match)
        stage.pop(stream)
        return True

    def _collective_key(self, item: Expanded) -> tuple:
        name = self._collective_names.get(item.node)
        if name is None:  # once per node: the proof asks at every head
            name = self._collective_names[item.node] = \
                self.graph.nodes[item.node].get("collective", item.node) \
                if item.node in self.graph else item.node
        return item.op, name, item.microbatch

    def _awaited(self, stage: "_Stage", head: Expanded) -> str:
        if head.op is Opcode.WAIT:
            return f"event {head.event}"
        if head.op is Opcode.SYNC:
            return "the stage's other streams"
        if head.op is Opcode.SEND:
            return "the peer stage to receive it"
        if head.op is Opcode.RECV:
            return "the peer stage to send it"
        axis = self._spans_stages(head.node)
        others = [s for s in self._stages_of(axis) if s != stage.number]
        return f"stage{'s' * (len(others) > 1)} {', '.join(map(str, others))} to join " \
               f"this {axis} {head.op}"


class _Stage:
    """One stage's streams as FIFO queues of its expanded program."""

    def __init__(self, number: int, expanded) -> None:
        self.number = number
        self.queues: dict[str, deque[Expanded]] = {}
        for item in expanded:
            self.queues.setdefault(item.stream, deque()).append(item)
        self.recorded: set[str] = set()

    def holding(self, places: list[tuple[str, Expanded]]) -> str | None:
        """The stream whose head is one of ``places``' instructions (stream, instruction),
        if any."""
        return next((stream for stream, item in places
                     if (queue := self.queues[stream]) and queue[0] is item), None)

    def pop(self, stream: str) -> None:
        item = self.queues[stream].popleft()
        if item.op is Opcode.RECORD:
            self.recorded.add(item.event)
