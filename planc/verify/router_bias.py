"""Prove that ``model moe { bias_update }`` moves every copy of a balancing bias alike,
once per step, between the step's routing and the next's.

The balancing bias (planc.graph.router_bias) is right when every program of a stage
that holds mixture blocks runs, once per step and in its epilogue (after every block, so
after every forward and recomputed forward that routed with the bias), in this order:
the count of its loads, their all-reduce over the ``stage`` group, the update; each of
the three names the stage's mixture blocks, and the update the plan's ``bias_update``.
A stage without mixture blocks, and a plan without ``bias_update``, runs none of them.
That the all-reduce is the same collective on every rank of the stage is
:meth:`planc.verify.verifier._Verifier.collective_order`'s proof.
"""

from __future__ import annotations

from planc.graph.router_bias import mixture_layers
from planc.program.operands import StepKind
from planc.program.program import Opcode, Program
from planc.verify.report import describe

LOAD, UPDATE = "router_load", "router_bias"


def _role(instruction) -> str | None:
    operands = instruction.operands
    if operands is None:
        return None
    if instruction.op is Opcode.COMPUTE and operands.step is StepKind.ROUTER:
        return "load" if operands.kernel == LOAD else "update"
    if operands.payload == LOAD:
        return "sum"
    return None


class RouterBiasChecks:
    """Mixed into the verifier, which provides ``plan``, ``table`` and ``report``."""

    def router_bias(self, name: str, program: Program) -> None:
        parts: dict[str, list] = {"load": [], "sum": [], "update": []}
        for instruction in program.written():
            role = _role(instruction)
            if role is not None:
                parts[role].append(instruction)
        rate = self.plan.model.options.get("bias_update")
        layers = tuple(mixture_layers(self.plan, program.stage)) if rate is not None else ()
        if not layers:
            found = [i for items in parts.values() for i in items]
            if found:
                why = "the plan sets no bias_update" if rate is None else \
                    f"stage {program.stage} holds no mixture block"
                self.report.add(f"program {name}: {describe(found[0])} works on the "
                                f"balancing bias, but {why}")
            return
        epilogue = [i for i in program.epilogue if not i.per_microbatch]
        for role, what in (("load", "counts the expert loads"),
                           ("sum", "all-reduces the expert loads"),
                           ("update", "updates the balancing bias")):
            found = parts[role]
            if len(found) != 1 or found[0] not in epilogue:
                self.report.add(f"program {name}: {len(found)} instructions {what} once per "
                                f"step in the epilogue; bias_update = {rate:g} needs exactly "
                                f"one, after the step's last forward")
                return
        load, total, update = (parts[r][0] for r in ("load", "sum", "update"))
        at = {id(i): k for k, i in enumerate(epilogue)}
        if not at[id(load)] < at[id(total)] < at[id(update)]:
            self.report.add(f"program {name}: the balancing bias runs {describe(load)}, "
                            f"{describe(total)} and {describe(update)} out of that order")
        for instruction in (load, update):
            if tuple(instruction.operands.router_layers) != layers:
                self.report.add(f"program {name}: {describe(instruction)} names blocks "
                                f"{list(instruction.operands.router_layers)}, the stage's "
                                f"mixture blocks are {list(layers)}")
        if total.operands.group != "stage":
            self.report.add(f"program {name}: {describe(total)} sums the loads over "
                            f"{total.operands.group}, not over the stage")
        if update.operands.bias_update != rate:
            self.report.add(f"program {name}: {describe(update)} moves the bias by "
                            f"{update.operands.bias_update}, the plan by {rate:g}")
