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


def test_a_forward_step_keeps_where_its_output_enters_the_graph_not_its_values():
    """A step's backward needs the edge its output's gradient enters autograd's graph by
    and the output's dtype: the values are freed once nothing else holds them (the
    logits, once the loss has read them), and the backward computes what it did."""
    import gc
    import weakref

    from planc.runtime.engine.kernels import Output, _kept, _vector_jacobian

    weight = torch.randn(8, 32, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True)
    logits = x @ weight
    kept, values = _kept(logits), weakref.ref(logits)
    assert isinstance(kept, Output) and kept.dtype == torch.float32
    grad = torch.randn(4, 32)
    expected = torch.autograd.grad(x @ weight, (x, weight), grad)
    del logits
    gc.collect()
    assert values() is None
    for got, want in zip(_vector_jacobian((kept.edge,), (grad,), (x, weight), False),
                         expected):
        assert torch.equal(got, want)
    leaf = torch.randn(3, requires_grad=True)
    assert _kept(leaf) is leaf  # no graph behind it: kept as it is


def test_a_residual_sum_keeps_nothing_and_passes_its_gradient_to_both_inputs():
    """The gradient of skip + x is the output's, to each input: a residual sum keeps
    neither input (the two outputs of a block's row-parallel linears, hidden wide, which
    autograd's leaves would hold until the backward), except without a graph, where a
    recomputation takes its inputs from what the forward kept."""
    import functools
    from types import SimpleNamespace

    from planc.graph.vocabulary import Op
    from planc.runtime.engine.kernels import Kernels

    kernels = object.__new__(Kernels)
    kernels.ctx = SimpleNamespace(dtype=torch.float32)
    kernels.forward_table = {Op.MLP_RESIDUAL: functools.partial(Kernels._residual, kernels)}
    spec = SimpleNamespace(op=Op.MLP_RESIDUAL, bias=None, keeps_inputs=None)
    skip, x = torch.randn(2, 3, 4), torch.randn(2, 3, 4)
    out, saved = kernels.forward(spec, {"skip": skip, "x": x}, {}, 0, 0, keep_graph=True)
    assert torch.equal(out, skip + x) and saved.inputs == {} and saved.output is None
    grad = torch.randn(2, 3, 4)
    ports, named = kernels.backward(spec, saved, grad)
    assert set(ports) == {"skip", "x"} and named == {}
    assert all(torch.equal(g, grad) for g in ports.values())
    assert kernels.backward(spec, saved, grad, inputs=False) == ({}, {})
    _, unrecorded = kernels.forward(spec, {"skip": skip, "x": x}, {}, 0, 0, keep_graph=False)
    assert set(unrecorded.inputs) == {"skip", "x"}


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                         reason="needs a CUDA GPU"))])
@pytest.mark.parametrize("shape", [(3, 17, 50), (2, 64, 8000), (1, 4, 32000)])
def test_the_loss_over_its_logits_in_place_is_the_same_bits(device, shape):
    """The loss written over the logits it was given (a 16-bit model's fp32 copy, or the
    head's fp32 logits, which the program frees after the loss) keeps no second tensor of
    their size, and computes the same bits as into a tensor of its own."""
    logits, targets = _logits(0, shape)
    logits, targets = logits.to(device), targets.to(device)
    expected_loss, expected = cross_entropy_sum(logits, targets, 1000)
    given = logits.clone()
    loss, log_probs = cross_entropy_sum(given, targets, 1000, in_place=True)
    assert log_probs.data_ptr() == given.data_ptr()
    assert torch.equal(loss, expected_loss) and torch.equal(log_probs, expected)
