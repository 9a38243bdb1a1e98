"""Prove that a program runs its stage's step whole: every node of the graph once, every
block once per microbatch.

The other rules check what the instructions that are there do; these check that nothing
is missing or doubled, which no ordering or buffer rule can see: a program without a
bucket's optimizer step runs, trains, and leaves those parameters at their initial
values; one whose schedule runs a block twice for a microbatch adds that microbatch's
gradient twice. For the program of stage ``s`` (docs/semantics.md, the rank program):

1. every node of the graph on stage ``s`` is issued by exactly one instruction, and no
   instruction names a node of another stage or none of the graph's;
2. a per-microbatch node runs in a block of its own model chunk and phase (the forward
   block for the forward, a backward block for the backward), unguarded, so once per
   microbatch; a once-per-step node in the prologue, the epilogue, or a block guarded to
   one microbatch's instance;
3. a pipeline receive is taken once per microbatch, on one receive stream, and only the
   stage's receives are;
4. the schedule runs every block exactly once for every microbatch, and nothing else.
"""

from __future__ import annotations

from collections import Counter

from planc.graph.ir import NodeType, Phase, is_pipeline_receive
from planc.program.program import EVENT_OPS, Opcode, Program
from planc.schedules.actions import ActionKind, Block
from planc.verify.report import part_text

_FORWARD_KINDS = (ActionKind.FORWARD,)
_BACKWARD_KINDS = (ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT,
                   ActionKind.BACKWARD_WEIGHT)


class CoverageChecks:
    """Mixed into the verifier, which provides ``graph``, ``report``, ``ranks_text`` and
    ``_by_stage`` (None until the graph's nodes are grouped by stage)."""

    def coverage(self, name: str, program: Program) -> None:
        where = f"{self.ranks_text(name)} ({name})"
        stage = program.stage
        issued: Counter = Counter()
        for part, instructions in (("prologue", program.prologue), *program.blocks.items(),
                                   ("epilogue", program.epilogue)):
            for instruction in instructions:
                if instruction.op in EVENT_OPS:
                    continue
                node = instruction.node
                issued[node] += 1
                problem = self._placement_problem(node, part, instruction.guard, stage) or \
                    self._kind_problem(instruction)
                if problem is not None:
                    self.report.add(f"{where}: {instruction.op} {node} in "
                                    f"{part_text(part)} {problem}")
        mine = self._nodes_of_stage().get(stage, [])
        for node in mine:
            if is_pipeline_receive(self.graph.nodes[node]):
                continue
            count = issued.get(node, 0)
            if count != 1:
                self.report.add(f"{where}: {node} is {_issued(count)}; every node of "
                                f"stage {stage} runs exactly once per step (per microbatch "
                                f"in its block)")
        self._receives(where, program, [n for n in mine
                                        if is_pipeline_receive(self.graph.nodes[n])])
        self._schedule(where, program)

    def _nodes_of_stage(self) -> dict[int, list[str]]:
        """The graph's nodes by stage, grouped once for every program."""
        if self._by_stage is None:
            self._by_stage = {}
            for node, data in self.graph.nodes(data=True):
                self._by_stage.setdefault(data.get("stage"), []).append(node)
        return self._by_stage

    def _placement_problem(self, node: str | None, part: str, guard, stage: int
                           ) -> str | None:
        """Why ``node`` may not run in ``part`` (rule 1 and 2), or None."""
        if node not in self.graph:
            return "names no node of graph.json"
        data = self.graph.nodes[node]
        if data.get("stage") != stage:
            return f"is a node of stage {data.get('stage')}"
        if is_pipeline_receive(data):
            return "is a pipeline receive, which runs on its receive stream"
        if part in ("prologue", "epilogue"):
            return "runs once per microbatch, not once per step" \
                if data["per_microbatch"] else None
        block = Block.parse(part)
        kinds = _FORWARD_KINDS if data["phase"] == Phase.FORWARD else _BACKWARD_KINDS
        if block.chunk != data["chunk"] or block.kind not in kinds:
            return (f"belongs to model chunk {data['chunk']}'s "
                    f"{'forward' if data['phase'] == Phase.FORWARD else 'backward'}")
        if data["per_microbatch"] and guard is not None:
            return f"runs once per microbatch but is guarded to the {guard} one"
        if not data["per_microbatch"] and guard is None:
            return "runs once per step but is not guarded to one microbatch"
        return None

    def _kind_problem(self, instruction) -> str | None:
        """Rule 2's other half: the instruction is the kind of work its node is, and runs
        per microbatch exactly when its node does (the runtime read both from the
        program: a compute step written as an all_reduce stopped a rank with a KeyError)."""
        data = self.graph.nodes[instruction.node]
        op = Opcode.COMPUTE if data["type"] == NodeType.COMPUTE else Opcode(data["kind"].value)
        if instruction.op is not op:
            return f"is a {op.value} node of the graph"
        if instruction.per_microbatch != data["per_microbatch"]:
            return ("runs once per microbatch" if data["per_microbatch"] else
                    "runs once per step") + f", not as per_microbatch = " \
                f"{str(instruction.per_microbatch).lower()} says"
        return None

    def _receives(self, where: str, program: Program, receives: list[str]) -> None:
        """Rule 3: each receive of the stage once per microbatch, on one stream."""
        taken: dict[str, Counter] = {}
        streams: dict[str, set[str]] = {}
        for stream, items in program.receives.items():
            for node, microbatch in items:
                taken.setdefault(node, Counter())[microbatch] += 1
                streams.setdefault(node, set()).add(stream)
        every = Counter(range(program.microbatches))
        for node in receives:
            if taken.get(node) != every:
                self.report.add(f"{where}: {node} is received for microbatches "
                                f"{_microbatches(taken.get(node, Counter()))}; a receive "
                                f"is taken once for each of the {program.microbatches}")
            elif len(streams[node]) > 1:
                self.report.add(f"{where}: {node} is received on streams "
                                f"{sorted(streams[node])}; each receive has one")
        for node in sorted(set(taken) - set(receives)):
            self.report.add(f"{where}: its receive streams take {node}, which is not a "
                            f"pipeline receive of stage {program.stage} in graph.json")

    def _schedule(self, where: str, program: Program) -> None:
        """Rule 4: every block once for every microbatch."""
        self._runs_once(where, "the schedule", program.schedule, sorted(program.blocks),
                        program.microbatches, "block")

    def evaluation_coverage(self, name: str, program: Program) -> None:
        """An evaluation batch runs every forward block once for every microbatch, and
        nothing else."""
        forward = sorted(b for b in program.blocks
                         if Block.parse(b).kind is ActionKind.FORWARD)
        self._runs_once(f"{self.ranks_text(name)} ({name})", "the evaluation's schedule",
                        program.evaluation, forward, program.microbatches, "forward block")

    def _runs_once(self, where: str, what: str, entries, blocks: list[str], m: int,
                   noun: str) -> None:
        runs = Counter(tuple(entry) for entry in entries)
        for block in blocks:
            counts = Counter({mb: runs.get((block, mb), 0) for mb in range(m)})
            wrong = sorted(mb for mb, count in counts.items() if count != 1)
            if wrong:
                mb = wrong[0]
                said = f"never runs block {block}" if counts[mb] == 0 else \
                    f"runs block {block} {_times(counts[mb])}"
                self.report.add(f"{where}: {what} {said} for microbatch {mb}; every "
                                f"{noun} runs once for each of the {m}")
        allowed = set(blocks)  # a set: a schedule has blocks x microbatches entries
        extra = sorted(entry for entry in runs if entry[0] not in allowed or
                       not 0 <= entry[1] < m)
        if extra:
            self.report.add(f"{where}: {what} runs {extra[0][0]} for microbatch "
                            f"{extra[0][1]}, which it may not")

def _issued(count: int) -> str:
    return "never issued" if count == 0 else f"issued {_times(count)}"


def _times(count: int) -> str:
    return {0: "never", 1: "once", 2: "twice"}.get(count, f"{count} times")


def _microbatches(counts: Counter) -> str:
    if not counts:
        return "none"
    return ", ".join(f"{mb}" + (f" ({_times(c)})" if c != 1 else "")
                     for mb, c in sorted(counts.items()))
