"""What checkpoints and failures cost a run, per step (``planc simulate --mtbf``,
``planc tune --mtbf``; docs/simulate.md, "Checkpoints and failures").

A checkpoint here is what ``planc run --checkpoint-dir`` writes: whole fp32 parameters and
the optimizer's fp32 state, consolidated per pipeline stage by the stage's writer (the
rank with tp = cp = dp = 0, planc.runtime.checkpoint.checkpoints), which writes its
stage's files while the other stages' writers write theirs. So a checkpoint takes

- the copy of the stage's state into the writer's host memory, at PCIe Gen5 x16's rate
  (:data:`HOST_COPY_BYTES_PER_S`), which stops the step in both modes, and
- the writing of it at the storage's rate per node (:data:`STORAGE_BYTES_PER_S`), shared
  by the writers of one node: the step waits for it when synchronous; with
  ``--checkpoint-async`` only when it outlasts the steps until the next checkpoint.

Failures follow the first-order model of Young (1974, "A first order approximation to
the optimum checkpoint interval"), as Daly (2006) refines it: a failure loses on average
half an interval of work plus the restart (start-up, and every node reading its share of
the checkpoint back), and failures come every ``mtbf`` seconds of wall time, so that a
fraction ``(interval / 2 + restart) / mtbf`` of the time is lost; the interval that
minimises the loss is ``sqrt(2 x checkpoint cost x mtbf)``.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from planc.estimate.memory import FP32_BYTES, optimizer_state_bytes
from planc.models import family_of
from planc.plan.layout import Layout
from planc.plan.plan import Plan

# Llama 3 (Dubey et al. 2024, section 3.3.1): Meta's Tectonic file system sustains 2 TB/s
# for the 16,384 H100 GPUs of the run, 2,048 nodes of 8: about 0.98 GB/s a node.
STORAGE_BYTES_PER_S = 2e12 / 2048
# PCIe Gen5 x16, one direction (PCI-SIG; NVIDIA's H100 datasheet: 128 GB/s both ways).
HOST_COPY_BYTES_PER_S = 64e9
# Measured here (bench/recovery.py, docs/checkpoints.md): planc run stopped 0.13 s after a
# rank was killed and the restarted run trained its first step 3.1 s after it started,
# loading the checkpoint included. A cluster's start-up is longer: give yours (--restart).
RESTART_S = 3.2


@dataclass(frozen=True)
class Resilience:
    """A plan's checkpoints and failures, priced per step of ``step_seconds``."""

    step_seconds: float
    state_bytes: float  # one checkpoint, every stage
    writer_bytes: float  # the largest stage's, which its writer copies and writes
    writers_per_node: int  # at most, on one node
    copy_seconds: float
    write_seconds: float
    blocked_seconds: float  # how long a checkpoint holds the steps up
    asynchronous: bool
    every: int  # steps from one checkpoint to the next
    optimal_every: int | None  # Young's interval, in steps (with an mtbf)
    mtbf_seconds: float | None
    restart_seconds: float  # start-up and reading the checkpoint back
    lost_fraction: float  # of the wall time, to failures
    effective_step_seconds: float  # wall time per step trained for good

    @property
    def checkpoint_overhead(self) -> float:
        """What checkpoints add to a step, as a fraction of it."""
        return self.blocked_seconds / self.every / self.step_seconds

    def to_json(self) -> dict:
        """JSON-ready: a run that never gets ahead (failures faster than it recovers) has
        no effective step (null)."""
        out = {key: getattr(self, key) for key in self.__dataclass_fields__} | {
            "checkpoint_overhead": self.checkpoint_overhead}
        if math.isinf(out["effective_step_seconds"]):
            out["effective_step_seconds"] = None
        return out


def stage_parameters_whole(plan: Plan) -> list[int]:
    """Every pipeline stage's parameter elements, whole (not cut over tp or ep): its
    layers', the embedding's on stage 0 and the final norm's and head's on the head's
    stage; a tied head is the embedding, counted once. They add up to the model's."""
    family, model = family_of(plan), plan.model
    counts = []
    for stage in range(plan.mesh.pp):
        count = sum(p.numel for layer in plan.layers_of_stage(stage)
                    for p in family.layer_parameters(model, layer))
        if stage == 0:
            count += sum(p.numel for p in family.embedding_parameters(model))
        if stage == plan.head_stage:
            count += sum(p.numel for p in family.head_parameters(model))
        counts.append(count)
    return counts


def stage_state_bytes(plan: Plan) -> list[float]:
    """Bytes of a checkpoint's part for each pipeline stage: its parameters in fp32 and
    the optimizer's fp32 state of each (AdamW two moments, SGD with momentum one)."""
    state = optimizer_state_bytes(plan) - (FP32_BYTES if plan.model.dtype != "fp32" else 0)
    return [float((FP32_BYTES + state) * n) for n in stage_parameters_whole(plan)]


def price(plan: Plan, step_seconds: float, mtbf_seconds: float | None = None,
          every: int | None = None, asynchronous: bool = False,
          storage_bytes_per_s: float = STORAGE_BYTES_PER_S,
          restart_seconds: float = RESTART_S) -> Resilience:
    """The cost of checkpointing ``plan`` every ``every`` steps (None: Young's interval) and
    of a failure every ``mtbf_seconds`` (None: none); one of the two must be given."""
    if every is None and mtbf_seconds is None:
        raise ValueError("a checkpoint interval or a failure rate is needed")
    stages = stage_state_bytes(plan)
    layout = Layout.of(plan)
    nodes = Counter(layout.rank({"pp": s}) // plan.topology.devices_per_node
                    for s in range(plan.mesh.pp))
    writers = max(nodes.values())
    writer_bytes = max(stages)
    copy = writer_bytes / HOST_COPY_BYTES_PER_S
    write = writer_bytes * writers / storage_bytes_per_s
    optimal = None
    if mtbf_seconds is not None:
        # Young: sqrt(2 C M), with C what a checkpoint holds the steps up for; an
        # asynchronous one holds them up for the copy alone if the writer keeps pace
        held = copy if asynchronous else copy + write
        optimal = max(1, round(math.sqrt(2 * held * mtbf_seconds) / step_seconds))
        if asynchronous:
            optimal = max(optimal, math.ceil(write / step_seconds))
    every = every or optimal
    blocked = copy + (max(0.0, write - every * step_seconds) if asynchronous else write)
    restart = restart_seconds + sum(stages) / (layout.nodes * storage_bytes_per_s)
    lost = 0.0
    if mtbf_seconds is not None:
        lost = ((every * step_seconds + blocked) / 2 + restart) / mtbf_seconds
    per_step = step_seconds + blocked / every
    effective = per_step / (1 - lost) if lost < 1 else math.inf
    return Resilience(step_seconds, sum(stages), writer_bytes, writers, copy, write, blocked,
                      asynchronous, every, optimal, mtbf_seconds, restart, lost, effective)
