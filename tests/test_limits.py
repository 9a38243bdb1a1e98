"""planc's limits (docs/language.md, section 5, Limits): every plan that ``check``
accepts compiles in seconds, and a plan past a limit is refused by ``check`` with the
limit and the reason it exists.

The plans at the limits run each command in its own process under a cap on address
space and on time. On a 2-core machine each command takes 2 to 8 s and the heaviest
layout's compile about 12 s, all under 1 GB resident; the caps leave room for a slower
machine and still fail anything like the minutes such plans once took.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

from planc.cost import MAX_RECIPE_MEMBERS, CostModel, Placement, Route
from planc.lang.check import LIMITS, largest_divisors
from planc.plan import Device, Link, Topology
from tests.conftest import ROOT

SECONDS = 40  # per command; 12 s at most here
ADDRESS_SPACE = 2 << 30  # bytes of address space per command (resident: under 1 GB)


def gpt(layers: int, *, pp: int = 1, dp: int = 1, tp: int = 1, cp: int = 1,
        microbatches: int = 1, virtual: int = 1, family: str = "gpt", extra: str = "",
        shard: str = "") -> str:
    """A small-width plan: compile time depends on the counts, not on the widths."""
    heads = max(4, tp)
    model = (f"layers = {layers}; hidden = {16 * heads}; heads = {heads}; "
             + (f"kv_heads = {heads // 2}; ffn = {48 * heads}; " if family == "llama" else "")
             + f"vocab = {max(256, 128 * tp)}; seq = {max(32, 2 * cp * tp)}; "
             f"batch = {dp * microbatches}; dtype = fp32")
    pipeline = "interleaved" if virtual > 1 else "1f1b"
    world = tp * cp * pp * dp
    return (f"plan limits {{\n  model {family} {{ {model} }}\n"
            f"  mesh {{ tp = {tp}; cp = {cp}; pp = {pp}; dp = {dp} }}\n"
            f"  topology {{ devices_per_node = {8 if world % 8 == 0 else world} }}\n"
            f"  shard {{ {shard}pp {{ virtual = {virtual} }} }}\n"
            f"  schedule {{ microbatches = {microbatches}; pipeline = {pipeline} }}\n"
            f"{extra}}}\n")


def _capped() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))


def planc(*args, cwd: Path) -> subprocess.CompletedProcess:
    """One command in its own process, under the caps; fails the test past either."""
    start = time.monotonic()
    try:
        result = subprocess.run([sys.executable, "-m", "planc", *map(str, args)],
                                capture_output=True, text=True, cwd=cwd,
                                preexec_fn=_capped, timeout=SECONDS)
    except subprocess.TimeoutExpired:
        pytest.fail(f"planc {' '.join(map(str, args))} ran past {SECONDS} s")
    elapsed = time.monotonic() - start
    assert result.returncode == 0, (args, result.stderr[-2000:])
    assert elapsed < SECONDS, (args, elapsed)
    return result


def check_messages(text: str, tmp_path: Path) -> list[str]:
    path = tmp_path / "plan.plan"
    path.write_text(text)
    result = subprocess.run([sys.executable, "-m", "planc", "check", str(path),
                             "--error-format", "json"], capture_output=True, text=True,
                            cwd=ROOT, timeout=60)
    return [d["message"] for d in json.loads(result.stdout)["diagnostics"]
            if d["severity"] == "error"]


LAYERS_WHY = ("the graph holds every layer's compute steps and transfers, and compile "
              "derives, lowers and verifies each of them")
SCHEDULE_WHY = ("the stages' programs run a forward and a backward block per model chunk "
                "and microbatch, and the verifier proves every one of them")


# --- refused at check ---------------------------------------------------------------------

def test_the_plans_that_compiled_for_minutes_are_refused(tmp_path):
    """The two plans of the issue passed check and then compiled for minutes."""
    deep = gpt(65536, pp=16384, dp=32, microbatches=65536)
    assert check_messages(deep, tmp_path) == [
        f"layers (65536) is more than planc's limit of 1024: {LAYERS_WHY}",
        f"pp x microbatches (16384 x 65536 = 1073741824) is more than planc's limit of "
        f"131072: {SCHEDULE_WHY}"]
    interleaved = gpt(16384, pp=8192, virtual=2, microbatches=65536)
    assert check_messages(interleaved, tmp_path) == [
        f"layers (16384) is more than planc's limit of 1024: {LAYERS_WHY}",
        f"pp x virtual x microbatches (8192 x 2 x 65536 = 1073741824) is more than planc's "
        f"limit of 131072: {SCHEDULE_WHY}"]
    # Within the layer limit the schedule alone is refused.
    assert check_messages(gpt(1024, pp=512, virtual=2, microbatches=1024), tmp_path) == [
        f"pp x virtual x microbatches (512 x 2 x 1024 = 1048576) is more than planc's limit "
        f"of 131072: {SCHEDULE_WHY}"]


@pytest.mark.parametrize("text, message", [
    (gpt(1025), f"layers (1025) is more than planc's limit of 1024: {LAYERS_WHY}"),
    (gpt(1, dp=524289), "the mesh has 524289 ranks, more than planc's limit of 524288: "
                        "planc layout lists every rank and its groups"),
    (gpt(1, microbatches=65537), "microbatches (65537) is more than planc's limit of "
                                 "65536: each stage's program runs a forward and a "
                                 "backward block per microbatch"),
    (gpt(3, pp=3, microbatches=43691),  # 3 x 43691 = 131073
     f"pp x microbatches (3 x 43691 = 131073) is more than planc's limit of 131072: "
     f"{SCHEDULE_WHY}"),
], ids=["layers", "ranks", "microbatches", "schedule"])
def test_one_past_each_limit_is_refused_with_its_reason(text, message, tmp_path):
    assert check_messages(text, tmp_path) == [message]


def test_the_limits_are_the_documented_ones():
    assert LIMITS == {"world": 524_288, "layers": 1_024, "microbatches": 65_536,
                      "schedule": 131_072}
    reference = (ROOT / "docs" / "language.md").read_text()
    for row in ("| ranks (`tp * cp * pp * dp`) | 524,288 |", "| `layers` | 1,024 |",
                "| `microbatches` | 65,536 |", "| `pp * virtual * microbatches` | 131,072 |"):
        assert row in reference


# --- compiled at the limits -------------------------------------------------------------

def test_a_plan_at_every_limit_runs_every_command_in_seconds(tmp_path):
    """1,024 layers, 524,288 ranks, 65,536 microbatches and pp x microbatches = 131,072:
    every limit at once."""
    text = gpt(LIMITS["layers"], pp=2, dp=LIMITS["world"] // 2,
               microbatches=LIMITS["microbatches"])
    assert 2 * LIMITS["microbatches"] == LIMITS["schedule"]
    (tmp_path / "limits.plan").write_text(text)
    planc("compile", "limits.plan", "-o", "build", cwd=tmp_path)
    last = LIMITS["world"] - 1
    listing = planc("programs", "build", "--rank", last, "--expand", cwd=tmp_path).stdout
    lines = listing.splitlines()
    assert lines[0].startswith(f"rank {last}: stage 1 ")
    assert lines[-1].startswith("  ... and ") and lines[-1].endswith(
        "more: --expand lists the first 100,000 instructions of a step; --microbatch K "
        "lists all of microbatch K")
    assert len(lines) < 100_100
    assert "no deadlock" in planc("verify", "build", cwd=tmp_path).stdout
    planc("graph", "build", "-o", "graph.html", cwd=tmp_path)
    assert (tmp_path / "graph.html").stat().st_size > 0


def test_the_most_model_chunks_run_every_command_in_seconds(tmp_path):
    """Interleaved: pp x virtual = 1,024 chunks of one layer, pp x virtual x microbatches
    at its limit."""
    text = gpt(LIMITS["layers"], pp=2, virtual=512, microbatches=128)
    (tmp_path / "chunks.plan").write_text(text)
    planc("compile", "chunks.plan", "-o", "build", cwd=tmp_path)
    planc("verify", "build", cwd=tmp_path)
    one = planc("programs", "build", "--rank", 1, "--expand", "--microbatch", 127,
                cwd=tmp_path).stdout
    assert "(mb 127)" in one and "(mb 126)" not in one and "... and" not in one
    assert "MFU" in planc("simulate", "build", cwd=tmp_path).stdout


@pytest.mark.slow
def test_the_heaviest_layout_at_the_limits_compiles_in_seconds(tmp_path):
    """The most nodes per layer (llama; tp, cp and sequence parallelism; ZeRO-3; full
    recomputation) on 1,024 layers in 1,024 stages, pp x microbatches at its limit."""
    text = gpt(LIMITS["layers"], pp=1024, tp=8, cp=2, dp=2, microbatches=128,
               family="llama", shard="tp { sequence_parallel = on }; dp { zero = 3 }; ",
               extra="  optimize { recompute = full }\n")
    (tmp_path / "heavy.plan").write_text(text)
    planc("compile", "heavy.plan", "-o", "build", cwd=tmp_path)
    planc("verify", "build", cwd=tmp_path)
    planc("programs", "build", "--rank", 5, "--expand", cwd=tmp_path)
    planc("graph", "build", "-o", "graph.html", cwd=tmp_path)


# --- what is bounded rather than refused ----------------------------------------------------

def test_tree_and_hierarchical_routes_stop_at_the_recipe_limit():
    """Recipes are proven symbolically, in time growing with the square of the group:
    larger groups keep the backend's own algorithm, and say why."""
    model = CostModel(Topology(1, 8, Device(1e15, 8e10, 0.5, 2e12), Link(3e11, 2e-6),
                               Link(2.5e10, 5e-6)))

    def routes(members: int) -> dict[Route, object]:
        placement = Placement(members, members // 8, 8, 8, 8)
        return {c.route: c for c in model.candidates("all_reduce", 1e6, placement)}

    small, large = routes(MAX_RECIPE_MEMBERS), routes(MAX_RECIPE_MEMBERS + 8)
    assert small[Route.TREE].seconds is not None
    assert small[Route.HIERARCHICAL].seconds is not None
    for route in (Route.TREE, Route.HIERARCHICAL):
        assert large[route].seconds is None
        assert large[route].reason == ("planc writes and proves recipes for groups of at most "
                                       "1,024 ranks; larger groups use the backend's own "
                                       "algorithm")
    assert large[Route.RING].seconds is not None


# --- no limit, but a bounded search for the hint --------------------------------------------


def test_a_huge_heads_or_kv_heads_is_diagnosed_with_its_hint_at_once(tmp_path):
    """heads = 100000144 (a mutant of bench/hostile.py) took check 6 s, searching every
    value below heads for a divisor of hidden; 10**15 would never have finished."""
    heads = (f"plan p {{\n  model gpt {{ layers = 2; hidden = 4096; heads = {10**15 + 37}; "
             "vocab = 256; seq = 32; batch = 8 }\n}\n")
    kv_heads = (f"plan p {{\n  model llama {{ layers = 2; hidden = 4096; heads = 32; "
                f"kv_heads = {10**15 + 37}; ffn = 128; vocab = 256; seq = 32; batch = 8 }}\n}}\n")
    for text, message, hint in [
        (heads, f"hidden (4096) must divide by heads ({10**15 + 37})",
         "heads must divide hidden; try heads = 4096 or heads = 2048"),
        (kv_heads, f"kv_heads ({10**15 + 37}) must divide heads (32): each key/value head "
                   f"serves a group of query heads", "try kv_heads = 32 or kv_heads = 16")]:
        path = tmp_path / "plan.plan"
        path.write_text(text)
        result = subprocess.run([sys.executable, "-m", "planc", "check", str(path),
                                 "--error-format", "json"], capture_output=True, text=True,
                                cwd=ROOT, timeout=SECONDS)
        (diagnostic,) = json.loads(result.stdout)["diagnostics"]
        assert (diagnostic["message"], diagnostic["hints"]) == (message, [hint])


def test_largest_divisors_are_exact_near_the_bound_and_searched_within_a_budget():
    assert largest_divisors(4096, 100) == [64, 32]
    assert largest_divisors(18432, 100000144) == [18432, 9216]
    assert largest_divisors(7, 7) == [1]
    assert largest_divisors(12, 2) == [1]
    assert largest_divisors(12, 1) == []
    prime = 10**12 + 39
    assert largest_divisors(prime, 10**13) == [prime]  # 1 lies beyond the budget
    assert largest_divisors(prime * 2, prime, budget=10) == []
