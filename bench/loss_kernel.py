"""Benchmark: planc's hand-differentiated cross-entropy against ``F.cross_entropy`` with
autograd, forward and backward of one loss, on one thread.

planc's loss (planc.runtime.families.loss: ``cross_entropy_sum``, then
``cross_entropy_grad`` in place on the kept log-probabilities) against what a PyTorch
user writes (``F.cross_entropy(..., reduction="sum") / tokens``, ``torch.autograd.grad``
of it by the logits). Both run interleaved, ``--rounds`` rounds of ``--repeat`` calls
each after a warm-up; the figure is the median over rounds of each side's mean.

    .venv/bin/python bench/loss_kernel.py [--tokens 2048] [--vocab 2048] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--vocab-parallel", action="store_true",
                        help="time the vocabulary-parallel loss's statistics instead")
    args = parser.parse_args()
    if min(args.tokens, args.vocab, args.rounds, args.repeat) < 1:
        parser.error("--tokens, --vocab, --rounds and --repeat must be at least 1")

    import torch
    import torch.nn.functional as F

    from planc.runtime.families.loss import (cross_entropy_grad, cross_entropy_sum,
                                              sum_exp_shifted)

    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(args.tokens, args.vocab, generator=generator)
    targets = torch.randint(0, args.vocab, (args.tokens,), generator=generator)
    tokens = args.tokens

    if args.vocab_parallel:
        reference = "torch.logsumexp"

        def torch_side():  # the statistics as planc computed them before
            largest = logits.max(dim=-1).values
            return (torch.logsumexp(logits, dim=-1) - largest).exp()

        def planc_side():
            return sum_exp_shifted(logits, logits.amax(dim=-1))
    else:
        reference = "F.cross_entropy + autograd"

        def torch_side():
            leaf = logits.detach().requires_grad_()
            loss = F.cross_entropy(leaf, targets, reduction="sum") / tokens
            return torch.autograd.grad(loss, leaf)[0]

        def planc_side():
            _, log_probs = cross_entropy_sum(logits, targets, tokens)
            return cross_entropy_grad(log_probs, targets, tokens)

    sides = {reference: torch_side, "planc": planc_side}
    times: dict[str, list[float]] = {name: [] for name in sides}
    for function in sides.values():
        function()  # warm-up
    for round_ in range(args.rounds):
        order = list(sides) if round_ % 2 == 0 else list(reversed(sides))
        for name in order:
            start = time.perf_counter()
            for _ in range(args.repeat):
                sides[name]()
            times[name].append((time.perf_counter() - start) / args.repeat)
    theirs, ours = torch_side(), planc_side()
    difference = ((theirs - ours).abs() / theirs.abs().clamp_min(1e-30)).max().item()
    print(f"{tokens} tokens x {args.vocab} words, fp32, 1 thread, {args.rounds} rounds")
    for name, values in times.items():
        print(f"  {name}: {statistics.median(values) * 1e3:.2f} ms")
    ratio = statistics.median(times["planc"]) / statistics.median(times[reference])
    what = "sum of exponentials" if args.vocab_parallel else "gradient"
    print(f"  planc / torch: {ratio:.2f}; largest relative {what} difference "
          f"{difference:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
