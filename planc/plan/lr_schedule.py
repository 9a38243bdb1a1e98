"""Learning-rate schedules: ``train { lr_schedule = cosine(warmup = W, min_lr = M) }``.

The lr of step k (0-based: the lr that step k's optimizer update uses) for a plan with
optimizer lr ``lr`` = η and ``train.steps`` = T (docs/language.md, train):

    warm-up, k < W:     η (k + 1) / (W + 1)
    then, e = k - W, N = T - W:
      constant          η
      cosine            M + (η - M) (1 + cos(π e / N)) / 2
      linear            η + (M - η) e / N
      wsd               η while k < T - D, then η + (M - η) (k - (T - D)) / D
    past the end (k >= T, a run with --steps beyond train.steps): M (η for constant)

These are torch.optim.lr_scheduler's values for the same steps: the warm-up is
``LinearLR(start_factor = 1 / (W + 1), end_factor = 1, total_iters = W)`` (torchtitan's
linear warm-up, (k + 1) / (W + 1), so step 0 trains and step W is the first at η),
chained by ``SequentialLR(milestones = [W])`` with ``CosineAnnealingLR(T_max = N,
eta_min = M)``, ``LinearLR(1, M / η, total_iters = N)`` or a constant factor; wsd
(warm-up, stable, decay: Hu et al. 2024, MiniCPM) chains ``LinearLR(1, M / η,
total_iters = D)`` from milestone T - D. Like CosineAnnealingLR with T_max = N, every
decay reaches M at step T, the step after the last: the last step trains a little above
M. tests/test_lr_schedule.py checks these against torch's schedulers to 1e-12.

Torch-free: ``planc check`` and ``planc explain`` show the schedule, the runtime and the
single-process reference of ``planc run --check`` set each step's lr from it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# name -> its arguments and their defaults; None marks a required argument.
SCHEDULE_ARGUMENTS: dict[str, dict[str, float | int | None]] = {
    "constant": {"warmup": 0},
    "cosine": {"warmup": 0, "min_lr": 0.0},
    "linear": {"warmup": 0, "min_lr": 0.0},
    "wsd": {"warmup": 0, "decay": None, "min_lr": 0.0},
}


@dataclass(frozen=True)
class LrSchedule:
    """``name`` one of SCHEDULE_ARGUMENTS; ``decay`` is wsd's (0 for the others)."""

    name: str = "constant"
    warmup: int = 0
    min_lr: float = 0.0
    decay: int = 0

    @property
    def is_constant(self) -> bool:
        """No schedule at all: every step at the optimizer's lr."""
        return self.name == "constant" and self.warmup == 0


def lr_at(schedule: LrSchedule, lr: float, steps: int, step: int) -> float:
    """The lr of step ``step`` (0-based) of a run of ``steps`` (train.steps) steps whose
    optimizer's lr is ``lr``: the formulas of the module's docstring."""
    warmup = schedule.warmup
    if step < warmup:
        return lr * (step + 1) / (warmup + 1)
    if schedule.name == "constant":
        return lr
    low = schedule.min_lr
    if step >= steps:
        return low
    if schedule.name == "wsd":
        start = steps - schedule.decay
        return lr if step < start else lr + (low - lr) * (step - start) / schedule.decay
    done, span = step - warmup, steps - warmup
    if schedule.name == "cosine":
        return low + (lr - low) * (1 + math.cos(math.pi * done / span)) / 2
    return lr + (low - lr) * done / span  # linear


def problems(schedule: LrSchedule, lr: float, steps: int) -> list[tuple[str, str, str]]:
    """What makes the schedule meaningless for a run of ``steps`` at ``lr``: (the argument
    to point at, the message, a hint), empty if nothing."""
    found = []
    if schedule.warmup >= steps:
        found.append(("warmup", f"warmup = {schedule.warmup} is not below train.steps = "
                      f"{steps}: every step would be a warm-up step",
                      f"use warmup = {max(steps - 1, 0)} or less, or raise train.steps"))
    elif schedule.name == "wsd" and schedule.decay > steps - schedule.warmup:
        room = steps - schedule.warmup
        found.append(("decay", f"decay = {schedule.decay} is more than the {room} steps "
                      f"after the warm-up (train.steps - warmup = {steps} - "
                      f"{schedule.warmup})", f"use decay = {room} or less"))
    if schedule.name != "constant" and schedule.min_lr > lr:
        found.append(("min_lr", f"min_lr = {schedule.min_lr:g} is above the optimizer's "
                      f"lr = {lr:g}: the schedule decays from lr down to min_lr",
                      f"use a min_lr of at most {lr:g}, for example {lr / 10:g}"))
    return found


def describe(schedule: LrSchedule, lr: float, steps: int) -> str:
    """One line for ``planc explain``: the schedule and the lr of its landmarks."""
    if schedule.is_constant:
        return f"constant lr {lr:g}"
    parts = []
    if schedule.warmup == 1:
        parts.append(f"warm-up step 0 at {lr_at(schedule, lr, steps, 0):.4g}")
    elif schedule.warmup:
        parts.append(f"warm-up over steps 0..{schedule.warmup - 1} from "
                     f"{lr_at(schedule, lr, steps, 0):.4g} to "
                     f"{lr_at(schedule, lr, steps, schedule.warmup - 1):.4g}")
    if schedule.name == "constant":
        parts.append(f"then {lr:g}")
    elif schedule.name == "wsd":
        start = steps - schedule.decay
        parts.append(f"{lr:g} until step {start - 1}, then linear decay to "
                     f"{lr_at(schedule, lr, steps, steps - 1):.4g} at step {steps - 1} "
                     f"(min_lr {schedule.min_lr:g} at step {steps})")
    else:
        parts.append(f"{schedule.name} decay from {lr:g} at step {schedule.warmup} to "
                     f"{lr_at(schedule, lr, steps, steps - 1):.4g} at step {steps - 1} "
                     f"(min_lr {schedule.min_lr:g} at step {steps})")
    return f"lr_schedule {schedule.name}: " + ", ".join(parts)
