"""``model llama { head_dim }`` (and moe's): attention heads whose width is not
hidden / heads, as Qwen3's 128-wide heads on a 2,048-wide stream.

The counts are checked against a hand computation, the checks at their place, plan.json
against the byte-identical promise (a plan without head_dim holds no option), and a run
under tp 2 against the single-process reference (``planc run --check``). The Hugging Face
round trip with a head_dim is in tests/test_transformers.py.
"""

from __future__ import annotations

import json

import pytest

from planc.estimate import memory
from planc.estimate.model import Shapes, forward_flops
from planc.lang import load_text
from planc.models import family_of
from planc.plan.plan_json import plan_from_dict

PLAN = """plan head_dim {{
  model {family} {{ layers = 2; hidden = 32; heads = 4; kv_heads = 2; {head_dim}ffn = 48;
                vocab = 128; seq = 16; batch = 8{extra} }}
  mesh {{ {mesh} }}
  shard {{ {shard} }}
  train {{ steps = 2; optimizer = adamw(lr = 0.01, weight_decay = 0.1); seed = 5 }}
}}
"""


def plan_text(head_dim: str = "head_dim = 12; ", mesh: str = "", shard: str = "",
              family: str = "llama", extra: str = "") -> str:
    return PLAN.format(head_dim=head_dim, mesh=mesh, shard=shard, family=family, extra=extra)


def _errors(text: str) -> list[tuple[int, int, str]]:
    return [(d.span.line, d.span.column, d.message) for d in load_text(text).diagnostics
            if d.is_error]


def test_head_dim_sets_the_widths_parameters_and_flops_as_counted_by_hand():
    plan = load_text(plan_text()).plan
    m = plan.model
    assert (m.head_dim, m.attention_width) == (12, 48)
    # per layer: 2 norms (32), q (32 x 4*12), k and v (32 x 2*12 each), o (4*12 x 32),
    # gate, up, down (32 x 48 each); embedding and head 128 x 32, the final norm 32
    per_layer = 2 * 32 + 32 * 48 + 2 * 32 * 24 + 48 * 32 + 3 * 32 * 48
    assert per_layer == 9280
    assert memory.total_parameters(plan) == 128 * 32 + 2 * per_layer + 32 + 32 * 128 == 26784
    shapes = {p.name: p.shape for p in family_of(plan).all_parameters(m)}
    assert (shapes["layers.0.q.weight"], shapes["layers.0.k.weight"],
            shapes["layers.0.o.weight"]) == ((32, 48), (32, 24), (48, 32))
    # forward FLOPs per token (Narayanan et al.): q/k/v 2*32*(4+2*2)*12, o 2*48*32, the
    # scores and their use 4*seq*48, the SwiGLU 6*32*48; then the head 2*32*128
    per_layer_flops = 2 * 32 * 8 * 12 + 2 * 48 * 32 + 4 * 16 * 48 + 6 * 32 * 48
    assert per_layer_flops == 21504
    assert family_of(plan).model_flops_per_token(m) == 2 * per_layer_flops + 2 * 32 * 128
    # one microbatch of 8 x 16 tokens: attention over 4 heads of 12, o reads 48 features
    s = Shapes.of(plan)
    assert forward_flops("attention", s) == 4.0 * 128 * 16 * 48 + 5.0 * 128 * 4 * 16
    assert forward_flops("proj", s) == 2.0 * 128 * 48 * 32
    assert s.widths["context"] == 48 and s.widths["qkv"] == (4 + 2 * 2) * 12


def test_head_dim_sets_the_activation_memory_of_a_block():
    m = load_text(plan_text()).plan.model
    # tp 2, fp32: the stream's 4 tensors (128 x 32), then per tp rank q, k, v (8 heads of
    # 12), o's input (48), gate, up and down's input (3 x 48), and the scores (4 x 16)
    sb = 16 * 8
    expected = (4 * sb * 32 + sb * (8 * 12 + 48 + 3 * 48) / 2 + 4 * 16 * sb / 2) * 4
    assert family_of(m).activation_bytes(m, seq=16, seq_full=16, batch=8, tp=2,
                                          sequence_parallel=False,
                                          recompute="none") == expected == 155648


def test_without_head_dim_the_model_and_plan_json_are_as_before():
    plain = load_text(plan_text(head_dim="")).plan
    assert plain.model.options == {} and plain.model.head_dim == 8
    assert "options" not in plain.to_dict()["model"]
    assert memory.total_parameters(plain) == 23712  # o is 32 x 32 again
    given = load_text(plan_text()).plan
    data = json.loads(json.dumps(given.to_dict()))
    assert data["model"]["options"] == {"head_dim": 12}
    assert plan_from_dict(data).model.head_dim == 12
    # a build's plan.json is untrusted: a head_dim of 0 there is refused, not used
    data["model"]["options"]["head_dim"] = 0
    with pytest.raises(ValueError, match="plan.model.options.head_dim"):
        plan_from_dict(data)


def test_head_dim_frees_hidden_from_dividing_by_heads():
    plan = load_text(plan_text(head_dim="head_dim = 8; ").replace("hidden = 32",
                                                                  "hidden = 30")).plan
    assert plan is not None and plan.model.attention_width == 32
    assert _errors(plan_text(head_dim="").replace("hidden = 32", "hidden = 30")) == [
        (2, 50, "hidden (30) must divide by heads (4)")]


def test_a_bad_head_dim_is_an_error_at_its_place():
    assert _errors(plan_text(head_dim="head_dim = 0; ")) == [
        (2, 78, "expected a positive integer, got 0")]
    assert _errors(plan_text(head_dim="head_dim = 7; ")) == [
        (2, 78, "head_dim (7) is odd; rotary embedding turns pairs of features")]
    assert _errors(plan_text(head_dim="head_dim = 12.5; ")) == [
        (2, 78, "expected an integer, got 12.5")]
    # over tp the heads split, whatever their width
    over = plan_text(mesh="tp = 8").replace("kv_heads = 2", "kv_heads = 1")
    assert _errors(over) == [(4, 15, "heads (4) must divide by tp (8)")]
    # the mixture of experts has llama's attention, and the key
    assert _errors(plan_text(head_dim="head_dim = 0; ", family="moe",
                             extra="; experts = 4; top_k = 2; expert_ffn = 16")) == [
        (2, 76, "expected a positive integer, got 0")]


def test_the_qwen3_preset_has_its_128_wide_heads():
    m = load_text("plan q { model moe { preset = qwen3-30b-a3b; batch = 8 } }").plan.model
    assert (m.hidden, m.heads, m.kv_heads, m.head_dim, m.attention_width) == \
        (2048, 32, 4, 128, 4096)
    # Qwen/Qwen3-30B-A3B's 30.5B parameters, its q and k norms (2 x 128 per layer) with
    # them: qk_norm = on
    assert m.qk_norm is True
    assert memory.total_parameters(load_text(
        "plan q { model moe { preset = qwen3-30b-a3b; batch = 8 } }").plan) == 30_532_122_624


# Qwen/Qwen3-8B's config.json as the Hub holds it (transformers 4.51)
QWEN3_8B_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 12288,
    "max_position_embeddings": 40960, "max_window_layers": 36, "model_type": "qwen3",
    "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.51.0",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 151936}


def test_the_qwen3_8b_preset_is_qwen3_8b():
    """preset = qwen3-8b: Qwen3-8B's 8.19B parameters (6.95B without the embedding and
    the head, as its model card counts them), and planc check would start it from the
    Hub's config.json (every compared key agrees); with ffn changed it names the key."""
    from planc.hf.export import architecture
    from planc.hf.init import config_problem

    plan = load_text("plan q { model llama { preset = qwen3-8b; batch = 8 } }").plan
    total = memory.total_parameters(plan)
    assert total == 8_190_735_360
    assert total - 2 * 151936 * 4096 == 6_946_075_648
    m = plan.model
    assert architecture(m).name == "Qwen3ForCausalLM"
    assert config_problem(m, architecture(m), QWEN3_8B_CONFIG) is None
    assert config_problem(m, architecture(m), {**QWEN3_8B_CONFIG, "intermediate_size": 9728}
                          ) == ("config.json's intermediate_size is 9728; the plan's model "
                                "has ffn = 12288")


@pytest.mark.slow
@pytest.mark.parametrize("family,mesh,shard,extra", [
    ("llama", "tp = 2", "tp { sequence_parallel = on }", ""),
    ("moe", "tp = 2; ep = 2", "", "; experts = 4; top_k = 2; expert_ffn = 16"),
], ids=["llama-tp2-sp", "moe-tp2-ep2"])
def test_a_run_with_head_dim_matches_one_process(family, mesh, shard, extra, tmp_path, capfd):
    pytest.importorskip("torch")
    from planc.cli import main

    plan = tmp_path / "head_dim.plan"
    plan.write_text(plan_text(mesh=mesh, shard=shard, family=family, extra=extra))
    status = main(["run", str(plan), "-o", str(tmp_path / "build"), "--check",
                   "--timeout", "120"])
    err = capfd.readouterr().err
    assert status == 0, err
    assert "every loss and parameter matches" in err
