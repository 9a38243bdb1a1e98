"""``planc simulate``: predict a training step of a build on its topology's cost model.

The rank programs are replayed (:mod:`planc.simulate.pipeline`): the instructions a rank
runs, in the order it runs them, each timed from its operands by the model the compiler
optimises with (:mod:`planc.estimate.instruction_cost`): a compute step by the roofline of its FLOPs
and memory traffic, a transfer by the route the compiler chose for it, on its group as
programs/groups.json places it. Besides the programs, their rank table and group table,
the simulator reads only the plan: the topology the cost model prices, the model whose
FLOPs make the MFU, and the memory estimate.

The figures per step are those Megatron-LM reports: time, model TFLOP/s per GPU and MFU
with the model FLOPs of Narayanan et al. (SC'21, eq. 3, with the MLP width as written):
``3 * tokens * (layers * (24 h^2-equivalent matmuls + 4 s h attention) + 2 h V)``,
recomputation not counted (it is hardware FLOPs, not model FLOPs). The pipeline bubble is
the time a stage's compute stream waits for its neighbours; exposed communication the
time it waits for a transfer of its own, by axis. Memory is planc.estimate.memory's estimate.
"""

from __future__ import annotations

from dataclasses import dataclass

from planc.estimate import memory
from planc.build.directory import Build
from planc.models import step_model_flops
from planc.plan.plan import Plan
from planc.estimate.instruction_cost import InstructionCosts
from planc.estimate.plan_rates import fp8_speedup, mfu_peak
from planc.simulate.pipeline import StageTime, step


def model_flops(plan: Plan) -> float:
    """Model FLOPs of one step (planc.models.step_model_flops: Narayanan et al. 2021,
    recomputation not counted), the same count planc run's MFU divides."""
    return step_model_flops(plan)


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
    # (stage, bytes) of the stage that needs the most under the worst routing a dropless
    # mixture can get (planc.estimate.memory.MemoryEstimate.worst_routing_peak), or None
    worst_routing_memory: tuple[int, float] | None = None
    # model { fp8 } on a device the simulator knows no FP8 rate of: its GEMMs are priced
    # at the dtype's (InstructionCosts.fp8_at_the_dtype_rate)
    fp8_at_the_dtype_rate: bool = False
    # model { fp8 } at the device's FP8 rate: the MFU is of its FP8 peak (mfu_peak)
    mfu_of_fp8: bool = False
    # (stage, bytes) of the stage that needs the most as planc's runtime holds it, where
    # that is more than the estimate (MemoryEstimate.planc_run_peak), or None
    planc_run_memory: tuple[int, float] | None = None

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
                "fp8_at_the_dtype_rate": self.fp8_at_the_dtype_rate,
                "mfu_of_fp8": self.mfu_of_fp8,
                "worst_routing_memory": None if self.worst_routing_memory is None else {
                    "stage": self.worst_routing_memory[0],
                    "memory_bytes": self.worst_routing_memory[1]},
                "planc_run_memory": None if self.planc_run_memory is None else {
                    "stage": self.planc_run_memory[0],
                    "memory_bytes": self.planc_run_memory[1]},
                "stages": [{"stage": s.stage, "step_seconds": s.step_seconds,
                            "busy_seconds": s.busy_seconds,
                            "bubble_seconds": s.bubble_seconds,
                            "exposed_seconds": s.exposed_seconds,
                            "memory_bytes": s.memory_bytes} for s in self.stages]}


def stage_results(times, memory_bytes: list[float]) -> tuple[StageResult, ...]:
    """Each stage's figures from its replayed step (planc.simulate.pipeline.StageTime):
    its bubble is what it waited for other stages, plus the time from its own end to
    the slowest stage's, when the step ends for every stage."""
    step_seconds = max(t.end for t in times)
    return tuple(StageResult(
        t.stage, t.end, t.busy, t.waiting + (step_seconds - t.end),
        {axis: seconds for axis, seconds in sorted(t.exposed.items()) if seconds > 0},
        memory_bytes[t.stage]) for t in times)


def simulate(build: Build, keep_timeline: bool = False, gpu=None) -> Simulation:
    """One step of ``build`` (with its programs) on its plan's topology; ``gpu``: a
    planc.estimate.kernel_cost.GPU to price the kernels with instead of the preset's (the
    leave-one-table-out validation re-derives its figures without a table)."""
    plan = build.plan
    programs = {program.stage: program for name, program in build.programs.items()
                if build.table.stages.get(name) == program.stage}
    costs = InstructionCosts(plan, build.groups, gpu)
    times = step(programs, costs.of_stage, keep_timeline)
    step_seconds = max(t.end for t in times)
    estimate = memory.estimate(plan)
    stages = stage_results(times, [s.total_bytes for s in estimate.stages])
    worst, held = estimate.worst_routing_peak, estimate.planc_run_peak
    return Simulation(plan.name, plan.world, stages, step_seconds, model_flops(plan),
                      mfu_peak(plan), plan.topology.device.memory,
                      tuple(times) if keep_timeline else (),
                      None if worst is None else
                      (worst.stage, worst.worst_routing_total_bytes),
                      costs.fp8_at_the_dtype_rate, fp8_speedup(plan) is not None,
                      None if held is None else (held.stage, held.planc_run_total_bytes))
