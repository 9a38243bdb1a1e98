"""Train plans/llama-small.plan under two layouts for 50 steps on the project's corpus and
draw both losses with planc plot (docs/loss-two-plans.png): every plan computes the
single-process function, so the two curves lie on one another.

    .venv/bin/python bench/loss_curves.py [--steps 50] [--plot docs/loss-two-plans.png]

The layouts: tp 2 with sequence parallelism (the plan as written), and dp 2 with ZeRO-3.
Makes data/tiny-corpus.tokens first if it is missing (python -m planc.data.corpus).
Prints the largest difference between the two runs' losses.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.corpus import loss_bench_arguments  # noqa: E402 (the repository's root first)
PLANC = [sys.executable, "-m", "planc"]
LAYOUTS = {  # the metrics file's name (planc plot's label beside the plan's) -> overrides
    "tp2-sp.jsonl": [],
    "dp2-zero3.jsonl": ["mesh.tp=1", "mesh.dp=2", "shard.tp.sequence_parallel=off",
                        "shard.dp.zero=3"],
}


def main() -> int:
    args = loss_bench_arguments(__doc__.splitlines()[0], 50, "loss-two-plans.png", ROOT)
    work = tempfile.mkdtemp(prefix="planc-loss-curves-")
    files = []
    for name, overrides in LAYOUTS.items():
        metrics = os.path.join(work, name)
        sets = [arg for o in ["train.data=\"../data/tiny-corpus.tokens\"",
                              f"train.steps={args.steps}", *overrides] for arg in ("--set", o)]
        subprocess.run(PLANC + ["run", "plans/llama-small.plan", "-o",
                                os.path.join(work, name.split(".")[0]), *sets,
                                "--metrics", metrics], check=True)
        files.append(metrics)
    losses = [[json.loads(line)["loss"] for line in open(f)] for f in files]
    gaps = [abs(a - b) for a, b in zip(*losses)]
    worst = max(range(len(gaps)), key=gaps.__getitem__)
    print(f"loss: step 1 {losses[0][0]:.4f}, step {len(losses[0])} {losses[0][-1]:.4f} and "
          f"{losses[1][-1]:.4f}; the layouts differ by at most {max(gaps[:10]):.2g} over "
          f"steps 1-10, {gaps[-1]:.2g} at step {len(gaps)}, {gaps[worst]:.2g} at most (step "
          f"{worst + 1})")
    subprocess.run(PLANC + ["plot", *files, "-o", args.plot, "--force"], check=True)
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
