"""A schedule's timeline with uniform block times and free communication: the
textbook bubble, to check a schedule against its paper (the compiled programs have
their own simulator, :mod:`planc.simulate`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from planc.schedules.actions import Action, ActionKind

FORWARD, BACKWARD = ActionKind.FORWARD, ActionKind.BACKWARD
INPUT, WEIGHT = ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT


@dataclass(frozen=True)
class Timeline:
    """When each stage runs each action, from :func:`simulate`."""

    starts: dict[int, list[float]]  # stage -> start time of each of its actions
    ends: dict[int, list[float]]
    makespan: float

    def bubble(self, stage: int) -> float:
        """Idle fraction of ``stage`` between the first start and the last end overall."""
        busy = sum(e - s for s, e in zip(self.starts[stage], self.ends[stage]))
        return 1.0 - busy / self.makespan


def _needs(action: Action, last_chunk: int) -> list[tuple[str, int, int]]:
    """What must have finished first, as (what, microbatch, chunk): a forward of chunk c
    needs the same microbatch's forward of chunk c - 1 (``F``); a backward, or its input
    part, needs its own forward and the input gradient (``G``, from a B or an I) of chunk
    c + 1; a weight part needs its own input part."""
    kind, microbatch, chunk = action
    if kind is FORWARD:
        return [("F", microbatch, chunk - 1)] if chunk > 0 else []
    if kind is WEIGHT:
        return [("G", microbatch, chunk)]
    return [("F", microbatch, chunk)] + \
        ([("G", microbatch, chunk + 1)] if chunk < last_chunk else [])


def simulate(schedules: dict[int, Sequence[Action | tuple[str, int, int]]], pp: int,
             virtual: int, forward_time: float = 1.0, backward_time: float = 2.0) -> Timeline:
    """Run the schedules (actions, or (letter, microbatch, chunk) triples) in order on
    each stage; a split backward's input and weight parts take half the backward time
    each. Raises ValueError if the schedules deadlock."""
    last_chunk = pp * virtual - 1
    typed = {stage: [Action(ActionKind(k), mb, c) for k, mb, c in actions]
             for stage, actions in schedules.items()}
    done: dict[tuple[str, int, int], float] = {}
    position = {stage: 0 for stage in typed}
    clock = {stage: 0.0 for stage in typed}
    starts: dict[int, list[float]] = {stage: [] for stage in typed}
    ends: dict[int, list[float]] = {stage: [] for stage in typed}
    remaining = sum(len(a) for a in typed.values())
    while remaining:
        progressed = False
        for stage, actions in typed.items():
            while position[stage] < len(actions):
                action = actions[position[stage]]
                needs = _needs(action, last_chunk)
                if any(n not in done for n in needs):
                    break
                start = max([clock[stage]] + [done[n] for n in needs])
                end = start + _duration(action.kind, forward_time, backward_time)
                done[(_DONE[action.kind], action.microbatch, action.chunk)] = end
                starts[stage].append(start)
                ends[stage].append(end)
                clock[stage] = end
                position[stage] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise ValueError("the pipeline schedules deadlock")
    return Timeline(starts, ends, max(clock.values()))


# What finishing an action makes available: a forward's output, an input gradient (from
# a whole backward or its input part), or the weight gradient.
_DONE = {FORWARD: "F", BACKWARD: "G", INPUT: "G", WEIGHT: "W"}


def _duration(kind: ActionKind, forward_time: float, backward_time: float) -> float:
    if kind is FORWARD:
        return forward_time
    return backward_time if kind is BACKWARD else backward_time / 2
