"""make demo: it measures this machine (planc calibrate), trains plans/demo.plan priced on
that measurement on the project's corpus (made first if missing), and ends by printing
the predicted and measured step and where the build directory, the comm graph and the
report are, as absolute paths of the files its own commands wrote."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys

from tests.conftest import PLANS, ROOT

from planc.compile import compile_plan
from planc.lang import load_file
from planc.models import step_model_flops
from planc.simulate import simulate

MACHINE = ".venv/bin/planc calibrate -o build/demo-machine.json --ranks 8 --quick --repeats 3 --force"
HERE = "--set 'topology.preset=\"../build/demo-machine.json\"'"


def test_make_demo_trains_on_the_corpus_and_prints_the_three_paths():
    # -n prints the commands without running them; -B takes every target as out of date,
    # so the corpus's command shows whether or not data/ exists here.
    done = subprocess.run(["make", "-n", "-B", "demo"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    compile_line = next(line for line in lines if " compile " in line)
    assert compile_line == (".venv/bin/planc compile plans/demo.plan --set "
                            f"'train.data=\"../data/tiny-corpus.tokens\"' {HERE} -o build/demo")
    # this machine is measured first, and every command that reads the plan prices it
    assert lines.index(MACHINE) < lines.index(compile_line)
    assert f".venv/bin/planc check plans/demo.plan {HERE} --verbose" in lines
    assert f".venv/bin/planc layout plans/demo.plan {HERE}" in lines
    build = ROOT / "build" / "demo"
    assert (".venv/bin/planc run build/demo --check --metrics build/demo/metrics.jsonl "
            "--force") in lines
    assert ".venv/bin/planc graph build/demo -o build/demo/graph.html --force" in lines
    assert (".venv/bin/planc report build/demo -o build/demo/report.html --metrics "
            "build/demo/metrics.jsonl --force") in lines
    shown = [re.fullmatch(r'echo "(\w+): +(.*)"', line) for line in lines]
    assert [(m[1], m[2]) for m in shown if m] == [
        ("build", f"{build}/"), ("graph", f"{build}/graph.html"),
        ("report", f"{build}/report.html")]
    corpus = next(k for k, line in enumerate(lines)
                  if line.endswith(" -m planc.data.corpus -o data/tiny-corpus.tokens --force"))
    assert corpus < lines.index(compile_line)  # made before the demo trains on it


def test_the_demo_plan_names_a_machine_that_planc_calibrate_measured():
    plan = load_file(PLANS / "demo.plan").plan
    measured = json.loads((PLANS / "demo-machine.json").read_text())
    assert plan.topology.preset == "demo-machine.json"
    assert measured["format"] == "planc-topology"
    assert measured["measured"]["backend"] == "gloo"
    assert measured["measured"]["world"] == 8 == plan.mesh.world
    assert plan.topology.device.flops == measured["device"]["flops"]
    assert plan.topology.device.overhead == measured["device"]["overhead"] == \
        measured["measured"]["overhead"]["forward"] > 0
    assert plan.topology.device.backward_overhead == \
        measured["device"]["backward_overhead"] == measured["measured"]["overhead"]["backward"]
    assert plan.topology.device.handoff == measured["device"]["handoff"] == \
        measured["measured"]["handoff"] > 0
    assert plan.topology.device.bandwidth == measured["device"]["bandwidth"]
    assert plan.topology.intra.latency == measured["intra"]["latency"]
    # each operator's own instructions, as calibrate timed them
    assert plan.topology.device.overheads == tuple(
        (kernel, figures["forward"], figures["gradient"])
        for kernel, figures in sorted(measured["device"]["overheads"].items()))
    assert {"attention", "qkv", "gelu", "head", "loss"} <= dict(
        (row[0], row) for row in plan.topology.device.overheads).keys()


def test_the_demo_s_mfu_is_of_the_calibrated_peak_in_the_build_simulate_and_the_run(
        tmp_path):
    flops = json.loads((PLANS / "demo-machine.json").read_text())["device"]["flops"]
    plan = load_file(PLANS / "demo.plan").plan
    model_flops = step_model_flops(plan)
    result = simulate(compile_plan(plan))
    assert result.peak_flops == flops
    assert result.mfu == model_flops / result.step_seconds / 8 / flops
    # every compute instruction pays the measured overhead: without it the step is shorter
    free = dataclasses.replace(plan, topology=dataclasses.replace(
        plan.topology, device=dataclasses.replace(plan.topology.device, overhead=0.0)))
    assert simulate(compile_plan(free)).step_seconds < result.step_seconds
    done = subprocess.run([sys.executable, "-m", "planc", "run", PLANS / "demo.plan",
                           "-o", tmp_path / "b", "--steps", "2", "--metrics",
                           tmp_path / "m.jsonl"], capture_output=True, text=True, cwd=ROOT,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    manifest = json.loads((tmp_path / "b" / "build.json").read_text())
    assert manifest["mfu"] == {"model_flops_per_step": model_flops,
                               "peak_flops_per_device": flops}
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert len(records) == 2
    for record in records:
        per_device = model_flops / record["time_s"] / 8
        assert record["mfu"] == per_device / flops
    # the progress bar prints the same MFU, the calibrated peak's
    last = next(line for line in done.stderr.splitlines() if "step 2/2" in line)
    assert last.endswith(f"MFU {100 * records[-1]['mfu']:.2g}%")
