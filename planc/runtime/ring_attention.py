"""Ring attention: causal attention over the cp ring, each K/V block's shift overlapped
with the partial attention on the block in hand, forward and backward.

The compiler writes the ring on the attention step (planc.lower.operands: ``ring_steps``
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
computed, but it still travels. The arithmetic is in fp32; the blocks travel in the
model's dtype.
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


def step_masks(ring: Ring, queries: torch.Tensor, keys_of) -> list[torch.Tensor | None]:
    """Per ring step, which keys of the block in hand each query sees (causal, by token
    position); None where it sees none. ``keys_of(cp_rank)``: that block's positions."""
    masks = []
    for step in range(ring.steps):
        allowed = keys_of(ring.owner(step)).unsqueeze(0) <= queries.unsqueeze(1)
        masks.append(allowed if bool(allowed.any()) else None)
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


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring: Ring, masks):
        repeat = q.shape[1] // k.shape[1]
        scale = 1.0 / math.sqrt(q.shape[-1])
        q32 = q.to(FP32)
        b, heads, tokens, d = q.shape
        peak = torch.full((b, heads, tokens), -math.inf, dtype=FP32, device=q.device)
        total = torch.zeros_like(peak)
        acc = torch.zeros((b, heads, tokens, d), dtype=FP32, device=q.device)
        block = torch.stack([k, v]).contiguous()
        for step in range(ring.steps):
            shift = _Shift(block, ring) if step < ring.steps - 1 else None
            allowed = masks[step]
            if allowed is not None:  # the partial attention on the block in hand
                key, value = (_widen(t.to(FP32), repeat) for t in block.unbind(0))
                scores = (q32 @ key.transpose(-1, -2) * scale).masked_fill(~allowed,
                                                                           -math.inf)
                new_peak = torch.maximum(peak, scores.amax(-1))
                base = new_peak.masked_fill(new_peak == -math.inf, 0.0)
                weights = (scores - base.unsqueeze(-1)).exp()
                rescale = (peak - base).exp()
                total = total * rescale + weights.sum(-1)
                acc = acc * rescale.unsqueeze(-1) + weights @ value
                peak = new_peak
            if shift is not None:
                block = shift.wait()
        # every query sees at least itself (its own block, ring step 0): total > 0
        out = acc / total.unsqueeze(-1)
        lse = peak + total.log()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.masks = ring, masks
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        ring, masks = ctx.ring, ctx.masks
        repeat = q.shape[1] // k.shape[1]
        scale = 1.0 / math.sqrt(q.shape[-1])
        q32, dout = q.to(FP32), grad_out.to(FP32)
        delta = (dout * out).sum(-1, keepdim=True)  # FlashAttention-2's D
        dq = torch.zeros_like(q32)
        block = torch.stack([k, v]).contiguous()
        travelling = None  # the shift of the previous block's dK/dV accumulator
        for step in range(ring.steps):
            shift = _Shift(block, ring) if step < ring.steps - 1 else None
            share = torch.zeros(block.shape, dtype=FP32, device=q.device)
            allowed = masks[step]
            if allowed is not None:
                key, value = (_widen(t.to(FP32), repeat) for t in block.unbind(0))
                scores = (q32 @ key.transpose(-1, -2) * scale).masked_fill(~allowed,
                                                                           -math.inf)
                probs = (scores - lse.unsqueeze(-1)).exp()
                dprobs = dout @ value.transpose(-1, -2)
                dscores = probs * (dprobs - delta)
                dq += dscores @ key * scale
                share[0] = _narrow(dscores.transpose(-1, -2) @ q32 * scale, repeat)
                share[1] = _narrow(probs.transpose(-1, -2) @ dout, repeat)
            # This block's accumulator arrives from the rank that held the block last.
            accumulator = share if travelling is None else travelling.wait().to(FP32) + share
            travelling = _Shift(accumulator.to(block.dtype).contiguous(), ring)
            if shift is not None:
                block = shift.wait()
        home = travelling.wait()  # this rank's own block, every rank's share added
        return dq.to(q.dtype), home[0].to(k.dtype), home[1].to(v.dtype), None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring,
                   masks: list[torch.Tensor | None]) -> torch.Tensor:
    """q: (batch, heads, tokens, head_dim); k, v: (batch, kv heads, tokens, head_dim), this
    rank's block. The attention output, (batch, heads, tokens, head_dim)."""
    return _RingAttention.apply(q, k.contiguous(), v.contiguous(), ring, masks)
