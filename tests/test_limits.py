"""planc's limits (docs/language.md, section 5, Limits): a plan past a limit is refused
by ``check`` with the limit and the reason it exists; what is bounded rather than refused
(recipes, the search for a hint) stops at its bound.

The plans at the limits are compiled, and every command run on them, by
tests/test_limits_compiled.py; bench/limits.py measures how long that takes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from planc.estimate.cost import MAX_RECIPE_MEMBERS, CostModel, Placement, Route
from planc.lang.check import LIMITS, largest_divisors
from planc.plan.topology import Device, Link, Topology
from tests.conftest import ROOT
from tests.limit_plans import gpt

HANG_S = 60  # a check that never ends fails the test rather than the suite


def check_messages(text: str, tmp_path: Path) -> list[str]:
    path = tmp_path / "plan.plan"
    path.write_text(text)
    result = subprocess.run([sys.executable, "-m", "planc", "check", str(path),
                             "--error-format", "json"], capture_output=True, text=True,
                            cwd=ROOT, timeout=HANG_S)
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
                                cwd=ROOT, timeout=HANG_S)
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
