"""Named machines for ``topology { preset = ... }``, from vendors' published figures.

Bandwidths are per device and per direction (NVIDIA quotes NVLink bidirectionally:
600 GB/s on A100 is 300 GB/s each way). Compute is dense tensor-core peak for the
model's dtype (fp32 models use TF32 tensor cores, as PyTorch's matmul does with
``allow_tf32``). Latencies are the per-message start-up cost NCCL achieves on such
links, not the raw hardware figure.
"""

from __future__ import annotations

from dataclasses import dataclass


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


PRESETS: dict[str, Preset] = {
    # NVIDIA DGX A100 datasheet: 8x A100-SXM4-80GB, 312 TFLOP/s BF16/FP16 dense,
    # 156 TFLOP/s TF32 dense, NVLink 3 at 600 GB/s bidirectional per GPU through
    # NVSwitch, 8x 200 Gb/s HDR InfiniBand (one ConnectX-6 per GPU).
    "dgx-a100": Preset("dgx-a100", "NVIDIA DGX A100: 8x A100 80GB, NVLink 3, 8x HDR 200 Gb/s IB",
                       8, {"bf16": 312e12, "fp16": 312e12, "fp32": 156e12}, 80e9, 0.5,
                       300e9, 2e-6, 25e9, 5e-6),
    # NVIDIA DGX H100 datasheet: 8x H100-SXM5-80GB, 989 TFLOP/s BF16/FP16 dense,
    # 494 TFLOP/s TF32 dense, NVLink 4 at 900 GB/s bidirectional per GPU, 8x 400 Gb/s
    # NDR InfiniBand (ConnectX-7).
    "dgx-h100": Preset("dgx-h100", "NVIDIA DGX H100: 8x H100 80GB, NVLink 4, 8x NDR 400 Gb/s IB",
                       8, {"bf16": 989e12, "fp16": 989e12, "fp32": 494e12}, 80e9, 0.5,
                       450e9, 2e-6, 50e9, 5e-6),
    # One gloo process per socket of a dual-socket x86 server (32 cores at 2 GHz with
    # AVX-512: 32 x 2e9 x 32 fp32 FLOP/cycle = 2 TFLOP/s; bf16 is no faster on most
    # CPUs), shared memory inside a host, 25 Gb/s Ethernet between hosts.
    "cpu": Preset("cpu", "CPU servers running gloo: 2 TFLOP/s per process, 25 Gb/s Ethernet",
                  None, {"bf16": 2e12, "fp16": 2e12, "fp32": 2e12}, 256e9, 0.5,
                  10e9, 10e-6, 3.125e9, 50e-6),
}

# The topology of a plan that says nothing about it: one node, generic links, and no
# memory limit (planc will not guess a capacity to warn against).
GENERIC = Preset("generic", "one node, generic links", None,
                 {"bf16": 100e12, "fp16": 100e12, "fp32": 50e12}, None, 0.5,
                 100e9, 5e-6, 12.5e9, 10e-6)
