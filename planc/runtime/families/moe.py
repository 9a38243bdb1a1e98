"""The moe family's kernels: llama's, and the mixture of experts as planc.models.moe
defines it (router in fp32, top-k with ties to the lower expert index, weights
renormalised over the k when ``norm_topk``, SwiGLU experts, shared experts unweighted).

The mixture runs on the tokens the step holds (all of a microbatch's, or this tp rank's
share): each expert multiplies the tokens routed to it, in token order, as one GEMM per
weight (a grouped GEMM, Gale et al. 2023's MegaBlocks without padding), and each output
is added back to its token weighted by its routing probability.
"""

from __future__ import annotations

import torch

from planc.graph.vocabulary import Op
from planc.runtime.engine import fp8
from planc.runtime.families import llama
from planc.runtime.families import moe_dispatch
from planc.runtime.families.moe_dispatch import (added_by_token, exchange_fp8_rows,
                                                 exchange_rows, exchanged_counts, expert_mlp,
                                                 outputs_by_expert, received_experts,
                                                 stacked_experts, through_experts)
from planc.runtime.families.recomputed_product import product_recomputed
from planc.runtime.families.moe_gate import (WithBalanceLoss, balance_loss, balanced,
                                             choose, routed_pairs, sorted_pairs, update_bias)
from planc.vocabulary.model_options import balanced_layers


def _shared_and_balance(out, tokens, probabilities, experts, weights_of, m, sequences: int,
                        batch: int, collected: list | None, counts_over=None
                        ) -> torch.Tensor:
    """The shared experts added to the routed ones' ``out``; with ``aux_loss``, the
    balance loss of the ``sequences`` sequences (whole, or this rank's parts of them with
    their counts summed over ``counts_over``), divided by the batch, joined to the
    backward, or appended to ``collected`` (the reference, which adds it itself)."""
    if m.shared_experts:
        out = out + expert_mlp(tokens, *(weights_of(f"shared.{w}.weight")
                                         for w in ("gate", "up", "down")), fp8.recipe_of(m),
                               again=product_recomputed(m))
    if m.aux_loss:
        loss = balance_loss(probabilities, experts, sequences, m, counts_over) / batch
        if collected is None:
            out = WithBalanceLoss.apply(out, loss)
        else:
            collected.append(loss)
    return out


def mixture(tokens: torch.Tensor, weights_of, m, sequences: int = 1, batch: int = 1,
            collected: list | None = None, counts_over=None, bias=None, count=None,
            positions: torch.Tensor | None = None, drops=None) -> torch.Tensor:
    """The mixture's output for ``tokens`` (n, hidden) of ``sequences`` sequences of a
    batch of ``batch``; ``weights_of(name)``: a weight of the block by its name within
    the block, in the model's dtype (see :func:`_shared_and_balance`); ``bias`` and
    ``count``: the balancing bias and its count (:func:`choose`); ``positions``: those of
    each sequence's tokens (whole sequences in order when None), which ``capacity``
    drops by (planc.runtime.families.moe_gate.kept), telling ``drops``
    (:func:`routed_pairs`)."""
    probabilities, experts, weights = choose(tokens, weights_of, m, bias, count)
    routed = routed_pairs(experts, sequences, positions, m, counts_over, drops)
    weights = weights.to(tokens.dtype)
    stacked, recipe = stacked_experts(weights_of), fp8.recipe_of(m)
    # the (token, slot) pairs by expert (a stable sort: each expert's in token order),
    # gathered once, each expert on its slice (moe_dispatch.through_experts' reason), and
    # added to their tokens expert after expert, as a token's experts are summed
    pairs = routed.reshape(-1)
    chosen = ((pairs >= 0) & (pairs < m.experts)).nonzero(as_tuple=True)[0]
    order = chosen[torch.argsort(pairs[chosen], stable=True)]
    counts = torch.bincount(pairs[order], minlength=m.experts).tolist()
    token_of = order // routed.shape[1]
    outputs = outputs_by_expert(tokens[token_of], weights.reshape(-1)[order].unsqueeze(-1),
                                counts, stacked, recipe, product_recomputed(m))
    out = torch.zeros_like(tokens)
    if outputs is not None:
        out = added_by_token(out, token_of, outputs, [n for n in counts if n])
    return _shared_and_balance(out, tokens, probabilities, experts, weights_of, m, sequences,
                               batch, collected, counts_over)


class _AllToAll(torch.autograd.Function):
    """Rows to the ranks of a group, ``sent[j]`` of them to rank j, ``received[j]`` back
    from it (torch.distributed's all_to_all_single with uneven splits); the backward
    returns the gradients the same way reversed."""

    @staticmethod
    def forward(ctx, rows, sent, received, group):
        ctx.sent, ctx.received, ctx.group = sent, received, group
        return exchange_rows(rows, sent, received, group)

    @staticmethod
    def backward(ctx, grad):
        return exchange_rows(grad, ctx.received, ctx.sent, ctx.group), None, None, None


class _Fp8Dispatch(torch.autograd.Function):
    """The dispatch of model { fp8 } (DeepSeek-V3, section 3.3, "Low-Precision
    Communication": activations dispatched in FP8): each row sent as E4M3 bytes and one
    fp32 scale per tile (planc.runtime.engine.fp8.encoded_rows), what the experts' first
    FP8 GEMM reads, and decoded on arrival into the rows' dtype; the backward returns the
    gradients in the dtype, as _AllToAll does (the report keeps its combine components,
    forward and backward, in BF16)."""

    @staticmethod
    def forward(ctx, rows, sent, received, group, tile):
        ctx.sent, ctx.received, ctx.group = sent, received, group
        return exchange_fp8_rows(rows, sent, received, group, fp8.Recipe(tile))

    @staticmethod
    def backward(ctx, grad):
        return exchange_rows(grad, ctx.received, ctx.sent, ctx.group), None, None, None, None


class _Fp8Combine(torch.autograd.Function):
    """The combine of model { fp8 }: the experts' outputs back in the dtype, as
    _AllToAll sends them; the backward sends their gradients to the experts as FP8, as
    the dispatch sends the rows (DeepSeek-V3, section 3.3: "a similar strategy is applied
    to the activation gradient before MoE down-projections"). The down-projection's FP8
    backward quantises that gradient in the same 1 x tile groups, so it reads what it
    would have read of the gradient sent whole."""

    @staticmethod
    def forward(ctx, rows, sent, received, group, recipe):
        ctx.sent, ctx.received, ctx.group, ctx.recipe = sent, received, group, recipe
        return exchange_rows(rows, sent, received, group)

    @staticmethod
    def backward(ctx, grad):
        return (exchange_fp8_rows(grad, ctx.received, ctx.sent, ctx.group, ctx.recipe,
                                  gradients=True), None, None, None, None)


def expert_parallel_mixture(tokens: torch.Tensor, weights_of, m, peers, sequences: int,
                            batch: int, counts_over=None, tally=None, bias=None, count=None,
                            positions: torch.Tensor | None = None, drops=None
                            ) -> torch.Tensor:
    """The mixture with its experts spread over ``peers`` (expert parallelism: GShard,
    Lepikhin et al. 2021; Megatron-Core's token dispatcher): rank j of the ep group runs
    experts j E/ep ... (j + 1) E/ep - 1, the rows of the stacked weights it keeps. Each
    (token, expert) pair goes, sorted by expert,
    to the expert's rank with one all-to-all after the counts are exchanged (they vary
    step by step), comes back with another, and is added to its token weighted; a token's
    experts add in increasing order, as :func:`mixture` adds them. The counts go per
    expert, so that a rank knows each row's expert from where it lies among the rows
    (sorted by expert) without a third exchange (Megatron-Core's all-to-all dispatcher
    sends its tokens-per-expert counts the same way)."""
    probabilities, experts, weights = choose(tokens, weights_of, m, bias, count)
    per_rank = m.experts // peers.size
    chosen = routed_pairs(experts, sequences, positions, m, counts_over, drops).reshape(-1)
    order, token_of = sorted_pairs(chosen, m.top_k)  # every pair, unless capacity drops
    arriving, sent, received = exchanged_counts(
        torch.bincount(chosen[order], minlength=m.experts), peers.group, peers.size)
    if tally is not None:  # the rows this rank's experts run: the routing's balance
        tally(sum(received))
    recipe = fp8.recipe_of(m)
    rows = _AllToAll.apply(tokens[token_of], sent, received, peers.group) if recipe is None \
        else _Fp8Dispatch.apply(tokens[token_of], sent, received, peers.group, recipe.tile)
    # each pair's routing weight goes with its row: applied inside the expert's SwiGLU
    scales = _AllToAll.apply(weights.reshape(-1)[order].to(tokens.dtype).unsqueeze(-1),
                             sent, received, peers.group)
    local_expert = received_experts(arriving)
    stacked = stacked_experts(weights_of)  # this rank's experts only
    # zeros that depend on ``rows`` and ``scales``: a rank whose experts got no row in
    # this microbatch still runs the all-to-alls' backward, which its peers wait for
    # (with zeros_like, autograd would skip them there, and the ep group would hang)
    done = through_experts(rows * 0 * scales, rows, scales, local_expert, per_rank, stacked,
                           recipe, product_recomputed(m))
    back = _AllToAll.apply(done, received, sent, peers.group) if recipe is None \
        else _Fp8Combine.apply(done, received, sent, peers.group, recipe)
    out = added_by_token(torch.zeros_like(tokens), token_of, back)
    return _shared_and_balance(out, tokens, probabilities, experts, weights_of, m, sequences,
                               batch, None, counts_over)


def moe(k, spec, x, p, step, mb, extra):
    data = x["x"]
    by_suffix = {name.split(".", 2)[-1]: name for name in spec.params}
    weights_of = lambda name: p(by_suffix[name])  # noqa: E731
    flat = data.reshape(-1, data.shape[-1])
    # Each row of the input is one sequence, on every rank of the tp x cp group that
    # holds parts of it (cp's chunks and tp's share are cut along the tokens): the
    # balance loss's counts are summed per row over ``spec.counts``.
    m = k.ctx.model
    # keyed by block and microbatch: a recomputed forward counts once
    key = (step, mb, by_suffix["router.weight"])
    bias, count, drops = moe_dispatch.gate_hooks(k, spec, step, mb)
    positions = k.positions(spec)  # of this rank's tokens in their sequence: capacity's
    if spec.peers is not None and spec.peers.size > 1:
        out = expert_parallel_mixture(
            flat, weights_of, m, spec.peers, data.shape[0], m.batch, spec.counts,
            lambda rows: k.routed.__setitem__(key, (rows, spec.peers.members)), bias, count,
            positions, drops)
    else:
        out = mixture(flat, weights_of, m, data.shape[0], m.batch, counts_over=spec.counts,
                      bias=bias, count=count, positions=positions, drops=drops)
    return out.reshape(data.shape)


FORMULAS = llama.FORMULAS  # optimize { compile }: llama's kernels read them
KERNELS = {**llama.KERNELS, Op.MOE: moe,
           # cut at its all-to-alls (schedule { overlap_all_to_all })
           Op.MOE_ROUTE: moe_dispatch.route, Op.MOE_SHARED: moe_dispatch.shared,
           Op.MOE_EXPERTS: moe_dispatch.experts, Op.MOE_COMBINE: moe_dispatch.total}


def reference_state(m) -> dict | None:
    """What the reference keeps from step to step: the balancing bias of every mixture
    block (zeros at first), None without it."""
    if not balanced(m):
        return None
    return {"bias": {layer: torch.zeros(m.experts, dtype=torch.float32)
                     for layer in balanced_layers(m)}, "chosen": {}}


def reference_step_end(m, state: dict | None) -> None:
    """After the reference's optimizer step: every block's bias updated from the step's
    counts (planc.runtime.families.moe_gate.update_bias)."""
    if state is None:
        return
    for layer, bias in state["bias"].items():
        update_bias(bias, state["chosen"].pop(layer).to(torch.float64),
                    m.options["bias_update"])


def reference_objective(m, params: dict[str, torch.Tensor], tokens: torch.Tensor,
                        dtype: torch.dtype, state: dict | None = None,
                        counting: bool = True, attention=None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """The single-process reference (planc.runtime.oracle.reference): llama's, with the mixture
    in the blocks from ``first_dense`` on; (what is differentiated: the cross-entropy
    plus the balance loss of every mixture block averaged over the batch's sequences,
    what is reported: the cross-entropy, as Megatron-LM reports its lm loss). ``state``:
    :func:`reference_state`, whose biases route and, when ``counting`` (training, not an
    evaluation), whose counts the batch's choices add to. ``attention``: a block's
    attention in place of llama's (planc.runtime.families.llama.reference_loss)."""
    balance: list[torch.Tensor] = []

    def mlp(layer: int, h: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
        if layer < m.first_dense:
            return llama.dense_mlp(layer, h, w, fp8.recipe_of(m))
        bias = count = None
        if state is not None:
            bias = state["bias"][layer]
            if counting:
                count = lambda per_expert: state["chosen"].__setitem__(  # noqa: E731
                    layer, state["chosen"].get(layer, 0) + per_expert)
        out = mixture(h.reshape(-1, h.shape[-1]), w.__getitem__, m, h.shape[0], h.shape[0],
                      balance, bias=bias, count=count)
        return out.reshape(h.shape)

    loss = llama.reference_loss(m, params, tokens, dtype, mlp, attention)
    return loss + sum(balance, torch.zeros(())), loss


def reference_loss(m, params: dict[str, torch.Tensor], tokens: torch.Tensor,
                   dtype: torch.dtype) -> torch.Tensor:
    """The reported loss of the reference: the cross-entropy."""
    return reference_objective(m, params, tokens, dtype)[1]
