"""The gpt family's own kernels: LayerNorm, multi-head attention, GELU (tanh).

Each kernel runs on the local tensors the instruction's operands say the rank holds; the
shared ones (linear, embedding, residual, loss) are in planc.runtime.engine.kernels.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from planc.graph.vocabulary import Op
from planc.runtime.families.recomputed_output import MADE_AGAIN

LN_EPS = 1e-5


def layer_norm(k, spec, x, p, step, mb, extra):
    weight, bias = spec.params
    value, scale, shift = x["x"], p(weight), p(bias)
    out = F.layer_norm(value, (k.hidden,), scale, shift, LN_EPS)
    if spec.op is not Op.FINAL_LN and k.ctx.model.recompute_norms:
        # the GEMM reading it keeps how to make it (llama.rms_norm's reasons)
        scale, shift, width = scale.detach().clone(), shift.detach().clone(), (k.hidden,)
        extra[MADE_AGAIN] = k.recipes.remember(
            out, value.detach(), lambda kept: F.layer_norm(kept, width, scale, shift, LN_EPS))
    return out


def attention(k, spec, x, p, step, mb, extra):
    """Causal softmax attention on this rank's heads; keys and values of every cp rank
    when context parallelism gathered them, or travelling the cp ring (ring attention)."""
    qkv = x["x"]
    bias = k._bias(spec, p)
    if bias is not None:
        qkv = qkv + bias
    b, s, width = qkv.shape
    hd = k.head_dim
    heads = width // (3 * hd)
    q, key, v = qkv.view(b, s, 3, heads, hd).permute(2, 0, 3, 1, 4).unbind(0)
    if spec.ring is not None:
        out = k.ring_attention(spec, q, key, v)
    elif "kv" not in x:
        out = F.scaled_dot_product_attention(q, key, v, is_causal=True)
    else:
        kv = x["kv"]
        if bias is not None:  # a row-parallel qkv's bias, added after its reduction:
            kv = kv + bias[heads * hd:]  # every cp rank's keys and values take it too
        key, v = kv.view(b, kv.shape[1], 2, heads, hd).permute(2, 0, 3, 1, 4).unbind(0)
        query = k.ctx.positions(seq_sharded=False)
        keys = k.ctx.all_key_positions()
        allowed = keys.unsqueeze(0) <= query.unsqueeze(1)
        out = F.scaled_dot_product_attention(q, key, v, attn_mask=allowed)
    return out.transpose(1, 2).reshape(b, s, heads * hd)


def tanh_gelu(value: torch.Tensor) -> torch.Tensor:
    return F.gelu(value, approximate="tanh")


def gelu(k, spec, x, p, step, mb, extra):
    bias = k._bias(spec, p)
    value = x["x"] if bias is None else x["x"] + bias
    out = tanh_gelu(value)
    if k.ctx.model.recompute_activation:  # the down projection keeps how to make it
        extra[MADE_AGAIN] = k.recipes.remember(out, value.detach(), tanh_gelu)
    return out


KERNELS = {Op.LN1: layer_norm, Op.LN2: layer_norm, Op.FINAL_LN: layer_norm,
           Op.ATTENTION: attention, Op.GELU: gelu}


def reference_loss(m, params: dict[str, torch.Tensor], tokens: torch.Tensor,
                   dtype: torch.dtype) -> torch.Tensor:
    """The single-process reference's loss (planc.runtime.oracle.reference): the gpt family as
    docs/language.md defines it (model gpt), on whole tensors. ``m``: the plan's model."""
    p = {k: v.to(dtype) for k, v in params.items()}
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    seq = inputs.shape[1]
    x = p["embedding.weight"][inputs] + p["position.weight"][:seq]
    hd = m.head_dim
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    for layer in range(m.layers):
        w = {k[len(f"layers.{layer}."):]: v for k, v in p.items()
             if k.startswith(f"layers.{layer}.")}
        h = F.layer_norm(x, (m.hidden,), w["ln1.weight"], w["ln1.bias"], LN_EPS)
        qkv = h @ w["qkv.weight"] + w["qkv.bias"]
        q, k, v = qkv.view(*qkv.shape[:2], 3, m.heads, hd).unbind(2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
        scores = scores.masked_fill(~causal, float("-inf"))
        context = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)
        x = x + context.reshape(*x.shape) @ w["proj.weight"] + w["proj.bias"]
        h = F.layer_norm(x, (m.hidden,), w["ln2.weight"], w["ln2.bias"], LN_EPS)
        h = F.gelu(h @ w["fc1.weight"] + w["fc1.bias"], approximate="tanh")
        x = x + h @ w["fc2.weight"] + w["fc2.bias"]
    x = F.layer_norm(x, (m.hidden,), p["final_ln.weight"], p["final_ln.bias"], LN_EPS)
    head = p["embedding.weight"].t() if m.tie_embeddings else p["head.weight"]
    logits = (x @ head).float()
    return F.cross_entropy(logits.reshape(-1, m.vocab), targets.reshape(-1))
