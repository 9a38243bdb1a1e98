"""planc run --check with the communication passes forced where gloo's cost model would
not choose them: overlapped ring attention and scatter-gather pipeline sends, tp_overlap's
split GEMMs, and gradient buckets closed past their cap. Each run trains exactly like one
process (tests/runtime_matrix.py runs it; tests/test_runtime.py has the matrix)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

from tests.runtime_matrix import plan_text, run, run_checked  # noqa: E402

pytestmark = pytest.mark.slow

# Overlapped ring attention and scatter-gather pipeline sends, each once (passes on).
OVERLAPS = {
    # (The tied embedding's all-reduce over pp with ZeRO-3, a deadlock under 1F1B once:
    # tests/test_runtime.py's featured run pp2-dp2-zero3-tied.)
    "cp-ring-no-load-balance": dict(mesh="cp = 2", shard="cp { attention = ring; "
                                    "load_balance = off }"),
    "cp-ring-tp2-sp": dict(mesh="cp = 2; tp = 2", shard="cp { attention = ring }; "
                           "tp { sequence_parallel = on }"),
    "pp2-tp2-scatter-gather": dict(mesh="pp = 2; tp = 2", m=2,
                                   optimize="pp_scatter_gather = on"),
    "pp2-tp2-no-scatter-gather": dict(mesh="pp = 2; tp = 2", m=2,
                                      optimize="pp_scatter_gather = off"),
}


@pytest.mark.parametrize("name", list(OVERLAPS))
def test_every_overlap_trains_exactly_like_one_process(name, tmp_path, capfd):
    run_checked(name, OVERLAPS[name], tmp_path, capfd)


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
