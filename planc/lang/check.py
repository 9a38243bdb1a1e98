"""Syntax tree to validated :class:`~planc.plan.Plan`: every rule of the language spec.

Two passes. The first reads each block against :mod:`planc.lang.schema` (unknown and
duplicate keys, types, units, expressions). The second checks what holds across
keys and blocks: the world size against the topology, every divisibility the
sharding needs, pipeline stages, schedules and tied embeddings. Every problem found
is reported; a Plan is returned only when there is no error.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from planc.models import FAMILIES
from planc.diagnostics import Diagnostic, Span, error, warning
from planc.files import read_regular_file
from planc.lang import ast
from planc.lang.overrides import Override
from planc.lang.overrides import apply as apply_overrides
from planc.lang.presets import GENERIC, PRESETS, Preset, calibrated_preset
from planc.lang.schema import (PLAN_SCHEMA, BlockSchema, PresetFile, Scope, StageRange,
                               Unresolved, block_syntax, did_you_mean, join_words,
                               where_key_lives)
from planc.plan import (LIMITS, Optimizer, ContextParallel, DataParallel, Device, Link, Mesh, Model,
                        Optimize, PipelineParallel, Plan, Schedule, Shard, Sources,
                        TensorParallel, Topology, Train)
from planc.schedules import PipelineShape
from planc.schedules import problems as schedule_problems


def check(tree: ast.PlanFile, path: str, overrides: Sequence[Override] = ()
          ) -> tuple[Plan | None, list[Diagnostic]]:
    """Validate a parsed file, with ``overrides`` applied (``--set``) and recorded in the
    plan's sources. ``path`` names the file in the plan and locates data files. The
    diagnostics come in the order found (planc.lang.load_text sorts them)."""
    checker = _Checker(path, overrides=tuple(o.text for o in overrides))
    plan = checker.run(apply_overrides(tree, overrides) if overrides else tree)
    return plan, checker.diagnostics


MAX_TOPOLOGY_BYTES = 1 << 20  # a calibrated topology is a few KB
# planc's limits (docs/language.md, section 5): far beyond any model or cluster that
# exists, and small enough that compile, programs, verify and graph finish in seconds on
# every plan check accepts (tests/test_limits.py compiles a plan at each one). The work
# each bounds grows linearly with what it counts. pp x virtual is at most layers: each
# model chunk needs a layer.
LIMIT_REASONS = {
    "world": "planc layout lists every rank and its groups",
    "layers": "the graph holds every layer's compute steps and transfers, and compile "
              "derives, lowers and verifies each of them",
    "microbatches": "each stage's program runs a forward and a backward block per "
                    "microbatch",
    "schedule": "the stages' programs run a forward and a backward block per model chunk "
                "and microbatch, and the verifier proves every one of them",
}


def _over_limit(what: str, limit: str) -> str:
    """'layers (4096) is more than planc's limit of 1024: the graph holds ...'"""
    return f"{what} is more than planc's limit of {LIMITS[limit]}: {LIMIT_REASONS[limit]}"


def divisors_below(limit: int, *numbers: int, count: int = 2) -> list[int]:
    """The largest ``count`` values d in 2..limit-1, and at most 4096, that divide every
    one of ``numbers``."""
    return largest_divisors(math.gcd(*numbers), min(limit, 4097), count, least=2)


def largest_divisors(n: int, below: int, count: int = 2, least: int = 1,
                     budget: int = 100_000) -> list[int]:
    """The largest ``count`` divisors of ``n`` that are less than ``below`` and at least
    ``least``, for a hint. Searched downward from the first value that could be one, over
    at most ``budget`` values: a hostile plan may write heads = 100000144 (a search from
    there took 6 s) or hidden = 10**30, and a hint is not worth more than a few
    milliseconds."""
    top = below - 1 if n == 0 else min(below - 1, n)  # every number divides 0
    found = (d for d in range(top, max(top - budget, least - 1), -1) if n % d == 0)
    return list(itertools.islice(found, count))


def _where_given(span: Span) -> str:
    """'at line 3' in the file, 'by --set mesh.tp=8' in an override."""
    return f"by {span.source.name}" if span.source is not None else f"at line {span.line}"


def _try(name: str, candidates: list[int]) -> str:
    return "try " + " or ".join(f"{name} = {c}" for c in candidates) if candidates else ""


@dataclass
class _Checker:
    path: str
    diagnostics: list[Diagnostic] = field(default_factory=list)
    values: dict[str, Any] = field(default_factory=dict)  # "mesh.tp" -> value or None
    spans: dict[str, Span] = field(default_factory=dict)  # "mesh.tp" -> value span
    given: set[str] = field(default_factory=set)  # keys and blocks the user wrote
    plan_name: str = ""
    overrides: tuple[str, ...] = ()  # the --set KEY=VALUE texts applied, for Sources
    labels: dict[str, str] = field(default_factory=dict)  # "model" -> "llama"

    # --- pass 1: blocks and keys -----------------------------------------------------

    def run(self, tree: ast.PlanFile) -> Plan | None:
        self.spans["plan"] = tree.name_span
        self.plan_name = tree.name
        if "-" in tree.name:
            self.report(error(f"plan name '{tree.name}' may hold only letters, digits and '_'",
                              tree.name_span, f"write plan {tree.name.replace('-', '_')}"))
        self._read_block(PLAN_SCHEMA, tree.entries, "", tree.name_span)
        plan = self._build()
        return plan if not any(d.is_error for d in self.diagnostics) else None

    def report(self, diagnostic: Diagnostic) -> None:
        self.diagnostics.append(diagnostic)

    def _read_block(self, schema: BlockSchema, entries, path: str, header: Span) -> None:
        keys: dict[str, ast.Assign] = {}
        blocks: dict[str, ast.Block] = {}
        where = f"in {block_syntax(path)}" if path else "at the top of the plan"
        for entry in entries:
            if isinstance(entry, ast.Assign):
                self._index_key(schema, entry, keys, path, where)
            else:
                self._index_block(schema, entry, blocks, path, where)
        # A misspelt key is reported once, as unknown, not again as missing.
        unknown = [e.key for e in entries if isinstance(e, ast.Assign) and e.key not in schema.keys]
        for name, sub in schema.blocks.items():
            inner = f"{path}.{name}" if path else name
            if name in blocks:
                block = blocks[name]
                self.given.add(inner)
                self.spans[inner] = block.name_span
                if block.label in sub.variants:
                    self.labels[inner] = block.label
                self._read_block(sub.variant(block.label), block.entries, inner,
                                 block.name_span)
            else:
                if sub.required:
                    self.report(error(f"the plan has no {name} block", header,
                                      f"add {block_syntax(inner)} with its keys"))
                self._read_block(sub, (), inner, header)
        self._read_keys(schema, keys, path, header, unknown)

    def _index_key(self, schema, entry: ast.Assign, keys, path, where) -> None:
        if entry.key in schema.keys:
            if entry.key in keys:
                first = keys[entry.key].key_span
                self.report(error(f"duplicate key '{entry.key}' (first given "
                                  f"{_where_given(first)})", entry.key_span))
            else:
                keys[entry.key] = entry
        elif entry.key in schema.blocks:
            homes = [h for h in where_key_lives(entry.key) if h != path]
            self.report(error(f"'{entry.key}' is a block, not a key", entry.key_span,
                              *[f"'{entry.key}' belongs in {block_syntax(h)}" for h in homes],
                              f"write {entry.key} {{ ... }}"))
        else:
            self.report(error(f"unknown key '{entry.key}' {where}", entry.key_span,
                              *self._unknown_hints(entry.key, schema, path)))

    def _index_block(self, schema, entry: ast.Block, blocks, path, where) -> None:
        if entry.name in schema.blocks:
            sub = schema.blocks[entry.name]
            if entry.name in blocks:
                first = blocks[entry.name].name_span
                self.report(error(f"duplicate block '{entry.name}' (first given "
                                  f"{_where_given(first)})", entry.name_span))
                return
            if sub.labels and entry.label is None:
                self.report(error(f"{entry.name} needs its family: write "
                                  f"{entry.name} {sub.labels[0]} {{ ... }}", entry.name_span))
            elif sub.labels and entry.label not in sub.labels:
                self.report(error(f"unknown {entry.name} family '{entry.label}'; planc knows "
                                  f"{', '.join(sub.labels)}", entry.label_span,
                                  did_you_mean(entry.label, sub.labels)))
            elif not sub.labels and entry.label is not None:
                meant = next((k for k, key in sub.keys.items()
                              if entry.label in getattr(key.kind, "words", ())), None)
                self.report(error(f"block '{entry.name}' takes no second word",
                                  entry.label_span,
                                  f"write {entry.name} {{ {meant} = {entry.label}; ... }}"
                                  if meant else f"write {entry.name} {{ ... }}"))
            blocks[entry.name] = entry
        elif entry.name in schema.keys:
            self.report(error(f"'{entry.name}' is a key, not a block", entry.name_span,
                              f"write {entry.name} = ..."))
        else:
            self.report(error(f"unknown block '{entry.name}' {where}", entry.name_span,
                              *self._unknown_hints(entry.name, schema, path)))

    @staticmethod
    def _unknown_hints(name: str, schema: BlockSchema, path: str) -> list[str]:
        near = did_you_mean(name, list(schema.keys) + list(schema.blocks))
        if near:
            return [near]
        homes = [h for h in where_key_lives(name) if h != path]
        if homes:
            return [f"'{name}' belongs in " + " or ".join(block_syntax(h) for h in homes)]
        return []

    def _read_keys(self, schema: BlockSchema, entries: dict[str, ast.Assign], path: str,
                   header: Span, unknown: list[str]) -> None:
        required = frozenset(k for k, key in schema.keys.items() if key.required)
        misspelt: set[str] | None = None  # found only if a required key is missing
        scope = Scope(entries, {k: key.kind for k, key in schema.keys.items()},
                      {k: key.default for k, key in schema.keys.items()}, required)
        for name, key in schema.keys.items():
            dotted = f"{path}.{name}"
            if name in entries:
                self.given.add(dotted)
                self.spans[dotted] = entries[name].value.span
            elif key.required and path in self.given:
                if misspelt is None:
                    misspelt = {did_you_mean(word, schema.keys) for word in unknown}
                if f"did you mean '{name}'?" not in misspelt:
                    self.report(error(f"{block_syntax(path).split(' {')[0]} is missing the "
                                      f"key '{name}'", header, f"add {name} = ..."))
            try:
                self.values[dotted] = scope.value(name)
            except Unresolved:
                self.values[dotted] = None
        for problem in scope.problems:
            self.report(error(problem.message, problem.span, *problem.hints))

    # --- pass 2: rules across keys ----------------------------------------------------

    def value(self, dotted: str) -> Any:
        return self.values.get(dotted)

    def span(self, *dotted: str) -> Span | None:
        for key in dotted:
            if key in self.spans:
                return self.spans[key]
        return self.spans.get("plan")

    def ready(self, *dotted: str) -> bool:
        """Whether every named value was read successfully."""
        return all(self.values.get(key) is not None for key in dotted)

    def _build(self) -> Plan | None:
        model = self._model()
        mesh = self._mesh()
        topology = self._topology(mesh, model)
        tensor = self._tensor_parallel(mesh, model)
        context = self._context_parallel(mesh, model)
        schedule = self._schedule(mesh, model)
        pipeline = self._pipeline(mesh, model, schedule)
        self._tied_embeddings(mesh, model, tensor)
        zero = self.value("shard.dp.zero")
        if mesh and zero and mesh.dp * mesh.cp == 1 and "shard.dp.zero" in self.given:
            self.report(warning(f"zero = {zero} has no effect with dp = 1 and cp = 1",
                                self.span("shard.dp.zero")))
        optimize = self._optimize()
        train = self._train(model)
        parts = (model, mesh, topology, tensor, context, pipeline, schedule, optimize, train)
        if any(part is None for part in parts) or zero is None:
            return None
        return Plan(name=self.plan_name, model=model, mesh=mesh, topology=topology,
                    shard=Shard(tensor, context, pipeline, DataParallel(zero)),
                    schedule=schedule, optimize=optimize, train=train,
                    sources=Sources(self.path, dict(self.spans), self.overrides))

    def _model(self) -> Model | None:
        family = FAMILIES[self.labels.get("model", "gpt")]
        keys = tuple(k for k in family.keys() if k != "preset")
        preset_failed = "model.preset" in self.spans and self.values.get("model.preset") is None
        if family.presets and "model" in self.given and not preset_failed:
            # A family with presets: a key neither given nor in the preset is missing.
            for key in keys:
                if self.values.get(f"model.{key}") is None and \
                        f"model.{key}" not in self.spans and key != "batch":
                    self.report(error(f"model {family.name} is missing the key '{key}'",
                                      self.span("model"),
                                      f"add {key} = ..., or a preset = "
                                      f"{' | '.join(family.presets)} that sets it"))
        if not self.ready(*(f"model.{k}" for k in keys)):
            return None
        model = Model(family=family.name, **{k: self.value(f"model.{k}") for k in keys})
        if model.layers > LIMITS["layers"]:
            return self._reject(_over_limit(f"layers ({model.layers})", "layers"),
                                self.span("model.layers"))
        if model.hidden % model.heads:
            candidates = largest_divisors(model.hidden, model.heads)
            self.report(error(f"hidden ({model.hidden}) must divide by heads ({model.heads})",
                              self.span("model.heads"),
                              f"heads must divide hidden; {_try('heads', candidates)}"))
            return None
        if model.kv_heads is not None and model.heads % model.kv_heads:
            candidates = largest_divisors(model.heads, model.kv_heads)
            return self._reject(f"kv_heads ({model.kv_heads}) must divide heads "
                                f"({model.heads}): each key/value head serves a group of "
                                f"query heads", self.span("model.kv_heads", "model.heads"),
                                _try("kv_heads", candidates))
        if family.name == "llama" and model.head_dim % 2:
            return self._reject(f"the head dimension hidden / heads = {model.head_dim} is "
                                f"odd; rotary embedding turns pairs of features",
                                self.span("model.heads"))
        return model

    def _mesh(self) -> Mesh | None:
        keys = ("tp", "cp", "pp", "dp", "order")
        if not self.ready(*(f"mesh.{k}" for k in keys)):
            return None
        mesh = Mesh(**{k: self.value(f"mesh.{k}") for k in keys})
        if mesh.world > LIMITS["world"]:
            largest = max(("tp", "cp", "pp", "dp"), key=mesh.size)
            return self._reject(f"the mesh has {mesh.world} ranks, more than planc's limit of "
                                f"{LIMITS['world']}: {LIMIT_REASONS['world']}",
                                self.span(f"mesh.{largest}"))
        return mesh

    def _topology(self, mesh: Mesh | None, model: Model | None) -> Topology | None:
        keys = ("topology.nodes", "topology.devices_per_node", "topology.preset")
        if mesh is None or any(k in self.given and self.value(k) is None for k in keys):
            return None
        given = self.value("topology.preset")
        if isinstance(given, PresetFile):
            preset = self._calibrated(given)
            if preset is None:
                return None
        else:
            preset = PRESETS.get(given) or GENERIC
        world = mesh.world
        nodes, per_node = self.value("topology.nodes"), self.value("topology.devices_per_node")
        if per_node is None and nodes is not None and preset.devices_per_node:
            per_node = preset.devices_per_node  # the preset's machine, unless overridden
        mesh_text = (f"tp {mesh.tp} x cp {mesh.cp} x pp {mesh.pp} x dp {mesh.dp} = "
                     f"{world} devices")
        if nodes is not None and per_node is not None:
            if nodes * per_node != world:
                hint = (_try("nodes", [world // per_node]) if world % per_node == 0 else
                        f"devices_per_node must divide the world size {world}")
                self.report(error(f"topology has {nodes} nodes x {per_node} devices = "
                                  f"{nodes * per_node} devices, but the mesh needs {mesh_text}",
                                  self.span("topology.nodes"), hint))
                return None
        elif nodes is not None:
            if world % nodes:
                self.report(error(f"the mesh's {mesh_text} do not split evenly over {nodes} "
                                  f"nodes", self.span("topology.nodes")))
                return None
            per_node = world // nodes
        else:
            if per_node is None:
                per_node = preset.devices_per_node or world
                where = self.span("topology.preset")
                if world % per_node:
                    self.report(error(f"the mesh's {mesh_text} do not fill whole {preset.name} "
                                      f"nodes of {per_node} devices", where,
                                      f"set devices_per_node = {world} to use part of a node"
                                      if world < per_node else ""))
                    return None
            elif world % per_node:
                self.report(error(f"the mesh's {mesh_text} do not fill whole nodes of "
                                  f"{per_node} devices", self.span("topology.devices_per_node")))
                return None
            nodes = world // per_node

        def pick(key: str, fallback: Any) -> Any:
            given = self.value(f"topology.{key}")
            return fallback if given is None else given

        dtype = model.dtype if model else "fp32"
        device = Device(pick("device.flops", preset.flops[dtype]),
                        pick("device.memory", preset.memory),
                        pick("device.efficiency", preset.efficiency),
                        pick("device.bandwidth", preset.memory_bandwidth))
        # A link given in the plan replaces the preset's, measured collectives and all.
        intra = Link(pick("intra.bandwidth", preset.intra_bandwidth),
                     pick("intra.latency", preset.intra_latency),
                     () if "topology.intra" in self.given else preset.intra_collectives)
        inter = Link(pick("inter.bandwidth", preset.inter_bandwidth),
                     pick("inter.latency", preset.inter_latency),
                     () if "topology.inter" in self.given else preset.inter_collectives)
        return Topology(nodes, per_node, device, intra, inter, self.value("topology.preset"))

    def _calibrated(self, path: str) -> Preset | None:
        """The topology ``planc calibrate`` wrote at ``path`` (relative to the plan)."""
        base = os.path.dirname(os.path.abspath(self.path)) if self.path else os.getcwd()
        resolved = os.path.normpath(os.path.join(base, path))
        span = self.span("topology.preset")
        try:
            text = read_regular_file(resolved, MAX_TOPOLOGY_BYTES + 1)
        except OSError as exc:
            return self._reject(f"cannot read topology '{path}': "
                                f"{exc.strerror or exc}", span)
        if len(text) > MAX_TOPOLOGY_BYTES:
            return self._reject(f"topology '{path}' is larger than "
                                f"{MAX_TOPOLOGY_BYTES // 1024} KB; it is not one planc "
                                f"calibrate wrote", span)
        try:
            return calibrated_preset(json.loads(text), path)
        except (ValueError, UnicodeDecodeError, RecursionError, OverflowError) as exc:
            reason = "it is not JSON" if isinstance(exc, (json.JSONDecodeError,
                                                          UnicodeDecodeError)) else str(exc)
            return self._reject(f"cannot use topology '{path}': {reason}", span,
                                "write one with planc calibrate -o FILE")

    def _tensor_parallel(self, mesh: Mesh | None, model: Model | None) -> TensorParallel | None:
        keys = ("embedding", "qkv", "proj", "fc1", "fc2", "head", "sequence_parallel")
        if not self.ready(*(f"shard.tp.{k}" for k in keys)):
            return None
        tensor = TensorParallel(**{k: self.value(f"shard.tp.{k}") for k in keys})
        if mesh is None or model is None:
            return tensor
        family = FAMILIES[model.family]
        for key, allowed in family.placements.items():
            if getattr(tensor, key) not in allowed:
                return self._reject(f"{key} = {getattr(tensor, key)} is not a placement of "
                                    f"model {family.name}", self.span(f"shard.tp.{key}"),
                                    f"{key} may be {join_words(allowed)}")
        tp = mesh.tp
        if tp == 1:
            if "shard.tp" in self.given:
                self.report(warning("shard { tp { } } has no effect with tp = 1",
                                    self.span("shard.tp")))
            return tensor
        needs: dict[str, int] = {}
        if tensor.qkv == "column" or tensor.proj == "row":
            needs["heads"] = model.heads
        if "row" in (tensor.qkv, tensor.fc1) or "column" in (tensor.proj, tensor.fc2) or \
                tensor.embedding == "hidden":
            needs["hidden"] = model.hidden
        if tensor.fc1 == "column" or tensor.fc2 == "row":
            needs["ffn"] = model.ffn
        kv = model.kv_heads
        if tensor.qkv == "column" and kv is not None and kv % tp and tp % kv:
            return self._reject(
                f"kv_heads ({kv}) and tp ({tp}) must divide one another: each rank takes "
                f"kv_heads / tp key/value heads, or shares one with tp / kv_heads ranks",
                self.span("mesh.tp"), _try("tp", divisors_below(tp, kv)))
        if "vocab" in (tensor.embedding, tensor.head):
            needs["vocab"] = model.vocab
        local_seq = model.seq // mesh.cp if model.seq % mesh.cp == 0 else None
        if tensor.sequence_parallel and local_seq is not None:
            needs["seq / cp" if mesh.cp > 1 else "seq"] = local_seq
        failing = [name for name, amount in needs.items() if amount % tp]
        if not failing:
            return tensor
        listed = join_words([f"{name} ({needs[name]})" for name in failing], "and")
        hints = [f"tp must divide {join_words(failing, 'and')}; "
                 f"{_try('tp', divisors_below(tp, *needs.values()))}".rstrip("; ")]
        if "vocab" in failing:
            multiple = 128 * tp
            padded = -(-model.vocab // multiple) * multiple
            hints.append(f"or pad vocab to {padded}, a multiple of 128 x tp, as Megatron does")
        self.report(error(f"{listed} must divide by tp ({tp})", self.span("mesh.tp"), *hints))
        return None

    def _context_parallel(self, mesh: Mesh | None, model: Model | None) -> ContextParallel | None:
        if not self.ready("shard.cp.attention", "shard.cp.load_balance"):
            return None
        context = ContextParallel(self.value("shard.cp.attention"),
                                  self.value("shard.cp.load_balance"))
        if mesh is None or model is None:
            return context
        cp = mesh.cp
        if cp == 1:
            if "shard.cp" in self.given:
                self.report(warning("shard { cp { } } has no effect with cp = 1",
                                    self.span("shard.cp")))
            return context
        if context.load_balance:
            if model.seq % (2 * cp):
                candidates = [c for c in divisors_below(cp, model.seq, count=99)
                              if model.seq % (2 * c) == 0][:2]
                self.report(error(f"seq ({model.seq}) must divide by 2 x cp ({2 * cp}) with "
                                  f"load_balance = on", self.span("mesh.cp"),
                                  "load balancing cuts the sequence into 2 x cp chunks; "
                                  + (_try("cp", candidates) + " or " if candidates else "try ")
                                  + "load_balance = off"))
                return None
        elif model.seq % cp:
            self.report(error(f"seq ({model.seq}) must divide by cp ({cp})", self.span("mesh.cp"),
                              f"cp must divide seq; "
                              f"{_try('cp', divisors_below(cp, model.seq))}".rstrip("; ")))
            return None
        return context

    def _schedule(self, mesh: Mesh | None, model: Model | None) -> Schedule | None:
        if not self.ready("schedule.microbatches", "schedule.pipeline"):
            return None
        schedule = Schedule(self.value("schedule.microbatches"), self.value("schedule.pipeline"))
        if schedule.microbatches > LIMITS["microbatches"]:
            return self._reject(_over_limit(f"microbatches ({schedule.microbatches})",
                                            "microbatches"), self.span("schedule.microbatches"))
        if mesh is None or model is None:
            return schedule
        if model.batch % mesh.dp:
            batch_up = -(-model.batch // mesh.dp) * mesh.dp
            options = [f"dp = {d}" for d in divisors_below(mesh.dp, model.batch, count=1)]
            self.report(error(f"batch ({model.batch}) must divide by dp ({mesh.dp})",
                              self.span("mesh.dp", "model.batch"),
                              "try " + " or ".join(options + [f"batch = {batch_up}"])))
            return None
        per_rank = model.batch // mesh.dp
        if per_rank % schedule.microbatches:
            what = (f"batch per data-parallel rank (batch / dp = {per_rank})" if mesh.dp > 1
                    else f"batch ({per_rank})")
            self.report(error(f"{what} must divide by microbatches ({schedule.microbatches})",
                              self.span("schedule.microbatches"),
                              f"microbatches must divide {per_rank}; "
                              f"{_try('microbatches', divisors_below(schedule.microbatches, per_rank) or [1])}"))
            return None
        return schedule

    def _pipeline(self, mesh: Mesh | None, model: Model | None,
                  schedule: Schedule | None) -> PipelineParallel | None:
        if not self.ready("shard.pp.stages", "shard.pp.virtual"):
            return None
        stages, virtual = self.value("shard.pp.stages"), self.value("shard.pp.virtual")
        runs = mesh.pp * virtual * schedule.microbatches if mesh and schedule else 0
        if runs > LIMITS["schedule"]:  # every chunk's forward of every microbatch
            if virtual > 1:
                what = f"pp x virtual x microbatches ({mesh.pp} x {virtual} x " \
                       f"{schedule.microbatches} = {runs})"
            else:
                what = f"pp x microbatches ({mesh.pp} x {schedule.microbatches} = {runs})"
            return self._reject(_over_limit(what, "schedule"), self.span("schedule.microbatches"))
        if mesh is None or model is None or schedule is None:
            return None
        pp, layers = mesh.pp, model.layers
        ok = True
        shape = PipelineShape(pp, virtual, schedule.microbatches, layers)
        for problem in schedule_problems(schedule.pipeline, shape):
            ok = self._fail(problem.message, self.span(*problem.keys), problem.hint)
        if pp == 1 and "shard.pp" in self.given and stages == "auto" and virtual == 1:
            self.report(warning("shard { pp { } } has no effect with pp = 1",
                                self.span("shard.pp")))
        chunks = pp * virtual
        if stages == "auto":
            if not ok:
                return None
            if layers < chunks:
                what = f"pp ({pp})" if virtual == 1 else f"pp x virtual ({chunks})"
                return self._reject(f"{what} is more than layers ({layers}): each stage needs at "
                                  f"least one layer", self.span("mesh.pp"), None)
            return PipelineParallel(_even_chunks(layers, chunks), virtual, True) if ok else None
        if not self._stage_ranges(stages, layers, chunks, pp, virtual):
            return None
        return PipelineParallel(tuple((r.first, r.last) for r in stages), virtual, False) \
            if ok else None

    def _stage_ranges(self, ranges: tuple[StageRange, ...], layers: int, chunks: int,
                      pp: int, virtual: int) -> bool:
        ok = True
        if len(ranges) != chunks:
            what = f"pp is {pp}" if virtual == 1 else f"pp x virtual is {chunks}"
            ok = self._fail(f"stages lists {len(ranges)} layer ranges but {what}",
                            self.span("shard.pp.stages"),
                            "give one range per stage" if virtual == 1 else
                            "give one range per model chunk (chunk c runs on stage c mod pp)")
        for before, after in zip(ranges, ranges[1:]):
            if after.first < before.first:
                return self._fail(f"layer range {after.first}..{after.last} comes after "
                                  f"{before.first}..{before.last}", after.span,
                                  "list the ranges in layer order")
        expected = 0
        previous: StageRange | None = None
        for r in ranges:
            if r.last >= layers:
                ok = self._fail(f"layer range {r.first}..{r.last} goes past the last layer "
                                f"({layers - 1})", r.span)
            elif r.first < expected:
                ok = self._fail(f"layer range {r.first}..{r.last} overlaps "
                                f"{previous.first}..{previous.last}", r.span,
                                "each layer belongs to exactly one stage")
            elif r.first > expected:
                ok = self._fail(f"{_layers_text(expected, r.first - 1)} in no stage", r.span,
                                "the ranges must cover every layer once, in order")
            expected = max(expected, r.last + 1)
            previous = r
        if ok and expected < layers:
            ok = self._fail(f"{_layers_text(expected, layers - 1)} in no stage",
                            self.span("shard.pp.stages"),
                            f"the ranges must cover layers 0..{layers - 1}")
        return ok

    def _fail(self, message: str, span: Span | None, hint: str | None = None) -> bool:
        """Report an error; False, for ``ok = self._fail(...)``."""
        self.report(error(message, span, *([hint] if hint else [])))
        return False

    def _reject(self, message: str, span: Span | None, hint: str | None = None) -> None:
        """Report an error; None, for ``return self._reject(...)``."""
        self._fail(message, span, hint)

    def _tied_embeddings(self, mesh, model, tensor) -> None:
        if not (mesh and model and tensor) or not model.tie_embeddings or mesh.tp == 1:
            return
        if tensor.embedding == tensor.head:  # both vocab or both replicate
            return
        self.report(error(f"tie_embeddings needs embedding and head sharded alike, but "
                          f"embedding = {tensor.embedding} and head = {tensor.head}",
                          self.span("shard.tp.head", "shard.tp.embedding",
                                    "model.tie_embeddings"),
                          "use embedding = vocab with head = vocab, or replicate both"))

    def _optimize(self) -> Optimize | None:
        keys = ("fuse", "bucket", "route", "overlap", "recompute")
        if not self.ready(*(f"optimize.{k}" for k in keys)):
            return None
        return Optimize(**{k: self.value(f"optimize.{k}") for k in keys})

    def _train(self, model: Model | None) -> Train | None:
        keys = ("steps", "optimizer", "seed", "data")
        if not self.ready(*(f"train.{k}" for k in keys)):
            return None
        spec = self.value("train.optimizer")
        data = self.value("train.data")
        if data != "synthetic":
            data = self._data_file(data, model)
            if data is None:
                return None
        return Train(self.value("train.steps"), Optimizer(name=spec.name, **spec.arguments),
                     self.value("train.seed"), data)

    def _data_file(self, data: str, model: Model | None) -> str | None:
        from planc.runtime.data import DataError, DataMissing, check_file  # no torch

        base = os.path.dirname(os.path.abspath(self.path)) if self.path else os.getcwd()
        resolved = os.path.normpath(os.path.join(base, data))
        span = self.span("train.data")
        try:
            check_file(resolved, f"'{data}'", seq=model.seq if model else None,
                       vocab=model.vocab if model else None, scan_limit=DATA_SCAN_LIMIT,
                       engine="python")
        except DataMissing:
            self.report(warning(f"data file '{data}' does not exist (yet); planc run will need "
                                f"it", span))
        except DataError as exc:
            return self._reject(str(exc), span)
        return resolved


# Larger data files are scanned by planc run, which has torch to do it at GB/s; check
# stays fast (pure Python scans tens of MB/s).
DATA_SCAN_LIMIT = 16 << 20


def _layers_text(first: int, last: int) -> str:
    return f"layers {first}..{last} are" if last > first else f"layer {first} is"


def _even_chunks(layers: int, chunks: int) -> tuple[tuple[int, int], ...]:
    """Contiguous layer ranges, as even as possible, earlier chunks taking the remainder."""
    base, extra = divmod(layers, chunks)
    ranges, first = [], 0
    for c in range(chunks):
        count = base + (1 if c < extra else 0)
        ranges.append((first, first + count - 1))
        first += count
    return tuple(ranges)
