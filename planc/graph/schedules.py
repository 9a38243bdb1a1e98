"""Pipeline schedules: the order of forward and backward microbatches on every stage.

An action is ``(kind, microbatch, chunk)`` with kind "F" or "B", chunk being the model
chunk (equal to the stage unless the schedule is interleaved). Written as text, "F3"
is the forward of microbatch 3 and "B3.c1" the backward of microbatch 3 on chunk 1,
in the spirit of torch.distributed.pipelining's action IR ("1F3").

- gpipe (Huang et al. 2019): every forward, then every backward.
- 1f1b (PipeDream-Flush, Narayanan et al. 2021): stage s runs pp - s - 1 warm-up
  forwards, then alternates one forward and one backward, then drains the backwards.
- interleaved (Narayanan et al., SC'21, section 2.2; Megatron-LM's
  ``forward_backward_pipelining_with_interleaving``): each stage holds ``virtual``
  chunks; microbatches go through the chunks in groups of pp; warm-up is
  (pp - s - 1) * 2 + (virtual - 1) * pp forwards.
"""

from __future__ import annotations

from dataclasses import dataclass

Action = tuple[str, int, int]  # (kind, microbatch, chunk)


def action_text(action: Action, virtual: int = 1) -> str:
    kind, microbatch, chunk = action
    return f"{kind}{microbatch}" + (f".c{chunk}" if virtual > 1 else "")


def gpipe(stage: int, pp: int, microbatches: int) -> list[Action]:
    return ([("F", i, stage) for i in range(microbatches)]
            + [("B", i, stage) for i in range(microbatches)])


def one_f_one_b(stage: int, pp: int, microbatches: int) -> list[Action]:
    warmup = min(pp - stage - 1, microbatches)
    actions = [("F", i, stage) for i in range(warmup)]
    for i in range(microbatches - warmup):
        actions.append(("F", warmup + i, stage))
        actions.append(("B", i, stage))
    actions += [("B", i, stage) for i in range(microbatches - warmup, microbatches)]
    return actions


def interleaved(stage: int, pp: int, microbatches: int, virtual: int) -> list[Action]:
    """Megatron's interleaved 1F1B; needs microbatches divisible by pp."""
    total = microbatches * virtual
    group = pp * virtual

    def locate(k: int, forward: bool) -> tuple[int, int]:
        in_group = k % group
        chunk_index = in_group // pp
        if not forward:
            chunk_index = virtual - chunk_index - 1
        microbatch = (k // group) * pp + in_group % pp
        return microbatch, chunk_index * pp + stage

    warmup = min((pp - stage - 1) * 2 + (virtual - 1) * pp, total)
    actions: list[Action] = [("F", *locate(k, True)) for k in range(warmup)]
    for i in range(total - warmup):
        actions.append(("F", *locate(warmup + i, True)))
        actions.append(("B", *locate(i, False)))
    actions += [("B", *locate(k, False)) for k in range(total - warmup, total)]
    return actions


def schedule(pipeline: str, stage: int, pp: int, microbatches: int,
             virtual: int = 1) -> list[Action]:
    if pipeline == "gpipe":
        return gpipe(stage, pp, microbatches)
    if pipeline == "interleaved":
        return interleaved(stage, pp, microbatches, virtual)
    return one_f_one_b(stage, pp, microbatches)


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


def simulate(schedules: dict[int, list[Action]], pp: int, virtual: int,
             forward_time: float = 1.0, backward_time: float = 2.0) -> Timeline:
    """Run the schedules with uniform stage times and free communication.

    A forward of chunk c needs the same microbatch's forward of chunk c - 1; a backward
    of chunk c needs its own forward and the backward of chunk c + 1. Each stage runs
    its actions in order. Raises ValueError if the schedules deadlock.
    """
    last_chunk = pp * virtual - 1
    done: dict[Action, float] = {}
    position = {stage: 0 for stage in schedules}
    clock = {stage: 0.0 for stage in schedules}
    starts = {stage: [] for stage in schedules}
    ends = {stage: [] for stage in schedules}
    remaining = sum(len(a) for a in schedules.values())
    while remaining:
        progressed = False
        for stage, actions in schedules.items():
            while position[stage] < len(actions):
                kind, microbatch, chunk = actions[position[stage]]
                if kind == "F":
                    needs = [("F", microbatch, chunk - 1)] if chunk > 0 else []
                    duration = forward_time
                else:
                    needs = [("F", microbatch, chunk)]
                    needs += [("B", microbatch, chunk + 1)] if chunk < last_chunk else []
                if any(n not in done for n in needs):
                    break
                start = max([clock[stage]] + [done[n] for n in needs])
                end = start + duration
                done[(kind, microbatch, chunk)] = end
                starts[stage].append(start)
                ends[stage].append(end)
                clock[stage] = end
                position[stage] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise ValueError("the pipeline schedules deadlock")
    return Timeline(starts, ends, max(clock.values()))
