"""The model families planc knows, as data (:mod:`planc.models.family`)."""

from __future__ import annotations

from planc.models import gpt, llama, moe
from planc.models.family import Family

FAMILIES: dict[str, Family] = {"gpt": gpt.FAMILY, "llama": llama.FAMILY, "moe": moe.FAMILY}
DEFAULT_FAMILY = "gpt"  # the family of a model block with no family word (reported)


def family_of(model) -> Family:
    """The family of a :class:`planc.plan.Model` (or of a plan)."""
    model = getattr(model, "model", model)
    return FAMILIES[model.family]
