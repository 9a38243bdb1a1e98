"""What every block and key of a .plan file may hold: the schema table.

The kinds of values are :mod:`planc.vocabulary.kinds` (the language's leaf) and
:mod:`planc.lang.plan_kinds`; the keys of ``model NAME { }`` are the family's own
(:mod:`planc.models`), read from its description when a plan is checked.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from dataclasses import dataclass, field

from planc.vocabulary.kinds import (BOOLEAN_WORDS, MAX_EXPRESSION_DEPTH, MAX_INTEGER, Boolean,
                              Choice, Integer, Key, Kind, OnOffOrCount, Problem, Quantity, Real, Scope, Time,
                              Unresolved, check_literal, did_you_mean, evaluate_integer,
                              join_words, word_text)
from planc.lang.plan_kinds import (OPTIMIZER_ARGUMENTS, AxisOrder, ClipNorm, DataSource,
                                   OptimizerCall,
                                   OptimizerSpec, PresetFile, PresetSource, StageRange, Stages,
                                   check_path)
from planc.lang.lr_kinds import LrScheduleCall, LrScheduleSpec
from planc.lang.plan_kinds import CheckpointDirectory
from planc.vocabulary.units import COMPUTE, RATE, SIZE, TIME
from planc.plan.lr_schedule import LrSchedule
from planc.models import DEFAULT_FAMILY, FAMILIES
from planc.models.family import Family
from planc.plan.mesh import AXES
from planc.plan.optimize import GRAD_ACCUMULATIONS, KERNEL_MODES, MOE_DISPATCHERS
from planc.plan.plan import GRAD_REDUCES, REDUCE_DTYPES
from planc import schedules

__all__ = [  # the names other modules read here (the kinds live in planc.vocabulary.kinds)
    "BOOLEAN_WORDS", "MAX_EXPRESSION_DEPTH", "MAX_INTEGER", "OPTIMIZER_ARGUMENTS",
    "PLAN_SCHEMA", "AxisOrder", "BlockSchema", "Boolean", "Choice", "DataSource", "Integer",
    "Key", "Kind", "OptimizerCall", "OptimizerSpec", "PresetFile", "PresetSource", "Problem",
    "Quantity", "Real", "Scope", "StageRange", "Stages", "Time", "Unresolved",
    "block_syntax", "check_literal", "check_path", "did_you_mean", "evaluate_integer",
    "join_words", "plan_schema", "where_key_lives", "word_text"]


@dataclass(frozen=True)
class BlockSchema:
    name: str
    keys: dict[str, Key] = field(default_factory=dict)
    blocks: dict[str, "BlockSchema"] = field(default_factory=dict)
    labels: tuple[str, ...] = ()  # allowed second words; empty: none allowed
    required: bool = False
    # A block whose keys depend on its second word (model gpt, model llama): the schema
    # of each; ``keys`` then holds every variant's keys, for paths such as --set's.
    variants: dict[str, "BlockSchema"] = field(default_factory=dict)

    def variant(self, label: str | None) -> "BlockSchema":
        return self.variants.get(label, self) if label is not None else self


def model_schema(families: Mapping[str, Family]) -> BlockSchema:
    """``model FAMILY { }``: each family of ``families`` declares its keys."""
    variants = {name: BlockSchema("model", labels=tuple(families), required=True,
                                  keys=dict(family.keys))
                for name, family in families.items()}
    every: dict[str, Key] = {}
    for variant in variants.values():
        for name, key in variant.keys.items():
            every.setdefault(name, key)
    return BlockSchema("model", labels=tuple(families), required=True, keys=every,
                       variants=variants)


def plan_schema(families: Mapping[str, Family] = FAMILIES) -> BlockSchema:
    """The schema with the model block of ``families`` (by default those registered in
    planc.models: a family added there is in the language without a change here)."""
    if tuple(families.items()) == _SCHEMA_FAMILIES:
        return PLAN_SCHEMA
    return dataclasses.replace(PLAN_SCHEMA, blocks={**PLAN_SCHEMA.blocks,
                                                    "model": model_schema(families)})


_LINK = {"bandwidth": Key(Quantity(RATE)), "latency": Key(Time(TIME))}

_SCHEMA_FAMILIES = tuple(FAMILIES.items())  # the families PLAN_SCHEMA's model block holds
PLAN_SCHEMA = BlockSchema("plan", blocks={
    "model": model_schema(dict(_SCHEMA_FAMILIES)),
    "mesh": BlockSchema("mesh", keys={  # a degree per axis of planc.plan.mesh, then the order
        **{axis: Key(Integer(1), 1) for axis in AXES},
        "order": Key(AxisOrder(), AXES),
        "ep": Key(Integer(1), 1),  # experts, folded over a stage's tp x cp x dp ranks
    }),
    "topology": BlockSchema("topology", keys={
        "nodes": Key(Integer(1)),
        "devices_per_node": Key(Integer(1)),
        "preset": Key(PresetSource()),
    }, blocks={
        "device": BlockSchema("device", keys={
            "flops": Key(Quantity(COMPUTE)), "memory": Key(Quantity(SIZE)),
            "efficiency": Key(Real(0.0, 1.0, False)),
            "bandwidth": Key(Quantity(RATE)),
            "overlap": Key(Real(0.0, 1.0)),
        }),
        "intra": BlockSchema("intra", keys=dict(_LINK)),
        "inter": BlockSchema("inter", keys=dict(_LINK)),
    }),
    "shard": BlockSchema("shard", blocks={
        "tp": BlockSchema("tp", keys={
            "embedding": Key(Choice(("vocab", "hidden", "replicate")), "vocab"),
            "qkv": Key(Choice(("column", "row", "replicate")), "column"),
            "proj": Key(Choice(("column", "row", "replicate")), "row"),
            "fc1": Key(Choice(("column", "row", "replicate")), "column"),
            "fc2": Key(Choice(("column", "row", "replicate")), "row"),
            "head": Key(Choice(("vocab", "replicate")), "vocab"),
            "sequence_parallel": Key(Boolean(), False),
            "gathered_inputs": Key(Choice(("keep", "regather")), "keep"),
        }),
        "cp": BlockSchema("cp", keys={
            "attention": Key(Choice(("allgather", "ring")), "allgather"),
            "load_balance": Key(Boolean(), True),
        }),
        "pp": BlockSchema("pp", keys={
            "stages": Key(Stages(), "auto"),
            "virtual": Key(Integer(1), 1),
        }),
        "dp": BlockSchema("dp", keys={"zero": Key(Integer(0, 3), 0),
                                      "fp32_grads": Key(Boolean(), False),
                                      "reduce_dtype": Key(Choice(REDUCE_DTYPES), "model"),
                                      "grad_reduce": Key(Choice(GRAD_REDUCES),
                                                         "reduce_scatter")}),
    }),
    "schedule": BlockSchema("schedule", keys={
        "microbatches": Key(Integer(1), 1),
        "pipeline": Key(Choice(schedules.names()), schedules.DEFAULT_SCHEDULE),
        "overlap_all_to_all": Key(Boolean(), False),
    }),
    "optimize": BlockSchema("optimize", keys={
        "fuse": Key(Boolean(), True),
        "bucket": Key(Quantity(SIZE), 25e6),
        "route": Key(Choice(("ring", "tree", "hierarchical", "auto")), "auto"),
        "overlap": Key(Boolean(), True),
        "weight_grad_overlap": Key(Boolean(), True),
        "tp_overlap": Key(OnOffOrCount(), True),
        "recompute": Key(Choice(("none", "selective", "attention_inputs", "full")), "none"),
        "pp_scatter_gather": Key(Boolean(), True),
        "grad_accumulation": Key(Choice(GRAD_ACCUMULATIONS), "fused"),
        "kernels": Key(Choice(KERNEL_MODES), "fused"),
        "moe_dispatcher": Key(Choice(MOE_DISPATCHERS), "all_to_all"),
        "compile": Key(Boolean(), False),
        "recompute_moe_activation": Key(Boolean(), False),
        "recompute_activation": Key(Boolean(), False),
        "recompute_norms": Key(Boolean(), False),
    }),
    "train": BlockSchema("train", keys={
        "steps": Key(Integer(1), 1),
        "optimizer": Key(OptimizerCall(), OptimizerSpec("sgd", {"lr": 0.1, "momentum": 0.0,
                                                                "weight_decay": 0.0})),
        "seed": Key(Integer(0), 0),
        "data": Key(DataSource(), "synthetic"),
        "eval_every": Key(Integer(0), 0),
        "eval_batches": Key(Integer(1), 1),
        "eval_data": Key(DataSource(), "synthetic"),
        "grad_clip": Key(ClipNorm(), None),  # off
        "lr_schedule": Key(LrScheduleCall(), LrScheduleSpec(LrSchedule())),
        "shuffle": Key(Boolean(), False),
        "init": Key(CheckpointDirectory(), None),
    }),
})


def where_key_lives(key: str) -> list[str]:
    """Dotted paths of the blocks that have ``key``, for 'it belongs in ...' hints."""
    return list(_homes().get(key, ()))


@functools.lru_cache(maxsize=1)
def _homes() -> dict[str, tuple[str, ...]]:
    """Every key of the language -> the blocks that have it (built once: a file with
    thousands of unknown keys asks for each)."""
    found: dict[str, list[str]] = {}

    def visit(schema: BlockSchema, path: str) -> None:
        for name, block in schema.blocks.items():
            inner = f"{path}.{name}" if path else name
            for key in block.keys:
                found.setdefault(key, []).append(inner)
            visit(block, inner)

    visit(PLAN_SCHEMA, "")
    return {key: tuple(paths) for key, paths in found.items()}


def block_syntax(path: str, family: str | None = None) -> str:
    """``shard.tp`` -> ``shard { tp { } }``; ``model`` -> ``model gpt { }``, or the
    ``family`` the plan's model block names (``model deepseek { }``)."""
    parts = path.split(".")
    if parts == ["model"]:
        return f"model {family or DEFAULT_FAMILY} {{ }}"
    return " ".join(f"{p} {{" for p in parts) + " " + " ".join("}" for _ in parts)


def schema_problem(plan) -> str | None:
    """The first field of ``plan`` (a planc.plan.plan.Plan read back from a build's
    plan.json, which is untrusted) that holds a value the schema's key of the same path
    never reads (an unknown schedule or recomputation, a word for a number), as
    ``plan.PATH is VALUE, not WHAT``; None if none: a value planc check never lets
    through would otherwise reach the compiler's passes. Fields the plan holds in
    another form than they are written (a preset, the stages) are left to their rules."""
    from planc.plan.plan_json import holds

    def walk(block: BlockSchema, holder, where: str) -> str | None:
        for name, key in block.keys.items():
            value = getattr(holder, name, None)
            if value is not None and not dataclasses.is_dataclass(value) and \
                    not holds(key.kind, value):
                return f"{where}.{name} is {value!r}, not {key.kind.noun}"
        for name, inner in block.blocks.items():
            held = getattr(holder, name, None)
            if name != "model" and dataclasses.is_dataclass(held):
                found = walk(inner, held, f"{where}.{name}")
                if found:
                    return found
        return None

    return walk(PLAN_SCHEMA, plan, "plan")
