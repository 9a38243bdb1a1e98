"""``model moe { imbalance }``: the load imbalance of real routing, as the simulator prices
it. The busiest rank of an ep group receives ``imbalance`` times the mean rows; its
experts' GEMMs and the group's all-to-alls wait for it. Training is not changed: the
runtime routes for real.
"""

from __future__ import annotations

import pytest

from planc.compile import compile_plan
from planc.estimate.cost import CostModel, Placement
from planc.estimate.mixture import Mixture
from planc.lang import load_text
from planc.models import moe
from planc.simulate import simulate
from planc.estimate.instruction_cost import InstructionCosts

PLAN = """plan p {{
  model moe {{ layers = 2; hidden = 32; heads = 4; kv_heads = 2; vocab = 128; seq = 16;
              batch = 8; experts = 4; top_k = 2; expert_ffn = 16{imbalance} }}
  mesh {{ dp = {dp}; ep = {ep} }}
  topology {{ {topology} }}
}}"""


def plan_of(imbalance: str = "", ep: int = 2, dp: int = 8,
            topology: str = "preset = dgx-h100"):
    return load_text(PLAN.format(imbalance=imbalance, ep=ep, dp=dp, topology=topology)).plan


def test_the_key_is_a_number_of_at_least_one_and_plan_json_keeps_it_only_when_given():
    errors = load_text(PLAN.format(imbalance="; imbalance = 0.5", ep=2, dp=8,
                                   topology="preset = dgx-h100")).diagnostics
    assert [(d.span.line, d.span.column, d.message) for d in errors if d.is_error] == [
        (3, 79, "expected a number >= 1, got 0.5")]
    errors = load_text(PLAN.format(imbalance="; imbalance = 2.5", ep=2, dp=8,
                                   topology="preset = dgx-h100")).diagnostics
    assert [(d.span.line, d.span.column, d.message) for d in errors if d.is_error] == [
        (3, 79, "imbalance (2.5) must be at most experts / top_k (2): the busiest expert "
                "takes each token at most once")]
    assert "imbalance" not in plan_of().to_dict()["model"]["options"]
    assert plan_of("; imbalance = 1.3").to_dict()["model"]["options"]["imbalance"] == 1.3


def test_the_default_is_the_published_measurement_and_ep_1_has_none():
    assert moe.PUBLISHED_IMBALANCE == 1.72
    assert Mixture.of(plan_of()).imbalance == 1.72
    assert Mixture.of(plan_of("; imbalance = 1.25")).imbalance == 1.25
    # every rank holds every expert: it receives what it routes, whatever the routing
    assert Mixture.of(plan_of("; imbalance = 1.25", ep=1)).imbalance == 1.0


def test_the_busiest_rank_runs_its_routed_share_of_the_flops_times_the_imbalance():
    """Per token (hidden 32, experts of 16, top_k 2): an expert's SwiGLU is 2*32*2*16 +
    5*16 + 2*16*32 = 3,152 FLOPs, the router 2*32*4 + 5*4 = 276, the weighted sum 2*32
    per expert: 6,708 in all, of which the routed experts' 2 x (3,152 + 64) = 6,432."""
    mixture = Mixture.of(plan_of("; imbalance = 1.5"))
    assert mixture.flops_per_token == 6708
    assert mixture.busiest_flops(6708 * 10) == 6708 * 10 + 0.5 * 6432 * 10
    assert Mixture.of(plan_of("; imbalance = 1.0")).busiest_flops(6708.0) == 6708.0


def test_the_all_to_alls_and_the_experts_wait_for_the_busiest_rank():
    """ep 2 inside a node, one sequence of 16 tokens a rank: each all-to-all carries the
    busiest rank's rows, 1.5 times the mean; the counts before the dispatch, one int64
    an expert (4 of them), do not grow with it."""
    build = compile_plan(plan_of("; imbalance = 1.5"))
    costs = InstructionCosts(build.plan, build.groups)
    program = next(p for p in build.programs.values() if p.stage == 0)
    found = {i.node: i for block in program.blocks.values() for i in block}
    forward = found["F/L0/moe"]
    costs(forward, 0)
    cost = CostModel(build.plan.topology)
    one = cost.all_to_all_seconds(forward.operands.bytes * 1.5, Placement.within_node(2))
    counts = cost.all_to_all_seconds(4 * 8, Placement.within_node(2))
    assert costs.exchanges["F/L0/moe"] == 2 * one + counts
    # the step grows with the imbalance, and not at all without ep
    steps = [simulate(compile_plan(plan_of(f"; imbalance = {i}"))).step_seconds
             for i in (1.0, 1.5, 2.0)]
    assert steps[0] < steps[1] < steps[2]
    alone = [simulate(compile_plan(plan_of(f"; imbalance = {i}", ep=1))).step_seconds
             for i in (1.0, 2.0)]
    assert alone[0] == alone[1]


def test_off_the_known_gpus_the_roofline_prices_the_busiest_ranks_flops():
    cpu = "nodes = 1; devices_per_node = 8; device { flops = 1TFLOP/s; memory = 8GB }"
    steps = [simulate(compile_plan(plan_of(f"; imbalance = {i}", topology=cpu))).step_seconds
             for i in (1.0, 2.0)]  # 2: experts / top_k, every token on one expert
    assert steps[0] < steps[1]


@pytest.mark.parametrize("imbalance", ["", "; imbalance = 2"])
def test_the_plan_text_shows_the_key_only_when_given(imbalance):
    from planc.views.plan_summary import settings

    text = settings(plan_of(imbalance))
    assert ("imbalance 2" in text) == bool(imbalance)
