"""Syntax tree to validated :class:`~planc.plan.plan.Plan`: every rule of the language spec.

Two passes. The first reads each block against :mod:`planc.lang.schema` (unknown and
duplicate keys, types, units, expressions). The second checks what holds across
keys and blocks: the world size against the topology, every divisibility the
sharding needs, pipeline stages, schedules and tied embeddings, and the rules of the
model's family (planc.models). Every problem found is reported; a Plan is returned only
when there is no error.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass

from planc.diagnostics import Diagnostic, error, warning
from planc.vocabulary import ast
from planc.lang.blocks import BlockReader
from planc.vocabulary.hints import divisors_below, largest_divisors
from planc.vocabulary.hints import try_values as _try
from planc.lang.lr_kinds import findings as schedule_findings
from planc.lang.overrides import Override
from planc.lang.overrides import apply as apply_overrides
from planc.lang.schema import join_words, plan_schema
from planc.lang.stages_check import (StageProblem, auto_chunks, explicit_chunks,
                                     explicit_problems, microbatch_choices)
from planc.lang.topology_check import MAX_TOPOLOGY_BYTES, TopologyReader
from planc.plan.mesh import AXES
from planc.models import DEFAULT_FAMILY, FAMILIES
from planc.plan.plan import (LIMITS, ContextParallel, Mesh, Model, Optimizer,
                        PipelineParallel, Plan, Schedule, Shard, Sources, TensorParallel, Train)
from planc.schedules import PipelineShape
from planc.lang.data_check import DATA_SCAN_LIMIT, DataChecks
from planc.lang.dp_check import DataParallelChecks
from planc.lang.optimize_check import OptimizeChecks
from planc.schedules import named as schedule_named
from planc.schedules import problems as schedule_problems

__all__ = ["DATA_SCAN_LIMIT", "LIMITS", "LIMIT_REASONS", "MAX_TOPOLOGY_BYTES", "BlockReader",
           "check", "divisors_below", "largest_divisors"]


def check(tree: ast.PlanFile, path: str, overrides: Sequence[Override] = ()
          ) -> tuple[Plan | None, list[Diagnostic]]:
    """Validate a parsed file, with ``overrides`` applied (``--set``) and recorded in the
    plan's sources. ``path`` names the file in the plan and locates data files. The
    diagnostics come in the order found (planc.lang.load_text sorts them)."""
    checker = _Checker(path, overrides=tuple(o.text for o in overrides))
    plan = checker.run(apply_overrides(tree, overrides) if overrides else tree)
    return plan, checker.diagnostics


# planc's limits (docs/language.md, section 5): far beyond any model or cluster that
# exists, and small enough that compile, programs, verify and graph finish in seconds on
# every plan check accepts (tests/test_limits.py compiles a plan at each one). The work
# each bounds grows linearly with what it counts. pp x virtual is at most layers + 2: each
# model chunk needs a layer, bar an embedding-only first and a head-only last chunk.
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


@dataclass
class _Checker(DataChecks, DataParallelChecks, OptimizeChecks, TopologyReader):
    """Pass 2, the rules across keys and blocks. Pass 1 is BlockReader's
    (:mod:`planc.lang.blocks`), the topology TopologyReader's; a model family's own rules
    are its description's (Family.model_checks, Family.tensor_parallel_checks)."""

    plan_name: str = ""
    overrides: tuple[str, ...] = ()  # the --set KEY=VALUE texts applied, for Sources

    def run(self, tree: ast.PlanFile) -> Plan | None:
        self.spans["plan"] = tree.name_span
        self.plan_name = tree.name
        if "-" in tree.name:
            self.report(error(f"plan name '{tree.name}' may hold only letters, digits and '_'",
                              tree.name_span, f"write plan {tree.name.replace('-', '_')}"))
        self._read_block(plan_schema(), tree.entries, "", tree.name_span)
        plan = self._build()
        return plan if not any(d.is_error for d in self.diagnostics) else None

    # --- pass 2: rules across keys ----------------------------------------------------

    def _build(self) -> Plan | None:
        model = self._model()
        mesh = self._mesh()
        topology = self._topology(mesh, model)
        tensor = self._tensor_parallel(mesh, model)
        context = self._context_parallel(mesh, model)
        if mesh is not None and model is not None:
            self._family_mesh(mesh, model)
        schedule = self._schedule(mesh, model)
        pipeline = self._pipeline(mesh, model, schedule)
        self._tied_embeddings(mesh, model, tensor)
        data_parallel = self._data_parallel(mesh, model)
        optimize = self._optimize()
        if optimize is not None and model is not None:
            self._model_options(optimize, model, mesh, tensor)
        if optimize is not None and mesh and model:
            optimize = self._tp_overlap(optimize, mesh, model)
        if schedule is not None and optimize is not None and mesh and model:
            schedule = self._overlap_all_to_all(schedule, optimize, mesh, model)
        self._scatter_gather(mesh, tensor)
        train = self._train(model)
        parts = (model, mesh, topology, tensor, context, pipeline, data_parallel, schedule,
                 optimize, train)
        if any(part is None for part in parts):
            return None
        return Plan(name=self.plan_name, model=model, mesh=mesh, topology=topology,
                    shard=Shard(tensor, context, pipeline, data_parallel),
                    schedule=schedule, optimize=optimize, train=train,
                    sources=Sources(self.path, dict(self.spans), self.overrides))

    def _model(self) -> Model | None:
        family = FAMILIES[self.labels.get("model", DEFAULT_FAMILY)]
        keys = tuple(k for k in family.keys if k != "preset")
        # An optional key unset is no error; one given must have been read.
        needed = tuple(k for k in keys if not family.keys[k].optional
                       or f"model.{k}" in self.spans)
        preset_failed = "model.preset" in self.spans and self.values.get("model.preset") is None
        if family.presets and "model" in self.given and not preset_failed:
            # A family with presets: a key neither given nor in the preset is missing.
            for key in needed:
                if self.values.get(f"model.{key}") is None and \
                        f"model.{key}" not in self.spans and key != "batch":
                    self.report(error(f"model {family.name} is missing the key '{key}'",
                                      self.span("model"),
                                      f"add {key} = ..., or a preset = "
                                      f"{' | '.join(family.presets)} that sets it"))
        if not self.ready(*(f"model.{k}" for k in needed)):
            return None
        model = Model.of(family.name, {k: self.value(f"model.{k}") for k in keys
                                       if self.value(f"model.{k}") is not None})
        if model.layers > LIMITS["layers"]:
            return self._reject(_over_limit(f"layers ({model.layers})", "layers"),
                                self.span("model.layers"))
        # Heads hidden / heads wide need hidden to divide; a head_dim given sets their width.
        if "head_dim" not in model.options and model.hidden % model.heads:
            candidates = largest_divisors(model.hidden, model.heads)
            self.report(error(f"hidden ({model.hidden}) must divide by heads ({model.heads})",
                              self.span("model.heads"),
                              f"heads must divide hidden; {_try('heads', candidates)}"))
            return None
        for rule in family.model_checks:  # the family's own rules, in its order
            found = rule(model)
            if found is not None:
                return self._reject(found.message, self.span(*found.keys), found.hint or None)
        return model

    def _family_mesh(self, mesh: Mesh, model: Model) -> None:
        family = FAMILIES[model.family]
        if mesh.ep > 1 and "experts" not in family.keys:
            self._reject(f"ep ({mesh.ep}) spreads a model's experts over ranks; model "
                         f"{family.name} has none", self.span("mesh.ep"),
                         "remove ep, or describe a mixture of experts (model moe)")
            return
        for rule in family.mesh_checks:  # the family's own, in its order
            found = rule(model, mesh)
            if found is not None:
                self._reject(found.message, self.span(*found.keys), found.hint or None)
                return
        if mesh.ep > 1 and model.options.get("first_dense", 0) >= model.layers:
            self.report(warning(f"ep = {mesh.ep} has no effect: every block is dense "
                                f"(first_dense = {model.layers}), so no expert is spread",
                                self.span("mesh.ep"), "remove ep, or lower first_dense"))

    def _mesh(self) -> Mesh | None:
        keys = (*AXES, "order", "ep")
        if not self.ready(*(f"mesh.{k}" for k in keys)):
            return None
        mesh = Mesh(**{k: self.value(f"mesh.{k}") for k in keys})
        if mesh.world > LIMITS["world"]:
            largest = max(AXES, key=mesh.size)
            return self._reject(f"the mesh has {mesh.world} ranks, more than planc's limit of "
                                f"{LIMITS['world']}: {LIMIT_REASONS['world']}",
                                self.span(f"mesh.{largest}"))
        return mesh

    def _tensor_parallel(self, mesh: Mesh | None, model: Model | None) -> TensorParallel | None:
        keys = tuple(f.name for f in dataclasses.fields(TensorParallel))
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
        if "shard.tp.gathered_inputs" in self.given and not tensor.sequence_parallel:
            self.report(warning(f"gathered_inputs = {tensor.gathered_inputs} has no effect "
                                f"without sequence_parallel = on",
                                self.span("shard.tp.gathered_inputs"),
                                "only sequence parallelism gathers a GEMM's input over tp"))
        elif tensor.gathered_inputs == "regather" and model.options.get("fp8") is not None:
            self.report(warning("gathered_inputs = regather has no effect with fp8: the FP8 "
                                "GEMMs keep FP8 codes of their whole input for the weight "
                                "gradient", self.span("shard.tp.gathered_inputs")))
        for rule in family.tensor_parallel_checks:  # the family's own rules, in its order
            found = rule(model, tensor, mesh)
            if found is not None:
                return self._reject(found.message, self.span(*found.keys), found.hint or None)
        needs: dict[str, int] = {}  # model key -> its value, which tp must divide
        for key, slot, placement in family.tensor_parallel_splits:
            if getattr(tensor, slot) == placement:
                needs.setdefault(key, getattr(model, key))
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
        if not self.ready("schedule.microbatches", "schedule.pipeline",
                          "schedule.overlap_all_to_all"):
            return None
        schedule = Schedule(self.value("schedule.microbatches"), self.value("schedule.pipeline"),
                            bool(self.value("schedule.overlap_all_to_all")))
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
                              + _try("microbatches", microbatch_choices(
                                  per_rank, schedule.microbatches, schedule.pipeline, mesh.pp,
                                  self.value("shard.pp.virtual") or 1, model.layers))))
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
        placement = schedule_named(schedule.pipeline).placement
        if stages == "auto":
            if not ok:
                return None
            chunks = auto_chunks(layers, pp, virtual, placement)
            problems = [chunks] if isinstance(chunks, StageProblem) else []
        else:
            problems = explicit_problems(stages, layers, pp, virtual, placement)
            chunks = explicit_chunks(stages, layers)
        for problem in problems:
            span = problem.span or self.span("mesh.pp" if problem.at_mesh else "shard.pp.stages")
            ok = self._fail(problem.message, span, problem.hint)
        return PipelineParallel(chunks, virtual, stages == "auto") if ok else None

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

    def _train(self, model: Model | None) -> Train | None:
        # grad_clip's default is None (off): not a key that must have a value
        keys = ("steps", "optimizer", "seed", "data", "eval_every", "eval_batches", "eval_data",
                "lr_schedule", "shuffle")
        if not self.ready(*(f"train.{k}" for k in keys)):
            return None
        if "train.init" in self.given and not self.ready("train.init"):  # None: not given
            return None
        spec = self.value("train.optimizer")
        data = self.value("train.data")
        schedule = self.value("train.lr_schedule")
        for message, span, hint in schedule_findings(schedule, spec.arguments["lr"],
                                                     self.value("train.steps")):
            self._reject(message, span, hint)
        if data == "synthetic" and self.value("train.shuffle"):
            self.report(warning("shuffle = on changes nothing with data = synthetic: each "
                                "step's batch is drawn from the seed and the step alone",
                                self.span("train.shuffle"), "remove shuffle, or name a "
                                "token file in data"))
        if data != "synthetic":
            data = self._data_file(data, model)
            if data is None:
                return None
        # the evaluation reads the training data unless eval_data says otherwise
        eval_data = self.value("train.eval_data") if "train.eval_data" in self.spans \
            else data
        if not self.value("train.eval_every"):
            eval_data = "synthetic"  # nothing evaluates: the default, as plan.json omits it
        if eval_data != "synthetic" and eval_data != data:
            eval_data = self._data_file(eval_data, model, "train.eval_data")
            if eval_data is None:
                return None
        init, form = self.value("train.init"), None
        if init is not None:
            init, form = self._init_directory(init, model) or (None, None)
            if init is None or data != "synthetic" and not self._cut_by(data, init):
                return None
        return Train(self.value("train.steps"), Optimizer(name=spec.name, **spec.arguments),
                     self.value("train.seed"), data, eval_every=self.value("train.eval_every"),
                     eval_batches=self.value("train.eval_batches"), eval_data=eval_data,
                     grad_clip=self.value("train.grad_clip"), lr_schedule=schedule.schedule,
                     shuffle=self.value("train.shuffle"), init=init, init_form=form)

    def _init_directory(self, init: str, model: Model | None) -> tuple[str, str] | None:
        """The Hugging Face checkpoint to start from, relative to the plan's directory as
        ``data`` is, checked against the model (planc.hf.init), and how its
        tensors are named."""
        from planc.hf.init import HFCheckpointError, check_init

        base = os.path.dirname(os.path.abspath(self.path)) if self.path else os.getcwd()
        resolved = os.path.normpath(os.path.join(base, init))
        if model is None:
            return None
        try:
            return resolved, check_init(resolved, model)
        except HFCheckpointError as exc:
            return self._reject(f"init: {exc}", self.span("train.init"),
                                "init names a directory saved by transformers' "
                                "save_pretrained(safe_serialization=True) of the plan's model")
