"""One rank's routed experts, forward and backward, with their stacked weights indexed
expert by expert (each backward returns a whole zero-filled gradient of the stacked
weight, added up) or taken as slices (planc.runtime.families.moe_dispatch.stacked_experts:
one stack of the slices' gradients per weight). Interleaved rounds, the median of each;
the gradients must be equal.

    .venv/bin/python bench/moe_expert_slices.py [--experts 16] [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from planc.runtime.families.moe_dispatch import expert_output, stacked_experts


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
    whole = tuple(stacked.values())
    rows = [torch.randn(args.rows, args.hidden, generator=generator)
            for _ in range(args.experts)]

    def step(sliced: bool):
        weights = stacked_experts(stacked.__getitem__) if sliced else whole
        out = sum(expert_output(rows[e], weights, e).sum() for e in range(args.experts))
        return torch.autograd.grad(out, whole)

    same = all(torch.equal(a, b) for a, b in zip(step(False), step(True)))
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.rounds + 1):  # the first round warms up
        for sliced in (False, True):
            start = time.perf_counter()
            step(sliced)
            times[sliced].append(time.perf_counter() - start)
    indexed, sliced = (statistics.median(times[k][1:]) * 1e3 for k in (False, True))
    print(f"{args.experts} experts of {args.hidden} x {args.expert_ffn}, {args.rows} rows "
          f"each, {args.rounds} rounds: indexed {indexed:.1f} ms, slices {sliced:.1f} ms "
          f"(slices / indexed {sliced / indexed:.2f}); gradients equal: {same}")


if __name__ == "__main__":
    main()
