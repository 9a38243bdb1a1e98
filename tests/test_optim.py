"""planc's optimizers against torch.optim's AdamW and SGD classes: the rank's bucket
optimizer against their fused form, the reference's against their default one; the same
parameters and state, bit for bit, over steps with a changing lr and after a resumed
state, and without importing torch._dynamo (which torch.optim's Optimizer class does)."""

import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from planc.plan.plan import Optimizer  # noqa: E402
from planc.runtime.engine.optim import BucketOptimizer, TensorOptimizer  # noqa: E402

SETTINGS = [
    Optimizer(name="adamw", lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1),
    Optimizer(name="adamw", lr=1e-2, betas=(0.8, 0.999), eps=1e-6, weight_decay=0.0),
    Optimizer(name="sgd", lr=0.05, momentum=0.9, weight_decay=0.01),
    Optimizer(name="sgd", lr=0.05, momentum=0.0, weight_decay=0.0),
]


def _torch_optimizer(settings, tensors, fused):
    if settings.name == "adamw":
        return torch.optim.AdamW(tensors, lr=settings.lr, betas=settings.betas,
                                 eps=settings.eps, weight_decay=settings.weight_decay,
                                 fused=fused)
    return torch.optim.SGD(tensors, lr=settings.lr, momentum=settings.momentum,
                           weight_decay=settings.weight_decay, fused=fused)


def _torch_fused(settings, tensor):
    return _torch_optimizer(settings, [tensor], True)


def _gradients(steps, size, seed):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(size, generator=generator) for _ in range(steps)]


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: f"{s.name}-{s.lr}")
def test_the_bucket_optimizer_is_torchs_fused_optimizer_to_the_bit(settings):
    start = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    ours, theirs = start.clone(), start.clone()
    mine, reference = BucketOptimizer(settings, ours), _torch_fused(settings, theirs)
    for step, grad in enumerate(_gradients(6, 1000, 2)):
        lr = settings.lr * (step + 1) / 6  # a warm-up, set before each step
        mine.lr = lr
        for group in reference.param_groups:
            group["lr"] = lr
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        mine.step()
        reference.step()
        assert torch.equal(ours, theirs), step
    kept = reference.state[theirs]
    assert sorted(mine.state) == sorted(kept)
    for key, value in kept.items():
        assert mine.state[key].dtype == value.dtype, key
        assert torch.equal(mine.state[key], value), key


@pytest.mark.parametrize("settings", SETTINGS[::2], ids=lambda s: s.name)
def test_a_resumed_state_continues_as_torch_continues_it(settings):
    """State put in before the first step (as a checkpoint's load does) is used, not
    replaced: the momentum buffer is not started again, the step count goes on."""
    start = torch.randn(64, generator=torch.Generator().manual_seed(3))
    ours, theirs = start.clone(), start.clone()
    reference = _torch_fused(settings, theirs)
    grads = _gradients(4, 64, 4)
    for grad in grads[:2]:
        theirs.grad = grad.clone()
        reference.step()
    mine = BucketOptimizer(settings, ours)
    ours.copy_(theirs)
    mine.state = {key: value.clone() for key, value in reference.state[theirs].items()}
    for grad in grads[2:]:
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        mine.step()
        reference.step()
    assert torch.equal(ours, theirs)
    if settings.name == "adamw":
        assert float(mine.state["step"]) == 4.0


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: f"{s.name}-{s.lr}")
def test_the_reference_optimizer_is_torchs_default_optimizer_to_the_bit(settings):
    """Several tensors, one of them without a gradient in a step (left alone, as torch
    leaves it)."""
    generator = torch.Generator().manual_seed(5)
    starts = [torch.randn(shape, generator=generator) for shape in ((7, 3), (11,), (2, 5))]
    ours, theirs = [t.clone() for t in starts], [t.clone() for t in starts]
    mine = TensorOptimizer(settings, ours)
    reference = _torch_optimizer(settings, theirs, None)
    for step in range(5):
        mine.zero_grad()
        reference.zero_grad()
        for index, (a, b) in enumerate(zip(ours, theirs)):
            if step == 2 and index == 1:
                continue  # no gradient this step
            grad = torch.randn(a.shape, generator=generator)
            a.grad, b.grad = grad.clone(), grad.clone()
        mine.lr = reference.param_groups[0]["lr"] = settings.lr / (step + 1)
        mine.step()
        reference.step()
        for a, b in zip(ours, theirs):
            assert torch.equal(a, b), step
    for state, tensor in zip(mine.states, theirs):
        kept = reference.state[tensor]
        assert sorted(state) == sorted(kept)
        for key, value in kept.items():
            assert state[key].dtype == value.dtype and state[key].device == value.device
            assert torch.equal(state[key], value), key


def test_an_update_does_not_import_torch_dynamo():
    """What a rank's first step imports: torch.optim's Optimizer would add torch._dynamo,
    seconds of CPU in every rank (planc/runtime/engine/optim.py)."""
    code = ("import sys, torch\n"
            "from planc.plan.plan import Optimizer\n"
            "from planc.runtime.engine.optim import BucketOptimizer, TensorOptimizer\n"
            "for name in ('adamw', 'sgd'):\n"
            "    for make in (lambda s, t: BucketOptimizer(s, t),\n"
            "                 lambda s, t: TensorOptimizer(s, [t])):\n"
            "        tensor = torch.ones(4)\n"
            "        tensor.grad = torch.ones(4)\n"
            "        make(Optimizer(name=name, momentum=0.9), tensor).step()\n"
            "print(sorted(m for m in sys.modules if m.startswith('torch._dynamo')))\n")
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert ran.stdout.strip() == "[]"
