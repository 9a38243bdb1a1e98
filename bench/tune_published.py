"""Benchmark: ``planc tune`` against the layouts experts published.

For each published plan (Narayanan et al. SC'21's GPT-3 175B and 1T, the Megatron-LM H100
table, Llama 3 405B), tune searches its model on the same devices (``--top 3 --budget
60``) and the table compares the best it finds with the published layout, both
simulated on the plan's topology. The file's own layout is always among tune's
candidates, so its best is never predicted slower. The last column says whether the
speed-up is larger than the simulator's expected error for the plan
(planc.simulate.accuracy, from bench/validation.py): a smaller one is not a speed-up the
simulator can tell apart from its error.

    .venv/bin/python bench/tune_published.py [--budget 60] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PLANS = ("gpt3-175b", "gpt-1t", "llama3-405b", *(f"megatron-h100-{n}" for n in (
    "1_7b", "7_1b", "16b", "32b", "70b", "119b", "177b", "314b", "462b")))


def verdict(ratio: float, accuracy) -> str:
    if accuracy is None:
        return "unknown: the simulator was not measured on this device"
    if accuracy.tells_apart(ratio):
        return f"yes (± {accuracy.median:.1%})"
    return f"no: within ± {accuracy.median:.1%}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=60.0)
    parser.add_argument("--only", nargs="*", default=None)
    args = parser.parse_args()
    from planc.commands.tune import devices_per_node, topology_settings
    from planc.lang import load_text
    from planc.simulate.accuracy import expected
    from planc.tune import tune
    from planc.tune.space import of_plan

    print("| plan | devices | published layout | simulated | tune's best | simulated | "
          "speed-up | search | beyond the expected error |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.only or PLANS:
        source = (ROOT / "plans" / f"{name}.plan").read_text()
        plan = load_text(source).plan
        gpus = plan.world
        per_node = devices_per_node(plan, source, gpus)
        topology = topology_settings(source, per_node, gpus)

        def check(text):
            loaded = load_text(text)
            return loaded.plan if loaded.ok else None

        search = tune(plan, source, gpus, top=3, check=check, topology=topology,
                      per_node=per_node, budget=args.budget)
        own = of_plan(plan)
        published = next(r for r in search.ranked if r.candidate == own)
        best = search.best
        cell = lambda c: c.text().replace(" | ", "; ")  # noqa: E731 (a table's cell)
        ratio = published.step_seconds / best.step_seconds
        print(f"| {name} | {gpus:,} | {cell(own)} | {published.step_seconds:.2f} s | "
              f"{cell(best.candidate)} | {best.step_seconds:.2f} s | "
              f"{ratio:.2f}x | {search.seconds:.0f} s, {search.simulated} simulated | "
              f"{verdict(ratio, expected(plan))} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
