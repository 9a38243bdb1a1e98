"""A moe checkpoint outside and across plans (issue 24): ``planc export --format hf``
writes it as transformers' ``MixtralForCausalLM`` when it is one (no shared experts, no
dense first blocks, top-k weights renormalised), which loads it with ``from_pretrained``
and computes planc's loss, and refuses it in one line, writing nothing, when it is not;
and a moe checkpoint resumes under another layout as the other families' do
(tests/test_checkpoint.py)."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from planc.cli import main  # noqa: E402
from planc.lang import load_text  # noqa: E402
from tests.conftest import checkpoint_tensors  # noqa: E402
from tests.test_checkpoint import resumed_run_matches_uninterrupted, tensors_of  # noqa: E402
from tests.test_moe import plan_text  # noqa: E402

pytestmark = pytest.mark.slow


def _trained(text: str, tmp_path, capfd):
    """The checkpoint directory of one planc run of ``text``, checkpointed every step."""
    source, checkpoints = tmp_path / "moe.plan", tmp_path / "ckpt"
    source.write_text(text)
    status = main(["run", str(source), "-o", str(tmp_path / "build"), "--checkpoint-dir",
                   str(checkpoints), "--checkpoint-every", "1"])
    assert status == 0, capfd.readouterr().err
    capfd.readouterr()
    return checkpoints


# --- export to transformers' Mixtral ---------------------------------------------------------

def _mixtral_value(final: dict, target: str):
    """The tensor ``target`` of a MixtralForCausalLM state dict, from planc's tensors
    (stored (in, out), x @ W), as tests/test_moe.py's _mixtral maps them."""
    globals_ = {"model.embed_tokens.weight": final["embedding.weight"],
                "model.norm.weight": final["final_ln.weight"],
                "lm_head.weight": final["head.weight"].t()}
    if target in globals_:
        return globals_[target]
    _, _, layer, local = target.split(".", 3)
    w = {k[len(f"layers.{layer}."):]: v for k, v in final.items()
         if k.startswith(f"layers.{layer}.")}
    if local in ("input_layernorm.weight", "post_attention_layernorm.weight"):
        return w["ln1.weight" if local.startswith("input") else "ln2.weight"]
    if local.startswith("self_attn."):
        return w[f"{local[len('self_attn.')]}.weight"].t()
    return {"mlp.gate.weight": lambda: w["router.weight"].t(),
            "mlp.experts.gate_up_proj": lambda: torch.cat(
                [w["experts.gate.weight"], w["experts.up.weight"]], dim=2).transpose(1, 2),
            "mlp.experts.down_proj": lambda: w["experts.down.weight"].transpose(1, 2),
            }[local]()


def test_export_loads_in_mixtral_and_computes_the_same_loss(tmp_path, capfd):
    """A tp 2 run's checkpoint, exported, is MixtralForCausalLM's: every tensor is the
    checkpoint's and the loss on the first batch is planc's reference forward loss."""
    transformers = pytest.importorskip("transformers")
    from planc.runtime.engine.data import batch_tokens
    from planc.runtime.oracle.reference import forward_loss

    text = plan_text("hf", mesh="tp = 2", steps=1,
                     optimizer="sgd(lr = 0.1, momentum = 0, weight_decay = 0)",
                     extra="; rope_theta = 500000; norm_eps = 1e-6")
    plan = load_text(text).plan
    checkpoints, exported = _trained(text, tmp_path, capfd), tmp_path / "hf"
    assert main(["export", str(checkpoints), "--format", "hf", "-o", str(exported)]) == 0
    assert capfd.readouterr().err == (
        f"wrote 30 tensors of {checkpoints / 'step-000001'} to {exported}/ (config.json, "
        f"model.safetensors) for MixtralForCausalLM.from_pretrained\n")  # 3 x 9 + 3
    config = json.loads((exported / "config.json").read_text())
    assert {k: config[k] for k in ("architectures", "model_type", "intermediate_size",
                                   "num_local_experts", "num_experts_per_tok",
                                   "router_aux_loss_coef", "rope_parameters",
                                   "rms_norm_eps", "num_key_value_heads", "head_dim")} == {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
        "intermediate_size": 24, "num_local_experts": 4, "num_experts_per_tok": 2,
        "router_aux_loss_coef": 0.0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
        "rms_norm_eps": 1e-6, "num_key_value_heads": 2, "head_dim": 8}

    model = transformers.MixtralForCausalLM.from_pretrained(str(exported),
                                                           attn_implementation="eager")
    final = checkpoint_tensors(checkpoints)
    loaded = {k: v.detach() for k, v in model.named_parameters()}
    assert len(loaded) == 30
    for target, value in loaded.items():
        assert torch.equal(value, _mixtral_value(final, target)), target
    tokens = batch_tokens(plan, 0)
    with torch.no_grad():
        logits = model(input_ids=tokens[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, plan.model.vocab).float(), tokens[:, 1:].reshape(-1))
        expected = forward_loss(plan, final, tokens)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)


@pytest.mark.parametrize("keys, value, why", [
    (dict(shared=1), "shared_experts = 1", "Mixtral has no shared experts"),
    (dict(dense=1), "first_dense = 1", "every Mixtral block is a mixture of experts"),
    (dict(extra="; norm_topk = off"), "norm_topk = off",
     "Mixtral always renormalises each token's top-k routing weights"),
    (dict(extra="; aux_loss = 0.01"), "aux_loss = 0.01",
     "transformers' Mixtral has no sequence-wise balance loss"),
    (dict(extra="; score = sigmoid"), "score = sigmoid",
     "Mixtral's router scores are softmax probabilities"),
    (dict(extra="; routed_scale = 2.5"), "routed_scale = 2.5",
     "Mixtral does not scale its routing weights"),
    (dict(extra="; expert_groups = 2; route_groups = 1"), "route_groups = 1",
     "Mixtral routes to any of its experts"),
    (dict(extra="; bias_update = 0.001"), "bias_update = 0.001",
     "Mixtral's router has no balancing bias"),
    (dict(extra="; capacity = 1.25"), "capacity = 1.25",
     "Mixtral routes every token to its experts (dropless)"),
], ids=["shared-experts", "first-dense", "norm-topk-off", "aux-loss", "sigmoid", "scale",
        "groups", "bias", "capacity"])
def test_export_refuses_a_moe_model_that_is_not_a_mixtral(keys, value, why, tmp_path, capfd):
    checkpoints = _trained(plan_text("not_mixtral", layers=2, steps=1, **keys), tmp_path,
                           capfd)
    exported = tmp_path / "hf"
    assert main(["export", str(checkpoints), "--format", "hf", "-o", str(exported)]) == 1
    assert capfd.readouterr().err == (
        f"planc: error: {checkpoints / 'step-000001'} holds a model moe with {value}, which "
        f"MixtralForCausalLM cannot hold ({why}); --format hf writes moe models with "
        f"shared_experts = 0, first_dense = 0, norm_topk = on, aux_loss = 0, score = "
        f"softmax, routed_scale = 1.0, route_groups = unset, bias_update = unset and "
        f"capacity = unset\n")
    assert not exported.exists()


def test_a_checkpoint_whose_model_no_plan_could_describe_is_refused(tmp_path, capfd):
    """A manifest's mixture is held to planc check's rule across its keys, top_k at most
    experts: top_k = 5 of 4 experts (each value alone of its kind) was exported as a
    config transformers cannot build (num_experts_per_tok 5 of num_local_experts 4),
    status 0."""
    checkpoints = _trained(plan_text("top_k", layers=2, steps=1), tmp_path, capfd)
    manifest_path = checkpoints / "step-000001" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    experts = manifest["model"]["options"]["experts"]
    manifest["model"]["options"]["top_k"] = experts + 1
    manifest_path.write_text(json.dumps(manifest))
    exported = tmp_path / "hf"
    assert main(["export", str(checkpoints), "--format", "hf", "-o", str(exported)]) == 1
    err = capfd.readouterr().err
    assert f"model.options.top_k is {experts + 1}, more than model.options.experts " \
        f"({experts}): each token goes to top_k different experts" in err, err
    assert "Traceback" not in err and not exported.exists()

# --- resuming under another layout -----------------------------------------------------------

MOE = "; kv_heads = 2; experts = 4; top_k = 2; expert_ffn = 24"


def test_a_moe_run_resumed_under_another_layout_matches_the_uninterrupted_run(tmp_path,
                                                                              capfd):
    """Written from tp 2 x pp 2 (the experts whole on every tp rank, the blocks split over
    the stages), resumed on dp 2 with ZeRO 1 (the stacked experts' momenta split over dp):
    the losses, parameters and momenta are the uninterrupted run's, within planc run
    --check's tolerances, as tests/test_checkpoint.py's cases are."""
    resumed_run_matches_uninterrupted(
        dict(family="moe", model=MOE, mesh="tp = 2; pp = 2"),
        dict(family="moe", model=MOE, mesh="dp = 2", shard="dp { zero = 1 }"),
        tmp_path, capfd)
    final = tensors_of(tmp_path / "ckpt" / "step-000004")
    assert len(final) == 4 * 10 + 3  # a block: attention and norms (6), router, 3 stacked
    assert final["layers.3.experts.down.weight"].shape == (4, 24, 32)


def test_a_moe_run_resumes_across_expert_parallelism(tmp_path, capfd):
    """Written with the experts split over ep 4 (folded over tp 2 x dp 2, one expert a
    rank), resumed with them over ep 2 on dp 4 under ZeRO-3 (2 experts a rank, stored
    sharded over their 2 replicas): a checkpoint holds every expert whole, whatever ep."""
    resumed_run_matches_uninterrupted(
        dict(family="moe", model=MOE, mesh="tp = 2; dp = 2; ep = 4"),
        dict(family="moe", model=MOE, mesh="dp = 4; ep = 2", shard="dp { zero = 3 }"),
        tmp_path, capfd)


def test_a_moe_run_written_with_experts_sharded_over_their_replicas_resumes(tmp_path,
                                                                             capfd):
    """Written with ep 2 over tp 2 x dp 2 under ZeRO-1 (each expert's AdamW state split
    over the 2 ranks holding it), resumed without ep on dp 2 x pp 2."""
    resumed_run_matches_uninterrupted(
        dict(family="moe", model=MOE, mesh="tp = 2; dp = 2; ep = 2", shard="dp { zero = 1 }"),
        dict(family="moe", model=MOE, mesh="pp = 2; dp = 2"),
        tmp_path, capfd)

