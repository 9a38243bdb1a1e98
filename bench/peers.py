"""Benchmark: planc against PyTorch's own distributed APIs, on the same model, same run.

Every pair trains planc's ``gpt`` model (4 layers, hidden 256, heads 8, vocab 2048, seq
128, batch 16, fp32, AdamW) on 2 gloo ranks, one thread each: planc through
``planc run``, PyTorch through bench/peers_torch.py (DDP, FSDP2, DTensor,
torch.distributed.pipelining, and the no-communication floor of data parallelism). The
runs of all pairs are interleaved in rounds (the order alternates), so that a slow
moment of the machine hits both sides. A run's step time is the median, after two
warm-up steps, of each step's slowest rank; a pair's figure is the median over the
rounds, and the ratio is planc's figure over the peer's. Both sides start from planc's
initial weights on planc's batches, and every round checks that they train the same
function: planc's first loss and the peer's agree to 1e-5 (relative), or the benchmark
stops.

It also compiles and runs the dp 2 and ZeRO-3 plans with fuse and with overlap turned
off: collectives per step, step time and exposed communication.

    .venv/bin/python bench/peers.py [--rounds 3] [--steps 8] [--only dp2,tp2] [--json OUT]

Goals (issue 37, against each peer at its best: torch's fused AdamW and planc's allocator
settings in bench/peers_torch.py): 1 rank <= 1.00x plain; dp 2 <= 0.95x DDP and <= 1.05x
the floor; zero 3 <= 0.85x FSDP2; tp 2, with or without sequence parallelism, <= 0.80x
DTensor; pp 2 1F1B and GPipe <= 0.95x torch's schedule; zb1p <= 0.85x Schedule1F1B;
interleaved, interleaved_zb, zbv and dualpipev (virtual 2) <= 0.90x torch's own.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

WARMUP = 2
# The plans say what they run on: gloo processes on CPU cores (the cpu preset, whose
# collectives hide nothing behind compute, as planc calibrate measures here).
PLAN = """plan bench {{
  model gpt {{ layers = 4; hidden = 256; heads = 8; vocab = 2048; seq = 128; batch = 16 }}
  mesh {{ {mesh} }}
  topology {{ preset = cpu }}
  shard {{ {shard} }}
  schedule {{ microbatches = {m}; pipeline = {pipeline} }}
  optimize {{ {optimize} }}
  train {{ steps = {steps}; optimizer = adamw(lr = 1e-3, weight_decay = 0.01); seed = 1 }}
}}
"""

# name: (planc plan, PyTorch peer, goal for planc / peer)
PAIRS = {
    "1 rank": (dict(), "plain", 1.00),
    "dp 2": (dict(mesh="dp = 2"), "ddp", 0.95),
    "dp 2 (floor)": (dict(mesh="dp = 2"), "floor", 1.05),
    "zero 3": (dict(mesh="dp = 2", shard="dp { zero = 3 }"), "fsdp2", 0.85),
    "tp 2": (dict(mesh="tp = 2"), "tp", 0.8),
    "tp 2, sequence parallel": (dict(mesh="tp = 2", shard="tp { sequence_parallel = on }"),
                                "tp_sp", 0.8),
    # tp_overlap (collective matmul) off and forced to 2 chunks: what it does on gloo
    "tp 2, tp_overlap off": (dict(mesh="tp = 2", optimize="tp_overlap = off"), "tp", None),
    "tp 2, tp_overlap 2": (dict(mesh="tp = 2", optimize="tp_overlap = 2"), "tp", None),
    "tp 2, sp, tp_overlap off": (dict(mesh="tp = 2", shard="tp { sequence_parallel = on }",
                                      optimize="tp_overlap = off"), "tp_sp", None),
    "tp 2, sp, tp_overlap 2": (dict(mesh="tp = 2", shard="tp { sequence_parallel = on }",
                                    optimize="tp_overlap = 2"), "tp_sp", None),
    "pp 2, 1F1B": (dict(mesh="pp = 2", m=4), "pp_1f1b", 0.95),
    "pp 2, GPipe": (dict(mesh="pp = 2", m=4, pipeline="gpipe"), "pp_gpipe", 0.95),
    "pp 2, zb1p": (dict(mesh="pp = 2", m=4, pipeline="zb1p"), "pp_1f1b", 0.85),
    "pp 2, interleaved": (dict(mesh="pp = 2", m=4, pipeline="interleaved",
                               shard="pp { virtual = 2 }"), "pp_interleaved", 0.90),
    "pp 2, interleaved_zb": (dict(mesh="pp = 2", m=4, pipeline="interleaved_zb",
                                  shard="pp { virtual = 2 }"), "pp_interleaved_zb", 0.90),
    # the V schedules, virtual 2: chunk 0 and the last chunk on stage 0
    "pp 2, zbv": (dict(mesh="pp = 2", m=4, pipeline="zbv", shard="pp { virtual = 2 }"),
                  "pp_zbv", 0.90),
    "pp 2, dualpipev": (dict(mesh="pp = 2", m=4, pipeline="dualpipev",
                             shard="pp { virtual = 2 }"), "pp_dualpipev", 0.90),
}
SHORT = {"1rank": "1 rank", "dp2": "dp 2", "floor": "dp 2 (floor)", "zero3": "zero 3",
         "tp2": "tp 2", "tp2sp": "tp 2, sequence parallel", "1f1b": "pp 2, 1F1B",
         "tp2off": "tp 2, tp_overlap off", "tp2c2": "tp 2, tp_overlap 2",
         "tp2spoff": "tp 2, sp, tp_overlap off", "tp2spc2": "tp 2, sp, tp_overlap 2",
         "gpipe": "pp 2, GPipe", "zb1p": "pp 2, zb1p", "interleaved": "pp 2, interleaved",
         "interleaved_zb": "pp 2, interleaved_zb", "zbv": "pp 2, zbv",
         "dualpipev": "pp 2, dualpipev"}
SWITCHES = {"passes on": "", "fuse off": "fuse = off", "overlap off": "overlap = off"}


def plan_text(case: dict, steps: int, optimize: str = "") -> str:
    values = dict(mesh="", shard="", m=1, pipeline="1f1b", optimize=optimize, steps=steps)
    values.update(case)
    return PLAN.format(**values)


def run_planc(text: str, directory: Path) -> dict:
    """``planc run`` of one plan: per-step records of the metrics file, and the build's
    collectives per step on the busiest stage."""
    from planc.cli import main

    plan = directory / "bench.plan"
    plan.write_text(text)
    metrics = directory / "metrics.jsonl"
    captured = io.StringIO()
    with contextlib.redirect_stderr(captured), contextlib.redirect_stdout(io.StringIO()):
        status = main(["run", str(plan), "-o", str(directory / "build"), "--metrics",
                       str(metrics), "--force"])  # the last round's metrics: replaced
    if status != 0:
        raise SystemExit(f"planc run failed:\n{captured.getvalue()[-3000:]}")
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    summary = json.loads((directory / "build" / "summary.json").read_text())
    collectives = max(sum(t["count"] for t in stage["transfers"]
                          if t["kind"] not in ("send", "recv"))
                      for stage in summary["stages"])
    return {"records": records, "collectives_per_step": collectives}


# Both sides start from planc's initial weights on planc's batches (bench/peers_torch.py),
# so the first step's loss, computed before any update, is the same function of the same
# numbers; only the order of floating-point sums differs (fp32: a few ulps of the loss).
SAME_LOSS = 1e-5  # relative


def same_function(name: str, first: dict[str, float]) -> None:
    """Stop the benchmark unless planc and the peer computed the same first loss."""
    planc, peer = first["planc"], first["peer"]
    if abs(planc - peer) > SAME_LOSS * abs(peer):
        raise SystemExit(f"{name}: planc's first loss {planc!r} and the peer's {peer!r} "
                         f"differ: the two sides do not train the same function")


def median_after_warmup(values: list[float]) -> float:
    return statistics.median(values[WARMUP:])


def measure_pairs(names: list[str], rounds: int, steps: int) -> dict:
    from peers_torch import run_peer

    planc_times: dict[str, list[float]] = {n: [] for n in names}
    peer_times: dict[str, list[float]] = {n: [] for n in names}
    details: dict[str, dict] = {}
    peer_runs: dict[str, list[float]] = {}  # one peer may serve two pairs: run it once
    peer_first: dict[str, float] = {}
    first_losses: dict[str, dict[str, float]] = {}  # pair -> side -> the first step's loss
    for round_ in range(rounds):
        peer_runs.clear()
        for i, name in enumerate(names):
            case, peer, _ = PAIRS[name]
            order = ("planc", "peer") if (round_ + i) % 2 == 0 else ("peer", "planc")
            for side in order:
                if side == "peer":
                    if peer not in peer_runs:
                        result = run_peer(peer, steps=steps)
                        peer_runs[peer] = median_after_warmup(result["step_times"])
                        peer_first[peer] = result["losses"][0]
                        details.setdefault(name, {})["peer_collectives"] = \
                            result.get("collectives_per_step")
                    peer_times[name].append(peer_runs[peer])
                    first_losses.setdefault(name, {})["peer"] = peer_first[peer]
                else:
                    with tempfile.TemporaryDirectory() as tmp:
                        result = run_planc(plan_text(case, steps), Path(tmp))
                    records = result["records"]
                    planc_times[name].append(median_after_warmup([r["time_s"] for r in
                                                                  records]))
                    first_losses.setdefault(name, {})["planc"] = records[0]["loss"]
                    details.setdefault(name, {}).update(
                        planc_collectives=result["collectives_per_step"],
                        exposed_comm_s=median_after_warmup([r["exposed_comm_s"]
                                                            for r in records]))
            print(f"  round {round_ + 1}: {name}: planc {planc_times[name][-1] * 1e3:.0f} ms, "
                  f"{peer} {peer_times[name][-1] * 1e3:.0f} ms", file=sys.stderr, flush=True)
            same_function(name, first_losses[name])
            details.setdefault(name, {})["first_losses"] = dict(first_losses[name])
    out = {}
    for name in names:
        planc, peer = statistics.median(planc_times[name]), statistics.median(peer_times[name])
        ratios = [a / b for a, b in zip(planc_times[name], peer_times[name])]
        out[name] = {"peer": PAIRS[name][1], "planc_ms": planc * 1e3, "peer_ms": peer * 1e3,
                     "ratio": planc / peer, "round_ratios": ratios, "goal": PAIRS[name][2],
                     **details.get(name, {})}
    return out


def measure_switches(rounds: int, steps: int) -> dict:
    """dp 2 and ZeRO-3 with each pass on and off: interleaved as well."""
    cases = {"dp 2": PAIRS["dp 2"][0], "zero 3": PAIRS["zero 3"][0]}
    times: dict[tuple[str, str], list[dict]] = {}
    for _ in range(rounds):
        for name, case in cases.items():
            for switch, optimize in SWITCHES.items():
                with tempfile.TemporaryDirectory() as tmp:
                    result = run_planc(plan_text(case, steps, optimize), Path(tmp))
                records = result["records"]
                times.setdefault((name, switch), []).append({
                    "time": median_after_warmup([r["time_s"] for r in records]),
                    "exposed": median_after_warmup([r["exposed_comm_s"] for r in records]),
                    "collectives": result["collectives_per_step"]})
    return {f"{name}, {switch}": {
        "ms": statistics.median(r["time"] for r in runs) * 1e3,
        "exposed_ms": statistics.median(r["exposed"] for r in runs) * 1e3,
        "collectives_per_step": runs[0]["collectives"]} for (name, switch), runs in
        times.items()}


def table(pairs: dict, switches: dict) -> str:
    lines = ["| planc plan | PyTorch peer | planc ms | peer ms | planc / peer | rounds | goal "
             "| met |", "|---|---|---|---|---|---|---|---|"]
    for name, r in pairs.items():
        spread = f"{min(r['round_ratios']):.2f}-{max(r['round_ratios']):.2f}"
        goal = f"<= {r['goal']:.2f}" if r["goal"] else "-"
        met = "-" if not r["goal"] else ("yes" if r["ratio"] <= r["goal"] else "no")
        lines.append(f"| {name} | {r['peer']} | {r['planc_ms']:.0f} | {r['peer_ms']:.0f} | "
                     f"{r['ratio']:.2f} | {spread} | {goal} | {met} |")
    if switches:
        lines += ["", "| plan, passes | collectives per step | step ms | exposed comm ms |",
                  "|---|---|---|---|"]
        for name, r in switches.items():
            lines.append(f"| {name} | {r['collectives_per_step']} | {r['ms']:.0f} | "
                         f"{r['exposed_ms']:.0f} |")
    return "\n".join(lines)


def main() -> int:
    from rounds import check_rounds_and_steps

    # one intra-op thread for every rank of both sides (the peers set it for theirs):
    # planc run would give a 1-rank plan every core of the machine
    os.environ["OMP_NUM_THREADS"] = "1"

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--only", help="comma-separated pairs: " + ", ".join(SHORT))
    parser.add_argument("--no-switches", action="store_true",
                        help="skip the fuse/overlap on-off runs")
    parser.add_argument("--json", metavar="OUT", help="also write the results as JSON")
    args = parser.parse_args()
    check_rounds_and_steps(parser, args, WARMUP)
    names = list(PAIRS)
    if args.only:
        try:
            names = [SHORT[n.strip()] for n in args.only.split(",")]
        except KeyError as exc:
            parser.error(f"unknown pair {exc}; choose from {', '.join(SHORT)}")
    pairs = measure_pairs(names, args.rounds, args.steps)
    switches = {} if args.no_switches else measure_switches(args.rounds, args.steps)
    print(table(pairs, switches))
    if args.json:
        Path(args.json).write_text(json.dumps({"pairs": pairs, "switches": switches},
                                              indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
