"""The alpha-beta cost model of compute and collectives over a topology.

One module for everything that estimates time, so that what the compiler optimises
(tensor-parallel layouts, routes) is what ``compile`` reports and the simulator predicts.

A message of ``b`` bytes over a link costs ``alpha + b / beta`` (Hockney's model), with
alpha and beta per link type: inside a node and between nodes, from the plan's topology.
A topology measured by ``planc calibrate`` also gives, per link and collective, the bus
bandwidth the backend achieves and a fixed cost per call: NCCL's model has the same
terms (base latency per algorithm, bandwidth per algorithm), and gloo on CPUs needs
them, its reduce_scatter reaching half the bandwidth of its all_reduce.
The routes and their costs follow Thakur, Rabenseifner and Gropp, "Optimization of
Collective Communication Operations in MPICH" (IJHPCA 2005), and the way NCCL chooses an
algorithm per call (``src/graph/tuning.cc``: a base latency per algorithm, a latency per
hop by link type, a bandwidth per algorithm):

- **ring**, the backend's native collective. For ``n`` ranks and a buffer of ``B`` bytes
  (the nccl-tests convention: all_reduce's buffer, the whole gathered or scattered
  buffer), all_reduce takes ``2 (n - 1)`` steps and moves ``2 (n - 1) / n B`` bytes per
  rank, all_gather and reduce_scatter ``n - 1`` steps and ``(n - 1) / n B``. Across nodes
  every step waits for the slowest hop (alpha of the inter-node link) and the bytes
  cross nodes at the node's share of inter-node bandwidth: one NIC per member of the
  group on the node, as NCCL spreads its rings over channels and NICs.
- **tree**, all_reduce only (NCCL has no tree all_gather or reduce_scatter): a binary
  tree inside each node rooted at the node's first member, a binary tree over those
  roots between nodes; reduce up, broadcast down, whole buffer per hop. A parent with
  two children receives ``2 B``. Latency grows with the depth, ``log2 n``, not ``n``;
  bandwidth with the depth too, so trees win small messages (NCCL's double binary tree
  pipelines chunks to hide that; planc's point-to-point tree does not).
- **hierarchical**, for a group with the same number ``L >= 2`` of members on each of
  ``N >= 2`` nodes: all_reduce is a reduce_scatter inside each node, ``L`` concurrent
  all_reduces of ``B / L`` between nodes (one per local position, each on its own NIC),
  an all_gather inside each node. reduce_scatter is the intra-node reduce_scatter then an
  inter-node reduce_scatter of ``B / L``; all_gather the reverse. Only ``B / L`` crosses
  nodes per rank, so a flat ring over ``n = N L`` ranks puts ``(n - 1) / n / ((N - 1) /
  N)`` times the bytes of a hierarchical route on the inter-node link (1.75 for 8 ranks
  on 2 nodes).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import floor, log2

from planc.program.names import Kind
from planc.plan.mesh import Placement, counts_of  # noqa: F401 (API: the cost model's vocabulary)
from planc.program.names import Route  # noqa: F401 (API)
from planc.plan.topology import Link, Topology

POINT_TO_POINT_KINDS = tuple(kind.value for kind in Kind if not kind.is_collective)


# planc writes a recipe for every tree and hierarchical route and proves it computes its
# collective symbolically (planc.verify.routes): a state of members x chunks, so the
# proof of a hierarchical reduce_scatter or all_gather grows with the square of the
# group. Larger groups keep the backend's own algorithm, which scales with them.
MAX_RECIPE_MEMBERS = 1024
TOO_LARGE = (f"planc writes and proves recipes for groups of at most {MAX_RECIPE_MEMBERS:,} "
             f"ranks; larger groups use the backend's own algorithm")


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


def tree_depth(members: int) -> int:
    """Edges from the root to the deepest leaf of a binary heap of ``members`` nodes."""
    return floor(log2(members)) if members > 1 else 0


@dataclass(frozen=True)
class Candidate:
    """One route considered for a transfer: its predicted time, or why it cannot run."""

    route: Route
    seconds: float | None  # None: the route does not apply
    reason: str

    def to_json(self) -> dict:
        return {"route": self.route.value, "seconds": self.seconds, "reason": self.reason}


@dataclass(frozen=True)
class CostModel:
    topology: Topology

    def link(self, crosses_nodes: bool) -> Link:
        return self.topology.inter if crosses_nodes else self.topology.intra

    def compute_seconds(self, flops: float) -> float:
        device = self.topology.device
        return flops / (device.flops * device.efficiency)

    def _hop(self, link: Link, nbytes: float, bandwidth: float | None = None) -> float:
        return link.latency + nbytes / (bandwidth or link.bandwidth)

    @staticmethod
    def _collective(link: Link, kind: str) -> tuple[float, float]:
        """(bus bandwidth, latency per call) of ``kind`` on ``link``: measured by planc
        calibrate where the topology has it, else the link's bandwidth and no extra."""
        tuning = link.tuning(kind)
        return (tuning.bandwidth, tuning.latency) if tuning else (link.bandwidth, 0.0)

    def ring_seconds(self, kind: str, nbytes: float, placement: Placement) -> float:
        """NCCL's ring: a cost per call, a latency per step (the steps inside a node at
        the intra-node link's, those that cross nodes at the network's, as NCCL's tuning
        model counts them), and the buffer's bus bytes at the bandwidth of the narrowest
        part (the node with the fewest members' NICs). Inside a node whose link carries a
        measured size sweep the sweep gives the time whole (its small buffers are the
        latency, its mid-sized ones the channels NCCL has not opened)."""
        if kind in POINT_TO_POINT_KINDS:
            return self._hop(self.link(placement.crosses_nodes), nbytes)
        n = placement.size
        if n <= 1:
            return 0.0
        intra, inter = self.topology.intra, self.topology.inter
        inside, call = self._collective(intra, kind)
        swept = intra.swept(nbytes)
        if swept is not None:
            inside = min(inside, swept)
        moved = bus_factor(kind, n) * nbytes
        if not placement.crosses_nodes:
            if swept is not None:
                return moved / inside
            return call + steps(kind, n) * intra.latency + moved / inside
        between, call = self._collective(inter, kind)
        across = between * max(placement.fewest_per_node, 1)
        beta = min(inside, across) if placement.most_per_node > 1 else across
        network_steps = steps(kind, placement.nodes)
        latency = call + (steps(kind, n) - network_steps) * intra.latency + \
            network_steps * inter.latency
        return latency + moved / beta

    def tree_seconds(self, nbytes: float, placement: Placement) -> float:
        """all_reduce as a reduce up and a broadcast down the two-level binary tree."""
        if placement.size <= 1:
            return 0.0
        intra, inter = self.topology.intra, self.topology.inter
        local = placement.most_per_node

        def level(link: Link, members: int, nics: int) -> float:
            """A hop costs the link's message latency and bandwidth, or what planc
            calibrate measured for a hop of the tree itself."""
            tuning = link.tuning("tree")
            latency, bandwidth = (tuning.latency, tuning.bandwidth) if tuning else \
                (link.latency, link.bandwidth)
            fan = 1 if members <= 2 else 2
            return tree_depth(members) * (latency + fan * nbytes / (bandwidth * nics))

        one_way = level(intra, local, 1)
        if placement.crosses_nodes:
            one_way += level(inter, placement.nodes, placement.fewest_per_node)
        return 2 * one_way

    def hierarchical_seconds(self, kind: str, nbytes: float, placement: Placement) -> float:
        local, nodes = placement.per_node, placement.nodes
        assert local is not None and local > 1 and nodes > 1
        inside = Placement.within_node(local)
        across = Placement(nodes, nodes, 1, 1, 1)
        intra_phase = self.ring_seconds(Kind.REDUCE_SCATTER.value, nbytes, inside)
        if kind == Kind.ALL_REDUCE:
            return 2 * intra_phase + self.ring_seconds(kind, nbytes / local, across)
        return intra_phase + self.ring_seconds(kind, nbytes / local, across)

    def route_time(self, route: str, kind: str, nbytes: float, placement: Placement
                   ) -> float:
        """Seconds of a collective on one group so placed, over ``route`` (which must
        apply: :meth:`candidates` says where it does)."""
        if route == Route.TREE:
            return self.tree_seconds(nbytes, placement)
        if route == Route.HIERARCHICAL:
            return self.hierarchical_seconds(kind, nbytes, placement)
        return self.ring_seconds(kind, nbytes, placement)

    def candidates(self, kind: str, nbytes: float, placement: Placement
                   ) -> list[Candidate]:
        """Every route for a collective of ``kind`` on a group so placed: predicted time,
        or the reason it does not apply."""
        ring = Candidate(Route.RING, self.ring_seconds(kind, nbytes, placement),
                         "the backend's native collective")
        if kind == Kind.ALL_REDUCE and placement.size > MAX_RECIPE_MEMBERS:
            tree = Candidate(Route.TREE, None, TOO_LARGE)
        elif kind == Kind.ALL_REDUCE:
            tree = Candidate(Route.TREE, self.tree_seconds(nbytes, placement),
                             "binary trees inside and between nodes, point to point")
        else:
            tree = Candidate(Route.TREE, None, f"tree applies to all_reduce only (as in "
                                               f"NCCL); {kind} has no tree route")
        if kind not in (Kind.ALL_REDUCE, Kind.ALL_GATHER, Kind.REDUCE_SCATTER):
            reason = f"{kind} has no hierarchical route"
        elif not placement.crosses_nodes:
            reason = "the group lies inside one node"
        elif placement.per_node is None:
            reason = (f"uneven ranks per node ({placement.fewest_per_node} to "
                      f"{placement.most_per_node})")
        elif placement.per_node == 1:
            reason = "one rank per node: the hierarchical route is the flat one"
        elif placement.size > MAX_RECIPE_MEMBERS:
            reason = TOO_LARGE
        else:
            reason = ""
        hierarchical = Candidate(
            Route.HIERARCHICAL,
            None if reason else self.hierarchical_seconds(kind, nbytes, placement),
            reason or f"inside nodes of {placement.per_node}, then between "
                      f"{placement.nodes} nodes")
        return [ring, tree, hierarchical]

    def all_to_all_seconds(self, nbytes: float, placement: Placement) -> float:
        """An all-to-all in which each rank sends ``nbytes`` in all, ``nbytes / n`` to
        every member (itself included), as NCCL runs it: a send and a receive to every
        peer at once (grouped point-to-point), not a ring. A rank's bytes for peers on its
        node cross NVLink, those for other nodes its own NIC (one per GPU), at the same
        time: the slower of the two parts, on the rank that sends the most over it (the
        node with the most members for NVLink, the fewest for the NIC). Each part pays
        its link's latency once, as the sends are in flight together."""
        n = placement.size
        if n <= 1:
            return 0.0
        parts = []
        for link, peers in ((self.topology.intra, placement.most_per_node - 1),
                            (self.topology.inter, n - placement.fewest_per_node)):
            if peers > 0:
                bandwidth, call = self._collective(link, Kind.ALL_TO_ALL.value)
                parts.append(call + link.latency + peers / n * nbytes / bandwidth)
        return max(parts)

    def two_hop_seconds(self, rows_bytes: float, node_bytes: float, placement: Placement
                        ) -> float:
        """A two-hop dispatch or combine (DeepSeek-V3's, section 3.2.2; DeepEP): each
        rank sends ``node_bytes`` in all, one part to its peer at its own place on every
        node (itself included), over its NIC; the peers forward ``rows_bytes`` in all (a
        row per token and rank), one part to every rank of their node, over NVLink. The
        forwarding runs as rows arrive, so the two links work at once: the slower, each
        paying its latency."""
        nodes, per_node = placement.nodes, placement.most_per_node
        parts = []
        for link, share, nbytes in ((self.topology.inter, (nodes - 1) / nodes, node_bytes),
                                    (self.topology.intra, (per_node - 1) / per_node,
                                     rows_bytes)):
            if share > 0:
                bandwidth, call = self._collective(link, Kind.ALL_TO_ALL.value)
                parts.append(call + link.latency + share * nbytes / bandwidth)
        return max(parts, default=0.0)

    def transfer_seconds(self, kind: str, nbytes: float, group_size: int,
                         crosses_nodes: bool) -> float:
        """Ring time of a transfer on a group of ``group_size`` whose placement is known
        only as inside or across nodes (one member per node when across)."""
        placement = Placement(group_size, group_size, 1, 1, 1) if crosses_nodes else \
            Placement.within_node(group_size)
        return self.ring_seconds(kind, nbytes, placement)
