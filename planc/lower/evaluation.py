"""The evaluation of ``train { eval_every = N }``: every N steps, the mean loss of
``eval_batches`` global batches, run forward only.

An evaluation batch runs the training program's own forward blocks (the same
instructions, tp and cp collectives and pipeline sends as a training step's forwards),
so that its loss is the one the plan's forward computes, and every plan of a model
gives the same evaluation loss. What differs is the order: no backward, so each stage
runs its chunks one after another, every microbatch of a chunk before the next chunk
(GPipe's forward order, Huang et al. 2019): a chunk's input comes from the chunk before
it, which every stage has finished or is finishing, so the order cannot deadlock, and
the microbatches of a chunk flow down the pipeline one after another. The loss's
reduction over the head stage runs where the training step runs it, with the last
microbatch of the last chunk. Megatron-LM's evaluation runs its forward-only schedule
the same way (``forward_backward_func`` with ``forward_only=True``).
"""

from __future__ import annotations

from planc.program.model_table import Evaluation
from planc.plan.plan import Plan
from planc.schedules import Action, ActionKind

# The synthetic evaluation batches are drawn from the seed after the training's, so
# that they are none of the training's batches.
EVALUATION_SEED_OFFSET = 1


def evaluation_of(plan: Plan) -> Evaluation | None:
    """The model table's evaluation settings (None: the plan evaluates nothing)."""
    train = plan.train
    if train.eval_every <= 0:
        return None
    return Evaluation(train.eval_every, train.eval_batches, train.eval_data,
                      train.seed + EVALUATION_SEED_OFFSET)


def forward_only(plan: Plan, stage: int) -> list[Action]:
    """Stage ``stage``'s forward-only order: its chunks in order, each for every
    microbatch."""
    return [Action(ActionKind.FORWARD, microbatch, chunk)
            for chunk in plan.chunks_of_stage(stage)
            for microbatch in range(plan.schedule.microbatches)]
