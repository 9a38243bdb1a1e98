"""The rank's bucket optimizer against torch.optim's fused AdamW and SGD: the same
parameters and state, bit for bit, over steps with a changing lr and after a resumed state."""

import pytest

torch = pytest.importorskip("torch")

from planc.plan.plan import Optimizer  # noqa: E402
from planc.runtime.engine.optim import BucketOptimizer  # noqa: E402

SETTINGS = [
    Optimizer(name="adamw", lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1),
    Optimizer(name="adamw", lr=1e-2, betas=(0.8, 0.999), eps=1e-6, weight_decay=0.0),
    Optimizer(name="sgd", lr=0.05, momentum=0.9, weight_decay=0.01),
    Optimizer(name="sgd", lr=0.05, momentum=0.0, weight_decay=0.0),
]


def _torch_fused(settings, tensor):
    if settings.name == "adamw":
        return torch.optim.AdamW([tensor], lr=settings.lr, betas=settings.betas,
                                 eps=settings.eps, weight_decay=settings.weight_decay,
                                 fused=True)
    return torch.optim.SGD([tensor], lr=settings.lr, momentum=settings.momentum,
                           weight_decay=settings.weight_decay, fused=True)


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
