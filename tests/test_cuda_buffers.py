"""A CUDA rank keeps each freed buffer from the caching allocator until the stream that
last reads it has finished (torch.Tensor.record_stream): every tensor the buffer holds,
not only a buffer that is one tensor. A backward step's gradients by port (a dict) and a
mixture's Routed rows with their two-hop Hops were handed back at once, so that the
compute stream could overwrite a gradient a communication stream was still copying
(planc.runtime.engine.executor.tensors_in). Runs on CPU: the walk is the same."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from planc.runtime.engine.executor import tensors_in  # noqa: E402
from planc.runtime.families.moe_dispatch import Routed  # noqa: E402
from planc.runtime.families.moe_two_hop import Hop, Hops  # noqa: E402


def test_every_tensor_of_a_buffer_is_found():
    made = []

    def tensor():
        made.append(torch.zeros(2))
        return made[-1]

    gradients = {"x": tensor(), "skip": tensor(), "kv": None}
    assert [id(t) for t in tensors_in(gradients)] == [id(t) for t in made]
    made.clear()
    hop = Hop(group=object(), local=False)
    values = {f.name: (tensor() if "Tensor" in str(f.type) else
                       hop if f.type == "Hop" else (1, 2))
              for f in dataclasses.fields(Hops)}
    hops = Hops(**values)
    routed = Routed(rows=tensor(), counts=tensor(), tokens=tensor(), shape=(2, 3),
                    experts=tensor(), hops=hops)
    found = {id(t) for t in tensors_in([routed, (tensor(),)])}
    assert found == {id(t) for t in made} and len(made) == 4 + 7 + 1
    assert list(tensors_in(torch.ones(1))) and not list(tensors_in(None))


NO_NUMBER_MID_STEP = """
import json, sys, threading
import torch
import planc.runtime.worker as worker
from planc.runtime.engine.executor import CpuExecutor
from planc.runtime.engine.interpreter import StepState

reads, where = [], threading.local()
number, item = torch.Tensor.__float__, torch.Tensor.item

def counted(original):
    def read(self, *args):
        if getattr(run_step, "active", False) and not getattr(where, "settling", False):
            reads.append(tuple(self.shape))
        return original(self, *args)
    return read

torch.Tensor.__float__, torch.Tensor.item = counted(number), counted(item)
settle, run = StepState.settle, CpuExecutor.run_step

def settling(self):
    where.settling = True
    try:
        return settle(self)
    finally:
        where.settling = False

def run_step(self, step):
    run_step.active = True
    try:
        return run(self, step)
    finally:
        run_step.active = False

StepState.settle, CpuExecutor.run_step = settling, run_step
status = worker.main([sys.argv[1], "--steps", "2"])
print(json.dumps({"status": status, "reads": reads}))
"""


def test_a_step_reads_no_number_off_a_tensor_before_it_ends(tmp_path):
    """The loss, the clipped gradient norm and a mixture's imbalance stay tensors until the
    step has ended: on a CUDA rank, one host thread issues every stream, and a number read
    mid-step (the loss's all-reduce came between the forward and the backward) would stop
    it until the device caught up."""
    from conftest import one_rank_printed, run_one_rank

    plan = """plan one {
  model moe { layers = 2; hidden = 32; heads = 4; kv_heads = 2; vocab = 64; seq = 8; batch = 4
              experts = 4; top_k = 2; expert_ffn = 16; bias_update = 0.001 }
  mesh { }
  train { steps = 2; optimizer = adamw(lr = 1e-3); grad_clip = 1.0; seed = 0 }
}
"""
    seen = one_rank_printed(run_one_rank(NO_NUMBER_MID_STEP, tmp_path, plan_text=plan))
    assert seen == {"status": 0, "reads": []}


def test_a_parameter_is_cast_to_the_models_dtype_once_a_step():
    """A bf16 model's forwards read one bf16 copy of each parameter for the whole step (the
    parameters change only at its end): a cast in every forward was a copy of the
    weights that autograd kept for every microbatch in flight (a gpipe plan of 4
    microbatches held 58 MiB more, bench/memory_live.py's way), except a table only looked
    up, whose backward keeps none. An fp32 model reads the parameter itself."""
    import torch

    from planc.runtime.engine.interpreter import Interpreter, StepState

    weight = torch.randn(8, 4)
    interpreter = object.__new__(Interpreter)
    interpreter.store = SimpleNamespace(param=lambda name: weight)
    interpreter.ctx = SimpleNamespace(dtype=torch.bfloat16)
    state = StepState(0)
    first = interpreter._in_dtype(state, "w")
    assert first.dtype == torch.bfloat16 and torch.equal(first, weight.to(torch.bfloat16))
    assert interpreter._in_dtype(state, "w") is first  # the next microbatch's forward
    assert interpreter._in_dtype(StepState(1), "w") is not first  # the next step's
    # a table only looked up (the embedding): cast by its forward, and freed with it
    assert interpreter._in_dtype(state, "w", kept=False) is weight
    assert state.settle().casts == {}  # the step's result outlives it, not its copies
    interpreter.ctx = SimpleNamespace(dtype=torch.float32)
    assert interpreter._in_dtype(StepState(2), "w") is weight
