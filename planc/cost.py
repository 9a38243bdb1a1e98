"""The alpha-beta cost model of compute and collectives over a topology.

One module for everything that estimates time, so that what the compiler optimises
(layout choices, routes) is what the simulator predicts.

Collectives follow the ring algorithms whose costs NCCL documents (nccl-tests,
PERFORMANCE.md): for a group of n ranks and a buffer of B bytes per rank,
all_reduce moves 2 (n - 1) / n B bytes per rank in 2 (n - 1) steps, all_gather and
reduce_scatter (n - 1) / n B in n - 1 steps, all_to_all (n - 1) / n B, and a
point-to-point transfer B in one step. A step costs the link latency alpha and a
byte 1 / beta, beta being the bandwidth of the slowest link the group crosses.
"""

from __future__ import annotations

from dataclasses import dataclass

from planc.graph.ir import Kind
from planc.plan import Link, Topology

POINT_TO_POINT_KINDS = tuple(kind.value for kind in Kind if not kind.is_collective)


def bus_factor(kind: str, group_size: int) -> float:
    """Bytes each rank moves per byte of its buffer (nccl-tests' 'bus bandwidth' factor)."""
    n = group_size
    if n <= 1:
        return 0.0
    if kind == "all_reduce":
        return 2 * (n - 1) / n
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0  # broadcast (pipelined ring), send, recv


def steps(kind: str, group_size: int) -> int:
    """Latency-bound steps of the ring algorithm."""
    n = group_size
    if kind in POINT_TO_POINT_KINDS:
        return 1
    if n <= 1:
        return 0
    return 2 * (n - 1) if kind == "all_reduce" else n - 1


@dataclass(frozen=True)
class CostModel:
    topology: Topology

    def link(self, crosses_nodes: bool) -> Link:
        return self.topology.inter if crosses_nodes else self.topology.intra

    def compute_seconds(self, flops: float) -> float:
        device = self.topology.device
        return flops / (device.flops * device.efficiency)

    def transfer_seconds(self, kind: str, nbytes: float, group_size: int,
                         crosses_nodes: bool) -> float:
        """Ring-algorithm time of one transfer; ``nbytes`` in the nccl-tests convention."""
        if group_size <= 1 and kind not in POINT_TO_POINT_KINDS:
            return 0.0
        link = self.link(crosses_nodes)
        return (steps(kind, group_size) * link.latency
                + bus_factor(kind, group_size) * nbytes / link.bandwidth)
