"""The checker's rules for keys of ``optimize { }`` that act on one kind of model only
(docs/language.md)."""

from __future__ import annotations

from planc.diagnostics import warning
from planc.models import FAMILIES
from planc.plan.plan import Model, Optimize


class OptimizeChecks:
    """A mixin of planc.lang.check's checker (its spans and reports)."""

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
