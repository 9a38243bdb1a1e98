"""planc simulate against published training runs that state their layout: one table per
source, each row's error, each table's median and largest error and whether its errors
have both signs; the same with the model's constants re-derived without that table
(leave one table out); and predicted against published peak memory.

Every error is the simulated step time's: ``simulated / published - 1``, so a negative
error is a prediction faster than the run (a throughput is a step: tokens or FLOPs over
it). The tables, their plans and their sources:

- ``korthikanti``: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
  Transformer Models" (arXiv 2205.05198), Table 5, A100s (plans/korthikanti-*.plan, both
  columns);
- ``h100``: the Megatron-LM README's H100 weak-scaling table (plans/megatron-h100-*.plan);
- ``narayanan``: Narayanan et al., SC'21, Table 1, A100s, with the layouts of the paper's
  run scripts (plans/narayanan-*.plan); its TFLOP/s count the recomputed forward (eq. 3);
- ``llama3``: Dubey et al. 2024, Table 4, the 16,384-GPU row (plans/llama3-405b.plan);
- ``bloom``: BLOOM-176B and BigScience's layout search on Jean Zay (plans/bloom/);
- ``bloom_search``: held out, the readings of that layout search's two days (2022-02-25
  and 02-28) which ``bloom`` leaves out, each a bloom plan of that day with the reading's
  shape and layout;
- ``mtnlg``: MT-NLG 530B at 280, 350 and 420 nodes (plans/mtnlg/);
- ``torchtitan``: torchtitan's H100 Llama 3 benchmarks (plans/torchtitan/);
- ``planc_h200``: planc run's own steps on one H200, as bench/gpu_step.py and
  bench/gpu_moe.py measured them (plans/planc-h200/; not among the published dense runs);
- ``moe``: the mixtures of experts of plans/moe-published/ (tests/test_simulate_moe.py
  lists the sources; ``--write`` puts that table into docs/simulate.md);
- ``memory``: planc simulate's peak memory per device against the runs that publish theirs.

Each plan's header comment gives its source and what it assumes where the source is silent.
Everything runs in this process's workers (``planc.compile`` and ``planc.simulate``
imported, no subprocess per row).

    .venv/bin/python bench/validation.py [--only TABLE] [--json] [--kernels FILE]
    .venv/bin/python bench/validation.py --only moe --write
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLANS = ROOT / "plans"
sys.path.insert(0, str(ROOT))

from planc.compile import compile_plan  # noqa: E402
from planc.estimate.memory import estimate as memory_estimate  # noqa: E402
from planc.estimate.kernel_cost import GPUS, GPU  # noqa: E402
from planc.lang import load_file  # noqa: E402
from planc.simulate import model_flops, simulate  # noqa: E402
from bench.published_runs import (BLOOM, BLOOM_SEARCH_DAYS,  # noqa: E402
                                  CUDA_ALLOCATED, KORTHIKANTI_TABLE_5, MEGATRON_H100, MTNLG,
                                  NARAYANAN_TABLE_1, NVIDIA_SMI, PLANC_H200,
                                  SEQUENCE_SELECTIVE, TORCHTITAN, TORCHTITAN_COMPILED,
                                  TORCHTITAN_PEAK,
                                  narayanan_step_flops)

GB, GIB, MIB = 1e9, 2.0 ** 30, 2.0 ** 20

# --- the published runs -----------------------------------------------------------------

STEP, TFLOPS, EQ3_TFLOPS, TOKENS = "step", "tflops", "eq3_tflops", "tokens"
UNITS = {STEP: "s per step", TFLOPS: "model TFLOP/s per GPU",
         EQ3_TFLOPS: "TFLOP/s per GPU (eq. 3, recompute counted)",
         TOKENS: "tokens/s per GPU"}


@dataclass(frozen=True)
class Run:
    """One published run: its plan (with ``overrides``), what was published (``measure``
    in UNITS) and, where stated, its peak memory in bytes."""

    table: str
    label: str
    plan: str  # relative to plans/
    measure: str
    published: float
    overrides: tuple[str, ...] = ()
    memory: float | None = None
    memory_note: str = ""


SIZES = {"1_7b": "1.7B", "3_6b": "3.6B", "7_5b": "7.5B", "7_1b": "7.1B", "16b": "16B",
         "18b": "18B", "22b": "22B", "32b": "32B", "39b": "39B", "70b": "70B", "76b": "76B",
         "119b": "119B", "145b": "145B", "175b": "175B", "177b": "177B", "310b": "310B",
         "314b": "314B", "462b": "462B", "530b": "530B", "1t": "1T"}


def runs() -> list[Run]:
    rows = []
    for name, (full, selective) in KORTHIKANTI_TABLE_5.items():
        plan = f"korthikanti-{name}.plan"
        rows.append(Run("korthikanti", f"{SIZES[name]}, full recompute", plan, STEP, full))
        rows.append(Run("korthikanti", f"{SIZES[name]}, seq. parallel + selective", plan,
                        STEP, selective, SEQUENCE_SELECTIVE))
    rows += [Run("h100", SIZES[n], f"megatron-h100-{n}.plan", TFLOPS, v)
             for n, v in MEGATRON_H100.items()]
    rows += [Run("narayanan", SIZES[n], f"narayanan-{n}.plan", EQ3_TFLOPS, v)
             for n, v in NARAYANAN_TABLE_1.items()]
    rows.append(Run("llama3", "405B, 16,384 GPUs", "llama3-405b.plan", TFLOPS, 400.0))
    rows += [Run("bloom", n, f"bloom/{n}.plan", STEP, s, memory=m * GB,
                 memory_note=NVIDIA_SMI) for n, (s, m) in BLOOM.items()]
    rows += bloom_search()
    rows += [Run("mtnlg", n, f"mtnlg/{n}.plan", STEP, s) for n, s in MTNLG.items()]
    rows += [Run("torchtitan", n, f"torchtitan/{n}.plan", TOKENS, t,
                 memory=m * GIB if m else None, memory_note=TORCHTITAN_PEAK)
             for n, (t, m) in TORCHTITAN.items()]
    rows += [Run("torchtitan", f"{n} + torch.compile", f"torchtitan/{n}.plan", TOKENS, t,
                 ("optimize.kernels=fused",), memory=m * GIB, memory_note=TORCHTITAN_PEAK)
             for n, (t, m) in TORCHTITAN_COMPILED.items()]
    rows += [Run("planc_h200", n, f"planc-h200/{n}.plan", STEP, s, memory=m * MIB,
                 memory_note=CUDA_ALLOCATED) for n, (s, m) in PLANC_H200.items()]
    return rows


def bloom_search() -> list[Run]:
    """The timed readings of BLOOM_SEARCH_DAYS, each day's plan at the reading's shape and
    layout."""
    rows, seen = [], set()
    for date, plan, own, shape, layout, seconds, gb in _bloom_readings():
        if seconds is None:
            continue
        label, overrides = _bloom_reading(date, own, shape, layout)
        if label in seen:
            label += " (read again)"
        seen.add(label)
        rows.append(Run("bloom_search", label, plan, STEP, seconds, overrides,
                        memory=gb * GB if gb else None, memory_note=NVIDIA_SMI))
    return rows


def out_of_memory() -> list[dict]:
    """The layouts of BLOOM_SEARCH_DAYS read as out of memory: the estimate's peak against
    the device's capacity (above which planc check warns that the plan does not fit)."""
    rows = []
    for date, plan, own, shape, layout, seconds, _ in _bloom_readings():
        if seconds is None:
            label, overrides = _bloom_reading(date, own, shape, layout)
            estimate = memory_estimate(plan_of(plan, overrides))
            rows.append({"label": label, "memory": estimate.peak.total_bytes,
                         "capacity": estimate.capacity, "over": estimate.overflows})
    return rows


def _bloom_readings():
    """Each reading of BLOOM_SEARCH_DAYS with its day, its plan and the plan's own (layers,
    hidden, heads)."""
    for date, plan, readings in BLOOM_SEARCH_DAYS:
        model = plan_of(plan, ()).model
        own = (model.layers, model.hidden, model.heads)
        for shape, layout, seconds, gb in readings:
            yield date, plan, own, shape, layout, seconds, gb


def _bloom_reading(date, own, shape, layout) -> tuple[str, tuple[str, ...]]:
    """A reading's label and its overrides of the day's plan: the layout, and the shape
    where it is not the plan's own (the label then names the day and the shape)."""
    (layers, hidden, heads), (dp, tp, pp, micro, batch) = shape, layout
    overrides = (f"mesh.dp={dp}", f"mesh.tp={tp}", f"mesh.pp={pp}", f"model.batch={batch}",
                 f"schedule.microbatches={batch // dp // micro}")
    if shape == own:
        return f"dp {dp}, tp {tp}, pp {pp}, mbs {micro}, batch {batch}", overrides
    return (f"{date}, {layers} x {hidden}, {heads} heads: dp {dp}, tp {tp}, pp {pp}, "
            f"mbs {micro}",
            (f"model.layers={layers}", f"model.hidden={hidden}", f"model.heads={heads}")
            + overrides)


TABLE_SOURCES = {
    "korthikanti": "Korthikanti et al. 2022, Table 5 (A100, Selene)",
    "h100": "Megatron-LM README, H100 weak scaling (Megatron-Core r0.8)",
    "narayanan": "Narayanan et al. SC'21, Table 1, layouts of run_table_1.sh (A100, Selene)",
    "llama3": "Dubey et al. 2024, Table 4 (16,384 H100s)",
    "bloom": "BigScience tr11: BLOOM-176B and chronicles-prequel.md (A100, Jean Zay)",
    "bloom_search": "Held out: BigScience's layout search of 2022-02-25 and 02-28, the "
                    "readings the bloom table leaves out (chronicles-prequel.md, GBS "
                    "Variations and Rebalancing layers; A100, Jean Zay)",
    "mtnlg": "Smith et al. 2022, MT-NLG 530B, section 2.4 (A100, Selene; transcribed)",
    "torchtitan": "torchtitan benchmarks/, Llama 3 on H100 96GB (Grand Teton)",
    "planc_h200": "planc run on one H200: bench/gpu_step.py and bench/gpu_moe.py, 2026-12-04",
}

# --- the constants derived from a table's runs ----------------------------------------
# From the docstrings of planc/estimate/kernel_cost.py and planc/plan/presets.py: what each
# constant of the simulated step was derived from. A table absent here fed no constant,
# so its leave-one-table-out prediction is the shipped one.


@dataclass(frozen=True)
class Derived:
    what: str
    tables: tuple[str, ...]  # the tables whose runs it was derived from
    how: str


DERIVED = (
    Derived("dgx-h100 attention_forward, attention_backward (164, 168 TFLOP/s)",
            ("h100", "llama3"),
            "the median over the attention shapes of the Megatron-LM H100 plans and Llama 3 "
            "405B measured by bench/kernels_gpu.py; re-derived from --kernels FILE without "
            "the held-out table's shapes"),
    Derived("k_overhead = 256 (both GPUs)", ("h100", "llama3"),
            "read off the GEMMs of the same plans (K of 896 to 2,304); no stated rule to "
            "re-derive it from, so it is kept"),
    Derived("dgx-a100 efficiency = 0.6", ("korthikanti",),
            "chosen to match Korthikanti Table 5 (presets.py); removed (1.0): the kernel "
            "model prices the A100's compute without it"),
)
ATTENTION_PLANS = {"h100": "megatron-h100-", "llama3": "llama3-405b"}
FLASH_BACKWARD = 2.5  # FlashAttention counts a backward as 2.5 forwards (kernel_cost.py)


def attention_rates(path: Path, leave_out: str | None) -> tuple[float, float]:
    """(forward, backward) FLOP/s: the median over bench/kernels_gpu.py's attention lines
    of the plans not in ``leave_out``; the backward's time is forward+backward's less the
    forward's, its FLOPs 2.5 forwards'."""
    forward, backward = [], []
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if row.get("op") != "attention":
            continue
        if leave_out and row["plan"].startswith(ATTENTION_PLANS[leave_out]):
            continue
        flops = row["forward_tflops"] * row["forward_seconds"]  # TFLOP
        forward.append(row["forward_tflops"])
        backward.append(FLASH_BACKWARD * flops / (row["both_seconds"] - row["forward_seconds"]))
    if not forward:
        raise ValueError(f"{path} holds no attention line of the plans left")
    return statistics.median(forward) * 1e12, statistics.median(backward) * 1e12


def loo_variant(table: str, kernels: Path | None) -> tuple[tuple[str, ...], GPU | None, str]:
    """What to simulate the held-out ``table`` with: (overrides, replacement H100 GPU or
    None, note). Raises ValueError when a constant cannot be re-derived."""
    if table in ATTENTION_PLANS:
        if kernels is None:
            raise ValueError("needs bench/kernels_gpu.py's per-shape output on the H100 "
                             "(--kernels FILE; not in the repository)")
        shipped = GPUS["dgx-h100"]
        full = attention_rates(kernels, None)
        if any(abs(a - b) > 1e12 for a, b in zip(full, (shipped.attention_forward,
                                                        shipped.attention_backward))):
            raise ValueError(f"{kernels}'s medians ({full[0] / 1e12:.0f}, "
                             f"{full[1] / 1e12:.0f} TFLOP/s) are not the shipped constants: "
                             f"not the measurement they came from")
        forward, backward = attention_rates(kernels, table)
        return (), dataclasses.replace(shipped, attention_forward=forward,
                                       attention_backward=backward), \
            f"H100 attention {forward / 1e12:.0f}/{backward / 1e12:.0f} TFLOP/s"
    return (), None, "no constant derived from it"


# --- simulating ---------------------------------------------------------------------------


def published_step(run: Run, plan) -> float:
    """The published figure as seconds per step."""
    m = plan.model
    if run.measure == STEP:
        return run.published
    if run.measure == TFLOPS:
        return model_flops(plan) / (run.published * 1e12 * plan.world)
    if run.measure == EQ3_TFLOPS:
        return narayanan_step_flops(m) / (run.published * 1e12 * plan.world)
    return m.batch * m.seq / (run.published * plan.world)


def loaded(run: Run, overrides=()):
    return plan_of(run.plan, run.overrides + tuple(overrides))


def plan_of(path: str, overrides: tuple[str, ...]):
    """plans/``path`` with ``overrides``; ValueError with the diagnostics if it fails."""
    result = load_file(PLANS / path, overrides)
    if not result.ok:
        raise ValueError(f"{path}: " + "; ".join(d.message for d in result.diagnostics))
    return result.plan


def simulated(run: Run, kernels: Path | None = None) -> dict:
    """One run: shipped and leave-one-table-out predictions (in a worker process)."""
    plan = loaded(run)
    shipped = simulate(compile_plan(plan))
    step = published_step(run, plan)
    row = {"table": run.table, "label": run.label, "plan": run.plan,
           "overrides": list(run.overrides), "gpus": plan.world, "measure": run.measure,
           "published": run.published, "published_step": step,
           "step": shipped.step_seconds, "error": shipped.step_seconds / step - 1,
           "memory": max(s.memory_bytes for s in shipped.stages),
           "published_memory": run.memory, "memory_note": run.memory_note}
    try:
        overrides, gpu, note = loo_variant(run.table, kernels)
    except ValueError as exc:
        row.update(loo_error=None, loo_note=str(exc))
        return row
    if overrides:
        variant = simulate(compile_plan(loaded(run, overrides)))
    elif gpu is not None:
        variant = simulate(compile_plan(plan), gpu=gpu)
    else:
        variant = shipped
    row.update(loo_step=variant.step_seconds, loo_error=variant.step_seconds / step - 1,
               loo_note=note)
    return row


def simulate_all(chosen: list[Run], kernels: Path | None, workers: int) -> list[dict]:
    """Each run compiled and simulated in a worker (compiling dominates)."""
    if workers <= 1:
        return [simulated(run, kernels) for run in chosen]
    with ProcessPoolExecutor(workers) as pool:
        return list(pool.map(simulated, chosen, [kernels] * len(chosen)))


# --- the tables ---------------------------------------------------------------------------


def summary(errors: list[float]) -> dict:
    sizes = [abs(e) for e in errors]
    return {"rows": len(errors), "median": statistics.median(sizes), "largest": max(sizes),
            "both_signs": min(errors) < 0 < max(errors),
            "direction": ("mixed" if min(errors) < 0 < max(errors) else
                          "every row too fast" if max(errors) < 0 else "every row too slow")}


def figure(value: float, measure: str) -> str:
    return f"{value:,.2f} s" if measure == STEP else f"{value:,.1f}"


def table_of(name: str, rows: list[dict]) -> dict:
    shipped = summary([r["error"] for r in rows])
    loo = [r["loo_error"] for r in rows]
    return {"source": TABLE_SOURCES[name], "shipped": shipped,
            "loo": summary(loo) if None not in loo else None,
            "loo_note": rows[0]["loo_note"],
            "derived_from_it": [d.what for d in DERIVED if name in d.tables],
            "rows": rows}


def markdown(name: str, result: dict) -> list[str]:
    rows = result["rows"]
    unit = UNITS[rows[0]["measure"]]
    lines = [f"{result['source']}.", "",
             f"| run | GPUs | published ({unit}) | published step | simulated step | error "
             f"| leave one table out |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        loo = f"{r['loo_error']:+.1%}" if r["loo_error"] is not None else "n/a"
        lines.append(f"| {r['label']} | {r['gpus']:,} | {figure(r['published'], r['measure'])} "
                     f"| {r['published_step']:.2f} s | {r['step']:.2f} s | {r['error']:+.1%} "
                     f"| {loo} |")
    s = result["shipped"]
    lines += ["", f"Shipped: median {s['median']:.1%}, largest {s['largest']:.1%}, "
                  f"{s['direction']}."]
    if result["loo"] is not None:
        o = result["loo"]
        lines.append(f"Leave one table out ({result['loo_note']}): median {o['median']:.1%}, "
                     f"largest {o['largest']:.1%}, {o['direction']}.")
    else:
        lines.append(f"Leave one table out: not computed, {result['loo_note']}.")
    return lines


def memory_table(rows: list[dict]) -> dict:
    measured = [r for r in rows if r["published_memory"]]
    tables: dict[str, list[float]] = {}
    for r in measured:
        r["memory_error"] = r["memory"] / r["published_memory"] - 1
        tables.setdefault(r["table"], []).append(r["memory_error"])
    return {"rows": [{k: r[k] for k in ("table", "label", "plan", "gpus", "memory",
                                        "published_memory", "memory_note", "memory_error")}
                     for r in measured],
            **({"summary": summary([r["memory_error"] for r in measured]),
                "tables": {t: summary(e) for t, e in tables.items()}} if measured else {})}


def _under_over(direction: str) -> str:
    return direction.replace("too fast", "under").replace("too slow", "over")


def memory_markdown(result: dict) -> list[str]:
    lines = ["| table | run | GPUs | published peak | simulated peak | error | published as |",
             "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['table']} | {r['label']} | {r['gpus']:,} "
                     f"| {r['published_memory'] / GB:.1f} GB "
                     f"| {r['memory'] / GB:.1f} GB | {r['memory_error']:+.1%} "
                     f"| {r['memory_note']} |")
    if "summary" in result:
        s = result["summary"]
        lines += ["", f"Median {s['median']:.1%}, largest {s['largest']:.1%}, "
                      f"{_under_over(s['direction'])}, over the {s['rows']} runs; by table:", ""]
        for table, t in result["tables"].items():
            lines.append(f"- {table} ({t['rows']}): median {t['median']:.1%}, largest "
                         f"{t['largest']:.1%}, {_under_over(t['direction'])}")
    if result.get("out_of_memory"):
        lines += ["", "Layouts that ran out of memory (bloom_search: chronicles-prequel.md reads "
                      "them as OOM):", "",
                  "| run | simulated peak | capacity | planc check |", "|---|---|---|---|"]
        for r in result["out_of_memory"]:
            lines.append(f"| {r['label']} | {r['memory'] / GB:.1f} GB | "
                         f"{r['capacity'] / GB:.0f} GB | "
                         f"{'warns it does not fit' if r['over'] else 'says it fits'} |")
    return lines


def moe(write: bool, as_json: bool) -> dict:
    from tests.test_simulate_moe import BEGIN, DOC, END, moe_rows, moe_table

    def simulated_json(path: Path, overrides=()) -> dict:
        result = load_file(path, tuple(overrides))
        return simulate(compile_plan(result.plan)).to_json()

    rows = moe_rows(simulated_json)
    table = "\n".join(moe_table(rows))
    if not as_json:
        print(table)
    if write:
        text = DOC.read_text()
        head, rest = text.split(BEGIN, 1)
        DOC.write_text(f"{head}{BEGIN}\n{table}\n{END}{rest.split(END, 1)[1]}")
        print(f"wrote the table into {DOC.relative_to(ROOT)}", file=sys.stderr)
    # moe_rows' error is on throughput; as a step time's: 1 / (1 + e) - 1. A refused
    # run (its plan states what planc cannot express) has no error.
    simulated = [r for r in rows if not r["refused"]]
    errors = [1 / (1 + r["error"]) - 1 for r in simulated]
    return {"source": "plans/moe-published/ (tests/test_simulate_moe.py)",
            "shipped": summary(errors), "loo": summary(errors),
            "loo_note": "no constant derived from it",
            "rows": [{"label": r["run"], "plan": r["plan"], "error": e}
                     for r, e in zip(simulated, errors)],
            "refused": [{"label": r["run"], "plan": r["plan"], "refused": r["refused"]}
                        for r in rows if r["refused"]]}


TABLES = tuple(TABLE_SOURCES) + ("moe", "memory")
OWN_OR_MIXTURES = ("moe", "planc_h200")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=TABLES)
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    parser.add_argument("--write", action="store_true",
                        help="with --only moe: put the table into docs/simulate.md")
    parser.add_argument("--kernels", type=Path,
                        help="bench/kernels_gpu.py's output on the H100, to re-derive its "
                             "attention rates without each table")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)
    if args.write and args.only != "moe":
        parser.error("--write needs --only moe")
    if args.kernels is not None and not args.kernels.is_file():
        parser.error(f"--kernels {args.kernels}: no such file")
    every = runs()
    if args.only == "memory":
        chosen = [r for r in every if r.memory]
    elif args.only in (None,):
        chosen = every
    else:
        chosen = [r for r in every if r.table == args.only]
    try:
        rows = simulate_all(chosen, args.kernels, args.workers)
    except (ValueError, OSError) as exc:
        print(f"validation: {exc}", file=sys.stderr)
        return 1
    out: dict = {"format": "planc-validation", "version": 1,
                 "error": "simulated step / published step - 1", "tables": {}}
    for name in TABLE_SOURCES:
        mine = [r for r in rows if r["table"] == name]
        if mine and args.only != "memory":
            out["tables"][name] = table_of(name, mine)
            if not args.json:
                print(f"## {name}\n")
                print("\n".join(markdown(name, out["tables"][name])) + "\n")
    if args.only in (None, "moe"):
        if not args.json:
            print("## moe\n")
        out["tables"]["moe"] = moe(args.write, args.json)
        if not args.json:
            s = out["tables"]["moe"]["shipped"]
            refused = len(out["tables"]["moe"]["refused"])
            print(f"\nShipped (on the step time, {s['rows']} runs simulated, {refused} "
                  f"refused): median {s['median']:.1%}, largest {s['largest']:.1%}, "
                  f"{s['direction']}.\n")
    if args.only in (None, "memory"):
        out["memory"] = memory_table(rows)
        out["memory"]["out_of_memory"] = out_of_memory()
        if not args.json:
            print("## memory\n")
            print("\n".join(memory_markdown(out["memory"])) + "\n")
    # published dense runs: the mixtures and planc's own runs have their own figures
    dense = [r["error"] for t, v in out["tables"].items() if t not in OWN_OR_MIXTURES
             for r in v["rows"]]
    if dense:
        out["all_dense"] = summary(dense)
        if not args.json:
            s = out["all_dense"]
            print(f"Every published dense run ({s['rows']}): median {s['median']:.1%}, largest "
                  f"{s['largest']:.1%}, {s['direction']}.")
    if args.json:
        print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
