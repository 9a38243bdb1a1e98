"""DeepSeek-V3's gate (issue 40): ``model moe { score = sigmoid; routed_scale = S }``,
checked against transformers' ``DeepseekV3MoE`` (its router and experts) on the same
weights, and trained under tp, dp and ep with --check."""

from __future__ import annotations

import pytest

from planc.cli import main
from planc.lang import load_text

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

PLAN = """plan ds {
  model moe {
    layers = 3; hidden = 64; heads = 4; kv_heads = 2; vocab = 128; seq = 32; batch = 8
    experts = 8; top_k = 2; expert_ffn = 48; shared_experts = 1; first_dense = 1; ffn = 128
    score = sigmoid; routed_scale = 2.5 EXTRA
  }
  mesh { tp = 2; dp = 2; ep = 4 }
  shard { tp { sequence_parallel = on } }
  schedule { microbatches = 2 }
  train { steps = 3; optimizer = sgd(lr = 0.1, momentum = 0.9); seed = 0 }
}
"""


def deepseek_mixture(m, weights: dict, groups: tuple[int, int] = (1, 1)):
    """transformers' DeepseekV3MoE of ``m``'s sizes holding planc's ``weights`` (planc
    stores x @ W: (in, out); torch's Linear holds (out, in))."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    config = transformers.DeepseekV3Config(
        hidden_size=m.hidden, n_routed_experts=m.options["experts"],
        num_experts_per_tok=m.options["top_k"], moe_intermediate_size=m.options["expert_ffn"],
        n_shared_experts=m.options["shared_experts"], n_group=groups[0], topk_group=groups[1],
        norm_topk_prob=True, routed_scaling_factor=m.options["routed_scale"], hidden_act="silu")
    module = DeepseekV3MoE(config).float()
    with torch.no_grad():
        module.gate.weight.copy_(weights["router.weight"].T)
        module.gate.e_score_correction_bias.zero_()
        gate, up, down = (weights[f"experts.{w}.weight"] for w in ("gate", "up", "down"))
        module.experts.gate_up_proj.copy_(torch.cat([gate, up], dim=2).transpose(1, 2))
        module.experts.down_proj.copy_(down.transpose(1, 2))
        for name in ("gate", "up", "down"):
            getattr(module.shared_experts, f"{name}_proj").weight.copy_(
                weights[f"shared.{name}.weight"].T)
    return module


def random_weights(m, generator) -> dict:
    """A mixture block of ``m``'s sizes, every weight drawn from ``generator``."""
    e, h, f = m.options["experts"], m.hidden, m.options["expert_ffn"]
    return {"router.weight": torch.randn(h, e, generator=generator) * 0.3,
            "experts.gate.weight": torch.randn(e, h, f, generator=generator) * 0.1,
            "experts.up.weight": torch.randn(e, h, f, generator=generator) * 0.1,
            "experts.down.weight": torch.randn(e, f, h, generator=generator) * 0.1,
            "shared.gate.weight": torch.randn(h, f, generator=generator) * 0.1,
            "shared.up.weight": torch.randn(h, f, generator=generator) * 0.1,
            "shared.down.weight": torch.randn(f, h, generator=generator) * 0.1}


@pytest.mark.parametrize("groups", [None, (4, 2)])  # DeepSeek-V3's node-limited routing
def test_the_sigmoid_gate_is_deepseek_v3s(groups):
    from planc.runtime.families.moe import mixture
    from planc.runtime.families.moe_gate import route

    extra = "" if groups is None else f"; expert_groups = {groups[0]}; route_groups = {groups[1]}"
    m = load_text(PLAN.replace("EXTRA", extra)).plan.model
    generator = torch.Generator().manual_seed(3)
    weights = random_weights(m, generator)
    tokens = torch.randn(40, m.hidden, generator=generator)
    theirs = deepseek_mixture(m, weights, groups or (1, 1))
    _, their_weights, their_experts = theirs.gate(tokens)
    experts, ours = route(tokens, weights["router.weight"], 2, True, "sigmoid", 2.5, groups)
    if groups is not None:  # every token's experts within its 2 best groups of 2 experts
        assert all(len({e // 2 for e in row}) <= 2 for row in experts.tolist())
        ungrouped = route(tokens, weights["router.weight"], 2, True, "sigmoid", 2.5)[0]
        assert not torch.equal(ungrouped.sort(-1).values, experts.sort(-1).values)
    order = their_experts.sort(-1)
    assert torch.equal(experts.sort(-1).values, order.values)
    assert torch.allclose(ours.gather(-1, experts.sort(-1).indices),
                          their_weights.gather(-1, order.indices), rtol=1e-6, atol=1e-7)
    assert torch.allclose(ours.sum(-1), torch.full((40,), 2.5), rtol=1e-6)  # normalised, x 2.5
    with torch.no_grad():
        expected = theirs(tokens.unsqueeze(0)).squeeze(0)
    assert torch.allclose(mixture(tokens, weights.__getitem__, m), expected, rtol=1e-5,
                          atol=1e-6)


@pytest.mark.parametrize("extra", ["", "; aux_loss = 0.01",
                                   "; expert_groups = 4; route_groups = 1"])
def test_the_sigmoid_gate_trains_under_tp_dp_and_ep(tmp_path, extra, capsys):
    (tmp_path / "ds.plan").write_text(PLAN.replace("EXTRA", extra))
    assert main(["run", str(tmp_path / "ds.plan"), "-o", str(tmp_path / "b"), "--check"]) == 0
    assert "every loss and parameter matches" in capsys.readouterr().err


def test_the_keys_are_checked(capsys):
    loaded = load_text(PLAN.replace("EXTRA", "").replace("score = sigmoid", "score = tanh"))
    assert not loaded.ok
    assert "unknown value 'tanh'; expected softmax or sigmoid" in str(loaded.diagnostics[0])
    loaded = load_text(PLAN.replace("EXTRA", "").replace("routed_scale = 2.5",
                                                         "routed_scale = 0"))
    assert not loaded.ok and "expected a number > 0, got 0" in str(loaded.diagnostics[0])
    for groups, message in (
            ("expert_groups = 3", "expert_groups (3) must divide experts (8)"),
            ("expert_groups = 4; route_groups = 5",
             "route_groups (5) must be at most expert_groups (4)"),
            ("expert_groups = 8; route_groups = 1",
             "top_k (2) must be at most the experts of route_groups groups (1 x 1)")):
        loaded = load_text(PLAN.replace("EXTRA", f"; {groups}"))
        assert not loaded.ok and message in str(loaded.diagnostics[0]), groups
    # written only when set: a plan without them keeps its plan.json
    plain = load_text(PLAN.replace("EXTRA", "").replace(
        "score = sigmoid; routed_scale = 2.5", "")).plan
    assert "score" not in plain.model.options and "routed_scale" not in plain.model.options
