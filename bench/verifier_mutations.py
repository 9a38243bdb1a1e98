"""Single changes to compiled programs against the verifier, and what the accepted ones do.

For each of five 2-rank plans (pp 2 with 1F1B, pp 2 with zb1p, tp 2 with sequence
parallelism, dp 2 with ZeRO-3, a mixture of experts over ep 2; SGD so that a wrong
gradient shows in the loss), compile a build, then make every single change of these
kinds to its programs: delete, duplicate or move one event (wait or record) one or two
places; change a wait's or a record's guard, stream or event; change an instruction's
op or its per_microbatch flag; delete or duplicate a schedule or receive entry; delete
an instruction. Each mutant is verified in process (planc.verify.verifier.verify, what
``planc verify`` runs). With ``--run N``, up to N of the accepted ones per plan also run
``planc run --steps 3 --check``: a mutant that fails --check or stops with a rank's
traceback is a change the verifier should have refused.

    .venv/bin/python bench/verifier_mutations.py [--run 0] [--out build/vmut]

Prints, per plan, the mutants made, refused and accepted (and, with --run, how the
accepted ones ran); exits 1 when an accepted mutant ran wrong. A pristine build must
verify and pass --check, or the plan's line says so.
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planc.build import directory as build_dir  # noqa: E402
from planc.program.program import Program  # noqa: E402
from planc.verify.verifier import verify  # noqa: E402

SGD = ["--set", "train.steps=3", "--set", "train.optimizer=sgd(lr = 0.2)"]
ONE_NODE = ["--set", "topology.devices_per_node=2", "--set", "topology.nodes=1"]
PLANS = {
    "pp2-1f1b": ("gpt-tiny.plan", ["mesh.tp=1", "mesh.dp=1", "shard.dp.zero=0"]),
    "pp2-zb1p": ("gpt-tiny.plan", ["mesh.tp=1", "mesh.dp=1", "shard.dp.zero=0",
                                   "schedule.pipeline=zb1p"]),
    "tp2-sp": ("llama-tiny.plan", ["mesh.tp=2", "mesh.pp=1", "mesh.dp=1",
                                   "shard.tp.sequence_parallel=on", "shard.dp.zero=0"]),
    "dp2-zero3": ("gpt-tiny.plan", ["mesh.tp=1", "mesh.pp=1", "mesh.dp=2", "shard.dp.zero=3",
                                    "shard.pp.stages=[0..3]"]),
    "moe-ep2": ("moe-tiny.plan", ["mesh.tp=1", "mesh.pp=1", "mesh.dp=2", "mesh.ep=2",
                                  "shard.tp.sequence_parallel=off"]),
}
OPS = ("compute", "all_reduce", "all_gather", "reduce_scatter", "all_to_all")


def compile_build(name: str, out: Path) -> Path:
    plan, sets = PLANS[name]
    target = out / name / "base"
    argv = [sys.executable, "-m", "planc", "compile", str(ROOT / "plans" / plan), "-o",
            str(target), "--force", *SGD, *(x for key in sets for x in ("--set", key))]
    if name != "moe-ep2":
        argv += ONE_NODE
    subprocess.run(argv, check=True, capture_output=True, cwd=ROOT)
    return target


def mutants(programs: dict[str, dict]):
    """(description, the programs' JSON with one change) for every change of the kinds
    in the docstring."""
    for name, data in programs.items():
        parts = [("prologue", data["prologue"]), ("epilogue", data["epilogue"]),
                 *((f"blocks.{b}", block) for b, block in data["blocks"].items())]
        for where, part in parts:
            for k, item in enumerate(part):
                label = f"{name} {where}[{k}] {item['op']} {item.get('node') or item.get('event')}"
                yield f"{label}: deleted", _edit(programs, name, where, lambda p, k=k: p.pop(k))
                if item["op"] in ("wait", "record"):
                    yield (f"{label}: duplicated",
                           _edit(programs, name, where, lambda p, k=k: p.insert(k, p[k])))
                    for shift in (-2, -1, 1, 2):
                        if 0 <= k + shift < len(part):
                            yield (f"{label}: moved {shift:+d}", _edit(
                                programs, name, where,
                                lambda p, k=k, s=shift: p.insert(k + s, p.pop(k))))
                    for guard in (None, "first", "last"):
                        if item.get("guard") != guard:
                            yield f"{label}: guard {guard}", _edit(
                                programs, name, where,
                                lambda p, k=k, g=guard: _set(p[k], "guard", g))
                    for stream in data["streams"]:
                        if stream != item["stream"]:
                            yield f"{label}: stream {stream}", _edit(
                                programs, name, where,
                                lambda p, k=k, s=stream: _set(p[k], "stream", s))
                else:
                    for op in OPS:
                        if op != item["op"] and item["op"] in OPS:
                            yield f"{label}: op {op}", _edit(
                                programs, name, where,
                                lambda p, k=k, o=op: _set(p[k], "op", o))
                    yield f"{label}: per_microbatch flipped", _edit(
                        programs, name, where, lambda p, k=k: _set(
                            p[k], "per_microbatch", not p[k].get("per_microbatch", True)))
        for k in range(len(data["schedule"])):
            yield f"{name} schedule[{k}]: deleted", _edit(
                programs, name, "schedule", lambda p, k=k: p.pop(k))
            yield f"{name} schedule[{k}]: duplicated", _edit(
                programs, name, "schedule", lambda p, k=k: p.insert(k, p[k]))
        for stream, items in data["receives"].items():
            for k in range(len(items)):
                yield f"{name} receives.{stream}[{k}]: deleted", _edit(
                    programs, name, f"receives.{stream}", lambda p, k=k: p.pop(k))


def _set(item: dict, key: str, value) -> None:
    if value is None:
        item.pop(key, None)
    else:
        item[key] = value


def _edit(programs: dict[str, dict], name: str, where: str, change) -> dict[str, dict]:
    edited = copy.deepcopy(programs)
    holder = edited[name]
    for key in where.split("."):
        holder = holder[key]
    change(holder)
    return edited


def accepted(build, programs: dict[str, dict]) -> bool:
    try:
        read = {name: Program.from_json(data) for name, data in programs.items()}
    except (ValueError, KeyError, TypeError):
        return False  # refused as it is read, before the verifier
    return verify(build.plan, build.graph, read, build.table, build.groups,
                  build.routes).ok


def run_check(directory: Path) -> str:
    """'same', 'wrong' (--check failed) or 'crash' (a rank's traceback or another
    status), for a build run with --check."""
    done = subprocess.run([sys.executable, "-m", "planc", "run", str(directory), "--steps",
                           "3", "--check", "--no-verify", "--timeout", "60"],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    if done.returncode == 0:
        return "same"
    return "crash" if "Traceback" in done.stderr else "wrong"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", type=int, default=0, metavar="N",
                        help="run up to N accepted mutants per plan with --check [0]")
    parser.add_argument("--out", default=str(ROOT / "build" / "vmut"))
    args = parser.parse_args(argv)
    out = Path(args.out)
    bad = 0
    for name in PLANS:
        base = compile_build(name, out)
        build = build_dir.read_programs(build_dir.read(base))
        programs = {n: p.to_json() for n, p in build.programs.items()}
        made = refused = 0
        kept = []
        for description, edited in mutants(programs):
            made += 1
            if accepted(build, edited):
                kept.append((description, edited))
            else:
                refused += 1
        line = f"{name}: {made} mutants, {refused} refused, {len(kept)} accepted"
        if args.run and kept:
            outcomes = {"same": 0, "wrong": 0, "crash": 0}
            for k, (description, edited) in enumerate(kept[:args.run]):
                mutant = out / name / f"m{k:04d}"
                shutil.rmtree(mutant, ignore_errors=True)
                shutil.copytree(base, mutant)
                for program, data in edited.items():
                    (mutant / "programs" / program).write_text(json.dumps(data))
                outcome = run_check(mutant)
                outcomes[outcome] += 1
                if outcome != "same":
                    print(f"  {outcome}: {description} ({mutant})")
            bad += outcomes["wrong"] + outcomes["crash"]
            line += (f"; of {min(len(kept), args.run)} run: {outcomes['same']} the same, "
                     f"{outcomes['wrong']} wrong, {outcomes['crash']} crashed")
        print(line, flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
