"""Does DeepSeek-V3's balancing bias balance the experts? Train plans/moe-tiny.plan with
the sigmoid gate, its bias frozen at zero (``bias_update = 0``) and updated
(``bias_update = 0.01``), and plot each step's ``moe_expert_imbalance`` (the busiest
expert's load over the mean, the worst block: docs/metrics.md) in
docs/moe-bias-balance.png.

    .venv/bin/python bench/moe_balance_bias.py [--steps 200] [--plot docs/moe-bias-balance.png]

Both runs start from the same weights and read the same batches (the plan's synthetic
tokens); only the bias differs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.corpus import loss_axes, save_curves  # noqa: E402 (the repository's root first)
PLANC = [os.path.join(os.path.dirname(sys.executable), "planc")]
RATES = ("0", "0.01")


def train(work: str, rate: str, steps: int) -> list[dict]:
    metrics = os.path.join(work, f"bias-{rate}.jsonl")
    subprocess.run(PLANC + ["run", "plans/moe-tiny.plan", "-o", os.path.join(work, "b"),
                            "--force", "--set", "model.score=sigmoid",
                            "--set", f"model.bias_update={rate}",
                            "--set", f"train.steps={steps}", "--metrics", metrics],
                   check=True, stdout=subprocess.DEVNULL)
    return [json.loads(line) for line in open(metrics)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--plot", default=os.path.join(ROOT, "docs", "moe-bias-balance.png"))
    args = parser.parse_args()
    os.chdir(ROOT)
    work = tempfile.mkdtemp(prefix="planc-moe-bias-")
    runs = {rate: train(work, rate, args.steps) for rate in RATES}
    quarter = max(1, args.steps // 4)
    for rate, records in runs.items():
        worst = [r["moe_expert_imbalance"] for r in records]
        ranks = [r["ep_imbalance"] for r in records]
        print(f"bias_update = {rate}: expert imbalance, mean of the last {quarter} steps "
              f"{sum(worst[-quarter:]) / quarter:.3f} (first step {worst[0]:.3f}); ep "
              f"imbalance {sum(ranks[-quarter:]) / quarter:.3f}; loss at the end "
              f"{records[-1]['loss']:.4f}")
    drawn = loss_axes("busiest expert's load / mean")
    if drawn is None:
        return 0
    figure, axes = drawn
    for rate, records in runs.items():
        axes.plot([r["step"] + 1 for r in records],
                  [r["moe_expert_imbalance"] for r in records], linewidth=1,
                  label=f"bias_update = {rate}")
    save_curves(figure, axes, "moe-tiny, sigmoid gate: the balancing bias at work", args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
