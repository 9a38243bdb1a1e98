"""The layout a run continues on after it lost devices: ``planc tune``'s search over the
devices left, kept to layouts the newest checkpoint resumes under (planc.commands.replan).

Devices are counted by node, as a cluster gives them back: a layout takes whole nodes
(every device of each), or part of one node, never a node with a device missing plus
another node, since a plan's topology has the same devices on every node
(``topology.devices_per_node``). Among the layouts of every such count, the simulator's
fastest that passes planc's checker, fits in memory and resumes from the checkpoint is
chosen. The model block, the batch included, is the file's, so the global batch and the
function the loss follows are the same before and after (Megatron-LM and torchtitan
restart on the same layout instead; this is what a consolidated checkpoint allows).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from planc.plan.plan import Plan

# Seconds the searches of one replan may take together: each device count gets its share
# (planc.tune's budget, which only ever stops a search once it has ranked its top layouts).
SEARCH_BUDGET_S = 10.0
TOP = 3


@dataclass(frozen=True)
class Choice:
    """The layout to continue on: the devices its ranks 0, 1, ... take, its plan text and
    checked plan, its compiled build, tune's line for it and its simulated step time."""

    devices: tuple[int, ...]
    text: str
    plan: Plan
    build: object
    layout: str
    step_seconds: float


def node_devices(devices: tuple[int, ...], per_node: int) -> dict[int, list[int]]:
    """The devices left on each node (device d lives on node d // per_node)."""
    nodes: dict[int, list[int]] = {}
    for device in sorted(devices):
        nodes.setdefault(device // per_node, []).append(device)
    return nodes


def device_sets(devices: tuple[int, ...], per_node: int, limit: int) -> list[tuple[int, ...]]:
    """The device sets a layout may take, largest first: 1, 2, ... whole nodes (those with
    every device left), and 1 .. per_node - 1 devices of the node with the most left; at
    most ``limit`` devices."""
    nodes = node_devices(devices, per_node)
    whole = [nodes[n] for n in sorted(nodes) if len(nodes[n]) == per_node]
    sets = [tuple(d for node in whole[:k] for d in node) for k in range(1, len(whole) + 1)]
    fullest = max(nodes.values(), key=len, default=[])
    sets += [tuple(fullest[:n]) for n in range(1, min(per_node - 1, len(fullest)) + 1)]
    return sorted((s for s in sets if len(s) <= limit), key=len, reverse=True)


def best_layout(plan: Plan, source: str, check: Callable[[str], Plan | None],
                devices: tuple[int, ...], per_node: int, limit: int,
                resume_problem: Callable[[object], str | None],
                budget: float = SEARCH_BUDGET_S) -> Choice | str:
    """The fastest layout of ``plan`` (the text ``source``) on some of ``devices`` that
    ``check`` accepts, that fits in memory and that ``resume_problem(build)`` has nothing
    against, or why there is none."""
    from planc.commands.tune import topology_settings
    from planc.compile import compile_plan
    from planc.tune import tune

    sets = device_sets(devices, per_node, limit)
    if not sets:
        return f"no device is left (at most {limit} can be used here)"
    start, ranked = time.perf_counter(), []
    for index, chosen in enumerate(sets):
        topology = topology_settings(source, per_node, len(chosen))
        if isinstance(topology, str):
            continue
        share = max(budget - (time.perf_counter() - start), 1.0) / (len(sets) - index)
        search = tune(plan, source, len(chosen), TOP, None, (), check, None, topology,
                      min(per_node, len(chosen)), share)
        ranked += [(r, chosen) for r in search.ranked]
    ranked.sort(key=lambda pair: (pair[0].step_seconds, -len(pair[1]), pair[0].candidate.text()))
    problems = []
    for candidate, chosen in ranked:
        build = candidate.build if candidate.build is not None else compile_plan(candidate.plan)
        problem = resume_problem(build)
        if problem is None:
            return Choice(chosen, candidate.text, candidate.plan, build,
                          candidate.candidate.text(), candidate.step_seconds)
        problems.append(problem)
    if problems:
        return (f"none of the {len(problems)} layouts that fit on the {len(devices)} devices "
                f"left can resume from the checkpoint ({problems[0]})")
    memory = plan.topology.device.memory
    return (f"no layout of this model on {len(devices)} device{'s' * (len(devices) != 1)} or "
            f"fewer passes planc check and fits in the memory of a device"
            + (f" ({memory / 1e9:g} GB)" if memory else ""))
