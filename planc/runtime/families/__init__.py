"""The kernels of each model family: one module per family of planc.models, named after
it (``planc.runtime.families.NAME``), holding ``KERNELS``."""

from __future__ import annotations

import importlib
from typing import Callable

from planc.graph.ir import Op


def family_kernels(name: str) -> dict[Op, Callable]:
    """Operator -> kernel ``(kernels, spec, inputs, param, step, microbatch, extra)``."""
    return importlib.import_module(f"planc.runtime.families.{name}").KERNELS
