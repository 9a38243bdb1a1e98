"""The routing imbalance of Megatron-MoE-ModelZoo's Qwen3-235B-A22B benchmark, from its
own measurement of what real routing costs.

The ModelZoo's best_practice/Qwen3/readme.md ("Long Context", at c1ad0b5) measures
Qwen3-235B-A22B on 32 nodes of 8 H100s at sequences of 16,384 (tp 4, cp 1, ep 8, pp 8,
VPP 4, global batch 256, bf16, selective recomputation of the norms and the MoE layer)
twice: 295 TFLOP/s per GPU with the router forced to balance
(``--moe-router-force-load-balancing``) and 237 dropless, with its own routing (an
auxiliary loss of 1e-3, model_configs/benchmarking/Qwen3-235B-A22B.yaml). The same
FLOPs, so the dropless step is 295 / 237 = 1.245 times the balanced one. This script
finds the plan ``imbalance`` at which planc simulate's step of that layout is 1.245 times
its step at ``imbalance = 1.0`` (bisection), the figure plans/moe-published/modelzoo-
qwen3-235b-a2a.plan states for the same benchmark's routing at 4,096. It is a reading
of that measurement through planc's model: whatever else dropless routing costs
(the host copy of the token counts every layer) is counted as imbalance.

Where the plan departs from that run: it recomputes nothing, where the run recomputed
the norms and the MoE layer, which planc cannot write (its ``selective`` recomputes the
attention core, which the run's FlashAttention backward already does once, and ``full``
the whole layer; with ``full`` the figure is 1.97); the run used DeepEP's dispatcher,
planc prices a plain all-to-all (both ratios are of the same dispatcher).

    .venv/bin/python bench/moe_imbalance.py
"""

from __future__ import annotations

from planc.compile import compile_plan
from planc.lang import load_text
from planc.simulate import simulate

FORCED_BALANCE_TFLOPS, DROPLESS_TFLOPS = 295.0, 237.0

LONG_CONTEXT = """plan modelzoo_qwen3_235b_16k {{
  model moe {{
    layers = 94; hidden = 4096; heads = 64; kv_heads = 4; head_dim = 128; vocab = 151936
    experts = 128; top_k = 8; expert_ffn = 1536
    seq = 16384; batch = 256; rope_theta = 1e6; dtype = bf16; imbalance = {imbalance}
  }}
  mesh {{ tp = 4; pp = 8; dp = 8; ep = 8; order = [tp, cp, dp, pp] }}
  topology {{ preset = dgx-h100 }}
  shard {{ tp {{ sequence_parallel = on }}; pp {{ virtual = 4 }}; dp {{ zero = 1 }} }}
  schedule {{ microbatches = 32; pipeline = interleaved }}
}}"""


def step_seconds(imbalance: float) -> float:
    """planc simulate's step of the long-context layout at ``imbalance``."""
    plan = load_text(LONG_CONTEXT.format(imbalance=imbalance)).plan
    return simulate(compile_plan(plan)).step_seconds


def measured_imbalance(low: float = 1.0, high: float = 4.0, steps: int = 10) -> float:
    """The imbalance whose simulated step over the balanced one is the measured ratio,
    to (high - low) / 2**steps."""
    target = FORCED_BALANCE_TFLOPS / DROPLESS_TFLOPS
    balanced = step_seconds(1.0)
    for _ in range(steps):
        middle = (low + high) / 2
        if step_seconds(middle) / balanced < target:
            low = middle
        else:
            high = middle
    return (low + high) / 2


def main() -> int:
    ratio = FORCED_BALANCE_TFLOPS / DROPLESS_TFLOPS
    print(f"measured dropless / balanced step: {ratio:.3f}")
    print(f"imbalance at which planc simulate gives it: {measured_imbalance():.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
