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


def route(tokens: torch.Tensor, router: torch.Tensor, top_k: int, norm_topk: bool
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(experts, weights), each (tokens, top_k): every token's k most probable experts,
    most probable first and ties to the lower index (a stable sort), and their softmax
    probabilities in fp32, renormalised over the k when ``norm_topk``."""
    probabilities = torch.softmax(tokens.float() @ router.float(), dim=-1)
    chosen = torch.sort(probabilities, dim=-1, descending=True, stable=True).indices[:, :top_k]
    weights = probabilities.gather(-1, chosen)
    if norm_topk:
        weights = weights / weights.sum(-1, keepdim=True)
    return chosen, weights


def mixture(tokens: torch.Tensor, weights_of, m) -> torch.Tensor:
    """The mixture's output for ``tokens`` (n, hidden); ``weights_of(name)``: a weight
    of the block by its name within the block, in the model's dtype."""
    experts, weights = route(tokens, weights_of("router.weight"), m.top_k, m.norm_topk)
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
    return out


def moe(k, spec, x, p, step, mb, extra):
    data = x["x"]
    by_suffix = {name.split(".", 2)[-1]: name for name in spec.params}
    out = mixture(data.reshape(-1, data.shape[-1]), lambda name: p(by_suffix[name]),
                  k.ctx.model)
    return out.reshape(data.shape)


KERNELS = {**llama.KERNELS, Op.MOE: moe}


def reference_loss(m, params: dict[str, torch.Tensor], tokens: torch.Tensor,
                   dtype: torch.dtype) -> torch.Tensor:
    """The single-process reference (planc.runtime.reference): llama's, with the mixture
    in the blocks from ``first_dense`` on."""
    def mlp(layer: int, h: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
        if layer < m.first_dense:
            return llama.dense_mlp(layer, h, w)
        return mixture(h.reshape(-1, h.shape[-1]), w.__getitem__, m).reshape(h.shape)

    return llama.reference_loss(m, params, tokens, dtype, mlp)
