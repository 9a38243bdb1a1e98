"""The cross-entropy planc differentiates by hand (planc.runtime.families.loss) against
PyTorch's ``F.cross_entropy`` and autograd, on the same logits."""

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from planc.runtime.families.loss import cross_entropy_grad, cross_entropy_sum  # noqa: E402


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_elements", [50, 7 * 50, 1 << 22])
def test_the_vocabulary_parallel_normaliser_is_the_sum_of_shifted_exponentials(
        dtype, chunk_elements):
    """sum(exp(logit - max)) per token, a chunk of tokens at a time (one token, 7 and 3
    left over, all 51 at once): the same bits as the formula on the whole fp32 logits,
    and torch's logsumexp within rounding."""
    from planc.runtime.families.loss import sum_exp_shifted

    logits, _ = _logits(3)
    logits = logits.to(dtype)
    shift = logits.float().amax(-1) + 0.5  # the max over tp ranks is at least the local
    sums = sum_exp_shifted(logits, shift, chunk_elements)
    assert sums.dtype == torch.float32 and sums.shape == shift.shape
    assert torch.equal(sums, (logits.float() - shift.unsqueeze(-1)).exp().sum(-1))
    torch.testing.assert_close(sums, (torch.logsumexp(logits.float(), -1) - shift).exp(),
                               rtol=1e-6, atol=0)


def test_the_vocabulary_parallel_normaliser_holds_one_chunk_beside_the_logits():
    """Every tensor the normaliser makes is at most one chunk of fp32 rows, or its
    per-token output: no copy of the logits' size (``torch.logsumexp`` makes two, and
    casting 16-bit logits to fp32 a third)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from planc.runtime.families.loss import sum_exp_shifted

    logits = torch.randn(64, 8, 1000).to(torch.bfloat16)  # 512 tokens
    shift = logits.float().amax(-1)
    known = {logits.untyped_storage().data_ptr(), shift.untyped_storage().data_ptr()}
    made = {}  # storage -> (operator, bytes): the storages the call allocates

    class Allocations(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                storage = t.untyped_storage()
                if storage.data_ptr() not in known:
                    made.setdefault(storage.data_ptr(), (str(func), storage.nbytes()))
            return out

    with Allocations():
        sums = sum_exp_shifted(logits, shift, chunk_elements=16 * 1000)
    # the chunk (16 tokens of the vocabulary, fp32) and the per-token sums
    assert sorted(nbytes for _, nbytes in made.values()) == [512 * 4, 16 * 1000 * 4], made
    assert torch.equal(sums, (logits.float() - shift.unsqueeze(-1)).exp().sum(-1))


VOCAB_PARALLEL = """plan vocab_parallel {
  model llama { layers = 2; hidden = 64; heads = 4; kv_heads = 2; ffn = 176; vocab = 512;
                seq = 32; batch = 4; dtype = DTYPE }
  mesh { tp = 2 }
  schedule { microbatches = 2 }
  train { steps = 2; optimizer = adamw(lr = 1e-3); seed = 0 }
}
"""

# Each vocabulary-parallel loss backward: whether the fp32 logits its forward kept hold
# the gradient it returns once it ran, and their shapes and dtypes.
IN_PLACE_RANK = """
import json, sys
import torch
import planc.runtime.worker as worker
from planc.runtime.families import loss
backward, seen = loss.loss_backward, []
def noting(ctx, extra):
    logits = extra.get("logits")
    grads = backward(ctx, extra)
    if logits is not None:
        # written over: the kept logits now hold the gradient (in the model's dtype, a
        # cast of them)
        seen.append([torch.equal(logits.to(grads["x"].dtype), grads["x"]),
                     list(logits.shape), str(logits.dtype), str(grads["x"].dtype)])
    return grads
loss.loss_backward = noting
status = worker.main([sys.argv[1], "--steps", "2"])
print(json.dumps({"status": status, "seen": seen}))
"""


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_vocabulary_parallel_gradient_is_written_over_the_logits_it_read(tmp_path, dtype):
    """The loss is the logits' last reader (the program frees them there), so its
    backward computes softmax minus one-hot in their fp32 storage (a 16-bit model's fp32
    copy is the loss's own), not in a second tensor of the logits' size."""
    from conftest import one_rank_printed, run_ranks

    ranks = run_ranks(IN_PLACE_RANK, tmp_path, world=2,
                      plan_text=VOCAB_PARALLEL.replace("DTYPE", dtype))
    for done in ranks:
        seen = one_rank_printed(done)
        assert seen["status"] == 0
        # 2 steps of 2 microbatches, each of 2 sequences of 32 tokens over 256 words a rank
        grad_dtype = "torch.float32" if dtype == "fp32" else "torch.bfloat16"
        assert seen["seen"] == [[True, [2, 32, 256], "torch.float32", grad_dtype]] * 4
