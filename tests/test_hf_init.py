"""``train { init = "DIR" }`` (issue 26): a run starts from a Hugging Face checkpoint.

A tiny random ``LlamaForCausalLM`` or ``MixtralForCausalLM`` is built here and saved with
``save_pretrained(safe_serialization=True)`` (one file, or sharded with an index); ``planc
run --check`` starts from it under several layouts, and its first step's loss (the
metrics') must equal transformers' forward loss on the same batch (the runtime's batch of
step 0, as tests/test_transformers.py compares them) to a relative 1e-5, fp32's
agreement between two orders of summation, while the single-process reference, which
starts from the same checkpoint, must agree with every loss and parameter. ``planc
check`` refuses a directory that is not the plan's model with one line at ``init``'s
value, naming the field and both values.
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from planc.cli import main  # noqa: E402
from planc.lang import load_file  # noqa: E402
from planc.runtime.engine.data import batch_tokens  # noqa: E402

SIZES = dict(vocab_size=96, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
             max_position_embeddings=16, rms_norm_eps=1e-6, rope_theta=500000.0)
KEYS = {"layers": 3, "hidden": 32, "heads": 4, "kv_heads": 2, "ffn": 40, "vocab": 96,
        "seq": 16, "batch": 4, "rope_theta": 500000, "norm_eps": "1e-6"}
EXPERTS = {"experts": 4, "top_k": 2, "expert_ffn": 24}
PLAN = """plan hf_init {{
  model {family} {{ {model} }}
  mesh {{ {mesh} }}
  shard {{ {shard} }}
  schedule {{ microbatches = {m} }}
  train {{ steps = 2; optimizer = sgd(lr = 0.1, momentum = 0, weight_decay = 0); seed = 11; init = "{init}"{train} }}
}}
"""


def plan_text(family="llama", mesh="", shard="", m=1, init="hf", train="", **keys) -> str:
    """The plan; ``keys``: the model's keys that differ from KEYS (and EXPERTS);
    ``train``: more of the train block's entries."""
    values = {**KEYS, **(EXPERTS if family == "moe" else {}), **keys}
    model = "; ".join(f"{k} = {v}" for k, v in values.items())
    return PLAN.format(family=family, model=model, mesh=mesh, shard=shard, m=m, init=init,
                       train=train)


def save_llama(directory, kv=2, tie=False, shard=False) -> None:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**SIZES, intermediate_size=40, num_key_value_heads=kv,
                                      tie_word_embeddings=tie)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(directory, safe_serialization=True,
                          **({"max_shard_size": "40KB"} if shard else {}))


def mixtral(kv=2):
    torch.manual_seed(0)
    config = transformers.MixtralConfig(**SIZES, intermediate_size=24, num_key_value_heads=kv,
                                        num_local_experts=4, num_experts_per_tok=2)
    return transformers.MixtralForCausalLM(config)


def save_mixtral(directory, shard=False, in_memory_names=False) -> None:
    """As save_pretrained writes it (the Hub's per-expert w1, w2, w3), or with the names
    the class holds in memory (stacked experts.gate_up_proj), as planc export writes."""
    model = mixtral()
    if not in_memory_names:
        model.save_pretrained(directory, safe_serialization=True,
                              **({"max_shard_size": "100KB"} if shard else {}))
        return
    from safetensors.torch import save_file

    directory.mkdir()
    model.config.to_json_file(directory / "config.json")
    save_file({k: v.contiguous() for k, v in model.state_dict().items()},
              directory / "model.safetensors")


def transformers_loss(plan) -> float:
    """transformers' loss of the checkpoint ``init`` names on the runtime's batch of step 0."""
    cls = transformers.LlamaForCausalLM if plan.model.family == "llama" else \
        transformers.MixtralForCausalLM
    model = cls.from_pretrained(plan.train.init, attn_implementation="eager").float()
    tokens = batch_tokens(plan, 0)
    with torch.no_grad():
        logits = model(input_ids=tokens[:, :-1]).logits
        return torch.nn.functional.cross_entropy(
            logits.reshape(-1, plan.model.vocab).float(), tokens[:, 1:].reshape(-1)).item()


RUNS = {  # name: (plan_text arguments, how the checkpoint is saved)
    # (one rank: the Mixtral rows; llama's layouts compare with transformers as well)
    "llama-tp2-pp2-shared-kv-sharded-files": (
        {"kv_heads": 1, "mesh": "tp = 2; pp = 2", "m": 2}, lambda d: save_llama(d, kv=1, shard=True)),
    "llama-tp2-dp2-zero3-tied-evaluating": (
        {"tie_embeddings": "on", "mesh": "tp = 2; dp = 2", "shard": "dp { zero = 3 }",
         "train": "; eval_every = 1"},
        lambda d: save_llama(d, tie=True)),
    "mixtral-1-rank": ({"family": "moe"}, lambda d: save_mixtral(d)),
    "mixtral-in-memory-names": ({"family": "moe"}, lambda d: save_mixtral(
        d, in_memory_names=True)),
    "mixtral-tp2-dp2-ep2-sharded-files": (
        {"family": "moe", "mesh": "tp = 2; dp = 2; ep = 2"}, lambda d: save_mixtral(
            d, shard=True)),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_first_loss_equals_transformers_and_check_passes(name, tmp_path, capfd):
    arguments, save = RUNS[name]
    save(tmp_path / "hf")
    source, metrics = tmp_path / "init.plan", tmp_path / "m.jsonl"
    source.write_text(plan_text(**arguments))
    status = main(["run", str(source), "-o", str(tmp_path / "build"), "--metrics",
                   str(metrics), "--check", "--timeout", "60"])
    err = capfd.readouterr().err
    assert status == 0, err
    assert f"planc: started from Hugging Face checkpoint {tmp_path / 'hf'} in " in err
    assert "every loss and parameter matches" in err
    if "eval_every" in arguments.get("train", ""):  # evaluated from the same weights
        assert " and 2 evaluations against the single-process run" in err
    plan = load_file(source).plan
    first = json.loads(metrics.read_text().splitlines()[0])["loss"]
    assert first == pytest.approx(transformers_loss(plan), rel=1e-5)


@pytest.mark.slow
def test_resume_wins_over_init(tmp_path, capfd):
    """A checkpoint of the run continues it (as torchtitan prefers a checkpoint in the
    run's folder to its initial one), exactly: --check compares steps 1.. with the
    single process that starts from init."""
    save_llama(tmp_path / "hf")
    source, checkpoints = tmp_path / "init.plan", tmp_path / "ckpt"
    source.write_text(plan_text(mesh="tp = 2"))
    assert main(["run", str(source), "-o", str(tmp_path / "build"), "--steps", "1",
                 "--checkpoint-dir", str(checkpoints)]) == 0
    capfd.readouterr()
    assert main(["run", str(source), "-o", str(tmp_path / "build"), "--resume",
                 str(checkpoints), "--check"]) == 0
    err = capfd.readouterr().err
    assert "started from Hugging Face checkpoint" not in err
    assert "resumed from" in err and "every loss and parameter matches" in err


@pytest.mark.slow
def test_a_file_damaged_after_compile_stops_the_run_in_one_line(tmp_path, capfd):
    save_llama(tmp_path / "hf")
    source = tmp_path / "init.plan"
    source.write_text(plan_text(mesh="tp = 2"))
    assert main(["compile", str(source), "-o", str(tmp_path / "build")]) == 0
    weights = tmp_path / "hf" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    capfd.readouterr()
    assert main(["run", str(tmp_path / "build")]) == 1
    err = capfd.readouterr().err
    assert "Traceback" not in err
    assert f"planc: error: {weights} is truncated or damaged: model.norm.weight" in err


def test_a_build_whose_weights_no_longer_tile_their_file_starts_no_rank(tmp_path, capfd):
    save_llama(tmp_path / "hf")
    source = tmp_path / "init.plan"
    source.write_text(plan_text(mesh="tp = 2"))
    assert main(["compile", str(source), "-o", str(tmp_path / "build")]) == 0
    weights = tmp_path / "hf" / "model.safetensors"
    weights.write_bytes(weights.read_bytes() + bytes(8))  # bytes no tensor holds
    capfd.readouterr()
    assert main(["run", str(tmp_path / "build")]) == 1
    assert capfd.readouterr().err.splitlines() == [
        f"planc: error: {weights} is not a safetensors file (bytes 108416..108424 after the "
        f"header belong to no tensor); nothing was run"]


# --- planc check --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("init") / "hf"
    save_llama(directory)
    return directory


def _checked(tmp_path, capfd, text: str) -> tuple[int, str]:
    source = tmp_path / "init.plan"
    source.write_text(text)
    capfd.readouterr()  # what came before (transformers' progress bars)
    status = main(["check", str(source)])
    return status, capfd.readouterr().err


def _error_line(tmp_path, text: str, message: str) -> str:
    """The diagnostic's first line at the value of init (line 6)."""
    column = text.splitlines()[5].index("init = ") + len("init = ") + 1
    return f"{tmp_path / 'init.plan'}:6:{column}: error: init: {message}"


@pytest.mark.parametrize("keys,message", [
    ({"kv_heads": 1}, "config.json's num_key_value_heads is 2; the plan's model has "
                      "kv_heads = 1"),
    ({"tie_embeddings": "on"}, "config.json's tie_word_embeddings is false; the plan's model "
                               "has tie_embeddings = on"),
    ({"ffn": 48}, "config.json's intermediate_size is 40; the plan's model has ffn = 48"),
    ({"vocab": 128}, "config.json's vocab_size is 96; the plan's model has vocab = 128"),
    ({"rope_theta": 10000}, "config.json's rope_theta is 500000.0; the plan's model has "
                            "rope_theta = 10000.0"),
    ({"norm_eps": "1e-5"}, "config.json's rms_norm_eps is 1e-06; the plan's model has "
                           "norm_eps = 1e-05"),
    ({"layers": 4}, "config.json's num_hidden_layers is 3; the plan's model has layers = 4"),
    ({"hidden": 64}, "config.json's hidden_size is 32; the plan's model has hidden = 64"),
    ({"heads": 8}, "config.json's num_attention_heads is 4; the plan's model has heads = 8"),
], ids=lambda v: "-".join(v) if isinstance(v, dict) else None)
def test_check_names_the_field_that_disagrees(keys, message, llama_dir, tmp_path, capfd):
    text = plan_text(init=str(llama_dir), **keys)
    status, err = _checked(tmp_path, capfd, text)
    assert status == 1
    assert err.splitlines()[0] == _error_line(tmp_path, text, f"{llama_dir}: {message}")
    assert "Traceback" not in err


GONE = "(removed)"  # a key of config.json that a change removes


def _configured(llama_dir, tmp_path, changes: dict):
    """A copy of the checkpoint with ``changes`` to its config.json."""
    hf = _copy(llama_dir, tmp_path / "hf")
    config = {**json.loads((hf / "config.json").read_text()), **changes}
    (hf / "config.json").write_text(json.dumps({k: v for k, v in config.items()
                                                if v != GONE}))
    return hf


def test_check_names_a_number_written_as_null(llama_dir, tmp_path, capfd):
    """rms_norm_eps written as null is not the default: the message said "config.json's
    rms_norm_eps is 1e-06", the default it had put in its place. A null that transformers
    computes (num_key_value_heads, head_dim) still reads as its default."""
    hf = _configured(llama_dir, tmp_path, {"rms_norm_eps": None})
    status, err = _checked(tmp_path, capfd, plan_text())
    assert status == 1
    assert err.splitlines()[0] == _error_line(tmp_path, plan_text(), (
        f"{hf}: config.json's rms_norm_eps is null; the plan's model has norm_eps = 1e-06"))
    (tmp_path / "computed").mkdir()
    _configured(llama_dir, tmp_path / "computed", {"head_dim": None})
    status, err = _checked(tmp_path / "computed", capfd, plan_text(
        init=str(tmp_path / "computed" / "hf")))
    assert status == 0, err


PLAIN = "planc's llama has plain RoPE (rope_type 'default', no scaling)"
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("changes,message", [
    ({"rope_scaling": LLAMA3}, f"config.json's RoPE is 'llama3'; {PLAIN}"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}},
     f"config.json's RoPE is 'linear'; {PLAIN}"),
    ({"rope_scaling": 5}, f"config.json's rope_scaling is 5; {PLAIN}"),
    ({"rope_scaling": {"factor": 2.0}}, f'config.json\'s rope_scaling is {{"factor": 2.0}}; '
                                        f'{PLAIN}'),
    # transformers 4's config.json: rope_theta and rope_scaling, no rope_parameters
    ({"rope_parameters": GONE, "rope_theta": 500000.0, "rope_scaling": LLAMA3},
     f"config.json's RoPE is 'llama3'; {PLAIN}"),
    ({"rope_parameters": [500000.0]}, f"config.json's rope_parameters is [500000.0]; {PLAIN}"),
], ids=["llama3", "linear", "a-number", "no-type", "transformers-4", "parameters-a-list"])
def test_check_refuses_a_rope_scaling_planc_does_not_implement(changes, message, llama_dir,
                                                                tmp_path, capfd):
    hf = _configured(llama_dir, tmp_path, changes)
    status, err = _checked(tmp_path, capfd, plan_text())
    assert status == 1
    assert err.splitlines()[0] == _error_line(tmp_path, plan_text(), f"{hf}: {message}")
    assert "Traceback" not in err


@pytest.mark.parametrize("changes", [
    {"rope_scaling": None}, {"rope_scaling": {"rope_type": "default"}},
    {"rope_parameters": GONE, "rope_theta": 500000.0},
    {"rope_parameters": GONE, "rope_theta": 500000.0, "rope_scaling": None},
], ids=["rope_scaling-null", "rope_scaling-default", "transformers-4", "transformers-4-null"])
def test_check_accepts_plain_rope(changes, llama_dir, tmp_path, capfd):
    _configured(llama_dir, tmp_path, changes)
    status, err = _checked(tmp_path, capfd, plan_text())
    assert status == 0, err


def test_check_refuses_another_family(llama_dir, tmp_path, capfd):
    text = plan_text("moe", init=str(llama_dir))
    status, err = _checked(tmp_path, capfd, text)
    assert status == 1
    assert err.splitlines()[0] == _error_line(tmp_path, text, (
        f"{llama_dir}: config.json's model_type is \"llama\"; model moe starts from a "
        f"\"mixtral\" checkpoint (MixtralForCausalLM)"))
    text = plan_text("gpt", init=str(llama_dir)).replace("kv_heads = 2; ", "").replace(
        "; rope_theta = 500000; norm_eps = 1e-6", "")
    status, err = _checked(tmp_path, capfd, text)
    assert status == 1
    assert err.splitlines()[0] == _error_line(tmp_path, text, (
        "init starts llama (LlamaForCausalLM or, with qk_norm, Qwen3ForCausalLM), moe "
        "(MixtralForCausalLM or, with qk_norm, Qwen3MoeForCausalLM) and deepseek "
        "(DeepseekV3ForCausalLM) models from a "
        "Hugging Face checkpoint; model gpt has no transformers class"))


def test_check_refuses_a_moe_model_mixtral_cannot_hold(tmp_path, capfd):
    text = plan_text("moe", shared_experts=1)
    status, err = _checked(tmp_path, capfd, text)
    assert status == 1
    assert err.splitlines()[0] == _error_line(tmp_path, text, (
        f"model moe with shared_experts = 1 cannot start from a MixtralForCausalLM checkpoint "
        f"(Mixtral has no shared experts); it needs shared_experts = 0; and no such "
        f"directory: {tmp_path}/hf"))
    # Qwen3's mixture says its own name; a directory that is not there is said too
    text = plan_text("moe", shared_experts=1, qk_norm="on", init="nowhere")
    status, err = _checked(tmp_path, capfd, text)
    assert status == 1
    assert err.splitlines()[0] == _error_line(tmp_path, text, (
        f"model moe with shared_experts = 1 cannot start from a Qwen3MoeForCausalLM "
        f"checkpoint (Qwen3-MoE has no shared experts); it needs shared_experts = 0; and no "
        f"such directory: {tmp_path}/nowhere"))


def test_a_relative_directory_is_the_plan_files(llama_dir, tmp_path, capfd):
    (tmp_path / "weights").symlink_to(llama_dir, target_is_directory=True)
    status, err = _checked(tmp_path, capfd, plan_text(init="weights"))
    assert status == 0, err
    assert load_file(tmp_path / "init.plan").plan.train.init == str(tmp_path / "weights")
    status, err = _checked(tmp_path, capfd, plan_text(init="elsewhere"))
    assert status == 1
    assert err.splitlines()[0] == _error_line(tmp_path, plan_text(init="elsewhere"), (
        f"no such directory: {tmp_path / 'elsewhere'}"))


def _copy(source, target):
    target.mkdir()
    for file in source.iterdir():
        (target / file.name).write_bytes(file.read_bytes())
    return target


def test_check_refuses_a_missing_tensor_a_shape_and_a_dtype(llama_dir, tmp_path, capfd):
    from safetensors.torch import load_file as load_tensors, save_file

    hf = _copy(llama_dir, tmp_path / "hf")
    name = "model.layers.2.mlp.down_proj.weight"
    tensors = load_tensors(hf / "model.safetensors")
    for value, message in [
            (None, f"{hf} has no tensor {name} (of shape [32, 40])"),
            (torch.zeros(40, 32), f"{hf}: {name} in model.safetensors has shape [40, 32]; "
                                  f"the plan's model needs [32, 40]"),
            (torch.zeros(32, 40, dtype=torch.int64),
             f"{hf}: {name} in model.safetensors is I64; planc starts from F32, BF16, F16 "
             f"tensors")]:
        tensors.pop(name)
        save_file(tensors if value is None else {**tensors, name: value},
                  hf / "model.safetensors")
        tensors[name] = value
        status, err = _checked(tmp_path, capfd, plan_text())
        assert status == 1
        assert err.splitlines()[0] == _error_line(tmp_path, plan_text(), message)


def _rewrite(path, change, tail: bytes = b"") -> None:
    """The safetensors file ``path`` with its header changed by ``change(header)`` (padded
    with spaces to a multiple of 8 bytes, as safetensors pads it) and ``tail`` appended to
    its data."""
    data = path.read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + length])
    change(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + data[8 + length:] + tail)


def _set_header(hf, key, value) -> None:
    _rewrite(hf / "model.safetensors", lambda header: header.update({key: value}))


@pytest.mark.parametrize("damage,message", [
    (lambda hf: (hf / "config.json").unlink(), "{hf} has no config.json"),
    (lambda hf: (hf / "config.json").write_text("{"), "{hf}/config.json is not JSON "
     "(Expecting property name enclosed in double quotes: line 1 column 2 (char 1))"),
    (lambda hf: (hf / "model.safetensors").unlink(), "{hf} holds neither model.safetensors "
     "nor model.safetensors.index.json (a Hugging Face checkpoint saved with "
     "safe_serialization=True)"),
    (lambda hf: (hf / "model.safetensors").write_bytes(b"\xff" * 16),
     "{hf}/model.safetensors is not a safetensors file (its header would take "
     "18446744073709551615 bytes of the 8 after its length)"),
    (lambda hf: (hf / "model.safetensors").write_bytes(
        (hf / "model.safetensors").read_bytes()[:-4]),
     "{hf}/model.safetensors is truncated or damaged: model.norm.weight (F32 [32], 128 "
     "bytes) would lie at bytes 108288..108416 of the 108412 after the header"),
    # the safetensors format: the tensors tile the data after the header, each beginning
    # where the previous ends, and __metadata__ maps strings to strings
    (lambda hf: _set_header(hf, "model.embed_tokens.weight", {
        "dtype": "F32", "shape": [96, 32], "data_offsets": [0, 12288]}),
     "{hf}/model.safetensors is not a safetensors file (model.embed_tokens.weight at bytes "
     "0..12288 after the header overlaps lm_head.weight at bytes 0..12288)"),
    (lambda hf: _rewrite(hf / "model.safetensors", lambda header: None, tail=b"\0" * 8),
     "{hf}/model.safetensors is not a safetensors file (bytes 108416..108424 after the header "
     "belong to no tensor)"),
    (lambda hf: _rewrite(hf / "model.safetensors", lambda header: header.pop(
        "model.layers.0.input_layernorm.weight")),
     "{hf}/model.safetensors is not a safetensors file (bytes 24576..24704 after the header "
     "belong to no tensor)"),
    (lambda hf: _set_header(hf, "__metadata__", {"format": 1}),
     "{hf}/model.safetensors is not a safetensors file (its __metadata__ is not a map of "
     "strings to strings)"),
    (lambda hf: _set_header(hf, "__metadata__", "pt"),
     "{hf}/model.safetensors is not a safetensors file (its __metadata__ is not a map of "
     "strings to strings)"),
], ids=["no-config", "bad-config", "no-weights", "not-safetensors", "truncated",
        "overlapping", "trailing-bytes", "a-gap", "metadata-not-strings", "metadata-not-a-map"])
def test_check_refuses_a_damaged_directory(damage, message, llama_dir, tmp_path, capfd):
    hf = _copy(llama_dir, tmp_path / "hf")
    damage(hf)
    status, err = _checked(tmp_path, capfd, plan_text())
    assert status == 1
    assert err.splitlines()[0] == _error_line(tmp_path, plan_text(), message.format(hf=hf))
    assert "Traceback" not in err


def test_init_is_a_path_in_quotes_and_shows_in_the_settings(llama_dir, tmp_path, capfd):
    text = plan_text().replace('init = "hf"', "init = 3")
    status, err = _checked(tmp_path, capfd, text)
    assert status == 1
    assert err.splitlines()[0] == _error_line(tmp_path, text, "").replace(
        "init: ", "expected a Hugging Face checkpoint directory's path in quotes, got the "
        "number 3")
    source = tmp_path / "init.plan"
    source.write_text(plan_text(init=str(llama_dir)))
    assert main(["check", "-v", str(source)]) == 0
    assert f"seed 11, data synthetic, init {llama_dir}, shuffle off," in capfd.readouterr().out


def test_plan_json_holds_init_only_when_given(llama_dir, tmp_path):
    from planc.plan.plan_json import plan_from_dict

    plan = load_file(_write(tmp_path, plan_text(init=str(llama_dir)))).plan
    assert plan.to_dict()["train"]["init"] == str(llama_dir)
    assert plan.to_dict()["train"]["init_form"] == "memory"  # llama: the same names
    assert plan_from_dict(plan.to_dict()) == plan
    plain = load_file(_write(tmp_path, plan_text().replace('; init = "hf"', ""))).plan
    assert "init" not in plain.to_dict()["train"] and plain.train.init is None


def _write(tmp_path, text: str):
    source = tmp_path / "init.plan"
    source.write_text(text)
    return source


def test_a_directory_of_links_is_read_as_the_hub_cache_holds_it(llama_dir, tmp_path, capfd):
    """huggingface_hub's cache (snapshots/REVISION/) links each file to its blob."""
    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    for file in llama_dir.iterdir():
        (snapshot / file.name).symlink_to(file)
    status, err = _checked(tmp_path, capfd, plan_text(init="snapshot"))
    assert status == 0, err


@pytest.mark.parametrize("changes,message", [
    ({"sliding_window": 8}, "config.json's sliding_window is 8; planc attends to all 16 "
                            "tokens of a sequence (seq = 16)"),
    ({"num_experts_per_tok": 1}, "config.json's num_experts_per_tok is 1; the plan's model "
                                 "has top_k = 2"),
    ({"num_local_experts": 8}, "config.json's num_local_experts is 8; the plan's model has "
                               "experts = 4"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0}},
     "config.json's RoPE is 'llama3'; planc's moe has plain RoPE (rope_type 'default', no "
     "scaling)"),
], ids=["sliding_window", "top_k", "experts", "rope_scaling"])
def test_check_compares_mixtrals_keys(changes, message, tmp_path, capfd):
    hf = tmp_path / "hf"
    save_mixtral(hf)
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, **changes}))
    status, err = _checked(tmp_path, capfd, plan_text("moe"))
    assert status == 1
    assert err.splitlines()[0] == _error_line(tmp_path, plan_text("moe"), f"{hf}: {message}")
