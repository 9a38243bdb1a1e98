"""Benchmark: one device, planc's step against the same model in plain PyTorch.

A llama trains for a few steps three ways, interleaved in rounds so that a slow moment
of the machine hits all three:

- ``planc``: ``planc run`` of a 1-rank plan (CUDA streams and events where a GPU is
  present, the generated step code on CPU);
- ``eager``: transformers' ``LlamaForCausalLM`` (SDPA attention) with torch's fused
  AdamW, a plain training loop;
- ``compiled``: the same module under ``torch.compile`` (forward and backward; on CUDA
  with ``mode="reduce-overhead"``, which replays CUDA graphs), the loop around it eager.

Every side starts from planc's initial weights (planc.runtime.oracle.reference, mapped
onto transformers' names by planc.hf.export) and trains on planc's batches, with the
same AdamW; the benchmark stops unless the first losses agree (1e-4 relative: fp32 on
both sides, different kernels). A step's time is the median after warm-up steps; a
side's figure the median of its rounds; the ratios are planc's over each peer's, with
each side's peak memory (CUDA: ``torch.cuda.max_memory_allocated``; CPU: peak resident
set, which for the PyTorch sides includes the benchmark process itself). Issue 37's
goals on one GPU: <= 1.00x eager and <= 1.05x compiled.

    .venv/bin/python bench/gpu_step.py                 # ~1.1B parameters on one GPU
    .venv/bin/python bench/gpu_step.py --size small    # bench/peers.py's size, a CPU
    .venv/bin/python bench/gpu_step.py --size tiny     # a 2-layer model, any machine
    .venv/bin/python bench/gpu_step.py --size small --compile-kernels  # planc with optimize { compile = on }

The 1B model (16 layers, hidden 2048, 32 heads, 8 kv heads, ffn 8192, vocabulary 32,000,
sequence 2,048, batch 4, fp32 with AdamW: about 18 GB of weights, gradients and optimizer
state) fits one 80 GB card. Run it whenever a GPU is available and put its table, with
the card's name, in docs/performance.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SIZES = {
    "1b": dict(layers=16, hidden=2048, heads=32, kv_heads=8, ffn=8192, vocab=32000,
               seq=2048, batch=4),
    "small": dict(layers=4, hidden=256, heads=8, kv_heads=4, ffn=704, vocab=2048, seq=128,
                  batch=16),
    "tiny": dict(layers=2, hidden=64, heads=4, kv_heads=2, ffn=160, vocab=256, seq=32,
                 batch=4),
}
PLAN = """plan gpu_step {{
  model llama {{ layers = {layers}; hidden = {hidden}; heads = {heads}; kv_heads = {kv_heads};
                ffn = {ffn}; vocab = {vocab}; seq = {seq}; batch = {batch}; dtype = fp32 }}
  mesh {{ }}
  schedule {{ microbatches = 1 }}
  optimize {{ compile = {compile} }}
  train {{ steps = {steps}; optimizer = adamw(lr = 1e-4, weight_decay = 0.01); seed = 1 }}
}}
"""
WARMUP = 3
SAME_LOSS = 1e-4  # relative: the first step's loss, before any update


def plan_of(size: str, steps: int, compile_kernels: bool = False):
    from planc.lang import load_text

    text = PLAN.format(steps=steps, compile="on" if compile_kernels else "off", **SIZES[size])
    loaded = load_text(text, "gpu_step.plan")
    if not loaded.ok:
        raise SystemExit(f"gpu_step: the plan does not check: {loaded.diagnostics}")
    return text, loaded.plan


def run_planc(text: str, directory: Path) -> dict:
    from planc_metrics import run_for_metrics

    records, printed = run_for_metrics(text, directory)
    if records is None:
        raise SystemExit(f"gpu_step: planc run failed:\n{printed}")
    return {"times": [r["time_s"] for r in records], "first_loss": records[0]["loss"],
            "peak_mb": max(records[-1]["peak_memory_mb"])}


def hf_model(plan, device, values):
    """transformers' LlamaForCausalLM with planc's initial weights (``values``, by
    planc's names), laid out as ``planc export`` writes them (planc.hf.export's tensors),
    SDPA attention, on ``device``."""
    import transformers

    from planc.hf.export import hf_config, model_tensors
    from planc.runtime.checkpoint.export_hf import hf_tensor

    config = transformers.LlamaConfig(**{k: v for k, v in hf_config(
        dataclasses.asdict(plan.model)).items() if k not in ("architectures", "model_type")})
    config._attn_implementation = "sdpa"
    import torch

    with torch.device(device):  # drawn where it runs: on a CPU, 1.1B values take seconds
        model = transformers.LlamaForCausalLM(config).float()
    state = {t.target: hf_tensor(t, values) for t in model_tensors(plan.model)}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or not all("rotary" in k for k in missing):
        raise SystemExit(f"gpu_step: planc's weights do not fit transformers' llama: "
                         f"{missing} {unexpected}")
    return model.to(device)


def run_torch(plan, values, steps: int, device, compiled: bool) -> dict:
    """A plain loop: forward, mean cross-entropy, backward, fused AdamW, zero_grad."""
    import torch
    import torch.nn.functional as F

    from planc.runtime.engine.data import batch_tokens

    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.zeros(1, device=device)  # the allocator's statistics exist once it is used
        torch.cuda.reset_peak_memory_stats(device)
    else:  # as planc run's one rank: the machine's cores, unless the user sets it
        from planc.runtime.launcher.launch import threads_per_rank

        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", threads_per_rank(1))))
    model = hf_model(plan, device, values)
    forward = torch.compile(model, mode="reduce-overhead" if device.type == "cuda" else None) \
        if compiled else model  # forward and backward compiled (AOTAutograd), as torchtitan
    train = plan.train.optimizer
    optimizer = torch.optim.AdamW(model.parameters(), lr=train.lr, betas=train.betas,
                                  eps=train.eps, weight_decay=train.weight_decay, fused=True)
    vocab = plan.model.vocab

    def step(tokens):
        logits = forward(input_ids=tokens[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, vocab).float(), tokens[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    batches = [batch_tokens(plan, k).to(device) for k in range(steps)]
    times, first = [], None
    for tokens in batches:
        sync(device)
        start = time.perf_counter()
        loss = step(tokens)
        sync(device)
        times.append(time.perf_counter() - start)
        if first is None:
            first = float(loss)
    result = {"times": times, "first_loss": first, "peak_mb": peak_mb(device)}
    if device.type == "cuda":  # give the memory back before the next side needs it: a
        # compiled module's CUDA graphs keep their pools while dynamo keeps the module
        del model, forward, optimizer, batches
        torch.compiler.reset()
        torch.cuda.empty_cache()
    return result


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_mb(device) -> float:
    import resource

    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure(size: str, steps: int, rounds: int, compile_kernels: bool = False) -> dict:
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    from planc.runtime.oracle.reference import initial_values

    text, plan = plan_of(size, steps, compile_kernels)
    values = initial_values(plan)  # drawn once: 1.1B values take tens of seconds
    sides = ("planc", "eager", "compiled")
    figures: dict[str, list[float]] = {side: [] for side in sides}
    peaks: dict[str, float] = {}
    firsts: dict[str, float] = {}
    for round_ in range(rounds):
        order = sides[round_ % 3:] + sides[:round_ % 3]
        for side in order:
            if side == "planc":
                with tempfile.TemporaryDirectory() as tmp:
                    result = run_planc(text, Path(tmp))
            else:
                result = run_torch(plan, values, steps, device,
                                   compiled=side == "compiled")
            figures[side].append(statistics.median(result["times"][WARMUP:]))
            peaks[side] = max(peaks.get(side, 0.0), result["peak_mb"])
            firsts[side] = result["first_loss"]
            print(f"  round {round_ + 1}: {side} {figures[side][-1] * 1e3:.1f} ms, peak "
                  f"{result['peak_mb']:,.0f} MiB, first loss {result['first_loss']:.6f}",
                  file=sys.stderr, flush=True)  # kept if a time limit stops the rest
        for side in ("eager", "compiled"):
            if abs(firsts[side] - firsts["planc"]) > SAME_LOSS * abs(firsts["planc"]):
                raise SystemExit(f"gpu_step: the first losses differ (planc "
                                 f"{firsts['planc']!r}, {side} {firsts[side]!r}): the sides "
                                 f"do not train the same function")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    medians = {side: statistics.median(values) for side, values in figures.items()}
    from planc.runtime.oracle.reference import parameters

    count = sum(math.prod(p.shape) for p in parameters(plan).values())
    return {"device": name, "size": size, "parameters": count,
            "ms": {s: m * 1e3 for s, m in medians.items()},
        "rounds_ms": {s: [v * 1e3 for v in values] for s, values in figures.items()},
        "peak_mb": peaks, "first_loss": firsts,
        "planc_over_eager": medians["planc"] / medians["eager"],
        "planc_over_compiled": medians["planc"] / medians["compiled"]}


def table(result: dict) -> str:
    count = result["parameters"]
    size = f"{count / 1e9:.2f}B" if count >= 1e9 else f"{count / 1e6:.1f}M"
    lines = [f"{result['device']}, llama {result['size']} ({size} parameters), 1 device, "
             f"fp32, AdamW",
             "", "| side | step ms | rounds ms | peak memory MiB | first loss |",
             "|---|---|---|---|---|"]
    for side, ms in result["ms"].items():
        rounds = ", ".join(f"{v:.1f}" for v in result["rounds_ms"][side])
        lines.append(f"| {side} | {ms:.1f} | {rounds} | {result['peak_mb'][side]:.0f} | "
                     f"{result['first_loss'][side]:.6f} |")
    lines += ["", f"planc / eager {result['planc_over_eager']:.2f} (goal <= 1.00); "
                  f"planc / compiled {result['planc_over_compiled']:.2f} (goal <= 1.05)"]
    return "\n".join(lines)


def main() -> int:
    from rounds import check_rounds_and_steps

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="1b")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", metavar="OUT", help="also write the results as JSON")
    parser.add_argument("--compile-kernels", action="store_true",
                        help="planc's plan with optimize { compile = on }")
    args = parser.parse_args()
    check_rounds_and_steps(parser, args, WARMUP)
    result = measure(args.size, args.steps, args.rounds, args.compile_kernels)
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
