"""Where a plan runs: its devices, the links between them and what a backend achieves on
them, in SI units (FLOP/s, bytes, bytes/s, seconds). The topology block's values, presets
applied (planc.plan.presets), as a :class:`planc.plan.plan.Plan` holds them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Device:
    flops: float  # peak FLOP/s at the model's dtype
    memory: float | None  # bytes; None when the topology does not say
    efficiency: float = 0.5  # achievable fraction of peak
    bandwidth: float = 1e12  # memory bytes/s, for operators bound by memory traffic
    # Fraction of a collective's time that can run hidden behind a GEMM: 1 where the
    # network has its own engines (NCCL's kernels beside cuBLAS's), 0 where the
    # collective needs the cores the GEMM already fills (gloo on a CPU).
    overlap: float = 1.0
    # Seconds every compute instruction costs beyond its arithmetic and memory traffic:
    # on a CPU the Python and dispatch of the runtime's step (planc calibrate measures
    # it); 0 for the GPU presets, whose launch cost the kernel model prices. A backward
    # step (its input half, its weight half or both) asks autograd for gradients, which
    # costs several times a forward: ``backward_overhead`` (None: ``overhead``).
    overhead: float = 0.0
    backward_overhead: float | None = None
    # Seconds a transfer costs its rank beyond the backend's time: on a CPU the runtime
    # hands it from the compute stream's thread to its own and the result back (planc
    # calibrate measures that round trip); 0 on a GPU, where streams need no threads.
    handoff: float = 0.0
    # The fixed cost by operator, where planc calibrate measured it on the runtime's own
    # instructions: (kernel, forward seconds, gradient step seconds), sorted by kernel.
    # An operator it did not measure costs ``overhead`` / ``backward_overhead``.
    overheads: tuple[tuple[str, float, float], ...] = field(
        default=(), metadata={"omitted_when_default": True})
    # Whether ``flops`` is a machine's own peak (a preset's, a calibrated machine's or one
    # the plan writes). A plan that names no machine is priced on a generic one, whose
    # peak is no device's: planc run reports no MFU against it.
    peak_known: bool = field(default=True, metadata={"omitted_when_default": True})
    # Exponentials a second (planc calibrate measures them on a CPU): a loss's pass that
    # exponentiates every logit, or an activation's tanh or sigmoid, costs that much more
    # arithmetic than its FLOPs say, as an exponential costs a CPU core tens of
    # operations (planc.estimate.roofline.transcendentals). None: priced by its FLOPs
    # alone, as on every GPU preset, whose kernel model prices them by their bytes.
    exp_rate: float | None = field(default=None, metadata={"omitted_when_default": True})

    @property
    def gradient_step_overhead(self) -> float:
        """Seconds a backward step (or either half of a split one) costs beyond its
        arithmetic: ``backward_overhead``, or ``overhead`` where none was measured."""
        return self.overhead if self.backward_overhead is None else self.backward_overhead

    def instruction_overhead(self, kernel: str | None, gradient: bool) -> float:
        """Seconds a compute instruction of ``kernel`` costs beyond its arithmetic: the
        operator's measured figure, else the device's; ``gradient``: a backward step or
        either half of a split one."""
        for name, forward, backward in self.overheads:
            if name == kernel:
                return backward if gradient else forward
        return self.gradient_step_overhead if gradient else self.overhead


# The collectives a link's measured figures may name (planc calibrate's "tree" is its
# tree all-reduce).
TUNED_COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "tree")


@dataclass(frozen=True)
class Tuning:
    """What a backend achieves for one collective on a link, as ``planc calibrate``
    measured it: its bus bandwidth and the fixed cost of a call (the base latency per
    algorithm of NCCL's tuning model, src/graph/tuning.cc)."""

    kind: str  # all_reduce, reduce_scatter, all_gather
    bandwidth: float  # bytes/s, bus bandwidth (nccl-tests' convention)
    latency: float  # seconds per call, beside the link's latency per step


@dataclass(frozen=True)
class Link:
    bandwidth: float  # bytes/s per device, one direction
    latency: float  # seconds per message (one step of a ring, one hop of a tree)
    collectives: tuple[Tuning, ...] = ()  # measured figures per collective, if any
    # A measured all_reduce size sweep inside a node (nccl-tests: buffer bytes, bus
    # bandwidth), in increasing size: a collective of a mid-sized buffer reaches only
    # part of the plateau (NCCL opens fewer channels and cannot fill its pipeline).
    sweep: tuple[tuple[float, float], ...] = ()

    def tuning(self, kind: str) -> Tuning | None:
        return next((t for t in self.collectives if t.kind == kind), None)

    def swept(self, nbytes: float) -> float | None:
        """The bus bandwidth an all_reduce of an ``nbytes`` buffer reached in the sweep
        (log-linear between its sizes; below the smallest, latency-bound: the time of the
        smallest; above the largest, its plateau); None without a sweep."""
        if not self.sweep:
            return None
        if nbytes >= self.sweep[-1][0]:
            return self.sweep[-1][1]
        if nbytes <= self.sweep[0][0]:
            size, busbw = self.sweep[0]
            return max(nbytes, 1.0) / size * busbw
        for (a, fa), (b, fb) in zip(self.sweep, self.sweep[1:]):
            if nbytes <= b:
                t = (math.log2(nbytes) - math.log2(a)) / (math.log2(b) - math.log2(a))
                return fa + t * (fb - fa)
        return self.sweep[-1][1]


@dataclass(frozen=True)
class Topology:
    nodes: int
    devices_per_node: int
    device: Device
    intra: Link
    inter: Link
    preset: str | None = None

    def node_of(self, rank: int) -> int:
        return rank // self.devices_per_node
