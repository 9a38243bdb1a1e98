"""Benchmark: mixtures of experts that fit one device, through ``planc run``.

Issue 40 asks that, with a GPU available, the MoE plans that fit one device run and
their step time be recorded. The published MoE plans (plans/moe-published) need hundreds
of GPUs, so this script writes two plans of one device's size and trains each for a few
steps, in bf16 and with DeepSeek-V3's FP8 recipe (``fp8 = blockwise``, 128-wide tiles):

- ``moe``: the llama-style mixture (softmax gate, top-k normalised) at Qwen3-30B-A3B's
  widths (hidden 2,048, experts of 768, each token to 8), with 32 experts over 4 layers
  where Qwen3 has 128 over 48;
- ``deepseek``: multi-head latent attention and DeepSeek-V3's gate (sigmoid affinities,
  the top-k normalised among the chosen, the auxiliary-loss-free balancing bias) at
  DeepSeek-V2-Lite's widths (hidden 2,048, latent kv 512, experts of 1,408, each token
  to 6, 2 shared, the first layer dense), with 32 experts over 4 layers where V2-Lite has
  64 over 27.

Each run's step time is the median after warm-up steps of ``planc run``'s metrics (one
rank: the slowest rank is that rank), with its tokens per second, its model TFLOP/s as
planc counts them (no MFU: the plans name no machine) and its peak memory. The runs of one round go in turn, the order
rotating between rounds. No PyTorch peer trains these models, so the figures are a
record, not a ratio: bf16 against FP8 is planc against planc.

    .venv/bin/python bench/gpu_moe.py                  # on one GPU
    .venv/bin/python bench/gpu_moe.py --size tiny      # the same plans at toy size, a CPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODELS = {
    "moe": """model moe {{
    layers = {layers}; hidden = {hidden}; heads = {heads}; kv_heads = {kv_heads}
    vocab = {vocab}; seq = {seq}; batch = {batch}; dtype = bf16
    experts = {experts}; top_k = 8; expert_ffn = {moe_expert_ffn}; ffn = {ffn}; first_dense = 0
    {fp8}
  }}""",
    "deepseek": """model deepseek {{
    layers = {layers}; hidden = {hidden}; heads = {heads}; vocab = {vocab}; seq = {seq}
    batch = {batch}; dtype = bf16
    q_rank = {q_rank}; kv_rank = {kv_rank}; nope_dim = {nope}; rope_dim = {rope}; v_dim = {nope}
    experts = {experts}; top_k = 6; expert_ffn = {deepseek_expert_ffn}; shared_experts = 2
    first_dense = 1; ffn = {ffn}; score = sigmoid; routed_scale = 1.0; bias_update = 0.001
    {fp8}
  }}""",
}
SIZES = {
    "gpu": dict(layers=4, hidden=2048, heads=16, kv_heads=4, vocab=32000, seq=2048, batch=8,
                experts=32, moe_expert_ffn=768, deepseek_expert_ffn=1408, ffn=10944,
                q_rank=768, kv_rank=512, nope=128, rope=64, tile=128),
    "tiny": dict(layers=2, hidden=64, heads=4, kv_heads=2, vocab=256, seq=32, batch=4,
                 experts=8, moe_expert_ffn=32, deepseek_expert_ffn=48, ffn=128, q_rank=32,
                 kv_rank=32, nope=16, rope=8, tile=16),
}
PLAN = """plan {name} {{
  {model}
  mesh {{ }}
  schedule {{ microbatches = 1 }}
  train {{ steps = {steps}; optimizer = adamw(lr = 1e-4, weight_decay = 0.01); seed = 1 }}
}}
"""
WARMUP = 3
RECIPES = ("bf16", "fp8")  # the GEMMs in the dtype, and DeepSeek-V3's FP8 recipe


def plan_text(family: str, fp8: bool, size: str, steps: int) -> str:
    shape = SIZES[size]
    model = MODELS[family].format(fp8=f"fp8 = blockwise; fp8_tile = {shape['tile']}"
                                  if fp8 else "", **shape)
    return PLAN.format(name=f"{family}_{'fp8' if fp8 else 'bf16'}", model=model,
                       steps=steps)


def run(text: str, directory: Path) -> dict:
    from planc_metrics import run_for_metrics

    records, printed = run_for_metrics(text, directory)
    if records is None:
        return {"failed": printed}
    timed = records[WARMUP:]
    return {"ms": statistics.median(r["time_s"] for r in timed) * 1e3,
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
            "tflops": statistics.median(r["tflops_per_device"] for r in timed),
            "peak_mb": max(max(r["peak_memory_mb"]) for r in records),
            "peak_kind": records[-1]["peak_memory"],
            "losses": [r["loss"] for r in records]}


def parameters(text: str) -> int:
    from planc.lang import load_text
    from planc.models import FAMILIES

    model = load_text(text, "moe.plan").plan.model
    return sum(p.numel for p in FAMILIES[model.family].all_parameters(model))


def measure(size: str, steps: int, rounds: int, families: list[str],
            recipes: tuple[str, ...] = RECIPES) -> list[dict]:
    cases = [(family, recipe == "fp8") for family in families for recipe in recipes]
    results: dict[tuple[str, bool], list[dict]] = {case: [] for case in cases}
    for round_ in range(rounds):
        shift = round_ % len(cases)
        for family, fp8 in cases[shift:] + cases[:shift]:
            with tempfile.TemporaryDirectory() as tmp:
                result = run(plan_text(family, fp8, size, steps), Path(tmp))
            name = f"{family} {'fp8' if fp8 else 'bf16'}"
            if "failed" in result:  # the other plans still run
                print(f"  round {round_ + 1}: {name}: planc run failed:\n{result['failed']}",
                      file=sys.stderr, flush=True)
                continue
            results[family, fp8].append(result)
            # all of it, so that a run stopped at its time limit keeps what it measured
            print(f"  round {round_ + 1}: {name} {result['ms']:.1f} ms, "
                  f"{result['tokens_per_s']:,.0f} tokens/s, {result['tflops']:.1f} TFLOP/s, "
                  f"peak {result['peak_mb']:,.0f} MiB, losses "
                  f"{' '.join(f'{v:.4f}' for v in result['losses'])}", file=sys.stderr,
                  flush=True)
    rows = []
    for (family, fp8), runs in results.items():
        if not runs:
            continue
        text = plan_text(family, fp8, size, steps)
        rows.append({"family": family, "recipe": "fp8" if fp8 else "bf16",
                     "parameters": parameters(text),
                     "ms": statistics.median(r["ms"] for r in runs),
                     "rounds_ms": [r["ms"] for r in runs],
                     **{key: statistics.median(r[key] for r in runs)
                        for key in ("tokens_per_s", "tflops")},
                     "peak_mb": max(r["peak_mb"] for r in runs),
                     "peak_kind": runs[-1]["peak_kind"], "losses": runs[0]["losses"]})
    return rows


def table(rows: list[dict], device: str, size: str) -> str:
    lines = [f"{device}, MoE plans of size {size}, 1 device, bf16 weights with fp32 "
             f"master copies, AdamW",
             "", "| model | parameters | GEMMs | step ms | rounds ms | tokens/s | TFLOP/s | "
             "peak MiB | first loss | last loss |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        rounds = ", ".join(f"{v:.1f}" for v in row["rounds_ms"])
        count = row["parameters"]
        count = f"{count / 1e9:.2f}B" if count >= 1e9 else f"{count / 1e6:.2f}M"
        lines.append(f"| {row['family']} | {count} | {row['recipe']} | "
                     f"{row['ms']:.1f} | {rounds} | {row['tokens_per_s']:,.0f} | "
                     f"{row['tflops']:.1f} | {row['peak_mb']:,.0f} | {row['losses'][0]:.4f} | "
                     f"{row['losses'][-1]:.4f} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="gpu")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--only", choices=sorted(MODELS), action="append",
                        help="one family (repeatable); both by default")
    parser.add_argument("--recipe", choices=RECIPES, action="append",
                        help="the GEMMs of one recipe (repeatable); both by default")
    parser.add_argument("--json", metavar="OUT", help="also write the results as JSON")
    args = parser.parse_args()
    if args.steps <= WARMUP:
        parser.error(f"--steps must be more than {WARMUP} (the warm-up steps)")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    rows = measure(args.size, args.steps, args.rounds, args.only or sorted(MODELS),
                   tuple(args.recipe or RECIPES))
    print(table(rows, device, args.size))
    if args.json:
        Path(args.json).write_text(json.dumps({"device": device, "size": args.size,
                                               "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
