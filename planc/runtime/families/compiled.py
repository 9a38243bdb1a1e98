"""``optimize { compile = on }``: a family's elementwise formulas through ``torch.compile``.

Each formula (a family's ``FORMULAS``: pure functions of tensors, such as llama's RMSNorm,
SwiGLU and rotary embedding) is compiled once per rank, with static shapes, by inductor,
which fuses each of its passes (forward, backward) into one loop where eager PyTorch
runs an operator, and a pass over memory, per step of the formula (torchtitan and
Megatron-LM's fused kernels do the same). The first call of each shape compiles it, in
the rank's first step; torch keeps the compiled code in its cache for later runs.
Inductor builds CPU code with a C++ compiler and GPU code with Triton: a rank without
one stops with a message before training.
"""

from __future__ import annotations

import importlib.util
import shutil
from typing import Callable

import torch

from planc.runtime.families import family_formulas

# the C++ compilers inductor looks for on Linux (torch._inductor.cpp_builder)
CPP_COMPILERS = ("g++", "c++", "clang++")


def compiled_formulas(family: str, device: torch.device) -> dict[str, Callable]:
    """Name -> the compiled formula, for every formula of ``family``."""
    if device.type == "cuda":
        if importlib.util.find_spec("triton") is None:
            raise SystemExit("planc: error: optimize { compile = on } needs Triton on a GPU "
                             "rank (pip install triton), which this one lacks")
    elif not any(shutil.which(name) for name in CPP_COMPILERS):
        raise SystemExit("planc: error: optimize { compile = on } needs a C++ compiler on a "
                         f"CPU rank ({', '.join(CPP_COMPILERS)} on PATH), which this one "
                         "lacks; install one (Debian: apt-get install g++) or set "
                         "compile = off")
    return {name: torch.compile(formula, dynamic=False)
            for name, formula in family_formulas(family).items()}
