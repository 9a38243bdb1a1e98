"""planc run on real processes with gloo: every plan trains exactly like one process.

Runs go through ``planc run`` in this process, so torch.distributed's launcher starts
workers from one fork server for the whole module (torch is imported once). Each run's --check trains the
same model in one process and compares every loss and final parameter.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from planc.cli import main  # noqa: E402
from tests.conftest import PLANS, ROOT  # noqa: E402

pytestmark = pytest.mark.slow

TEMPLATE = """plan {name} {{
  model gpt {{ layers = 4; hidden = 32; heads = 4; vocab = 128; seq = 16; batch = 8{model} }}
  mesh {{ {mesh} }}
  topology {{ {topology} }}
  shard {{ {shard} }}
  schedule {{ microbatches = {m}{schedule} }}
  optimize {{ {optimize} }}
  train {{ steps = 2; optimizer = sgd(lr = 0.5, momentum = 0.9); seed = 3 }}
}}
"""

# Each axis alone and combined, Megatron's placements and unusual ones, up to 8 ranks.
MATRIX = {
    "single": dict(mesh=""),
    "tp-megatron": dict(mesh="tp = 2"),
    "tp-sequence-parallel": dict(mesh="tp = 2", shard="tp { sequence_parallel = on }"),
    "tp-fc1-row-fc2-column": dict(mesh="tp = 2", shard="tp { fc1 = row; fc2 = column }"),
    "tp-qkv-replicate": dict(mesh="tp = 2", shard="tp { qkv = replicate }"),
    "tp-embedding-hidden": dict(mesh="tp = 2", shard="tp { embedding = hidden }"),
    "tp-proj-column": dict(mesh="tp = 2", shard="tp { proj = column }"),
    "tp-qkv-row-proj-row-sp": dict(mesh="tp = 2",
                                   shard="tp { qkv = row; proj = row; sequence_parallel = on }"),
    "cp-allgather": dict(mesh="cp = 2"),
    "cp-ring": dict(mesh="cp = 2", shard="cp { attention = ring; load_balance = on }"),
    "pp-gpipe-uneven": dict(mesh="pp = 2", shard="pp { stages = [0..2, 3..3] }", m=4,
                            schedule="; pipeline = gpipe"),
    "pp-1f1b-uneven": dict(mesh="pp = 2", shard="pp { stages = [0..0, 1..3] }", m=4),
    "pp-interleaved": dict(mesh="pp = 2", shard="pp { virtual = 2 }", m=4,
                           schedule="; pipeline = interleaved"),
    # Uneven interleaving: 4 layers in 6 chunks, the first of the embedding alone and the
    # last of the head alone (Llama 3's layout), with tp and sequence parallelism; chunks
    # of 1 and 2 layers written out; the same with a tied head.
    "pp-interleaved-uneven-auto-tp-sp": dict(mesh="pp = 2; tp = 2", m=4,
                                             shard="pp { virtual = 3 }; tp { sequence_parallel "
                                                   "= on }", schedule="; pipeline = interleaved"),
    "pp-interleaved-uneven-explicit": dict(mesh="pp = 2", m=2, schedule="; pipeline = interleaved",
                                           shard="pp { virtual = 2; stages = [0, 1..2, 3, head] }"),
    "tied-pp-interleaved-uneven": dict(mesh="pp = 2", m=2, model="; tie_embeddings = on",
                                       schedule="; pipeline = interleaved",
                                       shard="pp { virtual = 2; stages = [embedding, 0..1, 2, 3] }"),
    "dp-zero0": dict(mesh="dp = 2", m=2),
    "dp-zero1": dict(mesh="dp = 2", shard="dp { zero = 1 }", m=2),
    "dp-zero3": dict(mesh="dp = 2", shard="dp { zero = 3 }", m=2),
    "custom-order": dict(mesh="tp = 2; dp = 2; order = [dp, tp, cp, pp]"),
    "recompute-full": dict(mesh="tp = 2", m=2, optimize="recompute = full"),
    "tp2-pp2-dp2": dict(mesh="tp = 2; pp = 2; dp = 2", m=2,
                        shard="tp { sequence_parallel = on }; dp { zero = 1 }"),
    "tied-over-pp": dict(mesh="pp = 2", m=2, model="; tie_embeddings = on"),
    "dp-zero2-sp": dict(mesh="tp = 2; dp = 2", m=2,
                        shard="tp { sequence_parallel = on }; dp { zero = 2 }"),
    "dp-zero3-recompute": dict(mesh="dp = 2", shard="dp { zero = 3 }", m=2,
                               optimize="recompute = full"),
    "tied-zero3": dict(mesh="dp = 2", shard="dp { zero = 3 }", model="; tie_embeddings = on"),
    "tied-pp-zero1": dict(mesh="pp = 2; dp = 2", m=2, model="; tie_embeddings = on",
                          shard="dp { zero = 1 }"),
}
# Overlapped ring attention and scatter-gather pipeline sends, each once (passes on).
OVERLAPS = {
    # The tied embedding's all-reduce joins the two stages: issued inside a block it held
    # the dp stream, and the ZeRO-3 gathers queued behind it, until the first stage's last
    # backward, which waited for them (a deadlock under 1F1B, found by the zero-bubble work).
    "tied-pp2-dp2-zero3": dict(mesh="pp = 2; dp = 2", m=2, model="; tie_embeddings = on",
                               shard="dp { zero = 3 }"),
    "cp-ring-no-load-balance": dict(mesh="cp = 2", shard="cp { attention = ring; "
                                    "load_balance = off }"),
    "cp-ring-tp2-sp": dict(mesh="cp = 2; tp = 2", shard="cp { attention = ring }; "
                           "tp { sequence_parallel = on }"),
    "pp2-tp2-scatter-gather": dict(mesh="pp = 2; tp = 2", m=2,
                                   optimize="pp_scatter_gather = on"),
    "pp2-tp2-no-scatter-gather": dict(mesh="pp = 2; tp = 2", m=2,
                                      optimize="pp_scatter_gather = off"),
}
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
    "zbv-tied-zero3": dict(mesh="pp = 2; dp = 2", m=2, schedule="; pipeline = zbv",
                           model="; tie_embeddings = on",
                           shard="pp { virtual = 2 }; dp { zero = 3 }"),
    "dualpipev-tied-zero1": dict(mesh="pp = 2; dp = 2", m=4, schedule="; pipeline = dualpipev",
                                 model="; tie_embeddings = on",
                                 shard="pp { virtual = 2 }; dp { zero = 1 }"),
    "dualpipev-tp2-sp-zero2": dict(mesh="tp = 2; pp = 2; dp = 2", m=4,
                                   schedule="; pipeline = dualpipev",
                                   shard="tp { sequence_parallel = on }; pp { virtual = 2 }; "
                                         "dp { zero = 2 }"),
})
TIED = ("tied-over-pp", "tied-zero3", "tied-pp-zero1",  # another model: its head is tied
        "tied-pp-interleaved-uneven", "zb1p-tied-zero3", "zbv-tied-zero3",
        "dualpipev-tied-zero1")
# Every plan with the optimisation passes as the plan says (on), and with each turned off.
SWITCHES = {"": [], "fuse-off": ["--set", "optimize.fuse=off"],
            "overlap-off": ["--set", "optimize.overlap=off"]}


METRICS = {"step", "loss", "time_s", "compute_s", "comm_s", "exposed_comm_s", "pipeline_wait_s",
           "tokens_per_s", "slowest_rank", "max_rss_mb", "build"}


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


def plan_text(name: str, **case) -> str:
    values = dict(model="", mesh="", shard="", m=1, schedule="", optimize="", topology="")
    values.update(case)
    return TEMPLATE.format(name=name.replace("-", "_"), **values)


def run(args: list[str], capfd) -> tuple[int, str]:
    """``planc run ARGS`` in this process; gloo unless ARGS name a backend (planc picks
    nccl on a machine with GPUs, which has fewer GPUs than most of these plans' ranks)."""
    args = [*map(str, args)]
    if "--backend" not in args:
        args += ["--backend", "gloo"]
    status = main(["run", *args])
    return status, capfd.readouterr().err


@pytest.fixture(scope="module")
def losses() -> dict[str, list[float]]:
    return {}


def run_checked(name: str, case: dict, tmp_path, capfd, *switches: str) -> list[dict]:
    """``planc run --check`` of the matrix plan ``name`` into tmp_path/build: it must match
    the one-process run; its metrics records."""
    plan = tmp_path / f"{name}.plan"
    plan.write_text(plan_text(name, **case))
    metrics = tmp_path / "metrics.jsonl"
    status, err = run([plan, "-o", tmp_path / "build", "--check", "--metrics", metrics,
                       "--timeout", "60", *switches], capfd)
    assert status == 0, err
    assert "every loss and parameter matches" in err
    return [json.loads(line) for line in metrics.read_text().splitlines()]


# Uneven interleaved chunks change what the derivation places, not what the passes do:
# they run with the passes as the plan says only (the suite's time).
PASSES_ON_ONLY = {"pp-interleaved-uneven-auto-tp-sp", "pp-interleaved-uneven-explicit",
                  "tied-pp-interleaved-uneven"}
RUNS = [(name, switch) for name in MATRIX for switch in SWITCHES
        if switch == "" or name not in PASSES_ON_ONLY]


@pytest.mark.parametrize("name,switch", RUNS,
                         ids=[f"{n}-{s or 'passes-on'}" for n, s in RUNS])
def test_every_plan_trains_exactly_like_one_process(name, switch, tmp_path, capfd, losses):
    records = run_checked(name, MATRIX[name], tmp_path, capfd, *SWITCHES[switch])
    assert [r["step"] for r in records] == [0, 1]
    assert all(set(r) == METRICS for r in records)
    for r in records:  # the slowest rank's step, and where its compute stream spent it
        assert 0 < r["compute_s"] < r["time_s"] and 0 <= r["exposed_comm_s"] < r["time_s"]
    losses[(name, switch)] = [r["loss"] for r in records]


@pytest.mark.parametrize("name", list(OVERLAPS))
def test_every_overlap_trains_exactly_like_one_process(name, tmp_path, capfd):
    run_checked(name, OVERLAPS[name], tmp_path, capfd)


@pytest.mark.parametrize("name", list(ZERO_BUBBLE))
def test_zero_bubble_schedules_train_exactly_like_one_process(name, tmp_path, capfd, losses):
    records = run_checked(name, ZERO_BUBBLE[name], tmp_path, capfd)
    programs = json.loads((tmp_path / "build" / "programs" / "stage0.json").read_text())
    assert any(block.startswith("W") for block, _ in programs["schedule"])
    losses[(name, "zero-bubble")] = [r["loss"] for r in records]


# tp_overlap forced to split (on gloo the cost model keeps every GEMM whole, which the
# matrix above runs): collective matmul with and without sequence parallelism, with data
# and pipeline parallelism, recomputation, and overlap off.
TP_OVERLAP = {
    "tp2-overlap-4": dict(mesh="tp = 2", m=2, optimize="tp_overlap = 4"),
    "tp2-dp2-sp-zero1-overlap-2": dict(mesh="tp = 2; dp = 2", m=2, optimize="tp_overlap = 2",
                                       shard="tp { sequence_parallel = on }; dp { zero = 1 }"),
    "tp2-pp2-sp-recompute-overlap-2": dict(mesh="tp = 2; pp = 2", m=4,
                                           shard="tp { sequence_parallel = on }",
                                           optimize="tp_overlap = 2; recompute = selective"),
    "tp2-sp-overlap-off-chunks-2": dict(mesh="tp = 2", shard="tp { sequence_parallel = on }",
                                        optimize="tp_overlap = 2; overlap = off"),
}


@pytest.mark.parametrize("name", list(TP_OVERLAP))
def test_tp_overlap_trains_exactly_like_one_process(name, tmp_path, capfd):
    run_checked(name, TP_OVERLAP[name], tmp_path, capfd)
    summary = json.loads((tmp_path / "build" / "summary.json").read_text())
    line = next(p["line"] for p in summary["passes"] if p["name"] == "tp_overlap")
    assert " GEMMs split into " in line, line


@pytest.mark.parametrize("name", list(ROUTES))
def test_every_route_trains_exactly_like_one_process(name, tmp_path, capfd, losses):
    records = run_checked(name, ROUTES[name], tmp_path, capfd)
    graph = json.loads((tmp_path / "build" / "graph.json").read_text())
    decisions = next(p for p in graph["graph"]["passes"] if p["name"] == "route")["decisions"]
    expected = ROUTES_TAKEN[name]
    assert decisions and all(d["route"] in ("ring", "tree", "hierarchical") for d in decisions)
    if expected is not None:
        assert {(d["kind"], d["route"]) for d in decisions} == expected
    losses[(name, "route")] = [r["loss"] for r in records]


def test_every_plan_of_one_model_follows_the_same_loss_curve(losses):
    if len(losses) < len(RUNS) + len(ROUTES):
        pytest.skip("needs the whole matrix")
    reference = losses[("single", "")]
    tied = losses[("tied-over-pp", "")]
    for (name, switch), curve in losses.items():
        expected = tied if name in TIED else reference
        assert curve == pytest.approx(expected, rel=1e-5), (name, switch)
    assert tied != pytest.approx(reference, rel=1e-3)  # another model


def test_buckets_closed_past_their_cap_train_exactly_like_one_process(tmp_path, capfd):
    # 4 KB buckets on tp 2 with sequence parallelism and ZeRO-1: each weight of 6 to 8 KB
    # closes the bucket that holds it and the biases and LayerNorms before it (PyTorch
    # DDP's rule), partial sums over tp leading 9 of the 14 buckets.
    plan = tmp_path / "small_buckets.plan"
    plan.write_text(plan_text("small-buckets", mesh="tp = 2; dp = 2", m=2,
                              shard="tp { sequence_parallel = on }; dp { zero = 1 }",
                              optimize="bucket = 4KB"))
    status, err = run([plan, "-o", tmp_path / "build", "--check", "--timeout", "60"], capfd)
    assert status == 0, err
    assert "every loss and parameter matches" in err
    graph = json.loads((tmp_path / "build" / "graph.json").read_text())
    buckets = graph["graph"]["buckets"].values()
    assert [len(b["members"]) for b in buckets] == [1] + [4, 2, 6] * 4 + [4]
    assert (min(b["numel"] for b in buckets) * 4, max(b["numel"] for b in buckets) * 4) == (
        8192, 10496)  # the head alone; layer 0's LayerNorm with both embeddings
    assert sum(b["tp_sum_numel"] > 0 for b in buckets) == 9


def test_gpt_tiny_with_adamw_and_a_trace(tmp_path, capfd):
    trace = tmp_path / "trace.json"
    status, err = run([PLANS / "gpt-tiny.plan", "-o", tmp_path / "b", "--steps", "2",
                       "--check", "--trace", trace], capfd)
    assert status == 0, err
    assert "step 2/2" in err and "every loss and parameter matches" in err
    events = json.loads(trace.read_text())["traceEvents"]
    processes = {e["pid"] for e in events if e["ph"] == "X"}
    assert processes == set(range(8))
    names = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert {"compute", "comm", "send_next", "recv_next", "recv_prev", "send_prev"} <= names
    kinds = {e["name"].split(":")[-1] for e in events if e["ph"] == "X" and ":" in e["name"]}
    assert {"all_reduce@tp", "send@pp", "recv@pp", "reduce_scatter@dp_cp",
            "all_gather@dp_cp"} <= kinds
    # A flow arrow from every pipeline send to its receive on the peer rank: 2 steps x 4
    # microbatches x 2 directions on each of the 4 pipeline pairs.
    starts = {e["id"]: e for e in events if e["ph"] == "s"}
    finishes = {e["id"]: e for e in events if e["ph"] == "f"}
    assert len(starts) == len(finishes) == 2 * 4 * 2 * 4 and set(starts) == set(finishes)
    assert all(starts[i]["pid"] != finishes[i]["pid"] for i in starts)


def test_the_demo_plan_learns_the_corpus_exactly_like_one_process(tmp_path, capfd):
    """make demo's run, 16 of its 40 steps: plans/demo.plan on the corpus of make corpus.
    Uniform random tokens (the synthetic data) keep the loss at ln(vocab) whatever the
    model learns; the stories have structure, so the loss falls by more than 1.5."""
    from planc.tools.corpus import main as make_corpus

    corpus = tmp_path / "tiny-corpus.tokens"
    assert make_corpus(["-o", str(corpus)]) == 0
    metrics = tmp_path / "metrics.jsonl"
    status, err = run([PLANS / "demo.plan", "-o", tmp_path / "b", "--set",
                       f'train.data="{corpus}"', "--steps", "16", "--check",
                       "--metrics", metrics, "--timeout", "60"], capfd)
    assert status == 0, err
    assert "check: 16 steps and 53 parameters on each of 2 replicas against the " \
           "single-process run (relative tolerance 1e-05): every loss and parameter " \
           "matches" in err
    loss = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
    assert len(loss) == 16
    assert loss[0] == pytest.approx(math.log(1024), abs=0.05)  # an untrained model
    assert loss[-1] < loss[0] - 1.5


def test_data_from_a_file_of_uint16_tokens(tmp_path, capfd):
    tokens = torch.randint(0, 128, (1000,), generator=torch.Generator().manual_seed(1))
    (tmp_path / "tokens.bin").write_bytes(b"".join(int(t).to_bytes(2, "little")
                                                   for t in tokens))
    text = plan_text("file_data", mesh="tp = 2").replace(
        "seed = 3 }", 'seed = 3; data = "tokens.bin" }')
    (tmp_path / "f.plan").write_text(text)
    status, err = run([tmp_path / "f.plan", "-o", tmp_path / "b", "--check"], capfd)
    assert status == 0, err


def test_a_data_file_that_changed_after_compile_is_refused_before_any_rank_starts(
        tmp_path, capfd):
    text = plan_text("file_data").replace("seed = 3 }", 'seed = 3; data = "tokens.bin" }')
    (tmp_path / "f.plan").write_text(text)
    assert main(["compile", str(tmp_path / "f.plan"), "-o", str(tmp_path / "b")]) == 0
    assert "data file 'tokens.bin' does not exist (yet)" in capfd.readouterr().err
    tokens = tmp_path / "tokens.bin"
    status, err = run([tmp_path / "b"], capfd)
    assert (status, err) == (1, f"planc: error: data file {tokens} does not exist; nothing "
                                f"was run\n")
    tokens.write_bytes(b"".join(t.to_bytes(2, "little") for t in [5] * 40 + [300] + [5] * 9))
    status, err = run([tmp_path / "b"], capfd)
    assert (status, err) == (1, f"planc: error: data file {tokens} holds token id 300 (token "
                                f"40 of the file), not below vocab = 128; nothing was run\n")
    assert not (tmp_path / "b" / "logs").exists()


def test_a_data_file_is_read_a_step_at_a_time_and_each_batch_checked(tmp_path):
    from planc.lang import load_text
    from planc.runtime.data import DataError, batch_tokens

    tokens = tmp_path / "tokens.bin"
    values = list(range(100))
    tokens.write_bytes(b"".join(t.to_bytes(2, "little") for t in values))
    text = plan_text("file_data").replace("seed = 3 }", f'seed = 3; data = "{tokens}" }}')
    plan = load_text(text).plan
    values[86] = 500  # written after the check: beyond vocab, and only in step 1's batch
    tokens.write_bytes(b"".join(t.to_bytes(2, "little") for t in values))
    first = batch_tokens(plan, 0)
    assert first.shape == (8, 17) and first.dtype == torch.int64
    # 100 tokens hold 84 sample starts: sample j starts at token (17 j) mod 84
    assert [int(row[0]) for row in first] == [17 * j % 84 for j in range(8)]
    assert first[5].tolist() == list(range(1, 18))
    with pytest.raises(DataError) as caught:
        batch_tokens(plan, 1)
    assert str(caught.value) == (f"data file {tokens} holds token id 500 in the batch of "
                                 f"step 1, not below vocab = 128")
    tokens.write_bytes(b"\x01\x00" * 10)
    with pytest.raises(DataError) as caught:
        batch_tokens(plan, 0)
    assert str(caught.value) == (f"data file {tokens} no longer holds one sample (seq + 1 = "
                                 f"17 tokens)")
    tokens.unlink()
    with pytest.raises(DataError) as caught:
        batch_tokens(plan, 0)
    assert str(caught.value) == (f"data file {tokens} cannot be read for step 0 (No such "
                                 f"file or directory)")


# --- failures ---------------------------------------------------------------------------------


def _compiled(tmp_path, name: str, capfd) -> Path:
    plan = tmp_path / f"{name}.plan"
    plan.write_text(plan_text(name, **MATRIX[name]))
    assert main(["compile", str(plan), "-o", str(tmp_path / "b")]) == 0
    capfd.readouterr()
    return tmp_path / "b"


def _edit(directory: Path, name: str, change) -> None:
    path = directory / "programs" / name
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def test_a_rank_that_raises_brings_the_run_down_with_its_traceback(tmp_path, capfd):
    build = _compiled(tmp_path, "pp-1f1b-uneven", capfd)

    def misorder(data):  # stage 1 runs a backward step before its input gradient exists
        block = data["blocks"]["B1"]
        steps = [i for i, x in enumerate(block) if x["op"] == "compute"]
        block[steps[0]], block[steps[3]] = block[steps[3]], block[steps[0]]

    _edit(build, "stage1.json", misorder)
    status, err = run([build, "--no-verify", "--timeout", "60"], capfd)
    assert status == 1
    assert "planc: rank 1 exited with status 1" in err
    assert "planc: traceback of rank 1, the first to fail:" in err
    assert "KeyError: ('B/final_ln', 0)" in err


def test_a_transfer_that_never_completes_makes_every_rank_report(tmp_path, capfd):
    build = _compiled(tmp_path, "pp-1f1b-uneven", capfd)
    _edit(build, "stage0.json", lambda data: data["blocks"].update(
        F0=[x for x in data["blocks"]["F0"] if x["op"] != "send"]))
    assert main(["verify", str(build)]) == 1  # the verifier would have refused it
    capfd.readouterr()
    start = time.monotonic()
    status, err = run([build, "--no-verify", "--timeout", "3"], capfd)
    assert status == 1
    assert time.monotonic() - start < 40
    assert "rank 1 (stage 1, tp 0, cp 0, dp 0) made no progress for 3 s in step 0; its " \
           "streams wait on:" in err
    assert "  recv_prev: #0 recv F/c0>c1:recv@pp (microbatch 0): receive from rank 0 (pp)" in err
    assert "rank 0 (stage 0, tp 0, cp 0, dp 0)" in err
    assert "recv_next: #" in err and "receive from rank 1 (pp)" in err


# --- a cluster launch -----------------------------------------------------------------------


def test_two_torchrun_nodes_on_localhost_form_one_world(tmp_path, capfd):
    plan = tmp_path / "four.plan"
    plan.write_text(plan_text("four", mesh="tp = 2; pp = 2", m=2))
    assert main(["compile", str(plan), "-o", str(tmp_path / "four")]) == 0
    capfd.readouterr()
    port = str(29000 + os.getpid() % 1000)
    nodes = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank",
         str(i), "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", port,
         "-m", "planc.runtime.worker", str(tmp_path / "four"), "--check"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"}) for i in (0, 1)]
    outputs = [node.communicate(timeout=240) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs
    assert "every loss and parameter matches" in outputs[0][1]


# --- GPUs -------------------------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs two CUDA devices")
def test_nccl_with_cuda_streams(tmp_path, capfd):  # pragma: no cover - no GPU here
    plan = tmp_path / "cuda.plan"
    plan.write_text(plan_text("cuda", mesh="tp = 2", m=2))
    status, err = run([plan, "-o", tmp_path / "b", "--check", "--backend", "nccl"], capfd)
    assert status == 0, err


def test_cuda_backend_refused_cleanly_without_gpus(tmp_path, capfd):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    plan = tmp_path / "p.plan"
    plan.write_text(plan_text("p", mesh="tp = 2"))
    status, err = run([plan, "-o", tmp_path / "b", "--backend", "nccl"], capfd)
    assert status == 1  # this machine cannot do it (README, "Exit status")
    assert "the nccl backend needs a GPU per rank" in err
    shutil.rmtree(tmp_path / "b")


def test_check_reports_a_wrong_result_per_parameter(tmp_path, capfd):
    build = _compiled(tmp_path, "tp-megatron", capfd)
    graph = json.loads((build / "graph.json").read_text())
    for node in graph["nodes"]:  # a sum that became a max: wrong numbers, no crash
        if node["id"] == "F/L1/fc2>mlp_residual:all_reduce@tp":
            node["reduce_op"] = "max"
    (build / "graph.json").write_text(json.dumps(graph))
    # the program is what runs: its operands say the same (the verifier checks they agree)
    program = json.loads((build / "programs" / "stage0.json").read_text())
    for block in program["blocks"].values():
        for instruction in block:
            if instruction.get("node") == "F/L1/fc2>mlp_residual:all_reduce@tp":
                instruction["operands"]["reduce_op"] = "max"
    (build / "programs" / "stage0.json").write_text(json.dumps(program))
    status, err = run([build, "--check"], capfd)
    assert status == 1
    assert "against the single-process run (relative tolerance 1e-05): FAILED" in err
    assert "MISMATCH" in err
    assert "layers.1.fc2.weight: largest difference" in err
    assert "planc: rank 0 exited with status 1" in err


def test_bf16_with_adamw_compares_losses_and_says_why_not_parameters(tmp_path, capfd):
    text = plan_text("half", mesh="tp = 2", model="; dtype = bf16").replace(
        "sgd(lr = 0.5, momentum = 0.9)", "adamw(lr = 0.01)")
    (tmp_path / "h.plan").write_text(text)
    status, err = run([tmp_path / "h.plan", "-o", tmp_path / "b", "--check"], capfd)
    assert status == 0, err
    assert ("check: 2 steps and no parameters (bf16/fp16 with AdamW, see below) against the "
            "single-process run (relative tolerance 0.02): every loss matches.") in err


@pytest.mark.parametrize("flag", ["--metrics", "--trace"])
def test_an_unwritable_output_path_is_refused_before_anything_runs(flag, tmp_path, capfd):
    plan = tmp_path / "p.plan"
    plan.write_text(plan_text("p"))
    status, err = run([plan, "-o", tmp_path / "b", flag, tmp_path / "missing" / "m.json"], capfd)
    assert status == 1
    assert err == (f"planc: error: {flag} {tmp_path / 'missing' / 'm.json'}: cannot write "
                   f"there ({tmp_path / 'missing'} is not a writable directory)\n")
    assert not (tmp_path / "b").exists()
    status, err = run([plan, "-o", tmp_path / "b", flag, tmp_path], capfd)
    assert status == 1
    assert err == f"planc: error: {flag} {tmp_path}: is a directory; name a file\n"
