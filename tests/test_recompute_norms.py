"""optimize { recompute_norms }: a block's two norms (llama's RMSNorms, gpt's LayerNorms)
keep their input but not their output, which the backward of the GEMM reading it (q/k/v,
the MLP's first) computes again (Megatron-Core's recompute_modules "layernorm", and what
torchtitan's per-op selective checkpointing recomputes): the check's messages, the model
table, the estimate and the simulator's price, how often a rank computes an output again
and what it lets go, and training that computes the same bits."""

from __future__ import annotations

import textwrap

import pytest

from planc.estimate.kernel_cost import KernelModel
from planc.estimate.in_flight import layers_in_flight
from planc.estimate.memory import layer_activation_bytes, stage_activation_bytes
from planc.lang import load_text
from planc.lower.tabulate_model import model_table
from planc.models import recomputes_norms
from tests.conftest import one_rank_printed, run_ranks
from tests.test_llama import plan_text
from tests.test_moe import plan_text as moe_plan_text
from tests.test_recompute_activation import (GPT, H100, _trained, _warnings,
                                            gpt_two_chunks_a_stage)

ON = "recompute_norms = on"


@pytest.mark.parametrize("source,why", [
    (moe_plan_text(optimize=ON), "planc makes the norms again for gpt and llama models, "
                                 "not moe"),
    (plan_text("p", optimize=f"recompute = full; {ON}"),
     "recompute = full keeps no norm's output"),
    (plan_text("p", optimize=f"recompute = attention_inputs; {ON}"),
     "recompute = attention_inputs keeps no norm's output"),
    (plan_text("p", model="; fp8 = blockwise", optimize=ON),
     "FP8 GEMMs keep FP8 codes of their input"),
    (plan_text("p", mesh="tp = 2", shard="tp { sequence_parallel = on }", optimize=ON),
     "under sequence parallelism the GEMMs keep the norms' outputs gathered over tp"),
])
def test_where_no_gemm_keeps_a_norm_s_output_the_key_is_warned_about(source, why):
    assert _warnings(source) == [f"recompute_norms = on has no effect: {why}"]
    plan = load_text(source).plan
    assert not recomputes_norms(plan)
    assert not model_table(plan).recompute_norms


@pytest.mark.parametrize("source", [
    plan_text("p", optimize=ON), GPT.format(mesh="tp = 2", topology="", optimize=ON),
    plan_text("p", mesh="pp = 2", m=4, schedule="; pipeline = zb1p",
              optimize=f"recompute = selective; {ON}")],
    ids=["llama", "gpt-tp2", "llama-zb1p-selective"])
def test_a_gpt_or_llama_model_takes_it_silently_and_the_model_table_carries_it(source):
    assert _warnings(source) == []
    table = model_table(load_text(source).plan)
    assert table.recompute_norms
    assert table.to_json()["kernels"] == {"recompute_norms": True}


@pytest.mark.parametrize("family", ["llama", "gpt"])
def test_the_estimate_drops_both_norms_outputs_of_every_block_but_one(family):
    """Per block and microbatch, the two norms' outputs: tokens x hidden each, whole on
    every tp rank, in fp32; a stage holds every block's of every microbatch in flight
    less one output, which a GEMM's backward makes again for a moment."""
    def plan(optimize: str):
        if family == "llama":  # hidden 32, 16 x 4 tokens a microbatch
            return load_text(plan_text("p", mesh="tp = 2; pp = 2", m=2,
                                       optimize=f"tp_overlap = off; {optimize}")).plan
        return load_text(GPT.format(mesh="tp = 2; pp = 2", topology="",
                                    optimize=f"tp_overlap = off; {optimize}")).plan
    keep, again = plan(""), plan(ON)
    tokens = 16 * 4 if family == "llama" else 8 * 2
    norm_output = tokens * 32 * 4
    assert layer_activation_bytes(keep) - layer_activation_bytes(again) == 2 * norm_output
    for stage in range(keep.mesh.pp):
        (held, _), (held_again, _) = (stage_activation_bytes(p, stage) for p in (keep, again))
        assert held - held_again == 2 * layers_in_flight(keep, stage) * norm_output - \
            norm_output


@pytest.mark.parametrize("step,split", [("backward", False), ("backward", True),
                                        ("weight", True), ("forward", False)])
@pytest.mark.parametrize("op", ["qkv", "fc1"])
def test_the_simulator_prices_the_norm_again_where_the_gemm_s_backward_unpacks_it(
        step, split, op):
    """The norm's input read and its output written, over the GEMM's tokens and the model's
    width, a launch with it; in the backward, or in a split backward's input half, which
    holds it for the weight half; none in the forward; proj and down as before."""
    def model(optimize: str) -> KernelModel:
        text = plan_text("p", mesh="tp = 2", optimize=f"tp_overlap = off; {optimize}").replace(
            "mesh {", H100 + "\n  mesh {")
        return KernelModel.of(load_text(text).plan)
    keep, again = model(""), model(ON)
    flops = 1e9
    tokens = again.linear_tokens(op, step, flops, split)
    more = again.linear_seconds(op, step, flops, split) - \
        keep.linear_seconds(op, step, flops, split)
    priced = 2 * tokens * 32 * 4 / again.bandwidth + again.gpu.launch \
        if step == "backward" else 0.0
    assert more == pytest.approx(priced, rel=1e-9, abs=1e-15)
    for other in ("proj", "fc2"):
        assert again.linear_seconds(other, step, flops, split) == \
            keep.linear_seconds(other, step, flops, split)


# --- in real runs ----------------------------------------------------------------------

# What a rank's GEMMs did over one step: how many times a norm's output was computed
# again, the bytes each output held once the GEMM reading it had run, and for each norm's
# backward step, how many of its outputs a weight half yet to run held made and how many
# recipes still held the norm's input after it.
RANK = textwrap.dedent("""
    import json, sys
    import planc.runtime.worker as worker
    from planc.runtime.families import recomputed_output
    computed, left, settled = [], [], []
    made, through = recomputed_output._Product._made, recomputed_output.Recipes.through
    settle = recomputed_output.Made.settle
    def counting(self):
        computed.append(tuple(self.layout[0]))
        return made(self)
    def watching(self, data, gemm, tokens, frees):
        pending = self._pending
        output = pending[0].untyped_storage() if pending is not None else None
        out = through(self, data, gemm, tokens, frees)
        if frees and output is not None:
            left.append(output.nbytes())
        return out
    def settling(self):
        settle(self)
        settled.append([sum(p.whole is not None for p in self.products),
                        sum(p.compute is not None for p in self.products)])
    recomputed_output._Product._made = counting
    recomputed_output.Recipes.through = watching
    recomputed_output.Made.settle = settling
    status = worker.main([sys.argv[1], "--steps", "1"])
    print(json.dumps({"status": status, "computed": len(computed), "left": left,
                      "settled": settled}))
""")

# name: (plan, ranks, norm outputs computed again, outputs freed, each norm backward's
# [outputs held made for a weight half, recipes still holding its input])
RUNS = {
    # 4 blocks x 2 norms x 2 microbatches over tp: the GEMMs' weight gradients are steps
    # of their own, run while the all-reduce of their input gradient goes, before the
    # norm's backward: each output made once, in the input half, held for the weight
    # half, which lets it go
    "llama-tp2": (plan_text("tp2", mesh="tp = 2", m=2, optimize=ON), 2, 16, 16,
                  [[0, 0]] * 16),
    # one rank: one backward each, nothing held for a weight half
    "llama": (plan_text("one", m=2, optimize=ON), 1, 16, 16, [[0, 0]] * 16),
    # zero-bubble over two stages with the SwiGLU product made again too: 2 blocks a
    # stage x 4 microbatches x 2 norms, and 8 products
    "llama-pp2-zb1p-act": (plan_text("zb", mesh="pp = 2", m=4, schedule="; pipeline = zb1p",
                                     optimize=f"recompute_activation = on; {ON}"), 2, 24, 24,
                           [[1, 0]] * 24),
    # gpt's LayerNorms: 2 blocks a stage x 2 microbatches
    "gpt-pp2": (GPT.format(mesh="pp = 2", topology="", optimize=ON), 2, 4, 4, [[0, 0]] * 4),
    "off": (plan_text("off", mesh="tp = 2", m=2), 2, 0, 0, []),
}


@pytest.mark.parametrize("name", sorted(RUNS))
def test_each_rank_lets_each_norm_output_go_and_makes_it_again_once(tmp_path, name):
    text, world, computed, freed, settled = RUNS[name]
    for done in run_ranks(RANK, tmp_path, world=world, plan_text=text):
        seen = one_rank_printed(done)
        assert seen["status"] == 0
        assert seen["computed"] == computed
        assert seen["left"] == [0] * freed
        assert seen["settled"] == settled


TRAINED = {
    "llama-tp2": lambda optimize: plan_text("trained", mesh="tp = 2", m=2,
                                            optimize=optimize),
    # ZeRO-3's units let their storage go after the forward: the recipe keeps a copy of
    # the norm's scale
    "llama-zero3": lambda optimize: plan_text("trained", mesh="dp = 2", m=2,
                                              shard="dp { zero = 3 }", optimize=optimize),
    "llama-pp2-zb1p": lambda optimize: plan_text(
        "trained", mesh="pp = 2", m=4, schedule="; pipeline = zb1p", optimize=optimize),
    "gpt-pp2-zbv": lambda optimize: gpt_two_chunks_a_stage("zbv", optimize),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(TRAINED))
def test_training_computes_the_same_bits_with_the_norms_made_again(tmp_path, name):
    pytest.importorskip("torch")
    kept = _trained(tmp_path, "kept", TRAINED[name](""))
    again = _trained(tmp_path, "again", TRAINED[name](ON))
    assert kept == again
