"""What planc tune knows of a candidate before it simulates it: its plan (built from the
file's by replacing the candidate's choices, as the checker would read them), its memory
estimate, and a lower bound on its simulated step time.

The bound is what no schedule can beat on the compute stream of one stage: the first
microbatch's forward has to reach stage s through the chunks before it, and then stage
s runs the forward and backward of every microbatch, one after another:

    step >= max over s of ( sum over the chunks before s of F_c  +  m (F_s + B_s) )

with F and B the forward and backward FLOPs of one microbatch (backward twice the
forward's matrix work, plus the forward again where recomputed) at the fastest rate any
compute instruction reaches in the simulator (planc.estimate.kernel_cost.KernelModel.
fastest_fraction of the device's peak: a large GEMM's, or the roofline's efficiency), no
communication, and each operator's FLOPs divided by tp (those run whole on every tp rank
are counted as split too). Every term only undercounts what the simulator charges
(planc.estimate.instruction_cost: each kernel at its own rate, communication, the pipeline's
waits), so a candidate whose bound is above a step time already simulated cannot beat
it: pruning by the bound never drops a better plan.
"""

from __future__ import annotations

import dataclasses

from planc.estimate.cost import CostModel
from planc.estimate.kernel_cost import KernelModel
from planc.estimate.model import Shapes
from planc.models import family_of
from planc.plan.plan import Mesh, PipelineParallel, Plan, Schedule
from planc.schedules import named as named_schedule
from planc.schedules.layers import EMBEDDING_WORK, balanced_chunks, range_text
from planc.tune.space import Candidate

# The forward's FLOPs again, per recomputation: full recomputes every block's forward,
# selective only attention's core (Korthikanti et al. 2023) and attention_inputs the
# operators up to it, taken here as none at all so that the bound stays below the
# simulator's.
RECOMPUTED_FORWARDS = {"none": 0.0, "selective": 0.0, "attention_inputs": 0.0,
                       "full": 1.0}


def chunks_for(base: Plan, c: Candidate, chunks_of: dict | None = None) -> tuple:
    """The candidate's layer ranges: the file's own, or balanced (``stages = auto``),
    or the layers alone spread evenly (``even``); ``chunks_of``: those found already."""
    if c.stages == "file":
        return base.shard.pp.chunks
    placement = named_schedule(c.pipeline).placement
    key = (c.pp, c.virtual, placement.name, c.stages)
    chunks = None if chunks_of is None else chunks_of.get(key)
    if chunks is None:
        chunks = balanced_chunks(base.model.layers, c.pp, c.virtual, placement,
                                 ends=0 if c.stages == "even" else EMBEDDING_WORK)
        if chunks_of is not None:
            chunks_of[key] = chunks
    return chunks


def plan_of(base: Plan, c: Candidate, per_node: int, chunks_of: dict | None = None) -> Plan:
    """``base`` with the candidate's choices, its layers in balanced chunks, on nodes of
    ``per_node`` devices; ``chunks_of``: balanced chunks already found, by layout."""
    chunks = chunks_for(base, c, chunks_of)
    shard = base.shard
    world = c.tp * c.cp * c.pp * c.dp
    topology = dataclasses.replace(base.topology, nodes=max(1, world // per_node),
                                   devices_per_node=min(per_node, world))
    return dataclasses.replace(
        base, mesh=Mesh(c.tp, c.cp, c.pp, c.dp, c.order, c.ep), topology=topology,
        shard=dataclasses.replace(
            shard, tp=dataclasses.replace(shard.tp, sequence_parallel=c.sequence_parallel),
            pp=PipelineParallel(chunks, c.virtual, c.stages == "auto" or
                                c.stages == "file" and base.shard.pp.auto),
            # grad_reduce = all_reduce is ZeRO-1's alone: another zero reduce-scatters
            dp=dataclasses.replace(shard.dp, zero=c.zero, grad_reduce=shard.dp.grad_reduce
                                   if c.zero == 1 else "reduce_scatter")),
        schedule=Schedule(c.microbatches, c.pipeline),
        optimize=dataclasses.replace(base.optimize, recompute=c.recompute))


class Estimator:
    """Bounds and estimates of the candidates of one search, sharing what they have in
    common (a block's FLOPs per tp, cp and microbatch size)."""

    def __init__(self, per_node: int):
        self.per_node = per_node
        self._blocks: dict[tuple, float] = {}
        self._costs: dict = {}  # topology -> its cost model (one per search, in practice)

    def _ops_flops(self, plan: Plan, shapes: Shapes, ops) -> float:
        key = (plan.mesh.tp, plan.mesh.cp, plan.microbatch_size, tuple(ops))
        if key not in self._blocks:
            family = family_of(plan)
            self._blocks[key] = sum(family.forward_flops(op, shapes) for op in ops) / \
                plan.mesh.tp
        return self._blocks[key]

    def chunk_forward_flops(self, plan: Plan) -> list[float]:
        """Forward FLOPs of one microbatch per chunk on one rank, every operator over
        tp."""
        family, m = family_of(plan), plan.model
        shapes = Shapes.of(plan)
        out = []
        chunks = plan.shard.pp.chunks
        for chunk, (first, last) in enumerate(chunks):
            flops = 0.0
            for layer in range(first, last + 1):
                ops = family.layer_ops if family.layer_block is None else \
                    family.layer_block(m, layer)[0]
                flops += self._ops_flops(plan, shapes, ops)
            if chunk == 0:
                flops += self._ops_flops(plan, shapes, family.embedding_ops)
            if chunk == len(chunks) - 1:
                flops += self._ops_flops(plan, shapes, family.head_ops)
            out.append(flops)
        return out

    def lower_bound(self, plan: Plan) -> float:
        """Seconds no schedule of ``plan`` can beat (see the module's docstring)."""
        fastest = plan.topology.device.flops * KernelModel.fastest_fraction(plan)
        forward = [f / fastest for f in self.chunk_forward_flops(plan)]
        again = RECOMPUTED_FORWARDS[plan.optimize.recompute]
        m = plan.schedule.microbatches
        best = 0.0
        for stage in range(plan.mesh.pp):
            mine = plan.chunks_of_stage(stage)
            before = sum(forward[c] for c in range(min(mine)))  # the first one's way in
            work = sum(forward[c] * (3.0 + again) for c in mine)
            best = max(best, before + m * work)
        return best

    def estimate(self, plan: Plan, bound: float, stage_parameters: int) -> float:
        """An order to simulate candidates in, best first: the bound at the device's
        achievable rate with the schedule's bubble (Narayanan et al. 2021: (pp - 1) /
        (m v) of the step for 1F1B and interleaved, about a third of that for the
        zero-bubble schedules), plus the tp and cp collectives of every block, which run
        in series with it, and what of the gradient reduction outlasts a microbatch."""
        mesh, m = plan.mesh, plan.model
        micro, v = plan.schedule.microbatches, plan.shard.pp.virtual
        bubble = (mesh.pp - 1) / (micro * v)
        if plan.schedule.pipeline in ("zb1p", "interleaved_zb", "zbv", "dualpipev"):
            bubble /= 3
        compute = bound * (1 + bubble) * KernelModel.fastest_fraction(plan) / \
            plan.topology.device.efficiency  # the bound's rate back to the device's
        cost = self._costs.get(plan.topology)
        if cost is None:
            cost = self._costs[plan.topology] = CostModel(plan.topology)
        layers = max(len(plan.layers_of_stage(s)) for s in range(mesh.pp))
        tokens = plan.microbatch_size * m.seq // mesh.cp
        activation = tokens * m.hidden * m.dtype_bytes
        passes = 3 + (1 if plan.optimize.recompute == "full" else 0)
        comm = 0.0
        if mesh.tp > 1:
            per = cost.transfer_seconds("all_reduce", activation, mesh.tp,
                                        mesh.tp > self.per_node)
            comm += micro * layers * passes * 2 * per / 1.5
        if mesh.cp > 1:
            kv = 2 * activation * m.key_value_heads / m.heads / mesh.tp
            comm += micro * layers * passes * cost.transfer_seconds(
                "all_gather", kv * mesh.cp, mesh.cp, mesh.tp * mesh.cp > self.per_node)
        replicas = mesh.dp * mesh.cp
        if replicas > 1:
            grads = stage_parameters * plan.reduce_dtype_bytes
            crosses = mesh.tp * mesh.cp * mesh.pp * mesh.dp > self.per_node
            reduce = cost.transfer_seconds("all_reduce", grads, replicas, crosses)
            each = compute / micro
            if plan.shard.dp.zero >= 2:  # every microbatch, as well as gathers under 3
                reduce *= micro * (1.5 if plan.shard.dp.zero == 3 else 0.5)
            comm += max(0.0, reduce - each)
        return compute + comm


def stages_setting(base: Plan, c: Candidate) -> str | None:
    """``shard.pp.stages`` as the candidate's plan writes it: None to leave the file's,
    ``auto``, or the ranges of ``even``."""
    if c.stages == "file":
        return None
    if c.stages == "auto":
        return "auto"
    chunks = chunks_for(base, c)
    return "[" + ", ".join(range_text(chunks, k) for k in range(len(chunks))) + "]"
