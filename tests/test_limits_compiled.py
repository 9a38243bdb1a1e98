"""Plans at planc's limits compile, and every read-only command runs on their builds
(docs/language.md, section 5, Limits), in work and memory bounded by what the limits
count: the graph holds at most 100 nodes per layer, the build one program per stage
(524,288 ranks: two programs), each program's schedule a forward and a backward block
per model chunk and microbatch, and every command stays under 1 GiB resident.

Each command runs in its own process under a cap on address space. How long the
commands take is measured by bench/limits.py, not here: a timed test fails on a busy
machine (this one once failed at 40 s a command while the compile took 12 s alone).
The only clock here is a guard against a hang (:data:`HANG_S`), far beyond any run.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.limit_plans import EVERY_LIMIT, HEAVIEST, LAST_RANK, MOST_CHUNKS, AtTheLimits

ADDRESS_SPACE = 2 << 30  # bytes of address space per command
RESIDENT = 1 << 30  # bytes resident per command, at most (the heaviest compile: ~0.7 GB)
NODES_PER_LAYER = 100  # docs/language.md: 20 to 100 nodes per layer
HANG_S = 900  # a hung command fails the test rather than the suite; not a speed check


def _capped() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))


@dataclass
class Ran:
    stdout: str
    stderr: str
    peak_bytes: int  # the command's peak resident set


def planc(*args, cwd: Path) -> Ran:
    """One command in its own process, under the address-space cap: it must succeed and
    stay under :data:`RESIDENT`."""
    process = subprocess.Popen([sys.executable, "-m", "planc", *map(str, args)], cwd=cwd,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               preexec_fn=_capped)
    hung = threading.Event()
    guard = threading.Timer(HANG_S, lambda: (hung.set(), process.kill()))
    guard.start()
    with ThreadPoolExecutor(2) as pool, process.stdout, process.stderr:
        out, err = pool.submit(process.stdout.read), pool.submit(process.stderr.read)
        try:
            _, status, usage = os.wait4(process.pid, 0)  # wait4: its own peak resident set
        finally:
            guard.cancel()
        ran = Ran(out.result(), err.result(), usage.ru_maxrss * 1024)
    process.returncode = os.waitstatus_to_exitcode(status)
    if hung.is_set():
        pytest.fail(f"planc {' '.join(map(str, args))} hung: killed after {HANG_S} s")
    assert process.returncode == 0, (args, process.returncode, ran.stderr[-2000:])
    assert ran.peak_bytes < RESIDENT, (args, ran.peak_bytes)
    return ran


def compiled(plan: AtTheLimits, tmp_path: Path) -> Path:
    """Compile ``plan`` into tmp_path/build and check what the limits bound: nodes per
    layer, one program per stage, each program's schedule a forward and a backward block
    per chunk and microbatch."""
    (tmp_path / "limits.plan").write_text(plan.text)
    planc("compile", "limits.plan", "-o", "build", cwd=tmp_path)
    build = tmp_path / "build"
    summary = json.loads((build / "summary.json").read_text())
    assert summary["world"] == plan.world
    assert summary["nodes"] <= NODES_PER_LAYER * plan.layers, summary["nodes"]
    programs = sorted((build / "programs").glob("stage*.json"))
    assert len(programs) == plan.pp
    for stage in {0, plan.pp - 1}:
        program = json.loads((build / "programs" / f"stage{stage}.json").read_text())
        assert len(program["schedule"]) == 2 * plan.chunks_per_stage * plan.microbatches
    return build


def test_a_plan_at_every_limit_runs_every_command(tmp_path):
    """1,024 layers, 524,288 ranks, 65,536 microbatches and pp x microbatches = 131,072:
    every limit at once."""
    compiled(EVERY_LIMIT, tmp_path)
    listing, verified, _ = (planc(*command, cwd=tmp_path) for command in EVERY_LIMIT.commands)
    lines = listing.stdout.splitlines()
    assert lines[0].startswith(f"rank {LAST_RANK}: stage 1 ")
    assert lines[-1].startswith("  ... and ") and lines[-1].endswith(
        "more: --expand lists the first 100,000 instructions of a step; --microbatch K "
        "lists all of microbatch K")
    assert len(lines) < 100_100
    assert "no deadlock" in verified.stdout
    assert (tmp_path / "graph.html").stat().st_size > 0


def test_the_most_model_chunks_run_every_command(tmp_path):
    """Interleaved: pp x virtual = 1,024 chunks of one layer, pp x virtual x microbatches
    at its limit."""
    compiled(MOST_CHUNKS, tmp_path)
    verified, one, simulated = (planc(*command, cwd=tmp_path)
                                for command in MOST_CHUNKS.commands)
    assert "no deadlock" in verified.stdout
    assert "(mb 127)" in one.stdout and "(mb 126)" not in one.stdout
    assert "... and" not in one.stdout
    assert "MFU" in simulated.stdout


@pytest.mark.slow
def test_the_heaviest_layout_at_the_limits_runs_every_command(tmp_path):
    """The most nodes per layer (llama; tp, cp and sequence parallelism; ZeRO-3; full
    recomputation) on 1,024 layers in 1,024 stages, pp x microbatches at its limit."""
    compiled(HEAVIEST, tmp_path)
    verified, listing, _ = (planc(*command, cwd=tmp_path) for command in HEAVIEST.commands)
    assert "no deadlock" in verified.stdout
    assert listing.stdout.startswith("rank 5: stage 0 ")
    assert (tmp_path / "graph.html").stat().st_size > 0
