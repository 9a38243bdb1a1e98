"""The checker's rules for keys of ``optimize { }`` that act on one kind of model only
(docs/language.md)."""

from __future__ import annotations

from planc.diagnostics import warning
from planc.models import FAMILIES
from planc.plan.plan import Model, Optimize


class OptimizeChecks:
    """A mixin of planc.lang.check's checker (its spans and reports)."""

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
