"""What the derivation's walks over one chunk hand on.

The forward walk of a chunk returns a :class:`ForwardChunk`: its steps, its data edges
and how it joins its neighbours; the backward walk of that chunk reads it, and returns a
:class:`BackwardChunk` for the backward walk of the chunk before it and for the
parameters' half (:mod:`planc.graph.parameters`). Nothing else passes between walks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from planc.graph.ir import Port
from planc.graph.sharding import Layout


class Held(NamedTuple):
    """A value in flight between operators: the operator that made it and the node
    that holds it (that operator's step, or the pipeline receive that brought it)."""

    op: str
    node: str


class Step(NamedTuple):
    """One operator's forward step on a chunk."""

    node: str
    op: str
    layer: int | None  # None outside the transformer layers (embedding, head)


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


@dataclass(frozen=True)
class ForwardChunk:
    """One chunk's forward walk, as its backward walk and its parameters read it."""

    chunk: int
    steps: tuple[Step, ...]  # in the order made
    links: tuple[Link, ...]  # in the order made
    entry: Held | None  # what it reads from the chunk before; None on chunk 0
    output: Step | None  # the step whose output the next chunk reads; None on the last
    # What the next chunk reads: that output itself when the two share a stage, else the
    # pipeline receive that brings it; None on the last chunk.
    next_entry: Held | None
    # (layer, operator) -> forward node: the backward walk finds a layer's steps by what
    # they are, not by their ids
    by_operator: Mapping[tuple[int | None, str], str] = field(init=False, repr=False,
                                                             compare=False)

    def __post_init__(self) -> None:
        index = {(step.layer, step.op): step.node for step in self.steps}
        object.__setattr__(self, "by_operator", index)

    def node(self, layer: int | None, op: str) -> str:
        """The forward step of ``op`` in ``layer`` (None: outside the layers)."""
        return self.by_operator[(layer, op)]


@dataclass
class ForwardWalk:
    """A chunk's forward walk under way; it becomes a :class:`ForwardChunk` at its end."""

    chunk: int
    steps: list[Step] = field(default_factory=list)
    links: list[Link] = field(default_factory=list)
    # (node, source layout, target layout) -> the node carrying the value after the tp
    # redistribution and the slice taken locally: one value is redistributed once,
    # however many consumers read it.
    carried: dict[tuple[str, str, str], tuple[str, Layout | None]] = field(
        default_factory=dict)


@dataclass(frozen=True)
class BackwardChunk:
    """One chunk's backward walk, as the backward walk of the chunk before it and the
    parameters read it."""

    backward_of: Mapping[str, str]  # each forward step's node -> its backward step
    # The gradient of the chunk before's output arrives by one of two ways: a pipeline
    # receive, or (the two chunks share a stage, a V's turn) straight into that
    # output's backward step, which this walk made early to connect it.
    gradient_receive: str | None = None
    early_backward: str | None = None
