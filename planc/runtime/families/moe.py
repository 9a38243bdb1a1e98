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
import torch.nn.functional as F

from planc.graph.vocabulary import Op
from planc.runtime.families import llama


def route(tokens: torch.Tensor, router: torch.Tensor, k: int, norm_topk: bool
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(experts, weights), each (tokens, k): every token's k most probable experts, most
    probable first and ties to the lower index (a stable sort), and their softmax
    probabilities in fp32, renormalised over the k when ``norm_topk``."""
    return top_k(torch.softmax(tokens.float() @ router.float(), dim=-1), k, norm_topk)


def top_k(probabilities: torch.Tensor, k: int, norm_topk: bool
          ) -> tuple[torch.Tensor, torch.Tensor]:
    chosen = torch.sort(probabilities, dim=-1, descending=True, stable=True).indices[:, :k]
    weights = probabilities.gather(-1, chosen)
    if norm_topk:
        weights = weights / weights.sum(-1, keepdim=True)
    return chosen, weights


def balance_loss(probabilities: torch.Tensor, chosen: torch.Tensor, sequences: int,
                 m) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise load-balancing loss (DeepSeek-AI 2024, eqs. 17-20),
    summed over ``sequences`` whose tokens ``probabilities`` (n, experts) and ``chosen``
    (n, top_k) hold in order: per sequence of T tokens, ``aux_loss * sum_i f_i P_i`` with
    ``f_i = experts / (top_k T) * (tokens routed to i)`` (no gradient) and ``P_i`` the
    mean over the tokens of the softmax probability of i (already normalised)."""
    per_sequence = probabilities.reshape(sequences, -1, m.experts)
    tokens = per_sequence.shape[1]
    routed = torch.zeros(sequences, tokens * m.top_k, m.experts, dtype=torch.float32,
                         device=probabilities.device)
    routed.scatter_(-1, chosen.reshape(sequences, -1, 1), 1.0)
    f = routed.sum(1) * (m.experts / (m.top_k * tokens))
    return m.aux_loss * (f * per_sequence.mean(1)).sum()


class _WithBalanceLoss(torch.autograd.Function):
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


def mixture(tokens: torch.Tensor, weights_of, m, sequences: int = 1, batch: int = 1,
            balance: bool = True) -> torch.Tensor:
    """The mixture's output for ``tokens`` (n, hidden) of ``sequences`` whole sequences
    of a batch of ``batch``; ``weights_of(name)``: a weight of the block by its name
    within the block, in the model's dtype. With ``aux_loss`` (and ``balance``) the
    balance loss of those sequences, divided by the batch, joins the backward."""
    probabilities = torch.softmax(tokens.float() @ weights_of("router.weight").float(), -1)
    experts, weights = top_k(probabilities, m.top_k, m.norm_topk)
    weights = weights.to(tokens.dtype)
    gate, up, down = (weights_of(f"experts.{w}.weight") for w in ("gate", "up", "down"))
    out = torch.zeros_like(tokens)
    for expert in range(m.experts):
        rows, slots = (experts == expert).nonzero(as_tuple=True)
        if rows.numel() == 0:
            continue
        x = tokens[rows]
        y = (F.silu(x @ gate[expert]) * (x @ up[expert])) @ down[expert]
        out = out.index_add(0, rows, y * weights[rows, slots].unsqueeze(-1))
    if m.shared_experts:
        out = out + llama.dense_mlp(-1, tokens, {
            f"{w}.weight": weights_of(f"shared.{w}.weight") for w in ("gate", "up", "down")})
    if m.aux_loss and balance:
        loss = balance_loss(probabilities, experts, sequences, m) / batch
        out = _WithBalanceLoss.apply(out, loss)
    return out


def moe(k, spec, x, p, step, mb, extra):
    data = x["x"]
    by_suffix = {name.split(".", 2)[-1]: name for name in spec.params}
    # With aux_loss the mixture holds whole sequences (planc.models.moe): the rows.
    out = mixture(data.reshape(-1, data.shape[-1]), lambda name: p(by_suffix[name]),
                  k.ctx.model, data.shape[0], k.ctx.model.batch)
    return out.reshape(data.shape)


KERNELS = {**llama.KERNELS, Op.MOE: moe}


def reference_objective(m, params: dict[str, torch.Tensor], tokens: torch.Tensor,
                        dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The single-process reference (planc.runtime.reference): llama's, with the mixture
    in the blocks from ``first_dense`` on; (what is differentiated: the cross-entropy
    plus the balance loss of every mixture block averaged over the batch's sequences,
    what is reported: the cross-entropy, as Megatron-LM reports its lm loss)."""
    balance = []

    def mlp(layer: int, h: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
        if layer < m.first_dense:
            return llama.dense_mlp(layer, h, w)
        flat = h.reshape(-1, h.shape[-1])
        out = mixture(flat, w.__getitem__, m, balance=False)
        if m.aux_loss:
            probabilities = torch.softmax(flat.float() @ w["router.weight"].float(), -1)
            chosen, _ = top_k(probabilities, m.top_k, m.norm_topk)
            balance.append(balance_loss(probabilities, chosen, h.shape[0], m) / h.shape[0])
        return out.reshape(h.shape)

    loss = llama.reference_loss(m, params, tokens, dtype, mlp)
    return loss + sum(balance, torch.zeros(())), loss


def reference_loss(m, params: dict[str, torch.Tensor], tokens: torch.Tensor,
                   dtype: torch.dtype) -> torch.Tensor:
    """The reported loss of the reference: the cross-entropy."""
    return reference_objective(m, params, tokens, dtype)[1]
