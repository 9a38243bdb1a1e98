"""The checker's rules for ``shard { dp { } }``: data parallelism and ZeRO, and the keys
that say how a run keeps and reduces its gradients (docs/language.md)."""

from __future__ import annotations

from planc.diagnostics import error, warning
from planc.plan.plan import DataParallel, Mesh, Model

# why grad_reduce = all_reduce needs zero = 1, by zero (2 for 2 and 3)
GRAD_REDUCE_ZERO = {0: "without ZeRO the gradients are all-reduced already",
                    2: "ZeRO-2 and ZeRO-3 keep only a shard of each gradient"}


class DataParallelChecks:
    """A mixin of planc.lang.check's checker (its spans, reports and values)."""

    def _data_parallel(self, mesh: Mesh | None, model: Model | None) -> DataParallel | None:
        """The dp block, with a warning for each key that has no effect on this plan;
        None where a key is in error."""
        zero = self.value("shard.dp.zero")
        if mesh and zero and mesh.dp * mesh.cp == 1 and "shard.dp.zero" in self.given:
            self.report(warning(f"zero = {zero} has no effect with dp = 1 and cp = 1",
                                self.span("shard.dp.zero")))
        fp32_grads = self.value("shard.dp.fp32_grads")
        if model and fp32_grads and model.dtype == "fp32":
            self.report(warning("fp32_grads = on has no effect with dtype = fp32: the "
                                "gradients are fp32 already", self.span("shard.dp.fp32_grads")))
        reduce_dtype = self.value("shard.dp.reduce_dtype")
        if model and reduce_dtype == "fp32" and model.dtype == "fp32":
            self.report(warning("reduce_dtype = fp32 has no effect with dtype = fp32: the "
                                "gradients are fp32 already", self.span("shard.dp.reduce_dtype")))
        grad_reduce = self.value("shard.dp.grad_reduce")
        if grad_reduce == "all_reduce" and zero is not None and zero != 1:
            self.report(error(f"grad_reduce = all_reduce needs zero = 1, not zero = {zero}: "
                              f"{GRAD_REDUCE_ZERO[min(zero, 2)]}",
                              self.span("shard.dp.grad_reduce")))
            return None
        if zero is None or reduce_dtype is None or grad_reduce is None:
            return None
        return DataParallel(zero, bool(fp32_grads), reduce_dtype, grad_reduce)
