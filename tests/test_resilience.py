"""Checkpoints and failures priced (planc.estimate.resilience; planc simulate --mtbf,
planc tune --mtbf; issue 39)."""

from __future__ import annotations

import json
import math

import pytest

from planc.cli import main
from planc.estimate.memory import total_parameters
from planc.estimate.resilience import (HOST_COPY_BYTES_PER_S, RESTART_S, STORAGE_BYTES_PER_S,
                                       price, stage_parameters_whole, stage_state_bytes)
from planc.lang import load_file
from planc.plan.layout import Layout
from tests.conftest import ROOT

PLANS = ROOT / "plans"


def plan_of(name: str, *overrides: str):
    loaded = load_file(PLANS / name, list(overrides))
    assert loaded.ok, loaded.diagnostics
    return loaded.plan


@pytest.mark.parametrize("name", ["gpt-tiny.plan", "llama3-405b.plan", "moe-tiny.plan",
                                  "pp-interleaved.plan", "demo.plan"])
def test_the_stages_hold_every_parameter_once(name):
    plan = plan_of(name)
    assert sum(stage_parameters_whole(plan)) == total_parameters(plan)


@pytest.mark.parametrize("optimizer, per_parameter", [
    ("adamw(lr = 1e-3)", 12), ("sgd(lr = 0.1, momentum = 0.9)", 8), ("sgd(lr = 0.1)", 4)])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_checkpoint_holds_fp32_parameters_and_the_optimizers_state(optimizer, per_parameter,
                                                                     dtype):
    plan = plan_of("gpt-tiny.plan", f"train.optimizer={optimizer}", f"model.dtype={dtype}")
    assert sum(stage_state_bytes(plan)) == per_parameter * total_parameters(plan)


def test_young_interval_and_its_costs():
    plan = plan_of("llama3-405b.plan")  # pp 16 on nodes of 8: a writer a node
    step, mtbf = 9.0, 3.1 * 3600
    stages = stage_state_bytes(plan)
    sync = price(plan, step, mtbf)
    assert sync.writers_per_node == 1 and sync.writer_bytes == max(stages)
    assert sync.copy_seconds == max(stages) / HOST_COPY_BYTES_PER_S
    assert sync.write_seconds == max(stages) / STORAGE_BYTES_PER_S
    cost = sync.copy_seconds + sync.write_seconds
    assert sync.every == sync.optimal_every == round(math.sqrt(2 * cost * mtbf) / step)
    assert sync.blocked_seconds == cost
    assert sync.lost_fraction == pytest.approx(
        ((sync.every * step + cost) / 2 + sync.restart_seconds) / mtbf)
    # a restart reads every stage's checkpoint back, each node its share (5.6 s here)
    assert sync.restart_seconds == RESTART_S + sum(stages) / (
        Layout.of(plan).nodes * STORAGE_BYTES_PER_S)
    # Young's interval is the one that loses least: shorter and longer ones lose more
    for every in (sync.every // 2, sync.every * 2):
        assert price(plan, step, mtbf, every).effective_step_seconds > \
            sync.effective_step_seconds
    # asynchronous: the steps wait for the copy alone, at an interval the writer keeps
    background = price(plan, step, mtbf, asynchronous=True)
    # Young's interval of the copy alone (36 steps; of copy and write, 296), but never
    # shorter than the writer needs
    assert background.every == background.optimal_every == max(
        round(math.sqrt(2 * background.copy_seconds * mtbf) / step),
        math.ceil(background.write_seconds / step)) == 36
    assert background.every * step >= background.write_seconds
    assert background.blocked_seconds == background.copy_seconds
    assert background.effective_step_seconds < sync.effective_step_seconds
    # an asynchronous writer that falls behind holds the next checkpoint up
    behind = price(plan, step, None, every=1, asynchronous=True)
    assert behind.blocked_seconds == pytest.approx(
        behind.copy_seconds + behind.write_seconds - step)
    assert behind.lost_fraction == 0 and behind.optimal_every is None
    with pytest.raises(ValueError):
        price(plan, step)


def test_writers_of_stages_on_one_node_share_its_storage():
    plan = plan_of("gpt-tiny.plan", "mesh.order=[pp, tp, cp, dp]", "mesh.dp=1", "mesh.tp=1",
                   "topology.nodes=1", "topology.devices_per_node=2")
    shared = price(plan, 1.0, every=10)
    # the two writers of a node write at once, each at half the node's storage rate
    assert shared.writers_per_node == 2
    assert shared.write_seconds == 2 * max(stage_state_bytes(plan)) / STORAGE_BYTES_PER_S


def test_simulate_prices_checkpoints_and_failures(capsys):
    assert main(["simulate", str(PLANS / "llama3-405b.plan"), "--mtbf", "3.1",
                 "--checkpoint-async"]) == 0
    out = capsys.readouterr().out
    assert "checkpoints and failures (docs/simulate.md)" in out
    assert "  checkpoint     4.87 TB: fp32 parameters and optimizer state; the largest " \
           "stage's writer 306 GB\n" in out
    assert "  copy to host   4.78 s (PCIe Gen5 x16, 64 GB/s)\n" in out
    assert main(["simulate", str(PLANS / "llama3-405b.plan"), "--checkpoint-every", "100",
                 "--json"]) == 0
    data = json.loads(capsys.readouterr().out)["checkpoints_and_failures"]
    assert data["every"] == 100 and data["mtbf_seconds"] is None and data["lost_fraction"] == 0
    assert data["checkpoint_overhead"] == pytest.approx(
        data["blocked_seconds"] / 100 / data["step_seconds"])


@pytest.mark.parametrize("flags, message", [
    (["--mtbf", "0"], "--mtbf 0: must be a number from 1e-06 to 1e+09"),
    (["--mtbf", "nan"], "--mtbf nan: must be a number from 1e-06 to 1e+09"),
    (["--mtbf", "1e306"], "--mtbf 1e+306: must be a number from 1e-06 to 1e+09"),
    (["--storage", "-1", "--mtbf", "1"], "--storage -1: must be a number from 1e-06 to 1e+09"),
    (["--storage", "1e-310", "--mtbf", "1"],
     "--storage 1e-310: must be a number from 1e-06 to 1e+09"),
    (["--restart", "-1", "--mtbf", "1"], "--restart -1: must be a number from 0 to 1e+09"),
    (["--checkpoint-every", "0"],
     "--checkpoint-every must be a number of steps from 1 to 10^12"),
    # a number past a float's range stopped simulate with an OverflowError
    (["--checkpoint-every", "1" + "0" * 400],
     "--checkpoint-every must be a number of steps from 1 to 10^12"),
    (["--checkpoint-every", str(10**12 + 1), "--mtbf", "3"],
     "--checkpoint-every must be a number of steps from 1 to 10^12"),
    # options that price checkpoints did nothing where nothing was priced
    (["--storage", "5"], "--storage prices checkpoints, which only --mtbf or "
                         "--checkpoint-every asks for"),
    (["--restart", "5"], "--restart prices checkpoints, which only --mtbf or "
                         "--checkpoint-every asks for"),
    (["--checkpoint-async"], "--checkpoint-async prices checkpoints, which only --mtbf or "
                             "--checkpoint-every asks for"),
])
def test_bad_pricing_options_are_refused(flags, message, capsys):
    assert main(["simulate", str(PLANS / "gpt-tiny.plan"), *flags]) == 2
    assert capsys.readouterr().err == f"planc: error: {message}\n"


def test_tune_refuses_a_pricing_option_without_mtbf(capsys):
    assert main(["tune", str(PLANS / "gpt-tiny.plan"), "--gpus", "8", "--storage", "5"]) == 2
    assert capsys.readouterr().err == ("planc: error: --storage prices checkpoints, which "
                                       "only --mtbf asks for\n")


def test_tune_ranks_by_the_step_with_failures_priced(capsys):
    assert main(["tune", str(PLANS / "gpt-tiny.plan"), "--gpus", "4", "--top", "4",
                 "--mtbf", "0.001", "--json", "--budget", "20"]) == 0
    ranked = json.loads(capsys.readouterr().out)["candidates"]
    effective = [c["effective_step_seconds"] for c in ranked]
    assert effective == sorted(effective) and len(ranked) == 4
    assert all(c["effective_step_seconds"] > c["step_seconds"] for c in ranked)


def test_failures_faster_than_recovery_leave_no_step(capsys):
    # one failure every 3.6 s against a 5.6 s restart: the run never gets ahead
    assert main(["simulate", str(PLANS / "llama3-405b.plan"), "--mtbf", "0.001",
                 "--json"]) == 0
    data = json.loads(capsys.readouterr().out)["checkpoints_and_failures"]
    assert data["lost_fraction"] > 1 and data["effective_step_seconds"] is None
    assert main(["simulate", str(PLANS / "llama3-405b.plan"), "--mtbf", "0.001"]) == 0
    assert "  step, all in   never: a failure comes before the run gets back to where it " \
           "was\n" in capsys.readouterr().out
