"""Uneven pipeline chunks: the layer assignment of ``stages = auto``, explicit lists with
chunks of any size (and the embedding or head alone), the memory estimate that follows
them, and Llama 3 405B's layout (Dubey et al. 2024, section 3.3.2)."""

from __future__ import annotations

import itertools

import pytest

from planc.estimate import in_flight, memory
from planc.cli import main
from planc.lang import load_file, load_text
from planc.schedules.layers import balanced_chunks, chunk_text, fewest_layers
from tests.conftest import PLANS


def plan_text(layers=5, pp=2, virtual=2, m=2, stages="auto", pipeline="interleaved"):
    return f"""plan p {{
  model gpt {{ layers = {layers}; hidden = 32; heads = 4; vocab = 128; seq = 16; batch = 8 }}
  mesh {{ pp = {pp} }}
  shard {{ pp {{ virtual = {virtual}; stages = {stages} }} }}
  schedule {{ microbatches = {m}; pipeline = {pipeline} }}
}}"""


def sizes(chunks):
    return [last - first + 1 for first, last in chunks]


def test_even_division_is_unchanged():
    assert sizes(balanced_chunks(24, 4, 2)) == [3] * 8
    assert balanced_chunks(8, 2, 1) == ((0, 3), (4, 7))


def test_the_remainder_goes_to_the_ranks_without_the_embedding_or_head():
    # 10 layers on 4 stages: ranks 0 and 3 carry the embedding and the head.
    assert balanced_chunks(10, 4, 1) == ((0, 1), (2, 4), (5, 7), (8, 9))
    # 5 layers in 4 chunks: both ranks carry one end, so the lower rank takes the layer,
    # in its chunk that is not the model's first.
    assert balanced_chunks(5, 2, 2) == ((0, 0), (1, 1), (2, 3), (4, 4))
    # Llama 3 405B with virtual = 2: one fewer layer in the first and last chunk.
    chunks = balanced_chunks(126, 16, 2)
    assert sizes(chunks) == [3] + [4] * 30 + [3]
    assert [sum(sizes(chunks[s::16])) for s in range(16)] == [7] + [8] * 14 + [7]


def test_llama3_layout_first_chunk_embedding_alone_last_head_alone():
    chunks = balanced_chunks(126, 16, 8)
    assert chunks[0] == (0, -1) and chunks[-1] == (126, 125)
    assert chunks[1:-1] == tuple((layer, layer) for layer in range(126))
    assert fewest_layers(16, 8) == 126


@pytest.mark.parametrize("pp,virtual", [(1, 1), (2, 1), (3, 1), (4, 1), (2, 2), (2, 3),
                                        (3, 2), (4, 2), (4, 3)])
def test_auto_covers_every_layer_once_and_balances_the_work(pp, virtual):
    count = pp * virtual
    for layers in range(fewest_layers(pp, virtual), 3 * count + 2):
        chunks = balanced_chunks(layers, pp, virtual)
        assert len(chunks) == count
        assert [c for first, last in chunks for c in range(first, last + 1)] == \
            list(range(layers))
        assert max(sizes(chunks)) - min(sizes(chunks)) <= 1
        # Only the model's first and last chunk may be empty.
        assert all(size > 0 for size in sizes(chunks)[1:-1])
        # Each rank's work, the embedding and the head counted as a layer each, is within
        # one layer of every other's unless a rank's chunks are all full.
        work = [sum(sizes(chunks[s::pp])) + (s == 0) + (s == pp - 1) for s in range(pp)]
        full = [all(size == max(sizes(chunks)) for size in sizes(chunks[s::pp]))
                for s in range(pp)]
        for a, b in itertools.permutations(range(pp), 2):
            assert work[a] <= work[b] + 1 or full[b], (layers, work)


def test_the_checker_takes_uneven_auto_and_explicit_chunks():
    plan = load_text(plan_text()).plan
    assert plan.shard.pp.chunks == ((0, 0), (1, 1), (2, 3), (4, 4)) and plan.shard.pp.auto
    explicit = load_text(plan_text(stages="[embedding, 0..2, 3, 4..4]")).plan
    assert explicit.shard.pp.chunks == ((0, -1), (0, 2), (3, 3), (4, 4))
    assert not explicit.shard.pp.auto
    head = load_text(plan_text(stages="[0..1, 2..3, 4, head]")).plan
    assert head.shard.pp.chunks == ((0, 1), (2, 3), (4, 4), (5, 4))
    assert [chunk_text(head.shard.pp.chunks, c) for c in range(4)] == [
        "layers 0-1", "layers 2-3", "layer 4", "the head alone"]
    assert chunk_text(explicit.shard.pp.chunks, 0) == "the embedding alone"
    # One layer per chunk, and the two ends alone: as few layers as chunks - 2.
    ends = load_text(plan_text(layers=2, stages="[embedding, 0, 1, head]")).plan
    assert ends.shard.pp.chunks == ((0, -1), (0, 0), (1, 1), (2, 1))


@pytest.mark.parametrize("stages,message,hint", [
    ("[0..1, embedding, 2..3, 4]", "only the first chunk can run the embedding alone",
     "a chunk after the first needs a layer range; write embedding first"),
    ("[head, 0..1, 2..3, 4]", "only the last chunk can run the head alone",
     "a chunk before the last needs a layer range; write head last"),
    ("[0, 1..3, 4]", "stages lists 3 layer ranges but pp x virtual is 4",
     "give one range per model chunk (chunk c runs on stage c mod pp)"),
    ("[0, 1..2, 2..3, 4]", "layer range 2..3 overlaps 1..2",
     "each layer belongs to exactly one stage"),
    ("[0, 1, 3, 4]", "layer 2 is in no stage", "the ranges must cover every layer once, in order"),
    ("[0, 1, 2..3, 4..5]", "layer range 4..5 goes past the last layer (4)",
     "the model has layers 0..4"),
    ("[0, 2..3, 1, 4]", "layer range 1..1 comes after 2..3", "list the ranges in layer order"),
    ("[0, 1, 2, 3]", "layer 4 is in no stage", "the ranges must cover layers 0..4"),
])
def test_each_wrong_list_is_one_error_with_a_hint(stages, message, hint):
    loaded = load_text(plan_text(stages=stages))
    assert loaded.plan is None
    (error,) = [d for d in loaded.diagnostics if d.severity == "error"]
    assert (error.message, error.hints) == (message, (hint,))
    assert error.span.line == 4


def test_too_few_layers_for_the_chunks():
    loaded = load_text(plan_text(layers=2, pp=2, virtual=3, m=2))
    (error,) = loaded.diagnostics
    assert error.message == ("pp x virtual (2 x 3 = 6) is more than layers + 2 (2 + 2): every "
                             "chunk needs a layer, but the first may run the embedding alone "
                             "and the last the head alone")
    assert error.hints == ("use virtual = 2 or fewer",) and error.span.line == 3


def test_memory_follows_the_layers_of_the_chunks_in_flight():
    plan = load_text(plan_text()).plan  # stage 0: chunks of 1 and 2 layers; stage 1: 1 and 1
    one = memory.layer_activation_bytes(plan)
    # Stage 0's warm-up holds every forward: F0.c0 F1.c0 F0.c2 F1.c2, 1 + 1 + 2 + 2 layers.
    assert in_flight.layers_in_flight(plan, 0) == 6
    # (and the largest gradient a backward step returns: memory.largest_step_gradient_bytes)
    assert memory.stage_activation_bytes(plan, 0) == (
        6 * one + memory.largest_step_gradient_bytes(plan, 0), 4)
    # Stage 1's chunks are alike: the schedule's 3 chunk-microbatches of 1 layer.
    assert in_flight.layers_in_flight(plan, 1) == 3
    even = load_text(plan_text(layers=8)).plan  # 2 layers a chunk: as before
    assert in_flight.layers_in_flight(even, 0) == in_flight.microbatches_in_flight(even, 0) * 2
    # The head-only last chunk holds no layer, but the stage still holds the logits.
    head = load_text(plan_text(stages="[0..1, 2..3, 4, head]")).plan
    # Stage 1 runs F0.c1 F1.c1 F0.c3 B0.c3 F1.c3 B1.c3 B0.c1 B1.c1: chunk 1's 2 layers
    # for both microbatches at the peak, chunk 3's none.
    assert in_flight.layers_in_flight(head, 1) == 4
    assert in_flight.microbatches_in_flight(head, 1) == 3


def test_llama3_405b_plan_is_the_papers_layout(capsys):
    plan = load_file(PLANS / "llama3-405b.plan").plan
    assert (plan.mesh.tp, plan.mesh.cp, plan.mesh.pp, plan.mesh.dp) == (8, 1, 16, 128)
    assert plan.schedule.pipeline == "interleaved" and plan.schedule.microbatches == 16
    assert plan.shard.pp.chunks == balanced_chunks(126, 16, 8)
    assert [len(plan.shard.pp.layers_of_stage(s, 16)) for s in range(16)] == \
        [7] + [8] * 14 + [7]
    # The command: virtual = 2 is now accepted, with no divisibility error.
    assert main(["check", str(PLANS / "llama3-405b.plan"), "--set", "shard.pp.virtual=2",
                 "--set", "schedule.pipeline=interleaved"]) == 0
    assert "ok: plan llama3_405b" in capsys.readouterr().out


def test_the_graph_runs_the_embedding_and_the_head_alone_on_the_end_chunks():
    from planc.graph.derive import derive

    plan = load_text("""plan p {
  model llama { layers = 5; hidden = 32; heads = 4; kv_heads = 2; ffn = 48; vocab = 128;
                seq = 16; batch = 8 }
  mesh { pp = 2; tp = 2 }
  shard { tp { sequence_parallel = on }; pp { virtual = 2; stages = [embedding, 0..2, 3, 4] } }
  schedule { microbatches = 2; pipeline = interleaved }
}""").plan
    graph = derive(plan)
    computed = {}
    for _, data in graph.nodes(data=True):
        if data["type"] == "compute" and data["phase"] == "forward" and not data["recompute"]:
            computed.setdefault(data["chunk"], set()).add((data["layer"], str(data["op"])))
    assert computed[0] == {(None, "embedding")}
    assert {layer for layer, _ in computed[1]} == {0, 1, 2}
    assert {layer for layer, _ in computed[2]} == {3}
    assert {op for layer, op in computed[3] if layer is None} == {
        "final_ln", "head", "loss", "loss_max", "loss_sum_exp"}  # vocabulary-parallel loss
    assert {layer for layer, _ in computed[3]} == {4, None}
    # The chunk of the embedding alone sends the vocabulary-parallel embedding's partial
    # sum whole (the next chunk's first layer reduce-scatters it); the later chunks send
    # the sequence-parallel residual stream, a tp-th of it. The gradients match in size.
    first, later = graph.nodes["F/c0>c1:send@pp"], graph.nodes["F/c1>c2:send@pp"]
    assert first["bytes"] == 2 * later["bytes"] == 8 // 2 * 16 * 32 * 4
    assert first["shape"] == [4, 16, 32] and later["shape"] == [4, 8, 32]
    assert graph.nodes["B/c1>c0:send@pp"]["bytes"] == first["bytes"]


def test_dualpipev_frees_what_its_whole_backwards_are_done_with():
    """DualPipeV runs whole backwards (B) beside split ones (I then W): a B frees its
    chunk's layers too, so uneven chunks hold as much at 32 microbatches as at 8 (the
    estimate grew with the microbatches before)."""
    held = [in_flight.layers_in_flight(load_text(plan_text(
        layers=7, m=m, pipeline="dualpipev").replace("batch = 8", "batch = 32")).plan, stage)
        for m in (8, 32) for stage in (0, 1)]  # chunks of 2, 2, 2 and 1 layers
    assert held == [9, 10, 9, 10]
