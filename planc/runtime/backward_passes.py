"""Which gradients one pass of a backward is asked for, from inside a Function's backward.

A split backward (zero-bubble's B and W steps, Qi et al. 2023, "Zero Bubble Pipeline
Parallelism") runs one autograd graph twice: once for the gradients of a step's inputs and
once, later, for its weights'. Autograd's own operators compute only the outputs a pass
needs; a ``torch.autograd.Function`` is told only which inputs require a gradient
(``ctx.needs_input_grad``), the same in both passes, so a hand-written backward would
compute both of its products twice. :func:`asked_for` answers per pass, as FSDP asks
whether a node will run (``torch._C._will_engine_execute_node``).
"""

from __future__ import annotations

import torch


def _will_run(node) -> bool:
    """Whether this pass of the backward runs ``node`` (the gradient edge of an input). A
    leaf's accumulator cannot be asked under ``torch.autograd.grad``: a leaf is given to a
    Function as a view of itself (:func:`traceable`) so that this rarely answers
    "maybe", which counts as yes."""
    if node is None:
        return False
    try:
        return torch._C._will_engine_execute_node(node)
    except (AttributeError, RuntimeError):  # another torch, or a leaf's accumulator
        return True


def asked_for(ctx, first: int = 0) -> tuple[bool, ...]:
    """Which of the forward's inputs this pass needs a gradient of, in the order of
    ``ctx.needs_input_grad``. The forward's tensors are the inputs from position
    ``first`` on, the last of them possibly None (absent, never asked for); the inputs
    before ``first`` and after the tensors are never asked for."""
    asked = ctx.needs_input_grad
    runs = [_will_run(node) for node, _ in ctx.next_functions]
    runs = [False] * first + runs + [False] * (len(asked) - first - len(runs))
    return tuple(need and run for need, run in zip(asked, runs))


def traceable(t: torch.Tensor | None) -> torch.Tensor | None:
    """A leaf that requires a gradient as a view of itself (no copy), whose node
    :func:`asked_for` can ask about; anything else as it is."""
    if t is not None and t.requires_grad and t.grad_fn is None:
        return t.view_as(t)
    return t
