"""The deepseek family's own kernels: multi-head latent attention as Hugging Face
transformers' ``DeepseekV3Attention`` computes it (DeepSeek-V2, arXiv 2405.04434,
section 2.1), then the moe family's mixture.

``qkv`` makes the heads' q, k and v from the two latents (each normalised by its
RMSNorm), rotating q's and the shared key's ``rope_dim`` features with DeepSeek's
interleaved RoPE (features 2i and 2i + 1 turn by the i-th frequency, written back as
two halves: transformers' ``apply_rotary_pos_emb_interleave``); ``attention`` runs them
causally, scaled by ``1 / sqrt(nope_dim + rope_dim)``, with values ``v_dim`` wide.
Every projection is a GEMM of the model's FP8 recipe when it has one (DeepSeek-V3's
linear layers, section 3.3).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from planc.graph.vocabulary import Op
from planc.runtime.engine import fp8
from planc.runtime.families import llama, moe
from planc.runtime.families.moe import reference_state, reference_step_end

__all__ = ("FORMULAS", "KERNELS", "latent_heads", "query_width", "reference_loss",
           "reference_objective", "reference_state", "reference_step_end")


def interleaved_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Pairs (x[2i], x[2i+1]) turned by angle i; the turned firsts, then the seconds.
    ``cos``, ``sin``: one angle a pair, broadcast against ``x``'s leading dimensions."""
    first, second = x[..., 0::2], x[..., 1::2]
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)


def latent_heads(m, h: torch.Tensor, weight, positions: torch.Tensor, recipe
                 ) -> torch.Tensor:
    """[q | k | v] of every head, side by side, from the block's normed input ``h``
    (batch, tokens, hidden) at ``positions``: ``weight(name)`` gives the block's MLA
    parameters by their names in the block (``q_a.weight``, ...), the up-projections
    whole or a tp rank's shard of them, whose heads it then makes."""
    b, s, _ = h.shape
    nope, rope, v_dim = m.nope_dim, m.rope_dim, m.v_dim
    heads = weight("q_b.weight").shape[1] // (nope + rope)
    latent_q = llama.normed(fp8.matmul(h, [weight("q_a.weight")], recipe),
                            weight("ln_q.weight"), m.norm_eps)
    q = fp8.matmul(latent_q, [weight("q_b.weight")], recipe).view(b, s, heads, nope + rope)
    latent_kv, key_rope = fp8.matmul(h, [weight("kv_a.weight")], recipe).split(
        [m.kv_rank, rope], dim=-1)
    latent_kv = llama.normed(latent_kv, weight("ln_kv.weight"), m.norm_eps)
    key_nope, v = fp8.matmul(latent_kv, [weight("kv_b.weight")], recipe).view(
        b, s, heads, nope + v_dim).split([nope, v_dim], dim=-1)
    cos, sin = llama.rotary_tables(positions, rope, m.rope_theta, h.dtype)
    cos, sin = cos[:, :rope // 2], sin[:, :rope // 2]  # one angle a pair
    q_rope = interleaved_rope(q[..., nope:], cos[:, None, :], sin[:, None, :])
    key_rope = interleaved_rope(key_rope, cos, sin)  # one key, shared by the heads
    q = torch.cat([q[..., :nope], q_rope], dim=-1)
    key = torch.cat([key_nope, key_rope[:, :, None, :].expand(b, s, heads, rope)], dim=-1)
    return torch.cat([q.reshape(b, s, -1), key.reshape(b, s, -1), v.reshape(b, s, -1)],
                     dim=-1)


def local_heads(m, qkv_width: int) -> int:
    """The heads in a [q | k | v] activation this wide: all, or a tp rank's."""
    return qkv_width // (2 * (m.nope_dim + m.rope_dim) + m.v_dim)


def query_width(m, qkv_width: int) -> int:
    """Features of the queries in a [q | k | v] activation this wide: what context
    parallelism leaves at home (planc.runtime.engine.transfers gathers or passes on the
    rest)."""
    return local_heads(m, qkv_width) * (m.nope_dim + m.rope_dim)


def _heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    b, s, _ = t.shape
    return t.reshape(b, s, heads, -1).transpose(1, 2)


def _split_heads(m, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as (batch, heads, tokens, features) from [q | k | v]."""
    heads, width = local_heads(m, qkv.shape[-1]), query_width(m, qkv.shape[-1])
    q, key, v = qkv.split([width, width, heads * m.v_dim], dim=-1)
    return tuple(_heads(t, heads) for t in (q, key, v))


def qkv(k, spec, x, p, step, mb, extra):
    by_suffix = {name.split(".", 2)[-1]: name for name in spec.params}
    return latent_heads(k.ctx.model, x["x"], lambda name: p(by_suffix[name]),
                        k.positions(spec), k.fp8)


def attention(k, spec, x, p, step, mb, extra):
    """Causal attention of every head, or of this tp rank's: on the tokens this rank
    holds, or over every cp rank's keys and values, gathered (``x["kv"]``) or travelling
    the cp ring, as llama's attention runs them; k and v travel together, v narrower
    than k."""
    m = k.ctx.model
    scale = 1.0 / math.sqrt(m.nope_dim + m.rope_dim)
    heads = local_heads(m, x["x"].shape[-1])
    if "kv" not in x and spec.ring is None:
        q, key, v = _split_heads(m, x["x"])
        out = F.scaled_dot_product_attention(q, key, v, is_causal=True, scale=scale)
    else:
        width = query_width(m, x["x"].shape[-1])
        q = _heads(x["x"][..., :width], heads)
        pair = x["kv"] if "kv" in x else x["x"][..., width:]
        key, v = (_heads(t, heads) for t in pair.split([width, heads * m.v_dim], dim=-1))
        if spec.ring is not None:  # scaled by q's width, nope_dim + rope_dim
            out = k.ring_attention(spec, q, key, v)
        else:
            query = k.ctx.positions(seq_sharded=False)
            allowed = k.ctx.all_key_positions().unsqueeze(0) <= query.unsqueeze(1)
            out = F.scaled_dot_product_attention(q, key, v, attn_mask=allowed, scale=scale)
    b, _, s, _ = out.shape
    return out.transpose(1, 2).reshape(b, s, heads * m.v_dim)


FORMULAS = moe.FORMULAS  # optimize { compile }: the norms' and SwiGLU's
KERNELS = {**moe.KERNELS, Op.QKV: qkv, Op.ATTENTION: attention}


def reference_attention(m):
    """A block's attention for the single-process reference, on whole tensors: the heads
    of :func:`latent_heads`, softmax of the scaled and masked scores written out, then o."""
    recipe = fp8.recipe_of(m)

    def attend(h: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
        b, seq, _ = h.shape
        q, key, v = _split_heads(m, latent_heads(m, h, w.__getitem__, torch.arange(seq),
                                                 recipe))
        scores = (q @ key.transpose(-1, -2)) / math.sqrt(m.nope_dim + m.rope_dim)
        causal = torch.ones(seq, seq, dtype=torch.bool).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        context = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, seq, -1)
        return fp8.matmul(context, [w["o.weight"]], recipe)
    return attend


def reference_objective(m, params: dict[str, torch.Tensor], tokens: torch.Tensor,
                        dtype: torch.dtype, state: dict | None = None,
                        counting: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The moe family's reference with multi-head latent attention in every block."""
    return moe.reference_objective(m, params, tokens, dtype, state, counting,
                                   attention=reference_attention(m))


def reference_loss(m, params: dict[str, torch.Tensor], tokens: torch.Tensor,
                   dtype: torch.dtype) -> torch.Tensor:
    """The reported loss of the reference: the cross-entropy."""
    return reference_objective(m, params, tokens, dtype)[1]
