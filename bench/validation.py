"""The validation tables of docs/simulate.md, from real runs of ``planc simulate --json``:
Korthikanti et al. 2022 Table 5 (A100), the Megatron-LM README's H100 weak-scaling table,
Narayanan et al. 2021 Table 1 (A100, held out) and Llama 3 405B (Dubey et al. 2024,
Table 4), and the mixtures of experts of plans/moe-published/ against their published
throughput (tests/test_simulate_moe.py lists the sources). Prints the Markdown tables with
each row's error and the median and largest; ``--write`` puts the moe table into
docs/simulate.md, where tests/test_simulate_moe.py checks it.

    .venv/bin/python bench/validation.py [--only korthikanti|h100|narayanan|llama3|moe]
    .venv/bin/python bench/validation.py --only moe --write
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLANS = ROOT / "plans"
sys.path.insert(0, str(ROOT))

from planc.lang import load_file  # noqa: E402
from tests.test_simulate import (KORTHIKANTI_TABLE_5, MEGATRON_H100,  # noqa: E402
                                 NARAYANAN_TABLE_1, SEQUENCE_SELECTIVE,
                                 narayanan_step_flops)
from tests.test_simulate_moe import BEGIN, DOC, END, moe_rows, moe_table  # noqa: E402

SIZES = {"1_7b": "1.7B", "3_6b": "3.6B", "7_5b": "7.5B", "7_1b": "7.1B", "16b": "16B",
         "18b": "18B", "22b": "22B", "32b": "32B", "39b": "39B", "70b": "70B", "76b": "76B",
         "119b": "119B", "145b": "145B", "175b": "175B", "177b": "177B", "310b": "310B",
         "314b": "314B", "462b": "462B", "530b": "530B", "1t": "1T"}


def simulated(path: Path, overrides=()) -> dict:
    command = [sys.executable, "-m", "planc", "simulate", str(path), "--json"]
    for override in overrides:
        command += ["--set", override]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, check=True)
    return json.loads(done.stdout)


def summary(errors: list[float]) -> str:
    sizes = [abs(e) for e in errors]
    return f"Median error {statistics.median(sizes):.1%}, largest {max(sizes):.1%}."


def korthikanti() -> None:
    print("| model | GPUs | full recompute: published | simulated | error "
          "| seq. parallel + selective: published | simulated | error |")
    print("|---|---|---|---|---|---|---|---|")
    errors = []
    for name, (full, selective) in KORTHIKANTI_TABLE_5.items():
        path = PLANS / f"korthikanti-{name}.plan"
        a, b = simulated(path), simulated(path, SEQUENCE_SELECTIVE)
        ea, eb = a["step_seconds"] / full - 1, b["step_seconds"] / selective - 1
        errors += [ea, eb]
        print(f"| {SIZES[name]} | {a['world']:,} | {full:.2f} s | {a['step_seconds']:.2f} s "
              f"| {ea:+.1%} | {selective:.2f} s | {b['step_seconds']:.2f} s | {eb:+.1%} |")
    print("\n" + summary(errors))


def h100() -> None:
    print("| model | GPUs | published TFLOP/s per GPU | simulated | error |")
    print("|---|---|---|---|---|")
    errors = []
    for name, published in MEGATRON_H100.items():
        data = simulated(PLANS / f"megatron-h100-{name}.plan")
        error = data["tflops_per_gpu"] / published - 1
        errors.append(error)
        print(f"| {SIZES[name]} | {data['world']:,} | {published:.1f} "
              f"| {data['tflops_per_gpu']:.1f} | {error:+.1%} |")
    print("\n" + summary(errors))


def narayanan() -> None:
    print("| model | GPUs | published TFLOP/s per GPU (eq. 3) | published step | simulated "
          "| error |")
    print("|---|---|---|---|---|---|")
    errors = []
    for name, published in NARAYANAN_TABLE_1.items():
        path = PLANS / f"narayanan-{name}.plan"
        data = simulated(path)
        step = narayanan_step_flops(load_file(path).plan.model) / (
            published * 1e12 * data["world"])
        error = data["step_seconds"] / step - 1
        errors.append(error)
        print(f"| {SIZES[name]} | {data['world']:,} | {published} | {step:.2f} s "
              f"| {data['step_seconds']:.2f} s | {error:+.1%} |")
    print("\n" + summary(errors))


def llama3() -> None:
    data = simulated(PLANS / "llama3-405b.plan")
    print(f"llama3-405b: {data['tflops_per_gpu']:.1f} TFLOP/s per GPU (published 400), "
          f"MFU {data['mfu']:.1%} (published 41%), bubble {data['bubble']:.1%}, "
          f"error {data['tflops_per_gpu'] / 400 - 1:+.1%}")


def moe(write: bool = False) -> None:
    rows = moe_rows(simulated)
    table = "\n".join(moe_table(rows))
    print(table)
    print("\n" + summary([r["error"] for r in rows]))
    if write:
        text = DOC.read_text()
        head, rest = text.split(BEGIN, 1)
        DOC.write_text(f"{head}{BEGIN}\n{table}\n{END}{rest.split(END, 1)[1]}")
        print(f"wrote the table into {DOC.relative_to(ROOT)}")


TABLES = {"korthikanti": korthikanti, "h100": h100, "narayanan": narayanan, "llama3": llama3,
          "moe": moe}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", choices=sorted(TABLES))
    parser.add_argument("--write", action="store_true",
                        help="with --only moe: put the table into docs/simulate.md")
    args = parser.parse_args()
    if args.write and args.only != "moe":
        parser.error("--write needs --only moe")
    for name, table in TABLES.items():
        if args.only in (None, name):
            print(f"## {name}\n")
            table(args.write) if name == "moe" else table()
            print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
