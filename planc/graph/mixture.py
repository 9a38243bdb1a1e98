"""What a mixture of experts' compute node says of the collectives its kernel runs itself.

Both run inside the operator's instruction, on its stream, over groups of their own
(planc.program.groups), so that the verifier, ``planc explain`` and the simulator see them
(with schedule { overlap_all_to_all } the pass planc.passes.split_dispatch turns the ep
all-to-alls into transfers of the graph instead):

- over ``ep`` > 1 (GShard's expert parallelism, Lepikhin et al. 2021; Megatron-Core's
  token dispatcher): the size of the ep group (``experts_over``) and what each of its
  all-to-alls moves at uniform routing (``dispatch_bytes``);
- with a statistic of each sequence (DeepSeek-V3's sequence-wise balance loss,
  :attr:`planc.models.family.OpRule.sequence_statistic_when`) whose tokens lie on several
  ranks: how many ranks hold parts of one sequence (cp, times tp since the operator then
  runs on a 1/tp share), over which the forward sums the per-(sequence, expert) counts
  with one all-reduce (``counts_over``), and the bytes of those fp32 counts
  (``counts_bytes``: the microbatch's sequences x experts); with ``capacity``, over the
  same ranks, the all-gathers of every part's choices of experts and its tokens'
  positions (int64), from which each rank finds the tokens every expert drops
  (``capacity_bytes``: what one rank contributes).
"""

from __future__ import annotations

from planc.estimate.model import Shapes
from planc.graph.tensor_parallel import FP32_BYTES, OpLayout
from planc.models.family import OpRule
from planc.plan.plan import Plan

INDEX_BYTES = 8  # an int64 expert index or token position


def in_kernel_collectives(plan: Plan, rule: OpRule, shapes: Shapes, layout: OpLayout
                          ) -> dict:
    """The node attributes of the collectives ``rule``'s operator runs in its kernel."""
    attrs: dict = {}
    mesh, m = plan.mesh, plan.model
    tp_share = mesh.tp if layout.sharded else 1
    if rule.expert_parallel and mesh.ep > 1:
        attrs["experts_over"] = mesh.ep  # dispatched over the ep group
        # what one all-to-all moves at uniform routing: every (token, expert) row
        tokens = shapes.batch * shapes.seq / tp_share
        attrs["dispatch_bytes"] = int(tokens * m.top_k * shapes.hidden * shapes.dtype_bytes)
    if rule.sums_over_sequences(m) and tp_share * mesh.cp > 1:
        attrs["counts_over"] = tp_share * mesh.cp
        if m.options.get("aux_loss"):
            attrs["counts_bytes"] = int(shapes.batch * m.experts * FP32_BYTES)
        if m.options.get("capacity") is not None:  # every part's choices and positions
            held = shapes.seq // tp_share
            attrs["capacity_bytes"] = int(shapes.batch * held * m.top_k * INDEX_BYTES
                                          + held * INDEX_BYTES)
    return attrs
