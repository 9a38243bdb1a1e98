"""Named machines for ``topology { preset = ... }``, from vendors' published figures.

Bandwidths are per device and per direction (NVIDIA quotes NVLink bidirectionally:
600 GB/s on A100 is 300 GB/s each way), at what the communication library achieves on
the link (NCCL's figures for the GPUs, below), not its line rate. Compute is the dense
peak for the model's dtype: the tensor cores' for bf16, fp16 and fp8, and the FP32 cores'
for fp32, since PyTorch runs an fp32 matmul in full FP32 unless told to use TF32
(``torch.backends.cuda.matmul.allow_tf32``, False by default) and planc run does not tell
it. Latencies are the per-message start-up cost NCCL achieves on such links, not the raw
hardware figure.
"""

from __future__ import annotations

from dataclasses import dataclass

from planc.plan.topology import TUNED_COLLECTIVES, Device, Link, Topology, Tuning
from planc.vocabulary.units import MAX_RATE, MAX_SECONDS
from planc.vocabulary.versions import is_version


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    devices_per_node: int | None  # None: one node holds the whole world
    flops: dict[str, float]  # dtype -> peak FLOP/s
    memory: float | None  # bytes
    efficiency: float
    intra_bandwidth: float
    intra_latency: float
    inter_bandwidth: float
    inter_latency: float
    intra_collectives: tuple[Tuning, ...] = ()  # measured by planc calibrate
    inter_collectives: tuple[Tuning, ...] = ()
    memory_bandwidth: float = 1e12  # bytes/s of the device's memory
    overlap: float = 1.0  # fraction of a collective hidden behind compute (Device.overlap)
    overhead: float = 0.0  # seconds per compute instruction (Device.overhead; calibrated)
    intra_sweep: tuple[tuple[float, float], ...] = ()  # Link.sweep
    backward_overhead: float | None = None  # Device.backward_overhead (calibrated)
    handoff: float = 0.0  # seconds per transfer (Device.handoff; calibrated)
    overheads: tuple[tuple[str, float, float], ...] = ()  # Device.overheads (calibrated)
    exp_rate: float | None = None  # exponentials a second (Device.exp_rate; calibrated)

    def topology(self, nodes: int, dtype: str = "fp32") -> Topology:
        """The preset's machine with ``nodes`` nodes, every figure as measured."""
        per_node = self.devices_per_node or 1
        return Topology(nodes, per_node, Device(self.flops[dtype], self.memory,
                                                self.efficiency, self.memory_bandwidth,
                                                self.overlap, self.overhead,
                                                self.backward_overhead, self.handoff,
                                                self.overheads, exp_rate=self.exp_rate),
                        Link(self.intra_bandwidth, self.intra_latency, self.intra_collectives,
                             self.intra_sweep),
                        Link(self.inter_bandwidth, self.inter_latency, self.inter_collectives),
                        self.name)


# What NCCL achieves on these machines (the model of planc.estimate.cost prices collectives with
# them, not with the links' line rates):
# - Inside a node, the bus bandwidth of a ring: "~230GB/s" on A100's NVLink 3 (line rate
#   240 GB/s of payload; NCCL maintainer, NVIDIA/nccl-tests issue 149) and "370GB/s" on
#   H100's NVLink 4 (450 GB/s line rate less ~20 % protocol overhead; nccl-tests issue
#   212); an H100 all_reduce runs NVLink SHARP, "peak busBw of ~480GB/s" (same issue).
# - How much of that plateau a buffer reaches: Microsoft's published all_reduce sweeps
#   inside one 8-GPU VM (Azure/AI-benchmarking-guide, nccl-tests in place, 1 KB to 8 GB),
#   NCCL 2.18.5 on ND A100 v4 (A100-SXM4-80GB) and NCCL 2.20.5 on ND H200 v5, whose
#   NVLink 4 and NVSwitch are the DGX H100's. A tensor-parallel all_reduce of 50 MB
#   reaches about 150 of A100's 230 GB/s.
# - Between nodes, "46-48GB/s per NIC" for NDR 400 Gb/s InfiniBand (nccl-tests issue
#   290): 47 GB/s, 94 % of the line rate; HDR 200 Gb/s is taken at the same 94 % of its
#   25 GB/s (no published figure found).
# - Latencies from NCCL's own tuning model (src/graph/tuning.cc, commit 01afd20, ring with
#   the Simple protocol that large buffers use): 8.4 us per call (baseLat), 3.4 us per
#   NVLink step and 9.6 us per network step (hwLat).
NCCL_CALL_LATENCY = 8.4e-6
NVLINK_STEP_LATENCY = 3.4e-6
NETWORK_STEP_LATENCY = 9.6e-6
KIB, MIB, GIB = 1024, 1024 ** 2, 1024 ** 3


def _sweep(points) -> tuple[tuple[float, float], ...]:
    """A published sweep's (buffer bytes, bus GB/s) points as (bytes, bytes/s)."""
    return tuple((size, busbw * 1e9) for size, busbw in points)


A100_SWEEP = _sweep((
    (KIB, 0.04), (2 * KIB, 0.08), (4 * KIB, 0.17), (8 * KIB, 0.33), (16 * KIB, 0.67),
    (32 * KIB, 1.37), (64 * KIB, 2.70), (128 * KIB, 5.15), (256 * KIB, 10.11),
    (512 * KIB, 19.24), (MIB, 36.22), (2 * MIB, 53.54), (4 * MIB, 71.43),
    (8 * MIB, 89.99), (16 * MIB, 109.22), (32 * MIB, 132.77), (64 * MIB, 166.63),
    (128 * MIB, 174.18), (256 * MIB, 213.87), (512 * MIB, 221.58), (GIB, 228.10),
    (2 * GIB, 230.22), (4 * GIB, 230.48), (8 * GIB, 231.58)))
H200_SWEEP = _sweep((
    (KIB, 0.06), (2 * KIB, 0.12), (4 * KIB, 0.23), (8 * KIB, 0.47), (16 * KIB, 0.93),
    (32 * KIB, 1.84), (64 * KIB, 3.72), (128 * KIB, 7.39), (256 * KIB, 14.75),
    (512 * KIB, 29.38), (MIB, 52.96), (2 * MIB, 88.78), (4 * MIB, 138.44),
    (8 * MIB, 181.94), (16 * MIB, 240.41), (32 * MIB, 300.91), (64 * MIB, 368.11),
    (128 * MIB, 412.45), (256 * MIB, 432.24), (512 * MIB, 442.72), (GIB, 467.58),
    (2 * GIB, 472.57), (4 * GIB, 477.41), (8 * GIB, 479.98)))
NETWORK_EFFICIENCY = 47 / 50


def _nccl(bandwidth: float, all_reduce: float | None = None) -> tuple[Tuning, ...]:
    """NCCL's collectives on a link of ring bus ``bandwidth`` (``all_reduce``: where it
    runs another algorithm, NVLink SHARP), each with NCCL's cost per call."""
    return tuple(Tuning(kind, all_reduce if kind == "all_reduce" and all_reduce else
                        bandwidth, NCCL_CALL_LATENCY)
                 for kind in ("all_reduce", "reduce_scatter", "all_gather"))


PRESETS: dict[str, Preset] = {
    # NVIDIA DGX A100 datasheet: 8x A100-SXM4-80GB, 312 TFLOP/s BF16/FP16 dense,
    # 19.5 TFLOP/s FP32 (156 TFLOP/s TF32 dense, unused: above), 2,039 GB/s of HBM2e,
    # NVLink 3 at 600 GB/s bidirectional per GPU through NVSwitch, 8x 200 Gb/s HDR
    # InfiniBand (one ConnectX-6 per GPU); the links at what NCCL achieves on them
    # (above). Efficiency 0.8: what cuBLAS reaches on large GEMMs
    # (planc.estimate.kernel_cost's ``large``), for the estimates that price compute with
    # one figure (compile's, the tensor-parallel chooser's, tune's bound).
    "dgx-a100": Preset("dgx-a100", "NVIDIA DGX A100: 8x A100 80GB, NVLink 3, 8x HDR 200 Gb/s IB",
                       8, {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12}, 80e9, 0.8,
                       230e9, NVLINK_STEP_LATENCY, 25e9 * NETWORK_EFFICIENCY,
                       NETWORK_STEP_LATENCY, _nccl(230e9), _nccl(25e9 * NETWORK_EFFICIENCY),
                       memory_bandwidth=2.039e12, intra_sweep=A100_SWEEP),
    # NVIDIA DGX H100 datasheet: 8x H100-SXM5-80GB, 989 TFLOP/s BF16/FP16 dense,
    # 1,979 TFLOP/s FP8 dense (3,958 with sparsity), 67 TFLOP/s FP32 (494 TFLOP/s TF32
    # dense, unused: above), 3.35 TB/s of HBM3, NVLink 4 at 900 GB/s bidirectional per
    # GPU, 8x 400 Gb/s NDR InfiniBand (ConnectX-7); the links as NCCL achieves them.
    # Efficiency 0.79: cuBLAS's large-GEMM rate measured on an H100
    # (planc.estimate.kernel_cost). The A100 above has no FP8
    # tensor cores, so its table has no "fp8" (model { fp8 } is refused there).
    "dgx-h100": Preset("dgx-h100", "NVIDIA DGX H100: 8x H100 80GB, NVLink 4, 8x NDR 400 Gb/s IB",
                       8, {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12, "fp8": 1979e12},
                       80e9, 0.79,
                       370e9, NVLINK_STEP_LATENCY, 50e9 * NETWORK_EFFICIENCY,
                       NETWORK_STEP_LATENCY, _nccl(370e9, all_reduce=480e9),
                       _nccl(50e9 * NETWORK_EFFICIENCY),
                       memory_bandwidth=3.35e12, intra_sweep=H200_SWEEP),
    # One gloo process per socket of a dual-socket x86 server (32 cores at 2 GHz with
    # AVX-512: 32 x 2e9 x 32 fp32 FLOP/cycle = 2 TFLOP/s; bf16 is no faster on most
    # CPUs), eight DDR4-3200 channels per socket (205 GB/s), shared memory inside a
    # host, 25 Gb/s Ethernet between hosts. A gloo collective runs on the cores that
    # torch's GEMM threads already fill, so none of it hides behind compute.
    "cpu": Preset("cpu", "CPU servers running gloo: 2 TFLOP/s per process, 25 Gb/s Ethernet",
                  None, {"bf16": 2e12, "fp16": 2e12, "fp32": 2e12}, 256e9, 0.5,
                  10e9, 10e-6, 3.125e9, 50e-6, memory_bandwidth=205e9, overlap=0.0),
}

# Machines whose GPUs have no FP8 tensor cores, where model { fp8 } is refused (the A100's
# datasheet lists no FP8 rate); on CPUs planc emulates FP8, so the cpu preset takes it.
WITHOUT_FP8 = frozenset({"dgx-a100"})

# The topology of a plan that says nothing about it: one node, generic links, and no
# memory limit (planc will not guess a capacity to warn against).
GENERIC = Preset("generic", "one node, generic links", None,
                 {"bf16": 100e12, "fp16": 100e12, "fp32": 50e12}, None, 0.5,
                 100e9, 5e-6, 12.5e9, 10e-6)


# --- calibrated topologies: `planc calibrate` writes them, `preset = "FILE"` reads them ---

CALIBRATED_FORMAT, CALIBRATED_VERSION = "planc-topology", 1


def calibrated_document(name: str, devices_per_node: int, flops: float, intra: dict,
                        inter: dict, measured: dict, memory_bandwidth: float,
                        overlap: float, overhead: float = 0.0,
                        backward_overhead: float | None = None, handoff: float = 0.0,
                        overheads: dict[str, dict[str, float]] | None = None,
                        exp_rate: float | None = None) -> dict:
    """The JSON of a measured machine. A link is ``{"bandwidth": B/s, "latency": s,
    "collectives": {kind: {"bandwidth": bus B/s, "latency": s per call}}}``: the
    point-to-point figures, and what the backend achieves for each collective (``tree``:
    per hop of planc's point-to-point tree). ``overheads``: by operator, its
    instructions' fixed cost, ``{"forward": s, "gradient": s}`` (Device.overheads);
    ``exp_rate``: exponentials a second (Device.exp_rate)."""
    return {"format": CALIBRATED_FORMAT, "version": CALIBRATED_VERSION, "name": name,
            "devices_per_node": devices_per_node,
            "device": {"flops": flops, "memory": None, "efficiency": 1.0,
                       "bandwidth": memory_bandwidth, "overlap": overlap,
                       "overhead": overhead,
                       **({} if backward_overhead is None else
                          {"backward_overhead": backward_overhead}),
                       "handoff": handoff,
                       **({} if not overheads else {"overheads": overheads}),
                       **({} if exp_rate is None else {"exp_rate": exp_rate})},
            "intra": intra, "inter": inter, "measured": measured}


# What a calibrated figure may be: a rate (FLOP/s, bytes/s, bytes) from 1 to 1e30, a time
# (seconds) up to an hour, as a plan's own (planc.vocabulary.units.RANGES). Beyond them a
# step's time is no longer a finite number (a bandwidth of 5e-324 B/s) and nothing
# calibrate measures lies there.
def _number(value, what: str, positive: bool = True,
            within: tuple[float, float] | None = None) -> float:
    """A rate (``positive``: from 1 to MAX_RATE) or a time in seconds (from 0 to
    MAX_SECONDS) of a calibrated topology, or a figure ``within`` (low, high)."""
    low, high = within or ((1.0, MAX_RATE) if positive else (0.0, MAX_SECONDS))
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or \
            not low <= value <= high:
        raise ValueError(f"{what} must be a number from {low:g} to {high:g}")
    return float(value)


def _link(data: dict, block: str) -> tuple[float, float, tuple[Tuning, ...]]:
    link = data.get(block)
    if not isinstance(link, dict):
        raise ValueError(f"it has no {block} link")
    table = link.get("collectives", {})
    if not isinstance(table, dict):
        raise ValueError(f"{block}.collectives must be an object")
    tunings = []
    for kind, figures in sorted(table.items()):
        if kind not in TUNED_COLLECTIVES:
            raise ValueError(f"{block}.collectives names {kind!r}; it holds all_reduce, "
                             f"reduce_scatter, all_gather and tree")
        if not isinstance(figures, dict):
            raise ValueError(f"{block}.collectives.{kind} must be an object")
        where = f"{block}.collectives.{kind}"
        tunings.append(Tuning(kind, _number(figures.get("bandwidth"), f"{where}.bandwidth"),
                              _number(figures.get("latency"), f"{where}.latency", False)))
    return (_number(link.get("bandwidth"), f"{block}.bandwidth"),
            _number(link.get("latency"), f"{block}.latency", False), tuple(tunings))


MAX_OPERATORS = 64  # far more than any family has (planc.graph.vocabulary.Op)


def _overheads(table) -> tuple[tuple[str, float, float], ...]:
    """``device.overheads``: operator -> {"forward": s, "gradient": s}, checked."""
    if not isinstance(table, dict):
        raise ValueError("device.overheads must be an object")
    if len(table) > MAX_OPERATORS:
        raise ValueError(f"device.overheads names {len(table)} operators; at most "
                         f"{MAX_OPERATORS}")
    out = []
    for kernel, figures in sorted(table.items()):
        if not kernel.isidentifier() or len(kernel) > 64:
            raise ValueError(f"device.overheads names {kernel[:64]!r}, not an operator")
        if not isinstance(figures, dict) or set(figures) != {"forward", "gradient"}:
            raise ValueError(f"device.overheads.{kernel} must hold forward and gradient")
        out.append((kernel, _number(figures["forward"],
                                    f"device.overheads.{kernel}.forward", False),
                    _number(figures["gradient"], f"device.overheads.{kernel}.gradient",
                            False)))
    return tuple(out)


def calibrated_preset(data, name: str) -> Preset:
    """A Preset from a calibrated topology document; ValueError says what is wrong."""
    if not isinstance(data, dict) or data.get("format") != CALIBRATED_FORMAT:
        raise ValueError("it is not a planc topology (planc calibrate writes them)")
    if not is_version(data.get("version"), CALIBRATED_VERSION):
        raise ValueError(f"it is version {data.get('version')!r} of the topology format; "
                         f"this planc reads version {CALIBRATED_VERSION}")
    per_node = data.get("devices_per_node")
    if isinstance(per_node, bool) or not isinstance(per_node, int) or per_node < 1:
        raise ValueError("devices_per_node must be a positive integer")
    device = data.get("device")
    if not isinstance(device, dict):
        raise ValueError("it has no device")
    flops = _number(device.get("flops"), "device.flops")
    bandwidth = _number(device.get("bandwidth", 1e12), "device.bandwidth")
    efficiency = _number(device.get("efficiency"), "device.efficiency", within=(1e-6, 1.0))
    memory = device.get("memory")
    if memory is not None:
        memory = _number(memory, "device.memory")
    # Topologies calibrated before overlap was measured: the Device default.
    overlap = _number(device.get("overlap", 1.0), "device.overlap", within=(0.0, 1.0))
    # Topologies calibrated before the overhead was measured: none.
    overhead = _number(device.get("overhead", 0.0), "device.overhead", False)
    # Before the backward's own overhead was measured, "overhead" was the mean of the
    # two, for every instruction; before the hand-off was measured: none.
    backward_overhead = device.get("backward_overhead")
    if backward_overhead is not None:
        backward_overhead = _number(backward_overhead, "device.backward_overhead", False)
    handoff = _number(device.get("handoff", 0.0), "device.handoff", False)
    overheads = _overheads(device.get("overheads", {}))  # none before they were measured
    exp_rate = device.get("exp_rate")  # none before it was measured
    if exp_rate is not None:
        exp_rate = _number(exp_rate, "device.exp_rate")
    intra, inter = _link(data, "intra"), _link(data, "inter")
    return Preset(name, str(data.get("name", name)), per_node,
                  {"bf16": flops, "fp16": flops, "fp32": flops}, memory, efficiency,
                  intra[0], intra[1], inter[0], inter[1], intra[2], inter[2], bandwidth,
                  overlap, overhead, backward_overhead=backward_overhead, handoff=handoff,
                  overheads=overheads, exp_rate=exp_rate)
