"""The plan's model as the derivation sees it: tensor sizes, FLOPs and parameters, read
from its family's description (:mod:`planc.models`).

Sizes here are per microbatch and per rank *before* tensor parallelism (after context
parallelism: each cp rank holds ``seq / cp`` tokens and attends to all ``seq``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from planc.models import family_of
from planc.models.family import Parameter
from planc.plan.plan import Model, Plan

__all__ = ["Parameter", "Shapes", "all_parameters", "forward_flops", "split_flops"]


@dataclass(frozen=True)
class Shapes:
    """Tensor sizes of one microbatch on one cp rank, before tensor parallelism."""

    batch: int  # microbatch size
    seq: int  # local tokens per cp rank
    seq_full: int
    hidden: int
    heads: int
    ffn: int
    vocab: int
    dtype_bytes: int
    model: Model
    widths: Mapping[str, int] = field(compare=False, hash=False)  # features per token

    @staticmethod
    def of(plan: Plan) -> "Shapes":
        m = plan.model
        return Shapes(plan.microbatch_size, m.seq // plan.mesh.cp, m.seq, m.hidden, m.heads,
                      m.ffn, m.vocab, m.dtype_bytes, m, family_of(m).widths(m))

    def elements(self, tensor: str) -> int:
        """Elements of an activation (batch, seq, features); ``tokens`` has one feature."""
        return self.batch * self.seq * self.widths[tensor]

    def bytes(self, tensor: str) -> int:
        return self.elements(tensor) * self.dtype_bytes


def forward_flops(op: str, s: Shapes) -> float:
    """FLOPs of one operator for one microbatch on one cp rank (all tp ranks together)."""
    return family_of(s.model).forward_flops(op, s)


def split_flops(op: str, s: Shapes, tp: int) -> float | None:
    """FLOPs of one of ``tp`` ranks of an operator split over its features, where the split
    leaves part of its work whole on every rank (multi-head latent attention's latents);
    None where it divides the work evenly (``forward_flops / tp``)."""
    family = family_of(s.model)
    return family.split_flops(op, s, tp) if family.split_flops is not None else None


def all_parameters(plan: Plan) -> list[Parameter]:
    return family_of(plan).all_parameters(plan.model)
