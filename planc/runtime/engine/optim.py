"""The optimizer of a run, with the plan's hyper-parameters (train.optimizer,
docs/language.md): torch.optim's AdamW or SGD, called through torch.optim's functional
form (``torch.optim.adam.adam`` with decoupled weight decay, ``torch.optim.sgd.sgd``),
which is the computation ``torch.optim.AdamW.step`` and ``SGD.step`` run, with the state
they would keep kept here.

What is left out is torch.optim's ``Optimizer`` class, its parameter groups, hooks and
compilation support: its first use imports ``torch._dynamo``, 3 s of CPU in every rank
that makes one. A rank updates each flat bucket with torch's one-pass fused kernel
(``fused``, the runtime's choice: the default implementation's temporaries of a whole
bucket cost ten times as much); the single-process reference (``planc run --check``)
runs torch's default implementation, to stay independent of the runtime. Both are
torch.optim's to the bit (tests/test_optim.py).
"""

from __future__ import annotations

import torch
from torch.optim.adam import adam
from torch.optim.sgd import sgd


def _step_dtype(fused: bool) -> torch.dtype:
    """The dtype of AdamW's step count as torch.optim keeps it (float32 when fused,
    otherwise float64 only under a float64 default dtype)."""
    if not fused and torch.get_default_dtype() == torch.float64:
        return torch.float64
    return torch.float32


class TensorOptimizer:
    """AdamW or SGD over ``tensors``, each updated from its ``.grad`` (a tensor without one
    is left alone, as torch.optim leaves it). ``states[i]`` holds what torch.optim keeps
    for tensor i: AdamW's ``step`` (a scalar: on the tensor's device when fused, on the
    CPU otherwise), ``exp_avg`` and ``exp_avg_sq``; SGD's ``momentum_buffer`` when momentum
    is not 0. A state starts empty and is filled by the first step, or by a checkpoint
    before it. ``lr`` is set before a step as a torch scheduler sets a group's lr."""

    def __init__(self, settings, tensors: list[torch.Tensor], fused: bool = False):
        self.settings = settings
        self.tensors = list(tensors)
        self.fused = fused
        self.lr = settings.lr
        self.states: list[dict[str, torch.Tensor]] = [{} for _ in self.tensors]

    def zero_grad(self) -> None:
        for tensor in self.tensors:
            tensor.grad = None

    def step(self) -> None:
        """One update of every tensor that has a gradient."""
        chosen = [i for i, tensor in enumerate(self.tensors) if tensor.grad is not None]
        if not chosen:
            return
        with torch.no_grad():
            if self.settings.name == "adamw":
                self._adamw(chosen)
            else:
                self._sgd(chosen)

    def _adamw(self, chosen: list[int]) -> None:
        """Loshchilov & Hutter's AdamW (Adam with decoupled weight decay)."""
        settings, fused = self.settings, self.fused
        for i in chosen:
            state, tensor = self.states[i], self.tensors[i]
            if not state:
                state["step"] = torch.zeros((), dtype=_step_dtype(fused),
                                            device=tensor.device if fused else "cpu")
                state["exp_avg"] = torch.zeros_like(tensor,
                                                    memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(tensor,
                                                       memory_format=torch.preserve_format)
        states = [self.states[i] for i in chosen]
        beta1, beta2 = settings.betas
        adam([self.tensors[i] for i in chosen], [self.tensors[i].grad for i in chosen],
             [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states], [],
             [s["step"] for s in states], fused=True if fused else None,
             decoupled_weight_decay=True, amsgrad=False, beta1=beta1, beta2=beta2,
             lr=self.lr, weight_decay=settings.weight_decay, eps=settings.eps,
             maximize=False)

    def _sgd(self, chosen: list[int]) -> None:
        """SGD with momentum: the first step starts the buffer from the gradient."""
        settings = self.settings
        buffers = [self.states[i].get("momentum_buffer") for i in chosen]
        sgd([self.tensors[i] for i in chosen], [self.tensors[i].grad for i in chosen],
            buffers, fused=True if self.fused else None, weight_decay=settings.weight_decay,
            momentum=settings.momentum, lr=self.lr, dampening=0.0, nesterov=False,
            maximize=False)
        if settings.momentum != 0:
            for i, buffer in zip(chosen, buffers):
                self.states[i]["momentum_buffer"] = buffer


class BucketOptimizer(TensorOptimizer):
    """One flat bucket's update with torch's fused kernel; ``state`` is the bucket's."""

    def __init__(self, settings, tensor: torch.Tensor):
        super().__init__(settings, [tensor], fused=True)

    @property
    def tensor(self) -> torch.Tensor:
        return self.tensors[0]

    @property
    def state(self) -> dict[str, torch.Tensor]:
        return self.states[0]

    @state.setter
    def state(self, value: dict[str, torch.Tensor]) -> None:
        self.states[0] = value
