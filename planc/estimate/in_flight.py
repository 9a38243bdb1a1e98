"""What a pipeline stage holds at its peak, counted in microbatches and in layers: the
schedule's in-flight rule (planc.schedules; 1F1B's stage s holds pp - s, Narayanan et al.,
SC'21, section 2.2), or the stage's order replayed where its chunks differ in size or only
the last chunk counts. The memory estimate (planc.estimate.memory) scales the activations
of a layer by these counts."""

from __future__ import annotations

import functools

from planc import schedules
from planc.plan.plan import Plan


def microbatches_in_flight(plan: Plan, stage: int) -> int:
    """Microbatch-chunks whose activations a stage holds at its peak."""
    return _in_flight(plan.schedule.pipeline, stage, plan.mesh.pp, plan.schedule.microbatches,
                      plan.shard.pp.virtual)


@functools.lru_cache(maxsize=1 << 16)
def _in_flight(pipeline: str, stage: int, pp: int, microbatches: int, virtual: int) -> int:
    # A V schedule's count replays its order; planc tune asks for thousands of layouts.
    schedule = schedules.named(pipeline)
    return schedule.in_flight(stage, pp, schedule.peak_microbatches(pp, microbatches, virtual),
                              virtual)


def layers_in_flight(plan: Plan, stage: int) -> float:
    """Layer-microbatches whose activations a stage holds at its peak: the schedule's
    microbatch-chunks in flight times the layers of a chunk when the stage's chunks are
    alike; when they differ (uneven interleaving), the stage's schedule replayed, a
    forward making its chunk's layers live and the chunk's last backward block
    (B, or W of a split backward) freeing them, and the most layers live at once."""
    pp, virtual = plan.mesh.pp, plan.shard.pp.virtual
    sizes = [plan.shard.pp.chunk_layers(c) for c in plan.chunks_of_stage(stage)]
    if len(set(sizes)) == 1:
        return microbatches_in_flight(plan, stage) * sizes[0]
    sizes_of_chunks = tuple(plan.shard.pp.chunk_layers(c)
                            for c in range(len(plan.shard.pp.chunks)))
    return _live_peak(plan.schedule.pipeline, stage, pp, plan.schedule.microbatches, virtual,
                      sizes_of_chunks)


def head_microbatches_in_flight(plan: Plan) -> int:
    """Microbatches whose logits the head's stage holds at its peak: those the last
    chunk has run forward and not yet backward. Counting the stage's every chunk, as
    :func:`microbatches_in_flight` does, would hold a V schedule's stage 0 (whose second
    chunk is the last) at 2 pp + 1 microbatches of logits where the last chunk's forward
    is followed at once by its backward."""
    chunks = len(plan.shard.pp.chunks)
    sizes = tuple(int(c == chunks - 1) for c in range(chunks))
    # the loss's backward, the first of a split backward's two, is done with the logits
    return _live_peak(plan.schedule.pipeline, plan.head_stage, plan.mesh.pp,
                      plan.schedule.microbatches, plan.shard.pp.virtual, sizes,
                      (schedules.ActionKind.BACKWARD, schedules.ActionKind.BACKWARD_INPUT))


# A split backward keeps what its weight gradient reads (the layers' inputs and output
# gradients) until the W block, as the schedule's in-flight rule counts; a whole backward
# (B, which DualPipeV runs beside its split ones) frees them itself.
_LAYERS_DONE = (schedules.ActionKind.BACKWARD, schedules.ActionKind.BACKWARD_WEIGHT)


@functools.lru_cache(maxsize=1 << 16)
def _live_peak(pipeline: str, stage: int, pp: int, microbatches: int, virtual: int,
               sizes: tuple[int, ...], done: tuple = _LAYERS_DONE) -> int:
    live = peak = 0
    for action in schedules.peak_order(pipeline, stage, pp, microbatches, virtual):
        if action.kind.is_forward:
            live += sizes[action.chunk]
        elif action.kind in done:  # the backward is done with them
            live -= sizes[action.chunk]
        peak = max(peak, live)
    return peak
