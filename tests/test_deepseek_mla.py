"""The deepseek family (issue 40): multi-head latent attention checked against
transformers' ``DeepseekV3Attention`` on the same weights, the published model's sizes
from its preset, its checks, and training under pp, dp and ep with --check."""

from __future__ import annotations

import pytest

from planc.cli import main
from planc.lang import load_text
from planc.models import FAMILIES

PLAN = """plan ds {
  model deepseek {
    layers = 3; hidden = 64; heads = 4; vocab = 128; seq = 32; batch = 8
    q_rank = 48; kv_rank = 32; nope_dim = 16; rope_dim = 8; v_dim = 24
    experts = 8; top_k = 2; expert_ffn = 48; shared_experts = 1; first_dense = 1; ffn = 128
    score = sigmoid; routed_scale = 2.5; bias_update = 0.001 EXTRA
  }
  mesh { MESH }
  schedule { microbatches = 2 }
  train { steps = 3; optimizer = adamw(lr = 1e-3, weight_decay = 0.01); seed = 0 }
}
"""


def plan_text(mesh: str = "pp = 2; dp = 2; ep = 2", extra: str = "") -> str:
    return PLAN.replace("MESH", mesh).replace("EXTRA", extra)


def test_the_published_sizes_give_671b_parameters_and_37b_active():
    """DeepSeek-V3's report (arXiv 2412.19437, section 1): 671B parameters, 37B active
    per token, its multi-token-prediction module aside; the active ones counted without
    the input embedding's table, which a token only looks up (37.55B with it)."""
    m = load_text("plan p { model deepseek { preset = deepseek-v3; batch = 1 } }").plan.model
    family = FAMILIES["deepseek"]
    params = family.all_parameters(m)
    total = sum(p.numel for p in params)
    routed = sum(p.numel for p in params if p.dims[:1] == ("experts",))
    active = total - routed * (1 - m.top_k / m.experts) - m.vocab * m.hidden
    assert (round(total / 1e9), round(active / 1e9, 1)) == (671, 36.6)
    attention = [p for p in params if p.layer == 5 and "." in p.name and
                 p.name.split(".", 2)[-1] in ("q_a.weight", "ln_q.weight", "q_b.weight",
                                               "kv_a.weight", "ln_kv.weight", "kv_b.weight",
                                               "o.weight")]
    assert {p.name.split(".", 2)[-1]: p.shape for p in attention} == {
        "q_a.weight": (7168, 1536), "ln_q.weight": (1536,), "q_b.weight": (1536, 128 * 192),
        "kv_a.weight": (7168, 576), "ln_kv.weight": (512,), "kv_b.weight": (512, 128 * 256),
        "o.weight": (128 * 128, 7168)}


def test_mla_splits_its_heads_over_tp():
    """Over tp each rank makes its own heads from the whole latents, as Megatron-Core's
    multi-latent attention does: q_b and kv_b split by heads, the down-projections and
    the latents' norms whole on every rank with their gradients summed over tp; the
    attention takes the rank's heads, o reads them."""
    from planc.estimate.kernel_cost import KernelModel
    from planc.estimate.memory import layer_parameters
    from planc.graph.sharding import P, R, S
    from planc.graph.derive import derive
    from planc.graph.tensor_parallel import plan_tensor_parallel

    plan = load_text(plan_text("tp = 2; dp = 2; ep = 2").replace(
        "  mesh {", "  topology { preset = dgx-h100; devices_per_node = 4 }\n  mesh {")).plan
    ops = plan_tensor_parallel(plan).ops
    qkv = ops["qkv"]
    assert (qkv.input, qkv.output, qkv.grad_input) == (R, S("qkv"), P)
    assert {u.name: (u.storage, u.local_gradient()) for u in qkv.params} == {
        "q_a.weight": (R, P), "ln_q.weight": (R, P), "q_b.weight": (S("q"), S("q")),
        "kv_a.weight": (R, P), "ln_kv.weight": (R, P), "kv_b.weight": (S("kv"), S("kv"))}
    assert (ops["attention"].input, ops["proj"].input) == (S("qkv"), S("hidden"))
    # the dense block on one of 2 ranks: q_b, kv_b, o and the MLP halved, the rest whole
    whole = layer_parameters(load_text(plan_text("dp = 4; ep = 2")).plan, 0)
    halved = 48 * 96 + 32 * 160 + 96 * 64 + 3 * 64 * 128
    assert layer_parameters(plan, 0) == whole - halved // 2
    # the kernel model prices W_qa and W_kva whole, W_qb and W_kvb on 2 of the 4 heads
    gemms = KernelModel.of(plan).features["qkv"]
    assert gemms == ((48, 64), (2 * 24, 48), (40, 64), (2 * 40, 32))
    # and the graph's qkv on one rank: those GEMMs, both latents' norms, the rotation of
    # the rank's 2 heads' and the shared key's rope_dim features; 2 x 32 tokens
    flops = derive(plan).nodes["F/L1/qkv"]["flops"]
    assert flops == 2 * 32 * (2 * (48 * 64 + 48 * 48 + 40 * 64 + 80 * 32) + 4 * (48 + 32)
                              + 3 * (2 + 1) * 8)


def test_an_fp8_shard_of_mlas_heads_must_hold_whole_tiles(tmp_path, capsys):
    path = tmp_path / "fp8.plan"
    path.write_text(plan_text("tp = 2; dp = 2; ep = 2", "; fp8 = blockwise; fp8_tile = 32"))
    assert main(["check", str(path)]) == 1
    assert ("error: fp8 scales tiles of 32 features, but a tp rank holds 48 of the "
            "features of q (tp = 2): a shard must hold whole tiles to quantise as one "
            "process does") in capsys.readouterr().err


def test_the_settings_show_mlas_widths_and_no_head_dim():
    from planc.views.plan_summary import settings

    text = settings(load_text(plan_text()).plan)
    assert "model deepseek  layers 3, hidden 64, heads 4, q_rank 48, kv_rank 32, nope_dim " \
        "16, rope_dim 8, v_dim 24, experts 8," in text


def test_an_odd_rope_dim_is_refused(tmp_path, capsys):
    path = tmp_path / "odd.plan"
    path.write_text(plan_text().replace("rope_dim = 8", "rope_dim = 7"))
    assert main(["check", str(path)]) == 1
    assert "rope_dim (7) is odd; rotary embedding turns pairs of features" in \
        capsys.readouterr().err


@pytest.mark.parametrize("recompute,again", [
    ("selective", ["attention"]), ("attention_inputs", ["ln1", "qkv", "attention"])])
def test_attention_inputs_recomputes_the_operators_up_to_the_attention(recompute, again):
    from planc.graph.derive import derive

    text = plan_text("dp = 2; ep = 2").replace("  train {", f"  optimize {{ recompute = "
                                                             f"{recompute} }}\n  train {{")
    graph = derive(load_text(text).plan)
    recomputed = sorted(n for n in graph if n.startswith("R/"))
    assert recomputed == sorted(f"R/L{layer}/{op}" for layer in range(3) for op in again)


def test_attention_inputs_keeps_the_attentions_output_alone():
    """Of llama's attention, recompute = attention_inputs keeps o's input: selective's
    count less the first norm's output (qkv's GEMM input) and q, k and v."""
    m = load_text("plan p { model llama { preset = llama3-8b; batch = 1 } }").plan.model
    llama = FAMILIES["llama"]
    sizes = dict(seq=8192, seq_full=8192, batch=1, tp=1, sequence_parallel=False)
    selective = llama.activation_bytes(m, recompute="selective", **sizes)
    inputs = llama.activation_bytes(m, recompute="attention_inputs", **sizes)
    assert selective - inputs == 8192 * (4096 + (32 + 2 * 8) * 128) * 2
    ds = load_text("plan p { model deepseek { preset = deepseek-v3; batch = 1 } }").plan.model
    deepseek = FAMILIES["deepseek"]
    sizes["seq"] = sizes["seq_full"] = 4096
    kept = deepseek.activation_bytes(ds, recompute="attention_inputs", **sizes)
    whole = deepseek.activation_bytes(ds, recompute="selective", **sizes)
    # the latents before and after their norms, the first norm's output, q, k and v
    assert whole - kept == 4096 * 2 * (1536 + 512 + 64 + 128 * (2 * 192 + 128) + 1536 + 512
                                       + 7168)


torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def transformers_attention(m, weights: dict):
    """transformers' DeepseekV3Attention of ``m``'s sizes holding planc's ``weights``
    (planc stores x @ W: (in, out); torch's Linear holds (out, in)), and its rotary
    embedding."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3Attention, DeepseekV3RotaryEmbedding)

    o = m.options
    config = transformers.DeepseekV3Config(
        hidden_size=m.hidden, num_attention_heads=m.heads, num_key_value_heads=m.heads,
        q_lora_rank=o["q_rank"], kv_lora_rank=o["kv_rank"], qk_nope_head_dim=o["nope_dim"],
        qk_rope_head_dim=o["rope_dim"], v_head_dim=o["v_dim"], rms_norm_eps=m.norm_eps,
        rope_theta=m.rope_theta, rope_interleave=True, attention_bias=False)
    config._attn_implementation = "eager"
    module = DeepseekV3Attention(config, layer_idx=0).float()
    pairs = {"q_a_proj": "q_a.weight", "q_b_proj": "q_b.weight",
             "kv_a_proj_with_mqa": "kv_a.weight", "kv_b_proj": "kv_b.weight",
             "o_proj": "o.weight"}
    with torch.no_grad():
        for theirs, ours in pairs.items():
            getattr(module, theirs).weight.copy_(weights[ours].T)
        module.q_a_layernorm.weight.copy_(weights["ln_q.weight"])
        module.kv_a_layernorm.weight.copy_(weights["ln_kv.weight"])
    return module, DeepseekV3RotaryEmbedding(config)


def rotate_half(x, cos, sin):
    """llama's RoPE layout (features i and i + d/2 turn together), with ``cos`` and ``sin``
    of one angle a pair: what DeepSeek's interleaved layout is not."""
    half = x.shape[-1] // 2
    turned = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * torch.cat([cos, cos], dim=-1) + turned * torch.cat([sin, sin], dim=-1)


@pytest.mark.parametrize("positions", ["from 0", "from 5"])
def test_latent_attention_is_transformers_deepseek_v3_attention(positions, monkeypatch):
    """planc's qkv and attention kernels' arithmetic (latent_heads, then causal attention
    and o) on transformers' DeepseekV3Attention's weights, at positions that start at 0
    and at 5 (RoPE's angles differ)."""
    from planc.runtime.families import deepseek

    m = load_text(plan_text()).plan.model
    generator = torch.Generator().manual_seed(4)
    shapes = {p.name.split(".", 2)[-1]: p.shape for p in
              FAMILIES["deepseek"].layer_parameters(m, 0)}
    weights = {name: torch.randn(shapes[name], generator=generator) * 0.2 for name in
               ("q_a.weight", "q_b.weight", "kv_a.weight", "kv_b.weight", "o.weight")}
    for norm in ("ln_q.weight", "ln_kv.weight"):
        weights[norm] = 1 + 0.1 * torch.randn(shapes[norm], generator=generator)
    h = torch.randn(2, 10, m.hidden, generator=generator)
    start = 0 if positions == "from 0" else 5
    at = torch.arange(start, start + 10)
    module, rotary = transformers_attention(m, weights)
    cos, sin = rotary(h, at[None, :])
    mask = torch.full((10, 10), float("-inf")).triu(1)[None, None]
    theirs, _ = module(h, (cos, sin), mask)

    def ours():
        q, key, v = deepseek._split_heads(m, deepseek.latent_heads(
            m, h, weights.__getitem__, at, None))
        context = torch.nn.functional.scaled_dot_product_attention(
            q, key, v, is_causal=True,
            scale=(m.options["nope_dim"] + m.options["rope_dim"]) ** -0.5)
        return context.transpose(1, 2).reshape(2, 10, -1) @ weights["o.weight"]

    # fp32 sums in another order (eager softmax against SDPA): within 1e-5 of the scale
    assert (ours() - theirs).abs().max() <= 1e-5 * theirs.abs().max()
    monkeypatch.setattr(deepseek, "interleaved_rope", rotate_half)  # llama's layout
    assert (ours() - theirs).abs().max() > 1e-2 * theirs.abs().max()


def transformers_model(m, weights: dict):
    """transformers' DeepseekV3ForCausalLM of ``m``'s sizes holding planc's ``weights``
    (full planc names; each projection transposed, a block's experts' gate and up fused)."""
    o = m.options
    config = transformers.DeepseekV3Config(
        vocab_size=m.vocab, hidden_size=m.hidden, intermediate_size=m.ffn,
        moe_intermediate_size=o["expert_ffn"], num_hidden_layers=m.layers,
        num_attention_heads=m.heads, num_key_value_heads=m.heads,
        n_shared_experts=o["shared_experts"], n_routed_experts=o["experts"],
        num_experts_per_tok=o["top_k"], first_k_dense_replace=o["first_dense"],
        n_group=1, topk_group=1, q_lora_rank=o["q_rank"], kv_lora_rank=o["kv_rank"],
        qk_nope_head_dim=o["nope_dim"], qk_rope_head_dim=o["rope_dim"],
        v_head_dim=o["v_dim"], routed_scaling_factor=o["routed_scale"], norm_topk_prob=True,
        rms_norm_eps=m.norm_eps, rope_theta=m.rope_theta, rope_interleave=True,
        tie_word_embeddings=False, max_position_embeddings=m.seq, hidden_act="silu")
    config._attn_implementation = "eager"
    model = transformers.DeepseekV3ForCausalLM(config).float()
    names = {"self_attn.q_a_proj": "q_a", "self_attn.q_b_proj": "q_b",
             "self_attn.kv_a_proj_with_mqa": "kv_a", "self_attn.kv_b_proj": "kv_b",
             "self_attn.o_proj": "o", "mlp.gate_proj": "gate", "mlp.up_proj": "up",
             "mlp.down_proj": "down", "mlp.gate": "router",
             "mlp.shared_experts.gate_proj": "shared.gate",
             "mlp.shared_experts.up_proj": "shared.up",
             "mlp.shared_experts.down_proj": "shared.down"}
    norms = {"input_layernorm": "ln1", "post_attention_layernorm": "ln2",
             "self_attn.q_a_layernorm": "ln_q", "self_attn.kv_a_layernorm": "ln_kv"}
    state = {"model.embed_tokens.weight": weights["embedding.weight"],
             "model.norm.weight": weights["final_ln.weight"],
             "lm_head.weight": weights["head.weight"].T}
    for layer in range(m.layers):
        ours = lambda name: weights.get(f"layers.{layer}.{name}.weight")  # noqa: E731
        at = f"model.layers.{layer}."
        for theirs, name in names.items():
            if ours(name) is not None:
                state[at + theirs + ".weight"] = ours(name).T
        for theirs, name in norms.items():
            state[at + theirs + ".weight"] = ours(name)
        if ours("experts.gate") is not None:
            state[at + "mlp.experts.gate_up_proj"] = torch.cat(
                [ours("experts.gate"), ours("experts.up")], dim=2).transpose(1, 2)
            state[at + "mlp.experts.down_proj"] = ours("experts.down").transpose(1, 2)
            state[at + "mlp.gate.e_score_correction_bias"] = torch.zeros(o["experts"])
    model.load_state_dict(state, strict=True)
    return model


def test_the_whole_model_is_transformers_deepseek_v3():
    """planc's reference loss of the deepseek family, on weights drawn as planc's are, is
    transformers' DeepseekV3ForCausalLM's cross-entropy on the same weights and tokens:
    MLA, the dense first block, the sigmoid gate with its routed scale, the routed and
    shared experts, the final norm and the head."""
    from planc.runtime.oracle.reference import forward_loss, initial_values

    plan = load_text(plan_text().replace("; bias_update = 0.001", "")).plan
    # planc's initial weights, spread 8 times wider so that every part moves the loss
    weights = {name: (value - value.mean()) * 8 + value.mean()
               for name, value in initial_values(plan).items()}
    tokens = torch.randint(0, plan.model.vocab, (2, plan.model.seq + 1),
                           generator=torch.Generator().manual_seed(5))
    ours = forward_loss(plan, weights, tokens)
    model = transformers_model(plan.model, weights)
    logits = model(input_ids=tokens[:, :-1]).logits
    theirs = torch.nn.functional.cross_entropy(logits.reshape(-1, plan.model.vocab),
                                               tokens[:, 1:].reshape(-1))
    assert abs(ours.item() - theirs.item()) <= 1e-5 * theirs.item(), (ours, theirs)


@pytest.mark.parametrize("mesh,extra,recompute", [
    ("pp = 2; dp = 2; ep = 2", "", "none"),
    ("pp = 2; dp = 2; ep = 2", "", "attention_inputs"),
    ("dp = 4; ep = 4", "; fp8 = blockwise; fp8_tile = 8", "none"),
    # k and v (narrower) travel together: gathered, or around the ring (load-balanced)
    ("cp = 2; dp = 2; ep = 4", "", "none"),
    ("cp = 2; dp = 2; ep = 4", "", "attention_inputs"),
    # the heads split over tp: with sequence parallelism, under pp; with cp's ring; fp8
    ("tp = 2; pp = 2; dp = 2; ep = 2", "", "none"),
    ("tp = 2; cp = 2; dp = 2; ep = 4", "", "attention_inputs"),
    ("tp = 2; dp = 2; ep = 2", "; fp8 = blockwise; fp8_tile = 8", "none"),
])
def test_training_matches_the_reference(tmp_path, capsys, mesh, extra, recompute):
    text = plan_text(mesh, extra)
    shard = []
    if recompute == "attention_inputs" and "cp" in mesh:
        shard.append("cp { attention = ring }")
    if "pp" in mesh and "tp" in mesh:
        shard.append("tp { sequence_parallel = on }")
    if shard:
        text = text.replace("  schedule {", f"  shard {{ {'; '.join(shard)} }}\n  schedule {{")
    (tmp_path / "ds.plan").write_text(text)
    assert main(["run", str(tmp_path / "ds.plan"), "-o", str(tmp_path / "b"), "--check",
                 "--set", f"optimize.recompute={recompute}"]) == 0
    err = capsys.readouterr().err
    assert "every loss and parameter matches" in err or \
        (extra and "every loss matches" in err), err


DEEPSEEK = ("; q_rank = 16; kv_rank = 8; nope_dim = 4; rope_dim = 4; v_dim = 8; experts = 4"
            "; top_k = 2; expert_ffn = 24; shared_experts = 1; first_dense = 1; ffn = 48"
            "; score = sigmoid; routed_scale = 2.5; bias_update = 0.01")


def test_a_deepseek_run_resumes_across_expert_and_pipeline_parallelism(tmp_path, capfd):
    """Written with the experts over ep 4 on dp 4, resumed on pp 2 x dp 2 with ep 2 under
    ZeRO-1: the latents' weights, the experts and their balancing biases come back whole,
    and the resumed run matches the uninterrupted one."""
    from tests.test_checkpoint import resumed_run_matches_uninterrupted

    resumed_run_matches_uninterrupted(
        dict(family="deepseek", model=DEEPSEEK, mesh="dp = 4; ep = 4"),
        dict(family="deepseek", model=DEEPSEEK, mesh="pp = 2; dp = 2; ep = 2",
             shard="dp { zero = 1 }"),
        tmp_path, capfd)


def test_a_deepseek_run_resumes_from_tp_to_ep(tmp_path, capfd):
    """Written with the heads over tp 2, resumed on dp 4 without tp: q_b's and kv_b's
    shards come back whole, and the resumed run matches the uninterrupted one."""
    from tests.test_checkpoint import resumed_run_matches_uninterrupted

    resumed_run_matches_uninterrupted(
        dict(family="deepseek", model=DEEPSEEK, mesh="tp = 2; dp = 2; ep = 2"),
        dict(family="deepseek", model=DEEPSEEK, mesh="dp = 4; ep = 4"),
        tmp_path, capfd)


# --- to and from transformers' DeepseekV3ForCausalLM ------------------------------------

HF_SIZES = dict(vocab_size=96, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=4, max_position_embeddings=16, rms_norm_eps=1e-6,
                intermediate_size=40, moe_intermediate_size=24, n_routed_experts=4,
                num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                n_group=2, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5,
                q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4,
                v_head_dim=8)
HF_PLAN = """plan ds_hf {{
  model deepseek {{
    layers = 3; hidden = 32; heads = 4; vocab = 96; seq = 16; batch = 4; ffn = 40
    experts = 4; top_k = 2; expert_ffn = 24; shared_experts = 1; first_dense = 1
    expert_groups = 2; route_groups = 1; score = sigmoid; routed_scale = 2.5
    q_rank = 16; kv_rank = 8; nope_dim = 4; rope_dim = 4; v_dim = 8; norm_eps = 1e-6{extra}
  }}
  mesh {{ {mesh} }}
  train {{ steps = 2; optimizer = sgd(lr = 0.1, momentum = 0, weight_decay = 0); seed = 11{train} }}
}}
"""


def hf_plan(tmp_path, mesh="", extra="", train=""):
    path = tmp_path / "hf.plan"
    path.write_text(HF_PLAN.format(mesh=mesh, extra=extra, train=train))
    return path


@pytest.mark.parametrize("mesh", ["dp = 2; ep = 2", "tp = 2; ep = 2"])
def test_a_run_starts_from_a_deepseek_v3_checkpoint(mesh, tmp_path, capfd):
    """save_pretrained's DeepseekV3ForCausalLM (the Hub's per-expert tensors), started
    from under dp 2 with ep 2, or with the heads over tp 2, and --check: the first loss is
    transformers' on the same batch, and the run matches the reference started from the
    same weights."""
    import json

    from planc.lang import load_file
    from planc.runtime.engine.data import batch_tokens

    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**HF_SIZES))
    model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    source = hf_plan(tmp_path, mesh, train='; init = "hf"')
    metrics = tmp_path / "m.jsonl"
    assert main(["run", str(source), "-o", str(tmp_path / "build"), "--metrics", str(metrics),
                 "--check"]) == 0
    err = capfd.readouterr().err
    assert f"planc: started from Hugging Face checkpoint {tmp_path / 'hf'} in " in err
    assert "every loss and parameter matches" in err
    tokens = batch_tokens(load_file(source).plan, 0)
    with torch.no_grad():
        logits = model.eval()(input_ids=tokens[:, :-1]).logits
    theirs = torch.nn.functional.cross_entropy(logits.reshape(-1, 96), tokens[:, 1:].reshape(-1))
    first = json.loads(metrics.read_text().splitlines()[0])["loss"]
    assert first == pytest.approx(theirs.item(), rel=1e-5)


def test_a_run_starts_from_a_checkpoints_balancing_biases(tmp_path, capfd):
    """A DeepseekV3ForCausalLM whose routers' e_score_correction_bias moved (as a trained
    DeepSeek-V3's have) routes its tokens by them; a run with bias_update starts its
    biases there, not at zero: its first loss is transformers', which the same weights
    with zero biases miss, and --check's reference starts from them too."""
    import json

    from planc.lang import load_file
    from planc.runtime.engine.data import batch_tokens

    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**HF_SIZES))
    biases = {}
    with torch.no_grad():
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(4) * 0.5)
            biases[layer] = layer.mlp.gate.e_score_correction_bias.clone()
    model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    source = hf_plan(tmp_path, "dp = 2; ep = 2", extra="; bias_update = 0.001",
                     train='; init = "hf"')
    metrics = tmp_path / "m.jsonl"
    assert main(["run", str(source), "-o", str(tmp_path / "build"), "--metrics", str(metrics),
                 "--check"]) == 0
    assert "every loss and parameter matches" in capfd.readouterr().err
    tokens = batch_tokens(load_file(source).plan, 0)

    def theirs() -> float:
        with torch.no_grad():
            logits = model.eval()(input_ids=tokens[:, :-1]).logits
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 96),
                                                 tokens[:, 1:].reshape(-1)).item()

    first = json.loads(metrics.read_text().splitlines()[0])["loss"]
    assert first == pytest.approx(theirs(), rel=1e-5)
    with torch.no_grad():
        for layer in biases:
            layer.mlp.gate.e_score_correction_bias.zero_()
    assert first != pytest.approx(theirs(), rel=1e-4)  # the biases route other experts


def test_export_loads_in_deepseek_v3_with_its_balancing_biases(tmp_path, capfd):
    """A run with the balancing bias, checkpointed and exported: DeepseekV3ForCausalLM
    loads every tensor (the biases as its e_score_correction_bias), none missing, and its
    loss is the reference's routed with those biases."""
    from planc.lang import load_file
    from planc.runtime.engine.data import batch_tokens
    from planc.runtime.families import deepseek
    from tests.conftest import checkpoint_tensors

    source = hf_plan(tmp_path, "dp = 2; ep = 2", extra="; bias_update = 0.05")
    # without groups, so that the toy's loads leave the mean within 4 steps
    source.write_text(source.read_text().replace("expert_groups = 2; route_groups = 1; ", "")
                      .replace("steps = 2", "steps = 4"))
    checkpoints, exported = tmp_path / "ckpt", tmp_path / "hf"
    assert main(["run", str(source), "-o", str(tmp_path / "build"), "--checkpoint-dir",
                 str(checkpoints), "--checkpoint-every", "4"]) == 0
    capfd.readouterr()
    assert main(["export", str(checkpoints), "--format", "hf", "-o", str(exported)]) == 0
    assert capfd.readouterr().err == (
        f"wrote 47 tensors of {checkpoints / 'step-000004'} to {exported}/ (config.json, "
        f"model.safetensors) for DeepseekV3ForCausalLM.from_pretrained\n")  # 3 + 12 + 2 x 16
    model, info = transformers.DeepseekV3ForCausalLM.from_pretrained(
        str(exported), attn_implementation="eager", output_loading_info=True)
    assert not any(info.values()), info
    final = checkpoint_tensors(checkpoints)
    biases = {layer: final[f"layers.{layer}.router.balance_bias"] for layer in (1, 2)}
    assert sum(float(b.abs().sum()) for b in biases.values()) > 0  # the updates moved them
    for layer, bias in biases.items():
        assert torch.equal(model.model.layers[layer].mlp.gate.e_score_correction_bias, bias)
    plan = load_file(source).plan
    tokens = batch_tokens(plan, 0)
    with torch.no_grad():
        logits = model(input_ids=tokens[:, :-1]).logits
    theirs = torch.nn.functional.cross_entropy(logits.reshape(-1, 96), tokens[:, 1:].reshape(-1))
    params = {k: v for k, v in final.items() if not k.endswith("balance_bias")}
    state = {"bias": biases, "chosen": {}}
    ours = deepseek.reference_objective(plan.model, params, tokens, torch.float32, state,
                                        counting=False)[1]
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-5)


@pytest.mark.parametrize("key, message", [
    ("q_rank = 12", "config.json's q_lora_rank is 16; the plan's model has q_rank = 12"),
    # DeepseekV3Config's head_dim is its rotated features', compared first
    ("rope_dim = 2", "config.json's head_dim is 4; the plan's model has rope_dim = 2"),
])
def test_check_names_the_deepseek_field_that_disagrees(key, message, tmp_path, capfd):
    torch.manual_seed(0)
    transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**HF_SIZES)) \
        .save_pretrained(tmp_path / "hf", safe_serialization=True)
    source = hf_plan(tmp_path, train='; init = "hf"')
    name = key.split()[0]
    text = source.read_text()
    start = text.index(name + " = ")
    source.write_text(text[:start] + key + text[text.index(";", start):])
    assert main(["check", str(source)]) == 1
    assert f"error: init: {tmp_path / 'hf'}: {message}\n" in capfd.readouterr().err


MINIATURE = """plan deepseek_v3_miniature {
  model deepseek {
    layers = 4; hidden = 64; heads = 4; vocab = 128; seq = 32; batch = 16
    q_rank = 48; kv_rank = 32; nope_dim = 16; rope_dim = 16; v_dim = 16
    experts = 8; top_k = 2; expert_ffn = 48; shared_experts = 1; first_dense = 1; ffn = 128
    score = sigmoid; routed_scale = 2.5; expert_groups = 4; route_groups = 2
    bias_update = 0.01 FP8
  }
  mesh { pp = 2; dp = 4; ep = 4; order = [tp, cp, dp, pp] }
  topology { nodes = 4; devices_per_node = 2 }
  shard { pp { virtual = 2 }; dp { zero = 1 } }
  schedule { microbatches = 4; pipeline = dualpipev; overlap_all_to_all = on }
  optimize { recompute = attention_inputs; moe_dispatcher = two_hop }
  train { steps = 3; optimizer = adamw(lr = 1e-3); seed = 0 }
}
"""


@pytest.mark.parametrize("fp8", [False, True])
def test_the_h800_plan_in_miniature_trains_as_one_process_does(fp8, tmp_path, capsys):
    """plans/moe-published/deepseek-v3-h800.plan's recipe on 8 CPU processes: MLA with its
    norms and up-projections recomputed, DualPipeV's pairs with the all-to-alls cut out
    and overlapped, two hops over 4 "nodes" of 2, the sigmoid gate with its bias and
    node-limited routing, ZeRO-1, and FP8 (losses) or not (losses and parameters)."""
    (tmp_path / "mini.plan").write_text(MINIATURE.replace(
        " FP8", "; fp8 = blockwise; fp8_tile = 16" if fp8 else ""))
    assert main(["run", str(tmp_path / "mini.plan"), "-o", str(tmp_path / "b"),
                 "--check"]) == 0
    err = capsys.readouterr().err
    assert ("every loss matches" if fp8 else "every loss and parameter matches") in err, err


def test_unfused_attention_is_priced_on_mlas_head_widths():
    """On a GPU without FlashAttention (the dgx-a100 preset), the scores' GEMM multiplies
    a head's q and k features, nope_dim + rope_dim, and the output's its v_dim; a llama's
    heads are head_dim wide both."""
    from planc.estimate.kernel_cost import KernelModel

    text = ("plan p {{ model {} {{ preset = {}; batch = 8 }} mesh {{ dp = 8 }} "
            "topology {{ preset = dgx-a100 }} }}")
    mla = KernelModel.of(load_text(text.format("deepseek", "deepseek-v3")).plan)
    assert (mla.score_width, mla.value_width) == (192, 128)
    gqa = KernelModel.of(load_text(text.format("llama", "llama3-8b")).plan)
    assert (gqa.score_width, gqa.value_width) == (128, 128)
