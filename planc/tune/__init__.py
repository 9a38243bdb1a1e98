"""``planc tune``: the best layout for a model on N devices, by the simulator.

The search (docs/tune.md):

1. every candidate of :mod:`planc.tune.space` (the mesh, its order, the schedule, ZeRO,
   sequence parallelism, recomputation), less those breaking the mesh's arithmetic;
2. each one's plan, memory estimate (planc.estimate.memory) and lower bound on its step time
   (:mod:`planc.tune.bounds`): a candidate that does not fit as planc run would hold it
   (the estimate, and under sequence parallelism with ``gathered_inputs = keep`` the
   gathered inputs the runtime keeps) is pruned;
3. the file's own layout first, when it is for ``gpus`` devices (so the best is never
   predicted slower than what the file says), then in the order of a rough estimate: a candidate whose bound is no better
   than the K-th best step time simulated so far is pruned (it cannot enter the top K);
   the others go through planc's checker (the plan text with the candidate's settings,
   exactly as ``--set`` would give them) and, if it accepts them, are compiled and
   simulated (planc.simulate), the programs verified as for any build.

Identical plans are simulated once. The result ranks the simulated candidates by step
time; what was pruned is counted by reason.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

from planc.estimate import memory
from planc.plan.plan import Plan
from planc.tune import bounds
from planc.tune.space import DEFAULTS, ORDERS, Candidate, candidates, dominates, of_plan

TUNE_FORMAT_VERSION = 1


@dataclass(frozen=True)
class Ranked:
    """A simulated candidate."""

    candidate: Candidate
    plan: Plan
    text: str  # the plan file that checks, compiles and simulates to ``step_seconds``
    step_seconds: float
    tflops_per_gpu: float
    mfu: float
    bubble: float
    exposed_seconds: float  # the worst stage's compute waiting on its own transfers
    memory_bytes: float  # the peak stage's estimate
    # with failures and checkpoints priced (planc tune --mtbf), else the step
    effective_seconds: float = 0.0
    simulation: object = field(repr=False, compare=False, default=None)
    build: object = field(repr=False, compare=False, default=None)  # kept for the top two

    def to_json(self) -> dict:
        return {**self.candidate.to_json(), "step_seconds": self.step_seconds,
                "tflops_per_gpu": self.tflops_per_gpu, "mfu": self.mfu,
                "bubble": self.bubble, "exposed_seconds": self.exposed_seconds,
                "memory_bytes": self.memory_bytes,
                # null: failures come faster than the layout recovers (planc tune --mtbf)
                "effective_step_seconds": self.effective_seconds
                if self.effective_seconds < float("inf") else None, "plan": self.text}


@dataclass
class Search:
    """What the search did: every candidate is counted once, as pruned (by reason) or
    simulated."""

    considered: int = 0
    pruned: Counter = field(default_factory=Counter)
    simulated: int = 0
    seconds: float = 0.0
    ranked: list[Ranked] = field(default_factory=list)
    capacity: float | None = None
    own: "Candidate | None" = None  # the file's own layout, when it was ranked

    @property
    def best(self) -> Ranked | None:
        return self.ranked[0] if self.ranked else None

    def to_json(self, top: int) -> dict:
        return {"format": "planc-tune", "version": TUNE_FORMAT_VERSION,
                "searched": self.considered, "pruned": dict(sorted(self.pruned.items())),
                "simulated": self.simulated, "seconds": self.seconds,
                "best": self.best.to_json() if self.best else None,
                "candidates": [r.to_json() for r in self.ranked[:top]]}


def _same_layout(a: Candidate, b: Candidate) -> bool:
    return dataclasses.replace(a, zero=b.zero, recompute=b.recompute) == b


# The share of --budget the memory estimates and bounds of the candidates may take (on
# hundreds of thousands of devices there are millions); the simulations get the rest.
ESTIMATING_SHARE = 0.5


def tune(plan: Plan, source: str, gpus: int, top: int = 5, capacity: float | None = None,
         keep: tuple[str, ...] = (), check: Callable[[str], Plan | None] | None = None,
         progress: Callable[[str, int, int], None] | None = None,
         topology: dict[str, str] | None = None, per_node: int | None = None,
         budget: float | None = None,
         effective: Callable[[Plan, float], float] | None = None) -> Search:
    """The best ``top`` layouts of ``plan`` (read from the file text ``source``) on
    ``gpus`` devices. ``check(text)``: the checked plan of a plan text, or None where the
    checker refuses it; ``capacity``: bytes per device (default: the topology's);
    ``topology``: the keys that put the file on ``gpus`` devices of ``per_node`` a node
    (planc.commands.tune.topology_settings); ``budget``: seconds after which the
    candidates not yet simulated are counted as left, not simulated (those not yet
    estimated once ESTIMATING_SHARE of it is spent); ``effective(plan,
    step_seconds)``: the wall time a step costs with checkpoints and failures
    (planc.estimate.resilience), by which the layouts are then ranked."""
    from planc.compile import compile_plan
    from planc.simulate import simulate
    from planc.tune.candidate_text import with_settings, written_values

    start = time.perf_counter()
    search = Search(capacity=capacity if capacity is not None else
                    plan.topology.device.memory)
    per_node = per_node or plan.topology.devices_per_node
    estimator = bounds.Estimator(per_node)
    waiting: list[tuple[float, float, Candidate, Plan]] = []
    fitting: list[Candidate] = []  # of the layout being enumerated (they come together)
    # the mesh order changes neither memory nor the bound nor the estimate
    known: dict[Candidate, tuple[bool, float, float]] = {}
    hopeless: dict[Candidate, bool] = {}
    chunks_of: dict[tuple, tuple] = {}
    activations: dict[Candidate, tuple] = {}  # ZeRO does not change them
    parameters: dict[tuple, tuple] = {}  # nor these, which depend on the chunks alone

    def estimate(candidate: Candidate, trial: Plan) -> memory.MemoryEstimate:
        key = dataclasses.replace(candidate, zero=0)
        if key not in activations:
            activations[key] = memory.stage_activations(trial)
        held = (candidate.tp, candidate.ep, candidate.pp, candidate.virtual,
                candidate.pipeline, candidate.stages)
        if held not in parameters:
            parameters[held] = memory.stage_parameter_counts(trial)
        return memory.estimate(trial, activations[key], parameters[held])
    items = list(candidates(plan, gpus, keep))
    for index, item in enumerate(items):
        if budget is not None and index % 256 == 0 and len(waiting) >= top and \
                time.perf_counter() - start > ESTIMATING_SHARE * budget:
            # the rest is left unestimated once K fit: the simulations get the other share
            search.considered += len(items) - index
            search.pruned["unestimated"] += len(items) - index
            break
        search.considered += 1
        if progress is not None and index % 256 == 0:
            progress("estimating", index, len(items))
        if isinstance(item, str):
            search.pruned[item] += 1
            continue
        fitting = [f for f in fitting if _same_layout(f, item)]
        if any(dominates(f, item) for f in fitting):
            search.pruned["dominated"] += 1
            continue
        # The lightest of a layout's variants is among ZeRO-3 and ZeRO-2 (ZeRO-3 holds
        # its largest unit whole, which can outweigh what it shards) with each
        # recomputation (full recomputes a whole layer once more, which outweighs what
        # it saves where a stage holds about one layer in flight): where none fits, no
        # variant does (one set of estimates for the lot)
        zeros = (item.zero,) if "shard.dp.zero" in keep else (3, 2) \
            if item.dp * item.cp > 1 else (0,)
        recomputes = (item.recompute,) if "optimize.recompute" in keep else \
            ("full", "selective")
        lightest = dataclasses.replace(item, order=ORDERS[0], zero=zeros[0],
                                       recompute=recomputes[0])
        if lightest not in hopeless and search.capacity is not None:
            hopeless[lightest] = all(
                estimate(light, bounds.plan_of(plan, light, per_node, chunks_of)
                         ).held_peak_bytes > search.capacity
                for light in (dataclasses.replace(lightest, zero=z, recompute=r)
                              for z in zeros for r in recomputes))
        if hopeless.get(lightest):
            search.pruned["memory"] += 1
            continue
        trial = bounds.plan_of(plan, item, per_node, chunks_of)
        same = dataclasses.replace(item, order=ORDERS[0])
        if same not in known:
            need = estimate(same, trial)
            fits = search.capacity is None or need.held_peak_bytes <= search.capacity
            bound = estimator.lower_bound(trial) if fits else 0.0
            params = max(s.parameters for s in need.stages)
            known[same] = (fits, bound, estimator.estimate(trial, bound, params)
                           if fits else 0.0)
        fits, bound, guess = known[same]
        if not fits:
            search.pruned["memory"] += 1
            continue
        fitting.append(item)
        waiting.append((guess, bound, item, trial))
    waiting.sort(key=lambda w: (w[0], w[2].text()))
    if plan.world == gpus:  # the file's own layout first: tune never ranks worse than it
        search.considered += 1
        own = of_plan(plan)
        if search.capacity is not None and \
                estimate(own, plan).held_peak_bytes > search.capacity:
            search.pruned["memory"] += 1  # ranked only if it fits, as every other
        else:
            waiting.insert(0, (0.0, 0.0, own, plan))
            search.own = own
    seen: set[str] = set()
    slowest = 0.0  # seconds, of the compilations and simulations so far
    written = set(written_values(source, DEFAULTS))
    for done, (_, bound, candidate, _) in enumerate(waiting):
        if progress is not None:
            progress("simulating", done, len(waiting))
        # a bound on the step bounds its effective time too, which is never shorter
        if len(search.ranked) >= top and bound >= search.ranked[top - 1].effective_seconds:
            search.pruned["bound"] += 1
            continue
        # stop before a simulation that would end past the budget (the slowest so far
        # is what the next may take), once the top K are found
        if budget is not None and len(search.ranked) >= top and \
                time.perf_counter() - start + slowest > budget:
            search.pruned["budget"] += 1
            continue
        settings = {**candidate.settings(),
                    "shard.pp.stages": bounds.stages_setting(plan, candidate)}
        settings = {k: v for k, v in settings.items()
                    if v is not None and (k in written or v != DEFAULTS[k])}
        text = with_settings(source, {**settings, **(topology or {})})
        checked = check(text) if check is not None else None
        if checked is None:
            search.pruned["check"] += 1
            continue
        key = repr(checked.to_dict())
        if key in seen:
            search.pruned["same plan"] += 1
            continue
        seen.add(key)
        began = time.perf_counter()
        build = compile_plan(checked)
        result = simulate(build)
        slowest = max(slowest, time.perf_counter() - began)
        search.simulated += 1
        worst = max(sum(s.exposed_seconds.values()) for s in result.stages)
        peak = max(s.memory_bytes for s in result.stages)
        search.ranked.append(Ranked(
            candidate, checked, text, result.step_seconds, result.tflops_per_gpu, result.mfu,
            result.bubble, worst, peak, result.step_seconds if effective is None else
            effective(checked, result.step_seconds), result, build))
        # times equal to 9 significant digits are a tie (a sum's last bits differ by the
        # order it was added in), broken by the layout's text, not by rounding noise
        search.ranked.sort(key=lambda r: (float(f"{r.effective_seconds:.9g}"),
                                          r.candidate.text()))
        # the best two keep their builds (planc diff's figures), the others drop theirs
        search.ranked[2:] = [dataclasses.replace(r, build=None) if r.build is not None
                             else r for r in search.ranked[2:]]
    if progress is not None:
        progress("simulating", len(waiting), len(waiting))
    search.seconds = time.perf_counter() - start
    return search


__all__ = ["Ranked", "Search", "tune", "of_plan"]
