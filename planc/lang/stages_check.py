"""The rules of ``shard { pp { stages = ... } }``: which layers each model chunk runs.

``auto`` asks :func:`planc.schedules.layers.balanced_chunks`; an explicit list gives one
inclusive range per chunk (``pp * virtual`` of them, chunk c on pipeline rank c mod pp),
covering every layer once, in order. The word ``embedding`` may stand for the first chunk
and ``head`` for the last: a chunk with no transformer layer, only the embedding, or the
final norm, head and loss (Llama 3's layout: Dubey et al. 2024, section 3.3.2). A chunk in
between has nothing to run without a layer, so it needs one.
"""

from __future__ import annotations

from dataclasses import dataclass

from planc.diagnostics import Span
from planc.lang.plan_kinds import StageRange
from planc.schedules import PipelineShape
from planc.schedules import problems as schedule_problems
from planc.schedules.layers import balanced_chunks, fewest_layers
from planc.schedules.schedule import LOOP, ChunkPlacement
from planc.vocabulary.hints import largest_divisors

Chunks = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class StageProblem:
    message: str
    span: Span | None  # None: at the stages key
    hint: str | None = None
    at_mesh: bool = False  # placed at mesh.pp rather than at the stages key


def _what(pp: int, virtual: int) -> str:
    return f"pp ({pp})" if virtual == 1 else f"pp x virtual ({pp} x {virtual} = {pp * virtual})"


def auto_chunks(layers: int, pp: int, virtual: int, placement: ChunkPlacement = LOOP
                ) -> Chunks | StageProblem:
    """The chunks of ``stages = auto``, or why there are none."""
    if layers >= fewest_layers(pp, virtual):
        return balanced_chunks(layers, pp, virtual, placement)
    most = layers + 2
    if virtual == 1:
        hint = f"use pp = {most} or fewer"
    else:
        fits = most // pp
        hint = (f"use virtual = {fits} or fewer" if fits > 1 else
                f"use virtual = 1, or pp = {most // 2} or fewer")
    return StageProblem(f"{_what(pp, virtual)} is more than layers + 2 ({layers} + 2): every "
                        f"chunk needs a layer, but the first may run the embedding alone and "
                        f"the last the head alone", None, hint, at_mesh=True)


def _layers_text(first: int, last: int) -> str:
    return f"layers {first}..{last} are" if last > first else f"layer {first} is"


def _text(r: StageRange) -> str:
    return r.alone or f"{r.first}..{r.last}"


def explicit_problems(ranges: tuple[StageRange, ...], layers: int, pp: int,
                      virtual: int, placement: ChunkPlacement = LOOP) -> list[StageProblem]:
    """What is wrong with an explicit list, [] if nothing."""
    found = []
    chunks = pp * virtual
    if len(ranges) != chunks:
        what = f"pp is {pp}" if virtual == 1 else f"pp x virtual is {chunks}"
        found.append(StageProblem(
            f"stages lists {len(ranges)} layer ranges but {what}", None,
            "give one range per stage" if virtual == 1 else
            "give one range per model chunk (chunk c runs on stage " +
            ("c, or 2pp - 1 - c once c >= pp: a V)" if placement.name == "v" else
             "c mod pp)")))
    for index, r in enumerate(ranges):
        if r.alone == "embedding" and index != 0:
            found.append(StageProblem(
                "only the first chunk can run the embedding alone", r.span,
                "a chunk after the first needs a layer range; write embedding first"))
        if r.alone == "head" and index != len(ranges) - 1:
            found.append(StageProblem(
                "only the last chunk can run the head alone", r.span,
                "a chunk before the last needs a layer range; write head last"))
    if found and any(r.alone for r in ranges):
        return found
    layered = [r for r in ranges if r.alone is None]
    for before, after in zip(layered, layered[1:]):
        if after.first < before.first:
            return found + [StageProblem(f"layer range {_text(after)} comes after "
                                         f"{_text(before)}", after.span,
                                         "list the ranges in layer order")]
    expected = 0
    previous: StageRange | None = None
    for r in layered:
        if r.last >= layers:
            found.append(StageProblem(f"layer range {_text(r)} goes past the last layer "
                                      f"({layers - 1})", r.span,
                                      f"the model has layers 0..{layers - 1}"))
        elif r.first < expected:
            found.append(StageProblem(f"layer range {_text(r)} overlaps {_text(previous)}",
                                      r.span, "each layer belongs to exactly one stage"))
        elif r.first > expected:
            found.append(StageProblem(f"{_layers_text(expected, r.first - 1)} in no stage",
                                      r.span,
                                      "the ranges must cover every layer once, in order"))
        expected = max(expected, r.last + 1)
        previous = r
    if not found and expected < layers:
        found.append(StageProblem(f"{_layers_text(expected, layers - 1)} in no stage", None,
                                  f"the ranges must cover layers 0..{layers - 1}"))
    return found


def explicit_chunks(ranges: tuple[StageRange, ...], layers: int) -> Chunks:
    """The chunks of a list :func:`explicit_problems` accepted: a chunk with no layer is
    the empty range just before or after the layers."""
    return tuple((0, -1) if r.alone == "embedding" else (layers, layers - 1)
                 if r.alone == "head" else (r.first, r.last) for r in ranges)


def microbatch_choices(per_rank: int, wanted: int, pipeline: str, pp: int, virtual: int,
                       layers: int, count: int = 2) -> list[int]:
    """For a hint: the ``count`` microbatch counts nearest ``wanted`` that divide a data-
    parallel rank's batch and that the pipeline schedule takes as they are (an
    interleaved schedule's must also divide by pp), 1 left out; [1] where none does, 1
    dividing every batch."""
    divisors = largest_divisors(per_rank, per_rank + 1, count=64)
    taken = [m for m in divisors if m not in (1, wanted) and not schedule_problems(
        pipeline, PipelineShape(pp, virtual, m, layers))]
    return sorted(taken, key=lambda m: (abs(m - wanted), -m))[:count] or [1]
