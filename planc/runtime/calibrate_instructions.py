"""What the runtime's instructions cost a rank on this machine beyond what the links and
the arithmetic take, for ``planc calibrate`` (planc.runtime.calibrate), and the load they
are measured under.

- Each operator's compute instructions, ``device.overheads`` (planc.plan.topology.Device),
  which ``planc simulate`` adds to each instruction's roofline time
  (planc.estimate.roofline). Measured on what runs: every rank of the calibration
  compiles a tiny data-parallel plan of each model family (:data:`FAMILIES`, ``dp`` = the
  calibration's world, so every rank runs it at once and the cores are shared as in a
  training step), runs a few steps of it through the runtime's own executor with its
  trace on, and takes, for every compute instruction after the warm-up, its traced time
  less its arithmetic as the simulator prices it at the measured compute rate, memory
  bandwidth and exponentials a second. The figure of
  an operator is the median over its instructions, forward steps and gradient steps
  apart, the slowest rank's. On a CPU a small model's instruction is mostly this: the
  Python of the step, the dispatch of several PyTorch operators, autograd's
  bookkeeping, which a single matrix multiply (the device's one ``overhead``,
  :func:`tiny_operator`) undercounts several times over.
- The hand-off of a transfer between the executor's stream threads
  (:func:`measure_handoff`, ``device.handoff``).
- :func:`while_others_compute` (and :func:`while_others_compute_each`, a batch at a
  time): a measurement on some ranks while the others compute, as in a step.
"""

from __future__ import annotations

import statistics
import tempfile
import threading
import time

import torch
import torch.distributed as dist

from planc.build import directory as build_directory
from planc.build.files import read_for_run
from planc.compile import compile_plan
from planc.data.identity import identity_now
from planc.estimate.roofline import (memory_bound_bytes, roofline_seconds, traffic,
                                     transcendentals)
from planc.lang.front import load_text
from planc.plan.plan import DTYPE_BYTES
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


def _samples(family: str, per_node: int, steps: int, rate: float, bandwidth: float,
             exp_rate: float | None) -> dict[tuple[str, bool], list[float]]:
    """Seconds beyond their arithmetic of this rank's compute instructions, by (operator,
    gradient step), over ``steps`` steps of the family's tiny plan after the warm-up: the
    arithmetic as the simulator prices it on this device (planc.estimate.roofline)."""
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
    dtype_bytes = DTYPE_BYTES[loaded.plan.model.dtype]
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
                moved = memory_bound_bytes(operands, traffic(operands.kernel, optimizer) *
                                           (operands.output_bytes or 0), dtype_bytes)
                arithmetic = roofline_seconds(operands.flops or 0.0, moved, rate, bandwidth,
                                              transcendentals(operands, dtype_bytes), exp_rate)
                key = (operands.kernel, operands.step in GRADIENT_STEPS)
                out.setdefault(key, []).append(event.end - event.start - arithmetic)
    finally:
        executor.close()
    return out


def measure_instructions(per_node: int, repeats: int, rate: float, bandwidth: float,
                         exp_rate: float | None = None) -> dict[str, dict[str, float]]:
    """Operator -> {"forward": s, "gradient": s}: the median fixed cost of its
    instructions over ``repeats`` steps of each family after the warm-up, on this
    machine, the slowest rank's (see the module docstring). An operator with no gradient
    step (the optimizer's) has its forward figure for both."""
    samples: dict[tuple[str, bool], list[float]] = {}
    for family in FAMILIES:
        for key, values in _samples(family, per_node, WARMUP + repeats, rate,
                                    bandwidth, exp_rate).items():
            samples.setdefault(key, []).extend(values)
    kernels = sorted({kernel for kernel, _ in samples})
    figures = torch.tensor([[max(statistics.median(samples.get((kernel, gradient)) or
                                                   samples[(kernel, not gradient)]), 0.0)
                             for gradient in (False, True)] for kernel in kernels],
                           dtype=torch.float64)
    dist.all_reduce(figures, op=dist.ReduceOp.MAX)
    return {kernel: {"forward": float(row[0]), "gradient": float(row[1])}
            for kernel, row in zip(kernels, figures)}


# The device's one fixed cost of a compute instruction, for the operators not timed
# above (planc.runtime.calibrate_device.measure_overhead): the runtime's forward step of a
# tiny operator (its inputs and parameter made autograd leaves, the parameter cast to the model's
# dtype, the operator run with a graph: planc.runtime.engine.kernels.Kernels.forward) and its
# backward step (torch.autograd.grad of that one step: Kernels.backward), timed over
# OVERHEAD_CALLS back to back, every rank at once, so that on a CPU shared by more ranks
# than cores each rank's share of the cores is in the figure. A window of 200 lasts about
# as long as a small model's training step (hundreds of instructions), the span whose
# median planc run reports; the median of OVERHEAD_WINDOWS of them. (Shorter windows
# catch the quiet moments of a loaded machine: on this 2-core machine at a load average
# of 10 to 17, the median of 11 windows of 50 gave 0.15 to 0.6 ms per instruction, and
# predicted steps 30 to 84 % short of the measured ones, bench/simulate_here.py.)
OVERHEAD_CALLS = 200
OVERHEAD_WINDOWS = 5
OVERHEAD_SHAPE = (4, 8)


def tiny_operator() -> tuple:
    """(forward, backward): the runtime's forward of a tiny operator (inputs and
    parameter made autograd leaves, the parameter cast to the model's dtype, the operator
    run with a graph: planc.runtime.engine.kernels.Kernels.forward), returning its leaves and
    output, and the backward of what it returned (``torch.autograd.grad`` of that one
    step: Kernels.backward)."""
    x, w = torch.randn(*OVERHEAD_SHAPE), torch.randn(OVERHEAD_SHAPE[1], OVERHEAD_SHAPE[1])
    grad = torch.ones(OVERHEAD_SHAPE)

    def forward():
        leaf = x.detach().requires_grad_(True)
        weight = w.detach().requires_grad_(True)
        with torch.enable_grad():
            out = leaf @ weight.to(torch.float32)
        return leaf, weight, out

    def backward(leaf, weight, out):
        torch.autograd.grad(out, [leaf, weight], grad)

    return forward, backward


def while_others_compute(members: tuple[int, ...], measure) -> float:
    """``measure()`` (seconds) on the ranks ``members`` while every other rank runs the
    tiny operator's forward and backward back to back, as the ranks that are not waiting
    in a training step compute; the slowest member's figure, on every rank. A rank that
    waits for a message, or a thread that waits for another, is woken only when a core
    is free: with more ranks than cores that costs several times what it does while the
    other ranks wait too (on this 2-core machine, a 4 KB all_reduce on a pair of 8 ranks
    took 1.1 to 1.8 ms with every pair at it at once, 4.3 to 4.5 ms with the other six
    ranks computing), and in a step the other ranks compute."""
    return while_others_compute_each(members, lambda: [measure()], 1)[0]


def while_others_compute_each(members: tuple[int, ...], measure, count: int
                              ) -> list[float]:
    """:func:`while_others_compute` of a ``measure()`` that returns ``count`` figures
    (one per batch of calls): each the slowest member's, on every rank."""
    rank = dist.get_rank()
    dist.barrier()
    seconds = [0.0] * count
    if rank in members:
        seconds = measure()
        done = dist.barrier(async_op=True)
    else:
        done = dist.barrier(async_op=True)
        forward, backward = tiny_operator()
        while not done.is_completed():
            backward(*forward())
    done.wait()
    slowest = torch.tensor(seconds, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.tolist()


def measure_handoff() -> float:
    """Seconds of a hand-off round trip between two threads of a rank, as the CPU
    executor makes one for every transfer the compute stream waits for
    (planc.runtime.engine.executor: the compute stream's thread sets an event, the transfer's
    thread wakes from ``Event.wait``, does its work and sets another, the compute
    thread wakes), on rank 0 while the others compute (:func:`while_others_compute`):
    the median of OVERHEAD_WINDOWS windows of OVERHEAD_CALLS round trips. The work in
    between is nothing: the transfer's own time is the backend's, measured with the
    links (planc.runtime.calibrate)."""
    go, back, stop = threading.Event(), threading.Event(), threading.Event()

    def other_stream():
        while True:
            while not go.wait(0.05):
                if stop.is_set():
                    return
            go.clear()
            back.set()

    thread = threading.Thread(target=other_stream, daemon=True)
    thread.start()

    def windows() -> float:
        times = []
        for _ in range(OVERHEAD_WINDOWS + 1):
            start = time.perf_counter()
            for _ in range(OVERHEAD_CALLS):
                go.set()
                while not back.wait(0.05):
                    pass
                back.clear()
            times.append((time.perf_counter() - start) / OVERHEAD_CALLS)
        return statistics.median(times[1:])

    try:
        return while_others_compute((0,), windows)
    finally:
        stop.set()
        thread.join()
