"""planc's llama against the ecosystem's reference: Hugging Face transformers'
``LlamaForCausalLM`` (a test-only dependency), built with planc's initial weights.

One SGD step with a large learning rate and no momentum or decay turns a planc run's
checkpoint into its gradients, ``(initial - final) / lr``; the loss comes from the run's
metrics. Both must equal what transformers computes, for a 1-rank run and for tp 2 x
pp 2 (with grouped-query attention and a shared k/v head). The export to transformers'
format is then loaded with ``from_pretrained`` and must compute the same loss.
"""

from __future__ import annotations


import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from planc.cli import main  # noqa: E402
from planc.hf.export import hf_config, hf_name  # noqa: E402
from planc.lang import load_text  # noqa: E402
from planc.runtime.engine.data import batch_tokens  # noqa: E402
from planc.runtime.oracle.reference import initial, parameters  # noqa: E402
from tests.conftest import checkpoint_tensors, trained_one_step  # noqa: E402

LR = 1000.0
PLAN = """plan hf_reference {{
  model llama {{ layers = 3; hidden = 32; heads = 4; kv_heads = {kv};{head_dim} ffn = 40; vocab = 96;
                seq = 16; batch = 4; rope_theta = 500000; norm_eps = 1e-6 }}
  mesh {{ {mesh} }}
  schedule {{ microbatches = {m} }}
  train {{ steps = 1; optimizer = sgd(lr = {lr}, momentum = 0, weight_decay = 0); seed = 11 }}
}}
"""


def _hf_model(plan):
    import dataclasses

    config = transformers.LlamaConfig(**{k: v for k, v in hf_config(
        dataclasses.asdict(plan.model)).items() if k not in ("architectures", "model_type")})
    config._attn_implementation = "eager"
    model = transformers.LlamaForCausalLM(config).float()
    state = {}
    for name, param in parameters(plan).items():
        target, transpose = hf_name(name)
        value = initial(plan, name, param.shape)
        state[target] = value.t().contiguous() if transpose else value
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    return model


def _hf_loss(model, plan):
    tokens = batch_tokens(plan, 0)
    logits = model(input_ids=tokens[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, plan.model.vocab).float(),
                                             tokens[:, 1:].reshape(-1))


@pytest.mark.slow
@pytest.mark.parametrize("mesh,kv,m,head_dim", [
    ("", 2, 1, ""), ("tp = 2; pp = 2", 1, 2, ""), ("tp = 2", 2, 1, " head_dim = 12;")],
    ids=["1-rank", "tp2-pp2-shared-kv", "tp2-head-dim-12"])
def test_loss_and_every_gradient_equal_transformers(mesh, kv, m, head_dim, tmp_path, capfd):
    text = PLAN.format(mesh=mesh, kv=kv, m=m, lr=LR, head_dim=head_dim)
    plan = load_text(text).plan
    planc_loss, final = trained_one_step(text, tmp_path, capfd)

    model = _hf_model(plan)
    loss = _hf_loss(model, plan)
    loss.backward()
    assert planc_loss == pytest.approx(loss.item(), rel=1e-5)

    hf_params = dict(model.named_parameters())
    assert len(final) == len(parameters(plan)) == 3 * 9 + 3
    for name, param in parameters(plan).items():
        target, transpose = hf_name(name)
        grad = hf_params[target].grad
        reference = grad.t() if transpose else grad
        planc_grad = (initial(plan, name, param.shape).double()
                      - final[name].double()) / LR
        torch.testing.assert_close(planc_grad.float(), reference, rtol=2e-4, atol=2e-7,
                                   msg=lambda text, n=name: f"{n}: {text}")


@pytest.mark.slow
@pytest.mark.parametrize("head_dim", ["", " head_dim = 12;"], ids=["hidden-over-heads", "12"])
def test_export_loads_in_transformers_and_computes_the_same_loss(head_dim, tmp_path, capfd):
    text = PLAN.format(mesh="tp = 2", kv=2, m=1, lr=0.1, head_dim=head_dim)
    plan_file = tmp_path / "hf.plan"
    plan_file.write_text(text)
    plan = load_text(text).plan
    checkpoints, exported = tmp_path / "ckpt", tmp_path / "hf"
    assert main(["run", str(plan_file), "-o", str(tmp_path / "build"), "--checkpoint-dir",
                 str(checkpoints), "--checkpoint-every", "1"]) == 0
    assert main(["export", str(checkpoints), "--format", "hf", "-o", str(exported)]) == 0
    assert "wrote 30 tensors" in capfd.readouterr().err
    model = transformers.LlamaForCausalLM.from_pretrained(str(exported),
                                                         attn_implementation="eager")
    final = checkpoint_tensors(checkpoints)
    for name, value in final.items():
        target, transpose = hf_name(name)
        loaded = dict(model.named_parameters())[target].detach()
        assert torch.equal(loaded, value.t() if transpose else value), name
    from planc.runtime.oracle.reference import forward_loss

    with torch.no_grad():
        expected = forward_loss(plan, final, batch_tokens(plan, 0))
        assert _hf_loss(model, plan).item() == pytest.approx(expected.item(), rel=1e-5)


def test_export_refuses_a_missing_checkpoint_directory(tmp_path, capfd):
    assert main(["export", str(tmp_path / "none"), "--format", "hf", "-o",
                 str(tmp_path / "out")]) == 1  # a checkpoint is an input
    err = capfd.readouterr().err
    assert "no such checkpoint directory" in err and "Traceback" not in err


def test_export_replaces_its_own_config_and_never_a_users(tmp_path, capfd):
    """Each file of an export is planc's by its own mark: a config.json a user wrote
    beside planc's weights is refused, --force or not, and named; planc's own (its key
    "planc" says "written by planc export --format hf") is replaced with --force.
    Whether the directory's model.safetensors was planc's decided for both, so --force
    replaced the user's config.json."""
    text = PLAN.format(mesh="", kv=2, m=1, lr=0.1, head_dim="")
    (tmp_path / "h.plan").write_text(text)
    checkpoints, first, mine = tmp_path / "ckpt", tmp_path / "first", tmp_path / "mine"
    assert main(["run", str(tmp_path / "h.plan"), "-o", str(tmp_path / "build"),
                 "--checkpoint-dir", str(checkpoints)]) == 0
    assert main(["export", str(checkpoints), "--format", "hf", "-o", str(first)]) == 0
    assert json.loads((first / "config.json").read_text())["planc"] == \
        "written by planc export --format hf"
    mine.mkdir()
    (mine / "model.safetensors").write_bytes((first / "model.safetensors").read_bytes())
    (mine / "config.json").write_text('{"my": "hand-written config"}')
    capfd.readouterr()
    for force in ([], ["--force"]):
        assert main(["export", str(checkpoints), "--format", "hf", "-o", str(mine),
                     *force]) == 2
        assert capfd.readouterr().err == (
            f"planc: error: -o {mine}/config.json: exists and is not a Hugging Face export "
            f"that planc wrote; planc never replaces such a file: name another path, or "
            f"remove it first\n")
        assert (mine / "config.json").read_text() == '{"my": "hand-written config"}'
    assert main(["export", str(checkpoints), "--format", "hf", "-o", str(first),
                 "--force"]) == 0

def test_export_refuses_values_past_the_dtypes_range(tmp_path, capfd):
    """A checkpoint's values are fp32; an fp16 model's export writes them as fp16, whose
    largest value is 65,504: one past it would load as inf, so nothing is written."""
    import hashlib
    import json

    from safetensors.torch import load_file, save_file

    text = PLAN.format(mesh="", kv=2, m=1, lr=0.1, head_dim="").replace(
        "norm_eps = 1e-6", "norm_eps = 1e-6; dtype = fp16")
    (tmp_path / "h.plan").write_text(text)
    checkpoints = tmp_path / "ckpt"
    assert main(["run", str(tmp_path / "h.plan"), "-o", str(tmp_path / "build"),
                 "--checkpoint-dir", str(checkpoints)]) == 0
    step = checkpoints / "step-000001"
    manifest = json.loads((step / "manifest.json").read_text())
    name = manifest["parameters"]["final_ln.weight"]["file"]
    tensors = load_file(step / name)
    tensors["final_ln.weight"][0] = 1e6
    save_file(tensors, step / name, metadata={"format": "pt"})
    data = (step / name).read_bytes()
    manifest["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    (step / "manifest.json").write_text(json.dumps(manifest))
    capfd.readouterr()
    assert main(["export", str(checkpoints), "--format", "hf", "-o",
                 str(tmp_path / "out")]) == 1
    assert capfd.readouterr().err == (
        f"planc: error: {step}: a value of model.norm.weight is beyond fp16's range (largest "
        f"65504), as the model's dtype writes it; nothing was written\n")
    assert not (tmp_path / "out").exists()
