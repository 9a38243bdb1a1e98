"""The model families planc knows, as data (:mod:`planc.models.family`)."""

from __future__ import annotations

from planc.models import deepseek, gpt, llama, moe
from planc.models.family import Family

FAMILIES: dict[str, Family] = {"gpt": gpt.FAMILY, "llama": llama.FAMILY, "moe": moe.FAMILY,
                               "deepseek": deepseek.FAMILY}
DEFAULT_FAMILY = "gpt"  # the family of a model block with no family word (reported)


def family_of(model) -> Family:
    """The family of a :class:`planc.plan.plan.Model` (or of a plan)."""
    model = getattr(model, "model", model)
    return FAMILIES[model.family]


def step_model_flops(plan) -> float:
    """Model FLOPs of one training step of ``plan`` (Narayanan et al., SC'21, eq. 3):
    forward and backward, 3x the forward's matrix multiplies and attention over the
    step's ``batch * seq`` tokens; recomputation not counted, as MFU conventionally
    excludes it (Chowdhery et al. 2022, PaLM, appendix B): it is hardware FLOPs, not
    model FLOPs. The family says what its forward costs per token."""
    m = plan.model
    return 3.0 * m.batch * m.seq * family_of(plan).model_flops_per_token(m)


def recomputes_norms(plan) -> bool:
    """optimize { recompute_norms } in effect: the plan lets it act
    (planc.plan.plan.Plan.norms_recomputable) on a family whose norms feed one GEMM each
    (Family.norms_made_again: gpt's and llama's)."""
    return family_of(plan).norms_made_again and plan.norms_recomputable


def recomputed_activation_bytes(m, *, seq: int, batch: int, tp: int,
                                activation_recomputed: bool = False, kinds: str = "both",
                                norms_recomputed: bool = False, **_) -> float:
    """What a dense block's backward holds for a moment beyond its count under optimize {
    recompute_activation }: its MLP activation's output of one microbatch, computed again
    for the down projection (planc.runtime.families.recomputed_output), FFN-wide, over tp;
    none where nothing is computed again (planc.plan.plan.Plan.recomputes_activation) or
    the stage holds mixtures alone (``kinds``: planc.models.moe_memory.BLOCK_KINDS). Under
    optimize { recompute_norms } a norm's output, hidden-wide, whole on every tp rank, at
    another moment of the backward: the larger of the two."""
    activation = seq * batch * m.ffn * m.dtype_bytes / tp \
        if activation_recomputed and kinds != "mixture" else 0.0
    return max(activation, seq * batch * m.hidden * m.dtype_bytes * norms_recomputed)
