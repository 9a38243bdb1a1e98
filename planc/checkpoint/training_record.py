"""What a checkpoint records of the plan that trained it, read from plan.json as data.

A rank never holds the plan (planc.plan.plan.Plan): it runs the build's programs and tables.
It still has to say in a checkpoint's manifest which model, optimizer, seed, data and
layout trained the steps it saved, and to refuse a checkpoint of another model or
optimizer when it resumes (planc.checkpoint.format). Those are plan.json's own sections, as
JSON: the same form ``planc run`` compares on its side before any rank starts.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

# A malformed plan.json section (a build is untrusted input): the caller says so.
MALFORMED = (KeyError, TypeError, ValueError, AttributeError)


@dataclass(frozen=True)
class TrainingRecord:
    name: str
    model: dict  # plan.json's model section
    optimizer: dict  # plan.json's train.optimizer
    seed: int
    data: str | None  # the token file, or None: the synthetic batches of the seed
    steps: int  # train.steps
    layout: dict  # tp, cp, pp, dp, zero, microbatches
    # train.lr_schedule as plan.json writes it, None without one; train.shuffle;
    # train.grad_clip (None: off), which changes every step's update as the lr does
    lr_schedule: dict | None = None
    shuffle: bool = False
    grad_clip: float | None = None

    @staticmethod
    def of(plan_data: dict) -> "TrainingRecord":
        """The record of a plan in its plan.json form (planc.plan.plan.Plan.to_dict)."""
        train, mesh = plan_data["train"], plan_data["mesh"]
        layout = {axis: mesh[axis] for axis in ("tp", "cp", "pp", "dp")}
        layout.update(zero=plan_data["shard"]["dp"]["zero"],
                      microbatches=plan_data["schedule"]["microbatches"])
        record = TrainingRecord(plan_data["name"], _as_read(plan_data["model"]),
                                _as_read(train["optimizer"]), train["seed"], train["data"],
                                train["steps"], layout)
        record = _with_order(record, train)
        if not isinstance(record.name, str) or type(record.seed) is not int or \
                type(record.steps) is not int or \
                not (record.data is None or isinstance(record.data, str)):
            raise ValueError("its name, seed, steps or data is not of its kind")
        return record


def _as_read(section: dict) -> dict:
    """A section as plan.json reads back (tuples become lists), whether it came from the
    file or from planc.plan.plan.Plan.to_dict: the two sides compare equal."""
    if not isinstance(section, dict):
        raise TypeError("a section of plan.json is not an object")
    return json.loads(json.dumps(section))


def _with_order(record: TrainingRecord, train: dict) -> TrainingRecord:
    """The record with the plan's lr schedule, sample order and gradient clipping (what a
    checkpoint's history says of each segment, for --check of a resumed run)."""
    schedule = train.get("lr_schedule")
    shuffle = train.get("shuffle", False)
    clip = train.get("grad_clip")
    if not (schedule is None or isinstance(schedule, dict)) or type(shuffle) is not bool or \
            not (clip is None or type(clip) in (int, float) and clip > 0):
        raise ValueError("its lr_schedule, shuffle or grad_clip is not of its kind")
    return dataclasses.replace(record, lr_schedule=None if schedule is None
                               else _as_read(schedule), shuffle=shuffle,
                               grad_clip=None if clip is None else float(clip))
