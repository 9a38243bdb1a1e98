"""train.lr_schedule: planc.plan.lr_schedule's formula against torch.optim.lr_scheduler's
schedulers, stepped on a dummy optimizer as a training loop steps them."""

from __future__ import annotations

import json
import math
import re

import pytest

from planc.plan.lr_schedule import LrSchedule, lr_at, problems

torch = pytest.importorskip("torch")
from torch.optim import lr_scheduler  # noqa: E402

LR = 3e-3


def torch_lrs(schedule: LrSchedule, steps: int, lr: float = LR) -> list[float]:
    """The lr each of ``steps`` optimizer steps uses, with the torch schedulers that
    planc.plan.lr_schedule's docstring names, stepped once after each optimizer step."""
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)
    warmup, low = schedule.warmup, schedule.min_lr
    after = steps - warmup
    phases: list[tuple[int, object]] = []  # (first step, scheduler)
    if warmup:
        phases.append((0, lr_scheduler.LinearLR(optimizer, start_factor=1 / (warmup + 1),
                                                end_factor=1.0, total_iters=warmup)))
    if schedule.name == "cosine":
        phases.append((warmup, lr_scheduler.CosineAnnealingLR(optimizer, T_max=after,
                                                              eta_min=low)))
    elif schedule.name == "linear":
        phases.append((warmup, lr_scheduler.LinearLR(optimizer, start_factor=1.0,
                                                     end_factor=low / lr, total_iters=after)))
    elif schedule.name == "wsd":
        if steps - schedule.decay > warmup:  # a stable phase
            phases.append((warmup, lr_scheduler.ConstantLR(optimizer, factor=1.0,
                                                           total_iters=0)))
        phases.append((steps - schedule.decay, lr_scheduler.LinearLR(
            optimizer, start_factor=1.0, end_factor=low / lr, total_iters=schedule.decay)))
    else:
        phases.append((warmup, lr_scheduler.ConstantLR(optimizer, factor=1.0,
                                                       total_iters=0)))
    # SequentialLR resets the lr and starts each scheduler at its milestone
    main = phases[0][1] if len(phases) == 1 else lr_scheduler.SequentialLR(
        optimizer, [p for _, p in phases], milestones=[first for first, _ in phases[1:]])
    seen = []
    for _ in range(steps):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        main.step()
    return seen


CASES = [
    # (name, steps, warmup, decay, min_lr)
    ("cosine", 10, 0, 0, 0.0), ("cosine", 10, 3, 0, 0.0), ("cosine", 37, 5, 0, 3e-4),
    ("cosine", 100, 10, 0, 1e-4), ("cosine", 2, 1, 0, 0.0),
    ("linear", 10, 0, 0, 0.0), ("linear", 20, 4, 0, 1e-4), ("linear", 64, 16, 0, 3e-3),
    ("constant", 10, 0, 0, 0.0), ("constant", 12, 5, 0, 0.0), ("constant", 3, 2, 0, 0.0),
    ("wsd", 10, 2, 3, 0.0), ("wsd", 30, 5, 10, 1e-4), ("wsd", 16, 0, 16, 0.0),
    ("wsd", 16, 4, 12, 5e-4), ("wsd", 9, 0, 1, 0.0),
]


@pytest.mark.parametrize("name,steps,warmup,decay,min_lr", CASES)
def test_lr_equals_torch_schedulers(name, steps, warmup, decay, min_lr):
    schedule = LrSchedule(name, warmup, min_lr, decay)
    expected = torch_lrs(schedule, steps)
    mine = [lr_at(schedule, LR, steps, k) for k in range(steps)]
    assert len(expected) == steps
    for k, (a, b) in enumerate(zip(mine, expected)):
        assert math.isclose(a, b, rel_tol=1e-12, abs_tol=0.0), (k, a, b)


def test_landmarks():
    cosine = LrSchedule("cosine", warmup=4, min_lr=1e-4)
    assert [lr_at(cosine, 1.0, 10, k) for k in range(4)] == [0.2, 0.4, 0.6, 0.8]
    assert lr_at(cosine, 1.0, 10, 4) == 1.0
    assert lr_at(cosine, 1.0, 10, 10) == 1e-4  # past train.steps (--steps beyond it)
    assert lr_at(cosine, 1.0, 10, 7) == pytest.approx(1e-4 + (1 - 1e-4) * 0.5)
    wsd = LrSchedule("wsd", warmup=0, min_lr=0.0, decay=4)
    assert [lr_at(wsd, 1.0, 8, k) for k in range(9)] == [1, 1, 1, 1, 1, 0.75, 0.5, 0.25, 0]
    assert [lr_at(LrSchedule(), 0.5, 3, k) for k in range(5)] == [0.5] * 5


def test_problems():
    assert problems(LrSchedule("cosine", warmup=10), 1e-3, 10) == [
        ("warmup", "warmup = 10 is not below train.steps = 10: every step would be a "
                   "warm-up step", "use warmup = 9 or less, or raise train.steps")]
    assert problems(LrSchedule("wsd", warmup=4, decay=7), 1e-3, 10) == [
        ("decay", "decay = 7 is more than the 6 steps after the warm-up (train.steps - "
                  "warmup = 10 - 4)", "use decay = 6 or less")]
    assert problems(LrSchedule("linear", min_lr=0.01), 1e-3, 10) == [
        ("min_lr", "min_lr = 0.01 is above the optimizer's lr = 0.001: the schedule decays "
                   "from lr down to min_lr", "use a min_lr of at most 0.001, for example "
                   "0.0001")]
    assert problems(LrSchedule("wsd", warmup=4, decay=6, min_lr=1e-3), 1e-3, 10) == []


def test_describe_names_the_landmarks():
    from planc.plan.lr_schedule import describe

    assert describe(LrSchedule(), 0.1, 10) == "constant lr 0.1"
    assert describe(LrSchedule("cosine", warmup=1, min_lr=0.05), 0.5, 4) == (
        "lr_schedule cosine: warm-up step 0 at 0.25, cosine decay from 0.5 at step 1 to "
        "0.1625 at step 3 (min_lr 0.05 at step 4)")
    assert describe(LrSchedule("wsd", warmup=2, decay=4), 1.0, 10) == (
        "lr_schedule wsd: warm-up over steps 0..1 from 0.3333 to 0.6667, 1 until step 5, "
        "then linear decay to 0.25 at step 9 (min_lr 0 at step 10)")
    assert describe(LrSchedule("constant", warmup=3), 1.0, 10) == (
        "lr_schedule constant: warm-up over steps 0..2 from 0.25 to 0.75, then 1")


PLAN = """plan s {
  model gpt { layers = 1; hidden = 8; heads = 2; vocab = 16; seq = 4; batch = 2 }
  train { steps = 10; optimizer = adamw(lr = 1e-3); lr_schedule = %s }
}
"""


def test_plan_json_and_the_model_table_carry_the_schedule_and_refuse_a_bad_one():
    from planc.lang import load_text
    from planc.program.model_table import ModelTable
    from planc.lower.tabulate_model import model_table
    from planc.plan.plan_json import plan_from_dict

    plan = load_text(PLAN % "wsd(warmup = 2, decay = 3, min_lr = 1e-4)").plan
    assert plan.train.lr_schedule == LrSchedule("wsd", 2, 1e-4, 3)
    data = plan.to_dict()
    assert data["train"]["lr_schedule"] == {"name": "wsd", "warmup": 2, "min_lr": 1e-4,
                                            "decay": 3}
    assert plan_from_dict(data) == plan
    table = model_table(plan)
    assert ModelTable.from_json(table.to_json()) == table
    assert [table.lr_at(k) for k in (0, 6, 7, 9)] == \
        [lr_at(plan.train.lr_schedule, 1e-3, 10, k) for k in (0, 6, 7, 9)]
    assert table.lr_at(7) == 1e-3  # the first step of the decay, still at lr
    assert table.lr_at(8) == pytest.approx(1e-3 + (1e-4 - 1e-3) / 3, rel=1e-15)
    # without a schedule neither file names one: builds of older plans are unchanged
    plain = load_text(PLAN % "constant").plan
    assert "lr_schedule" not in plain.to_dict()["train"]
    assert "lr_schedule" not in model_table(plain).to_json()
    for key, value, message in (
            ("warmup", 10, "plan.train.lr_schedule: warmup = 10 is not below train.steps = 10"),
            ("name", "step", "plan.train.lr_schedule.name is 'step'"),
            ("decay", 0, "plan.train.lr_schedule: decay is wsd's alone, and wsd needs it")):
        bad = json.loads(json.dumps(data))
        bad["train"]["lr_schedule"][key] = value
        with pytest.raises(ValueError, match=re.escape(message)):
            plan_from_dict(bad)
        bad = table.to_json()
        bad["lr_schedule"][key] = value
        with pytest.raises(ValueError):
            ModelTable.from_json(bad)
