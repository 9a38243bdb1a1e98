"""Ring attention: causal attention over the cp ring, each K/V block's shift overlapped
with the partial attention on the block in hand, forward and backward.

The compiler writes the ring on the attention step (planc.program.operands: ``ring_steps``
over the ``cp`` group). Ring step ``s`` holds the K/V block of the cp rank ``s`` before
this one; it posts the shift of that block to the next rank (and the receive of the next
block from the previous one), computes the partial attention on the block while the
shift travels, and then waits for it (Liu et al. 2023, "Ring Attention with Blockwise
Transformers"; picotron's ring attention). The partials are merged by their running
maximum and sum of exponentials, and the backward recomputes each block's probabilities
from the saved log-sum-exp (Dao 2023, FlashAttention-2). In the backward, the K/V blocks
travel the ring again and each block's dK/dV accumulator travels one step behind it,
every rank adding its share, and comes home after ``cp`` shifts.

Which keys a query sees comes from the token positions of the model table (load-balanced
causal chunks included): a block none of whose keys this rank's queries may see is not
computed, but it still travels. Each block's attention is PyTorch's fused flash kernel
on the CPU (the same arithmetic written out on other devices); the merge and the
gradient accumulators are in fp32, the blocks travel in the model's dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

FP32 = torch.float32


@dataclass(frozen=True)
class Ring:
    """The cp ring of one attention step, as its operands name it."""

    steps: int
    group: object  # the cp process group
    members: tuple[int, ...]  # global ranks, in cp order
    index: int  # this rank's position on the ring

    @property
    def next(self) -> int:
        return self.members[(self.index + 1) % len(self.members)]

    @property
    def previous(self) -> int:
        return self.members[(self.index - 1) % len(self.members)]

    def owner(self, step: int) -> int:
        """The cp rank whose block this rank holds at ring step ``step``."""
        return (self.index - step) % len(self.members)


class _Shift:
    """A posted shift: the block goes to the next rank, one comes from the previous."""

    def __init__(self, tensor: torch.Tensor, ring: Ring):
        self.received = torch.empty_like(tensor)
        self.works = dist.batch_isend_irecv([
            dist.P2POp(dist.isend, tensor, ring.next, group=ring.group),
            dist.P2POp(dist.irecv, self.received, ring.previous, group=ring.group)])

    def wait(self) -> torch.Tensor:
        for work in self.works:
            work.wait()
        return self.received


@dataclass(frozen=True)
class StepMask:
    """Which keys of the block in hand each query may see at one ring step: an additive
    mask (0 or -inf, the model's dtype) and the queries that see at least one key."""

    additive: torch.Tensor  # (queries, keys)
    sees_any: torch.Tensor  # (queries,) bool


def step_masks(ring: Ring, queries: torch.Tensor, keys_of, dtype: torch.dtype
               ) -> list[StepMask | None]:
    """Per ring step, which keys of the block in hand each query sees (causal, by token
    position); None where it sees none. ``keys_of(cp_rank)``: that block's positions."""
    masks = []
    for step in range(ring.steps):
        allowed = keys_of(ring.owner(step)).unsqueeze(0) <= queries.unsqueeze(1)
        if not bool(allowed.any()):
            masks.append(None)
            continue
        additive = torch.zeros(allowed.shape, dtype=dtype, device=queries.device)
        masks.append(StepMask(additive.masked_fill(~allowed, -math.inf), allowed.any(-1)))
    return masks


def _widen(block: torch.Tensor, repeat: int) -> torch.Tensor:
    """Grouped-query attention: each K/V head serves ``repeat`` query heads."""
    return block if repeat == 1 else block.repeat_interleave(repeat, dim=1)


def _narrow(grad: torch.Tensor, repeat: int) -> torch.Tensor:
    """The gradient of :func:`_widen`: sum over the query heads a K/V head served."""
    if repeat == 1:
        return grad
    b, heads, tokens, d = grad.shape
    return grad.view(b, heads // repeat, repeat, tokens, d).sum(2)


def _fused(q: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether PyTorch has a fused flash kernel with a log-sum-exp for this device and
    these widths (its CPU kernel wants v as wide as q and k)."""
    return q.device.type == "cpu" and value.shape[-1] == q.shape[-1]


def _partial(q, key, value, mask: StepMask) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention of q on one block and its log-sum-exp (-inf for a query that sees
    none of the block's keys): PyTorch's fused flash kernel on the CPU, the same
    arithmetic written out elsewhere."""
    if _fused(q, value):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, key, value, 0.0, False, attn_mask=mask.additive)
    else:
        scores = (q.to(FP32) @ key.to(FP32).transpose(-1, -2)) / math.sqrt(q.shape[-1]) \
            + mask.additive
        lse = torch.logsumexp(scores, -1)
        safe = lse.masked_fill(~mask.sees_any, 0.0)
        out = ((scores - safe.unsqueeze(-1)).exp() @ value.to(FP32)).to(q.dtype)
    return out, lse.to(FP32).masked_fill(~mask.sees_any, -math.inf)


def _partial_backward(dout, q, key, value, out, lse, mask: StepMask):
    """dq, dk, dv of one block from the whole attention's output and log-sum-exp
    (FlashAttention-2's backward: the block's probabilities are exp(scores - lse))."""
    if _fused(q, value):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, key, value, out, lse, 0.0, False, attn_mask=mask.additive)
    scale = 1.0 / math.sqrt(q.shape[-1])
    q32, key32, dout32 = q.to(FP32), key.to(FP32), dout.to(FP32)
    probs = ((q32 @ key32.transpose(-1, -2)) * scale + mask.additive
             - lse.unsqueeze(-1)).exp()
    delta = (dout32 * out.to(FP32)).sum(-1, keepdim=True)
    dscores = probs * (dout32 @ value.to(FP32).transpose(-1, -2) - delta)
    return dscores @ key32 * scale, dscores.transpose(-1, -2) @ q32 * scale, \
        probs.transpose(-1, -2) @ dout32


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring: Ring, masks):
        repeat = q.shape[1] // k.shape[1]
        out = lse = None
        # k and v travel as one block, side by side along the features (their widths may
        # differ: multi-head latent attention's v is narrower than its q and k)
        block, width = torch.cat([k, v], dim=-1).contiguous(), k.shape[-1]
        for step in range(ring.steps):
            shift = _Shift(block, ring) if step < ring.steps - 1 else None
            mask = masks[step]
            if mask is not None:  # the partial attention on the block in hand
                part, part_lse = _partial(q, _widen(block[..., :width], repeat),
                                          _widen(block[..., width:], repeat), mask)
                if out is None:  # step 0: the rank's own block, where every query sees
                    out, lse = part.to(FP32), part_lse  # at least itself
                else:
                    merged = torch.logaddexp(lse, part_lse)
                    out = out * (lse - merged).exp().unsqueeze(-1) + \
                        part.to(FP32) * (part_lse - merged).exp().unsqueeze(-1)
                    lse = merged
            if shift is not None:
                block = shift.wait()
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.masks = ring, masks
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        ring, masks = ctx.ring, ctx.masks
        repeat = q.shape[1] // k.shape[1]
        grad_out = grad_out.contiguous()
        dq = torch.zeros(q.shape, dtype=FP32, device=q.device)
        block, width = torch.cat([k, v], dim=-1).contiguous(), k.shape[-1]
        travelling = None  # the shift of the previous block's dK/dV accumulator
        for step in range(ring.steps):
            shift = _Shift(block, ring) if step < ring.steps - 1 else None
            share = torch.zeros(block.shape, dtype=FP32, device=q.device)
            mask = masks[step]
            if mask is not None:
                dq_part, dk, dv = _partial_backward(
                    grad_out, q, _widen(block[..., :width], repeat),
                    _widen(block[..., width:], repeat), out, lse, mask)
                dq += dq_part
                share[..., :width] = _narrow(dk.to(FP32), repeat)
                share[..., width:] = _narrow(dv.to(FP32), repeat)
            # This block's accumulator arrives from the rank that held the block last.
            accumulator = share if travelling is None else travelling.wait().to(FP32) + share
            travelling = _Shift(accumulator.to(block.dtype).contiguous(), ring)
            if shift is not None:
                block = shift.wait()
        home = travelling.wait()  # this rank's own block, every rank's share added
        return dq.to(q.dtype), home[..., :width].to(k.dtype), home[..., width:].to(v.dtype), \
            None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring,
                   masks: list[StepMask | None]) -> torch.Tensor:
    """q: (batch, heads, tokens, head_dim); k: (batch, kv heads, tokens, head_dim), v:
    (batch, kv heads, tokens, v features: head_dim, or MLA's own), this rank's block. The
    attention output, (batch, heads, tokens, v features)."""
    return _RingAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), ring, masks)
