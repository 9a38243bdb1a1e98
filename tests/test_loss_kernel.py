"""The cross-entropy planc differentiates by hand (planc.runtime.engine.kernels) against
PyTorch's ``F.cross_entropy`` and autograd, on the same logits."""

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from planc.runtime.engine.kernels import cross_entropy_grad, cross_entropy_sum  # noqa: E402


def _logits(seed: int, shape=(3, 17, 50)):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(shape, generator=generator, dtype=torch.float32) * 4
    targets = torch.randint(0, shape[-1], shape[:-1], generator=generator)
    return logits, targets


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_loss_is_torchs_summed_cross_entropy_over_the_tokens(seed):
    logits, targets = _logits(seed)
    loss, _ = cross_entropy_sum(logits, targets, 1000)
    expected = F.cross_entropy(logits.reshape(-1, 50), targets.reshape(-1),
                               reduction="sum") / 1000
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_hand_written_gradient_is_autograds(seed):
    logits, targets = _logits(seed)
    leaf = logits.clone().requires_grad_()
    (F.cross_entropy(leaf.reshape(-1, 50), targets.reshape(-1), reduction="sum")
     / 1000).backward()
    _, log_probs = cross_entropy_sum(logits, targets, 1000)
    grad = cross_entropy_grad(log_probs, targets, 1000)
    torch.testing.assert_close(grad, leaf.grad, rtol=1e-5, atol=1e-9)
    # every token's gradient sums to zero: softmax sums to one, the one-hot to one
    assert grad.sum(-1).abs().max().item() < 1e-9


def test_a_repeated_target_gets_one_one_hot_per_token():
    logits = torch.zeros(1, 2, 4)
    targets = torch.tensor([[3, 3]])
    _, log_probs = cross_entropy_sum(logits, targets, 2)
    grad = cross_entropy_grad(log_probs, targets, 2)
    # softmax of equal logits is 1/4 each; / 2 tokens; the target loses 1/2
    expected = torch.tensor([[[0.125, 0.125, 0.125, -0.375]] * 2])
    assert torch.equal(grad, expected)
