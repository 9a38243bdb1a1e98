"""The routing's balance, measured (issue 40): every step's rows per ep rank in the
metrics (``ep_rows``, ``ep_imbalance``), and ``planc simulate --imbalance-from``."""

from __future__ import annotations

import json

import pytest

from planc.cli import main
from tests.conftest import ROOT

PLANS = ROOT / "plans"


def test_the_balance_of_rows_per_group():
    torch = pytest.importorskip("torch")  # noqa: F841 (step_records imports it)
    from planc.runtime.step_records import routing_balance

    # two ep groups (first members 0 and 2); rank 4 holds no experts
    assert routing_balance([10, 30, 20, 20, 0], [0, 0, 2, 2, -1]) == {
        "ep_rows": [10, 30, 20, 20, None], "ep_imbalance": 1.5}
    assert routing_balance([0, 0], [-1, -1]) == {}
    assert routing_balance([0, 0], [0, 0]) == {"ep_rows": [0, 0], "ep_imbalance": 1.0}


@pytest.mark.parametrize("recompute", ["none", "full"])  # a recomputed block counts once
def test_a_run_records_the_rows_every_ep_rank_ran(tmp_path, recompute):
    pytest.importorskip("torch")
    metrics = tmp_path / "m.jsonl"
    assert main(["run", str(PLANS / "moe-tiny.plan"), "-o", str(tmp_path / "b"), "--steps",
                 "2", "--metrics", str(metrics), "--set",
                 f"optimize.recompute={recompute}"]) == 0
    # moe-tiny: batch 8 x seq 32 tokens, top_k 2, mixture blocks 1 (stage 0) and 2 and 3
    # (stage 1); ep 4 over each stage's tp x dp ranks (order tp, cp, pp, dp), each token
    # routed once, by the tp rank that holds it
    stages = {0: [0, 1, 4, 5], 1: [2, 3, 6, 7]}
    for line in metrics.read_text().splitlines():
        record = json.loads(line)
        rows = record["ep_rows"]
        assert [sum(rows[r] for r in stages[s]) for s in (0, 1)] == [8 * 32 * 2 * 1,
                                                                      8 * 32 * 2 * 2]
        assert record["ep_imbalance"] == max(
            max(rows[r] for r in ranks) / (sum(rows[r] for r in ranks) / len(ranks))
            for ranks in stages.values())


def test_simulate_takes_the_measured_imbalance(tmp_path, capsys):
    metrics = tmp_path / "m.jsonl"
    metrics.write_text("".join(json.dumps({"step": s, "loss": 4.0, "time_s": 0.5,
                                           "ep_imbalance": value}) + "\n"
                               for s, value in enumerate([1.2, 1.5, 1.4])))
    assert main(["simulate", str(PLANS / "moe-tiny.plan"), "--imbalance-from", str(metrics),
                 "--json"]) == 0
    out = capsys.readouterr()
    assert out.err == (f"planc: model.imbalance = 1.4, the median ep_imbalance of the 3 "
                       f"steps in {metrics}\n")
    measured = json.loads(out.out)["step_seconds"]
    assert main(["simulate", str(PLANS / "moe-tiny.plan"), "--set", "model.imbalance=1.4",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step_seconds"] == measured
    assert main(["simulate", str(PLANS / "moe-tiny.plan"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step_seconds"] != measured  # 1.72 declared


def test_imbalance_from_a_file_whose_last_line_is_cut_short_says_where_it_stopped(
        tmp_path, capsys):
    """A run killed while writing its last record: the records before it are read, and,
    as planc plot and planc report do, simulate says where they stopped."""
    metrics = tmp_path / "m.jsonl"
    whole = "".join(json.dumps({"step": s, "loss": 4.0, "time_s": 0.5, "ep_imbalance": v})
                    + "\n" for s, v in enumerate([1.2, 1.5, 1.4]))
    metrics.write_text(whole[:-20])  # the last line cut short, without its newline
    assert main(["simulate", str(PLANS / "moe-tiny.plan"), "--imbalance-from", str(metrics),
                 "--json"]) == 0
    assert capsys.readouterr().err == (
        f"planc: warning: {metrics}: line 3, the last, is cut short (a run stopped while "
        f"writing it); read the lines before it\nplanc: model.imbalance = 1.35, the median "
        f"ep_imbalance of the 2 steps in {metrics}\n")


def test_imbalance_from_a_file_without_it_is_refused(tmp_path, capsys):
    metrics = tmp_path / "m.jsonl"
    metrics.write_text(json.dumps({"step": 0, "loss": 4.0, "time_s": 0.5}) + "\n")
    assert main(["simulate", str(PLANS / "moe-tiny.plan"), "--imbalance-from",
                 str(metrics)]) == 1
    assert capsys.readouterr().err == (
        f"planc: error: {metrics} records no ep_imbalance: planc run writes it for a plan "
        f"whose experts are split over ep\n")


def test_imbalance_from_says_so_of_another_plans_run_and_refuses_an_imbalance_under_1(
        tmp_path, capsys):
    """The median was raised to 1 without a word (a file saying 0.5 gave "model.imbalance
    = 1, the median"), and a run of another plan was taken as this one's."""
    metrics = tmp_path / "m.jsonl"
    for plan, values in (("two", [1.3, 1.3, 1.3]), ("x\u001b[31mred", [1.3, 1.3, 1.3]),
                         ("moe_tiny", [1.3, 0.5, 1.3])):
        metrics.write_text("".join(json.dumps({"step": s, "loss": 4.0, "time_s": 0.5,
                                               "ep_imbalance": v, "plan": plan}) + "\n"
                                   for s, v in enumerate(values)))
        status = main(["simulate", str(PLANS / "moe-tiny.plan"), "--imbalance-from",
                       str(metrics), "--json"])
        err = capsys.readouterr().err
        if plan != "moe_tiny":  # a name from a file reaches the terminal as text
            shown = "two" if plan == "two" else "'x\\x1b[31mred'"
            assert status == 0
            assert err == (f"planc: model.imbalance = 1.3, the median ep_imbalance of the 3 "
                           f"steps in {metrics}\nplanc: warning: {metrics} records a run of "
                           f"{shown}, not of moe_tiny: its imbalance is another plan's\n")
        else:
            assert (status, err) == (1, (
                f"planc: error: {metrics}: line 2 (step 2) has an ep_imbalance under 1 (the "
                f"busiest over the mean); it is not what planc run --metrics writes\n"))
