"""optimize { recompute_activation }: a dense MLP's activation output (llama's SwiGLU
product, gpt's GeLU) is not kept for the down projection's backward but computed again
from the activation's input (what torchtitan's per-op selective checkpointing recomputes):
the check's messages, the model table, the estimate and the simulator's price, how often
a rank computes it again, and training that computes the same bits."""

from __future__ import annotations

import json
import textwrap

import pytest

from planc.cli import main
from planc.estimate.kernel_cost import KernelModel
from planc.estimate.in_flight import layers_in_flight
from planc.estimate.memory import layer_activation_bytes, stage_activation_bytes
from planc.lang import load_text
from planc.lower.tabulate_model import model_table
from planc.program.model_table import ModelTable
from tests.conftest import one_rank_printed, run_ranks
from tests.test_llama import plan_text
from tests.test_moe import plan_text as moe_plan_text

ON = "recompute_activation = on"
GPT = ("plan g {{ model gpt {{ layers = 2; hidden = 32; heads = 4; vocab = 64; seq = 8; "
       "batch = 4 }} mesh {{ {mesh} }} {topology} schedule {{ microbatches = 2 }} "
       "optimize {{ {optimize} }} }}")


def gpt_two_chunks_a_stage(pipeline: str, optimize: str) -> str:
    """GPT of 4 layers over pp 2, two chunks a stage, under ``pipeline``: the plan the
    trained-bits tests compare with and without a key."""
    return GPT.format(mesh="pp = 2", topology="", optimize=optimize).replace(
        "microbatches = 2", f"microbatches = 2; pipeline = {pipeline}").replace(
        "plan g {", "plan trained {").replace("layers = 2", "layers = 4").replace(
        "mesh {", "shard { pp { virtual = 2 } } mesh {")


def _warnings(source: str) -> list[str]:
    return [d.message for d in load_text(source).diagnostics if d.severity == "warning"]


@pytest.mark.parametrize("source,why", [
    (moe_plan_text(optimize=ON), "every block is a mixture (first_dense = 0)"),
    (plan_text("p", optimize=f"recompute = full; {ON}"),
     "recompute = full keeps only each block's input"),
    (plan_text("p", model="; fp8 = blockwise", optimize=ON),
     "FP8 down projections keep FP8 codes of their input"),
])
def test_where_no_dense_mlp_keeps_its_output_the_key_is_warned_about(source, why):
    assert _warnings(source) == [f"recompute_activation = on has no effect: {why}"]
    plan = load_text(source).plan
    assert not plan.recomputes_activation
    assert not model_table(plan).recompute_activation


@pytest.mark.parametrize("source", [
    plan_text("p", optimize=ON), GPT.format(mesh="", topology="", optimize=ON),
    moe_plan_text(layers=2, dense=1, optimize=ON),
    plan_text("p", mesh="pp = 2", m=4, schedule="; pipeline = zb1p", optimize=ON)],
    ids=["llama", "gpt", "moe-first-dense", "llama-zb1p"])
def test_a_dense_mlp_takes_it_silently_and_the_model_table_carries_it(source):
    assert _warnings(source) == []
    table = model_table(load_text(source).plan)
    assert table.recompute_activation
    written = table.to_json()
    assert written["kernels"] == {"recompute_activation": True}
    assert ModelTable.from_json(json.loads(json.dumps(written))).recompute_activation


def test_a_model_table_with_an_unknown_kernel_option_is_refused():
    written = model_table(load_text(plan_text("p", optimize=ON)).plan).to_json()
    written["kernels"]["recompute_everything"] = True
    with pytest.raises(ValueError, match="its kernels are not {'compile', "
                                         "'recompute_moe_activation', 'recompute_activation', "
                                         "'recompute_norms'}"):
        ModelTable.from_json(written)


@pytest.mark.parametrize("family", ["llama", "gpt"])
def test_the_estimate_drops_down_s_input_of_every_block_but_one(family):
    """Per block and microbatch, down's input: tokens x ffn over tp, in the dtype (fp32);
    a stage holds every block's of every microbatch in flight less one block's, which its
    backward makes again for a moment."""
    def plan(optimize: str):
        if family == "llama":  # ffn 48, 16 x 4 tokens a microbatch
            return load_text(plan_text("p", mesh="tp = 2; pp = 2", m=2,
                                       optimize=f"tp_overlap = off; {optimize}")).plan
        return load_text(GPT.format(mesh="tp = 2; pp = 2", topology="",
                                    optimize=f"tp_overlap = off; {optimize}")).plan
    keep, again = plan(""), plan(ON)
    ffn, tokens = (48, 16 * 4) if family == "llama" else (128, 8 * 2)
    down_input = tokens * ffn * 4 / 2
    assert layer_activation_bytes(keep) - layer_activation_bytes(again) == down_input
    for stage in range(keep.mesh.pp):
        (held, _), (held_again, _) = (stage_activation_bytes(p, stage) for p in (keep, again))
        assert held - held_again == (layers_in_flight(keep, stage) - 1) * down_input


def test_a_stage_of_the_head_alone_holds_no_output_made_again():
    """The last stage holds the head alone: no block's backward computes an output again
    there, so its estimate is the same with the key; the stages of blocks hold less."""
    def plan(optimize: str):
        return load_text(plan_text("p", mesh="pp = 3", m=4,
                                   shard="pp { stages = [0..1, 2..3, head] }",
                                   optimize=optimize)).plan
    keep, again = plan(""), plan(ON)
    assert again.layers_of_stage(2) == ()
    assert stage_activation_bytes(again, 2) == stage_activation_bytes(keep, 2)
    for stage in (0, 1):
        assert stage_activation_bytes(again, stage)[0] < stage_activation_bytes(keep, stage)[0]


H100 = "topology { preset = dgx-h100; nodes = 1; devices_per_node = 2 }"


@pytest.mark.parametrize("step,split", [("backward", False), ("backward", True),
                                        ("weight", True), ("forward", False)])
@pytest.mark.parametrize("family,reads", [("llama", 2), ("gpt", 1)])
def test_the_simulator_prices_the_output_again_wherever_down_s_backward_unpacks_it(
        step, split, family, reads):
    """The activation's inputs read (SwiGLU: gate and up; GeLU: one) and its output
    written, over down's tokens and its input features on the tp rank, a launch with it;
    in the backward, or in a split backward's input half, which holds it for the weight
    half; none in the forward."""
    def model(optimize: str) -> KernelModel:
        if family == "llama":
            text = plan_text("p", mesh="tp = 2", optimize=f"tp_overlap = off; {optimize}").replace(
                "mesh {", H100 + "\n  mesh {")
        else:
            text = GPT.format(mesh="tp = 2", topology=H100,
                              optimize=f"tp_overlap = off; {optimize}")
        return KernelModel.of(load_text(text).plan)
    keep, again = model(""), model(ON)
    flops = 1e9
    tokens = again.linear_tokens("fc2", step, flops, split)
    ffn_local = (48 if family == "llama" else 128) // 2
    more = again.linear_seconds("fc2", step, flops, split) - \
        keep.linear_seconds("fc2", step, flops, split)
    priced = (reads + 1) * tokens * ffn_local * 4 / again.bandwidth + again.gpu.launch \
        if step == "backward" else 0.0
    assert more == pytest.approx(priced, rel=1e-9, abs=1e-15)
    assert again.linear_seconds("fc1", step, flops, split) == \
        keep.linear_seconds("fc1", step, flops, split)


# --- in real runs ----------------------------------------------------------------------

# What a rank's down projections did over one step: how many times an output was
# computed again, the bytes each activation output held once its last reader had run,
# those each of tp_overlap's pieces (a copy of some of the output's tokens) held after its
# GEMM, and for each activation's backward step, how many of its outputs a weight half yet
# to run held made and how many recipes still held the activation's input after it.
RANK = textwrap.dedent("""
    import json, sys
    import planc.runtime.worker as worker
    from planc.runtime.families import recomputed_output
    computed, left, pieces, settled = [], [], [], []
    made, through = recomputed_output._Product._made, recomputed_output.Recipes.through
    settle = recomputed_output.Made.settle
    def counting(self):
        if type(self) is recomputed_output._Product:  # not tp_overlap's pieces taken again
            computed.append(True)
        return made(self)
    def settling(self):
        settle(self)
        settled.append([sum(p.whole is not None for p in self.products),
                        sum(p.compute is not None for p in self.products)])
    def watching(self, data, gemm, tokens, frees):
        pending = self._pending
        output = pending[0].untyped_storage() if pending is not None else None
        piece = output is not None and data.untyped_storage().data_ptr() != output.data_ptr()
        out = through(self, data, gemm, tokens, frees)
        if piece:
            pieces.append(data.untyped_storage().nbytes())
        if frees and output is not None:
            left.append(output.nbytes())
        return out
    recomputed_output._Product._made = counting
    recomputed_output.Recipes.through = watching
    recomputed_output.Made.settle = settling
    status = worker.main([sys.argv[1], "--steps", "1"])
    print(json.dumps({"status": status, "computed": computed, "left": left,
                      "pieces": pieces, "settled": settled}))
""")

# name: (plan, ranks, outputs computed again, outputs freed, pieces, each activation
# backward's [outputs held made for a weight half, recipes still holding its input])
RUNS = {
    # 4 blocks x 2 microbatches, over tp
    "tp2": (plan_text("tp2", mesh="tp = 2", m=2, optimize=f"tp_overlap = off; {ON}"), 2, 8,
            8, 0, [[0, 0]] * 8),
    # down cut into 2 pieces, copies of the output's tokens, each made again alone, once:
    # the input half of a backward tp_overlap splits from its weight gradient holds it
    # for the weight half, which runs after the activation's backward
    "tp2-tp-overlap-2": (plan_text("tp2_tp_overlap_2", mesh="tp = 2", m=2,
                                   optimize=f"tp_overlap = 2; {ON}"), 2, 16, 8, 16,
                         [[2, 0]] * 8),
    # 2 blocks a stage x 4 microbatches
    "pp2-1f1b": (plan_text("pp2_1f1b", mesh="pp = 2", m=4, optimize=ON), 2, 8, 8, 0,
                 [[0, 0]] * 8),
    # zero-bubble: down's weight halves deferred; each output made once, in the input
    # half, and held for the weight half, the activation's input let go
    "pp2-zb1p": (plan_text("pp2_zb1p", mesh="pp = 2", m=4, schedule="; pipeline = zb1p",
                           optimize=ON), 2, 8, 8, 0, [[1, 0]] * 8),
    # gpt's GeLU: 2 chunks of 1 block a stage x 2 microbatches
    "gpt-pp2-interleaved": (GPT.format(mesh="pp = 2", topology="", optimize=ON).replace(
        "microbatches = 2", "microbatches = 2; pipeline = interleaved").replace(
        "layers = 2", "layers = 4").replace("mesh {", "shard { pp { virtual = 2 } } mesh {"),
        2, 4, 4, 0, [[0, 0]] * 4),
    # and under the V schedule, whose weight halves are deferred too
    "gpt-pp2-zbv": (GPT.format(mesh="pp = 2", topology="", optimize=ON).replace(
        "microbatches = 2", "microbatches = 2; pipeline = zbv").replace(
        "layers = 2", "layers = 4").replace("mesh {", "shard { pp { virtual = 2 } } mesh {"),
        2, 4, 4, 0, [[1, 0]] * 4),
    # a mixture's first dense block alone (1 microbatch); its mixtures keep their product
    "moe-first-dense": (moe_plan_text(layers=2, dense=1, optimize=ON), 1, 1, 1, 0,
                        [[0, 0]]),
    "off": (plan_text("off", mesh="tp = 2", m=2), 2, 0, 0, 0, []),
}


@pytest.mark.parametrize("name", sorted(RUNS))
def test_each_rank_lets_each_output_go_and_makes_it_again_in_the_backward(tmp_path, name):
    text, world, computed, freed, pieces, settled = RUNS[name]
    for done in run_ranks(RANK, tmp_path, world=world, plan_text=text):
        seen = one_rank_printed(done)
        assert seen["status"] == 0
        assert seen["computed"] == [True] * computed
        assert seen["left"] == [0] * freed
        assert seen["pieces"] == [0] * pieces
        assert seen["settled"] == settled


def _trained(tmp_path, name: str, text: str) -> dict[str, bytes]:
    """The checkpoint's files after 2 steps of a real run of ``text``."""
    source = tmp_path / f"{name}.plan"
    source.write_text(text)
    build, checkpoints = tmp_path / f"build-{name}", tmp_path / f"checkpoints-{name}"
    assert main(["compile", str(source), "-o", str(build)]) == 0
    assert main(["run", str(build), "--steps", "2", "--checkpoint-dir", str(checkpoints)]) == 0
    step = checkpoints / "step-000002"
    return {f.name: f.read_bytes() for f in sorted(step.iterdir())}


TRAINED = {
    "llama-pp2-zb1p": lambda optimize: plan_text(
        "trained", mesh="pp = 2", m=4, schedule="; pipeline = zb1p",
        optimize=optimize.lstrip("; ")),
    "llama-tp2-sp-tp-overlap-2": lambda optimize: plan_text(
        "trained", mesh="tp = 2", m=2, shard="tp { sequence_parallel = on }",
        optimize=f"tp_overlap = 2{optimize}"),
    "gpt-tp2-tp-overlap-2": lambda optimize: GPT.format(
        mesh="tp = 2", topology="", optimize=f"tp_overlap = 2{optimize}").replace(
        "plan g {", "plan trained {"),
    "gpt-pp2-interleaved": lambda optimize: gpt_two_chunks_a_stage(
        "interleaved", optimize.lstrip("; ")),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(TRAINED))
def test_training_computes_the_same_bits_with_the_output_made_again(tmp_path, name):
    pytest.importorskip("torch")
    kept = _trained(tmp_path, "kept", TRAINED[name](""))
    again = _trained(tmp_path, "again", TRAINED[name](f"; {ON}"))
    assert kept == again
