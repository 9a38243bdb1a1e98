"""The run's evaluations (train.eval_every): the compiler's forward-only programs
(planc.lower.evaluation) on batches of the evaluation data, with the training's
parameters. The evaluation's loss of step k is the mean of its batches' losses."""

from __future__ import annotations

import dataclasses

import torch

from planc.data.identity import identity_now
from planc.runtime.engine.context import RankContext
from planc.runtime.engine.interpreter import Interpreter


class Evaluator:
    """``ctx``: the training's context (its groups, ranks and device are shared);
    ``executor_of(interpreter)``: an executor of the run's backend."""

    def __init__(self, ctx: RankContext, program, store, executor_of):
        evaluation = ctx.model.evaluation
        self.every, self.batches = evaluation.every, evaluation.batches
        # the evaluation's batches in the file's order, whatever train.shuffle says
        model = dataclasses.replace(ctx.model, data=evaluation.data, seed=evaluation.seed,
                                    shuffle=False)
        self.ctx = RankContext(model, ctx.ranks, ctx.rank, ctx.groups, ctx.device,
                               ctx.routes, identity_now(evaluation.data),
                               ctx.devices_per_node, record=ctx.record)
        self.executor = executor_of(Interpreter(self.ctx, program.for_evaluation(), store))

    def due(self, done: int) -> bool:
        """Whether an evaluation follows the step that brings the run to ``done`` steps."""
        return done % self.every == 0

    def run(self, after: int) -> float | None:
        """The mean loss of the evaluation batches after training step ``after`` (counted
        from 1), None on a rank that does not learn the loss; batch j is the evaluation
        data's batch j, every time."""
        self.ctx.evaluation = after  # what a problem reading a batch names
        losses = []
        with torch.no_grad():
            for batch in range(self.batches):
                loss = self.executor.run_step(batch).state.loss
                if loss is not None:
                    losses.append(loss)
        return sum(losses) / len(losses) if losses else None

    def close(self) -> None:
        self.executor.close()
