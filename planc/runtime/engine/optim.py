"""The optimizer of a run, with the plan's hyper-parameters (train.optimizer,
docs/language.md).

A rank updates each of its flat buckets with :class:`BucketOptimizer`: the one-pass
kernels that ``torch.optim.AdamW(fused=True)`` and ``SGD(fused=True)`` call
(``aten::_fused_adamw_``, ``aten::_fused_sgd_``), called directly on the bucket, with the
state torch would keep. The numbers are torch's to the bit (tests/test_optim.py); what is
left out is torch.optim's machinery for many parameter groups, hooks and compilation:
its ``Optimizer`` imports ``torch._dynamo`` on first use, 3 s of CPU in every run's start.
The single-process reference (``planc run --check``) keeps torch.optim itself
(:func:`torch_optimizer`), to stay independent of the runtime.
"""

from __future__ import annotations

import torch

STEP_DTYPE = torch.float32  # torch.optim's step count under fused=True: a float32 scalar


class BucketOptimizer:
    """One flat tensor's update. ``state`` holds what torch.optim would keep for it:
    AdamW's ``step`` (a float32 scalar on the tensor's device), ``exp_avg`` and
    ``exp_avg_sq``; SGD's ``momentum_buffer`` when momentum is not 0. It starts empty and
    is filled by the first step, or by a checkpoint before it. ``lr`` is set before each
    step from the build's schedule, as a torch scheduler sets a group's lr."""

    def __init__(self, settings, tensor: torch.Tensor):
        self.settings = settings
        self.tensor = tensor
        self.lr = settings.lr
        self.state: dict[str, torch.Tensor] = {}

    def step(self) -> None:
        """One update of ``tensor`` from ``tensor.grad``."""
        with torch.no_grad():
            if self.settings.name == "adamw":
                self._adamw()
            else:
                self._sgd()

    def _adamw(self) -> None:
        """Loshchilov & Hutter's AdamW, as torch.optim.AdamW(fused=True) runs it: the step
        count advanced first, then the kernel with it."""
        tensor, state, settings = self.tensor, self.state, self.settings
        if not state:
            state["step"] = torch.zeros((), dtype=STEP_DTYPE, device=tensor.device)
            state["exp_avg"] = torch.zeros_like(tensor, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(tensor,
                                                   memory_format=torch.preserve_format)
        steps = [state["step"]]
        torch._foreach_add_(steps, 1)
        beta1, beta2 = settings.betas
        torch._fused_adamw_([tensor], [tensor.grad], [state["exp_avg"]],
                            [state["exp_avg_sq"]], [], steps, amsgrad=False, lr=self.lr,
                            beta1=beta1, beta2=beta2, weight_decay=settings.weight_decay,
                            eps=settings.eps, maximize=False, grad_scale=None,
                            found_inf=None)

    def _sgd(self) -> None:
        """SGD with momentum, as torch.optim.SGD(fused=True) runs it: the first step
        starts the momentum buffer from the gradient (``is_first_step``)."""
        tensor, state, settings = self.tensor, self.state, self.settings
        buffers, first = [], False
        if settings.momentum != 0:
            first = "momentum_buffer" not in state
            if first:
                state["momentum_buffer"] = torch.empty_like(tensor.grad)
            buffers = [state["momentum_buffer"]]
        torch._fused_sgd_([tensor], [tensor.grad], buffers,
                          weight_decay=settings.weight_decay, momentum=settings.momentum,
                          lr=self.lr, dampening=0.0, nesterov=False, maximize=False,
                          is_first_step=first, grad_scale=None, found_inf=None)


def torch_optimizer(settings, tensors: list[torch.Tensor]) -> torch.optim.Optimizer:
    """torch.optim's own AdamW or SGD, unfused, over ``tensors``: the reference's."""
    if settings.name == "adamw":
        return torch.optim.AdamW(tensors, lr=settings.lr, betas=settings.betas,
                                 eps=settings.eps, weight_decay=settings.weight_decay)
    return torch.optim.SGD(tensors, lr=settings.lr, momentum=settings.momentum,
                           weight_decay=settings.weight_decay)
