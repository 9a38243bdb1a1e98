"""planc calibrate times the runtime's own compute instructions, operator by operator
(planc.runtime.calibrate_instructions), and a plan on that topology is priced with them."""

import json
import math

import pytest

pytest.importorskip("torch")

from planc.compile import compile_plan  # noqa: E402
from planc.lang import load_file, load_text  # noqa: E402
from planc.program.program import Opcode  # noqa: E402


def _kernels_of_the_tiny_plans(world: int) -> set[str]:
    from planc.runtime.calibrate_instructions import FAMILIES, _plan_text

    kernels = set()
    for family in FAMILIES:
        loaded = load_text(_plan_text(family, world, world, 3))
        assert loaded.ok, [d.message for d in loaded.diagnostics]
        build = compile_plan(loaded.plan)
        for program in build.programs.values():
            kernels |= {item.operands.kernel for item in program.written()
                        if item.op is Opcode.COMPUTE and item.operands.kernel is not None}
    return kernels


def test_calibrate_writes_a_fixed_cost_for_every_operator_the_runtime_runs(tmp_path,
                                                                         run_planc):
    machine = tmp_path / "machine.json"
    result = run_planc("calibrate", "-o", machine, "--ranks", 2, "--quick", "--repeats", 1,
                       timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    overheads = json.loads(machine.read_text())["device"]["overheads"]
    # every operator of the three families' instructions, gradient steps apart
    assert set(overheads) == _kernels_of_the_tiny_plans(2)
    assert {"attention", "qkv", "swiglu", "moe", "loss", "optimizer"} <= set(overheads)
    for figures in overheads.values():
        assert set(figures) == {"forward", "gradient"}
        assert all(math.isfinite(v) and v >= 0 for v in figures.values())
    # a plan on that topology carries them, sorted by operator, to the simulator
    plan = tmp_path / "p.plan"
    plan.write_text('plan p {\n  model gpt { layers = 2; hidden = 32; heads = 2; vocab = 64; '
                    'seq = 16; batch = 4 }\n  mesh { dp = 2 }\n  topology { preset = '
                    '"machine.json" }\n  train { steps = 1 }\n}\n')
    device = load_file(plan).plan.topology.device
    assert device.overheads == tuple((kernel, figures["forward"], figures["gradient"])
                                     for kernel, figures in sorted(overheads.items()))
