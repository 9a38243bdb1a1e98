"""What the derivation's walks over one chunk hand on: the forward walk to the backward
walk of the same chunk, and to the parameters' half (:mod:`planc.graph.parameters`)."""

from __future__ import annotations

from dataclasses import dataclass

from planc.graph.ir import Port
from planc.graph.sharding import Layout


@dataclass(frozen=True)
class Link:
    """A forward data edge, remembered to derive its backward twin."""

    producer: str  # node id: a compute node, or the pipeline receive that starts a chunk
    consumer: str
    tensor: str
    source: Layout  # producer's output layout over tp
    target: Layout  # consumer's input layout over tp
    grad: Layout  # layout of the gradient the consumer returns for this input
    layer: int | None
    ops: tuple[str, str]  # (producer, consumer) operator names
    port: Port = Port.X  # the consumer's input
    within_layer: bool = False  # both ends belong to ``layer`` (recomputed together)
