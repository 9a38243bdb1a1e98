"""The llama family's own kernels, as Hugging Face transformers' ``LlamaForCausalLM``
computes them: RMSNorm (in fp32, scaled after casting back), the q/k/v projections
followed by the rotary embedding in the rotate-half convention (Su et al. 2021; the
frequencies in fp32 as transformers makes them), grouped-query causal attention, and
SwiGLU ``silu(gate) * up`` (Shazeer 2020).

The rotation is applied where q and k are made, at the positions of the tokens this
rank holds (its context-parallel chunks in load-balanced order, its tp slice under
sequence parallelism), so keys travel between cp ranks already rotated.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from planc.graph.vocabulary import Op
from planc.runtime.engine import fp8
from planc.runtime.backward_passes import asked_for, traceable
from planc.runtime.engine.model import local_heads
from planc.runtime.families.recomputed_output import MADE_AGAIN


def rms_normed(m, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """RMSNorm as transformers computes it: in fp32, scaled after casting back."""
    return rms_norm_formula(x, weight, m.norm_eps)


def rms_norm(k, spec, x, p, step, mb, extra):
    (weight,) = spec.params
    formula = k.compiled.get("rms_norm", normed)  # compiled, or by hand
    value, scale, eps = x["x"], p(weight), k.ctx.model.norm_eps
    out = formula(value, scale, eps)
    if spec.op is not Op.FINAL_LN and k.ctx.model.recompute_norms:
        # the GEMM reading it keeps how to make it: from the input the norm's backward
        # keeps, and a copy of the scale (a ZeRO-3 unit's storage comes and goes)
        scale = scale.detach().clone()
        extra[MADE_AGAIN] = k.recipes.remember(out, value.detach(),
                                               lambda kept: formula(kept, scale, eps))
    return out


def normed(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:class:`RMSNorm` of ``x``, its leaves given so that each pass of a split backward
    computes only its own gradient (planc.runtime.backward_passes)."""
    return RMSNorm.apply(traceable(x), traceable(weight), eps)


class RMSNorm(torch.autograd.Function):
    """:func:`rms_norm_formula` keeping its input and one reciprocal root per token, the
    normalised input computed again in the backward (as the fused RMSNorm kernels of
    Megatron-LM and Apex keep them): autograd of the formula keeps the normalised
    input besides (and, for a 16-bit model, the input in fp32: twice its size). The
    backward is autograd's of the formula, operation for operation (its derivative
    rules for mul, rsqrt, mean and pow, and the sum over broadcast dimensions), so the
    same bits (tests/test_llama.py). Each pass of a split backward computes the one
    gradient it is asked for (:func:`normed`)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x32 = x.float()
        root = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, root)
        return weight * (x32 * root).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, root = ctx.saved_tensors
        wanted = asked_for(ctx)
        x32 = x.float()
        grad_weight = None
        if wanted[1]:  # summed over the dimensions weight was broadcast over
            leading = tuple(range(grad.dim() - weight.dim()))
            grad_weight = (grad * (x32 * root).to(x.dtype)).sum(leading, keepdim=True).view(
                weight.shape)
        grad_x = None
        if wanted[0]:
            # autograd casts a product's gradient to its factor's dtype (the normalised
            # input's, which a weight of another dtype promotes), then back to fp32
            grad_normed = (grad * weight).to(x.dtype).float()
            grad_root = (grad_normed * x32).sum(-1, keepdim=True)
            grad_square = (-0.5 * grad_root * root.pow(3)).expand(x32.shape) / x32.shape[-1]
            grad_x = (grad_normed * root + grad_square * (2.0 * x32)).to(x.dtype)
        return grad_x, grad_weight, None


def rotary_tables(positions: torch.Tensor, head_dim: int, theta: float, dtype):
    """cos and sin, (tokens, head_dim), for the given positions."""
    # made where the positions are: a copy from the host for every instruction would
    # stop a CUDA rank's issuing thread until the device caught up
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64,
                                             device=positions.device
                                             ).to(torch.float32) / head_dim))
    freqs = positions.to(torch.float32).unsqueeze(-1) * inv_freq
    table = torch.cat([freqs, freqs], dim=-1)
    return table.cos().to(dtype), table.sin().to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (batch, tokens, heads, head_dim); rotate-half: [x1, x2] -> [-x2, x1]."""
    half = x.shape[-1] // 2
    turned = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + turned * sin[:, None, :]


def _turn(source: torch.Tensor, target: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
          sign: int) -> None:
    """``target`` = the rotate-half rotation of ``source`` (both (batch, tokens, heads,
    head_dim)) by the angles of ``cos`` and ``sin`` (tokens, head_dim / 2), forward
    (``sign`` 1) or back (-1): [x1 c - x2 s, x2 c + x1 s], the products and the sums of
    :func:`rotate`'s, so the same bits."""
    half = source.shape[-1] // 2
    x1, x2 = source[..., :half], source[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    first, second = target[..., :half], target[..., half:]
    torch.mul(x1, c, out=first)
    torch.mul(x2, c, out=second)
    if sign > 0:
        first.sub_(x2 * s)
        second.add_(x1 * s)
    else:
        first.add_(x2 * s)
        second.sub_(x1 * s)


class RotateQK(torch.autograd.Function):
    """The rotary embedding of the q and k heads at the front of a q/k/v projection's
    output (batch, tokens, features), v copied behind them: what :func:`rotate` and a
    concatenation compute, written in one output without the turned copy of each head,
    and differentiated by hand (a rotation's gradient is the rotation back): on 2 CPU
    threads the small llama's q/k/v instructions took 0.92 (forward) and 0.87 (backward)
    of their time (docs/performance.md); tests/test_llama.py holds it to the formula's
    bits."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, width: int,
                head_dim: int) -> torch.Tensor:
        half = head_dim // 2
        cos, sin = cos[:, :half], sin[:, :half]  # both halves of each table are equal
        ctx.save_for_backward(cos, sin)
        ctx.width, ctx.head_dim = width, head_dim
        return RotateQK._apply(out, cos, sin, width, head_dim, 1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cos, sin = ctx.saved_tensors
        return RotateQK._apply(grad, cos, sin, ctx.width, ctx.head_dim, -1), None, None, \
            None, None

    @staticmethod
    def _apply(source: torch.Tensor, cos, sin, width: int, head_dim: int, sign: int
               ) -> torch.Tensor:
        target = torch.empty_like(source)
        _turn(source[..., :width].unflatten(-1, (-1, head_dim)),
              target[..., :width].unflatten(-1, (-1, head_dim)), cos, sin, sign)
        target[..., width:].copy_(source[..., width:])
        return target


def qkv(k, spec, x, p, step, mb, extra):
    """The q, k and v projections in one GEMM, then RoPE on q and k (with model {
    qk_norm }, after an RMSNorm of each head's q and k: Qwen3's)."""
    data = x["x"]
    norms = {name.rsplit(".", 2)[-2]: p(name) for name in spec.params
             if name.endswith("_norm.weight")}
    weights = [p(name) for name in spec.params if not name.endswith("_norm.weight")]
    if k.reads_recipe(spec):  # the input norm's output, made again in the backward
        out = k.through_recipe(spec, data, extra, lambda: fp8.matmul(data, weights, k.fp8))
    else:
        out = fp8.matmul(data, weights, k.fp8)
    model, hd = k.ctx.model, k.head_dim
    heads, kv = local_heads(model, out.shape[-1], k.ctx.tp)
    b, s, _ = out.shape
    cos, sin = rotary_tables(k.positions(spec), hd, model.rope_theta,
                             out.dtype)
    if not norms:  # compiled, or the hand-differentiated function
        return k.compiled.get("rotate_qk", RotateQK.apply)(out, cos, sin, (heads + kv) * hd, hd)
    q = out[..., :heads * hd].reshape(b, s, heads, hd)
    key = out[..., heads * hd:(heads + kv) * hd].reshape(b, s, kv, hd)
    eps = model.norm_eps
    q, key = normed(q, norms["q_norm"], eps), normed(key, norms["k_norm"], eps)
    q, key = rotate(q, cos, sin), rotate(key, cos, sin)
    return torch.cat([q.reshape(b, s, -1), key.reshape(b, s, -1),
                      out[..., (heads + kv) * hd:]], dim=-1)


def attention(k, spec, x, p, step, mb, extra):
    """Causal attention of this rank's query heads, each reading the k/v head of its
    group (transformers' repeat_kv); keys and values of every cp rank when context
    parallelism gathered them, or travelling the cp ring (ring attention)."""
    qkv = x["x"]
    b, s, width = qkv.shape
    hd = k.head_dim
    heads, kv = local_heads(k.ctx.model, width, k.ctx.tp)
    q = qkv[..., :heads * hd].reshape(b, s, heads, hd).transpose(1, 2)
    pair = qkv[..., heads * hd:] if "kv" not in x else x["kv"]
    tokens = pair.shape[1]
    key, v = pair.reshape(b, tokens, 2, kv, hd).permute(2, 0, 3, 1, 4).unbind(0)
    if spec.ring is not None:  # the K/V heads travel unrepeated
        out = k.ring_attention(spec, q, key, v)
        return out.transpose(1, 2).reshape(b, s, heads * hd)
    if "kv" not in x and q.device.type == "cpu":
        # the CPU's flash kernel reads each k/v head for its group itself; copies of them
        # repeated per query head would be kept for the backward (heads / kv_heads times
        # their size). CUDA's memory-efficient kernel, which fp32 runs, does not take
        # groups (torch's SDPA would fall back to the math one, keeping s x s scores).
        out = F.scaled_dot_product_attention(q, key, v, is_causal=True,
                                             enable_gqa=kv != heads)
        return out.transpose(1, 2).reshape(b, s, heads * hd)
    if kv != heads and "kv" not in x and _flash_takes_groups(q, key, v):
        # CUDA's flash kernel (16-bit) reads each k/v head for its group itself too
        out = F.scaled_dot_product_attention(q, key, v, is_causal=True, enable_gqa=True)
        return out.transpose(1, 2).reshape(b, s, heads * hd)
    if kv != heads:
        key = key.repeat_interleave(heads // kv, dim=1)
        v = v.repeat_interleave(heads // kv, dim=1)
    if "kv" not in x:
        out = F.scaled_dot_product_attention(q, key, v, is_causal=True)
    else:
        query = k.ctx.positions(seq_sharded=False)
        allowed = k.ctx.all_key_positions().unsqueeze(0) <= query.unsqueeze(1)
        out = F.scaled_dot_product_attention(q, key, v, attn_mask=allowed)
    return out.transpose(1, 2).reshape(b, s, heads * hd)


def _flash_takes_groups(q: torch.Tensor, key: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether CUDA's flash kernel runs this causal grouped-query attention with each
    k/v head unrepeated (torch's own test of its constraints: 16-bit CUDA tensors, head
    sizes it supports, flash not disabled). Its other kernels take no groups: torch's
    SDPA would fall back to the math one, which keeps the s x s scores, so unless flash
    runs, k and v are repeated per query head as before."""
    if not q.is_cuda:
        return False
    params = torch.backends.cuda.SDPAParams(q, key, v, None, 0.0, True, True)
    return torch.backends.cuda.can_use_flash_attention(params, False)


class SwiGLU(torch.autograd.Function):
    """``silu(gate) * up`` of a [gate | up] input (Shazeer 2020), differentiated by hand
    with autograd's own kernels, the gradients of both halves written into one tensor
    where autograd's backward of the split concatenates them in a copy of the input's
    size: the same bits (tests/test_llama.py). It keeps its input alone and computes
    ``silu(gate)`` again in the backward, as Megatron-LM's fused bias-SwiGLU does:
    autograd would keep that ffn-wide tensor too, a third more than the block's MLP
    needs (its input and down's)."""

    @staticmethod
    def forward(ctx, both: torch.Tensor) -> torch.Tensor:
        gate, up = both.chunk(2, dim=-1)
        ctx.save_for_backward(both)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (saved,) = ctx.saved_tensors
        gate, up = saved.chunk(2, dim=-1)
        activated = F.silu(gate)
        both = grad.new_empty(*grad.shape[:-1], 2 * grad.shape[-1])
        to_gate, to_up = both.chunk(2, dim=-1)
        torch.mul(grad, activated, out=to_up)
        del activated  # read: one ffn-wide tensor fewer while gate's gradient is made
        torch.ops.aten.silu_backward.grad_input(grad * up, gate, grad_input=to_gate)
        return both


def swiglu(k, spec, x, p, step, mb, extra):
    both = x["x"]
    formula = k.compiled.get("swiglu", SwiGLU.apply)  # compiled, or by hand
    out = formula(both)
    if k.ctx.model.recompute_activation:  # the down projection keeps how to make it
        extra[MADE_AGAIN] = k.recipes.remember(out, both.detach(), formula)
    return out


# optimize { compile }: the formulas of the kernels above as pure functions of tensors,
# which planc.runtime.engine.kernels hands to torch.compile; inductor fuses each pass
# (forward, backward) into one loop. bench/compile_kernels.py measures them.
def rms_norm_formula(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def swiglu_formula(both: torch.Tensor) -> torch.Tensor:
    gate, up = both.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotate_qk_formula(out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, width: int,
                      head_dim: int) -> torch.Tensor:
    turned = rotate(out[..., :width].unflatten(-1, (-1, head_dim)), cos, sin)
    return torch.cat([turned.flatten(-2), out[..., width:]], dim=-1)


FORMULAS = {"rms_norm": rms_norm_formula, "swiglu": swiglu_formula,
            "rotate_qk": rotate_qk_formula}


KERNELS = {Op.LN1: rms_norm, Op.LN2: rms_norm, Op.FINAL_LN: rms_norm,
           Op.QKV: qkv, Op.ATTENTION: attention, Op.SWIGLU: swiglu}


def dense_mlp(layer: int, h: torch.Tensor, w: dict[str, torch.Tensor],
              recipe=None) -> torch.Tensor:
    """SwiGLU of block ``layer``'s weights ``w`` (named within the block); its GEMMs in
    FP8 by ``recipe`` (planc.runtime.engine.fp8), else in ``h``'s dtype. The activation
    by :class:`SiluTimes`, which keeps gate and up alone."""
    if recipe is None:
        return SiluTimes.apply(h @ w["gate.weight"], h @ w["up.weight"], None) @ \
            w["down.weight"]
    gate, up = fp8.matmul(h, [w["gate.weight"], w["up.weight"]], recipe).chunk(2, dim=-1)
    return fp8.matmul(SiluTimes.apply(gate, up, None), [w["down.weight"]], recipe)


def silu_times(gate: torch.Tensor, up: torch.Tensor, scale: torch.Tensor | None
               ) -> torch.Tensor:
    """``silu(gate) * up`` (times ``scale`` when given): :class:`SiluTimes`' forward, and
    its product computed again (planc.runtime.families.moe_dispatch.down_of_product)."""
    return F.silu(gate) * up if scale is None else F.silu(gate) * up * scale


class SiluTimes(torch.autograd.Function):
    """``silu(gate) * up`` of gate and up apart (a routed or shared expert's, and the
    reference's dense MLP), times ``scale`` (rows x 1) when given: a routed expert's
    routing weights, applied inside its SwiGLU, before the down projection
    (Megatron-Core's weighted_bias_swiglu), whose gradient gate and up give, so that no
    expert output is kept for it. :class:`SwiGLU`'s storage: gate, up (and the weights)
    alone, silu(gate) computed again in the backward, where autograd's ``F.silu(gate) *
    up`` keeps it too (one ffn-wide tensor more for every row an expert runs);
    autograd's own operations in the backward, so the same bits. Each pass computes only
    the gradients it is asked for (:func:`asked_for`): a split backward's weight half that
    starts from the experts' output gradient needs gate's and up's, not the scale's,
    which are the routing weights, an input of the step."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor, scale: torch.Tensor | None
                ) -> torch.Tensor:
        ctx.save_for_backward(*(t for t in (gate, up, scale) if t is not None))
        return silu_times(gate, up, scale)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up, *scale = ctx.saved_tensors
        gate_asked, up_asked, scale_asked = asked_for(ctx)
        scale_asked = scale_asked and bool(scale)
        # Each temporary goes once read, so that no more than three ffn-wide tensors are
        # alive at once beside gate and up (six when all were made before any went).
        activated = F.silu(gate) if up_asked or scale_asked else None
        scale_grad = (grad * activated * up).sum(-1, keepdim=True) if scale_asked else None
        weighted = grad * scale[0] if scale and (gate_asked or up_asked) else grad
        up_grad = weighted * activated if up_asked else None
        del activated
        gate_grad = None
        if gate_asked:
            product = weighted * up
            del weighted
            gate_grad = torch.ops.aten.silu_backward(product, gate)
        return gate_grad, up_grad, scale_grad


def reference_loss(m, params: dict[str, torch.Tensor], tokens: torch.Tensor,
                   dtype: torch.dtype, mlp=None, attention=None) -> torch.Tensor:
    """The single-process reference's loss (planc.runtime.oracle.reference): the llama family as
    docs/language.md defines it (model llama), one line per rule, on whole tensors.
    ``m``: the plan's model; ``mlp(layer, normed, weights)``: a block's MLP (the moe
    family's mixture); ``attention(normed, weights)``: a block's attention with its
    output projection (the deepseek family's multi-head latent attention)."""
    p = {k: v.to(dtype) for k, v in params.items()}
    recipe = fp8.recipe_of(m)  # model { fp8 }: the linear layers' GEMMs in FP8
    if mlp is None:
        def mlp(layer, h, w):
            return dense_mlp(layer, h, w, recipe)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    b, seq = inputs.shape
    hd, kv = m.head_dim, m.key_value_heads

    def norm(x, weight):
        return rms_normed(m, x, weight)

    # rotary embedding, rotate-half convention, frequencies theta^(-2i/d) in fp32
    inv_freq = 1.0 / (m.rope_theta ** (torch.arange(0, hd, 2).float() / hd))
    angles = torch.arange(seq).float()[:, None] * inv_freq[None, :]
    cos, sin = (torch.cat([angles, angles], -1).cos().to(dtype),
                torch.cat([angles, angles], -1).sin().to(dtype))

    def rope(x):  # (b, heads, seq, hd)
        x1, x2 = x[..., :hd // 2], x[..., hd // 2:]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    causal = torch.ones(seq, seq, dtype=torch.bool).tril()

    def head_norm(x, name, w):  # model { qk_norm }: each head's features (Qwen3)
        return norm(x, w[name]) if name in w else x

    def grouped_query_attention(h, w):
        q = rope(head_norm(fp8.matmul(h, [w["q.weight"]], recipe).view(b, seq, m.heads, hd),
                           "q_norm.weight", w).transpose(1, 2))
        k = rope(head_norm(fp8.matmul(h, [w["k.weight"]], recipe).view(b, seq, kv, hd),
                           "k_norm.weight", w).transpose(1, 2))
        v = fp8.matmul(h, [w["v.weight"]], recipe).view(b, seq, kv, hd).transpose(1, 2)
        k = k.repeat_interleave(m.heads // kv, dim=1)
        v = v.repeat_interleave(m.heads // kv, dim=1)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
        scores = scores.masked_fill(~causal, float("-inf"))
        context = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, seq, m.heads * hd)
        return fp8.matmul(context, [w["o.weight"]], recipe)
    attention = attention or grouped_query_attention

    x = p["embedding.weight"][inputs]
    for layer in range(m.layers):
        w = {k[len(f"layers.{layer}."):]: v for k, v in p.items()
             if k.startswith(f"layers.{layer}.")}
        x = x + attention(norm(x, w["ln1.weight"]), w)
        h = norm(x, w["ln2.weight"])
        x = x + mlp(layer, h, w)
    x = norm(x, p["final_ln.weight"])
    head = p["embedding.weight"].t() if m.tie_embeddings else p["head.weight"]
    logits = (x @ head).float()
    return F.cross_entropy(logits.reshape(-1, m.vocab), targets.reshape(-1))
