"""Prove, without running anything, that the rank programs cannot go wrong.

The invariants of docs/semantics.md, section 5:

1. every group issues its collectives in the same order on all its members;
2. every send has exactly one matching receive of the same size, and the ranks cannot
   deadlock (the cross-rank wait-for graph has no cycle);
3. every wait names an event recorded earlier on some stream of the same rank;
4. every buffer is written before it is read, and never overwritten while a transfer
   still reads it;
5. every tree or hierarchical route runs a recipe that computes exactly the collective
   it replaces, without deadlock (:mod:`planc.verify.routes`);
6. ring attention's cp ring steps are deadlock-free and meet every block
   (:mod:`planc.verify.ring`), a mixture of experts' all-to-alls over its ep
   group match (:mod:`planc.verify.experts`), and a mixture's balance-loss counts
   are summed over the ranks of each sequence once per token, in one order
   (:mod:`planc.verify.counts`);
7. where a collective spans stages (the tied embedding's, the gradient norm's), the
   whole step, stream by stream, runs to its end (:mod:`planc.verify.progress`);
8. with ``train { grad_clip }``, every rank sums its share of the gradient norm once per
   step over the world group, after its gradient reductions and before its optimizer
   steps, counting every gradient element once (:mod:`planc.verify.grad_norm`);
9. with ``model moe { bias_update }``, every rank of a stage holding mixture blocks
   counts its expert loads, sums them over the stage and updates the balancing bias
   once per step, in that order, in its epilogue (:mod:`planc.verify.router_bias`);
10. every program runs its stage's step whole: each node of the graph once (per
    microbatch in its own block), each block once for every microbatch
    (:mod:`planc.verify.coverage`);
11. every event says what it claims: a record follows its node on its stream, a guarded
    wait serves one instruction of its own instance, and receives and the reductions
    the epilogue reads are waited for (:mod:`planc.verify.events`).

Before any of these, every instruction's operands (what the runtime runs) must be the
ones the graph implies (:func:`planc.lower.bind.operands_of`): the proofs below read the
graph, so they hold for the programs only where the two agree; and its reads and writes
must name what those operands read and write (:mod:`planc.verify.reads_writes`), since
the proofs order instructions by them.

Programs are folded (blocks run per microbatch, see program.py), and so is most of the
proof. This module checks the rank table, the buckets and the order of collectives on
each group; :mod:`planc.verify.streams` checks events and buffers block by block,
:mod:`planc.verify.pipeline` sends, receives and deadlock across the stages.
"""

from __future__ import annotations

import networkx as nx

from planc.graph.ir import Axis, bucket_problems
from planc.plan.layout import Layout as RankLayout
from planc.lower.bind import Binding
from planc.program.pair_orders import order_problem, pair_key
from planc.program.groups import SEQUENCE, GroupTable
from planc.program.program import COLLECTIVES, Program, RankTable
from planc.program.routes import RouteTable
from planc.lower.tables import routed_nodes
from planc.verify.reads_writes import reads_and_writes_problem
from planc.verify.counts import CountsChecks, sums_counts
from planc.verify.coverage import CoverageChecks
from planc.verify.events import EventChecks
from planc.verify.experts import ExpertChecks, is_expert_exchange
from planc.verify.grad_norm import GradNormChecks
from planc.verify.router_bias import RouterBiasChecks
from planc.verify.pipeline import PipelineChecks
from planc.verify.progress import ProgressChecks
from planc.verify.report import Report, describe, ranks_text
from planc.verify.ring import RingChecks, is_ring
from planc.verify.routes import check_routes
from planc.verify.streams import StreamChecks
from planc.plan.mesh import PIPELINE_AXIS
from planc.plan.plan import Plan


class _Verifier(StreamChecks, PipelineChecks, RingChecks, ExpertChecks, CountsChecks,
                ProgressChecks, GradNormChecks, RouterBiasChecks, CoverageChecks,
                EventChecks):
    def __init__(self, plan: Plan, graph: nx.DiGraph, programs: dict[str, Program],
                 table: RankTable, groups: GroupTable | None = None,
                 routes: RouteTable | None = None, binding: Binding | None = None):
        self.plan, self.graph, self.programs, self.table = plan, graph, programs, table
        self.groups, self.routes = groups, routes
        self.report = Report()
        self.layout = RankLayout.of(plan)
        self._texts: dict[str, str] = {}
        self.receive_of_send: dict[str, str] = {}
        self._binding = binding  # the graph's operands, made when first needed
        self._by_stage: dict[int, list[str]] | None = None  # the graph's nodes by stage

    # --- 0. the rank table ------------------------------------------------------------

    def rank_table(self) -> bool:
        table, pp = self.table, self.plan.mesh.pp
        layout = self.layout
        if (table.world, table.pp, table.stride) != (self.plan.world, pp,
                                                      layout.strides[PIPELINE_AXIS]) or \
                table.axes != {a: (layout.mesh.size(a), layout.strides[a]) for a in table.axes} \
                or table.leader != layout.first_rank_of_stage(self.plan.head_stage):
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
            self._texts[name] = ranks_text(list(self.table.ranks(name)))
        return self._texts[name]

    # --- pairs -------------------------------------------------------------------------

    def pair_orders(self, name: str, program: Program) -> bool:
        """Each order the program writes for an overlapped pair (planc.program.pair_orders)
        is one of the pair's: every instruction once, each block's own order, a weight
        gradient after what it needs, the second block's sends after the first's. The
        checks after this one read the pairs in that order."""
        pairs = {pair_key(program.schedule[k:k + program.together(k)])
                 for k in program.paired}
        ok = True
        for key, order in sorted(program.pair_orders.items()):
            problem = "it runs no such pair" if key not in pairs else order_problem(
                [program.blocks[block] for block in key.split(" ")], order)
            if problem is not None:
                self.report.add(f"program {name}: the order it writes for the pair {key}: "
                                f"{problem}")
                ok = False
        return ok

    # --- groups ------------------------------------------------------------------------

    def group_refs(self, name: str, program: Program) -> bool:
        """Every group an instruction names is a rule of groups.json. A rank finds its
        members there; one the table lacks would leave it alone in its group, and the
        simulator and the traces could not size it."""
        if self.groups is None:
            return True
        items = _with_operands(program)
        for instruction in items:
            operands = instruction.operands
            for ref in (operands.group, operands.counts_group) if operands else ():
                if ref is not None and self.groups.rule(ref) is None:
                    self.report.add(f"program {name}: {describe(instruction)} uses group "
                                    f"{ref!r}, which groups.json lacks")
                    return False
        return True

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

    # --- operands ----------------------------------------------------------------------

    def operands(self, name: str, program: Program) -> None:
        """Every instruction runs what its node of the graph says, as the lowering wrote it."""
        items = [i for i in _with_operands(program) if i.operands is not None]
        checked: set[tuple[str, str]] = set()
        if self._binding is None:
            self._binding = Binding(self.graph)
        for instruction in items:
            key = (instruction.op, instruction.node)
            if key in checked or instruction.node not in self.graph:
                continue
            checked.add(key)
            try:
                expected = self._binding.operands(instruction.node, instruction.op)
            except (KeyError, TypeError, ValueError, StopIteration) as exc:
                self.report.add(f"{name}: the operands of {instruction.op} "
                                f"{instruction.node} cannot be derived from graph.json "
                                f"({type(exc).__name__}: {exc})")
                return
            if instruction.operands != expected:
                self.report.add(f"{name}: the operands of {instruction.op} "
                                f"{instruction.node} are not those graph.json implies")
                return
        problem = reads_and_writes_problem(name, program)
        if problem is not None:
            self.report.add(problem)

    # --- 1. collective order ------------------------------------------------------------

    def collective_order(self) -> None:
        table = self.table
        if not self.uniform:  # some ranks run a program of their own: compare their groups
            for rank in sorted(table.overrides):
                for axis in [a.value for a in Axis if a.within_stage and a != Axis.STAGE] + \
                        ([SEQUENCE] if self.groups is not None and
                         self.groups.rule(SEQUENCE) is not None else []):
                    self._compare_members(axis, self.layout.group(rank, axis))
        if self.plan.model.tie_embeddings and self.plan.head_stage != 0:
            last = self.plan.head_stage
            pairs = {(0, self.layout.first_rank_of_stage(last))}
            for rank in table.overrides:  # and every pair involving an override
                pairs.add((self.layout.pipeline_peer(rank, 0),
                           self.layout.pipeline_peer(rank, last)))
            for pair in sorted(pairs):
                self._compare_members(Axis.TIED, pair)
        if self.plan.train.grad_clip is not None:  # the gradient norm: one rank per program
            self._compare_members(Axis.WORLD, tuple(sorted(
                next(iter(self.table.ranks(name))) for name in self.table.names)))

    def _collectives(self, name: str, axis: str) -> list[tuple[str, str, int | None]]:
        """The collectives on ``axis`` that the program issues in one step, in issue order
        (that of :func:`planc.program.expansion.expand`, which receives do not change), as (op, node,
        microbatch): found once per block, then repeated along the schedule."""
        program = self.programs[name]

        def on_axis(instructions) -> list:
            return [i for i in instructions if i.op in COLLECTIVES and i.node in self.graph
                    and self.graph.nodes[i.node].get("axis") == axis
                    or axis == Axis.CP.value and is_ring(i)
                    or axis == "ep" and is_expert_exchange(i)
                    or axis == SEQUENCE and sums_counts(i)]

        per_block = {block: on_axis(items) for block, items in program.blocks.items()}
        out = [(i.op, i.node, None) for i in on_axis(program.prologue)]
        for block, mb in program.schedule:
            for i in per_block.get(block, ()):
                if program.runs(i, mb):
                    out.append((i.op, i.node, mb if i.per_microbatch else None))
        return out + [(i.op, i.node, None) for i in on_axis(program.epilogue)]

    def _compare_members(self, axis: str, members) -> None:
        names = {r: self.table.program_of(r) for r in members}
        if len(set(names.values())) == 1 and axis not in ("tied", "world"):
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
        if axis in ("tied", "world"):  # each stage's node names the one collective
            name = lambda node: self.graph.nodes[node].get("collective", node) \
                if node in self.graph else node  # noqa: E731
            return x[0] == y[0] and name(x[1]) == name(y[1]) and x[2] == y[2]
        return x == y

    def run(self) -> Report:
        if not self.rank_table():
            return self.report
        if not all([self.group_refs(name, self.programs[name]) for name in self.table.names]):
            return self.report
        if not all([self.pair_orders(name, self.programs[name]) for name in self.table.names]):
            return self.report
        for name, program in self.programs.items():
            if name in self.table.names:
                self.coverage(name, program)
                if program.evaluation:
                    self.evaluation_coverage(name, program)
                self.operands(name, program)
                self.events(name, program)
                self.events_and_buffers(name, program)
                self.buckets(name, program)
                self.ring(name, program)
                self.experts(name, program)
                self.counts(name, program)
                self.grad_norm(name, program)
                self.router_bias(name, program)
        self.transfers_and_progress()
        self.route_recipes()
        return self.report

    def transfers_and_progress(self) -> None:
        """Every group's collectives in one order and the pipeline's sends matched;
        then, matched and ordered, the streams of every rank together."""
        self.collective_order()
        self.pipeline()
        if not self.report.problems:
            self.progress()

    def run_evaluation(self) -> Report:
        """The checks of a step's streams and transfers, on the evaluation's programs
        (the forward blocks on their forward-only schedule): events, buffers, the
        collectives' order on every group, the pipeline's sends and receives, and
        progress."""
        if not self.rank_table():
            return self.report
        for name, program in self.programs.items():
            if name in self.table.names:
                self.events_and_buffers(name, program)
        head = f"stage{self.plan.head_stage}.json"
        if head in self.programs and not any(
                i.operands is not None and i.operands.payload == "loss"
                for i in self.programs[head].written()):
            self.report.add(f"{self.ranks_text(head)} ({head}): no instruction reduces the "
                            f"loss, so an evaluation would report none")
        self.transfers_and_progress()
        return self.report

    # --- 5. routes ----------------------------------------------------------------------

    def route_recipes(self) -> None:
        """Tree and hierarchical transfers run recipes that compute their collective."""
        if not routed_nodes(self.graph):
            return
        if self.groups is None or self.routes is None:
            self.report.add("the graph routes transfers by tree or hierarchy, but the build "
                            "has no route recipes")
            return
        for problem in check_routes(self.graph, self.groups, self.routes):
            self.report.add(problem)


def _with_operands(program: Program) -> list:
    """The instructions a program writes, and one receive per node each receive stream
    takes (a stream receives a node once per microbatch, with the same operands)."""
    return [*program.written()] + [
        program.receive(stream, node) for stream, receives in program.receives.items()
        for node in dict.fromkeys(node for node, _ in receives)]


def _collective_text(item) -> str:
    if item is None:
        return "nothing (it stops earlier)"
    op, node, mb = item
    return f"{op} {node}" + (f" (microbatch {mb})" if mb is not None else "")


def verify(plan: Plan, graph: nx.DiGraph, programs: dict[str, Program],
           table: RankTable, groups: GroupTable | None = None,
           routes: RouteTable | None = None, binding: Binding | None = None) -> Report:
    """The problems of ``programs`` lowered from ``graph``; ``binding``: the graph's
    operands as the lowering derived them (planc.lower.bind.Binding), when it is at hand.
    Programs that pass, and that evaluate (``train { eval_every }``), are proven for an
    evaluation batch too (:func:`verify_evaluation`): a build read back was run without
    it, its evaluation unproven."""
    report = _Verifier(plan, graph, programs, table, groups, routes, binding).run()
    if report.ok and any(p.evaluation for p in programs.values()):
        return verify_evaluation(plan, graph, programs, table, groups, routes)
    return report


def verify_build(built) -> Report:
    """:func:`verify` of a build read with its programs (planc.build.directory)."""
    return verify(built.plan, built.graph, built.programs, built.table, built.groups,
                  built.routes)


def verify_evaluation(plan: Plan, graph: nx.DiGraph, programs: dict[str, Program],
                      table: RankTable, groups: GroupTable | None = None,
                      routes: RouteTable | None = None) -> Report:
    """:meth:`_Verifier.run_evaluation` on each program's evaluation
    (planc.lower.evaluation), its problems saying so."""
    report = _Verifier(plan, graph, {n: p.for_evaluation() for n, p in programs.items()},
                       table, groups, routes).run_evaluation()
    out = Report()
    for problem in report.problems:
        out.add(f"the evaluation: {problem}")
    return out
