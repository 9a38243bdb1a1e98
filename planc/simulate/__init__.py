"""``planc simulate``: predict a training step of a build on its topology's cost model.

The rank programs are replayed (:mod:`planc.simulate.pipeline`) with each instruction
timed by one model, the one the compiler optimises with:

- a compute node takes the longer of its FLOPs at the device's achievable rate
  (``flops * efficiency``) and its memory traffic at the device's memory bandwidth (a
  roofline: matrix multiplies are bound by the first, layer norms, activations and
  residual adds by the second);
- a transfer takes the time of the route the compiler chose (``route_seconds``), or the
  ring time of planc.cost for point-to-point transfers.

The figures per step are those Megatron-LM reports: time, model TFLOP/s per GPU and MFU
with the model FLOPs of Narayanan et al. (SC'21, eq. 3, with the MLP width as written):
``3 * tokens * (layers * (24 h^2-equivalent matmuls + 4 s h attention) + 2 h V)``,
recomputation not counted (it is hardware FLOPs, not model FLOPs). The pipeline bubble is
the time a stage's compute stream waits for its neighbours; exposed communication the
time it waits for a transfer of its own, by axis. Memory is planc.memory's estimate.
"""

from __future__ import annotations

from dataclasses import dataclass

import networkx as nx

from planc import memory
from planc.build import Build
from planc.cost import CostModel
from planc.graph.ir import Axis, NodeType
from planc.graph.summary import crosses_nodes
from planc.layout import Layout
from planc.models import family_of
from planc.plan import Plan
from planc.simulate.pipeline import StageTime, step

# Bytes an operator moves per byte of its output: read the input and write the output;
# a residual add reads two inputs; AdamW reads a parameter, its gradient and two moments
# and writes three of them back (SGD with momentum: three reads, two writes).
TRAFFIC = {"attn_residual": 3.0, "mlp_residual": 3.0}
OPTIMIZER_TRAFFIC = {"adamw": 7.0, "sgd": 5.0}
DEFAULT_TRAFFIC = 2.0


def model_flops(plan: Plan) -> float:
    """Model FLOPs of one step (Narayanan et al. 2021): forward and backward, 3x the
    forward's matrix multiplies and attention, recomputation not counted; the family
    says what its forward costs per token."""
    m = plan.model
    return 3.0 * m.batch * m.seq * family_of(plan).model_flops_per_token(m)


class Durations:
    """Seconds of each node of the graph, by the cost model; cached."""

    def __init__(self, plan: Plan, graph: nx.DiGraph):
        self.plan, self.graph = plan, graph
        self.cost = CostModel(plan.topology)
        layout = Layout.of(plan)
        self.crosses = {}
        self.layout = layout
        self.cache: dict[str, float] = {}

    def _crosses(self, axis) -> bool:
        if axis not in self.crosses:
            self.crosses[axis] = crosses_nodes(self.layout, Axis(axis))
        return self.crosses[axis]

    def __call__(self, node: str) -> float:
        if node in self.cache:
            return self.cache[node]
        data = self.graph.nodes[node]
        device = self.plan.topology.device
        if data["type"] == NodeType.COMPUTE:
            op = str(data["op"])
            traffic = OPTIMIZER_TRAFFIC.get(self.plan.train.optimizer.name, 7.0) \
                if op == "optimizer" else TRAFFIC.get(op, DEFAULT_TRAFFIC)
            seconds = max(self.cost.compute_seconds(data["flops"]),
                          traffic * data["bytes"] / device.bandwidth)
        elif data.get("route_seconds") is not None:
            seconds = data["route_seconds"]
        else:
            seconds = self.cost.transfer_seconds(data["kind"], data["bytes"],
                                                 data["group_size"],
                                                 self._crosses(data["axis"]))
        self.cache[node] = seconds
        return seconds

    def axis_of(self, node: str) -> str | None:
        data = self.graph.nodes.get(node)
        if data is None or data["type"] != NodeType.TRANSFER:
            return None
        return str(data["axis"])


@dataclass(frozen=True)
class StageResult:
    stage: int
    step_seconds: float  # when the stage's step ends
    busy_seconds: float  # computing
    bubble_seconds: float  # waiting for other stages, until the slowest stage ends
    exposed_seconds: dict[str, float]  # waiting for its own transfers, by axis
    memory_bytes: float


@dataclass(frozen=True)
class Simulation:
    plan: str
    world: int
    stages: tuple[StageResult, ...]
    step_seconds: float
    model_flops: float
    peak_flops: float  # per device
    memory_capacity: float | None
    timeline: tuple[StageTime, ...] = ()

    @property
    def tflops_per_gpu(self) -> float:
        return self.model_flops / self.step_seconds / self.world / 1e12

    @property
    def mfu(self) -> float:
        return self.model_flops / self.step_seconds / self.world / self.peak_flops

    @property
    def bubble(self) -> float:
        """The first stage's share of the step spent waiting for the pipeline."""
        return self.stages[0].bubble_seconds / self.step_seconds

    def to_json(self) -> dict:
        return {"format": "planc-simulation", "version": 1, "plan": self.plan,
                "world": self.world, "step_seconds": self.step_seconds,
                "model_flops": self.model_flops, "peak_flops": self.peak_flops,
                "tflops_per_gpu": self.tflops_per_gpu,
                "mfu": self.mfu, "bubble": self.bubble,
                "memory_capacity": self.memory_capacity,
                "stages": [{"stage": s.stage, "step_seconds": s.step_seconds,
                            "busy_seconds": s.busy_seconds,
                            "bubble_seconds": s.bubble_seconds,
                            "exposed_seconds": s.exposed_seconds,
                            "memory_bytes": s.memory_bytes} for s in self.stages]}


def simulate(build: Build, keep_timeline: bool = False) -> Simulation:
    """One step of ``build`` (with its programs) on its plan's topology."""
    plan, graph = build.plan, build.graph
    programs = {program.stage: program for name, program in build.programs.items()
                if build.table.stages.get(name) == program.stage}
    chunk_stage = {data["chunk"]: data["stage"] for _, data in graph.nodes(data=True)}
    durations = Durations(plan, graph)
    times = step(programs, chunk_stage, durations, durations.axis_of, keep_timeline)
    step_seconds = max(t.end for t in times)
    estimate = memory.estimate(plan)
    stages = tuple(StageResult(
        t.stage, t.end, t.busy,
        t.waiting + (step_seconds - t.end),
        {axis: seconds for axis, seconds in sorted(t.exposed.items()) if seconds > 0},
        estimate.stages[t.stage].total_bytes) for t in times)
    return Simulation(plan.name, plan.world, stages, step_seconds, model_flops(plan),
                      plan.topology.device.flops, plan.topology.device.memory,
                      tuple(times) if keep_timeline else ())
