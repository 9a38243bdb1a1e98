"""Benchmark: does ``planc simulate``'s peak memory per device hold for ``planc run`` on
this machine? For each plan of plans/ that trains here (bench/simulate_here.py's list),
run it for a few steps with gloo on this machine's CPUs, as many ranks as the plan has,
and compare the simulated peak (planc.estimate.memory: parameters, gradients, optimizer state,
activations; ``planc simulate --json``'s largest ``stages[].memory_bytes``) with what
the run records: ``peak_memory_mb`` (docs/metrics.md), on a CPU the peak resident set
of each rank (getrusage's ru_maxrss), the largest over the ranks, less two baselines:

- **cold**: a rank before it builds anything (bench/simulate_here.py's baseline: a
  process forked, as planc run forks its ranks, from one that imported planc's worker
  and torch, that has started gloo);
- **warm**: the same rank once it has run one training step of a model of no size: an
  8 x 8 matrix product's forward and backward, a cross entropy's, one step of the plan's
  optimizer as the runtime builds it (planc.runtime.engine.optim, fused) and one all-reduce,
  after planc.runtime.engine.host_memory's allocator settings. What this holds beyond the cold
  baseline is the libraries' working state (their code and buffers, loaded on first
  use), whatever the plan; what a run holds beyond it is the plan's own.

Nothing is fitted: the baselines are measured by the commands above, on this machine,
each time the benchmark runs.

    .venv/bin/python bench/memory_here.py [--steps 3] [--plans demo,gpt-tiny] [--write]

``--write`` puts the table into docs/simulate.md, "### Memory", between its markers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from simulate_here import HERE, MIB, baseline_mib, planc  # noqa: E402

DOC = ROOT / "docs" / "simulate.md"
BEGIN = "<!-- memory here: bench/memory_here.py --write regenerates it -->"
END = "<!-- end of the memory here table -->"

WARM_BASELINE = """
import datetime, json, multiprocessing, os, resource, sys, tempfile
import planc.runtime.worker  # noqa: F401  (what planc run's fork server preloads)
import torch
import torch.distributed as dist
from planc.plan.plan import Optimizer
from planc.runtime.engine.host_memory import keep_freed_memory
from planc.runtime.engine.optim import BucketOptimizer

def child(queue, name):
    keep_freed_memory()
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "s"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    weight = torch.zeros(8, 8, requires_grad=True)
    logits = torch.randn(4, 8) @ weight
    torch.nn.functional.cross_entropy(logits, torch.tensor([1, 2, 3, 4])).backward()
    BucketOptimizer(Optimizer(name=name), weight).step()
    dist.all_reduce(weight.grad)
    queue.put(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)

context = multiprocessing.get_context("fork")
queue = context.Queue()
process = context.Process(target=child, args=(queue, sys.argv[1]))
process.start()
print(json.dumps(queue.get()))
process.join()
"""


def warm_baseline_mib(optimizer: str) -> float:
    """The peak resident set, MiB, of a rank that has trained a model of no size with
    ``optimizer`` (see above)."""
    done = subprocess.run([sys.executable, "-c", WARM_BASELINE, optimizer],
                          capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    if done.returncode:
        raise SystemExit(done.stderr)
    return float(done.stdout)


def measure(name: str, steps: int, scratch: Path) -> dict:
    from planc.compile import compile_plan
    from planc.lang import load_file
    from planc.simulate import simulate

    source = ROOT / "plans" / f"{name}.plan"
    loaded = load_file(source)
    if not loaded.ok:
        raise SystemExit(f"{source}: {[d.message for d in loaded.diagnostics]}")
    plan = loaded.plan
    simulated = simulate(compile_plan(plan))
    # what planc run holds, where planc simulate says it is more than the estimate
    predicted = simulated.planc_run_memory[1] if simulated.planc_run_memory else max(
        s.memory_bytes for s in simulated.stages)
    metrics = scratch / f"{name}.jsonl"
    done = planc("run", source, "-o", scratch / f"{name}-build", "--steps", steps,
                 "--metrics", metrics, "--force")
    if done.returncode:
        raise SystemExit(f"planc run {name}: {done.stderr[-3000:]}")
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    kinds = {r["peak_memory"] for r in records}
    if kinds != {"max_rss"}:
        raise SystemExit(f"{name}: peak memory measured as {kinds}, not a CPU's max_rss")
    return {"plan": name, "mesh": plan.mesh, "optimizer": plan.train.optimizer.name,
            "measured_mib": max(max(r["peak_memory_mb"]) for r in records),
            "predicted_bytes": predicted}


def table(rows: list[dict], cold: float, warm: dict[str, float], steps: int) -> str:
    lines = ["| plan | ranks (tp x cp x pp x dp) | optimizer | peak RSS (largest rank) "
             "| less the warm baseline | simulated peak | error |",
             "|---|---|---|---|---|---|---|"]
    errors = []
    for r in rows:
        m, own = r["mesh"], r["measured_mib"] - warm[r["optimizer"]]
        error = r["predicted_bytes"] / MIB / own - 1
        errors.append(abs(error))
        lines.append(f"| {r['plan']} | {m.world} ({m.tp} x {m.cp} x {m.pp} x {m.dp}) | "
                     f"{r['optimizer']} | {r['measured_mib']:.1f} MiB | {own:.1f} MiB | "
                     f"{r['predicted_bytes'] / MIB:.2f} MiB | {error:+.0%} |")
    warm_text = ", ".join(f"{mib:.1f} MiB with {name}" for name, mib in sorted(warm.items()))
    lines += ["", f"{steps} steps each. Baselines: cold {cold:.1f} MiB, warm {warm_text}. "
                  f"Median error {statistics.median(errors):.0%}, largest {max(errors):.0%} "
                  f"(goal: 10 %)."]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--plans", default=",".join(HERE),
                        help="comma-separated names of plans/*.plan")
    parser.add_argument("--write", action="store_true",
                        help="put the table into docs/simulate.md between its markers")
    args = parser.parse_args()
    names = [n for n in args.plans.split(",") if n]
    unknown = [n for n in names if not (ROOT / "plans" / f"{n}.plan").is_file()]
    if unknown or args.steps < 1:
        print(f"memory_here: no plans/{unknown[0]}.plan" if unknown else
              "memory_here: --steps must be at least 1", file=sys.stderr)
        return 2
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for name in names:
            rows.append(measure(name, args.steps, Path(scratch)))
            print(f"{name}: {rows[-1]['measured_mib']:.1f} MiB peak RSS, "
                  f"{rows[-1]['predicted_bytes'] / MIB:.2f} MiB simulated", file=sys.stderr,
                  flush=True)
    cold = baseline_mib()
    warm = {name: warm_baseline_mib(name) for name in sorted({r["optimizer"] for r in rows})}
    text = table(rows, cold, warm, args.steps)
    print(text)
    return write_between(DOC, BEGIN, END, text, "memory_here") if args.write else 0


def write_between(doc_path: Path, begin: str, end: str, text: str, who: str) -> int:
    """Put ``text`` into the document between its two marker lines; 1 (and a line on
    stderr) if it has not both."""
    doc = doc_path.read_text()
    if begin not in doc or end not in doc:
        print(f"{who}: {doc_path} has no markers {begin!r} ... {end!r}", file=sys.stderr)
        return 1
    head, rest = doc.split(begin, 1)
    doc_path.write_text(f"{head}{begin}\n{text}\n{end}{rest.split(end, 1)[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
