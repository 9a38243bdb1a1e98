"""What one device does on its own, as planc calibrate measures it on every rank at once
(planc.runtime.calibrate): its matrix-multiply rate, its memory bandwidth, its
exponentials, how much of a collective hides behind a multiply, and what a compute
instruction costs the runtime beyond its arithmetic; and the timing both use, the
slowest rank's.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from planc.runtime.calibrate_instructions import OVERHEAD_CALLS, OVERHEAD_WINDOWS, tiny_operator

BATCH_BELOW = 1 << 20  # sizes below this are timed over a batch of calls
BATCH = 10


def timings(operation, nbytes: int, repeats: int) -> list[float]:
    """The slowest rank's time of each of ``repeats`` runs, after one warm-up. Small
    operations run ``BATCH`` at a time, back to back as a training step issues them, so
    that ranks leaving the barrier at different moments do not count as latency."""
    count = BATCH if nbytes < BATCH_BELOW else 1
    times = []
    for _ in range(repeats + 1):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(count):
            operation()
        times.append((time.perf_counter() - start) / count)
    slowest = torch.tensor(times[1:], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.tolist()


def timed(operation, nbytes: int, repeats: int) -> float:
    """The median of :func:`timings`."""
    return statistics.median(timings(operation, nbytes, repeats))


def measure_compute(repeats: int) -> float:
    """FLOP/s of an fp32 1024 x 1024 matrix multiply, the node's ranks all at once."""
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    seconds = timed(lambda: a @ b, 1 << 30, repeats)
    return 2 * 1024 ** 3 / seconds


def measure_overlap(repeats: int) -> dict:
    """How much of an all_reduce over the world hides behind a 1024 x 1024 matrix
    multiply started while it is in flight: ``(g + c - both) / min(g, c)``, from 0 (they
    take turns) to 1 (the shorter one is hidden), ``g`` and ``c`` each alone."""
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    buffer = torch.ones(1 << 20)  # 4 MB: a tp activation of a small model

    def both():
        work = dist.all_reduce(buffer, async_op=True)
        a @ b
        work.wait()

    gemm = timed(lambda: a @ b, 1 << 30, repeats)
    collective = timed(lambda: dist.all_reduce(buffer), 1 << 30, repeats)
    together = timed(both, 1 << 30, repeats)
    share = (gemm + collective - together) / min(gemm, collective)
    return {"gemm": gemm, "all_reduce": collective, "together": together,
            "overlap": min(1.0, max(0.0, share))}


def measure_memory(repeats: int) -> float:
    """Bytes/s of copying a 64 MB tensor (read and write), the node's ranks all at once."""
    source = torch.ones(16 << 20)
    target = torch.empty_like(source)
    seconds = timed(lambda: target.copy_(source), 1 << 30, repeats)
    return 2 * source.numel() * 4 / seconds


def measure_exponentials(repeats: int) -> float:
    """Exponentials a second of fp32 numbers, 4 Mi of them (16 MB) at a time, as a loss
    exponentiates its shifted logits (planc.runtime.families.loss), the node's ranks all
    at once: on a CPU an exponential costs tens of operations (on this 2-core machine,
    the 33 million of plans/llama-small.plan's sum of exponentials took 45 ms), which a
    loss's FLOPs do not count (Device.exp_rate)."""
    source = -10 * torch.rand(4 << 20)  # shifted logits: at most 0
    target = torch.empty_like(source)
    seconds = timed(lambda: torch.exp(source, out=target), 1 << 30, repeats)
    return source.numel() / seconds


def measure_overhead() -> dict:
    """Seconds of a tiny compute instruction as the runtime runs it, forward and
    backward apart: what the Python and the dispatcher cost, the arithmetic being
    nothing. Each window times OVERHEAD_CALLS forwards and their backwards one after the
    other, so that both figures see the same load; every rank at once."""
    forward, backward = tiny_operator()
    spent = {"forward": [], "backward": []}

    def window():
        forward_s = backward_s = 0.0
        for _ in range(OVERHEAD_CALLS):
            start = time.perf_counter()
            kept = forward()
            middle = time.perf_counter()
            backward(*kept)
            forward_s += middle - start
            backward_s += time.perf_counter() - middle
        spent["forward"].append(forward_s / OVERHEAD_CALLS)
        spent["backward"].append(backward_s / OVERHEAD_CALLS)

    timed(window, 1 << 30, OVERHEAD_WINDOWS)
    # timed's first window is its warm-up; each rank's median over the others, the
    # slowest rank's
    figures = torch.tensor([statistics.median(spent[k][1:]) for k in ("forward", "backward")],
                           dtype=torch.float64)
    dist.all_reduce(figures, op=dist.ReduceOp.MAX)
    return {"forward": figures[0].item(), "backward": figures[1].item()}
