"""DeepSeek-V3's auxiliary-loss-free balancing (issue 40): ``model moe { bias_update }``.
The bias steers the choice as transformers' ``DeepseekV3TopkRouter`` does with its
``e_score_correction_bias``; it moves by the sign of (mean - load) after every step, by
steps and an all-reduce the compiler writes and the verifier proves; training with it
matches the one-process reference, and a checkpoint carries it."""

from __future__ import annotations

import copy
import json

import pytest

from planc.cli import main
from planc.compile import compile_plan
from planc.graph.router_bias import bias_nodes
from planc.lang import load_text
from planc.program.program import Program
from planc.verify.verifier import verify
from tests.test_moe_sigmoid_gate import deepseek_mixture, random_weights

torch = pytest.importorskip("torch")

PLAN = """plan balanced {
  model moe {
    layers = LAYERS; hidden = 64; heads = 4; kv_heads = 2; vocab = 128; seq = 32; batch = 8
    experts = 8; top_k = 2; expert_ffn = 48; shared_experts = 1; first_dense = 1; ffn = 128
    score = sigmoid; routed_scale = 2.5; bias_update = 0.01
  }
  mesh { MESH }
  shard { tp { sequence_parallel = SP } }
  schedule { microbatches = 2 }
  train { steps = 4; optimizer = sgd(lr = 0.1, momentum = 0.9); seed = 0 }
}
"""


def plan_text(mesh: str = "tp = 2; dp = 2; ep = 4", layers: int = 3, sp: str = "on") -> str:
    return PLAN.replace("MESH", mesh).replace("LAYERS", str(layers)).replace("SP", sp)


def built(text: str):
    loaded = load_text(text)
    assert loaded.ok, loaded.diagnostics
    return compile_plan(loaded.plan)


# --- the rule -------------------------------------------------------------------------------

@pytest.mark.parametrize("groups", [None, (4, 2)])
def test_the_bias_chooses_as_deepseek_v3s_router(groups):
    from planc.runtime.families.moe import mixture
    from planc.runtime.families.moe_gate import route

    extra = "" if groups is None else f"; expert_groups = {groups[0]}; route_groups = {groups[1]}"
    m = load_text(plan_text().replace("bias_update = 0.01", "bias_update = 0.01" + extra)
                  ).plan.model
    generator = torch.Generator().manual_seed(5)
    weights = random_weights(m, generator)
    bias = torch.randn(8, generator=generator) * 0.3
    tokens = torch.randn(40, m.hidden, generator=generator)
    theirs = deepseek_mixture(m, weights, groups or (1, 1))
    with torch.no_grad():
        theirs.gate.e_score_correction_bias.copy_(bias)
        _, their_weights, their_experts = theirs.gate(tokens)
        expected = theirs(tokens.unsqueeze(0)).squeeze(0)
    experts, ours = route(tokens, weights["router.weight"], 2, True, "sigmoid", 2.5, groups,
                          bias)
    unbiased = route(tokens, weights["router.weight"], 2, True, "sigmoid", 2.5, groups)[0]
    assert not torch.equal(unbiased.sort(-1).values, experts.sort(-1).values)  # it steers
    order = their_experts.sort(-1)
    assert torch.equal(experts.sort(-1).values, order.values)
    # the weights are the chosen experts' unbiased scores, normalised, x 2.5
    assert torch.allclose(ours.gather(-1, experts.sort(-1).indices),
                          their_weights.gather(-1, order.indices), rtol=1e-6, atol=1e-7)
    assert torch.allclose(ours.sum(-1), torch.full((40,), 2.5), rtol=1e-6)
    assert torch.allclose(mixture(tokens, weights.__getitem__, m, bias=bias), expected,
                          rtol=1e-5, atol=1e-6)


def test_the_update_moves_each_bias_by_the_sign_of_mean_minus_load():
    from planc.runtime.families.moe_gate import update_bias

    bias = torch.tensor([0.5, 0.0, -0.25, 0.0], dtype=torch.float32)
    update_bias(bias, torch.tensor([3.0, 1.0, 2.0, 2.0], dtype=torch.float64), 0.125)
    assert bias.tolist() == [0.375, 0.125, -0.25, 0.0]  # mean 2: down, up, stays, stays
    # a positive factor on every load (tp copies counting the same tokens) changes nothing
    again = torch.tensor([0.5, 0.0, -0.25, 0.0], dtype=torch.float32)
    update_bias(again, torch.tensor([6.0, 2.0, 4.0, 4.0], dtype=torch.float64), 0.125)
    assert torch.equal(again, bias)


def test_bias_update_reads_a_number_at_least_zero_and_is_written_only_when_set():
    loaded = load_text(plan_text().replace("bias_update = 0.01", "bias_update = -1"))
    assert not loaded.ok
    assert "expected a number >= 0, got -1" in str(loaded.diagnostics[0])
    plain = load_text(plan_text().replace("; bias_update = 0.01", "")).plan
    assert "bias_update" not in plain.model.options


# --- the graph and the programs -------------------------------------------------------------

def test_each_stage_with_mixtures_counts_sums_over_the_stage_and_updates_in_its_epilogue():
    # pp 2 over 4 layers: stage 0 holds the dense layer 0 and the mixture 1, stage 1 two
    build = built(plan_text("tp = 2; pp = 2; dp = 2; ep = 4", layers=4))
    for stage, layers in ((0, [1]), (1, [2, 3])):
        load, total, update = bias_nodes(stage)
        graph = build.graph
        assert graph.nodes[load]["router_layers"] == layers
        assert graph.nodes[total]["bytes"] == 8 * len(layers) * 8  # fp64 per (block, expert)
        assert graph.nodes[total]["group_size"] == 4
        assert graph.nodes[update]["bias_update"] == 0.01
        # after every forward of the stage's mixtures
        mixtures = {u for u, _ in graph.in_edges(load)}
        assert mixtures and all(graph.nodes[u]["op"] == "moe" for u in mixtures)
        program = build.programs[f"stage{stage}.json"]
        epilogue = [i.node for i in program.epilogue if i.op.value not in ("record", "wait")]
        assert epilogue[:3] == [load, total, update]
        (summed,) = [i for i in program.epilogue if i.node == total]
        assert summed.operands.group == "stage" and summed.operands.payload == "router_load"
    assert verify(build.plan, build.graph, build.programs, build.table, build.groups,
                  build.routes).problems == []


def test_a_stage_without_mixtures_and_a_plan_without_bias_have_no_such_steps():
    build = built(plan_text("tp = 2; pp = 2; dp = 2; ep = 4", layers=4).replace(
        "first_dense = 1", "first_dense = 2"))
    assert bias_nodes(0)[0] not in build.graph and bias_nodes(1)[0] in build.graph
    plain = built(plan_text().replace("; bias_update = 0.01", ""))
    assert not [n for n in plain.graph if "router_" in n]


def _run(tmp_path, *args: str) -> int:
    return main(["run", str(tmp_path / "b.plan"), "-o", str(tmp_path / "b"), *args])


def _problems(build, name: str, change) -> list[str]:
    data = copy.deepcopy(build.programs[name].to_json())
    change(data)
    programs = {**build.programs, name: Program.from_json(data)}
    return verify(build.plan, build.graph, programs, build.table, build.groups,
                  build.routes).problems


def test_an_update_before_the_sum_and_a_missing_sum_are_refused():
    build = built(plan_text())
    (name,) = build.programs
    load, total, update = bias_nodes(0)

    def swap(data):
        epilogue = data["epilogue"]
        at = {i.get("node"): k for k, i in enumerate(epilogue) if i["op"] == "compute" or
              i["op"] == "all_reduce"}
        epilogue[at[total]], epilogue[at[update]] = epilogue[at[update]], epilogue[at[total]]

    assert f"program {name}: the balancing bias runs compute {load} on stream compute, " \
           f"all_reduce {total} on stream comm and compute {update} on stream compute out " \
           f"of that order" in _problems(build, name, swap)

    def drop(data):
        data["epilogue"] = [i for i in data["epilogue"] if i.get("node") != total]

    assert _problems(build, name, drop)[:3] == [
        f"ranks 0, 1, 2, 3 ({name}): {total} is never issued; every node of stage 0 runs "
        f"exactly once per step (per microbatch in its block)",
        f"ranks 0, 1, 2, 3 ({name}): epilogue records done:{total} on stream comm where "
        f"{total} has not run on that stream before it: the event would say {total} "
        f"finished while it may still run",
        f"program {name}: 0 instructions all-reduces the expert loads once per step in the "
        f"epilogue; bias_update = 0.01 needs exactly one, after the step's last forward"]


# --- training -------------------------------------------------------------------------------

@pytest.mark.parametrize("mesh, sp", [
    ("tp = 2; dp = 2; ep = 4", "on"),  # each tp rank routes its share of the tokens
    # without ep or sequence parallelism the mixture runs whole on each tp rank, on the
    # same tokens: every count doubled (ep > 1 would split the tokens over tp)
    ("tp = 2; dp = 2", "off"),
], ids=["tp2-sp-dp2-ep4", "tp2-dp2-replicated"])
def test_training_with_the_bias_matches_the_reference(tmp_path, mesh, sp, capsys):
    (tmp_path / "b.plan").write_text(plan_text(mesh, sp=sp))
    assert _run(tmp_path, "--check") == 0
    assert "every loss and parameter matches" in capsys.readouterr().err


def test_a_checkpoint_carries_the_bias_and_a_resumed_run_matches(tmp_path, capsys):
    (tmp_path / "b.plan").write_text(plan_text("tp = 2; pp = 2; ep = 2", layers=4))
    checkpoints = tmp_path / "ck"
    assert _run(tmp_path, "--checkpoint-dir", str(checkpoints), "--checkpoint-every", "2") == 0
    manifest = json.loads((checkpoints / "step-000002" / "manifest.json").read_text())
    assert manifest["buffers"] == {
        "layers.1.router.balance_bias": {"file": "model-00000-of-00002.safetensors",
                                         "shape": [8]},
        "layers.2.router.balance_bias": {"file": "model-00001-of-00002.safetensors",
                                         "shape": [8]},
        "layers.3.router.balance_bias": {"file": "model-00001-of-00002.safetensors",
                                         "shape": [8]}}
    from safetensors.torch import load_file

    saved = [value.tolist() for file in ("model-00000-of-00002", "model-00001-of-00002")
             for name, value in load_file(str(checkpoints / "step-000002" /
                                              f"{file}.safetensors")).items()
             if name.endswith("balance_bias")]
    # two updates of 0.01 each: every bias is -0.02, 0 or 0.02, and the routing moved some
    values = [v * 100 for bias in saved for v in bias]
    assert len(values) == 24
    assert all(round(v) in (-2, 0, 2) and abs(v - round(v)) < 1e-4 for v in values)
    assert any(round(v) for v in values)
    capsys.readouterr()
    # the reference trains from step 0: the check fails unless the bias was restored
    assert _run(tmp_path, "--resume", str(checkpoints / "step-000002"), "--check") == 0
    assert "every loss and parameter matches" in capsys.readouterr().err


def test_a_checkpoint_without_its_bias_is_refused(tmp_path, capfd):
    (tmp_path / "b.plan").write_text(plan_text("dp = 2; ep = 2", layers=2))
    checkpoints = tmp_path / "ck"
    assert _run(tmp_path, "--checkpoint-dir", str(checkpoints), "--checkpoint-every", "2") == 0
    step = checkpoints / "step-000002"
    manifest = json.loads((step / "manifest.json").read_text())
    del manifest["buffers"]["layers.1.router.balance_bias"]
    (step / "manifest.json").write_text(json.dumps(manifest))
    capfd.readouterr()
    assert _run(tmp_path, "--resume", str(step)) == 1
    assert capfd.readouterr().err == (
        f"planc: error: --resume: {step / 'manifest.json'}: buffers is {{}}, not an object "
        f"naming at least one buffer\n")
    del manifest["buffers"]
    (step / "manifest.json").write_text(json.dumps(manifest))
    assert _run(tmp_path, "--resume", str(step)) == 1
    assert capfd.readouterr().err == (
        f"planc: error: --resume: {step / 'model-00000-of-00001.safetensors'} holds "
        f"\"layers.1.router.balance_bias\", which the manifest does not list\n")


def test_node_limited_routing_with_the_bias_trains_on_two_nodes(tmp_path, capsys):
    """DeepSeek-V3's gate whole on a 2-"node" topology: ep 4 over both nodes, the experts
    in 2 groups of 4 (one a node's), each token's experts from its 1 best group, with the
    balancing bias; --check against one process."""
    text = plan_text("dp = 4; ep = 4").replace(
        "bias_update = 0.01", "bias_update = 0.01; expert_groups = 2; route_groups = 1"
    ).replace("  mesh {", "  topology { nodes = 2; devices_per_node = 2 }\n  mesh {")
    (tmp_path / "b.plan").write_text(text)
    assert _run(tmp_path, "--check") == 0
    assert "every loss and parameter matches" in capsys.readouterr().err


def test_a_node_lost_is_recovered_with_its_biases_from_a_peers_memory(tmp_path):
    """The balancing biases travel with each stage's copy in peer memory: a run that loses
    node 0 (both stages' writers) goes on from node 1's copy and still matches one
    process from step 0, which it cannot without the biases."""
    from tests.test_replan import Run, node_zero_lost

    text = plan_text("tp = 2; pp = 2; dp = 2; ep = 2", layers=4).replace(
        "steps = 4", "steps = 10").replace(
        "  mesh {", "  topology { nodes = 2; devices_per_node = 4 }\n  mesh {")
    (tmp_path / "b.plan").write_text(text)
    run = Run(str(tmp_path / "b.plan"), "-o", str(tmp_path / "b"), "--metrics",
              str(tmp_path / "m.jsonl"), "--checkpoint-dir", str(tmp_path / "ck"),
              "--checkpoint-every", "4", "--on-failure", "replan", "--check",
              "--checkpoint-peer-memory")
    out, history = node_zero_lost(run, tmp_path / "m.jsonl", 6)
    (recovery,) = [r["recovery"] for r in history if "recovery" in r]
    assert recovery["resumed_step"] > 4, out  # from the copy, newer than the file's
    assert "every loss and parameter matches" in out


def test_the_metrics_record_the_busiest_experts_load_the_same_on_every_layout(tmp_path):
    """moe_expert_imbalance: the busiest expert's load over the mean, the worst block, as
    the update read the step's loads; at step 0 (the same weights) the same number on
    tp 2 x dp 2 x ep 4 (sequence parallel), tp 2 x dp 2 (every count doubled) and pp 2."""
    values = []
    for mesh, sp in (("tp = 2; dp = 2; ep = 4", "on"), ("tp = 2; dp = 2", "off"),
                     ("pp = 2; dp = 2", "on")):
        (tmp_path / "b.plan").write_text(plan_text(mesh, sp=sp))
        metrics = tmp_path / f"{len(values)}.jsonl"
        assert _run(tmp_path, "--force", "--steps", "1", "--metrics", str(metrics)) == 0
        (record,) = [json.loads(line) for line in metrics.read_text().splitlines()]
        values.append(record["moe_expert_imbalance"])
    assert values[0] > 1 and values == [values[0]] * 3, values


def test_planc_plot_draws_the_experts_balance(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    (tmp_path / "b.plan").write_text(plan_text("dp = 2; ep = 2"))
    assert _run(tmp_path, "--steps", "2", "--metrics", str(tmp_path / "m.jsonl")) == 0
    capsys.readouterr()
    assert main(["plot", str(tmp_path / "m.jsonl"), "--metric", "moe_expert_imbalance",
                 "-o", str(tmp_path / "b.png")]) == 0
    assert (tmp_path / "b.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert capsys.readouterr().err == (f"planc: moe_expert_imbalance of 1 run written to "
                                       f"{tmp_path / 'b.png'}\n")
