"""The compute steps of the gpt model on one rank's shards, forward and backward.

Every compute node of the graph runs here on the local tensors its layouts say it holds
(planc/graph/tensor_parallel.py): a column-parallel linear multiplies by its columns, a
vocabulary-parallel embedding looks up its rows and zeroes the rest, attention runs on
its heads and, under context parallelism, on the keys and values the transfers brought.
A forward step keeps what its backward needs; the backward step asks autograd for the
gradients of that one step (the inputs and the parameters it used), except for the
loss, whose gradient (softmax minus one-hot) is written out so the vocabulary-parallel
form needs no gather of the logits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from planc.graph.layouts import S, parse
from planc.graph.model import LINEAR_DIMS
from planc.graph.tensor_parallel import OpLayout, ParamUse
from planc.runtime.context import RankContext
from planc.runtime.model import split_feature
from planc.runtime.reference import LN_EPS

FP32 = torch.float32


@dataclass
class Saved:
    """What a forward step keeps for its backward."""

    inputs: dict[str, torch.Tensor]  # leaves, by input port
    params: dict[str, torch.Tensor]  # leaves, by global parameter name
    output: torch.Tensor | None  # with its autograd graph (None if run without one)
    extra: dict = field(default_factory=dict)


def _param_name(name: str, layer: int | None) -> str:
    from planc.graph.derive import GLOBAL_PARAMETERS

    return name if layer is None or name in GLOBAL_PARAMETERS else f"layers.{layer}.{name}"


class Kernels:
    def __init__(self, ctx: RankContext):
        self.ctx = ctx
        self.h = ctx.plan.model.hidden
        self.hd = ctx.plan.model.hidden // ctx.plan.model.heads

    # --- parameters --------------------------------------------------------------------

    def use_view(self, value: torch.Tensor, use: ParamUse) -> torch.Tensor:
        """A replicated parameter applied to data sharded along one of its own dims is
        used through its slice (the position table's rows are indexed instead)."""
        data = use.data
        if use.storage.is_sharded or not data.is_sharded or data.dim not in use.dims or \
                data.dim == "seq" or self.ctx.tp == 1:
            return value
        return split_feature(value, data.dim, self.ctx.tp, self.ctx.tp_rank, self.ctx.heads,
                             use.dims.index(data.dim))

    # --- forward -----------------------------------------------------------------------

    def forward(self, data: dict, inputs: dict[str, torch.Tensor],
                params: dict[str, torch.Tensor], step: int, microbatch: int,
                keep_graph: bool) -> tuple[torch.Tensor, Saved]:
        """Run one forward compute node. ``params``: global name -> tensor as stored."""
        name, layer = data["name"], data["layer"]
        layout = self.ctx.tpp.ops[name]
        if data.get("part"):
            return self._loss_part(data["part"], inputs), Saved({}, {}, None)
        leaves = {port: t.detach().requires_grad_(keep_graph and t.is_floating_point())
                  for port, t in inputs.items()}
        param_leaves = {n: t.detach().requires_grad_(keep_graph) for n, t in params.items()}

        def p(short: str) -> torch.Tensor:
            global_name = _param_name(short, layer)
            use = next(u for u in layout.params if u.name == short)
            return self.use_view(param_leaves[global_name].to(self.ctx.dtype), use)

        with torch.enable_grad() if keep_graph else torch.no_grad():
            out, extra = self._forward_op(name, layout, leaves, p, step, microbatch)
        return out, Saved(leaves, param_leaves, out if keep_graph else None, extra)

    def _forward_op(self, name: str, layout: OpLayout, x: dict, p, step: int, mb: int):
        ctx = self.ctx
        extra: dict = {}
        if name == "embedding":
            ids, _ = ctx.microbatch(step, mb, layout.input)
            table = p("embedding.weight")
            if layout.params[0].storage == S("vocab") and ctx.tp > 1:
                rows = table.shape[0]
                local = ids - ctx.tp_rank * rows
                owned = (local >= 0) & (local < rows)
                out = table[local.clamp(0, rows - 1)] * owned.unsqueeze(-1)
            else:
                out = table[ids]
            return out, extra
        if name == "position":
            positions = ctx.positions(layout.input)
            return x["x"] + p("position.weight")[positions], extra
        if name in ("ln1", "ln2", "final_ln"):
            return F.layer_norm(x["x"], (self.h,), p(f"{name}.weight"), p(f"{name}.bias"),
                                LN_EPS), extra
        if name in LINEAR_DIMS:
            if name == "head" and ctx.plan.model.tie_embeddings:
                return x["x"] @ p("embedding.weight").t(), extra
            out = x["x"] @ p(f"{name}.weight")
            if any(u.name == f"{name}.bias" for u in layout.params):
                out = out + p(f"{name}.bias")
            return out, extra
        # A row-parallel producer's bias, added once its partial sum has been reduced.
        bias = p(f"{layout.bias_from}.bias") if layout.bias_from else None
        if name == "attention":
            if bias is not None:
                x = {**x, "x": x["x"] + bias}
            return self._attention(x), extra
        if name == "gelu":
            value = x["x"] if bias is None else x["x"] + bias
            return F.gelu(value, approximate="tanh"), extra
        if name in ("attn_residual", "mlp_residual"):
            out = x["skip"] + x["x"]
            return (out if bias is None else out + bias), extra
        if name == "loss":
            return self._loss(layout, x, step, mb, extra), extra
        raise KeyError(name)

    def _attention(self, x: dict) -> torch.Tensor:
        """Causal softmax attention on this rank's heads; keys and values of every cp rank
        when context parallelism gathered them."""
        qkv = x["x"]
        b, s, width = qkv.shape
        heads = width // (3 * self.hd)
        q, k, v = qkv.view(b, s, 3, heads, self.hd).unbind(2)
        query_positions = self.ctx.positions(parse("R"))
        key_positions = query_positions
        if "kv" in x:
            kv = x["kv"]
            k, v = kv.view(b, kv.shape[1], 2, heads, self.hd).unbind(2)
            key_positions = self.ctx.all_key_positions()
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(self.hd)
        future = key_positions.unsqueeze(0) > query_positions.unsqueeze(1)
        scores = scores.masked_fill(future, float("-inf"))
        context = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)
        return context.reshape(b, s, heads * self.hd)

    # --- the loss ----------------------------------------------------------------------

    def _loss_part(self, part: str, inputs: dict) -> torch.Tensor:
        logits = inputs["x"].detach().to(FP32)
        if part == "max":
            return logits.max(dim=-1).values
        return (logits - inputs["max"].unsqueeze(-1)).exp().sum(dim=-1)

    def _loss(self, layout: OpLayout, x: dict, step: int, mb: int, extra: dict):
        """This rank's share of the step's mean cross-entropy (a scalar): the sum over its
        tokens divided by every token of the global batch."""
        ctx = self.ctx
        logits = x["x"].detach().to(FP32)
        _, targets = ctx.microbatch(step, mb, layout.input if layout.input == S("seq")
                                    else parse("R"))
        total = ctx.tokens_per_step
        if "max" in x:  # vocabulary-parallel: max and sum of exponentials reduced over tp
            vocab_local = logits.shape[-1]
            local = targets - ctx.tp_rank * vocab_local
            owned = (local >= 0) & (local < vocab_local)
            lse = x["sum_exp"].log() + x["max"]
            target_logit = logits.gather(-1, local.clamp(0, vocab_local - 1).unsqueeze(-1))
            loss = ((lse - target_logit.squeeze(-1)) * owned).sum() / total
            extra.update(logits=logits, max=x["max"], sum_exp=x["sum_exp"], local=local,
                         owned=owned)
            return loss
        log_probs = logits.log_softmax(dim=-1)
        loss = -log_probs.gather(-1, targets.unsqueeze(-1)).sum() / total
        extra.update(log_probs=log_probs, targets=targets)
        if layout.input == parse("R") and ctx.tp > 1:
            loss = loss / ctx.tp  # every tp rank holds the whole loss: report it once
        return loss

    def _loss_backward(self, saved: Saved) -> dict[str, torch.Tensor]:
        extra, total = saved.extra, self.ctx.tokens_per_step
        if "owned" in extra:
            probs = (extra["logits"] - extra["max"].unsqueeze(-1)).exp() / \
                extra["sum_exp"].unsqueeze(-1)
            one_hot = torch.zeros_like(probs)
            one_hot.scatter_(-1, extra["local"].clamp(0, probs.shape[-1] - 1).unsqueeze(-1),
                             extra["owned"].unsqueeze(-1).to(probs.dtype))
        else:
            probs = extra["log_probs"].exp()
            one_hot = torch.zeros_like(probs)
            one_hot.scatter_(-1, extra["targets"].unsqueeze(-1), 1.0)
        return {"x": ((probs - one_hot) / total).to(self.ctx.dtype)}

    # --- backward ----------------------------------------------------------------------

    def backward(self, data: dict, saved: Saved, grad: torch.Tensor | None) -> dict:
        """Gradients of one compute node: by input port, and ``param:NAME``."""
        if data["name"] == "loss":
            return self._loss_backward(saved)
        inputs = [(port, t) for port, t in saved.inputs.items() if t.requires_grad]
        params = list(saved.params.items())
        targets = [t for _, t in inputs] + [t for _, t in params]
        if saved.output is None or not targets:
            return {}
        grads = torch.autograd.grad(saved.output, targets, grad.to(saved.output.dtype),
                                    allow_unused=True)
        out: dict[str, torch.Tensor] = {}
        for (port, tensor), g in zip(inputs, grads[:len(inputs)]):
            out[port] = torch.zeros_like(tensor) if g is None else g
        for (name, tensor), g in zip(params, grads[len(inputs):]):
            out[f"param:{name}"] = (torch.zeros_like(tensor) if g is None else g).to(FP32)
        return out
