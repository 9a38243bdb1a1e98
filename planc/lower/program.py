"""Rank programs: what one rank executes in a training step, on named streams.

A program belongs to a pipeline stage and is shared by every rank of that stage (they
differ only in which tp, cp and dp groups they belong to, see the rank table). Like the
graph it is folded over microbatches, in the spirit of torch.distributed.pipelining's
per-rank action lists ("1F3"): a *block* is the instruction list of one model chunk's
forward (``F0``) or backward (``B0``) for one microbatch, and the *schedule* says which
block runs for which microbatch, in order. Pipeline receives live on their own streams
in the order the sending stage sends; the *epilogue* runs once per step after the last
block (gradient reductions, optimizer, ZeRO gathers).

Instructions (semantics of CUDA streams, semantics.md section 5):

- ``compute NODE``: a compute node of the graph;
- ``<collective> NODE``: all_reduce, all_gather, reduce_scatter, all_to_all, broadcast
  over the group named by the node's axis;
- ``send NODE`` / ``recv NODE``: pipeline point-to-point with the peer stage;
  ``sendrecv NODE`` (the send half and the receive half of a cp ring shift together);
- ``record EVENT`` / ``wait EVENT``: an event recorded after the previous instruction of
  its stream; a wait blocks only its own stream, until that instruction has finished.

Every instruction writes the buffer named after its node and reads the buffers of the
node's inputs. In an expanded program a per-microbatch name gets ``#k`` appended.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Iterator

PROGRAM_FORMAT_VERSION = 1
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")


@dataclass(frozen=True)
class Instruction:
    op: str  # compute, a collective, send, recv, sendrecv, record, wait
    stream: str
    node: str | None = None
    event: str | None = None
    reads: tuple[str, ...] = ()
    writes: tuple[str, ...] = ()
    per_microbatch: bool = True  # names get the microbatch appended when expanded

    def to_json(self) -> list:
        """Compact: [op, stream, event, per_microbatch] for record and wait, [op, stream]
        for sync, [op, stream, node, reads, per_microbatch(, writes)] otherwise; writes
        are given only when they are not the node's own buffer."""
        if self.op in ("record", "wait"):
            return [self.op, self.stream, self.event, int(self.per_microbatch)]
        if self.op == "sync":
            return [self.op, self.stream]
        item = [self.op, self.stream, self.node, list(self.reads), int(self.per_microbatch)]
        if self.writes != (self.node,):
            item.append(list(self.writes))
        return item

    @staticmethod
    def from_json(item: list) -> "Instruction":
        if not isinstance(item, list) or len(item) < 2:
            raise ValueError(f"malformed instruction {item!r}")
        op, stream = str(item[0]), str(item[1])
        if op in ("record", "wait"):
            return Instruction(op, stream, event=str(item[2]), per_microbatch=bool(item[3]))
        if op == "sync":
            return Instruction(op, stream, per_microbatch=False)
        node, reads, per_microbatch = str(item[2]), item[3], bool(item[4])
        writes = tuple(map(str, item[5])) if len(item) > 5 else (node,)
        return Instruction(op, stream, node, reads=tuple(map(str, reads)), writes=writes,
                           per_microbatch=per_microbatch)


@dataclass(frozen=True)
class Expanded:
    """One instruction of an expanded program, microbatch resolved."""

    index: int  # position in the rank's issue order
    op: str
    stream: str
    node: str | None
    microbatch: int | None
    event: str | None
    reads: tuple[str, ...]
    writes: tuple[str, ...]
    where: str  # "F0 mb 2", "recv_prev", "epilogue"

    def text(self) -> str:
        mb = f" mb {self.microbatch}" if self.microbatch is not None else ""
        what = self.event if self.op in ("record", "wait") else self.node
        return f"#{self.index} {self.stream}: {self.op} {what}{mb}"


@dataclass(frozen=True)
class Program:
    stage: int
    streams: tuple[str, ...]
    blocks: dict[str, tuple[Instruction, ...]]
    schedule: tuple[tuple[str, int], ...]  # (block, microbatch)
    receives: dict[str, tuple[tuple[str, int], ...]]  # stream -> (recv node, microbatch)
    epilogue: tuple[Instruction, ...]
    microbatches: int
    info: dict = field(default_factory=dict, compare=False)

    def to_json(self) -> dict:
        return {"format": "planc-program", "version": PROGRAM_FORMAT_VERSION,
                "stage": self.stage, "microbatches": self.microbatches,
                "streams": list(self.streams),
                "blocks": {name: [i.to_json() for i in block] for name, block in
                           self.blocks.items()},
                "schedule": [list(s) for s in self.schedule],
                "receives": {stream: [list(r) for r in items]
                             for stream, items in self.receives.items()},
                "epilogue": [i.to_json() for i in self.epilogue]}

    @staticmethod
    def from_json(data: dict) -> "Program":
        if data.get("format") != "planc-program" or data.get("version") != \
                PROGRAM_FORMAT_VERSION:
            raise ValueError("not a version 1 planc program")
        return Program(
            stage=int(data["stage"]), streams=tuple(data["streams"]),
            blocks={name: tuple(Instruction.from_json(i) for i in block)
                    for name, block in data["blocks"].items()},
            schedule=tuple((str(b), int(m)) for b, m in data["schedule"]),
            receives={stream: tuple((str(n), int(m)) for n, m in items)
                      for stream, items in data["receives"].items()},
            epilogue=tuple(Instruction.from_json(i) for i in data["epilogue"]),
            microbatches=int(data["microbatches"]))

    def expand(self) -> Iterator[Expanded]:
        """Every instruction of one step, in issue order.

        Issue order: for each scheduled block, first the receives it waits for (and any
        queued before them on the same receive stream; each receive records the event
        ``done:NODE``), then the block's instructions; after the schedule, any receive
        left, then the epilogue.
        """
        counter = iter(range(1 << 62))
        position = {stream: 0 for stream in self.receives}
        needed = self.receives_needed()

        def emit(instruction: Instruction, microbatch: int | None, where: str) -> Expanded:
            mb = microbatch if instruction.per_microbatch else None
            suffix = f"#{mb}" if mb is not None else ""
            return Expanded(next(counter), instruction.op, instruction.stream,
                            instruction.node, mb,
                            f"{instruction.event}{suffix}" if instruction.event else None,
                            tuple(f"{r}{suffix}" for r in instruction.reads),
                            tuple(f"{w}{suffix}" for w in instruction.writes), where)

        def receive(stream: str) -> Iterator[Expanded]:
            node, mb = self.receives[stream][position[stream]]
            position[stream] += 1
            yield emit(Instruction("recv", stream, node, writes=(node,)), mb, stream)
            yield emit(Instruction("record", stream, event=f"done:{node}"), mb, stream)

        for block, microbatch in self.schedule:
            for stream, last in needed.get((block, microbatch), {}).items():
                while position[stream] <= last:
                    yield from receive(stream)
            for instruction in self.blocks[block]:
                yield emit(instruction, microbatch, f"{block} mb {microbatch}")
        for stream in self.receives:
            while position[stream] < len(self.receives[stream]):
                yield from receive(stream)
        for instruction in self.epilogue:
            yield emit(instruction, None, "epilogue")

    def receives_needed(self) -> dict[tuple[str, int], dict[str, int]]:
        """For each scheduled (block, microbatch): per receive stream, the position of the
        last receive whose event the block waits for."""
        where = {(node, mb): (stream, i) for stream, items in self.receives.items()
                 for i, (node, mb) in enumerate(items)}
        waits = {name: [i.event[len("done:"):] for i in block
                        if i.op == "wait" and i.event.startswith("done:")]
                 for name, block in self.blocks.items()}
        out: dict[tuple[str, int], dict[str, int]] = {}
        for block, microbatch in self.schedule:
            need: dict[str, int] = {}
            for node in waits[block]:
                if (node, microbatch) in where:
                    stream, i = where[(node, microbatch)]
                    need[stream] = max(need.get(stream, -1), i)
            out[(block, microbatch)] = need
        return out


@dataclass(frozen=True)
class RankTable:
    """Which program each rank runs. By rule, every rank of a pipeline stage runs that
    stage's program (so the table does not grow with the world); ``overrides`` lists ranks
    that run another program (a program edited by hand, for instance)."""

    world: int
    pp: int
    stride: int  # how far apart ranks of neighbouring stages are (mesh order)
    stages: dict[str, int]  # program file -> the stage whose ranks run it
    overrides: dict[int, str] = field(default_factory=dict)

    @property
    def names(self) -> list[str]:
        return list(self.stages) + sorted(set(self.overrides.values()) - set(self.stages))

    def stage_of(self, rank: int) -> int:
        return rank // self.stride % self.pp

    def program_of(self, rank: int) -> str:
        if rank in self.overrides:
            return self.overrides[rank]
        stage = self.stage_of(rank)
        return next(name for name, s in self.stages.items() if s == stage)

    def ranks(self, name: str) -> Iterator[int]:
        """Every rank that runs ``name`` (walks the world: for reports and listings)."""
        stage = self.stages.get(name)
        for rank in range(self.world):
            if rank in self.overrides:
                if self.overrides[rank] == name:
                    yield rank
            elif rank // self.stride % self.pp == stage:
                yield rank

    def to_json(self) -> dict:
        return {"format": "planc-ranks", "version": PROGRAM_FORMAT_VERSION,
                "world": self.world, "pp": self.pp, "pp_stride": self.stride,
                "stages": dict(self.stages),
                "overrides": {str(r): name for r, name in sorted(self.overrides.items())}}

    @staticmethod
    def from_json(data: dict) -> "RankTable":
        if data.get("format") != "planc-ranks" or data.get("version") != \
                PROGRAM_FORMAT_VERSION:
            raise ValueError("not a version 1 planc rank table")
        table = RankTable(int(data["world"]), int(data["pp"]), int(data["pp_stride"]),
                          {str(k): int(v) for k, v in data["stages"].items()},
                          {int(k): str(v) for k, v in data.get("overrides", {}).items()})
        if table.world < 1 or table.pp < 1 or table.stride < 1 or \
                sorted(table.stages.values()) != list(range(table.pp)) or \
                any(not 0 <= r < table.world for r in table.overrides):
            raise ValueError("its world, pp, pp_stride, stages or overrides are inconsistent")
        return table


def dumps(data: dict) -> str:
    return json.dumps(data, separators=(",", ":")) + "\n"
