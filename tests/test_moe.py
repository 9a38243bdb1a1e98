"""The moe family (issue 24, first part): its language, its routing rule, against
transformers' ``MixtralForCausalLM``, and every layout against the one-process run."""

from __future__ import annotations


import pytest

from planc.cli import main
from planc.lang import load_text
from planc.models import moe as moe_family
from tests.conftest import trained_one_step

MODEL = ("layers = {layers}; hidden = 32; heads = 4; kv_heads = 2; ffn = 40; vocab = 96; "
         "seq = 16; batch = 4; experts = {experts}; top_k = 2; expert_ffn = 24; "
         "shared_experts = {shared}; first_dense = {dense}{extra}")
PLAN = """plan moe_{name} {{
  model moe {{ {model} }}
  mesh {{ {mesh} }}
  shard {{ {shard} }}
  schedule {{ microbatches = {m}{schedule} }}{optimize}
  train {{ steps = {steps}; optimizer = {optimizer}; seed = 11 }}
}}
"""


def plan_text(name="t", layers=3, shared=0, dense=0, extra="", mesh="", shard="", m=1,
              schedule="", steps=2, optimizer="adamw(lr = 1e-3, weight_decay = 0.01)",
              optimize="", experts=4, batch=4) -> str:
    model = MODEL.format(layers=layers, shared=shared, dense=dense, extra=extra,
                         experts=experts).replace("batch = 4", f"batch = {batch}")
    return PLAN.format(name=name.replace("-", "_"), model=model, mesh=mesh, shard=shard, m=m,
                       schedule=schedule, steps=steps, optimizer=optimizer,
                       optimize=f"\n  optimize {{ {optimize} }}" if optimize else "")


# --- the language --------------------------------------------------------------------------

def test_a_moe_block_has_its_parameters_and_flops():
    plan = load_text(plan_text(layers=3, shared=1, dense=1)).plan
    params = {p.name: p.shape for p in moe_family.FAMILY.all_parameters(plan.model)}
    assert params["layers.0.gate.weight"] == (32, 40)  # dense: llama's SwiGLU, width ffn
    assert "layers.0.router.weight" not in params
    assert params["layers.1.router.weight"] == (32, 4)
    assert params["layers.1.experts.gate.weight"] == (4, 32, 24)
    assert params["layers.1.experts.down.weight"] == (4, 24, 32)
    assert params["layers.1.shared.up.weight"] == (32, 24)
    assert "layers.1.gate.weight" not in params
    h, f, e, v, s = 32, 40, 24, 96, 16
    attention = 2 * h * (4 + 2 * 2) * 8 + 2 * h * h + 4 * s * h
    assert moe_family.model_flops_per_token(plan.model) == \
        3 * attention + 6 * h * f + 2 * (2 * h * 4 + 3 * 6 * h * e) + 2 * h * v


@pytest.mark.parametrize("keys, message", [
    ("top_k = 5", "top_k (5) must be at most experts (4): each token goes to top_k "
                  "different experts"),
    ("first_dense = 4", "first_dense (4) must be at most layers (3): it counts the dense "
                        "blocks before the first mixture of experts"),
])
def test_a_moe_block_is_checked_at_its_key(keys, message):
    key, value = keys.split(" = ")
    text = plan_text().replace(f"{key} = ", f"{key} = {value}#", 1)
    text = text.replace(f"{key} = {value}#2", keys).replace(f"{key} = {value}#0", keys)
    loaded = load_text(text)
    assert not loaded.ok
    first = loaded.diagnostics[0]
    assert first.message == message
    line = text.splitlines()[first.span.line - 1]  # the span is the value's
    assert line[:first.span.column - 1].endswith(f"{key} = ")


def test_an_unknown_family_with_another_familys_preset_is_an_error_not_a_crash():
    """A model block of an unknown family is read with every family's keys: the moe
    family's defaults once looked llama's preset up among its own (found by
    tests/test_fuzz.py)."""
    loaded = load_text("plan p { model llama1f1b { preset = llama3-405b; batch = 8 } }")
    assert not loaded.ok
    assert "unknown model family 'llama1f1b'; planc knows gpt, llama, moe, deepseek" in \
        [d.message for d in loaded.diagnostics]


def test_the_presets_have_the_published_sizes():
    mixtral = load_text("plan p { model moe { preset = mixtral-8x7b; batch = 8 } }").plan.model
    assert (mixtral.layers, mixtral.hidden, mixtral.experts, mixtral.top_k,
            mixtral.expert_ffn, mixtral.kv_heads, mixtral.vocab) == \
        (32, 4096, 8, 2, 14336, 8, 32000)
    params = sum(p.numel for p in moe_family.FAMILY.all_parameters(mixtral))
    assert params == 46_702_792_704  # Mixtral 8x7B: 46.7B parameters (Jiang et al. 2024)
    deepseek = load_text("plan p { model moe { preset = deepseek-v3-size; batch = 8 } }"
                         ).plan.model
    assert (deepseek.first_dense, deepseek.shared_experts, deepseek.ffn) == (3, 1, 18432)


@pytest.mark.parametrize("mesh, extra, message, hint", [
    ("tp = 2; dp = 3; ep = 4", "", "ep (4) must divide the ranks of a pipeline stage, tp x "
     "cp x dp = 6: its groups are drawn from them", "try ep = 3 or ep = 2"),
    ("dp = 6; ep = 3", "", "ep (3) must divide experts (4): each rank of an ep group holds "
     "experts / ep of them", "try ep = 2"),
])
def test_ep_is_checked_at_its_key(mesh, extra, message, hint):
    text = plan_text(mesh=mesh, extra=extra, batch=12)
    errors = [d for d in load_text(text).diagnostics if d.is_error]
    assert [(d.message, d.hints) for d in errors] == [(message, (hint,))]
    line = text.splitlines()[errors[0].span.line - 1]
    assert line[:errors[0].span.column - 1].endswith("ep = ")


def test_ep_needs_a_model_with_experts():
    text = "plan p {\n  model llama { layers = 2; hidden = 32; heads = 4; ffn = 64; " \
           "vocab = 96; seq = 16; batch = 4 }\n  mesh { dp = 2; ep = 2 }\n}"
    errors = [d for d in load_text(text).diagnostics if d.is_error]
    assert [(d.message, d.hints, d.span.line, d.span.column) for d in errors] == [
        ("ep (2) spreads a model's experts over ranks; model llama has none",
         ("remove ep, or describe a mixture of experts (model moe)",), 3, 23)]


def test_ep_groups_are_runs_of_a_stages_ranks_fastest_axis_first():
    """Megatron-Core's MoE Parallel Folding: ep drawn from tp x cp x dp of one stage, in
    the mesh's order; the world does not change."""
    from planc.program.groups import EXPERTS
    from planc.lower.tables import plan_group_table

    plan = load_text(plan_text(mesh="tp = 2; pp = 2; dp = 2; ep = 4", m=2, batch=8)).plan
    table = plan_group_table(plan)
    rule = table.rule(EXPERTS)
    assert plan.world == 8
    assert list(table.groups(rule)) == [(0, 1, 4, 5), (2, 3, 6, 7)]  # pp is slower than tp
    reordered = load_text(plan_text(mesh="tp = 2; dp = 2; ep = 2; order = [dp, tp, cp, pp]",
                                    batch=8)).plan
    assert list(plan_group_table(reordered).groups(plan_group_table(reordered).rule(EXPERTS))) \
        == [(0, 1), (2, 3)]  # dp fastest: an ep group holds both dp ranks of a tp rank
    assert plan_group_table(load_text(plan_text(mesh="dp = 2")).plan).rule(EXPERTS) is None


def test_experts_are_split_over_ep_and_reduced_over_their_replicas():
    """ep 2 over tp 2 x dp 2 (ZeRO-1): each rank keeps 2 of the 4 experts' rows of every
    stacked weight, in buckets of their own reduced (and sharded) over the 2 ranks holding
    the same experts, the edp group [0, 2] / [1, 3]; the router and the attention stay
    in the dp x cp buckets, their tp partial sums summed first."""
    from planc.compile import compile_plan
    from planc.program.groups import EXPERTS
    from planc.lower.tables import plan_group_table
    from planc.graph.ir import Axis

    plan = load_text(plan_text(mesh="tp = 2; dp = 2; ep = 2", m=2, batch=8,
                               shard="dp { zero = 1 }")).plan
    table = plan_group_table(plan)
    assert list(table.groups(table.rule(EXPERTS))) == [(0, 1), (2, 3)]
    assert list(table.groups(table.rule("edp"))) == [(0, 2), (1, 3)]
    build = compile_plan(plan)
    buckets = build.graph.graph["buckets"]
    experts = {b: info for b, info in buckets.items() if info.get("over") == "edp"}
    assert sorted(experts) == ["c0.e0"]
    members = experts["c0.e0"]["members"]
    assert sorted(m["param"] for m in members) == sorted(
        f"layers.{layer}.experts.{w}.weight" for layer in range(3) for w in ("gate", "up",
                                                                           "down"))
    assert {(tuple(m["shape"]), m["ep_split"], m["tp_split"]) for m in members} == {
        ((2, 32, 24), 2, None), ((2, 24, 32), 2, None)}
    assert (experts["c0.e0"]["parts"], experts["c0.e0"]["numel"]) == (2, 3 * 3 * 2 * 32 * 24)
    assert not any(m["param"].split(".")[-2] in ("gate", "up", "down") and "experts" in
                   m["param"] for b, info in buckets.items() if b not in experts
                   for m in info["members"])
    reductions = sorted((d["kind"], d["group_size"], d["bucket"]) for _, d in
                        build.graph.nodes(data=True) if d.get("axis") == Axis.EDP)
    assert reductions == [("all_gather", 2, "c0.e0"), ("reduce_scatter", 2, "c0.e0")]
    fuse = next(r for r in build.graph.graph["passes"] if r["name"] == "fuse")
    assert "9 expert gradient reduce-scatters -> 1" in fuse["line"]
    # tp 4 over ep 2: the ranks holding the same experts are tp peers
    wide = plan_group_table(load_text(plan_text(mesh="tp = 4; ep = 2")).plan)
    assert list(wide.groups(wide.rule("edp"))) == [(0, 2), (1, 3)]


def test_planc_layout_lists_the_ep_groups_and_the_experts_replicas(capsys):
    """pp 2 x dp 2 x tp 2 with ep 2: a stage's ranks (tp fastest) in runs of 2, and the
    ranks at the same place of each run; both in the table and in --json."""
    from planc.plan.layout import Layout

    layout = Layout.of(load_text(plan_text(mesh="tp = 2; pp = 2; dp = 2; ep = 2", m=2,
                                           batch=8)).plan)
    assert layout.groups("ep") == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert layout.groups("edp") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert (layout.group(5, "ep"), layout.group(5, "edp")) == ((4, 5), (1, 5))
    plain = Layout.of(load_text(plan_text(mesh="tp = 2")).plan)
    assert plain.group(1, "ep") == plain.group(1, "edp") == (1,)
    assert "ep" not in plain.to_dict()["groups"]
    data = layout.to_dict()
    assert (data["groups"]["ep"], data["groups"]["edp"]) == (
        [[0, 1], [2, 3], [4, 5], [6, 7]], [[0, 4], [1, 5], [2, 6], [3, 7]])
    from planc.views.layout_text import render_groups

    rows = {line.split()[0]: line.split() for line in render_groups(layout).splitlines()
            if line.startswith(("ep ", "edp "))}
    assert rows["ep"][:4] == ["ep", "2", "4", "intra-node"]
    assert rows["edp"][:4] == ["edp", "2", "4", "intra-node"]


def test_the_memory_estimate_splits_the_experts_over_ep_and_their_replicas():
    """Model states of one device: the 3 x 4 x 32 x 24 expert elements of each of 3
    blocks, halved by ep 2; under ZeRO-1 their AdamW state is split over their 2 replicas
    (edp), as the rest's is over dp 2 (fp32: 4 bytes a weight, 8 of AdamW state)."""
    from planc.estimate import memory

    def states(mesh, zero):
        plan = load_text(plan_text(mesh=mesh, m=2, batch=8,
                                   shard=f"dp {{ zero = {zero} }}")).plan
        stage = memory.estimate(plan).stages[0]
        return stage.parameters, stage.parameter_bytes, stage.optimizer_bytes

    experts = 3 * 3 * 4 * 32 * 24
    dense, dense_bytes, dense_optimizer = states("tp = 2; dp = 2", 0)
    split, split_bytes, split_optimizer = states("tp = 2; dp = 2; ep = 2", 0)
    assert dense - split == experts // 2
    assert (dense_bytes - split_bytes, dense_optimizer - split_optimizer) == \
        (4 * experts // 2, 8 * experts // 2)
    _, _, zero1 = states("tp = 2; dp = 2; ep = 2", 1)
    assert zero1 == split_optimizer / 2  # both halves over 2 replicas


def test_a_mixture_over_ep_names_its_group_and_its_all_to_all_bytes():
    """Its rows at uniform routing: each rank's tokens (a 1/tp share over tp) times top_k,
    hidden wide, in the model's dtype; the simulator adds a dispatch and a combine."""
    from planc.compile import compile_plan
    from planc.simulate import simulate

    plan = load_text(plan_text(mesh="tp = 2; dp = 2; ep = 4", m=2, batch=8,
                               shard="tp { sequence_parallel = on }")).plan
    build = compile_plan(plan)
    data = build.graph.nodes["F/L1/moe"]
    tokens = 8 // 2 // 2 * 16 // 2  # microbatch rows x seq, over tp
    assert (data["experts_over"], data["dispatch_bytes"]) == (4, tokens * 2 * 32 * 4)
    moe = next(i for i in build.programs["stage0.json"].blocks["F0"] if i.node == "F/L1/moe")
    assert (moe.operands.group, moe.operands.bytes) == ("ep", tokens * 2 * 32 * 4)
    apart = simulate(build).step_seconds
    together = simulate(compile_plan(load_text(plan_text(
        mesh="tp = 2; dp = 2", m=2, batch=8, shard="tp { sequence_parallel = on }")).plan)
    ).step_seconds
    assert apart > together


def test_the_memory_estimate_holds_the_dispatch_buffers_at_the_priced_imbalance():
    """ep 4 over tp 2 x dp 2: a rank's 32 tokens (2 sequences of 32, over tp) send 64 rows
    (top_k 2); the busiest rank receives 1.72 times that mean (the imbalance the
    simulator prices) and holds them with the experts' gate, up and product and their
    outputs. At worst it may receive, from each of its 4 ep peers, every row their 32
    tokens can send to its 2 experts: the estimate reports that beside its peak."""
    from planc.estimate import memory
    from planc.views import memory_text

    def estimate(mesh):
        plan = load_text(plan_text(mesh=mesh, m=2, batch=8, experts=8).replace(
            "seq = 16", "seq = 32")).plan
        return memory.estimate(plan)

    row = (2 * 32 + 3 * 24) * 4
    split, whole = estimate("tp = 2; dp = 2; ep = 4"), estimate("tp = 2; dp = 2")
    priced = 1.72 * 32 * 2
    # (less the gradient the mixture's backward step returns, in fp32: 2 of the 8
    # experts' gate, up and down, 32 x 24 each, on a rank of ep 4)
    fewer = (8 - 2) * 3 * 32 * 24 * 4
    assert split.stages[0].activation_bytes - whole.stages[0].activation_bytes == \
        pytest.approx(priced * row - fewer, rel=1e-12)
    worst = 4 * 32 * 2
    assert split.stages[0].worst_routing_extra_bytes == pytest.approx((worst - priced) * row,
                                                                      rel=1e-12)
    assert whole.worst_routing_peak is None
    assert split.stages[0].total_bytes + (worst - priced) * row == pytest.approx(827e3, abs=500)
    assert memory_text.worst_routing_text(whole) is None
    assert memory_text.worst_routing_text(split) == (
        "under the worst routing (a dropless mixture's every row of the ep group on one "
        "rank's experts) stage 0 would need 827 KB; the estimate prices the routing's "
        "imbalance, and model { capacity } bounds the worst case")


def test_explain_names_a_mixtures_all_to_alls_and_their_bytes(capsys):
    """plans/moe-tiny.plan, layer 1: 32 tokens per rank (2 sequences of 32 over tp 2) x
    top_k 2 rows of 64 fp32 features: 16 KB at uniform routing; at most every row the
    4 ranks of the ep group can send to one rank's 2 experts, 4 x 32 x 2 rows."""
    from tests.conftest import PLANS

    assert main(["explain", str(PLANS / "moe-tiny.plan"), "--layer", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == ("layer 1: the mixture's all-to-alls over ep (4 ranks: [0, 1, 4, 5]), "
                        "inside its instruction")
    assert lines[1] == ("  F  all_to_all over ep  16.4 KB per microbatch at uniform routing, "
                        "at most 65.5 KB received  [dispatch: each (token, expert) row to its "
                        "expert's rank]")
    assert [line[:5] for line in lines[1:5]] == ["  F  ", "  F  ", "  B  ", "  B  "]


# --- the routing rule ----------------------------------------------------------------------

def test_ties_go_to_the_lower_expert_and_weights_are_renormalised():
    torch = pytest.importorskip("torch")
    from planc.runtime.families.moe_gate import route

    tokens = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
    router = torch.tensor([[2.0, 1.0, 2.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    experts, weights = route(tokens, router, 2, True)
    # token 0: experts 0 and 2 tie at the top; token 1: all four tie
    assert experts.tolist() == [[0, 2], [0, 1]]
    assert weights.tolist() == [[0.5, 0.5], [0.5, 0.5]]
    experts, weights = route(tokens, router, 2, False)
    assert weights[1].tolist() == [0.25, 0.25]


def test_the_balance_loss_is_deepseek_v3s_sequence_wise_loss():
    """Two tokens, two experts, top 1 (DeepSeek-AI 2024, eqs. 17-20): f_i = E / (K T) x
    the tokens routed to i, P_i the mean probability of i; aux_loss x sum_i f_i P_i."""
    torch = pytest.importorskip("torch")
    from planc.runtime.families.moe import balance_loss

    m = load_text(plan_text(extra="; aux_loss = 0.1").replace("top_k = 2", "top_k = 1")
                  .replace("experts = 4", "experts = 2")).plan.model
    probabilities = torch.tensor([[0.75, 0.25], [0.6, 0.4]])
    spread = balance_loss(probabilities, torch.tensor([[0], [1]]), 1, m)  # f = [1, 1]
    assert spread.item() == pytest.approx(0.1 * (0.675 + 0.325))
    crowded = balance_loss(probabilities, torch.tensor([[0], [0]]), 1, m)  # f = [2, 0]
    assert crowded.item() == pytest.approx(0.1 * 2 * 0.675)
    # two sequences of one token each: summed per sequence
    both = balance_loss(probabilities, torch.tensor([[0], [0]]), 2, m)  # f = [2, 0] each
    assert both.item() == pytest.approx(0.1 * (2 * 0.75 + 2 * 0.6))
    # computed where the probabilities are (an H200 found it counting on the CPU)
    on_meta = balance_loss(probabilities.to("meta"), torch.tensor([[0], [0]]).to("meta"), 1, m)
    assert on_meta.device.type == "meta"


def test_with_a_balance_loss_the_mixture_runs_on_its_tp_share():
    """Over tp the mixture may take every token or this rank's share; with aux_loss only
    its share, its balance loss's counts summed over the tp x cp ranks of each sequence."""
    from planc.graph.sharding import R, S
    from planc.graph.tensor_parallel import choices

    for aux, inputs in (("", [R, S("seq")]), ("; aux_loss = 0.01", [S("seq")])):
        plan = load_text(plan_text(extra=aux, mesh="tp = 2",
                                   shard="tp { sequence_parallel = on }")).plan
        assert [c.input for c in choices("moe", plan, S("seq"))] == inputs


# --- against transformers' Mixtral ----------------------------------------------------------

LR = 1000.0


def _mixtral(plan):
    """MixtralForCausalLM with planc's initial weights (planc stores x @ W, (in, out))."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from planc.runtime.oracle.reference import initial, parameters

    m = plan.model
    config = transformers.MixtralConfig(
        vocab_size=m.vocab, hidden_size=m.hidden, intermediate_size=m.expert_ffn,
        num_hidden_layers=m.layers, num_attention_heads=m.heads,
        num_key_value_heads=m.kv_heads, head_dim=m.head_dim, num_local_experts=m.experts,
        num_experts_per_tok=m.top_k, rms_norm_eps=m.norm_eps, max_position_embeddings=m.seq,
        rope_parameters={"rope_type": "default", "rope_theta": m.rope_theta},
        tie_word_embeddings=False, router_aux_loss_coef=0.0, router_jitter_noise=0.0)
    config._attn_implementation = "eager"
    model = transformers.MixtralForCausalLM(config).float()
    value = {name: initial(plan, name, p.shape) for name, p in parameters(plan).items()}
    state = {"model.embed_tokens.weight": value["embedding.weight"],
             "model.norm.weight": value["final_ln.weight"],
             "lm_head.weight": value["head.weight"].t()}
    for layer in range(m.layers):
        w = {k[len(f"layers.{layer}."):]: v for k, v in value.items()
             if k.startswith(f"layers.{layer}.")}
        to = f"model.layers.{layer}."
        state.update({
            to + "input_layernorm.weight": w["ln1.weight"],
            to + "post_attention_layernorm.weight": w["ln2.weight"],
            **{to + f"self_attn.{x}_proj.weight": w[f"{x}.weight"].t()
               for x in ("q", "k", "v", "o")},
            to + "mlp.gate.weight": w["router.weight"].t(),
            to + "mlp.experts.gate_up_proj": torch.cat(
                [w["experts.gate.weight"], w["experts.up.weight"]], dim=2).transpose(1, 2),
            to + "mlp.experts.down_proj": w["experts.down.weight"].transpose(1, 2)})
    missing, unexpected = model.load_state_dict({k: v.contiguous() for k, v in state.items()},
                                                strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    return model


def _mixtral_gradient(model, name: str, layer_of):
    """The gradient of planc parameter ``name``, read from the Mixtral model, in planc's
    orientation."""
    import torch

    grads = {k: p.grad for k, p in model.named_parameters()}
    if name == "embedding.weight":
        return grads["model.embed_tokens.weight"]
    if name == "final_ln.weight":
        return grads["model.norm.weight"]
    if name == "head.weight":
        return grads["lm_head.weight"].t()
    layer, local = layer_of(name)
    to = f"model.layers.{layer}."
    if local in ("ln1.weight", "ln2.weight"):
        return grads[to + ("input_layernorm.weight" if local == "ln1.weight"
                           else "post_attention_layernorm.weight")]
    if local in ("q.weight", "k.weight", "v.weight", "o.weight"):
        return grads[to + f"self_attn.{local[0]}_proj.weight"].t()
    if local == "router.weight":
        return grads[to + "mlp.gate.weight"].t()
    if local == "experts.down.weight":
        return grads[to + "mlp.experts.down_proj"].transpose(1, 2)
    gate, up = torch.chunk(grads[to + "mlp.experts.gate_up_proj"].transpose(1, 2), 2, dim=2)
    return gate if local == "experts.gate.weight" else up


@pytest.mark.slow
@pytest.mark.parametrize("mesh, m", [("", 1), ("tp = 2; pp = 2", 2)],
                         ids=["1-rank", "tp2-pp2"])
def test_loss_and_every_gradient_equal_mixtral(mesh, m, tmp_path, capfd):
    """One SGD step of learning rate 1000 turns the run's checkpoint into its gradients."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    from planc.runtime.engine.data import batch_tokens
    from planc.runtime.oracle.reference import initial, parameters

    text = plan_text(mesh=mesh, m=m, steps=1,
                     optimizer=f"sgd(lr = {LR}, momentum = 0, weight_decay = 0)")
    plan = load_text(text).plan
    planc_loss, final = trained_one_step(text, tmp_path, capfd)

    model = _mixtral(plan)
    tokens = batch_tokens(plan, 0)
    logits = model(input_ids=tokens[:, :-1]).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, plan.model.vocab).float(),
                                             tokens[:, 1:].reshape(-1))
    loss.backward()
    assert planc_loss == pytest.approx(loss.item(), rel=1e-5)

    assert len(final) == len(parameters(plan)) == 3 * 10 + 3

    def layer_of(name):
        _, layer, local = name.split(".", 2)
        return int(layer), local

    for name, param in parameters(plan).items():
        planc_grad = (initial(plan, name, param.shape).double() - final[name].double()) / LR
        torch.testing.assert_close(planc_grad.float(), _mixtral_gradient(model, name, layer_of),
                                   rtol=2e-4, atol=2e-7,
                                   msg=lambda text, n=name: f"{n}: {text}")


# --- every layout computes what one process computes ---------------------------------------

MATRIX = {
    "tp2-sp": dict(mesh="tp = 2", shard="tp { sequence_parallel = on }"),
    "tp2-pp2-dp2-zero1-shared-dense": dict(mesh="tp = 2; pp = 2; dp = 2", m=2, shared=1,
                                           dense=1, shard="dp { zero = 1 }"),
    "dp2-zero3": dict(mesh="dp = 2", shard="dp { zero = 3 }", m=2),
    "cp2-ring": dict(mesh="cp = 2", shard="cp { attention = ring }"),
    "pp2-zbv": dict(mesh="pp = 2", layers=4, m=4, shard="pp { virtual = 2 }",
                    schedule="; pipeline = zbv"),
    "dp2-zero2-first-dense-2": dict(mesh="dp = 2", shard="dp { zero = 2 }", dense=2, m=2),
    # the balance loss: its gradient joins each mixture's backward (the run's reported
    # loss is the cross-entropy, as the reference's); over tp the mixture runs on its
    # share, the counts of each sequence summed over its tp x cp ranks
    "aux-loss-tp2-sp-pp2-dp2-zero2": dict(mesh="tp = 2; pp = 2; dp = 2", m=2, shared=1,
                                          dense=1, extra="; aux_loss = 0.5",
                                          shard="tp { sequence_parallel = on }; "
                                                "dp { zero = 2 }"),
    "aux-loss-dp2-recompute": dict(mesh="dp = 2", m=2, extra="; aux_loss = 0.1",
                                   optimize="recompute = full"),
    # expert parallelism: each rank runs experts / ep of the experts on the tokens its ep
    # group dispatches to it, the ep ranks drawn from tp x cp x dp, fastest first
    "ep2-over-tp2-sp": dict(mesh="tp = 2; ep = 2", shared=1,
                            shard="tp { sequence_parallel = on }"),
    "ep4-over-tp2-dp2-zero1-dense": dict(mesh="tp = 2; dp = 2; ep = 4", m=2, dense=1,
                                         shard="dp { zero = 1 }"),
    "ep2-over-dp2-pp2-zero3": dict(mesh="pp = 2; dp = 2; ep = 2", m=2, dense=1,
                                   shard="dp { zero = 3 }"),
    "ep8-over-tp2-cp2-dp2-ring": dict(mesh="tp = 2; cp = 2; dp = 2; ep = 8", m=2, experts=8,
                                      shard="cp { attention = ring }"),
    "ep2-over-dp2-aux-loss": dict(mesh="dp = 2; ep = 2", m=2, extra="; aux_loss = 0.1"),
    # the experts' SwiGLU product computed again in the backward (Megatron-Core's moe_act)
    "ep2-over-tp2-sp-recompute-moe-activation": dict(
        mesh="tp = 2; ep = 2", m=2, shared=1, shard="tp { sequence_parallel = on }",
        optimize="recompute_moe_activation = on"),
    # each expert on 2 ranks (edp 2): its gradient reduced, and sharded, over them
    "ep2-over-tp2-dp2-zero3-edp2": dict(mesh="tp = 2; dp = 2; ep = 2", m=2, shared=1,
                                        shard="tp { sequence_parallel = on }; "
                                              "dp { zero = 3 }"),
    "ep2-over-cp2-dp2-zero1-edp2": dict(mesh="cp = 2; dp = 2; ep = 2", m=2,
                                        shard="cp { attention = ring }; dp { zero = 1 }"),
    "ep2-over-dp4-zero2-edp2": dict(mesh="dp = 4; ep = 2", dense=1,
                                    shard="dp { zero = 2 }"),
    "aux-loss-cp2-ring": dict(mesh="cp = 2", m=2, shared=1, extra="; aux_loss = 0.5",
                              shard="cp { attention = ring }"),
    "aux-loss-cp2-allgather-recompute": dict(mesh="cp = 2", m=2, extra="; aux_loss = 0.5",
                                             shard="cp { attention = allgather }",
                                             optimize="recompute = full"),
    "aux-loss-tp2-sp": dict(mesh="tp = 2", dense=1, extra="; aux_loss = 0.5",
                            shard="tp { sequence_parallel = on }"),
    "aux-loss-ep2-over-tp2": dict(mesh="tp = 2; ep = 2", m=2, extra="; aux_loss = 0.5",
                                  shard="tp { sequence_parallel = off }"),
    "aux-loss-ep4-over-tp2-cp2-ring": dict(mesh="tp = 2; cp = 2; ep = 4", m=2,
                                           extra="; aux_loss = 0.5",
                                           shard="tp { sequence_parallel = on }; "
                                                 "cp { attention = ring }"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MATRIX))
def test_every_moe_plan_trains_exactly_like_one_process(name, tmp_path, capfd):
    pytest.importorskip("torch")
    source = tmp_path / "moe.plan"
    source.write_text(plan_text(name, **MATRIX[name]))
    status = main(["run", str(source), "-o", str(tmp_path / "build"), "--check",
                   "--backend", "gloo"])
    err = capfd.readouterr().err
    assert status == 0, err
    assert "every loss and parameter matches" in err


# A mixture over ep whose all-to-alls run inside its step keeps its backward whole: its
# experts' weight gradients are reached only back through the combine's all-to-all, so a
# weight step of their own (weight_grad_overlap under 1F1B, every zero-bubble schedule)
# issued that all-to-all again, and not at all on a rank whose experts got no rows that
# microbatch: this plan's third step (seed 7) hung with rank 1 in W/L2/moe and rank 0 in
# a tp all-reduce. A run of random plans found it.
NO_ROWS = """plan no_rows {
  model moe { layers = 3; hidden = 32; heads = 4; vocab = 128; seq = 16; batch = 4
              experts = 4; top_k = 1; expert_ffn = 24; first_dense = 1; ffn = 64 }
  mesh { tp = 2; ep = 2 }
  schedule { microbatches = 2 }
  train { steps = 3; optimizer = adamw(lr = 0.01); seed = 7 }
}
"""


@pytest.mark.parametrize("mesh,pipeline", [("tp = 2; ep = 2", "1f1b"),
                                           ("pp = 2; dp = 2; ep = 2", "zb1p")])
def test_a_mixture_over_ep_keeps_its_backward_whole(mesh, pipeline):
    from planc.compile import compile_plan

    text = NO_ROWS.replace("microbatches = 2", f"microbatches = 2; pipeline = {pipeline}"
                           ).replace("tp = 2; ep = 2", mesh)
    loaded = load_text(text)
    assert loaded.ok, [d.message for d in loaded.diagnostics]
    graph = compile_plan(loaded.plan).graph
    weights = sorted(n for n, d in graph.nodes(data=True) if d.get("weight_grad_of"))
    assert not [n for n in weights if n.endswith("/moe")]
    assert "W/L0/fc1" in weights  # the dense layer's are split as before


def test_a_rank_whose_experts_get_no_rows_trains_exactly_like_one_process(tmp_path, capfd):
    pytest.importorskip("torch")
    source = tmp_path / "no_rows.plan"
    source.write_text(NO_ROWS)
    status = main(["run", str(source), "-o", str(tmp_path / "build"), "--check",
                   "--backend", "gloo", "--timeout", "60"])
    err = capfd.readouterr().err
    assert status == 0, err
    assert "every loss and parameter matches" in err


# --- the verifier proves the mixtures' all-to-alls match -----------------------------------

def _moe_build():
    from planc.compile import compile_plan

    return compile_plan(load_text(plan_text(mesh="dp = 2; ep = 2", m=2, batch=8)).plan)


def test_mixtures_out_of_order_on_one_ep_rank_are_refused():
    """Rank 1 runs its two mixtures' forwards in the other order: its ep group's
    all-to-alls would pair layer 0's rows with layer 1's."""
    from tests.test_lower import _split_rank, problems

    build = _moe_build()
    assert problems(build) == []

    def swap(data):
        block = data["blocks"]["F0"]
        first, second = [i for i, x in enumerate(block) if x.get("node", "").endswith("/moe")
                         ][:2]
        block[first], block[second] = block[second], block[first]

    programs, table = _split_rank(build, 1, swap)
    found = [p for p in problems(build, programs, table) if p.startswith("ep group")]
    assert found == ["ep group [0, 1]: collective 1 on this group is compute F/L0/moe "
                     "(microbatch 0) on rank 0 but compute F/L1/moe (microbatch 0) on rank 1: "
                     "the group would deadlock or mix up data"]


def test_mixtures_on_two_streams_are_refused():
    from tests.test_lower import _replace_program, problems

    build = _moe_build()
    (name,) = build.programs

    def move(data):
        for item in data["blocks"]["B0"]:
            if item.get("node") == "B/L2/moe":
                item["stream"] = "comm"

    found = [p for p in problems(build, _replace_program(build, name, move))
             if "ep group is used from" in p]
    assert found == [f"program {name}: the ep group is used from streams ['comm', "
                     "'compute']; its all-to-alls must leave from one stream in program "
                     "order, or two ranks could wait in different all-to-alls"]


def test_a_routing_weight_inside_the_swiglu_gives_the_weighted_outputs_gradients():
    """The routing weight is applied inside an expert's SwiGLU, before its down
    projection (Megatron-Core's weighted SwiGLU), so that no expert output is kept for
    the weight's gradient: the output and every gradient (rows, gate, up, down and the
    weights) equal autograd's of the weighted output, ((silu(x g) * x u) d) w, to
    float64's rounding; keeping gate, up and the weights alone, not silu(gate)."""
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F

    from planc.runtime.families.moe_dispatch import expert_mlp

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(7, 16, generator=generator, dtype=torch.float64, requires_grad=True)
    gate, up = (torch.randn(16, 24, generator=generator, dtype=torch.float64,
                            requires_grad=True) for _ in range(2))
    down = torch.randn(24, 16, generator=generator, dtype=torch.float64, requires_grad=True)
    weights = torch.rand(7, 1, generator=generator, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(7, 16, generator=generator, dtype=torch.float64)
    inside = expert_mlp(x, gate, up, down, None, weights)
    outside = ((F.silu(x @ gate) * (x @ up)) @ down) * weights
    assert (inside - outside).abs().max() < 1e-12
    swiglu = next(node for node, _ in inside.grad_fn.next_functions  # the down's input
                  if node is not None and "SiluTimes" in node.name())
    assert [tuple(t.shape) for t in swiglu.saved_tensors] == [(7, 24), (7, 24), (7, 1)]
    leaves = (x, gate, up, down, weights)
    for ours, theirs in zip(torch.autograd.grad(inside, leaves, grad),
                            torch.autograd.grad(outside, leaves, grad)):
        assert (ours - theirs).abs().max() < 1e-12


def test_an_experts_output_is_written_into_its_rows_keeping_only_their_indices():
    """Each expert's outputs are written over their rows of the experts piece's output
    (copied_by_row): the same bits forward and backward as autograd's index_copy, which
    keeps each expert's hidden-wide outputs for their shape alone; this keeps the rows'
    indices."""
    torch = pytest.importorskip("torch")

    from planc.runtime.families.moe_dispatch import copied_by_row

    generator = torch.Generator().manual_seed(1)
    into = torch.randn(10, 6, generator=generator, requires_grad=True)
    values = torch.randn(4, 6, generator=generator, requires_grad=True)
    rows, grad = torch.tensor([7, 1, 3, 8]), torch.randn(10, 6, generator=generator)
    ours, theirs = copied_by_row(into, rows, values), into.index_copy(0, rows, values)
    assert torch.equal(ours, theirs)
    assert [tuple(t.shape) for t in ours.grad_fn.saved_tensors] == [(4,)]
    for a, b in zip(torch.autograd.grad(ours, (into, values), grad),
                    torch.autograd.grad(theirs, (into, values), grad)):
        assert torch.equal(a, b)


def test_a_ranks_experts_gradients_are_stacked_once_not_zero_filled_per_expert():
    """The experts' stacked weights are taken as slices (Experts.slices): their
    backward stacks the slices' gradients once per weight (3 stacks), where indexing per
    expert returns a whole zero-filled gradient for each of the 4 experts and adds them
    (12 select_backward, 9 adds); the same gradients."""
    torch = pytest.importorskip("torch")

    from planc.runtime.families.moe_dispatch import expert_mlp, stacked_experts
    from tests.conftest import counting

    generator = torch.Generator().manual_seed(2)
    stacked = {f"experts.{w}.weight": torch.randn(
        4, *((16, 24) if w != "down" else (24, 16)), generator=generator, requires_grad=True)
        for w in ("gate", "up", "down")}
    rows = [torch.randn(3, 16, generator=generator) for _ in range(4)]

    def output(weights):
        return sum(expert_mlp(rows[e], *(w[e] for w in weights)).sum() for e in range(4))

    whole = tuple(stacked.values())
    indexed = torch.autograd.grad(output(whole), whole)
    sliced = output(stacked_experts(stacked.__getitem__).slices())
    ops = torch.ops.aten
    with counting(ops.stack.default) as stacks, \
            counting(ops.select_backward.default) as selects:
        grads = torch.autograd.grad(sliced, whole)
    assert (stacks.count, selects.count) == (3, 0)
    assert all(torch.equal(a, b) for a, b in zip(grads, indexed))


def test_a_ranks_rows_go_through_their_experts_sorted_once():
    """The rows a rank's experts run (4 experts, one of them without rows) are gathered
    in expert order once, each expert runs on its slice, and the outputs are written back
    once (through_experts): one gather of the rows and one of their scales, one
    index_copy, and in the backward one index_fill and two index_puts, where taking each
    expert's rows by index did all of it per expert; what that loop computes, forward
    and backward, to the rounding of the SwiGLU's exp."""
    torch = pytest.importorskip("torch")

    from planc.runtime.families.moe_dispatch import (copied_by_row, expert_mlp,
                                                     stacked_experts, through_experts)
    from tests.conftest import counting

    generator = torch.Generator().manual_seed(3)
    stacked = {f"experts.{w}.weight": torch.randn(
        4, *((16, 24) if w != "down" else (24, 16)), generator=generator, requires_grad=True)
        for w in ("gate", "up", "down")}
    rows = torch.randn(10, 16, generator=generator, requires_grad=True)
    scales = torch.rand(10, 1, generator=generator, requires_grad=True)
    expert_of = torch.tensor([2, 0, 2, 1, 0, 2, 0, 1, 2, 0])
    grad = torch.randn(10, 16, generator=generator)
    leaves = (rows, scales, *stacked.values())
    experts = stacked_experts(stacked.__getitem__)
    weights = experts.slices()
    by_index = rows * 0
    for expert in range(4):
        mine = (expert_of == expert).nonzero(as_tuple=True)[0]
        if mine.numel():
            by_index = copied_by_row(by_index, mine, expert_mlp(
                rows[mine], *(w[expert] for w in weights), scale=scales[mine]))
    ops = torch.ops.aten
    with counting(ops.index.Tensor) as gathers, counting(ops.index_copy.default) as copies:
        sorted_once = through_experts(rows * 0, rows, scales, expert_of, 4, experts)
    assert (gathers.count, copies.count) == (2, 1)
    # the SwiGLU's exp over all the rows at once, not expert by expert: its vectorised
    # loop leaves other elements to its scalar tail, which rounds otherwise
    torch.testing.assert_close(sorted_once, by_index, rtol=1e-6, atol=1e-5)
    expected = torch.autograd.grad(by_index, leaves, grad)
    with counting(ops.index_fill.int_Scalar) as fills, \
            counting(ops.index_put.default) as puts:
        got = torch.autograd.grad(sorted_once, leaves, grad)
    assert (fills.count, puts.count) == (1, 2)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("dtype,hidden,grouped", [
    ("float32", 16, 3), ("bfloat16", 16, 3), ("float32", 6, 0), ("bfloat16", 4, 0)])
def test_a_ranks_experts_run_as_three_grouped_gemms_where_the_widths_allow(
        dtype, hidden, grouped):
    """4 experts (one without rows) on 10 rows: where every row of the rows and weights
    is a multiple of 16 bytes (``torch._grouped_mm``'s stride check), the forward runs
    the three GEMMs as one grouped GEMM each over all the experts; elsewhere (6 fp32
    features, 4 bf16), and with a stack of weights that is not contiguous, a GEMM an
    expert. The same bits either way, forward and every gradient."""
    torch = pytest.importorskip("torch")

    from planc.runtime.families.moe_dispatch import Experts, through_experts
    from tests.conftest import counting

    kind = getattr(torch, dtype)
    generator = torch.Generator().manual_seed(5)
    stacked = [torch.randn(4, *shape, generator=generator).to(kind).requires_grad_()
               for shape in ((hidden, 24), (hidden, 24), (24, hidden))]
    rows = torch.randn(10, hidden, generator=generator).to(kind).requires_grad_()
    scales = torch.rand(10, 1, generator=generator).to(kind).requires_grad_()
    expert_of = torch.tensor([2, 0, 2, 1, 0, 2, 0, 1, 2, 0])
    grad = torch.randn(10, hidden, generator=generator).to(kind)
    # the same weights an expert's matrix apart in memory: each expert's contiguous as
    # before, the stack not
    spaced = [torch.stack([w.detach(), torch.zeros_like(w)], dim=1)[:, 0].requires_grad_()
              for w in stacked]
    results = []
    for weights, calls in ((stacked, grouped), (spaced, 0)):
        with counting(torch.ops.aten._grouped_mm.default) as counted:
            out = through_experts(rows * 0, rows, scales, expert_of, 4, Experts(*weights))
        assert counted.count == calls
        results.append((out, *torch.autograd.grad(out, (rows, scales, *weights), grad)))
    assert all(torch.equal(a, b) for a, b in zip(*results))


def _hopper():
    torch = pytest.importorskip("torch")
    return torch.cuda.is_available() and torch.cuda.get_device_capability(0)[0] in (9, 10)


def test_on_a_hopper_gpu_the_experts_grouped_gemm_computes_what_their_loop_computes():
    """On a GPU of compute capability 9 or 10, in bf16, a rank's 8 experts (one without
    rows) on 300 rows 256 wide run as three grouped GEMMs (one ``torch._grouped_mm`` each,
    CUTLASS's kernel), and compute what a GEMM an expert computes (a stack that is not
    contiguous takes that loop), forward and every gradient, to bf16's rounding of
    sums over 256 and 512 products."""
    if not _hopper():
        pytest.skip("needs a CUDA GPU of compute capability 9 or 10 (grouped GEMMs)")
    import torch

    from planc.runtime.families.moe_dispatch import Experts, through_experts
    from tests.conftest import counting

    generator = torch.Generator().manual_seed(6)
    kind, device = torch.bfloat16, torch.device("cuda")

    def made(*shape):
        return (torch.randn(*shape, generator=generator) / shape[-2] ** 0.5).to(
            device, kind).requires_grad_()

    stacked = [made(8, 256, 512), made(8, 256, 512), made(8, 512, 256)]
    spaced = [torch.stack([w.detach(), torch.zeros_like(w)], dim=1)[:, 0].requires_grad_()
              for w in stacked]
    rows, grad = made(300, 256), made(300, 256).detach()
    scales = torch.rand(300, 1, generator=generator).to(device, kind).requires_grad_()
    expert_of = torch.randint(0, 7, (300,), generator=generator).to(device)
    results = []
    for weights, calls in ((stacked, 3), (spaced, 0)):
        with counting(torch.ops.aten._grouped_mm.default) as counted:
            out = through_experts(rows * 0, rows, scales, expert_of, 8, Experts(*weights))
        assert counted.count == calls
        results.append((out, *torch.autograd.grad(out, (rows, scales, *weights), grad)))
    for ours, loop in zip(*results):
        torch.testing.assert_close(ours.float(), loop.float(), rtol=2e-2, atol=2e-2)
