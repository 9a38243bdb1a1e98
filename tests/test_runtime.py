"""planc run on real processes with gloo: every plan trains exactly like one process.

Runs go through ``planc run`` in this process (tests/runtime_matrix.py), so
torch.distributed's launcher starts workers from one fork server for the whole module
(torch is imported once). Each run's --check trains the same model in one process and
compares every loss and final parameter. The features beyond the layout (a cosine lr
schedule, gradient clipping and evaluations) train together, one run per layout. The
forced variants of the communication passes are in tests/test_runtime_comm.py, data, traces and failures in
tests/test_runtime_data_and_failures.py: three files that pytest-xdist runs side by side.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

from tests.runtime_matrix import (CLIP, MATRIX, check_features, featured,  # noqa: E402
                                  plan_text, run_checked, run_checked_with_output)

pytestmark = pytest.mark.slow

# The zero-bubble schedules (input and weight gradients in blocks of their own), once
# each with the passes as the plan says: uneven stages (and uneven chunks with the head
# alone), tp with sequence parallelism, cp ring, ZeRO 1 and 3, tied embeddings and
# overlap off.
ZERO_BUBBLE = {
    "zb1p-uneven-tp-sp": dict(mesh="tp = 2; pp = 2", m=4, schedule="; pipeline = zb1p",
                              shard="tp { sequence_parallel = on }; pp { stages = [0..0, 1..3] }"),
    "zb1p-cp-ring": dict(mesh="cp = 2; pp = 2", m=2, schedule="; pipeline = zb1p",
                         shard="cp { attention = ring; load_balance = on }"),
    "zb1p-tied-zero3": dict(mesh="pp = 2; dp = 2", m=2, model="; tie_embeddings = on",
                            schedule="; pipeline = zb1p", shard="dp { zero = 3 }"),
    "interleaved-zb-zero1-overlap-off": dict(
        mesh="pp = 2; dp = 2", m=2, schedule="; pipeline = interleaved_zb",
        shard="pp { virtual = 2 }; dp { zero = 1 }", optimize="overlap = off"),
    "interleaved-zb-uneven-zero3": dict(
        mesh="pp = 2; dp = 2", m=2, schedule="; pipeline = interleaved_zb",
        shard="pp { virtual = 2; stages = [0, 1..2, 3, head] }; dp { zero = 3 }"),
}
# The V schedules (chunk 0 and the last chunk on stage 0), which split the backward too:
# tensor and sequence parallelism, ZeRO 1, 2 and 3, tied embeddings.
ZERO_BUBBLE.update({
    "zbv-tp2-sp-tp-overlap-2": dict(mesh="tp = 2; pp = 2", m=4, schedule="; pipeline = zbv",
                                    shard="tp { sequence_parallel = on }; pp { virtual = 2 }",
                                    optimize="tp_overlap = 2"),
    "dualpipev-tied-zero1": dict(mesh="pp = 2; dp = 2", m=4, schedule="; pipeline = dualpipev",
                                 model="; tie_embeddings = on",
                                 shard="pp { virtual = 2 }; dp { zero = 1 }"),
    "dualpipev-tp2-sp-zero2": dict(mesh="tp = 2; pp = 2; dp = 2", m=4,
                                   schedule="; pipeline = dualpipev",
                                   shard="tp { sequence_parallel = on }; pp { virtual = 2 }; "
                                         "dp { zero = 2 }"),
})
TIED = ("tied-over-pp", "tied-zero3", "tied-pp-zero1", "tied-pp-zero1-all-reduce",  # tied head
        "tied-pp-interleaved-uneven", "zb1p-tied-zero3", "dualpipev-tied-zero1")
# Every plan with the optimisation passes as the plan says (on), and with each turned off.
SWITCHES = {"": [], "fuse-off": ["--set", "optimize.fuse=off"],
            "overlap-off": ["--set", "optimize.overlap=off"]}


METRICS = {"step", "loss", "time_s", "compute_s", "comm_s", "exposed_comm_s", "pipeline_wait_s",
           "tokens_per_s", "slowest_rank", "max_rss_mb", "build", "lr"}
METRICS |= {"tflops_per_device", "mfu", "peak_memory_mb", "peak_memory", "plan"}  # throughput
METRICS |= {"page_faults"}


def metrics_of(build) -> set[str]:
    """The keys of a step's record: no ``mfu`` where the plan names no machine (its
    build has no peak to divide by)."""
    named = json.loads((build / "build.json").read_text())["mfu"]["peak_flops_per_device"]
    return METRICS if named is not None else METRICS - {"mfu"}


# Each route forced (and chosen by the cost model) on 4 and 8 ranks over 2 nodes: a
# hierarchical route becomes sub-group collectives, a tree point-to-point transfers.
TWO_NODES = "nodes = 2; devices_per_node = {}; inter {{ bandwidth = 1GB/s; latency = 50us }}"
ROUTES = {
    "dp4-hierarchical": dict(mesh="dp = 4", topology=TWO_NODES.format(2), m=2,
                             optimize="route = hierarchical"),
    "dp4-tree-zero3": dict(mesh="dp = 4", topology=TWO_NODES.format(2), m=2,
                           shard="dp { zero = 3 }", optimize="route = tree"),
    "dp4-ring-zero1": dict(mesh="dp = 4", topology=TWO_NODES.format(2), m=2,
                           shard="dp { zero = 1 }", optimize="route = ring"),
    "dp8-hierarchical-zero3": dict(mesh="dp = 8", topology=TWO_NODES.format(4),
                                   shard="dp { zero = 3 }", optimize="route = hierarchical"),
    "dp8-tree": dict(mesh="dp = 8", topology=TWO_NODES.format(4), optimize="route = tree"),
    "tp2-dp4-auto-zero2": dict(mesh="tp = 2; dp = 4", topology=TWO_NODES.format(4), m=2,
                               shard="dp { zero = 2 }", optimize="route = auto"),
    "tp4-sp-hierarchical": dict(mesh="tp = 4; dp = 2", m=2,
                                topology=TWO_NODES.format(2).replace("nodes = 2", "nodes = 4"),
                                shard="tp { sequence_parallel = on }",
                                optimize="route = hierarchical"),
}
# The (collective, route) pairs each plan's route pass must produce, from the cost
# model's rules: hierarchical needs 2 or more members on each of 2 or more nodes (dp's
# groups in tp4-dp2 have one per node), a tree is for all_reduce only; None: auto.
ROUTES_TAKEN = {
    "dp4-hierarchical": {("all_reduce", "hierarchical")},
    "dp4-tree-zero3": {("all_reduce", "tree"), ("all_gather", "ring"),
                       ("reduce_scatter", "ring")},
    "dp4-ring-zero1": {("all_reduce", "ring"), ("all_gather", "ring"),
                       ("reduce_scatter", "ring")},
    "dp8-hierarchical-zero3": {("all_reduce", "hierarchical"), ("all_gather", "hierarchical"),
                               ("reduce_scatter", "hierarchical")},
    "dp8-tree": {("all_reduce", "tree")},
    "tp2-dp4-auto-zero2": None,
    "tp4-sp-hierarchical": {("all_reduce", "hierarchical"), ("all_gather", "hierarchical"),
                            ("reduce_scatter", "hierarchical"), ("all_reduce", "ring")},
}


@pytest.fixture(scope="module")
def losses() -> dict[str, list[float]]:
    return {}


# Uneven interleaved chunks change what the derivation places, not what the passes do:
# they run with the passes as the plan says only (the suite's time).
PASSES_ON_ONLY = {"pp-interleaved-uneven-auto-tp-sp", "pp-interleaved-uneven-explicit",
                  "tied-pp-interleaved-uneven"}
# These layouts' passes-on runs train with the features beyond the layout
# (tests/runtime_matrix.py FEATURES), below; their fuse-off and overlap-off runs stay
# plain, as every other layout's runs.
FEATURED = ("single", "tp-sequence-parallel", "pp-interleaved", "tied-pp-zero1",
            "tied-pp-zero1-all-reduce", "custom-order")
# Which layouts run with each pass switched off. fuse packs gradient and parameter
# collectives into buckets (tp partial sums first, ZeRO shards as slices of a bucket, a
# ZeRO-3 unit per layer, the tied embedding's bucket on both stages); overlap moves tp,
# cp, dp, tied-embedding and pipeline communication onto streams of their own, places
# the reductions inside the backward blocks, the ZeRO-1/2 gathers in the next prologue
# and prefetches ZeRO-3 units. Each switch runs where it changes communication, one
# layout per code path:
#   tp:                       tp-megatron, tp-qkv-replicate (replicated weights: tp
#                             partial-sum gradients first in a bucket)
#   sequence parallelism:     tp-sequence-parallel
#   cp (all-gather, ring):    cp-allgather, cp-ring
#   dp, ZeRO 0/1/2/3:         dp-zero0, dp-zero1, dp-zero2-sp, dp-zero3, tied-zero3
#   ZeRO-3 with recompute:    dp-zero3-recompute (overlap off: the gathers of the
#                             recomputed forward without prefetch)
#   tp with recompute:        recompute-full (overlap off: recomputed tp collectives on
#                             the compute stream)
#   pp with dp (and tied):    tp2-pp2-dp2, tied-pp-zero1
# The other layouts run with the passes as the plan says only: their communication
# (tp with other placements, pp without dp, a tied head over pp without dp, a custom
# rank order, no communication at all) takes the same paths through both passes as the
# layouts above; the zero-bubble schedules cover overlap off once more (interleaved-zb),
# and the featured tp2-sp-pp2-tied runs with overlap off.
SWITCHED = {
    "fuse-off": {"tp-megatron", "tp-qkv-replicate", "tp-sequence-parallel", "cp-allgather",
                 "cp-ring", "dp-zero0", "dp-zero1", "dp-zero2-sp", "dp-zero3", "tied-zero3",
                 "tp2-pp2-dp2", "tied-pp-zero1"},
    "overlap-off": {"tp-megatron", "tp-qkv-replicate", "tp-sequence-parallel", "cp-allgather",
                    "cp-ring", "dp-zero0", "dp-zero1", "dp-zero2-sp", "dp-zero3", "tied-zero3",
                    "dp-zero3-recompute", "recompute-full", "tp2-pp2-dp2", "tied-pp-zero1"},
}
assert not PASSES_ON_ONLY & (SWITCHED["fuse-off"] | SWITCHED["overlap-off"])
RUNS = [(name, switch) for name in MATRIX for switch in SWITCHES
        if (name in SWITCHED[switch] if switch else name not in FEATURED)]


@pytest.mark.parametrize("name,switch", RUNS,
                         ids=[f"{n}-{s or 'passes-on'}" for n, s in RUNS])
def test_every_plan_trains_exactly_like_one_process(name, switch, tmp_path, capfd, losses):
    records = run_checked(name, MATRIX[name], tmp_path, capfd, *SWITCHES[switch])
    assert [r["step"] for r in records] == [0, 1]
    assert all(set(r) == metrics_of(tmp_path / "build") for r in records)
    for r in records:  # the slowest rank's step, and where its compute stream spent it
        assert 0 < r["compute_s"] < r["time_s"] and 0 <= r["exposed_comm_s"] < r["time_s"]
        # a pipeline without tp: the compute stream waits for the other stage's
        # activations or gradients itself (with tp, a received gradient goes to a tp
        # collective first, and waiting for that counts as exposed communication)
        if "pp" in MATRIX[name]["mesh"] and "tp" not in MATRIX[name]["mesh"]:
            assert 0 < r["pipeline_wait_s"] < r["time_s"], r
        elif "pp" not in MATRIX[name]["mesh"]:
            assert r["pipeline_wait_s"] == 0, r
    losses[(name, switch)] = [r["loss"] for r in records]



@pytest.mark.parametrize("name", list(ZERO_BUBBLE))
def test_zero_bubble_schedules_train_exactly_like_one_process(name, tmp_path, capfd, losses):
    records = run_checked(name, ZERO_BUBBLE[name], tmp_path, capfd)
    programs = json.loads((tmp_path / "build" / "programs" / "stage0.json").read_text())
    assert any(block.startswith("W") for block, _ in programs["schedule"])
    losses[(name, "zero-bubble")] = [r["loss"] for r in records]


@pytest.mark.parametrize("name", list(ROUTES))
def test_every_route_trains_exactly_like_one_process(name, tmp_path, capfd, losses):
    trace = tmp_path / "trace.json"
    records = run_checked(name, ROUTES[name], tmp_path, capfd, "--trace", trace)
    graph = json.loads((tmp_path / "build" / "graph.json").read_text())
    decisions = next(p for p in graph["graph"]["passes"] if p["name"] == "route")["decisions"]
    expected = ROUTES_TAKEN[name]
    assert decisions and all(d["route"] in ("ring", "tree", "hierarchical") for d in decisions)
    if expected is not None:
        assert {(d["kind"], d["route"]) for d in decisions} == expected
    # the ranks ran the recipes: each routed collective's every event on every rank
    # names its route, and no other event names one (a plain collective names none)
    routed = {node["id"]: node["route"] for node in graph["nodes"]
              if node.get("route") in ("tree", "hierarchical")}
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    ran = {(e["pid"], e["name"], e["args"].get("route")) for e in events
           if e["name"] in routed or "route" in e["args"]}
    runs = {(e["pid"], e["name"]) for e in events if e["name"] in routed}
    assert ran == {(rank, node, routed[node]) for rank, node in runs}
    assert {node for _, node in runs} == set(routed)
    losses[(name, "route")] = [r["loss"] for r in records]


def test_every_plan_of_one_model_follows_the_same_loss_curve(losses):
    if len(losses) < len(RUNS) + len(ROUTES):
        pytest.skip("needs the whole matrix")
    reference = losses[("tp-megatron", "")]
    tied = losses[("tied-over-pp", "")]
    for (name, switch), curve in losses.items():
        expected = tied if name in TIED else reference
        assert curve == pytest.approx(expected, rel=1e-5), (name, switch)
    assert tied != pytest.approx(reference, rel=1e-3)  # another model


# tp_overlap forced to 2 chunks under every tp placement (on gloo the cost model keeps
# every GEMM whole): it splits Megatron's placements only; chunked, fc2 = replicate and
# each replicated slot with sequence parallelism once trained another model.
TP_OVERLAP = {**{name: case for name, case in MATRIX.items() if name.startswith("tp-")},
              "tp-fc2-replicate": dict(mesh="tp = 2", shard="tp { fc2 = replicate }"),
              **{f"tp-{slot}-replicate-sp": dict(mesh="tp = 2", shard=f"tp {{ {slot} = "
                                                 f"replicate; sequence_parallel = on }}")
                 for slot in ("qkv", "proj", "fc1", "fc2")}}


@pytest.mark.parametrize("name", list(TP_OVERLAP))
def test_forced_tp_overlap_trains_exactly_like_one_process_under_every_placement(
        name, tmp_path, capfd):
    run_checked(name, TP_OVERLAP[name], tmp_path, capfd, "--set", "optimize.tp_overlap=2")


# A row-parallel qkv adds its bias after its reduction, in the attention step: with cp
# gathering the keys and values, every cp rank's keys and values take it too (a second
# run of random plans found the loss 1e-4 off from step 0; ring attention was right).
QKV_ROW_CP = {"tp-qkv-row-cp": dict(mesh="tp = 2; cp = 2", shard="tp { qkv = row }"),
              "tp-qkv-proj-row-cp": dict(mesh="tp = 2; cp = 2",
                                         shard="tp { qkv = row; proj = row }")}


@pytest.mark.parametrize("name", list(QKV_ROW_CP))
def test_a_row_parallel_qkv_with_gathered_keys_trains_exactly_like_one_process(
        name, tmp_path, capfd):
    run_checked(name, QKV_ROW_CP[name], tmp_path, capfd)


# --- every feature beyond the layout at once ------------------------------------------------

OVERLAP_OFF = ["--set", "optimize.overlap=off"]
# Each run: (case, switches). The FEATURED matrix layouts as the passes say, one of them
# (pp-interleaved) evaluating on a token file of its own (train.eval_data, relative to the
# plan) and one (custom-order) training on the project's corpus with its samples shuffled
# (train.shuffle; the run names the corpus and a vocab that holds its ids). Then layouts
# of their own, the norm's steps on their streams over the world: tp with sequence
# parallelism and pp with a tied head (and once with overlap off, each collective on the
# compute stream after a sync, the loss's reduction in the epilogue, which an evaluation
# runs after its own sync: test_evaluation.py), cp
# with ZeRO-1, and ZeRO-3 over pp with a tied head (whose embedding all-reduce joins the
# two stages: issued inside a block it held the dp stream, and the ZeRO-3 gathers queued
# behind it, a deadlock under 1F1B found by the zero-bubble work); and the V schedule over
# ZeRO-3 with a tied head, which evaluates chunk 0 and the last chunk on stage 0.
EVAL_FILE = '; eval_data = "held-out.tokens"'
TP_SP_PP_TIED = dict(mesh="tp = 2; pp = 2", m=2, model="; tie_embeddings = on",
                     shard="tp { sequence_parallel = on }")
FEATURE_RUNS = {
    **{name: (featured(MATRIX[name], EVAL_FILE if name == "pp-interleaved"
                       else "; shuffle = on" if name == "custom-order" else ""), [])
       for name in FEATURED},
    "tp2-sp-pp2-tied": (featured(TP_SP_PP_TIED), []),
    "tp2-sp-pp2-tied-overlap-off": (featured(TP_SP_PP_TIED), OVERLAP_OFF),
    "cp2-dp2-zero1": (featured(dict(mesh="cp = 2; dp = 2", m=2, shard="dp { zero = 1 }")), []),
    "pp2-dp2-zero3-tied": (featured(dict(mesh="pp = 2; dp = 2", m=2, model="; tie_embeddings = on",
                                         shard="dp { zero = 3 }")), []),
    "zbv-tied-zero3": (featured(dict(mesh="pp = 2; dp = 2", m=2, schedule="; pipeline = zbv",
                                     model="; tie_embeddings = on",
                                     shard="pp { virtual = 2 }; dp { zero = 3 }")), []),
}
CORPUS = "custom-order"  # another model (vocab 1024) on other data


@pytest.fixture(scope="module")
def feature_curves() -> dict[str, tuple[list[float], list[float]]]:
    return {}


@pytest.mark.parametrize("name", list(FEATURE_RUNS))
def test_every_feature_trains_exactly_like_one_process(name, tmp_path, capfd,
                                                        feature_curves):
    from planc.data.tokens import write_tokens
    from planc.data.corpus import main as make_corpus

    case, switches = FEATURE_RUNS[name]
    overrides: tuple[str, ...] = ()
    if name == CORPUS:  # make corpus's file, its 655 ids below the vocab
        corpus = tmp_path / "tiny-corpus.tokens"
        assert make_corpus(["-o", str(corpus)]) == 0
        overrides = (f'train.data="{corpus}"', "model.vocab=1024")
    if EVAL_FILE in case["train"]:
        write_tokens(tmp_path / "held-out.tokens", [(7 * i) % 128 for i in range(400)])
    records, err, text = run_checked_with_output(
        name, case, tmp_path, capfd, *switches,
        *(arg for o in overrides for arg in ("--set", o)))
    evaluated = "eval_every" in case["train"]
    check_features(records, err, text, 0.5, 0.05, overrides, evaluated)
    assert [r["lr"] for r in records] == pytest.approx([0.25, 0.5, 0.3875, 0.1625],
                                                       rel=1e-15)
    for r in records:
        assert set(r) == metrics_of(tmp_path / "build") | {"grad_norm"} | (
            {"eval_loss", "eval_s"} if evaluated and r["step"] in (1, 3) else set())
        if "eval_s" in r:  # two batches' forwards: some time, less than a training step's 4
            assert 0 < r["eval_s"] < 10
    if "zb" in case.get("schedule", ""):
        programs = json.loads((tmp_path / "build" / "programs" / "stage0.json").read_text())
        assert any(block.startswith("W") for block, _ in programs["schedule"])
    if EVAL_FILE in case["train"]:  # the check evaluated the same file
        assert json.loads((tmp_path / "build" / "programs" / "model.json").read_text())[
            "evaluation"]["source"] == str(tmp_path / "held-out.tokens")
    feature_curves[name] = ([r["loss"] for r in records],
                            [r["eval_loss"] for r in records if "eval_loss" in r])


def test_the_plans_of_one_model_follow_one_curve_with_every_feature(feature_curves):
    """Every layout of one model on one curve of losses and evaluations; tied, untied and
    the corpus's three others; and the clip shows: the single process without it (in this
    process) leaves the curve after the first step."""
    if len(feature_curves) < len(FEATURE_RUNS):
        pytest.skip("needs every featured run")
    from planc.lang import load_text
    from planc.runtime.oracle import reference

    groups: dict[str, list] = {}
    for name, curve in feature_curves.items():
        case = FEATURE_RUNS[name][0]
        kind = "corpus" if name == CORPUS else "tied" if "tie_embeddings" in case.get(
            "model", "") else "untied"
        groups.setdefault(kind, []).append((name, curve))
    assert sorted(groups) == ["corpus", "tied", "untied"]
    assert len(groups["tied"]) >= 4 and len(groups["untied"]) >= 3
    for members in groups.values():
        losses = members[0][1][0]
        # the evaluations of the same data (not pp-interleaved's file; none with overlap off)
        same = [(name, e) for name, (_, e) in members
                if e and EVAL_FILE not in FEATURE_RUNS[name][0]["train"]]
        for name, (curve, _) in members:
            assert curve == pytest.approx(losses, rel=1e-5), name
        for name, evaluated in same:
            assert evaluated == pytest.approx(same[0][1], rel=1e-5), name
    firsts = {kind: members[0][1][0] for kind, members in groups.items()}
    assert firsts["tied"] != pytest.approx(firsts["untied"], rel=1e-3)
    assert firsts["corpus"] != pytest.approx(firsts["untied"], rel=1e-3)
    text = plan_text("t", **FEATURE_RUNS["tp2-sp-pp2-tied"][0])
    clipped, _ = reference.train(load_text(text).plan, 4)
    unclipped, _ = reference.train(load_text(text.replace(f"grad_clip = {CLIP}; ", "")).plan,
                                   4)
    assert clipped == pytest.approx(firsts["tied"], rel=1e-5)
    assert unclipped[0] == pytest.approx(clipped[0], rel=1e-6)  # the same first step ...
    assert unclipped[1] != pytest.approx(clipped[1], rel=1e-3)  # ... then the clip shows
