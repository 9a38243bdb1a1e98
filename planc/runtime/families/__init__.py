"""The kernels of each model family: one module per family of planc.models."""

from __future__ import annotations

from typing import Callable

from planc.graph.ir import Op


def family_kernels(name: str) -> dict[Op, Callable]:
    """Operator -> kernel ``(kernels, spec, inputs, param, step, microbatch, extra)``."""
    if name == "llama":
        from planc.runtime.families import llama
        return llama.KERNELS
    from planc.runtime.families import gpt
    return gpt.KERNELS
