"""A split backward of multi-head latent attention's q, k and v (the ``qkv`` step of the
deepseek family) at DeepSeek-V3's proportions, two ways, in interleaved rounds (the
median of each):

- ``from output``: the weight half runs the step's backward again from its output
  gradient, asking for the weights alone (planc before 2026-12-02): to reach the
  down-projections' weights it multiplies by the up-projections again;
- ``from products``: the input half keeps the gradients it sent into each product with
  a weight, and the weight half starts there (planc.runtime.backward_passes), as planc
  runs a step whose products' gradients take no more memory than its output's.

Each way times the input half and the weight half apart; the gradients must be equal, bit
for bit. The widths are DeepSeek-V3's per head (q heads of 128 + 64 rotary features,
values of 128; the latents a sixteenth of q's heads and a sixty-fourth of k's and v's,
1,536 and 512 over 128 heads), over fewer heads.

    .venv/bin/python bench/split_backward.py [--heads 16] [--tokens 1024] [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

import torch

from planc.runtime.backward_passes import input_pass_keeping_roots, weight_splits
from planc.runtime.families.deepseek import latent_heads

WAYS = ("from output", "from products")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    heads, nope, rope, v_dim = args.heads, 128, 64, 128
    q_rank, kv_rank = heads * 12, heads * 4  # 1,536 and 512 over DeepSeek-V3's 128 heads
    m = SimpleNamespace(nope_dim=nope, rope_dim=rope, v_dim=v_dim, kv_rank=kv_rank,
                        norm_eps=1e-6, rope_theta=10000.0)
    generator = torch.Generator().manual_seed(0)
    shapes = {"q_a.weight": (args.hidden, q_rank), "ln_q.weight": (q_rank,),
              "q_b.weight": (q_rank, heads * (nope + rope)),
              "kv_a.weight": (args.hidden, kv_rank + rope), "ln_kv.weight": (kv_rank,),
              "kv_b.weight": (kv_rank, heads * (nope + v_dim))}
    weights = {name: (torch.randn(*shape, generator=generator) / shape[0] ** 0.5)
               .requires_grad_() for name, shape in shapes.items()}
    params = list(weights.values())
    h = torch.randn(1, args.tokens, args.hidden, generator=generator, requires_grad=True)
    grad = torch.randn(1, args.tokens, heads * (2 * (nope + rope) + v_dim),
                       generator=generator)
    positions = torch.arange(args.tokens)

    def once(way: str):
        out = latent_heads(m, h, weights.__getitem__, positions, None)
        start = time.perf_counter()
        if way == "from output":
            (dh,) = torch.autograd.grad(out, [h], grad, retain_graph=True)
            middle = time.perf_counter()
            dws = torch.autograd.grad(out, params, grad)
        else:
            groups = weight_splits(out.grad_fn, [h], params)
            (dh,), roots = input_pass_keeping_roots(
                lambda: torch.autograd.grad(out, [h], grad, retain_graph=True), groups)
            assert roots.bytes() <= grad.nbytes, "the products' gradients take more"
            del out
            middle = time.perf_counter()
            found = {}
            for edges, grads, indices in roots.groups:
                found.update(zip(indices, torch.autograd.grad(
                    edges, [params[i] for i in indices], grads)))
            dws = [found[i] for i in range(len(params))]
        end = time.perf_counter()
        return (middle - start, end - middle), [dh, *dws]

    times = {way: [] for way in WAYS}
    results = {}
    for round_ in range(args.rounds + 1):  # the first round warms up
        for way in WAYS if round_ % 2 == 0 else WAYS[::-1]:
            spent, results[way] = once(way)
            if round_:
                times[way].append(spent)
    equal = all(torch.equal(a, b) for a, b in zip(*results.values()))
    print(f"{heads} heads, {args.tokens} tokens, hidden {args.hidden}, latents {q_rank} "
          f"and {kv_rank}; {args.rounds} rounds, medians; gradients equal: {equal}")
    print("| way | input half ms | weight half ms | both ms |")
    print("|---|---|---|---|")
    for way in WAYS:
        inputs, weight = (statistics.median(t[i] for t in times[way]) * 1e3 for i in (0, 1))
        both = statistics.median(sum(t) for t in times[way]) * 1e3
        print(f"| {way} | {inputs:.1f} | {weight:.1f} | {both:.1f} |")
    if not equal:
        raise SystemExit("the two ways' gradients differ")


if __name__ == "__main__":
    main()
