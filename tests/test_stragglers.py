"""Naming the straggler (issue 39): planc.runtime.stragglers on the per-step busy times
the metrics gather from every rank, and a balanced run that names none."""

from __future__ import annotations

import json

import pytest

from planc.runtime.stragglers import StragglerWatch, describe

STAGES = [[0, 1, 2], [3, 4, 5]]  # pp = 2, three peers a stage


def busy(compute: list[float], comm: list[float] | None = None) -> dict[str, list[float]]:
    return {"compute_s": compute, "comm_s": comm or [0.01] * len(compute)}


def test_a_rank_slower_than_its_peers_for_three_steps_is_named_on_the_third():
    watch = StragglerWatch(STAGES, margin=0.2, patience=3, warmup=0)
    # stage 1 does more work than stage 0 (a pipeline's stages differ): no straggler
    normal = [0.10, 0.10, 0.10, 0.25, 0.25, 0.25]
    slow = [0.10, 0.13, 0.10, 0.25, 0.25, 0.25]  # rank 1: 30 % over its peers' median
    assert watch.observe(busy(normal)) is None
    assert watch.observe(busy(slow)) is None
    assert watch.observe(busy(slow)) is None
    named = watch.observe(busy(slow))
    assert named == {"rank": 1, "stream": "compute", "slower_by": 0.3, "steps": 3}
    assert describe(named) == "straggler: rank 1's compute stream 30% slower than its " \
                              "peers' for 3 steps"
    assert watch.observe(busy(slow))["steps"] == 4
    assert watch.observe(busy(normal)) is None  # a step at its peers' pace resets it


def test_below_the_margin_or_the_noise_or_for_two_steps_nobody_is_named():
    watch = StragglerWatch(STAGES, margin=0.2, patience=3, warmup=0)
    for compute in ([0.10, 0.119, 0.10, 0.2, 0.2, 0.2],  # 19 %: under the margin
                    [0.001, 0.0018, 0.001, 0.2, 0.2, 0.2],  # 80 %, but under a millisecond
                    [0.10, 0.15, 0.10, 0.2, 0.2, 0.2], [0.10, 0.15, 0.10, 0.2, 0.2, 0.2],
                    [0.10, 0.10, 0.10, 0.2, 0.2, 0.2], [0.10, 0.15, 0.10, 0.2, 0.2, 0.2]):
        assert watch.observe(busy(compute)) is None
    # a stage of one rank has no peer to compare with
    alone = StragglerWatch([[0], [1]], patience=1, warmup=0)
    assert alone.observe(busy([0.1, 0.9])) is None


def test_the_first_steps_are_warm_up_and_the_default_waits_five_steps():
    watch = StragglerWatch(STAGES)
    slow = [0.10, 0.2, 0.10, 0.25, 0.25, 0.25]
    seen = [watch.observe(busy(slow)) for _ in range(7)]
    assert seen[:6] == [None] * 6  # 2 steps of warm-up, then 4 of the 5
    assert seen[6] == {"rank": 1, "stream": "compute", "slower_by": 1.0, "steps": 5}


def test_only_compute_is_judged_and_the_worst_rank_wins():
    """A collective lasts on every member until the slowest joins it, so a rank's long
    transfers say nothing of which rank was slow: only compute names a straggler."""
    watch = StragglerWatch(STAGES, margin=0.2, patience=2, warmup=0)
    compute = [0.10, 0.13, 0.10, 0.20, 0.30, 0.20]  # rank 1: 30 % slower, rank 4: 50 %
    comm = [0.05, 0.05, 2.00, 0.05, 0.05, 0.05]  # rank 2 waited long in its collectives
    assert watch.observe(busy(compute, comm)) is None
    assert watch.observe(busy(compute, comm)) == {"rank": 4, "stream": "compute",
                                                   "slower_by": 0.5, "steps": 2}


@pytest.mark.slow
def test_a_balanced_run_names_no_straggler_and_the_margin_is_checked(tmp_path, capfd):
    pytest.importorskip("torch")
    from planc.cli import main

    plan = tmp_path / "p.plan"
    plan.write_text("plan p {\n  model gpt { layers = 2; hidden = 64; heads = 4; vocab = 128; "
                    "seq = 16; batch = 8 }\n  mesh { dp = 2 }\n  train { steps = 6; "
                    "optimizer = sgd(lr = 0.1) }\n}\n")
    metrics = tmp_path / "m.jsonl"
    # the margin so wide that two equal ranks sharing two cores cannot pass it
    assert main(["run", str(plan), "-o", str(tmp_path / "b"), "--metrics", str(metrics),
                 "--straggler-margin", "100"]) == 0
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert len(records) == 6 and not any("straggler" in r for r in records)
    assert "straggler" not in capfd.readouterr().err
    for margin in ("0", "-1", "nan", "101"):
        assert main(["run", str(plan), "--straggler-margin", margin]) == 2
        assert capfd.readouterr().err.splitlines() == [
            f"planc: error: --straggler-margin must be above 0 and at most 100 (a fraction: "
            f"0.2 is 20 % slower than the peers), not {float(margin):g}"]
