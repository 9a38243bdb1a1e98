"""The layouts ``planc tune`` considers for a model on N devices.

A candidate sets every choice the search makes: the mesh degrees (tp, cp, pp, dp and,
for a mixture of experts, ep), the mesh order, the pipeline schedule with its virtual
stages and microbatches, the ZeRO stage, sequence parallelism and recomputation. The
rest of the plan (the model, the topology's devices and links, training, the tp
placements) is the file's. ``tp_overlap`` and ``pp_scatter_gather`` are left to the
compiler, whose cost model already decides them per GEMM and per send (planc.passes);
layer ranges are the balanced ones (``stages = auto``).

The space is the product of the values below, with a value held fixed by ``--keep``;
:func:`candidates` yields each candidate, or the rule it breaks, so the search can say
what it pruned and why. The rules here are the plain arithmetic of the mesh (the world,
a degree dividing what it splits); everything subtler is left to planc's checker, which
judges every candidate before it is simulated.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Iterator

from planc.plan.mesh import AXES
from planc.plan.plan import Plan

# Mesh orders tried: the default (pp inside dp, as Megatron-LM) and dp inside pp, which
# keeps small dp groups on a node when pp crosses nodes.
ORDERS: tuple[tuple[str, ...], ...] = (AXES, ("tp", "cp", "dp", "pp"))
PIPELINES = ("1f1b", "interleaved", "zb1p", "interleaved_zb", "zbv", "dualpipev")
VIRTUAL = {"1f1b": (1,), "zb1p": (1,), "interleaved": (2, 4), "interleaved_zb": (2, 4),
           "zbv": (2,), "dualpipev": (2,)}
MICROBATCH_SIZES = (1, 2, 4, 8)  # sequences per microbatch on one data-parallel rank
CONTEXT = (1, 2, 4, 8)
RECOMPUTE = ("none", "selective", "full")

# The settings' values when a plan does not write them: a best plan leaves these out
# unless its file wrote the key.
DEFAULTS = {"mesh.tp": "1", "mesh.cp": "1", "mesh.pp": "1", "mesh.dp": "1", "mesh.ep": "1",
            "mesh.order": f"[{', '.join(AXES)}]", "shard.pp.virtual": "1",
            "schedule.microbatches": "1", "schedule.pipeline": "1f1b", "shard.dp.zero": "0",
            "shard.tp.sequence_parallel": "off", "optimize.recompute": "none",
            "shard.pp.stages": "auto", "schedule.overlap_all_to_all": "off"}

# --keep KEY: the dotted key of the plan (as --set writes it) -> the candidate's field.
KEEPABLE = {"mesh.tp": "tp", "mesh.cp": "cp", "mesh.pp": "pp", "mesh.dp": "dp",
            "mesh.ep": "ep", "mesh.order": "order", "shard.pp.virtual": "virtual",
            "schedule.microbatches": "microbatches", "schedule.pipeline": "pipeline",
            "shard.dp.zero": "zero", "shard.tp.sequence_parallel": "sequence_parallel",
            "optimize.recompute": "recompute", "shard.pp.stages": "stages",
            "schedule.overlap_all_to_all": "overlap_all_to_all"}


@dataclass(frozen=True)
class Candidate:
    tp: int
    cp: int
    pp: int
    dp: int
    ep: int
    order: tuple[str, ...]
    virtual: int
    microbatches: int
    pipeline: str
    zero: int
    sequence_parallel: bool
    recompute: str
    # layer ranges: "auto" (the embedding and head counted as a layer each), "even" (the
    # layers alone spread evenly), or "file" (the file's own explicit stages)
    stages: str = "auto"
    # a mixture over ep: its all-to-alls on a stream of their own, pairs interleaved
    # (schedule { overlap_all_to_all }); the simulator says where it pays
    overlap_all_to_all: bool = False

    def settings(self) -> dict[str, str]:
        """The candidate as ``--set`` keys and values (what it changes in the file)."""
        on = "on" if self.sequence_parallel else "off"
        out = {"mesh.tp": str(self.tp), "mesh.cp": str(self.cp), "mesh.pp": str(self.pp),
               "mesh.dp": str(self.dp), "mesh.order": f"[{', '.join(self.order)}]",
               "shard.pp.virtual": str(self.virtual),
               "schedule.microbatches": str(self.microbatches),
               "schedule.pipeline": self.pipeline, "shard.dp.zero": str(self.zero),
               "shard.tp.sequence_parallel": on, "optimize.recompute": self.recompute}
        if self.ep > 1:
            out["mesh.ep"] = str(self.ep)
            out["schedule.overlap_all_to_all"] = "on" if self.overlap_all_to_all else "off"
        return out

    def text(self) -> str:
        """One line: ``tp 8 pp 4 dp 2 | 1f1b m 16 | zero 1 sp full``."""
        mesh = " ".join(f"{a} {getattr(self, a)}" for a in ("tp", "cp", "pp", "dp", "ep")
                        if getattr(self, a) > 1 or a == "dp")
        if self.order != AXES:
            mesh += f" order {','.join(self.order)}"
        pipe = self.pipeline + (f" v{self.virtual}" if self.virtual > 1 else "") + \
            f" m {self.microbatches}"
        extra = [f"zero {self.zero}"] + (["sp"] if self.sequence_parallel else []) + \
            ([f"recompute {self.recompute}"] if self.recompute != "none" else []) + \
            ([f"stages {self.stages}"] if self.stages != "auto" else []) + \
            (["a2a overlap"] if self.overlap_all_to_all else [])
        return f"{mesh} | {pipe} | {' '.join(extra)}"

    def to_json(self) -> dict:
        return {"mesh": {"tp": self.tp, "cp": self.cp, "pp": self.pp, "dp": self.dp,
                         "ep": self.ep}, "order": list(self.order), "virtual": self.virtual,
                "microbatches": self.microbatches, "pipeline": self.pipeline,
                "zero": self.zero, "sequence_parallel": self.sequence_parallel,
                "recompute": self.recompute, "stages": self.stages,
                **({"overlap_all_to_all": True} if self.overlap_all_to_all else {})}


# How much each recomputes, least first; attention_inputs is not searched (DeepSeek-V3's
# plans write it) but a plan that keeps it is ranked.
RECOMPUTE_RANK = {"none": 0, "selective": 1, "attention_inputs": 2, "full": 3}


def dominates(lighter: Candidate, heavier: Candidate) -> bool:
    """Whether ``lighter``, if it fits in memory, is never slower than ``heavier``: the
    same layout with no more recomputation (which only adds forward FLOPs) and a ZeRO
    stage that adds no communication to it (ZeRO-2 reduces every microbatch and ZeRO-3
    also gathers every microbatch, over ZeRO-1; ZeRO-0 and 1 move the same bytes and are
    both kept)."""
    same = dataclasses.replace(heavier, zero=lighter.zero, recompute=lighter.recompute)
    if same != lighter or lighter == heavier:
        return False
    zero_lighter = lighter.zero <= heavier.zero and (heavier.zero >= 2 or
                                                     lighter.zero == heavier.zero)
    return zero_lighter and RECOMPUTE_RANK[lighter.recompute] <= \
        RECOMPUTE_RANK[heavier.recompute]


def of_plan(plan: Plan) -> Candidate:
    """The candidate a plan already is (the file's own layout)."""
    return Candidate(plan.mesh.tp, plan.mesh.cp, plan.mesh.pp, plan.mesh.dp, plan.mesh.ep,
                     tuple(plan.mesh.order), plan.shard.pp.virtual,
                     plan.schedule.microbatches, plan.schedule.pipeline,
                     plan.shard.dp.zero, plan.shard.tp.sequence_parallel,
                     plan.optimize.recompute, "auto" if plan.shard.pp.auto else "file",
                     plan.schedule.overlap_all_to_all)


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def candidates(plan: Plan, gpus: int, keep: tuple[str, ...] = ()
               ) -> Iterator[Candidate | str]:
    """Every candidate for ``plan`` on ``gpus`` devices, or, for one that breaks a rule
    of the mesh's arithmetic, the rule's name; ``keep``: KEEPABLE keys held at the
    plan's values."""
    m, per_node = plan.model, plan.topology.devices_per_node
    fixed = {KEEPABLE[k]: getattr(of_plan(plan), KEEPABLE[k]) for k in keep}
    experts = getattr(m, "experts", 0)  # a family with routed experts says how many

    def values(name: str, options) -> list:
        return [fixed[name]] if name in fixed else list(options)

    for tp in values("tp", _divisors(gpus)):
        if tp > per_node:
            yield "tp across nodes"
            continue
        if m.heads % tp:
            yield "heads not divisible by tp"
            continue
        for cp in values("cp", CONTEXT):
            if gpus % (tp * cp) or m.seq % (2 * cp) and cp > 1:
                yield "cp does not divide the devices or the sequence"
                continue
            for pp in values("pp", _divisors(gpus // (tp * cp))):
                if (gpus // (tp * cp)) % pp:
                    yield "pp does not divide the devices"
                    continue
                dp = gpus // (tp * cp * pp)
                if "dp" in fixed and fixed["dp"] != dp or m.batch % dp:
                    yield "dp does not divide the batch"
                    continue
                stage = tp * cp * dp
                eps = [1] if not experts else [e for e in _divisors(experts)
                                               if stage % e == 0]
                for ep in values("ep", eps):
                    yield from _schedules(plan, fixed, values, tp, cp, pp, dp, ep)


def _schedules(plan: Plan, fixed: dict, values, tp: int, cp: int, pp: int, dp: int,
               ep: int) -> Iterator[Candidate | str]:
    per_dp = plan.model.batch // dp
    orders = values("order", ORDERS if pp > 1 and dp > 1 else ORDERS[:1])
    pipelines = values("pipeline", PIPELINES if pp > 1 else ("1f1b",))
    zeros = values("zero", range(4) if dp * cp > 1 else (0,))
    sps = values("sequence_parallel", (True, False) if tp > 1 else (False,))
    sizes = [s for s in MICROBATCH_SIZES if per_dp % s == 0]
    for order in orders:
        for pipeline in pipelines:
            for virtual in values("virtual", VIRTUAL.get(pipeline, (1,))):
                if pp * virtual > plan.model.layers + 2:
                    yield "more chunks than layers"
                    continue
                # uneven ranges differ from auto's only where the chunks cannot be equal
                ranges = values("stages", ("auto", "even") if pp > 1 and
                                plan.model.layers % (pp * virtual) else ("auto",))
                for m in values("microbatches", [per_dp // s for s in sizes]):
                    if per_dp % m:
                        yield "microbatches do not divide the batch per dp rank"
                        continue
                    for stages in ranges:
                        for sp in sps:
                            # lightest first: what heavier settings add (dominates)
                            for recompute in values("recompute", RECOMPUTE):
                                for zero in zeros:
                                    for overlap in values("overlap_all_to_all", (
                                            False, True) if ep > 1 else (False,)):
                                        yield Candidate(tp, cp, pp, dp, ep, tuple(order),
                                                        virtual, m, pipeline, zero, sp,
                                                        recompute, stages, overlap)
