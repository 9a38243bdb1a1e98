"""Benchmark: does ``planc simulate``'s peak memory hold, tensor for tensor, for what one
rank of ``planc run`` holds on this machine? bench/memory_here.py compares it with each
rank's peak resident set, in which the libraries' own memory (tens of MiB) hides the
small plans of plans/; this one counts the bytes the rank has allocated and not freed
(glibc's ``mallinfo2``: ``uordblks`` in use in the arenas, ``hblkhd`` in mapped
blocks), sampled every half millisecond by a thread of the rank and after every
instruction, less what the process held before the rank started. Every tensor of a CPU
rank is allocated through glibc, so the difference is the rank's tensors (and a few
hundred KiB of Python objects).

The plans are written here, sized so that a step's tensors are hundreds of MiB: llama
(RMSNorm, grouped-query attention, SwiGLU) in fp32 and bf16, with full recomputation,
and gpt, one rank each (the mesh's other axes change what a rank holds in ways the
estimate prices by the same rules); llama under ZeRO-3 over two ranks, where what
matters is that a unit's gathered parameters go once its forward is done; and the same
under zb1p over two stages (4 ranks), where a weight-gradient half keeps what it reads,
zb1p alone (2 ranks), and zb1p with full recomputation (2 ranks), where that is the
recomputed graph too; and tp 2 with sequence parallelism (2 ranks), whose loss works on
each rank's slice of the vocabulary. Each runs 2 steps; the second is measured, on the
rank holding the most.

    .venv/bin/python bench/memory_live.py [--plans llama-fp32,gpt-fp32] [--write]
    .venv/bin/python bench/memory_live.py --plans plans/llama-small.plan

A name ending in ``.plan`` is that file (relative to the repository), run on as many
ranks as its mesh has (not written into the table).

``--write`` puts the table into docs/simulate.md, "### Memory", between its markers.
Besides the table it prints, for each plan, the instruction during which the peak fell.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from memory_here import write_between  # noqa: E402

DOC = ROOT / "docs" / "simulate.md"
BEGIN = "<!-- memory live: bench/memory_live.py --write regenerates it -->"
END = "<!-- end of the memory live table -->"
MIB = 1 << 20

LLAMA = """plan {name} {{
  model llama {{ layers = 4; hidden = 512; heads = 8; kv_heads = 2; ffn = 2048;
                vocab = 8000; seq = 512; batch = {batch}; dtype = {dtype} }}
  mesh {{ {mesh} }}
  topology {{ preset = dgx-h100; devices_per_node = {devices} }}
  schedule {{ microbatches = 1 }}
  {shard}
  {optimize}
  train {{ steps = 2; optimizer = adamw(lr = 1e-4, weight_decay = 0.01); seed = 1 }}
}}
"""
GPT = """plan gpt_fp32 {
  model gpt { layers = 4; hidden = 512; heads = 8; vocab = 8000; seq = 512; batch = 4;
              dtype = fp32 }
  mesh { }
  topology { preset = dgx-h100; devices_per_node = 1 }
  schedule { microbatches = 1 }
  train { steps = 2; optimizer = adamw(lr = 1e-4, weight_decay = 0.01); seed = 1 }
}
"""
# a mixture of experts cut at its all-to-alls (ep 2) under zb1p over two stages: each
# experts piece's weight half keeps the gradients of the rows it received until it runs,
# as they arrived (in FP8 with model { fp8 })
MOE_ZB = """plan {name} {{
  model moe {{ layers = 4; hidden = 512; heads = 8; kv_heads = 2; ffn = 2048; vocab = 8000
              seq = 512; batch = 8; dtype = fp32; experts = 8; top_k = 2; expert_ffn = 1024
              shared_experts = 1; first_dense = 1{extra} }}
  mesh {{ pp = 2; dp = 2; ep = 2 }}
  topology {{ preset = dgx-h100; devices_per_node = 4 }}
  schedule {{ microbatches = 4; pipeline = zb1p; overlap_all_to_all = on }}
  train {{ steps = 2; optimizer = adamw(lr = 1e-4, weight_decay = 0.01); seed = 1 }}
}}
"""
ONE_RANK = {"batch": 4, "mesh": "", "devices": 1, "shard": ""}
# ZeRO-3 over two ranks, each with the one-rank plans' tokens: the gathered parameters
# must not stay while the forward goes on (FSDP frees them after each unit's forward)
ZERO3 = {"batch": 8, "mesh": "dp = 2", "devices": 2, "shard": "shard { dp { zero = 3 } }"}
# and under a zero-bubble pipeline over two stages, whose weight-gradient halves (W) run
# after later microbatches' input-gradient halves: what they read is kept until then
ZERO3_ZB = {"batch": 8, "mesh": "dp = 2; pp = 2", "devices": 4,
            "shard": "shard { dp { zero = 3 } }"}
PLANS = {
    "llama-fp32": LLAMA.format(name="llama_fp32", dtype="fp32", optimize="", **ONE_RANK),
    "llama-bf16": LLAMA.format(name="llama_bf16", dtype="bf16", optimize="", **ONE_RANK),
    "llama-fp32-full": LLAMA.format(name="llama_fp32_full", dtype="fp32",
                                    optimize="optimize { recompute = full }", **ONE_RANK),
    "gpt-fp32": GPT,
    "llama-fp32-zero3": LLAMA.format(name="llama_fp32_zero3", dtype="fp32", optimize="",
                                     **ZERO3),
    "llama-bf16-zero3": LLAMA.format(name="llama_bf16_zero3", dtype="bf16", optimize="",
                                     **ZERO3),
    "llama-fp32-zero3-zb": LLAMA.format(name="llama_fp32_zero3_zb", dtype="fp32", optimize="",
                                        **ZERO3_ZB).replace(
        "microbatches = 1", "microbatches = 4; pipeline = zb1p"),
    # zb1p over two stages alone: a weight half keeps its steps' graphs and output
    # gradients, and its input half has freed what the steps without parameters kept
    "llama-fp32-zb": LLAMA.format(
        name="llama_fp32_zb", dtype="fp32", optimize="", batch=8, mesh="pp = 2", devices=2,
        shard="").replace("microbatches = 1", "microbatches = 4; pipeline = zb1p"),
    # zb1p with the SwiGLU product made again: made once, in down's input half, and
    # held for its deferred weight half; gate and up go with the SwiGLU's backward
    "llama-fp32-zb-act": LLAMA.format(
        name="llama_fp32_zb_act", dtype="fp32", optimize="optimize { recompute_activation = on }",
        batch=8, mesh="pp = 2", devices=2, shard="").replace(
        "microbatches = 1", "microbatches = 4; pipeline = zb1p"),
    # full recomputation under zb1p over two stages: a chunk's recomputed layers are
    # kept from its input gradient to its weight gradient
    "llama-fp32-full-zb": LLAMA.format(
        name="llama_fp32_full_zb", dtype="fp32", optimize="optimize { recompute = full }",
        batch=8, mesh="pp = 2", devices=2, shard="").replace(
        "microbatches = 1", "microbatches = 4; pipeline = zb1p"),
    # tp 2 with sequence parallelism: the head's logits and the loss split over the
    # vocabulary (Megatron-LM's vocabulary-parallel cross-entropy)
    "llama-fp32-tp2-sp": LLAMA.format(
        name="llama_fp32_tp2_sp", dtype="fp32", optimize="", batch=4, mesh="tp = 2",
        devices=2, shard="shard { tp { sequence_parallel = on } }"),
    # the same, the GEMMs' gathered inputs gathered again in the backward (Megatron-LM's)
    "llama-fp32-tp2-sp-regather": LLAMA.format(
        name="llama_fp32_tp2_sp_regather", dtype="fp32", optimize="", batch=4,
        mesh="tp = 2", devices=2,
        shard="shard { tp { sequence_parallel = on; gathered_inputs = regather } }"),
    # a dense MLP's SwiGLU product computed again for down's backward, not kept
    "llama-fp32-act": LLAMA.format(name="llama_fp32_act", dtype="fp32",
                                   optimize="optimize { recompute_activation = on }",
                                   **ONE_RANK),
    # context parallelism, the keys and values all-gathered: the attention keeps every cp
    # rank's, and the copies repeated per query head its masked SDPA reads
    "llama-fp32-cp2": LLAMA.format(name="llama_fp32_cp2", dtype="fp32", optimize="",
                                   batch=4, mesh="cp = 2", devices=2, shard=""),
    # the two norms' outputs made again for q/k/v's and gate/up's backward, not kept
    "llama-fp32-norms": LLAMA.format(name="llama_fp32_norms", dtype="fp32",
                                     optimize="optimize { recompute_norms = on }",
                                     **ONE_RANK),
    # gpt's keys and values all-gathered over cp: kept with the qkv bias added
    "gpt-fp32-cp2": GPT.replace("plan gpt_fp32 {", "plan gpt_fp32_cp2 {").replace(
        "mesh { }", "mesh { cp = 2 }").replace("devices_per_node = 1", "devices_per_node = 2"),
    "gpt-fp32-norms": GPT.replace("plan gpt_fp32 {", "plan gpt_fp32_norms {").replace(
        "  train {", "  optimize { recompute_norms = on }\n  train {"),
    # tp 2 with sequence parallelism, each GEMM cut in 2 pieces (tp_overlap): down's
    # pieces are copies of the product's tokens; with the key each goes after its GEMM
    "llama-fp32-tp2-sp-overlap": LLAMA.format(
        name="llama_fp32_tp2_sp_overlap", dtype="fp32", optimize="optimize { tp_overlap = 2 }",
        batch=4, mesh="tp = 2", devices=2, shard="shard { tp { sequence_parallel = on } }"),
    "llama-fp32-tp2-sp-overlap-act": LLAMA.format(
        name="llama_fp32_tp2_sp_overlap_act", dtype="fp32",
        optimize="optimize { tp_overlap = 2; recompute_activation = on }", batch=4,
        mesh="tp = 2", devices=2, shard="shard { tp { sequence_parallel = on } }"),
    "llama-fp32-tp2-sp-regather-overlap": LLAMA.format(
        name="llama_fp32_tp2_sp_regather_overlap", dtype="fp32",
        optimize="optimize { tp_overlap = 2 }", batch=4, mesh="tp = 2", devices=2,
        shard="shard { tp { sequence_parallel = on; gathered_inputs = regather } }"),
    "moe-fp32-zb": MOE_ZB.format(name="moe_fp32_zb", extra=""),
    "moe-fp8-zb": MOE_ZB.format(name="moe_fp8_zb", extra="; fp8 = blockwise"),
    # the experts' SwiGLU product computed again in the backward, not kept
    "moe-fp32-zb-act": MOE_ZB.format(name="moe_fp32_zb_act", extra="").replace(
        "  train {", "  optimize { recompute_moe_activation = on }\n  train {"),
}
RANKS = {"llama-fp32-cp2": 2, "gpt-fp32-cp2": 2, "llama-fp32-tp2-sp": 2,
         "llama-fp32-tp2-sp-regather": 2,
         "llama-fp32-tp2-sp-overlap": 2, "llama-fp32-tp2-sp-overlap-act": 2,
         "llama-fp32-tp2-sp-regather-overlap": 2,
         "llama-fp32-zero3": 2, "llama-bf16-zero3": 2,
         "llama-fp32-zero3-zb": 4, "llama-fp32-zb": 2, "llama-fp32-zb-act": 2,
         "llama-fp32-full-zb": 2,
         "moe-fp32-zb": 4, "moe-fp8-zb": 4, "moe-fp32-zb-act": 4}  # the others run one rank

# The start of a probe's code: in_use(), the bytes glibc's allocator has handed out and
# not had back (bench/blas_buffers.py's probes start with it too).
IN_USE = r"""
import ctypes, json, sys, threading, time

class Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Mallinfo2

def in_use():
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd
"""
# Runs in a fresh process as a torchrun rank would (planc.runtime.worker.main), with a
# thread sampling the heap and every instruction reporting what it left.
RANK = IN_USE + r"""
import planc.runtime.worker as worker
from planc.runtime.engine.interpreter import Interpreter

after = []  # (node, bytes in use once it ran)
instruction = Interpreter.instruction

def reporting(self, op, node, microbatch, frees):
    run = instruction(self, op, node, microbatch, frees)
    def ran(state):
        run(state)
        after.append((node, in_use()))
    return ran

Interpreter.instruction = reporting
samples, running = [], True

def sample():
    while running:
        samples.append((len(after), in_use()))
        time.sleep(0.0005)

start = in_use()
thread = threading.Thread(target=sample, daemon=True)
thread.start()
status = worker.main([sys.argv[1], "--steps", "2"])
running = False
thread.join()
second = len(after) // 2  # the second step: the first allocates what later ones reuse
peak_index, peak = max(((i, b) for i, b in samples if i >= second), key=lambda s: s[1])
during = after[peak_index][0] if peak_index < len(after) else "after the step"
print(json.dumps({"status": status, "peak": peak - start, "during": during,
                  "step_start": after[second - 1][1] - start}))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def planc(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "planc", *map(str, args)],
                          capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=600)


def measure(name: str, scratch: Path) -> dict:
    stem = name.removesuffix(".plan").replace("/", "-")
    if name.endswith(".plan"):  # compiled where it is: its relative paths hold
        source = ROOT / name
    else:
        source = scratch / f"{stem}.plan"
        source.write_text(PLANS[name])
    build = scratch / f"{stem}-build"
    for done in (planc("compile", source, "-o", build, "--force"),):
        if done.returncode:
            raise SystemExit(f"planc compile {name}: {done.stderr[-2000:]}")
    simulated = planc("simulate", build, "--json")
    if simulated.returncode:
        raise SystemExit(f"planc simulate {name}: {simulated.stderr[-2000:]}")
    result = json.loads(simulated.stdout)
    # what planc run holds, where planc simulate says it is more than the estimate
    # (sequence parallelism's gathered inputs: planc.estimate.memory.gathered_inputs_bytes)
    held = result.get("planc_run_memory")
    predicted = held["memory_bytes"] if held else max(s["memory_bytes"]
                                                      for s in result["stages"])
    ranks, port = RANKS.get(name, 1), str(free_port())
    ranks_run = [subprocess.Popen(
        [sys.executable, "-c", RANK, str(build)], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "RANK": str(rank),
             "WORLD_SIZE": str(ranks), "LOCAL_RANK": str(rank),
             "LOCAL_WORLD_SIZE": str(ranks), "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": port}) for rank in range(ranks)]
    outputs = [run.communicate(timeout=1800) for run in ranks_run]
    results = []
    for run, (out, err) in zip(ranks_run, outputs):
        lines = [line for line in out.splitlines() if line.startswith("{")]
        if run.returncode or not lines:
            raise SystemExit(f"{name}: a rank failed: {err[-3000:]}")
        results.append(json.loads(lines[-1]))
    result = max(results, key=lambda r: r["peak"])  # the rank holding the most
    return {"plan": name, "measured": result["peak"], "during": result["during"],
            "step_start": result["step_start"], "predicted": predicted}


def world_of(path: Path) -> int:
    """The ranks of a plan file's mesh."""
    sys.path.insert(0, str(ROOT))
    from planc.lang import load_file

    loaded = load_file(path)
    if not loaded.ok:
        raise SystemExit(f"{path}: {loaded.diagnostics[0].message}")
    return loaded.plan.mesh.world


def table(rows: list[dict]) -> str:
    lines = ["| plan | held at the step's start | peak in use | simulated peak "
             "| error | the peak fell in |", "|---|---|---|---|---|---|"]
    for r in rows:
        error = r["predicted"] / r["measured"] - 1
        lines.append(f"| {r['plan']} | {r['step_start'] / MIB:.1f} MiB | "
                     f"{r['measured'] / MIB:.1f} MiB | {r['predicted'] / MIB:.1f} MiB | "
                     f"{error:+.1%} | {r['during']} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--plans", default=",".join(PLANS),
                        help=f"comma-separated, of {', '.join(PLANS)}")
    parser.add_argument("--write", action="store_true",
                        help="put the table into docs/simulate.md between its markers")
    args = parser.parse_args()
    names = [n for n in args.plans.split(",") if n]
    if args.write and any(name.endswith(".plan") for name in names):
        print("memory_live: --write takes the script's own plans only", file=sys.stderr)
        return 2
    for name in names:  # plan files, by their path
        if name.endswith(".plan") and name not in PLANS:
            path = ROOT / name
            if not path.is_file():
                print(f"memory_live: no plan file {name}", file=sys.stderr)
                return 2
            PLANS[name], RANKS[name] = path.read_text(), world_of(path)
    unknown = [n for n in names if n not in PLANS]
    if unknown or not names:
        print(f"memory_live: no plan {unknown[0]!r} (the plans: {', '.join(PLANS)})"
              if unknown else "memory_live: --plans names none", file=sys.stderr)
        return 2
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for name in names:
            rows.append(measure(name, Path(scratch)))
            print(f"{name}: {rows[-1]['measured'] / MIB:.1f} MiB in use at the peak, "
                  f"{rows[-1]['predicted'] / MIB:.1f} MiB simulated", file=sys.stderr,
                  flush=True)
    text = table(rows)
    print(text)
    return write_between(DOC, BEGIN, END, text, "memory_live") if args.write else 0


if __name__ == "__main__":
    sys.exit(main())
