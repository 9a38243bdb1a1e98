"""The model in one process, unsharded: the reference every plan must reproduce.

Written straight from the definitions of the families in docs/language.md (model gpt,
model llama), with torch.optim, so
that ``planc run --check`` compares a distributed run with an independent computation.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from planc.plan import Plan
from planc.runtime.data import batch_tokens
from planc.runtime.model import initial_value, parameters
from planc.runtime.optim import optimizer_of

LN_EPS = 1e-5


def forward_loss(plan: Plan, params: dict[str, torch.Tensor], tokens: torch.Tensor,
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Mean cross-entropy of the batch (tokens: batch x (seq + 1))."""
    if plan.model.family == "llama":
        return _llama_loss(plan, params, tokens, dtype)
    return _gpt_loss(plan, params, tokens, dtype)


def _llama_loss(plan: Plan, params: dict[str, torch.Tensor], tokens: torch.Tensor,
                dtype: torch.dtype) -> torch.Tensor:
    """The llama family as docs/language.md defines it (model llama), one line per rule."""
    m = plan.model
    p = {k: v.to(dtype) for k, v in params.items()}
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    b, seq = inputs.shape
    hd, kv = m.hidden // m.heads, m.key_value_heads

    def norm(x, weight):
        x32 = x.float()
        return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + m.norm_eps)
                         ).to(x.dtype)

    # rotary embedding, rotate-half convention, frequencies theta^(-2i/d) in fp32
    inv_freq = 1.0 / (m.rope_theta ** (torch.arange(0, hd, 2).float() / hd))
    angles = torch.arange(seq).float()[:, None] * inv_freq[None, :]
    cos, sin = (torch.cat([angles, angles], -1).cos().to(dtype),
                torch.cat([angles, angles], -1).sin().to(dtype))

    def rope(x):  # (b, heads, seq, hd)
        x1, x2 = x[..., :hd // 2], x[..., hd // 2:]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    x = p["embedding.weight"][inputs]
    for layer in range(m.layers):
        w = {k[len(f"layers.{layer}."):]: v for k, v in p.items()
             if k.startswith(f"layers.{layer}.")}
        h = norm(x, w["ln1.weight"])
        q = rope((h @ w["q.weight"]).view(b, seq, m.heads, hd).transpose(1, 2))
        k = rope((h @ w["k.weight"]).view(b, seq, kv, hd).transpose(1, 2))
        v = (h @ w["v.weight"]).view(b, seq, kv, hd).transpose(1, 2)
        k = k.repeat_interleave(m.heads // kv, dim=1)
        v = v.repeat_interleave(m.heads // kv, dim=1)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
        scores = scores.masked_fill(~causal, float("-inf"))
        context = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, seq, m.hidden)
        x = x + context @ w["o.weight"]
        h = norm(x, w["ln2.weight"])
        x = x + (F.silu(h @ w["gate.weight"]) * (h @ w["up.weight"])) @ w["down.weight"]
    x = norm(x, p["final_ln.weight"])
    head = p["embedding.weight"].t() if m.tie_embeddings else p["head.weight"]
    logits = (x @ head).float()
    return F.cross_entropy(logits.reshape(-1, m.vocab), targets.reshape(-1))


def _gpt_loss(plan: Plan, params: dict[str, torch.Tensor], tokens: torch.Tensor,
              dtype: torch.dtype) -> torch.Tensor:
    m = plan.model
    p = {k: v.to(dtype) for k, v in params.items()}
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    seq = inputs.shape[1]
    x = p["embedding.weight"][inputs] + p["position.weight"][:seq]
    hd = m.hidden // m.heads
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


def make_optimizer(plan: Plan, tensors: list[torch.Tensor], fused: bool = False
                   ) -> torch.optim.Optimizer:
    """The plan's optimizer (planc.runtime.optim)."""
    return optimizer_of(plan.train.optimizer, tensors, fused)


def train(plan: Plan, steps: int, identity=None
          ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses of every step and the final parameters; ``identity``: the data file as the
    run began (planc.runtime.data_identity), which every batch must still be read from."""
    params = {name: initial_value(plan.train.seed, name, p.shape).requires_grad_()
              for name, p in parameters(plan).items()}
    optimizer = make_optimizer(plan, list(params.values()))
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[
        plan.model.dtype]
    losses = []
    for step in range(steps):
        optimizer.zero_grad()
        loss = forward_loss(plan, params, batch_tokens(plan, step, identity), dtype)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, {k: v.detach() for k, v in params.items()}
