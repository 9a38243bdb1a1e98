"""Named machines for ``topology { preset = ... }``, from vendors' published figures.

Bandwidths are per device and per direction (NVIDIA quotes NVLink bidirectionally:
600 GB/s on A100 is 300 GB/s each way). Compute is dense tensor-core peak for the
model's dtype (fp32 models use TF32 tensor cores, as PyTorch's matmul does with
``allow_tf32``). Latencies are the per-message start-up cost NCCL achieves on such
links, not the raw hardware figure.
"""

from __future__ import annotations

from dataclasses import dataclass

from planc.plan import Device, Link, Topology, Tuning


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

    def topology(self, nodes: int, dtype: str = "fp32") -> Topology:
        """The preset's machine with ``nodes`` nodes, every figure as measured."""
        per_node = self.devices_per_node or 1
        return Topology(nodes, per_node, Device(self.flops[dtype], self.memory,
                                                self.efficiency, self.memory_bandwidth,
                                                self.overlap, self.overhead),
                        Link(self.intra_bandwidth, self.intra_latency, self.intra_collectives),
                        Link(self.inter_bandwidth, self.inter_latency, self.inter_collectives),
                        self.name)


PRESETS: dict[str, Preset] = {
    # NVIDIA DGX A100 datasheet: 8x A100-SXM4-80GB, 312 TFLOP/s BF16/FP16 dense,
    # 156 TFLOP/s TF32 dense, 2,039 GB/s of HBM2e, NVLink 3 at 600 GB/s bidirectional
    # per GPU through NVSwitch, 8x 200 Gb/s HDR InfiniBand (one ConnectX-6 per GPU).
    # Efficiency 0.6: the one figure for A100 with which planc simulate's step times
    # fall within 19 % of Korthikanti et al. 2022, Table 5 (tests/test_simulate.py).
    "dgx-a100": Preset("dgx-a100", "NVIDIA DGX A100: 8x A100 80GB, NVLink 3, 8x HDR 200 Gb/s IB",
                       8, {"bf16": 312e12, "fp16": 312e12, "fp32": 156e12}, 80e9, 0.6,
                       300e9, 2e-6, 25e9, 5e-6, memory_bandwidth=2.039e12),
    # NVIDIA DGX H100 datasheet: 8x H100-SXM5-80GB, 989 TFLOP/s BF16/FP16 dense,
    # 494 TFLOP/s TF32 dense, 3.35 TB/s of HBM3, NVLink 4 at 900 GB/s bidirectional per
    # GPU, 8x 400 Gb/s NDR InfiniBand (ConnectX-7).
    "dgx-h100": Preset("dgx-h100", "NVIDIA DGX H100: 8x H100 80GB, NVLink 4, 8x NDR 400 Gb/s IB",
                       8, {"bf16": 989e12, "fp16": 989e12, "fp32": 494e12}, 80e9, 0.5,
                       450e9, 2e-6, 50e9, 5e-6, memory_bandwidth=3.35e12),
    # One gloo process per socket of a dual-socket x86 server (32 cores at 2 GHz with
    # AVX-512: 32 x 2e9 x 32 fp32 FLOP/cycle = 2 TFLOP/s; bf16 is no faster on most
    # CPUs), eight DDR4-3200 channels per socket (205 GB/s), shared memory inside a
    # host, 25 Gb/s Ethernet between hosts. A gloo collective runs on the cores that
    # torch's GEMM threads already fill, so none of it hides behind compute.
    "cpu": Preset("cpu", "CPU servers running gloo: 2 TFLOP/s per process, 25 Gb/s Ethernet",
                  None, {"bf16": 2e12, "fp16": 2e12, "fp32": 2e12}, 256e9, 0.5,
                  10e9, 10e-6, 3.125e9, 50e-6, memory_bandwidth=205e9, overlap=0.0),
}

# The topology of a plan that says nothing about it: one node, generic links, and no
# memory limit (planc will not guess a capacity to warn against).
GENERIC = Preset("generic", "one node, generic links", None,
                 {"bf16": 100e12, "fp16": 100e12, "fp32": 50e12}, None, 0.5,
                 100e9, 5e-6, 12.5e9, 10e-6)


# --- calibrated topologies: `planc calibrate` writes them, `preset = "FILE"` reads them ---

CALIBRATED_FORMAT, CALIBRATED_VERSION = "planc-topology", 1


def calibrated_document(name: str, devices_per_node: int, flops: float, intra: dict,
                        inter: dict, measured: dict, memory_bandwidth: float,
                        overlap: float, overhead: float = 0.0) -> dict:
    """The JSON of a measured machine. A link is ``{"bandwidth": B/s, "latency": s,
    "collectives": {kind: {"bandwidth": bus B/s, "latency": s per call}}}``: the
    point-to-point figures, and what the backend achieves for each collective (``tree``:
    per hop of planc's point-to-point tree)."""
    return {"format": CALIBRATED_FORMAT, "version": CALIBRATED_VERSION, "name": name,
            "devices_per_node": devices_per_node,
            "device": {"flops": flops, "memory": None, "efficiency": 1.0,
                       "bandwidth": memory_bandwidth, "overlap": overlap,
                       "overhead": overhead},
            "intra": intra, "inter": inter, "measured": measured}


def _number(value, what: str, positive: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or \
            not (value > 0 if positive else value >= 0) or value == float("inf"):
        raise ValueError(f"{what} must be a {'positive' if positive else 'non-negative'} "
                         f"number")
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
        if kind not in ("all_reduce", "reduce_scatter", "all_gather", "tree"):
            raise ValueError(f"{block}.collectives names {kind!r}; it holds all_reduce, "
                             f"reduce_scatter, all_gather and tree")
        if not isinstance(figures, dict):
            raise ValueError(f"{block}.collectives.{kind} must be an object")
        where = f"{block}.collectives.{kind}"
        tunings.append(Tuning(kind, _number(figures.get("bandwidth"), f"{where}.bandwidth"),
                              _number(figures.get("latency"), f"{where}.latency", False)))
    return (_number(link.get("bandwidth"), f"{block}.bandwidth"),
            _number(link.get("latency"), f"{block}.latency", False), tuple(tunings))


def calibrated_preset(data, name: str) -> Preset:
    """A Preset from a calibrated topology document; ValueError says what is wrong."""
    if not isinstance(data, dict) or data.get("format") != CALIBRATED_FORMAT:
        raise ValueError("it is not a planc topology (planc calibrate writes them)")
    if data.get("version") != CALIBRATED_VERSION:
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
    efficiency = _number(device.get("efficiency"), "device.efficiency")
    if efficiency > 1:
        raise ValueError("device.efficiency must be at most 1")
    memory = device.get("memory")
    if memory is not None:
        memory = _number(memory, "device.memory")
    # Topologies calibrated before overlap was measured: the Device default.
    overlap = _number(device.get("overlap", 1.0), "device.overlap", False)
    if overlap > 1:
        raise ValueError("device.overlap must be at most 1")
    # Topologies calibrated before the overhead was measured: none.
    overhead = _number(device.get("overhead", 0.0), "device.overhead", False)
    intra, inter = _link(data, "intra"), _link(data, "inter")
    return Preset(name, str(data.get("name", name)), per_node,
                  {"bf16": flops, "fp16": flops, "fp32": flops}, memory, efficiency,
                  intra[0], intra[1], inter[0], inter[1], intra[2], inter[2], bandwidth,
                  overlap, overhead)
