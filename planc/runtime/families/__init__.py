"""The kernels of each model family: one module per family of planc.models, named after
it (``planc.runtime.families.NAME``), holding ``KERNELS`` and ``reference_loss``, the
family's whole-model loss for the single-process reference (planc.runtime.oracle.reference);
beside them, parts one family's module uses (moe_gate: the mixture's routing) or every
family's kernels share (loss: the cross-entropy, differentiated by hand; recomputed_output:
outputs made again in the backward)."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Callable

from planc.graph.vocabulary import Op


def family_module(name: str) -> ModuleType:
    """The runtime module of family ``name``, found by its name."""
    return importlib.import_module(f"planc.runtime.families.{name}")


def family_formulas(name: str) -> dict[str, Callable]:
    """Name -> the pure tensor function of an elementwise kernel that ``optimize {
    compile = on }`` hands to torch.compile (``FORMULAS``; none for a family without)."""
    return getattr(family_module(name), "FORMULAS", {})


def family_kernels(name: str) -> dict[Op, Callable]:
    """Operator -> kernel ``(kernels, spec, inputs, param, step, microbatch, extra)``."""
    return family_module(name).KERNELS
