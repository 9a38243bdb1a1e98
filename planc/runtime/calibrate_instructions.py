"""What the runtime's compute instructions cost beyond their arithmetic on this machine,
operator by operator: the fixed costs ``planc calibrate`` writes as ``device.overheads``
(planc.plan.plan.Device) and ``planc simulate`` adds to each instruction's roofline time
(planc.estimate.roofline).

Measured on what runs: every rank of the calibration compiles a tiny data-parallel plan
of each model family (:data:`FAMILIES`, ``dp`` = the calibration's world, so every rank
runs it at once and the cores are shared as in a training step), runs a few steps of it
through the runtime's own executor with its trace on, and takes, for every compute
instruction after the warm-up, its traced time less its arithmetic at the measured
compute rate and memory bandwidth. The figure of an operator is the median over its
instructions, forward steps and gradient steps apart, the slowest rank's. On a CPU a
small model's instruction is mostly this: the Python of the step, the dispatch of
several PyTorch operators, autograd's bookkeeping, which a single matrix multiply (the
device's one ``overhead``) undercounts several times over.
"""

from __future__ import annotations

import statistics
import tempfile

import torch
import torch.distributed as dist

from planc.build import directory as build_directory
from planc.build.files import read_for_run
from planc.compile import compile_plan
from planc.data.identity import identity_now
from planc.estimate.roofline import roofline_seconds, traffic
from planc.lang.front import load_text
from planc.program.operands import GRADIENT_STEPS
from planc.program.program import Opcode
from planc.runtime.engine.context import RankContext, make_groups
from planc.runtime.engine.executor import CpuExecutor
from planc.runtime.engine.interpreter import Interpreter
from planc.runtime.engine.store import ParamStore

# One tiny plan per family, 2 microbatches of one sequence per rank: the shapes of a
# small model, so that what is measured is the fixed cost and not the arithmetic.
FAMILIES = {
    "gpt": "model gpt { layers = 2; hidden = 64; heads = 4; vocab = 256; seq = 32; "
           "batch = BATCH }",
    "llama": "model llama { layers = 2; hidden = 64; heads = 4; kv_heads = 2; ffn = 176; "
             "vocab = 256; seq = 32; batch = BATCH }",
    "moe": "model moe { layers = 2; hidden = 64; heads = 4; kv_heads = 2; vocab = 256; "
           "seq = 32; batch = BATCH; experts = 4; top_k = 2; expert_ffn = 48; "
           "shared_experts = 1; first_dense = 1; ffn = 128 }",
}
PLAN = """plan calibrate_{family} {{
  {model}
  mesh {{ dp = {world} }}
  topology {{ nodes = {nodes}; devices_per_node = {per_node}; device {{ flops = 1TFLOP/s }} }}
  schedule {{ microbatches = 2 }}
  train {{ steps = {steps}; optimizer = adamw(lr = 1e-3); seed = 0 }}
}}
"""
WARMUP = 2  # steps left out: the first allocations, autograd's first graphs
TIMEOUT = 300.0  # seconds without progress before a step is declared hung


def plan_text(family: str, world: int, per_node: int, steps: int) -> str:
    """The tiny plan of ``family`` on ``world`` ranks, nodes of ``per_node``: one sequence
    of each of 2 microbatches per rank."""
    return PLAN.format(family=family, model=FAMILIES[family].replace("BATCH", str(2 * world)),
                       world=world, nodes=world // per_node, per_node=per_node, steps=steps)


def _samples(family: str, per_node: int, steps: int, rate: float, bandwidth: float
             ) -> dict[tuple[str, bool], list[float]]:
    """Seconds beyond their arithmetic of this rank's compute instructions, by (operator,
    gradient step), over ``steps`` steps of the family's tiny plan after the warm-up."""
    world, rank = dist.get_world_size(), dist.get_rank()
    loaded = load_text(plan_text(family, world, per_node, steps), f"<calibrate {family}>")
    if not loaded.ok:  # the plans above are fixed: a failure here is planc's own bug
        raise RuntimeError(f"calibrate's {family} plan does not check: "
                           f"{[d.message for d in loaded.diagnostics]}")
    with tempfile.TemporaryDirectory(prefix="planc-calibrate-") as scratch:
        build_directory.write(compile_plan(loaded.plan), scratch, loaded.path,
                              loaded.source)
        built = read_for_run(scratch)
    groups = make_groups(built.groups, rank, TIMEOUT)
    ctx = RankContext(built.model, built.table, rank, groups, torch.device("cpu"),
                      built.routes, identity_now(built.model.data),
                      built.groups.devices_per_node, record=built.record)
    program = built.programs[built.table.program_of(rank)]
    instructions = {item.node: item for item in program.written()
                    if item.op is Opcode.COMPUTE}
    optimizer = loaded.plan.train.optimizer.name
    executor = CpuExecutor(Interpreter(ctx, program, ParamStore(ctx, program.buckets)),
                           TIMEOUT, trace=True)
    out: dict[tuple[str, bool], list[float]] = {}
    try:
        for step in range(steps):
            result = executor.run_step(step)
            if step < WARMUP:
                continue
            for event in result.trace:
                instruction = instructions.get(event.name)
                if event.op is not Opcode.COMPUTE or instruction is None or \
                        instruction.operands.kernel is None:
                    continue
                operands = instruction.operands
                arithmetic = roofline_seconds(
                    operands.flops or 0.0,
                    traffic(operands.kernel, optimizer) * (operands.output_bytes or 0),
                    rate, bandwidth)
                key = (operands.kernel, operands.step in GRADIENT_STEPS)
                out.setdefault(key, []).append(event.end - event.start - arithmetic)
    finally:
        executor.close()
    return out


def measure_instructions(per_node: int, repeats: int, rate: float, bandwidth: float
                         ) -> dict[str, dict[str, float]]:
    """Operator -> {"forward": s, "gradient": s}: the median fixed cost of its
    instructions over ``repeats`` steps of each family after the warm-up, on this
    machine, the slowest rank's (see the module docstring). An operator with no gradient
    step (the optimizer's) has its forward figure for both."""
    samples: dict[tuple[str, bool], list[float]] = {}
    for family in FAMILIES:
        for key, values in _samples(family, per_node, WARMUP + repeats, rate,
                                    bandwidth).items():
            samples.setdefault(key, []).extend(values)
    kernels = sorted({kernel for kernel, _ in samples})
    figures = torch.tensor([[max(statistics.median(samples.get((kernel, gradient)) or
                                                   samples[(kernel, not gradient)]), 0.0)
                             for gradient in (False, True)] for kernel in kernels],
                           dtype=torch.float64)
    dist.all_reduce(figures, op=dist.ReduceOp.MAX)
    return {kernel: {"forward": float(row[0]), "gradient": float(row[1])}
            for kernel, row in zip(kernels, figures)}
