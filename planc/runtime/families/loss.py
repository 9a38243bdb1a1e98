"""The cross-entropy loss on one rank's logits, forward and backward, differentiated by
hand: its gradient, softmax minus one-hot, is written over the kept log-probabilities (or,
vocabulary-parallel, over this rank's slice of the logits, as Megatron-LM's
vocab_parallel_cross_entropy, which so never gathers them): every family's last kernel,
which planc.runtime.engine.kernels dispatches to.
"""

from __future__ import annotations

import math

import torch

from planc.runtime.engine.context import RankContext

FP32 = torch.float32
LOSS_CHUNK_ELEMENTS = 1 << 22  # sum_exp_shifted's temporary: 16 MiB of fp32


def cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor, tokens: int,
                      in_place: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The cross-entropy of ``logits`` (..., vocab, fp32) against ``targets``, summed and
    divided by ``tokens``, and the log-probabilities its gradient needs: one fused
    ``log_softmax`` pass and a gather. ``in_place``: written over the logits, which are
    the caller's to overwrite (Megatron-LM's cross-entropy works in its logits too): no
    second tensor of the logits' size at the loss's peak. The kernel reads each element
    before it writes it: the same bits (tests/test_loss_kernel.py)."""
    log_probs = torch.log_softmax(logits, dim=-1, out=logits) if in_place else \
        torch.log_softmax(logits, dim=-1)
    return -log_probs.gather(-1, targets.unsqueeze(-1)).sum() / tokens, log_probs


def sum_exp_shifted(logits: torch.Tensor, shift: torch.Tensor,
                    chunk_elements: int = LOSS_CHUNK_ELEMENTS) -> torch.Tensor:
    """``sum(exp(logits - shift))`` over the vocabulary, per token, in fp32: a
    vocabulary-parallel loss's local normaliser, shifted by the max over tp (Megatron-LM's
    vocab_parallel_cross_entropy). A chunk of tokens at a time, so the only temporary is
    one chunk's: ``torch.logsumexp`` makes two of the logits' size at once (the shifted
    logits and their exponentials), in fp32 whatever the logits' dtype."""
    rows = logits.reshape(-1, logits.shape[-1])
    shifts, sums = shift.reshape(-1, 1), torch.empty(rows.shape[0], dtype=FP32,
                                                     device=logits.device)
    step = max(1, chunk_elements // rows.shape[1])
    chunk = torch.empty(min(step, rows.shape[0]), rows.shape[1], dtype=FP32,
                        device=logits.device)
    for start in range(0, rows.shape[0], step):
        end = min(start + step, rows.shape[0])
        part = torch.sub(rows[start:end], shifts[start:end], out=chunk[:end - start])
        torch.sum(part.exp_(), dim=-1, out=sums[start:end])
    return sums.view(shift.shape)


def cross_entropy_grad(log_probs: torch.Tensor, targets: torch.Tensor, tokens: int
                       ) -> torch.Tensor:
    """The gradient of :func:`cross_entropy_sum` by its logits, (softmax - one-hot) /
    tokens, written into ``log_probs`` (exponentiated in place, then one scatter)."""
    grad = log_probs.exp_().div_(tokens)
    index = targets.unsqueeze(-1)
    return grad.scatter_add_(-1, index, torch.full(index.shape, -1.0 / tokens,
                                                   dtype=grad.dtype, device=grad.device))


def loss_max(ctx: RankContext, spec, x, p, step: int, mb: int, extra: dict):
    # a max is exact in any dtype: cast the maxima, not a copy of the logits
    return x["x"].detach().amax(dim=-1).to(FP32)

def loss_sum_exp(ctx: RankContext, spec, x, p, step: int, mb: int, extra: dict):
    return sum_exp_shifted(x["x"].detach(), x["max"])

def loss_forward(ctx: RankContext, spec, x, p, step: int, mb: int, extra: dict):
    """This rank's share of the step's mean cross-entropy: the sum over its tokens
    divided by every token of the global batch; the value to report goes into
    ``extra``.

    Differentiated by hand (:func:`loss_backward`), never through autograd: the
    gradient, softmax minus one-hot, is the kept log-probabilities exponentiated in
    place and one scatter, where autograd's ``nll_loss`` backward fills a zeroed
    tensor of the logits' size and ``log_softmax``'s backward makes a second pass
    (the fused cross-entropy of Megatron-LM's vocabulary-parallel loss and of Liger
    Kernel, here for every loss; bench/loss_kernel.py: 0.57x autograd's time at 2048
    tokens x 2048 words, 0.46x at 512 x 32768, on one core). No input is kept: the
    logits are freed once read."""
    total = ctx.tokens_per_step
    _, targets = ctx.microbatch(step, mb, spec.seq_sharded)
    logits = x["x"].detach()
    # the fp32 logits are this step's to overwrite: a 16-bit model's fp32 copy is its
    # own; fp32 logits are the head's, which nothing reads after the loss when the
    # program frees them here
    ours = logits.dtype != FP32 or spec.frees_input
    if not spec.vocab_parallel:
        loss, log_probs = cross_entropy_sum(logits.to(FP32), targets, total, ours)
        # every tp rank holds the whole loss if replicated: report it once
        report = loss / ctx.tp if spec.replicated and ctx.tp > 1 else loss
        extra.update(log_probs=log_probs, local=targets, report=report)
        return loss
    # max and sum of exponentials already reduced over tp
    logits = logits.to(FP32)
    vocab_local = logits.shape[-1]
    local = targets - ctx.tp_rank * vocab_local
    owned = (local >= 0) & (local < vocab_local)
    lse = x["sum_exp"].log() + x["max"]
    target_logit = logits.gather(-1, local.clamp(0, vocab_local - 1).unsqueeze(-1))
    loss = ((lse - target_logit.squeeze(-1)) * owned).sum() / total
    extra.update(logits=logits, ours=ours, lse=lse, local=local, owned=owned,
                 report=loss)
    return loss

def loss_backward(ctx: RankContext, extra: dict) -> dict[str, torch.Tensor]:
    """(softmax - one-hot) / tokens, in two passes over the local logits: the softmax
    is exp(log-probability), or, vocabulary-parallel, exp(logit - lse) with the lse
    reduced over tp; a target this rank's vocabulary slice does not hold gets no
    one-hot."""
    total = ctx.tokens_per_step
    if "log_probs" in extra:  # the last use of the log-probabilities
        grad = cross_entropy_grad(extra.pop("log_probs"), extra["local"], total)
        return {"x": grad.to(ctx.dtype)}
    logits, shift = extra.pop("logits"), (extra["lse"] + math.log(total)).unsqueeze(-1)
    grad = (logits.sub_(shift) if extra["ours"] else logits - shift).exp_()
    index = extra["local"].clamp(0, grad.shape[-1] - 1).unsqueeze(-1)
    grad.scatter_add_(-1, index, -(extra["owned"].unsqueeze(-1).to(grad.dtype) / total))
    return {"x": grad.to(ctx.dtype)}
