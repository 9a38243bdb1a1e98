"""Rank programs: what one rank executes in a training step, on named streams.

A program belongs to a pipeline stage and is shared by every rank of that stage (they
differ only in which tp, cp and dp groups they belong to, see the rank table). Like the
graph it is folded over microbatches, in the spirit of torch.distributed.pipelining's
per-rank action lists ("1F3"): a *block* is the instruction list of one model chunk's
forward (``F0``) or backward (``B0``) for one microbatch, and the *schedule* says which
block runs for which microbatch, in order. Pipeline receives live on their own streams
in the order the sending stage sends. The *prologue* runs once at the start of the step
(ZeRO parameter gathers), the *epilogue* once after the last block (optimizer steps).

Instructions (semantics of CUDA streams, docs/semantics.md, the rank program):

- ``compute NODE``: a compute node of the graph; ring attention runs its cp ring steps
  within (operands ``ring_steps`` over ``group``: each step's shift to the next cp rank
  posted before the partial attention on the block in hand);
- ``<collective> NODE``: all_reduce, all_gather, reduce_scatter, all_to_all, broadcast
  over the group the node names;
- ``send NODE`` / ``recv NODE``: pipeline point-to-point with the peer stage;
- ``record EVENT`` / ``wait EVENT``: an event recorded after the previous instruction of
  its stream; a wait blocks only its own stream, until that instruction has finished;
- ``sync``: the stream waits until every stream finished its earlier instructions.

Every instruction writes the buffers in ``writes`` (by default the one named after its
node) and reads those in ``reads``; ``frees`` lists buffers no later instruction reads,
which the runtime may release after it. In an expanded program a per-microbatch name
gets ``#k`` appended; names starting with ``@`` are the rank's state across microbatches
(``@grad:BUCKET``, a bucket's gradient buffer, which backward steps accumulate into) and
never do. An instruction with ``guard = "last"`` in a block runs only when
the block runs for the last microbatch (``"first"``: the first): once-per-step work (a
gradient bucket's reduction) issued as soon as its inputs are final, without unfolding
the program.

Every compute and transfer instruction carries its ``operands``
(:class:`planc.program.operands.Operands`): the buffers it reads and the ports they feed,
the gradient it takes, the local slice, its group or peer stage, shapes. The runtime
runs them as written; docs/programs.md lists them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Iterator

from planc.program.evaluation_blocks import evaluation_frees, evaluation_step
from planc.program.instruction_set import (  # noqa: F401 (the API of programs)
    COLLECTIVES,
    EVENT_NAMING_OPS,
    EVENT_OPS,
    GUARD_OF_TEXT,
    OPCODE_OF_TEXT,
    TRANSFER_OPS,
    Guard,
    Opcode,
    done_event,
    node_of_done,
    saved_for_weights,
)
from planc.program.names import STREAM_ORDER
from planc.program.operands import Operands
from planc.program.ranks import RANK_TABLE_VERSION, RankTable, integer_of  # noqa: F401 (API)
from planc.vocabulary.versions import is_version

# Version 3: instructions carry typed operands (version 2 left them to graph.json).
# Version 4: what a step keeps for a later one is a buffer of its own (NODE:saved).
PROGRAM_FORMAT_VERSION = 4
STATE = "@"  # state buffers (a bucket's gradient): one per step, never per microbatch


@dataclass(frozen=True)
class Instruction:
    op: Opcode
    stream: str
    node: str | None = None
    event: str | None = None
    reads: tuple[str, ...] = ()
    writes: tuple[str, ...] = ()
    per_microbatch: bool = True  # names get the microbatch appended when expanded
    guard: Guard | None = None  # LAST: only on the block's last microbatch
    frees: tuple[str, ...] = ()
    operands: Operands | None = None  # compute and transfer instructions

    def __post_init__(self):
        # Members compare by identity everywhere; an op or guard given as its text (a
        # test's hand-written instruction) becomes its member here, once.
        if self.op.__class__ is not Opcode:
            object.__setattr__(self, "op", Opcode(self.op))
        if self.guard is not None and self.guard.__class__ is not Guard:
            object.__setattr__(self, "guard", Guard(self.guard))

    def to_json(self) -> dict:
        """Compact: keys with default values are left out."""
        item: dict = {"op": self.op.value, "stream": self.stream}
        if self.node is not None:
            item["node"] = self.node
        if self.event is not None:
            item["event"] = self.event
        if self.reads:
            item["reads"] = list(self.reads)
        if self.writes != ((self.node,) if self.node is not None else ()):
            item["writes"] = list(self.writes)
        if not self.per_microbatch:
            item["per_microbatch"] = False
        if self.guard is not None:
            item["guard"] = self.guard.value
        if self.frees:
            item["frees"] = list(self.frees)
        if self.operands is not None:
            item["operands"] = self.operands.to_json()
        return item

    @staticmethod
    def from_json(item: dict) -> "Instruction":
        if not isinstance(item, dict):
            raise ValueError(f"malformed instruction {item!r}")
        if not _INSTRUCTION_KEYS.issuperset(item):
            raise ValueError(f"instruction with unknown keys "
                             f"{sorted(set(item) - _INSTRUCTION_KEYS)}")
        text, stream = item["op"], item["stream"]
        op = OPCODE_OF_TEXT.get(text) if isinstance(text, str) else None
        if op is None or not isinstance(stream, str):
            raise ValueError(f"instruction with an unknown op or stream: {item!r}")
        node, event = item.get("node"), item.get("event")
        names_event = op in EVENT_NAMING_OPS
        if names_event != (event is not None) or (op not in EVENT_OPS) != (node is not None):
            raise ValueError(f"instruction {op} must name "
                             f"{'an event' if names_event else 'a node'}")
        strings = lambda key: _strings(item.get(key, ()))  # noqa: E731
        writes = strings("writes") if "writes" in item else ((node,) if node else ())
        guard_text, guard = item.get("guard"), None
        if guard_text is not None:
            guard = GUARD_OF_TEXT.get(guard_text) if isinstance(guard_text, str) else None
            if guard is None:
                raise ValueError(f"instruction with guard {guard_text!r}; guards are 'first' "
                                 f"and 'last'")
        per_microbatch = item.get("per_microbatch", True)
        if not isinstance(per_microbatch, bool):
            raise ValueError("per_microbatch must be true or false")
        operands = None
        if op not in EVENT_OPS:
            if "operands" not in item:
                raise ValueError(f"instruction {op} {node} has no operands")
            operands = Operands.from_json(item["operands"])
        elif "operands" in item:
            raise ValueError(f"instruction {op} has operands")
        return Instruction(op, stream, None if node is None else _string(node),
                           None if event is None else _string(event), strings("reads"),
                           writes, per_microbatch, guard, strings("frees"), operands)


def _pairs(items, what: str) -> tuple[tuple[str, int], ...]:
    """(block or node, microbatch) pairs from their JSON (a schedule at the limits holds
    a quarter of a million: the checks are called only for what is not a str and an
    int)."""
    out = []
    for name, m in items:
        if name.__class__ is not str or m.__class__ is not int:
            name, m = _string(name), integer_of(m, what)
        out.append((name, m))
    return tuple(out)


def _order(items) -> tuple[tuple[int, int], ...]:
    """A pair's order from its JSON: [which block, position in it] for each instruction."""
    if not isinstance(items, list) or any(not isinstance(e, list) or len(e) != 2
                                          for e in items):
        raise ValueError("a pair's order must list [block, position] pairs")
    return tuple((integer_of(side, "a pair's block"), integer_of(at, "a position"))
                 for side, at in items)


def _receives(data: dict) -> dict[str, tuple[tuple[str, int], ...]]:
    """Receive stream -> its (recv node, microbatch) pairs, from their JSON."""
    return {_string(stream): _pairs(items, "a microbatch of its receives")
            for stream, items in data.items()}


def _evaluation_of(data) -> dict:
    """Program's evaluation fields from their JSON (absent: no evaluation)."""
    if data is None:
        return {}
    return {"evaluation": _pairs(data["schedule"], "a microbatch of the evaluation"),
            "evaluation_receives": _receives(data["receives"])}


def paired_positions(paired, paired_weights) -> set[int]:
    """The schedule's positions an overlapped pair runs: each pair's two blocks, and the
    weight-gradient block of those that take it (``paired_weights``)."""
    return {k + j for k in paired for j in range(3 if k in paired_weights else 2)}


def guard_microbatch(guard: Guard | None, microbatches: int) -> int | None:
    """The only microbatch a guarded instruction runs on (None: every microbatch)."""
    return None if guard is None else (0 if guard is Guard.FIRST else microbatches - 1)


def _string(value) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {value!r}")
    return value


def _strings(values) -> tuple[str, ...]:
    """A list of strings, as a tuple (the common case, every item a str, checked without
    a call per item: a program at the limits lists a million buffer names)."""
    out = tuple(values)
    if all(v.__class__ is str for v in out):
        return out
    return tuple(map(_string, out))


# The keys an instruction's JSON may hold.
_INSTRUCTION_KEYS = frozenset({"op", "stream", "node", "event", "reads", "writes",
                               "per_microbatch", "guard", "frees", "operands"})


@dataclass(frozen=True)
class Program:
    stage: int
    streams: tuple[str, ...]
    blocks: dict[str, tuple[Instruction, ...]]
    schedule: tuple[tuple[str, int], ...]  # (block, microbatch)
    receives: dict[str, tuple[tuple[str, int], ...]]  # stream -> (recv node, microbatch)
    epilogue: tuple[Instruction, ...]
    microbatches: int
    prologue: tuple[Instruction, ...] = ()
    buckets: dict[str, dict] = field(default_factory=dict)  # the stage's parameter buckets
    info: dict = field(default_factory=dict, compare=False)
    received: dict[str, Operands] = field(default_factory=dict)  # a receive's operands
    # The evaluation's forward-only schedule and its receives, when train.eval_every
    # asks for one (planc.lower.evaluation): empty otherwise.
    evaluation: tuple[tuple[str, int], ...] = ()
    evaluation_receives: dict[str, tuple[tuple[str, int], ...]] = field(default_factory=dict)
    # schedule { overlap_all_to_all } under a schedule with overlapped pairs: the
    # positions k of the schedule whose block runs interleaved with block k + 1
    # (planc.program.pairs)
    paired: tuple[int, ...] = ()
    # of those, the positions whose pair also runs block k + 2 inside it: the
    # weight-gradient block of block k + 1's microbatch (DualPipe's W within its pair)
    paired_weights: tuple[int, ...] = ()
    # positions k, in no pair, of an input-gradient block that runs interleaved with the
    # weight-gradient block of its chunk at k + 1 (planc.program.pairs.interleave with
    # no first)
    weighted: tuple[int, ...] = ()
    # pair's block names -> the order its instructions run in, (0, 1 or 2: which block,
    # position in it), where the compiler's cost model chose one over the default merge
    # (planc.program.pair_orders)
    pair_orders: dict[str, tuple[tuple[int, int], ...]] = field(default_factory=dict)

    def together(self, k: int) -> int:
        """How many blocks of the schedule run together from position ``k``: 1 alone, 2
        an overlapped pair or an input gradient with its weight gradients, 3 a pair with
        its weight gradients; 0 where position ``k`` runs inside the pair before it."""
        if k - 1 in self.paired or k - 2 in self.paired_weights or k - 1 in self.weighted:
            return 0
        if k in self.paired:
            return 3 if k in self.paired_weights else 2
        return 2 if k in self.weighted else 1

    def is_weighted(self, entries) -> bool:
        """Whether ``entries`` ((block, microbatch) of each) are an input gradient and its
        weight gradients run together (``weighted``), not an overlapped pair."""
        return len(entries) == 2 and any(
            self.schedule[k] == entries[0] and self.schedule[k + 1] == entries[1]
            for k in self.weighted)

    def for_evaluation(self) -> "Program":
        """The program of an evaluation batch: the forward blocks on the forward-only
        schedule the compiler wrote, the prologue (ZeRO's gathers), of the epilogue only
        the loss's reduction (there without overlap, after the streams' sync) and what it
        waits for, never the optimizer, and the receives of activations only."""
        used = {block for block, _ in self.evaluation}
        received = {node for items in self.evaluation_receives.values() for node, _ in items}
        loss = [i for i in self.epilogue if i.operands is not None and
                i.operands.payload == "loss"]
        waited = {(i.stream, done_event(source)) for i in loss for source in i.reads}
        epilogue = tuple(i for i in self.epilogue if i in loss or i.op is Opcode.SYNC and loss
                         or i.op is Opcode.WAIT and (i.stream, i.event) in waited)
        blocks = {name: tuple(evaluation_step(i) for i in block)
                  for name, block in self.blocks.items() if name in used}
        return Program(self.stage, self.streams, evaluation_frees(blocks, self.blocks),
                       self.evaluation, dict(self.evaluation_receives), epilogue,
                       self.microbatches, self.prologue, self.buckets,
                       received={n: o for n, o in self.received.items() if n in received})

    def receive(self, stream: str, node: str) -> Instruction:
        """The instruction of a pipeline receive (issued on its stream:
        planc.program.expansion)."""
        return Instruction(Opcode.RECV, stream, node, writes=(node,),
                           operands=self.received[node])

    def to_json(self) -> dict:
        return {"format": "planc-program", "version": PROGRAM_FORMAT_VERSION,
                "stage": self.stage, "microbatches": self.microbatches,
                "streams": list(self.streams),
                "buckets": self.buckets,
                "prologue": [i.to_json() for i in self.prologue],
                "blocks": {name: [i.to_json() for i in block] for name, block in
                           self.blocks.items()},
                "schedule": [list(s) for s in self.schedule],
                **({"paired": list(self.paired)} if self.paired else {}),
                **({"paired_weights": list(self.paired_weights)}
                   if self.paired_weights else {}),
                **({"weighted": list(self.weighted)} if self.weighted else {}),
                **({"pair_orders": {key: [list(entry) for entry in order] for key, order
                                    in self.pair_orders.items()}} if self.pair_orders else {}),
                "receives": {stream: [list(r) for r in items]
                             for stream, items in self.receives.items()},
                "epilogue": [i.to_json() for i in self.epilogue],
                "received": {node: operands.to_json()
                             for node, operands in self.received.items()},
                **({"evaluation": {
                    "schedule": [list(s) for s in self.evaluation],
                    "receives": {stream: [list(r) for r in items]
                                 for stream, items in self.evaluation_receives.items()}}}
                   if self.evaluation else {})}

    @staticmethod
    def from_json(data: dict) -> "Program":
        if data.get("format") != "planc-program":
            raise ValueError("not a planc program")
        if not is_version(data.get("version"), PROGRAM_FORMAT_VERSION):
            raise ValueError(f"program format version {data.get('version')!r}; this planc "
                             f"reads version {PROGRAM_FORMAT_VERSION}, whose steps write "
                             f"what they keep for their backward apart from their values")
        microbatches = data["microbatches"]
        if not isinstance(microbatches, int) or isinstance(microbatches, bool) or \
                microbatches < 1:
            raise ValueError("microbatches must be a positive integer")
        program = Program(
            stage=integer_of(data["stage"], "its stage"),
            streams=tuple(map(_string, data["streams"])),
            blocks={_string(name): tuple(Instruction.from_json(i) for i in block)
                    for name, block in data["blocks"].items()},
            schedule=_pairs(data["schedule"], "a microbatch of the schedule"),
            receives=_receives(data["receives"]),
            epilogue=tuple(Instruction.from_json(i) for i in data["epilogue"]),
            microbatches=microbatches,
            prologue=tuple(Instruction.from_json(i) for i in data.get("prologue", ())),
            buckets=dict(data.get("buckets", {})),
            received={_string(node): Operands.from_json(operands)
                      for node, operands in data["received"].items()},
            paired=tuple(integer_of(k, "a paired position") for k in data.get("paired", ())),
            paired_weights=tuple(integer_of(k, "a paired position") for k in
                                 data.get("paired_weights", ())),
            weighted=tuple(integer_of(k, "a weighted position") for k in
                           data.get("weighted", ())),
            pair_orders={_string(key): _order(order)
                         for key, order in dict(data.get("pair_orders", {})).items()},
            **_evaluation_of(data.get("evaluation")))
        if any(s not in STREAM_ORDER for s in program.streams):
            raise ValueError(f"streams {list(program.streams)}: one is not a stream planc "
                             f"knows")
        received = {node for items in program.receives.values() for node, _ in items}
        if received != set(program.received):
            raise ValueError("its receives and the operands of its receives name different "
                             "nodes")
        for name, block in program.blocks.items():
            for instruction in block:
                if instruction.stream not in program.streams:
                    raise ValueError(f"block {name} uses stream {instruction.stream!r}, "
                                     f"which the program does not declare")
        for part in (program.prologue, program.epilogue):
            for instruction in part:
                if instruction.guard is not None:
                    raise ValueError("only instructions of a block can have a guard")
                if instruction.stream not in program.streams:
                    raise ValueError(f"stream {instruction.stream!r} is not declared")
        paired = program.paired
        if any(not 0 <= k < len(program.schedule) - 1 for k in paired) or \
                list(paired) != sorted(set(paired)) or \
                any(k + 1 in paired for k in paired):
            raise ValueError("paired names positions that are not disjoint pairs of the "
                             "schedule")
        weights = program.paired_weights
        if not set(weights) <= set(paired) or list(weights) != sorted(set(weights)) or \
                any(k + 2 >= len(program.schedule) or k + 2 in paired for k in weights):
            raise ValueError("paired_weights names positions that are not pairs followed by "
                             "a block of their own")
        taken = paired_positions(paired, weights)
        if list(program.weighted) != sorted(set(program.weighted)) or any(
                not 0 <= k < len(program.schedule) - 1 or {k, k + 1} & taken or
                k + 1 in program.weighted for k in program.weighted):
            raise ValueError("weighted names positions that are not blocks of the schedule "
                             "outside its pairs, followed by one of their own")
        for key, order in program.pair_orders.items():
            names = key.split(" ")
            if len(names) not in (2, 3) or any(name not in program.blocks for name in names) \
                    or any(not 0 <= side < len(names) or
                           not 0 <= at < len(program.blocks[names[side]])
                           for side, at in order):
                raise ValueError(f"pair_orders: {key!r} names no blocks of the program, or "
                                 f"its order names instructions they do not have")
        if any(not 0 <= mb < microbatches for _, mb in program.schedule + program.evaluation):
            raise ValueError("the schedule names a microbatch outside the step")
        if any(block not in program.blocks or not block.startswith("F")
               for block, _ in program.evaluation):
            raise ValueError("the evaluation's schedule names a block that is no forward "
                             "block of the program")
        if not {n for items in program.evaluation_receives.values() for n, _ in items} <= \
                set(program.received):
            raise ValueError("the evaluation receives a node the program never receives")
        return program

    def written(self) -> Iterator[Instruction]:
        """Every instruction as the program writes it, once (blocks folded over
        microbatches): the prologue, each block, the epilogue."""
        for part in (self.prologue, *self.blocks.values(), self.epilogue):
            yield from part

    def last_microbatch(self) -> int:
        return self.microbatches - 1

    def runs(self, instruction: Instruction, microbatch: int | None) -> bool:
        """Whether ``instruction`` runs in a block instance of ``microbatch``."""
        return guard_microbatch(instruction.guard, self.microbatches) in (None, microbatch)

    def running(self, block: str, microbatch: int) -> tuple[Instruction, ...]:
        """The instructions of ``block`` that run for ``microbatch`` (guards applied)."""
        return tuple(i for i in self.blocks[block] if self.runs(i, microbatch))


def dumps(data: dict) -> str:
    return json.dumps(data, separators=(",", ":")) + "\n"
