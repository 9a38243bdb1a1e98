"""The optimizer of a run: torch.optim's AdamW or SGD with the plan's hyper-parameters
(train.optimizer, docs/language.md), for the runtime's flat buckets and for the
single-process reference alike."""

from __future__ import annotations

import torch


def optimizer_of(settings, tensors: list[torch.Tensor], fused: bool = False
                 ) -> torch.optim.Optimizer:
    """``settings``: the plan's train.optimizer (name, lr, betas, eps, momentum,
    weight_decay). ``fused``: torch's one-pass kernel (the runtime's choice for its flat
    buckets, where the default implementation's temporaries of the whole bucket cost ten
    times as much); the reference keeps the default, to stay independent."""
    if settings.name == "adamw":
        return torch.optim.AdamW(tensors, lr=settings.lr, betas=settings.betas,
                                 eps=settings.eps, weight_decay=settings.weight_decay,
                                 fused=fused or None)
    return torch.optim.SGD(tensors, lr=settings.lr, momentum=settings.momentum,
                           weight_decay=settings.weight_decay, fused=fused or None)
