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

import functools
from dataclasses import dataclass

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


# --- where a weight pass starts ------------------------------------------------------


@dataclass
class WeightRoots:
    """Where a weight pass starts, kept by the input pass: for each group of parameters,
    the gradient edges of the nodes where the paths to them leave the paths to the
    inputs, and the gradients the input pass sent into those nodes; and the parameters
    of each group, by their index among the pass's targets."""

    groups: list[tuple[list, list[torch.Tensor], list[int]]]

    def bytes(self) -> int:
        """What the kept gradients hold: each storage once (views of one share it)."""
        storages = {}
        for _, grads, _ in self.groups:
            for grad in grads:
                storage = grad.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
        return sum(storages.values())


def weight_splits(root, inputs: list[torch.Tensor], params: list[torch.Tensor]
                  ) -> list[tuple[list, list[int]]] | None:
    """Groups of the nodes under ``root`` where the paths to ``params`` leave the paths
    to ``inputs`` (torch.distributed.pipelining's split backward finds them the same
    way), each with the indices of its parameters: a weight pass that starts from them,
    with the gradients an input pass sent into them, recomputes nothing the input pass
    computed (a SwiGLU's product's gradient, an up-projection's input gradient). None
    when no such node lies under another (a weight pass from ``root`` would then multiply
    by no weight the input pass multiplied by: nothing to gain), or when a group's nodes
    lie on one another's paths (a weight pass from both would count a gradient twice)."""
    parents: dict = {}
    seen, stack = {root}, [root]
    while stack:
        node = stack.pop()
        for child, _ in node.next_functions:
            if child is None:
                continue
            parents.setdefault(child, []).append(node)
            if child not in seen:
                seen.add(child)
                stack.append(child)
    to_inputs = _above([torch.autograd.graph.get_gradient_edge(t).node for t in inputs],
                       parents)
    if root not in to_inputs:
        return None
    groups: list[tuple[list, list[int]]] = []
    for index, param in enumerate(params):
        splits = _splits_above(torch.autograd.graph.get_gradient_edge(param).node,
                               parents, to_inputs)
        joined = [group for group in groups if not set(group[0]).isdisjoint(splits)]
        for group in joined:
            groups.remove(group)
            splits += [node for node in group[0] if node not in splits]
        groups.append((splits, sorted([index, *(i for g in joined for i in g[1])])))
    # a weight pass from the root recomputes a product by a weight only where one of
    # these nodes lies under another (views and elementwise steps cost little)
    if not _reached_from(sum((splits for splits, _ in groups), [])):
        return None
    if any(_reached_from(splits) for splits, _ in groups):
        return None
    return groups


def _above(nodes: list, parents: dict) -> set:
    """``nodes`` and every node a path from the root to one of them passes."""
    found, stack = set(nodes), list(nodes)
    while stack:
        for parent in parents.get(stack.pop(), ()):
            if parent not in found:
                found.add(parent)
                stack.append(parent)
    return found


def _splits_above(node, parents: dict, to_inputs: set) -> list:
    """The nodes of ``to_inputs`` first met on the paths from ``node`` up to the root."""
    splits, seen, stack = [], {node}, [node]
    while stack:
        for parent in parents.get(stack.pop(), ()):
            if parent in to_inputs:
                if parent not in splits:
                    splits.append(parent)
            elif parent not in seen:
                seen.add(parent)
                stack.append(parent)
    return splits


def _reached_from(nodes: list) -> bool:
    """Whether a path from one of ``nodes`` passes another (a node cannot reach itself:
    the graph has no cycle), in one walk from all their children."""
    targets = set(nodes)
    stack = [child for node in nodes for child, _ in node.next_functions
             if child is not None]
    seen = set(stack)
    while stack:
        node = stack.pop()
        if node in targets:
            return True
        for child, _ in node.next_functions:
            if child is not None and child not in seen:
                seen.add(child)
                stack.append(child)
    return False


def input_pass_keeping_roots(run, groups) -> tuple[object, WeightRoots | None]:
    """``run()`` (an input pass), with the gradients sent into each group's nodes kept:
    its result, and where the weight pass starts (None if a node was not reached)."""
    sent: dict = {}
    handles = [node.register_prehook(functools.partial(_keep, sent, node))
               for splits, _ in groups for node in splits]
    try:
        result = run()
    finally:
        for handle in handles:
            handle.remove()
    kept = []
    for splits, indices in groups:
        if any(node not in sent for node in splits):
            return result, None
        edges, grads = [], []
        for node in splits:
            for number, grad in enumerate(sent[node]):
                if grad is not None:
                    edges.append(torch.autograd.graph.GradientEdge(node, number))
                    grads.append(grad)
        kept.append((edges, grads, indices))
    return result, WeightRoots(kept)


def _keep(sent: dict, node, grads):
    sent[node] = grads


def input_half(run, root, inputs: list[torch.Tensor], params: list[torch.Tensor],
               limit: int) -> tuple[object, WeightRoots | None]:
    """A split backward's input half, ``run()``, over the graph under ``root``: its
    result, and where its weight half starts if not from the output gradient, only where
    the gradients kept for it take no more than ``limit`` bytes (what the output gradient
    kept for the weight half would take): a memory estimate that counts the output
    gradient stays an upper bound."""
    groups = weight_splits(root, inputs, params)
    if groups is None:
        return run(), None
    result, roots = input_pass_keeping_roots(run, groups)
    return result, roots if roots is not None and roots.bytes() <= limit else None


def weight_half(roots: WeightRoots, params: list[torch.Tensor], vector_jacobian
                ) -> list[torch.Tensor | None]:
    """The gradients of ``params`` from where the input half left the paths to them:
    ``vector_jacobian(edges, grads, targets, retain_graph)`` once per group (no group
    passes another's nodes), the graph let go with the last."""
    found: list[torch.Tensor | None] = [None] * len(params)
    for number, (edges, grads, indices) in enumerate(roots.groups):
        if not edges:  # no gradient reached the group's nodes: none for its weights
            continue
        last = number == len(roots.groups) - 1
        for index, grad in zip(indices, vector_jacobian(
                edges, grads, [params[i] for i in indices], retain_graph=not last)):
            found[index] = grad
    return found
