"""``model { qk_norm }``: Qwen3's RMSNorm of each head's q and k before RoPE, on the
llama and moe families. A run trains it over tp (the norms whole on every rank, their
gradients summed over tp) and cp and matches the single-process reference; ``planc
export --format hf`` writes it as transformers' ``Qwen3ForCausalLM`` or
``Qwen3MoeForCausalLM``, which load it and compute planc's loss; ``train { init }``
starts from a saved ``Qwen3MoeForCausalLM`` (its per-expert tensors, as the Hub holds
Qwen/Qwen3-30B-A3B) and its first loss is transformers'."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from planc.cli import main  # noqa: E402
from planc.lang import load_file, load_text  # noqa: E402
from planc.runtime.engine.data import batch_tokens  # noqa: E402
from tests.conftest import checkpoint_tensors  # noqa: E402

pytestmark = pytest.mark.slow

PLAN = """plan qwen3 {{
  model {family} {{ {model} }}
  mesh {{ {mesh} }}
  shard {{ {shard} }}
  train {{ steps = {steps}; optimizer = sgd(lr = 0.5, momentum = 0, weight_decay = 0)
          seed = 3{train} }}
}}
"""
KEYS = {"layers": 2, "hidden": 32, "heads": 4, "kv_heads": 2, "head_dim": 16, "qk_norm": "on",
        "ffn": 40, "vocab": 96, "seq": 16, "batch": 4, "rope_theta": 1000000,
        "norm_eps": "1e-6"}
EXPERTS = {"experts": 4, "top_k": 2, "expert_ffn": 24, "norm_topk": "off"}


def plan_text(family="llama", mesh="", shard="", steps=2, train="", **keys) -> str:
    """The plan; ``keys``: the model's keys that differ from KEYS (and EXPERTS)."""
    values = {**KEYS, **(EXPERTS if family == "moe" else {}), **keys}
    return PLAN.format(family=family, mesh=mesh, shard=shard, steps=steps, train=train,
                       model="; ".join(f"{k} = {v}" for k, v in values.items()))


def _loss(model, plan) -> float:
    """transformers' loss of ``model`` on the runtime's batch of step 0."""
    tokens = batch_tokens(plan, 0)
    with torch.no_grad():
        logits = model(input_ids=tokens[:, :-1]).logits
        return torch.nn.functional.cross_entropy(
            logits.reshape(-1, plan.model.vocab).float(), tokens[:, 1:].reshape(-1)).item()


@pytest.mark.parametrize("family,mesh,shard", [
    ("llama", "tp = 2; cp = 2", "tp { sequence_parallel = on }"),
    ("moe", "tp = 2; dp = 2; ep = 2", "dp { zero = 3 }"),
])
def test_qk_norm_trains_as_one_process_and_exports_as_qwen3(family, mesh, shard, tmp_path,
                                                             capfd):
    """Two steps over tp (and cp or ep) match the single-process run, which moves the
    norms off their initial ones; the export loads in Qwen3's class with every q/k norm
    the checkpoint's, and transformers' loss on the first batch is planc's reference
    loss of the exported weights."""
    from planc.runtime.oracle.reference import forward_loss

    text = plan_text(family, mesh, shard)
    source, checkpoints, exported = tmp_path / "q.plan", tmp_path / "ckpt", tmp_path / "hf"
    source.write_text(text)
    assert main(["run", str(source), "-o", str(tmp_path / "build"), "--check",
                 "--checkpoint-dir", str(checkpoints), "--checkpoint-every", "2"]) == 0
    assert "every loss and parameter matches" in capfd.readouterr().err
    assert main(["export", str(checkpoints), "--format", "hf", "-o", str(exported)]) == 0
    cls = "Qwen3ForCausalLM" if family == "llama" else "Qwen3MoeForCausalLM"
    assert capfd.readouterr().err.endswith(f"for {cls}.from_pretrained\n")
    config = json.loads((exported / "config.json").read_text())
    assert (config["architectures"], config["head_dim"]) == ([cls], 16)
    if family == "moe":
        assert {k: config[k] for k in ("num_experts", "num_experts_per_tok", "norm_topk_prob",
                                       "moe_intermediate_size", "mlp_only_layers")} == {
            "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": False,
            "moe_intermediate_size": 24, "mlp_only_layers": []}

    model = getattr(transformers, cls).from_pretrained(str(exported),
                                                       attn_implementation="eager")
    final = checkpoint_tensors(checkpoints)
    loaded = dict(model.named_parameters())
    for layer in range(2):
        for x in "qk":
            norm = final[f"layers.{layer}.{x}_norm.weight"]
            assert not torch.equal(norm, torch.ones_like(norm))  # trained
            assert torch.equal(loaded[f"model.layers.{layer}.self_attn.{x}_norm.weight"], norm)
    plan = load_text(text).plan
    expected = forward_loss(plan, final, batch_tokens(plan, 0)).item()
    assert _loss(model, plan) == pytest.approx(expected, rel=1e-5)


def _qwen3_moe(directory) -> None:
    """A tiny random Qwen3MoeForCausalLM, its q/k norms away from ones, saved as
    save_pretrained writes it (each expert's gate_proj, up_proj and down_proj)."""
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=16, rms_norm_eps=1e-6,
        rope_theta=1e6, moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[])
    model = transformers.Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        for name, value in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                value.uniform_(0.5, 1.5)
    model.save_pretrained(directory, safe_serialization=True)


def test_a_run_starts_from_a_qwen3_moe_checkpoint(tmp_path, capfd):
    """``train { init }`` over tp 2 x dp 2 x ep 2 from a saved Qwen3MoeForCausalLM: the
    first loss is transformers' to fp32's agreement, and --check's reference (which
    starts from the same tensors) agrees with every loss and parameter."""
    _qwen3_moe(tmp_path / "hf")
    source, metrics = tmp_path / "init.plan", tmp_path / "m.jsonl"
    source.write_text(plan_text("moe", "tp = 2; dp = 2; ep = 2",
                                "tp { sequence_parallel = on }", train='; init = "hf"'))
    assert main(["run", str(source), "-o", str(tmp_path / "build"), "--metrics",
                 str(metrics), "--check"]) == 0
    err = capfd.readouterr().err
    assert "every loss and parameter matches" in err
    first = json.loads(metrics.read_text().splitlines()[0])["loss"]
    model = transformers.Qwen3MoeForCausalLM.from_pretrained(str(tmp_path / "hf"),
                                                            attn_implementation="eager")
    assert first == pytest.approx(_loss(model, load_file(source).plan), rel=1e-5)


@pytest.mark.parametrize("keys,message", [
    # the model_type first (before Mixtral's norm_topk = on), with the key that fits
    ({"qk_norm": "off"}, 'config.json\'s model_type is "qwen3_moe"; model moe starts from a '
                         '"mixtral" checkpoint (MixtralForCausalLM), with qk_norm = on from a '
                         '"qwen3_moe" one'),
    ({"norm_topk": "on"}, "config.json's norm_topk_prob is false; the plan's model has "
                          "norm_topk = on"),
    ({"experts": 8}, "config.json's num_experts is 4; the plan's model has experts = 8"),
])
def test_check_names_what_a_qwen3_moe_checkpoint_disagrees_with(keys, message, tmp_path,
                                                                capfd):
    _qwen3_moe(tmp_path / "hf")
    source = tmp_path / "init.plan"
    source.write_text(plan_text("moe", train='; init = "hf"', **keys))
    assert main(["check", str(source)]) == 1
    assert message in capfd.readouterr().err


def test_a_qk_norm_run_resumes_from_tp_to_dp_under_zero3(tmp_path, capfd):
    """The norms are whole on every tp rank: a tp 2 checkpoint resumes under dp 2 with
    ZeRO-3 (each rank then holding a shard of them) as if uninterrupted."""
    from tests.test_checkpoint import ADAMW, resumed_run_matches_uninterrupted

    model = "; kv_heads = 2; ffn = 96; qk_norm = on"
    resumed_run_matches_uninterrupted(
        dict(family="llama", model=model, mesh="tp = 2", optimizer=ADAMW,
             shard="tp { sequence_parallel = on }"),
        dict(family="llama", model=model, mesh="dp = 2", optimizer=ADAMW,
             shard="dp { zero = 3 }"), tmp_path, capfd)
