"""The gpt family's own kernels: LayerNorm, multi-head attention, GELU (tanh).

Each kernel runs on the local tensors the instruction's operands say the rank holds; the
shared ones (linear, embedding, residual, loss) are in planc.runtime.kernels.
"""

from __future__ import annotations

import torch.nn.functional as F

from planc.graph.ir import Op

LN_EPS = 1e-5


def layer_norm(k, spec, x, p, step, mb, extra):
    weight, bias = spec.params
    return F.layer_norm(x["x"], (k.hidden,), p(weight), p(bias), LN_EPS)


def attention(k, spec, x, p, step, mb, extra):
    """Causal softmax attention on this rank's heads; keys and values of every cp rank
    when context parallelism gathered them."""
    qkv = x["x"]
    bias = k._bias(spec, p)
    if bias is not None:
        qkv = qkv + bias
    b, s, width = qkv.shape
    hd = k.head_dim
    heads = width // (3 * hd)
    q, key, v = qkv.view(b, s, 3, heads, hd).permute(2, 0, 3, 1, 4).unbind(0)
    if "kv" not in x:
        out = F.scaled_dot_product_attention(q, key, v, is_causal=True)
    else:
        kv = x["kv"]
        key, v = kv.view(b, kv.shape[1], 2, heads, hd).permute(2, 0, 3, 1, 4).unbind(0)
        query = k.ctx.positions(seq_sharded=False)
        keys = k.ctx.all_key_positions()
        allowed = keys.unsqueeze(0) <= query.unsqueeze(1)
        out = F.scaled_dot_product_attention(q, key, v, attn_mask=allowed)
    return out.transpose(1, 2).reshape(b, s, heads * hd)


def gelu(k, spec, x, p, step, mb, extra):
    bias = k._bias(spec, p)
    value = x["x"] if bias is None else x["x"] + bias
    return F.gelu(value, approximate="tanh")


KERNELS = {Op.LN1: layer_norm, Op.LN2: layer_norm, Op.FINAL_LN: layer_norm,
           Op.ATTENTION: attention, Op.GELU: gelu}
