"""The gate of the moe family's mixture: which experts each token goes to, and with
what weights, as planc.models.moe defines it (docs/language.md, model moe).

The router's scores in fp32 (Mixtral's and Qwen3's softmax, or DeepSeek-V3's sigmoid),
each token's top_k with ties to the lower expert index, DeepSeek-V3's node-limited
routing and its balancing bias, the weights renormalised and scaled; and with a
capacity, which of the chosen (token, expert) pairs the experts take. The kernels
(planc.runtime.families.moe) and the single-process reference route through it alike.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from planc.vocabulary.model_options import expert_capacity, expert_groups_of



def route(tokens: torch.Tensor, router: torch.Tensor, k: int, norm_topk: bool,
          score: str = "softmax", scale: float = 1.0, groups: tuple[int, int] | None = None,
          bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(experts, weights), each (tokens, k): every token's k highest-scoring experts,
    highest first and ties to the lower index (a stable sort), and their scores in fp32,
    renormalised over the k when ``norm_topk``, times ``scale``; ``groups``: (groups,
    chosen), the experts of a token's ``chosen`` best groups alone; ``bias``: the
    balancing bias that steers the choice (:func:`top_k`)."""
    return top_k(probabilities_of(tokens, router, score), k, norm_topk, scale, groups, bias)


def score_of(m) -> str:
    """The router's score: ``softmax`` (Mixtral, Qwen3) or ``sigmoid`` (DeepSeek-V3)."""
    return m.options.get("score") or "softmax"


def scale_of(m) -> float:
    """DeepSeek-V3's routed scaling factor (``routed_scale``), 1 unless written."""
    return m.options.get("routed_scale") or 1.0


def balanced(m) -> bool:
    """Whether the routing carries DeepSeek-V3's balancing bias (``bias_update`` set)."""
    return m.options.get("bias_update") is not None


def choose(tokens: torch.Tensor, weights_of, m, bias: torch.Tensor | None = None, count=None
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(scores, experts, weights) of ``tokens``: the router's fp32 scores, each token's
    top_k experts and their weights (:func:`top_k`); ``count(per_expert)`` is told how
    many of the tokens chose each expert, what the balancing bias's update sums."""
    probabilities = probabilities_of(tokens, weights_of("router.weight"), score_of(m))
    experts, weights = top_k(probabilities, m.top_k, m.norm_topk, scale_of(m),
                             expert_groups_of(m), bias)
    if count is not None:
        count(torch.bincount(experts.reshape(-1), minlength=m.experts))
    return probabilities, experts, weights


def kept(experts: torch.Tensor, sequences: int, positions: torch.Tensor, m, over=None
         ) -> torch.Tensor:
    """Which of ``experts`` (n, top_k: the choices of this rank's tokens, ``sequences``
    rows of tokens at ``positions`` in their sequence) the experts take under ``capacity``:
    each expert the first ``expert_capacity(m)`` tokens of each sequence that chose it, in
    the order of their positions (GShard's and Megatron-Core's ``position`` policy); the
    others are dropped. With ``over`` (kernels.Peers: the ranks holding the other parts of
    the same sequences) the choices and positions of every part are gathered first, so
    that every plan drops the same tokens as one process holding whole sequences."""
    part = experts.reshape(sequences, -1, m.top_k)
    if over is not None and over.size > 1:
        parts = [torch.empty_like(part) for _ in range(over.size)]
        dist.all_gather(parts, part.contiguous(), group=over.group)
        places = [torch.empty_like(positions) for _ in range(over.size)]
        dist.all_gather(places, positions.contiguous(), group=over.group)
        whole, where = torch.cat(parts, dim=1), torch.cat(places)
        mine = slice(over.index * part.shape[1], (over.index + 1) * part.shape[1])
    else:
        whole, where, mine = part, positions, slice(None)
    order = torch.argsort(where)
    chosen = whole[:, order]  # (sequences, tokens, top_k), tokens by position
    picked = torch.zeros(*chosen.shape[:2], m.experts, dtype=torch.int64,
                         device=experts.device).scatter_(2, chosen, 1)
    earlier = picked.cumsum(1) - picked  # tokens before this one that chose each expert
    taken = earlier.gather(2, chosen) < expert_capacity(m)
    keep = torch.empty_like(taken)
    keep[:, order] = taken
    return keep[:, mine].reshape(experts.shape)


def routed_pairs(experts: torch.Tensor, sequences: int, positions, m, over=None,
                 drops=None) -> torch.Tensor:
    """``experts`` with the (token, slot) pairs ``capacity`` drops set to -1 (none
    without it): what the experts run; ``positions``: those of each sequence's tokens
    (whole sequences in order when None); ``drops(dropped, pairs)`` is told how many of
    the pairs were dropped."""
    if m.options.get("capacity") is None:
        return experts
    if positions is None:
        positions = torch.arange(experts.shape[0] // sequences, device=experts.device)
    keep = kept(experts, sequences, positions, m, over)
    if drops is not None:
        drops(int(keep.numel() - keep.sum()), keep.numel())
    return experts.masked_fill(~keep, -1)


def sorted_pairs(chosen: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The kept (token, slot) pairs of ``chosen`` (flat, -1 where capacity dropped one)
    sorted by expert, then token and slot: their positions in ``chosen``, and their
    tokens."""
    pairs = (chosen >= 0).nonzero(as_tuple=True)[0]
    order = pairs[torch.sort(chosen[pairs], stable=True).indices]
    return order, order // top_k


def update_bias(bias: torch.Tensor, load: torch.Tensor, rate: float) -> None:
    """DeepSeek-V3's bias update (DeepSeek-AI 2024, section 2.1.2; Megatron-Core's
    ``moe_router_bias_update_rate``): ``b_i += rate * sign(mean(load) - load_i)``, in
    place; ``load``: how many of the step's (token, slot) pairs chose each expert,
    in fp64 (integers, or integers times the same factor: only their order matters)."""
    direction = torch.sign(load.mean() - load).to(bias.dtype)
    bias.add_(direction, alpha=rate)


def probabilities_of(tokens: torch.Tensor, router: torch.Tensor, score: str = "softmax"
                     ) -> torch.Tensor:
    """The router's scores in fp32: softmax probabilities, or DeepSeek-V3's sigmoid
    affinities (DeepSeek-AI 2024, eq. 15)."""
    logits = tokens.float() @ router.float()
    return torch.sigmoid(logits) if score == "sigmoid" else torch.softmax(logits, dim=-1)


def top_k(probabilities: torch.Tensor, k: int, norm_topk: bool, scale: float = 1.0,
          groups: tuple[int, int] | None = None, bias: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """With ``groups`` = (G, M), DeepSeek-V3's node-limited routing (DeepSeek-AI 2024,
    section 2.1.2, as its released code does it): the experts are G contiguous groups, a
    group scores the sum of its two best experts' scores, and a token's k experts come
    from its M best groups (ties to the lower group); the others are never chosen.

    With ``bias`` (fp32, one per expert: DeepSeek-V3's auxiliary-loss-free balancing,
    eq. 16), the choice, of the groups too, ranks ``probabilities + bias``; the weights
    stay the unbiased scores of the chosen."""
    candidates = probabilities if bias is None else probabilities + bias
    if groups is not None and groups[1] < groups[0]:
        per_group = candidates.reshape(candidates.shape[0], groups[0], -1)
        best = torch.sort(per_group, dim=-1, descending=True).values[..., :2].sum(-1)
        kept = torch.sort(best, dim=-1, descending=True, stable=True).indices[:, :groups[1]]
        mask = torch.zeros_like(best, dtype=torch.bool).scatter_(1, kept, True)
        candidates = candidates.masked_fill(
            ~mask.repeat_interleave(per_group.shape[-1], dim=1), float("-inf"))
    chosen = torch.sort(candidates, dim=-1, descending=True, stable=True).indices[:, :k]
    weights = probabilities.gather(-1, chosen)
    if norm_topk:
        weights = weights / weights.sum(-1, keepdim=True)
    return chosen, weights * scale if scale != 1.0 else weights


def balance_loss(probabilities: torch.Tensor, chosen: torch.Tensor, sequences: int,
                 m, counts_over=None) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise load-balancing loss (DeepSeek-AI 2024, eqs. 17-20),
    summed over ``sequences`` whose tokens ``probabilities`` (n, experts) and ``chosen``
    (n, top_k) hold in order: per sequence of T tokens, ``aux_loss * sum_i f_i P_i`` with
    ``f_i = experts / (top_k T) * (tokens routed to i)`` (no gradient) and ``P_i`` the
    mean over the tokens of the softmax probability of i (already normalised).

    With ``counts_over`` (kernels.Peers: the ranks holding the other parts of the same
    sequences, tp x cp) the rows are this rank's part of each sequence: the counts are
    summed over the group (one all-reduce) and the part's tokens add their probabilities
    over the whole T. Since f carries no gradient, the group's parts sum to the loss and
    each differentiates exactly its own tokens' probabilities (Megatron-Core's
    sequence_load_balancing_loss_func all-reduces its counts over the sequence's
    partition group the same way)."""
    if score_of(m) == "sigmoid":  # eq. 19: each token's affinities normalised to sum to 1
        probabilities = probabilities / probabilities.sum(-1, keepdim=True)
    per_sequence = probabilities.reshape(sequences, -1, m.experts)
    part = per_sequence.shape[1]
    routed = torch.zeros(sequences, part * m.top_k, m.experts, dtype=torch.float32,
                         device=probabilities.device)
    routed.scatter_(-1, chosen.reshape(sequences, -1, 1), 1.0)
    counts = routed.sum(1)  # integers: exact in fp32, in any order of summation
    tokens = part
    if counts_over is not None and counts_over.size > 1:
        dist.all_reduce(counts, group=counts_over.group)
        tokens = part * counts_over.size
    f = counts * (m.experts / (m.top_k * tokens))
    return m.aux_loss * (f * per_sequence.sum(1)).sum() / tokens


class WithBalanceLoss(torch.autograd.Function):
    """The mixture's output, unchanged; its backward also differentiates the balance loss
    (with gradient 1), which joins the objective without passing along the network
    (Megatron-Core's MoEAuxLossAutoScaler does the same)."""

    @staticmethod
    def forward(ctx, output, loss):
        ctx.loss_dtype, ctx.loss_device = loss.dtype, loss.device
        return output

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.ones((), dtype=ctx.loss_dtype, device=ctx.loss_device)
