"""The checker's rules for the keys of ``optimize { }`` (docs/language.md): the block
read, the keys that act on one kind of model only or where the mesh lets them, and
``schedule { overlap_all_to_all }``, which overlaps what ``moe_dispatcher`` sends."""

from __future__ import annotations

import dataclasses

from planc.diagnostics import warning
from planc.models import FAMILIES
from planc.plan.optimize import Optimize
from planc.plan.plan import Mesh, Model, Schedule


class OptimizeChecks:
    """A mixin of planc.lang.check's checker (its spans, reports and values)."""

    def _optimize(self) -> Optimize | None:
        keys = ("fuse", "bucket", "route", "overlap", "weight_grad_overlap", "recompute",
                "tp_overlap", "pp_scatter_gather", "grad_accumulation", "kernels",
                "moe_dispatcher", "compile", "recompute_moe_activation",
                "recompute_activation", "recompute_norms")
        if not self.ready(*(f"optimize.{k}" for k in keys)):
            return None
        return Optimize(**{k: self.value(f"optimize.{k}") for k in keys})

    def _scatter_gather(self, mesh: Mesh | None, tensor) -> None:
        """pp_scatter_gather = on, written, where it cannot act: a warning at the key."""
        key = "optimize.pp_scatter_gather"
        if mesh is None or key not in self.given or not self.value(key):
            return
        if mesh.pp == 1 or mesh.tp == 1:
            self.report(warning(f"pp_scatter_gather = on has no effect with tp = {mesh.tp} "
                                f"and pp = {mesh.pp}", self.span(key),
                                "it splits the activation sent between pipeline stages over "
                                "tp; it needs tp > 1 and pp > 1"))
        elif tensor is not None and tensor.sequence_parallel:
            self.report(warning("pp_scatter_gather = on has no effect with "
                                "sequence_parallel = on", self.span(key),
                                "sequence parallelism already sends each tp rank's 1/tp of "
                                "the tokens between stages"))

    def _tp_overlap(self, optimize: Optimize, mesh, model) -> Optimize | None:
        """tp_overlap's rules: a forced chunk count must cut every rank's share of the
        tokens evenly. ``on`` means "wherever there are tp collectives", the default, so
        it is silent with tp = 1 (``planc compile`` notes the pass did nothing); a forced
        count with tp = 1 asks for something that cannot happen, and is warned about."""
        chunks = optimize.tp_overlap
        if "optimize.tp_overlap" not in self.given or chunks is False or chunks is True \
                and mesh.tp == 1:
            return optimize
        if mesh.tp == 1:
            self.report(warning(f"tp_overlap = {chunks} has no effect with tp = 1: there "
                                f"is no tp collective to split into chunks",
                                self.span("optimize.tp_overlap"),
                                "set mesh.tp to 2 or more, or remove tp_overlap"))
            return optimize
        tokens = model.seq // mesh.cp
        if chunks is not True and tokens % (mesh.tp * chunks):
            fits = [k for k in range(2, 9) if tokens % (mesh.tp * k) == 0]
            return self._reject(
                f"tp_overlap = {chunks} needs the tokens of a microbatch on each cp rank "
                f"(seq / cp = {tokens}) to divide by tp x chunks = {mesh.tp * chunks}",
                self.span("optimize.tp_overlap"),
                (f"use tp_overlap = {fits[0]}" if fits else "use tp_overlap = off") +
                ", or on to let the cost model choose")
        return optimize

    def _overlap_all_to_all(self, schedule: Schedule, optimize: Optimize, mesh, model
                            ) -> Schedule | None:
        """overlap_all_to_all's rules: it cuts a mixture of experts at the all-to-alls
        over ep (planc.passes.split_dispatch), so without them it does nothing (a mixture
        recomputed whole, recompute = full, is cut as its forward was)."""
        key = "schedule.overlap_all_to_all"
        if optimize.moe_dispatcher == "two_hop" and mesh.ep == 1:
            self.report(warning("moe_dispatcher = two_hop has no effect without experts "
                                "spread over ep: there is nothing to dispatch",
                                self.span("optimize.moe_dispatcher"),
                                "set mesh.ep to 2 or more on a model moe, or remove "
                                "moe_dispatcher"))
        if not schedule.overlap_all_to_all:
            return schedule
        if mesh.ep == 1:  # (ep > 1 on a family without experts is refused above)
            self.report(warning("overlap_all_to_all = on has no effect without experts "
                                "spread over ep: there is no all-to-all to overlap",
                                self.span(key),
                                "set mesh.ep to 2 or more on a model moe, or remove "
                                "overlap_all_to_all"))
            return dataclasses.replace(schedule, overlap_all_to_all=False)
        return schedule

    def _model_options(self, optimize: Optimize, model: Model, mesh, tensor) -> None:
        """The keys of ``optimize`` that do nothing on this model (``tensor``: the plan's
        shard { tp } settings, or None)."""
        if optimize.compile and not FAMILIES[model.family].module_kernels:
            self.report(warning(f"compile = on has no effect on the {model.family} family: "
                                f"its norms and activations are one kernel each already",
                                self.span("optimize.compile")))
        if optimize.recompute_moe_activation:
            self._moe_activation(optimize, model)
        if optimize.recompute_activation:
            self._dense_activation(optimize, model)
        if optimize.recompute_norms:
            self._norms(optimize, model, mesh, tensor)

    def _moe_activation(self, optimize: Optimize, model: Model) -> None:
        """recompute_moe_activation = on where no mixture keeps the SwiGLU's product."""
        why = None
        if "experts" not in FAMILIES[model.family].keys:
            why = f"model {model.family} has no experts"
        elif model.options.get("first_dense", 0) >= model.layers:
            why = f"every block is dense (first_dense = {model.layers})"
        elif optimize.recompute == "full":
            why = "recompute = full keeps only each block's input"
        elif model.options.get("fp8") is not None:
            why = "FP8 experts keep gate and up and compute the product again already"
        if why is not None:
            self.report(warning(f"recompute_moe_activation = on has no effect: {why}",
                                self.span("optimize.recompute_moe_activation")))

    def _dense_activation(self, optimize: Optimize, model: Model) -> None:
        """recompute_activation = on where no dense MLP keeps its activation's output."""
        why = None
        if model.options.get("experts") and not model.options.get("first_dense", 0):
            why = "every block is a mixture (first_dense = 0)"
        elif optimize.recompute == "full":
            why = "recompute = full keeps only each block's input"
        elif model.options.get("fp8") is not None:
            why = "FP8 down projections keep FP8 codes of their input"
        if why is not None:
            self.report(warning(f"recompute_activation = on has no effect: {why}",
                                self.span("optimize.recompute_activation")))

    def _norms(self, optimize: Optimize, model: Model, mesh, tensor) -> None:
        """recompute_norms = on where no GEMM keeps a norm's output
        (planc.models.recomputes_norms says where it does)."""
        why = None
        if not FAMILIES[model.family].norms_made_again:
            made_again = [name for name, family in FAMILIES.items() if family.norms_made_again]
            why = f"planc makes the norms again for {' and '.join(made_again)} " \
                  f"models, not {model.family}"
        elif optimize.recompute in ("full", "attention_inputs"):
            why = f"recompute = {optimize.recompute} keeps no norm's output"
        elif model.options.get("fp8") is not None:
            why = "FP8 GEMMs keep FP8 codes of their input"
        elif mesh and mesh.tp > 1 and tensor is not None and tensor.sequence_parallel:
            why = "under sequence parallelism the GEMMs keep the norms' outputs gathered " \
                  "over tp"
        if why is not None:
            self.report(warning(f"recompute_norms = on has no effect: {why}",
                                self.span("optimize.recompute_norms")))
