"""One rank's routed experts on the rows dispatched to them, forward and backward, four
ways, in interleaved rounds (the median of each):

- ``indexed``: each expert indexes the stacked weights, gathers its rows by index and
  writes its outputs into a copy of the piece's output (planc before 2026-12-02): each
  backward zero-fills a whole gradient of the stacked weights and of the rows, and each
  forward copies the output whole, for every expert;
- ``slices``: the weights as one unbind's slices (moe_dispatch.Experts.slices), the
  rows still by index;
- ``sorted``: the slices, and the rows sorted by expert once, each expert on its slice,
  the outputs written back once;
- ``grouped``: the rows sorted so, each of the three GEMMs one ``torch._grouped_mm`` over
  every expert and the SwiGLU one operation (moe_dispatch.through_experts), as planc runs
  them where the widths allow.

The outputs and every gradient must be equal, bit for bit, in the first three ways; in
``grouped`` to the rounding of the SwiGLU's exp, which runs once over all the rows
rather than expert by expert (its vectorised loop leaves other elements to its scalar
tail).

    .venv/bin/python bench/moe_expert_slices.py [--experts 16] [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from planc.runtime.families.moe_dispatch import (copied_by_row, expert_mlp,
                                                 stacked_experts, through_experts)

WAYS = ("indexed", "slices", "sorted", "grouped")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--expert-ffn", type=int, default=768)
    parser.add_argument("--rows", type=int, default=128, help="rows each expert runs")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    shapes = {"gate": (args.hidden, args.expert_ffn), "up": (args.hidden, args.expert_ffn),
              "down": (args.expert_ffn, args.hidden)}
    stacked = {f"experts.{w}.weight": torch.randn(args.experts, *shape, generator=generator,
                                                  requires_grad=True)
               for w, shape in shapes.items()}
    count = args.experts * args.rows
    rows = torch.randn(count, args.hidden, generator=generator, requires_grad=True)
    scales = torch.rand(count, 1, generator=generator, requires_grad=True)
    # the rows of each member come sorted by expert, the members one after another
    expert_of = torch.arange(args.experts).repeat_interleave(args.rows // 2).repeat(2)
    leaves = (rows, scales, *stacked.values())
    grad = torch.randn(count, args.hidden, generator=generator)

    def step(way: str):
        experts = stacked_experts(stacked.__getitem__)
        if way == "grouped":
            out = through_experts(rows * 0, rows, scales, expert_of, args.experts, experts)
        elif way == "sorted":
            order = torch.argsort(expert_of, stable=True)
            counts = torch.bincount(expert_of, minlength=args.experts).tolist()
            weights = experts.slices()
            out = copied_by_row(rows * 0, order, torch.cat([
                expert_mlp(x, *(w[expert] for w in weights), scale=scale)
                for expert, (x, scale) in
                enumerate(zip(rows[order].split(counts), scales[order].split(counts)))]))
        else:
            weights = experts.slices() if way == "slices" else tuple(stacked.values())
            out = rows * 0
            for expert in range(args.experts):
                mine = (expert_of == expert).nonzero(as_tuple=True)[0]
                out = copied_by_row(out, mine, expert_mlp(
                    rows[mine], *(w[expert] for w in weights), scale=scales[mine]))
        return (out, *torch.autograd.grad(out, leaves, grad))

    results = [step(way) for way in WAYS]
    same = all(torch.equal(a, b) for other in results[1:3] for a, b in zip(results[0], other))
    close = all(torch.allclose(a, b, rtol=1e-5, atol=1e-4)
                for a, b in zip(results[0], results[3]))
    times: dict[str, list[float]] = {way: [] for way in WAYS}
    for _ in range(args.rounds + 1):  # the first round warms up
        for way in WAYS:
            start = time.perf_counter()
            step(way)
            times[way].append(time.perf_counter() - start)
    ms = {way: statistics.median(times[way][1:]) * 1e3 for way in WAYS}
    print(f"{args.experts} experts of {args.hidden} x {args.expert_ffn}, {args.rows} rows "
          f"each, {args.rounds} rounds: " + ", ".join(f"{way} {ms[way]:.1f} ms" for way in WAYS)
          + f" (grouped / indexed {ms['grouped'] / ms['indexed']:.2f}); outputs and "
          f"gradients equal: {same}, grouped's within rounding: {close}")


if __name__ == "__main__":
    main()
