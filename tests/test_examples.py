"""Every example plan in plans/ is valid, warning-free (but for the warning an example
shows on purpose), and says what it shows."""

from __future__ import annotations

import pytest

from planc.lang import load_file
from tests.conftest import PLANS

EXAMPLES = sorted(PLANS.glob("*.plan"))


def test_the_required_examples_exist():
    names = {p.stem for p in EXAMPLES}
    assert {"gpt-tiny", "dp-only", "tp-sequence-parallel", "cp-ring-attention",
            "pp-interleaved", "zero3", "unusual-placements", "gpt3-175b", "gpt-1t"} <= names


# unusual-placements puts tp pairs on two nodes to show what that derives; planc warns.
ON_PURPOSE = {"unusual-placements": [(
    17, "tp group [0, 2] spans nodes 0 and 1: the tensor-parallel all-reduces of every layer "
        "cross the inter-node link",
    ("estimated 181 us per step on each device for 8 all-reduces of 32.8 KB (2 per layer in "
     "the forward and 2 in the backward, per microbatch), against 82.6 us inside one node, "
     "2.2 times as long",
     "put tp first in the mesh order (order = [tp, dp, cp, pp]), so that each tp group is 2 "
     "consecutive ranks of one node, as Megatron-LM places them"))]}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_is_valid_without_warnings(path):
    loaded = load_file(path)
    assert loaded.ok
    assert [(d.span.line, d.message, d.hints) for d in loaded.diagnostics
            if d.severity == "warning"] == ON_PURPOSE.get(path.stem, [])
    assert len(loaded.diagnostics) == len(ON_PURPOSE.get(path.stem, []))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_starts_with_a_comment_saying_what_it_shows(path):
    first = path.read_text().splitlines()[0]
    assert first.startswith(f"# {path.stem}: ")


def test_gpt_tiny_is_the_spec_example():
    plan = load_file(PLANS / "gpt-tiny.plan").plan
    assert (plan.mesh.tp, plan.mesh.cp, plan.mesh.pp, plan.mesh.dp) == (2, 1, 2, 2)
    assert plan.model.ffn == 256
    assert plan.shard.pp.chunks == ((0, 1), (2, 3))
    assert plan.shard.dp.zero == 1
    assert plan.train.optimizer.name == "adamw"
    assert plan.train.optimizer.weight_decay == 0.0
    assert plan.topology.inter.latency == 5e-6


def test_paper_scale_plans_match_narayanan_et_al():
    p175 = load_file(PLANS / "gpt3-175b.plan").plan
    assert (p175.mesh.tp, p175.mesh.pp, p175.mesh.dp, p175.world) == (8, 16, 8, 1024)
    assert (p175.topology.nodes, p175.topology.devices_per_node) == (128, 8)
    p1t = load_file(PLANS / "gpt-1t.plan").plan
    assert (p1t.mesh.tp, p1t.mesh.pp, p1t.mesh.dp, p1t.world) == (8, 64, 6, 3072)
    assert p1t.model.layers == 128 and p1t.schedule.microbatches == 512
