"""The derived communication graph against the textbook: exact counts and bytes.

Each expectation is written from the papers' formulas (Megatron, sequence parallelism,
ZeRO, 1F1B, ring attention), never read back from planc.
"""

from __future__ import annotations

from collections import Counter

import networkx as nx
import pytest

from planc.graph.derive import derive
from planc.graph.schedules import simulate
from planc.lang import load_text
from planc.estimate.memory import layer_parameters, stage_parameters

B, S, H, HEADS, V, FFN = 4, 32, 64, 4, 256, 256  # microbatch size 4 with batch 16, dp 1, m 4


def plan_text(*, layers=4, tp=1, cp=1, pp=1, dp=1, batch=16, microbatches=4, tp_block="",
              cp_block="", pp_block="", zero=0, pipeline="1f1b", dtype="fp32", tie="off",
              recompute="none", seq=S, scatter_gather="on", dp_block=""):
    return f"""plan t {{
  model gpt {{ layers = {layers}; hidden = {H}; heads = {HEADS}; vocab = {V}; seq = {seq}
              batch = {batch}; dtype = {dtype}; tie_embeddings = {tie} }}
  mesh {{ tp = {tp}; cp = {cp}; pp = {pp}; dp = {dp} }}
  shard {{
    tp {{ {tp_block} }}
    cp {{ {cp_block} }}
    pp {{ {pp_block} }}
    dp {{ zero = {zero}; {dp_block} }}
  }}
  schedule {{ microbatches = {microbatches}; pipeline = {pipeline} }}
  optimize {{ recompute = {recompute}; pp_scatter_gather = {scatter_gather} }}
}}"""


def compiled(**kwargs):
    loaded = load_text(plan_text(**kwargs))
    assert loaded.plan is not None, [d.message for d in loaded.diagnostics]
    return loaded.plan, derive(loaded.plan)


def transfers(graph, **where):
    return [d for _, d in graph.nodes(data=True) if d["type"] == "transfer"
            and all(d.get(k) == v for k, v in where.items())]


def kinds(graph, **where) -> Counter:
    """(phase, kind) -> executions per step."""
    counts = Counter()
    for d in transfers(graph, **where):
        counts[(d["phase"], d["kind"])] += d["repeat"]
    return counts


def activation_transfers(graph, layer, axis="tp"):
    """Per-microbatch transfers of a layer (activations and their gradients)."""
    return [d for d in transfers(graph, layer=layer, axis=axis) if d["per_microbatch"]]


# --- the graph itself -------------------------------------------------------------------


def test_graph_is_a_dag_with_the_required_attributes():
    _, g = compiled(tp=2, pp=2, dp=2, zero=1)
    assert nx.is_directed_acyclic_graph(g)
    for _, d in g.nodes(data=True):
        assert d["type"] in ("compute", "transfer")
        assert d["phase"] in ("forward", "backward", "optimizer")
        assert isinstance(d["stage"], int) and d["microbatch"] is None
        assert d["layer"] is None or isinstance(d["layer"], int)
        if d["type"] == "compute":
            assert isinstance(d["op"], str) and d["flops"] >= 0
        else:
            assert d["kind"] in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all",
                                 "broadcast", "send", "recv")
            assert d["axis"] in ("tp", "cp", "pp", "dp_cp", "tied", "stage")
            assert d["bytes"] > 0 and d["dtype"] in ("fp32", "bf16", "fp16")
            assert len(d["reason"]) > 40


def test_operators_of_a_layer_forward_and_backward():
    _, g = compiled(layers=1)
    forward = sorted(d["op"] for _, d in g.nodes(data=True)
                     if d["type"] == "compute" and d["phase"] == "forward" and d["layer"] == 0)
    assert forward == sorted(["ln1", "qkv", "attention", "proj", "attn_residual", "ln2", "fc1",
                              "gelu", "fc2", "mlp_residual"])
    outside = sorted(d["op"] for _, d in g.nodes(data=True)
                     if d["type"] == "compute" and d["phase"] == "forward" and d["layer"] is None)
    assert outside == ["embedding", "final_ln", "head", "loss", "position"]
    assert g.nodes["F/L0/qkv"]["flops"] == 2 * B * S * H * 3 * H
    assert g.nodes["B/L0/qkv"]["flops"] == 2 * 2 * B * S * H * 3 * H
    assert g.nodes["F/L0/qkv"]["repeat"] == 4  # once per microbatch


@pytest.mark.parametrize("change", [dict(tp=2), dict(tp=4), dict(dp=2), dict(dp=16),
                                    dict(cp=2), dict(cp=4)])
def test_graph_size_does_not_depend_on_tp_cp_or_dp_degrees(change):
    axis = next(iter(change))
    base = {"tp": 2, "cp": 2, "dp": 2}
    reference = nx.number_of_nodes(compiled(**base)[1]), nx.number_of_edges(compiled(**base)[1])
    other = {**base, **change}
    _, g = compiled(**other, batch=64)
    assert (g.number_of_nodes(), g.number_of_edges()) == reference, axis


# --- tensor parallelism (Megatron, Shoeybi et al. 2019) ---------------------------------


def test_megatron_tensor_parallel_two_all_reduces_each_way_per_layer():
    _, g = compiled(tp=2)
    for layer in range(4):
        moves = activation_transfers(g, layer)
        assert Counter((d["phase"], d["kind"]) for d in moves) == {
            ("forward", "all_reduce"): 2, ("backward", "all_reduce"): 2}
        assert all(d["bytes"] == B * S * H * 4 and d["repeat"] == 4 for d in moves)
    # nothing else over tp inside a layer: parameters are sharded or see replicated data
    assert not [d for d in transfers(g, axis="tp") if not d["per_microbatch"]]


def test_sequence_parallel_all_gather_and_reduce_scatter_pairs_and_layernorm_gradients():
    _, g = compiled(tp=2, tp_block="sequence_parallel = on")
    for layer in range(4):
        moves = activation_transfers(g, layer)
        assert Counter((d["phase"], d["kind"]) for d in moves) == {
            ("forward", "all_gather"): 2, ("forward", "reduce_scatter"): 2,
            ("backward", "all_gather"): 2, ("backward", "reduce_scatter"): 2}
        assert all(d["bytes"] == B * S * H * 4 for d in moves)  # AG output, RS input
        # LayerNorm weights and biases, and row-parallel biases, see only their tokens:
        # their gradients are all-reduced over tp once per step (as Megatron does).
        # (the derivation gives every parameter a bucket of its own, named after it)
        fixed = {d["bucket"] for d in transfers(g, layer=layer, axis="tp", kind="all_reduce")
                 if not d["per_microbatch"]}
        assert fixed == {f"layers.{layer}.{p}" for p in (
            "ln1.weight", "ln1.bias", "ln2.weight", "ln2.bias", "proj.bias", "fc2.bias")}
    assert transfers(g, bucket="layers.0.ln1.weight", axis="tp")[0]["bytes"] == H * 4


def test_vocabulary_parallel_embedding_and_loss_never_gather_logits():
    _, g = compiled(tp=2)
    loss = transfers(g, layer=None, axis="tp", phase="forward")
    by_tensor = {d["tensor"]: d for d in loss}
    # embedding output is a partial sum: one all-reduce; the loss: max and sum-exp.
    assert by_tensor["stream"]["kind"] == "all_reduce"
    assert by_tensor["loss_max"]["bytes"] == B * S * 4 and by_tensor["loss_max"]["dtype"] == "fp32"
    assert by_tensor["loss_sum_exp"]["bytes"] == B * S * 4
    assert len(loss) == 3
    assert not [d for d in transfers(g) if d.get("tensor") == "logits"]


def test_fc1_row_fc2_column_gives_what_the_rules_imply():
    _, g = compiled(tp=2, tp_block="fc1 = row; fc2 = column")
    mlp = [d for d in activation_transfers(g, 0) if d.get("producer") in
           ("ln2", "fc1", "gelu", "fc2", "mlp_residual")]
    found = sorted((d["phase"], d["kind"], d["producer"], d["consumer"], d["bytes"]) for d in mlp)
    assert found == sorted([
        # fc1 row: its input slice is free, its output partial -> all-reduce for gelu
        ("forward", "all_reduce", "fc1", "gelu", B * S * FFN * 4),
        # fc2 column: output sharded by features -> all-gather for the residual
        ("forward", "all_gather", "fc2", "mlp_residual", B * S * H * 4),
        # backward: fc2 column returns a partial input gradient -> all-reduce
        ("backward", "all_reduce", "fc2", "gelu", B * S * FFN * 4),
        # fc1 row returns its input gradient sharded -> all-gather for ln2
        ("backward", "all_gather", "fc1", "ln2", B * S * H * 4),
    ])


def test_qkv_replicate_runs_attention_whole_and_slices_for_proj():
    _, g = compiled(tp=2, tp_block="qkv = replicate")
    attention = [d for d in activation_transfers(g, 0) if d.get("producer") in
                 ("ln1", "qkv", "attention", "proj", "attn_residual")]
    assert sorted((d["phase"], d["kind"], d["producer"], d["consumer"]) for d in attention) == [
        ("backward", "all_gather", "proj", "attention"),
        ("forward", "all_reduce", "proj", "attn_residual")]


def test_embedding_hidden_gathers_the_embedding_output():
    _, g = compiled(tp=2, tp_block="embedding = hidden")
    moves = [d for d in transfers(g, layer=None, axis="tp")
             if d.get("producer") == "embedding"]
    assert [(d["phase"], d["kind"], d["bytes"]) for d in moves] == [
        ("forward", "all_gather", B * S * H * 4)]


# --- data parallelism and ZeRO (Rajbhandari et al. 2020) --------------------------------


def _gradient_bytes(g, stage, kind, phase="backward"):
    return sum(d["bytes"] * d["repeat"] for d in transfers(g, stage=stage, axis="dp_cp",
                                                               kind=kind, phase=phase))


@pytest.mark.parametrize("pp", [1, 2])
def test_zero0_gradient_bytes_equal_parameter_bytes_per_stage(pp):
    plan, g = compiled(dp=4, pp=pp, tp=2)
    for stage in range(pp):
        assert _gradient_bytes(g, stage, "all_reduce") == stage_parameters(plan, stage) * 4
        assert not transfers(g, stage=stage, axis="dp_cp", kind="reduce_scatter")


@pytest.mark.parametrize("zero", [1, 2])
def test_zero1_and_2_reduce_scatter_then_all_gather_the_same_bytes(zero):
    plan, g = compiled(dp=4, zero=zero, microbatches=1)
    params = stage_parameters(plan, 0) * 4
    assert _gradient_bytes(g, 0, "reduce_scatter") == params
    assert _gradient_bytes(g, 0, "all_gather", "optimizer") == params
    assert not transfers(g, axis="dp_cp", kind="all_reduce")


def test_zero2_reduces_every_microbatch():
    plan, g = compiled(dp=4, zero=2, microbatches=4)
    assert _gradient_bytes(g, 0, "reduce_scatter") == 4 * stage_parameters(plan, 0) * 4


def test_zero3_moves_one_and_a_half_times_the_volume_of_zero0():
    def bus_volume(g):
        return sum(d["bytes"] * d["repeat"] * (2 if d["kind"] == "all_reduce" else 1)
                   for d in transfers(g, axis="dp_cp"))

    plan, g0 = compiled(dp=4, zero=0, microbatches=1)
    _, g3 = compiled(dp=4, zero=3, microbatches=1)
    params = stage_parameters(plan, 0) * 4
    # ZeRO's 1.5x, less the second gathers of the head's unit and the last block's:
    # their backward follows their forward at once, and they are kept whole between
    # them (memory.head_unit_kept, memory.last_block_kept)
    head = (plan.model.vocab * plan.model.hidden + 2 * plan.model.hidden) * 4
    last_block = layer_parameters(plan, plan.model.layers - 1) * 4
    assert bus_volume(g3) == 1.5 * bus_volume(g0) - head - last_block
    assert _gradient_bytes(g3, 0, "all_gather", "forward") == params
    assert _gradient_bytes(g3, 0, "all_gather", "backward") == params - head - last_block
    assert _gradient_bytes(g3, 0, "reduce_scatter") == params


@pytest.mark.parametrize("zero,kind", [(0, "all_reduce"), (1, "reduce_scatter")])
def test_reduce_dtype_fp32_moves_four_bytes_a_parameter_in_the_dp_reduction(zero, kind):
    # bf16 weights: 2 bytes a parameter, but DeepSpeed's BF16_Optimizer and Megatron-LM's
    # accumulate_allreduce_grads_in_fp32 reduce the fp32 gradients, 4 bytes a parameter.
    plan, g = compiled(dp=4, zero=zero, microbatches=2, dtype="bf16",
                       dp_block="reduce_dtype = fp32")
    reductions = transfers(g, axis="dp_cp", kind=kind)
    assert {d["dtype"] for d in reductions} == {"fp32"}
    assert _gradient_bytes(g, 0, kind) == stage_parameters(plan, 0) * 4
    if zero:  # the updated bf16 weights are gathered in bf16
        assert _gradient_bytes(g, 0, "all_gather", "optimizer") == stage_parameters(plan, 0) * 2
    plain, g_model = compiled(dp=4, zero=zero, microbatches=2, dtype="bf16")
    assert {d["dtype"] for d in transfers(g_model, axis="dp_cp", kind=kind)} == {"bf16"}
    assert _gradient_bytes(g_model, 0, kind) == stage_parameters(plain, 0) * 2


def test_zero1_grad_reduce_all_reduce_sums_the_whole_gradient_once_a_step():
    # DeepSpeed's BF16_Optimizer under its pipeline engine all-reduces the whole buffer
    # and each replica updates its shard: an all-reduce of every parameter's bytes
    # (twice a ring reduce-scatter's bus bytes), once a step, the shard kept
    plan, g = compiled(dp=4, zero=1, microbatches=2, dtype="bf16",
                       dp_block="reduce_dtype = fp32; grad_reduce = all_reduce")
    reductions = transfers(g, axis="dp_cp", payload="grad")
    assert {(d["kind"], d["repeat"], d.get("keeps_shard")) for d in reductions} == \
        {("all_reduce", 1, True)}
    assert _gradient_bytes(g, 0, "all_reduce") == stage_parameters(plan, 0) * 4
    # ... and the updated shards are gathered as under any ZeRO-1
    assert _gradient_bytes(g, 0, "all_gather", "optimizer") == stage_parameters(plan, 0) * 2
    _, scattered = compiled(dp=4, zero=1, microbatches=2, dtype="bf16",
                            dp_block="reduce_dtype = fp32")
    assert {(d["kind"], d.get("keeps_shard")) for d in
            transfers(scattered, axis="dp_cp", payload="grad")} == {("reduce_scatter", None)}
    assert all("(zero 1, grad_reduce = all_reduce): all-reduce the whole gradient over "
               in d["reason"] for d in reductions)


def test_zero1_by_all_reduce_is_shown_in_the_buckets_reason_and_the_programs(tmp_path, capsys):
    from planc.cli import main

    text = plan_text(dp=2, zero=1, microbatches=2, dp_block="grad_reduce = all_reduce")
    plan = tmp_path / "p.plan"
    plan.write_text(text)
    whole = stage_parameters(load_text(text).plan, 0) * 4  # one fp32 bucket: every parameter
    assert main(["compile", str(plan), "-o", str(tmp_path / "b")]) == 0
    capsys.readouterr()
    assert main(["programs", str(tmp_path / "b")]) == 0
    shown = [line.split(maxsplit=3)[3] for line in capsys.readouterr().out.splitlines()
             if "G/c0.b0:all_reduce@dp_cp  [" in line]
    assert shown == [f"G/c0.b0:all_reduce@dp_cp  [dp_cp, {whole:,} B, keeps its shard]  "
                     f"<- @grad:c0.b0  (last microbatch only)"]
    assert main(["explain", str(plan), "--axis", "dp_cp"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert ("each dp x cp rank keeps only its equal slice of the summed gradient (zero 1, "
            "grad_reduce = all_reduce): one all-reduce of the whole bucket over dp x cp, once "
            "per step, and each keeps its slice") in text


def test_reduce_dtype_fp32_survives_bucket_fusion_and_sizes_the_tied_all_reduce():
    from planc.compile import compile_plan

    def fused(dp_block):
        loaded = load_text(plan_text(dp=2, pp=2, tie="on", dtype="bf16", dp_block=dp_block))
        graph = compile_plan(loaded.plan).graph
        return loaded.plan, [d for _, d in graph.nodes(data=True) if d["type"] == "transfer"
                             and d["payload"] == "grad" and d["axis"] in ("dp_cp", "tied")]

    plan, fp32 = fused("reduce_dtype = fp32")
    for stage in range(2):
        assert sum(d["bytes"] for d in fp32 if d["stage"] == stage and d["axis"] == "dp_cp") \
            == stage_parameters(plan, stage) * 4
    tied = [d for d in fp32 if d["axis"] == "tied"]
    assert sorted(d["stage"] for d in tied) == [0, 1]
    assert all(d["bytes"] == V * H * 4 and d["dtype"] == "fp32" for d in tied)
    _, bf16 = fused("")
    assert [d["bytes"] * 2 for d in bf16] == [d["bytes"] for d in fp32]


def test_gradients_are_reduced_over_dp_and_cp_together():
    _, g = compiled(dp=2, cp=2)
    reductions = transfers(g, axis="dp_cp", kind="all_reduce")
    assert reductions and all(d["group_size"] == 4 for d in reductions)


# --- pipeline parallelism ---------------------------------------------------------------


def test_one_send_per_microbatch_per_boundary_per_direction():
    _, g = compiled(pp=4, microbatches=8, batch=32, layers=8)
    for stage in range(3):
        for phase, sender, receiver in (("forward", stage, stage + 1),
                                        ("backward", stage + 1, stage)):
            sends = transfers(g, stage=sender, axis="pp", kind="send", phase=phase,
                              peer_stage=receiver)
            recvs = transfers(g, stage=receiver, axis="pp", kind="recv", phase=phase,
                              peer_stage=sender)
            assert [d["repeat"] for d in sends] == [8] and [d["repeat"] for d in recvs] == [8]
            assert sends[0]["bytes"] == B * S * H * 4


def reference_1f1b(stage, pp, m):
    """PipeDream-Flush, written out independently: warm-up, steady 1F1B, cool-down."""
    warmup = min(pp - stage - 1, m)
    order = [f"F{i}" for i in range(warmup)]
    forward, backward = warmup, 0
    while forward < m:
        order += [f"F{forward}", f"B{backward}"]
        forward += 1
        backward += 1
    return order + [f"B{i}" for i in range(backward, m)]


@pytest.mark.parametrize("pp, m", [(2, 4), (4, 8), (4, 4), (4, 2), (3, 7)])
def test_1f1b_order_and_bubble(pp, m):
    plan, g = compiled(pp=pp, microbatches=m, batch=4 * m, layers=pp * 2)
    schedules = {}
    for stage in range(pp):
        assert g.graph["schedule"][str(stage)].split() == reference_1f1b(stage, pp, m)
        schedules[stage] = [(a[0], int(a[1:]), stage) for a in reference_1f1b(stage, pp, m)]
    timeline = simulate(schedules, pp, 1)
    for stage in range(pp):
        assert timeline.bubble(stage) == pytest.approx((pp - 1) / (m + pp - 1))


def test_gpipe_runs_every_forward_first():
    _, g = compiled(pp=2, microbatches=3, batch=12, pipeline="gpipe")
    assert g.graph["schedule"]["1"].split() == ["F0", "F1", "F2", "B0", "B1", "B2"]


def reference_interleaved(stage, pp, m, v):
    """Megatron's interleaved 1F1B (schedules.py, forward_backward_pipelining_with_
    interleaving), re-derived: virtual microbatch k goes to chunk (k mod pp*v) // pp, in
    reverse order for backward."""
    total = m * v

    def chunk(k, forward):
        c = (k % (pp * v)) // pp
        return c if forward else v - 1 - c

    def microbatch(k):
        return (k // (pp * v)) * pp + k % pp

    warmup = min((pp - stage - 1) * 2 + (v - 1) * pp, total)
    order = [f"F{microbatch(k)}.c{chunk(k, True) * pp + stage}" for k in range(warmup)]
    for i in range(total - warmup):
        k = warmup + i
        order.append(f"F{microbatch(k)}.c{chunk(k, True) * pp + stage}")
        order.append(f"B{microbatch(i)}.c{chunk(i, False) * pp + stage}")
    return order + [f"B{microbatch(k)}.c{chunk(k, False) * pp + stage}"
                    for k in range(total - warmup, total)]


@pytest.mark.parametrize("pp, m, v", [(2, 4, 2), (4, 8, 2), (2, 6, 3)])
def test_interleaved_order_bubble_and_sends(pp, m, v):
    layers = pp * v * 2
    _, g = compiled(pp=pp, microbatches=m, batch=4 * m, layers=layers, pipeline="interleaved",
                    pp_block=f"virtual = {v}")
    schedules = {}
    for stage in range(pp):
        expected = reference_interleaved(stage, pp, m, v)
        assert g.graph["schedule"][str(stage)].split() == expected
        schedules[stage] = [(a[0], int(a[1:].split(".")[0]), int(a.split(".c")[1]))
                            for a in expected]
    timeline = simulate(schedules, pp, v, 1.0 / v, 2.0 / v)
    for stage in range(pp):
        assert timeline.bubble(stage) == pytest.approx((pp - 1) / (v * m + pp - 1))
    # every chunk boundary, the last stage back to the first included
    assert sum(d["repeat"] for d in transfers(g, axis="pp", kind="send", phase="forward")) \
        == (pp * v - 1) * m


def test_tied_embeddings_across_stages_all_reduce_between_first_and_last():
    plan, g = compiled(pp=2, tie="on", tp=2)
    tied = transfers(g, axis="tied")
    assert sorted(d["stage"] for d in tied) == [0, 1]
    assert all(d["kind"] == "all_reduce" and d["bytes"] == V * H * 4 // 2 for d in tied)
    assert tied[0]["collective"] == tied[1]["collective"]


# --- context parallelism ----------------------------------------------------------------


def test_cp_allgather_gathers_keys_and_values_once_per_layer():
    _, g = compiled(cp=2, tp=2)
    forward = [d for d in activation_transfers(g, 0, "cp") if d["phase"] == "forward"]
    backward = [d for d in activation_transfers(g, 0, "cp") if d["phase"] == "backward"]
    kv_full = B * S * 2 * H // 2 * 4  # all tokens' K and V, this rank's heads
    assert [(d["kind"], d["bytes"], d["repeat"]) for d in forward] == [("all_gather", kv_full, 4)]
    assert [(d["kind"], d["bytes"]) for d in backward] == [("reduce_scatter", kv_full)]


def test_cp_ring_runs_as_ring_steps_inside_attention():
    """No K/V transfer runs before attention: each attention step (forward, recomputed,
    backward) carries cp ring steps and the bytes of the block one shift moves."""
    cp = 4
    _, g = compiled(cp=cp, cp_block="attention = ring", recompute="selective")
    block = B * (S // cp) * 2 * H * 4  # this rank's K and V
    assert transfers(g, axis="cp") == []
    rings = {n: (d["ring_steps"], d["ring_bytes"], d["repeat"]) for n, d in g.nodes(data=True)
             if d.get("ring_steps")}
    assert rings == {f"{letter}/L{layer}/attention": (cp, block, 4)
                     for letter in "FRB" for layer in range(4)}
    assert "3 shifts" in g.nodes["F/L0/attention"]["ring_reason"]
    assert "(3 shifts)" in g.nodes["B/L0/attention"]["ring_reason"] and \
        "(4 shifts)" in g.nodes["B/L0/attention"]["ring_reason"]


def test_full_recomputation_repeats_the_forward_transfers_in_backward():
    _, plain = compiled(tp=2)
    _, full = compiled(tp=2, recompute="full")
    extra = kinds(full, layer=0, axis="tp") - kinds(plain, layer=0, axis="tp")
    assert extra == {("backward", "all_reduce"): 2 * 4}  # the forward's two, per microbatch


# --- scatter-gather pipeline sends ---------------------------------------------------------


def _pipeline_moves(graph):
    return {n: (d["kind"], d["bytes"], d["stage"], d["repeat"], d.get("scatter_gather"))
            for n, d in graph.nodes(data=True) if d["type"] == "transfer" and
            n.split("/")[1].startswith("c")}  # the chunk boundaries' transfers


def test_pp_scatter_gather_sends_each_tp_ranks_slice_and_gathers_it_in_the_node():
    """Narayanan et al. SC'21 4.1: each of the tp = 2 ranks sends half of the tokens; the
    receiving stage all-gathers the whole activation (or gradient) over tp."""
    whole = B * S * H * 4  # one microbatch's residual stream, fp32
    _, g = compiled(tp=2, pp=2)
    assert _pipeline_moves(g) == {
        "F/c0>c1:send@pp": ("send", whole // 2, 0, 4, 2),
        "F/c0>c1:recv@pp": ("recv", whole // 2, 1, 4, 2),
        "F/c0>c1:all_gather@tp": ("all_gather", whole, 1, 4, None),
        "B/c1>c0:send@pp": ("send", whole // 2, 1, 4, 2),
        "B/c1>c0:recv@pp": ("recv", whole // 2, 0, 4, 2),
        "B/c1>c0:all_gather@tp": ("all_gather", whole, 0, 4, None)}
    # what a send reads is this tp rank's slice of the tokens, taken locally
    assert {(u, d.get("slice")) for u, _, d in g.in_edges("F/c0>c1:send@pp", data=True)} == \
        {("F/L1/mlp_residual", "S(seq)")}
    assert {d.get("slice") for _, _, d in g.in_edges("B/c1>c0:send@pp", data=True)} == \
        {"S(seq)"}
    assert g.nodes["F/c0>c1:send@pp"]["shape"] == [B, S // 2, H]
    assert "1/2 of the tokens" in g.nodes["F/c0>c1:send@pp"]["reason"]
    assert g.graph["pp_scatter_gather"] == {
        "applied": True,
        "reason": "each of the 2 tp ranks sends 1/2 of the activation (and of its gradient) "
                  "to the next stage, which all-gathers it over tp inside its node: the bytes "
                  "between stages drop by 2 (Narayanan et al. SC'21, 4.1)"}


def test_pp_scatter_gather_off_or_under_sequence_parallelism_sends_as_before():
    whole = B * S * H * 4
    _, off = compiled(tp=2, pp=2, scatter_gather="off")
    assert _pipeline_moves(off) == {
        "F/c0>c1:send@pp": ("send", whole, 0, 4, None),
        "F/c0>c1:recv@pp": ("recv", whole, 1, 4, None),
        "B/c1>c0:send@pp": ("send", whole, 1, 4, None),
        "B/c1>c0:recv@pp": ("recv", whole, 0, 4, None)}
    # sequence parallelism already splits the stream over tp: the switch changes nothing
    sp = "sequence_parallel = on"
    _, on = compiled(tp=2, pp=2, tp_block=sp)
    _, without = compiled(tp=2, pp=2, tp_block=sp, scatter_gather="off")
    assert _pipeline_moves(on) == _pipeline_moves(without)
    assert {m[1] for m in _pipeline_moves(on).values()} == {whole // 2}
    assert sorted(on.nodes) == sorted(without.nodes)
    assert on.graph["pp_scatter_gather"] == {
        "applied": False,
        "reason": "sequence parallelism already splits the activation between stages over tp: "
                  "each tp rank sends its own tokens, nothing more to do"}
    assert off.graph["pp_scatter_gather"]["applied"] is False


def test_a_recomputation_waits_for_the_gradient_it_is_recomputed_for():
    """Guards the recomputation's order edges: a layer is recomputed just before its
    backward (Chen et al. 2016's checkpointing, Megatron-LM's full and selective
    recomputation, Korthikanti et al. 2022), once the gradient of what it recomputes is on
    its way: full recomputation of layer 1 starts after the final LayerNorm's backward
    (the gradient of layer 1's output), of layer 0 after the backward steps of layer 1's
    two readers of layer 0's output (its LayerNorm and its residual); selective
    recomputation of the attention core after the backward of proj, its reader. Each
    recomputed step feeds the backward step that differentiates it."""
    expected = {"full": [("B/L1/attn_residual", "R/L0/ln1"), ("B/L1/ln1", "R/L0/ln1"),
                         ("B/final_ln", "R/L1/ln1")],
                "selective": [("B/L0/proj", "R/L0/attention"),
                              ("B/L1/proj", "R/L1/attention")]}
    for recompute, edges in expected.items():
        _, g = compiled(layers=2, recompute=recompute)
        assert sorted((u, v) for u, v, d in g.edges(data=True)
                      if d.get("kind") == "order" and v.startswith("R/")) == edges
        again = [n for n in g if n.startswith("R/")]
        assert len(again) == (20 if recompute == "full" else 2)  # 10 operators a layer
        assert all(g.has_edge(n, "B/" + n[2:]) and g.nodes["B/" + n[2:]]["recompute_of"] == n
                   for n in again)
    _, plain = compiled(layers=2)
    assert not [n for n in plain if n.startswith("R/")]
