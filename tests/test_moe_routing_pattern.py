"""``model moe { routing }``: where the simulator takes a token's top_k experts to lie.
``learned`` (the default) spreads them as a router's choice; ``consecutive`` is a
benchmark's gate forced to balance, token t's experts t x top_k ... t x top_k + top_k - 1
modulo experts (NeMo AutoModel's FakeBalancedGate), which sets how many ranks and nodes a
two-hop dispatch reaches. Training is not changed: the runtime routes for real.
"""

from __future__ import annotations

import pytest

from planc.compile import compile_plan
from planc.estimate.mixture import Mixture, consecutive_holders
from planc.lang import load_file, load_text
from planc.models import moe
from planc.simulate import simulate
from tests.conftest import PLANS

PLAN = """plan p {{
  model moe {{ layers = 2; hidden = 32; heads = 4; kv_heads = 2; vocab = 128; seq = 16;
              batch = 8; experts = 8; top_k = 2; expert_ffn = 16{model} }}
  mesh {{ dp = 8; ep = 8 }}
  topology {{ preset = dgx-h100; nodes = 2; devices_per_node = 4 }}
  optimize {{ {optimize} }}
}}"""


def plan_of(model: str = "", optimize: str = "moe_dispatcher = two_hop"):
    loaded = load_text(PLAN.format(model=model, optimize=optimize))
    assert loaded.ok, [d.message for d in loaded.diagnostics]
    return loaded.plan


def counted(experts: int, top_k: int, holders: int) -> float:
    """The holders one token's experts lie on, counted token by token over a rank's
    tokens, as the gate picks them: ``arange(tokens * top_k).view(-1, top_k) % experts``
    (4,096 tokens where they make whole rounds of the experts, as the AutoModel runs'
    sequence of 4,096 does)."""
    per_holder = experts // holders
    tokens = 4096 - 4096 % experts
    return sum(len({(t * top_k + j) % experts // per_holder for j in range(top_k)})
               for t in range(tokens)) / tokens


@pytest.mark.parametrize("experts, top_k, ranks, nodes", [
    (256, 8, 64, 8),  # DeepSeek-V3 at ep 64 over 8 nodes: 2 ranks of one node
    (128, 8, 8, 1),  # Qwen3-30B-A3B at ep 8 on one node: one rank
    (8, 2, 8, 2), (8, 3, 4, 2), (12, 5, 4, 2), (64, 6, 16, 4), (16, 16, 8, 2)])
def test_a_tokens_consecutive_experts_lie_on_as_many_holders_as_counting_the_tokens_says(
        experts, top_k, ranks, nodes):
    mixture = Mixture(64, 48, experts, top_k, 0, experts // ranks, 1.0, consecutive=True)
    assert mixture.holders_per_token(ranks, nodes) == pytest.approx(
        counted(experts, top_k, ranks), rel=1e-12)
    assert mixture.nodes_per_token(nodes) == pytest.approx(
        counted(experts, top_k, nodes), rel=1e-12)


def test_a_tokens_consecutive_experts_lie_on_as_many_holders_as_counted_by_hand():
    """12 experts in blocks of 3, top 5: the 12 tokens of a round start at experts 0, 5,
    10, 3, 8, 1, 6, 11, 4, 9, 2, 7 and span 2, 3, 2, 2, 3, 2, 2, 3, 2, 2, 3, 2 blocks (28
    in all); 64 experts in blocks of 4, top 6: every token's 6 start at an even expert
    and span 2 blocks; a token whose top_k is every expert reaches every holder."""
    from fractions import Fraction

    assert Fraction(consecutive_holders(12, 5, 3)).limit_denominator(100) == \
        Fraction(28, 12)
    assert consecutive_holders(64, 6, 4) == 2.0
    assert consecutive_holders(16, 16, 2) == 8.0
    # a million experts in a few tenths of a second: counted per round, not per token
    assert consecutive_holders(1 << 20, 4095, 1 << 12) == pytest.approx(
        1 + 4094 / 4096, rel=1e-12)


def test_deepseek_v3s_forced_gate_reaches_2_ranks_of_one_node_where_a_router_reaches_7_7():
    spread = Mixture(7168, 2048, 256, 8, 1, 4, 1.0)
    forced = Mixture(7168, 2048, 256, 8, 1, 4, 1.0, consecutive=True)
    assert (round(spread.holders_per_token(64, 8), 2), round(spread.nodes_per_token(8), 2)) \
        == (7.68, 5.29)
    assert (forced.holders_per_token(64, 8), forced.nodes_per_token(8)) == (2.0, 1.0)
    # node-limited routing limits a router's choice, not the forced gate's
    grouped = Mixture(7168, 2048, 256, 8, 1, 4, 1.0, expert_groups=8, route_groups=4,
                      consecutive=True)
    assert (grouped.holders_per_token(64, 8), grouped.nodes_per_token(8)) == (2.0, 1.0)


def test_the_key_is_learned_or_consecutive_and_plan_json_keeps_it_only_when_given():
    loaded = load_text(PLAN.format(model="; routing = spread", optimize=""))
    assert [(d.span.line, d.span.column, d.message) for d in loaded.diagnostics
            if d.is_error] == [(3, 77, "unknown value 'spread'; expected learned or "
                                       "consecutive")]
    assert "routing" not in plan_of().to_dict()["model"]["options"]
    assert plan_of("; routing = consecutive").to_dict()["model"]["options"]["routing"] == \
        "consecutive"
    assert not Mixture.of(plan_of()).consecutive
    assert not Mixture.of(plan_of("; routing = learned")).consecutive
    assert Mixture.of(plan_of("; routing = consecutive")).consecutive


def test_the_forced_gate_is_balanced_unless_the_plan_says_otherwise():
    assert Mixture.of(plan_of()).imbalance == moe.PUBLISHED_IMBALANCE
    assert Mixture.of(plan_of("; routing = consecutive")).imbalance == 1.0
    assert Mixture.of(plan_of("; routing = consecutive; imbalance = 1.5")).imbalance == 1.5


def test_at_a_stated_imbalance_routing_moves_a_two_hop_dispatch_and_nothing_else():
    """Two nodes of 4, 8 experts of top 2, one a rank: a router's choice reaches 2 ranks
    on 1.57 nodes a token, the forced gate's (experts 2t and 2t + 1) 2 ranks of one
    node. The plain all-to-all sends a row per (token, expert) pair wherever they lie.
    (Unstated, the imbalance is 1 under the forced gate: the test above.)"""
    def step(routing: str, optimize: str) -> float:
        plan = plan_of(f"; imbalance = 1.0; routing = {routing}", optimize)
        return simulate(compile_plan(plan)).step_seconds

    assert step("consecutive", "moe_dispatcher = two_hop") < \
        step("learned", "moe_dispatcher = two_hop")
    assert step("consecutive", "") == step("learned", "")


def test_nemo_automodels_deepseek_v3_run_on_256_gpus_is_priced_with_its_gate():
    """plans/moe-published/automodel-deepseek-v3-256.plan (docs/simulate.md, "Mixtures of
    experts"): 6.95 s a step with the benchmark's gate, its worst stage waiting 6 % of it
    for ep; priced as a router's spread choice (and FSDP as zero = 3) it was 10.4 s, 34 %
    waiting for ep."""
    plan = load_file(PLANS / "moe-published" / "automodel-deepseek-v3-256.plan").plan
    assert plan.model.options["routing"] == "consecutive"
    result = simulate(compile_plan(plan))
    exposed = max(s.exposed_seconds.get("ep", 0.0) for s in result.stages)
    assert (round(result.step_seconds, 2), round(100 * exposed / result.step_seconds)) == \
        (6.95, 6)
