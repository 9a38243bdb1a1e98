"""The layout algebra of one mesh axis: replicate, shard and partial, and redistribution.

A tensor is, on a mesh axis, ``R`` (every rank holds all of it), ``S(d)`` (rank i holds
the i-th slice along dimension d) or ``P`` (every rank holds a full-shaped partial
value; the true tensor is the sum over the group). These are the placements of
PyTorch's DTensor (Replicate, Shard, Partial) and of GSPMD.

One function, :func:`redistribute`, turns any layout into any other with the cheapest
single collective. Applied to activations in the forward pass and to gradients in
the backward pass, it yields the whole redistribution table of docs/semantics.md, section 1:
Megatron's f and g operators (Shoeybi et al. 2019), sequence parallelism's
all-gather/reduce-scatter pairs (Korthikanti et al. 2022), and the vocabulary-parallel
embedding and head.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    kind: str  # "R", "S" or "P"
    dim: str | None = None  # the sharded dimension of S

    def __str__(self) -> str:
        return f"S({self.dim})" if self.kind == "S" else self.kind

    @property
    def is_partial(self) -> bool:
        return self.kind == "P"

    @property
    def is_sharded(self) -> bool:
        return self.kind == "S"


R = Layout("R")
P = Layout("P")


def S(dim: str) -> Layout:  # noqa: N802 - reads like the notation
    return Layout("S", dim)


def parse(text: str) -> Layout:
    if text in ("R", "P"):
        return Layout(text)
    if text.startswith("S(") and text.endswith(")"):
        return S(text[2:-1])
    raise ValueError(f"not a layout: {text!r}")


def gradient_layout(layout: Layout) -> Layout:
    """Layout of the gradient of a tensor laid out as ``layout``.

    The gradient of a partial tensor is replicated: every partial summand has the same
    derivative as the sum.
    """
    return R if layout.is_partial else layout


@dataclass(frozen=True)
class Redistribution:
    """One collective (or a free local slice) turning ``source`` into ``target``."""

    kind: str  # all_reduce, all_gather, reduce_scatter, all_to_all or slice
    source: Layout
    target: Layout

    @property
    def is_transfer(self) -> bool:
        return self.kind != "slice"

    @property
    def dim(self) -> str | None:
        if self.kind == "all_gather":
            return self.source.dim
        if self.kind in ("reduce_scatter", "slice"):
            return self.target.dim
        if self.kind == "all_to_all":
            return f"{self.source.dim}->{self.target.dim}"
        return None

    def buffer_fraction(self, group_size: int) -> float:
        """Per-rank buffer, nccl-tests convention (larger of input and output), as a
        fraction of the whole tensor."""
        if self.kind in ("all_reduce", "all_gather", "reduce_scatter"):
            return 1.0
        if self.kind == "all_to_all":
            return 1.0 / group_size
        return 0.0


class IllegalRedistribution(ValueError):
    pass


def redistribute(source: Layout, target: Layout) -> Redistribution | None:
    """The redistribution from ``source`` to ``target``, or None if they are equal."""
    if source == target:
        return None
    if source.is_partial:
        if target.kind == "R":
            return Redistribution("all_reduce", source, target)
        return Redistribution("reduce_scatter", source, target)
    if target.is_partial:
        raise IllegalRedistribution(f"no rule produces a partial tensor from {source}")
    if source.kind == "R":
        return Redistribution("slice", source, target)
    if target.kind == "R":
        return Redistribution("all_gather", source, target)
    return Redistribution("all_to_all", source, target)
