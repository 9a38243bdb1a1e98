"""A split backward's weight half starts where the input half left the paths to the
weights (planc.runtime.backward_passes): it multiplies by no weight again, and gives the
bits of one whole backward."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from planc.runtime.backward_passes import input_half, weight_half, weight_splits  # noqa: E402
from planc.runtime.engine.kernels import _vector_jacobian  # noqa: E402
from tests.conftest import counting, most_alive  # noqa: E402

# (an FP8 expert's weight gradient is written into its slice of the stack: mm.out)
GEMMS = (torch.ops.aten.mm.default, torch.ops.aten.mm.out, torch.ops.aten._grouped_mm.default)


def _experts(recipe=None):
    """Three experts of a rank (stacked weights, 16 wide, SwiGLU of 24) on 2, 0 and 3
    rows in expert order, weighted by their scales, as planc runs them; their leaves."""
    from planc.runtime.families.moe_dispatch import Experts, outputs_by_expert

    generator = torch.Generator().manual_seed(7)
    rows = torch.randn(5, 16, generator=generator, requires_grad=True)
    scales = torch.rand(5, 1, generator=generator, requires_grad=True)
    stacked = [torch.randn(3, *shape, generator=generator, requires_grad=True)
               for shape in ((16, 24), (16, 24), (24, 16))]
    grad = torch.randn(5, 16, generator=generator)

    def forward():
        return outputs_by_expert(rows, scales, [2, 0, 3], Experts(*stacked), recipe)

    return forward, [rows, scales], stacked, grad


def _input_half(out, inputs, params, grad, limit=1 << 40):
    """The input half of ``out``'s backward as planc runs it, keeping where its weight
    half starts wherever that takes at most ``limit`` bytes: its gradients, the roots."""
    return input_half(lambda: torch.autograd.grad(out, inputs, grad, retain_graph=True),
                      out.grad_fn, inputs, params, limit)


def _split(forward, inputs, params, grad):
    """The input half keeping where the weight half starts, then that weight half, and
    the GEMMs each runs."""
    out = forward()
    with counting(*GEMMS) as inputs_pass:
        dinputs, roots = _input_half(out, inputs, params, grad)
    assert roots is not None
    with counting(*GEMMS) as weights_pass:
        dparams = weight_half(roots, params, _vector_jacobian)
    return dinputs, dparams, inputs_pass.count, weights_pass.count


def _both_ways(forward, inputs, params, grad) -> tuple[int, int, int]:
    """The GEMMs of the input half, of the weight half from the products, and of a
    weight half from the output gradient; the split halves' gradients are one whole
    backward's, bit for bit."""
    whole = torch.autograd.grad(forward(), inputs + params, grad)
    out = forward()
    torch.autograd.grad(out, inputs, grad, retain_graph=True)
    with counting(*GEMMS) as from_output:
        torch.autograd.grad(out, params, grad)
    dinputs, dparams, inputs_pass, weights_pass = _split(forward, inputs, params, grad)
    assert all(torch.equal(a, b) for a, b in zip(whole, [*dinputs, *dparams]))
    return inputs_pass, weights_pass, from_output.count


@pytest.mark.parametrize("fp8,gemms", [(False, (3, 3, 4)), (True, (4, 4, 6))])
def test_the_experts_weight_half_multiplies_by_no_weight_again(fp8, gemms):
    """Two experts with rows: the input half multiplies by the down weights and by the
    gate's and up's; a weight half from the output gradient would multiply by the down
    weights again to reach the gate's and up's, from the kept roots it computes the
    weights' gradients alone. In the dtype each is one grouped GEMM over the experts (3
    in the input half, 3 from the roots, 4 from the output); in FP8 each expert runs its
    own, gate and up joined (2 an expert, 2, 3). The gradients are one backward's, bit
    for bit."""
    from planc.runtime.engine.fp8 import Recipe

    forward, inputs, params, grad = _experts(Recipe(8) if fp8 else None)
    assert _both_ways(forward, inputs, params, grad) == gemms


def test_a_weight_reached_through_another_weights_product_is_not_split():
    """``(x @ w) @ w``: both products lead to ``w``, one under the other; a weight half
    from both would count the lower one's gradient twice, so the weight half starts at
    the root (None)."""
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(8, 8, requires_grad=True)
    out = (x @ w) @ w
    assert weight_splits(out.grad_fn, [x], [w]) is None


def test_a_linear_has_nothing_to_split():
    """A linear's product is where the paths part: its weight half from the root
    multiplies once, as from the product (None: nothing to keep)."""
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(8, 6, requires_grad=True)
    out = (x @ w).reshape(2, 2, 6) * 2
    assert weight_splits(out.grad_fn, [x], [w]) is None


def test_a_weight_no_input_path_reaches_is_not_split():
    """An output no input reaches (a bias alone): the weight half starts at the root."""
    x = torch.randn(4, 8, requires_grad=True)
    b = torch.randn(8, requires_grad=True)
    out = b * 3
    assert weight_splits(out.grad_fn, [x], [b]) is None


def test_a_group_no_gradient_reached_gets_none():
    """A group of weights whose nodes the input half sent nothing into: no gradient for
    them, and the other groups' as from their nodes."""
    from planc.runtime.backward_passes import WeightRoots

    x = torch.randn(4, 8, requires_grad=True)
    w, unused = torch.randn(8, 6, requires_grad=True), torch.randn(3, requires_grad=True)
    out = x @ w
    grad = torch.randn(4, 6)
    edge = torch.autograd.graph.get_gradient_edge(out)
    found = weight_half(WeightRoots([([], [], [1]), ([edge], [grad], [0])]), [w, unused],
                        _vector_jacobian)
    assert found[1] is None and torch.equal(found[0], x.detach().t() @ grad)


def _latent_heads(heads: int, q_rank: int, kv_rank: int):
    """Multi-head latent attention's q, k and v (planc.runtime.families.deepseek) of 2 x 6
    tokens 32 wide, heads of 16 + 8 rotary features and values 16 wide; its leaves."""
    from types import SimpleNamespace

    from planc.runtime.families.deepseek import latent_heads

    m = SimpleNamespace(nope_dim=16, rope_dim=8, v_dim=16, kv_rank=kv_rank, norm_eps=1e-5,
                        rope_theta=10000.0)
    generator = torch.Generator().manual_seed(3)
    shapes = {"q_a.weight": (32, q_rank), "ln_q.weight": (q_rank,),
              "q_b.weight": (q_rank, heads * 24), "kv_a.weight": (32, kv_rank + 8),
              "ln_kv.weight": (kv_rank,), "kv_b.weight": (kv_rank, heads * 32)}
    weights = {name: torch.randn(*shape, generator=generator, requires_grad=True)
               for name, shape in shapes.items()}
    h = torch.randn(2, 6, 32, generator=generator, requires_grad=True)
    grad = torch.randn(2, 6, heads * 64, generator=generator)

    def forward():
        return latent_heads(m, h, weights.__getitem__, torch.arange(6), None)

    return forward, [h], list(weights.values()), grad


def test_latent_attentions_weight_half_skips_the_up_projections_input_gradients():
    """DeepSeek-V3's proportions (latents a sixteenth of q's heads and a sixty-fourth of
    k's and v's): the gradients at the products hold less than the q, k and v gradient
    they replace (``WeightRoots.bytes``), and the weight half from them multiplies 4
    times (the weights' gradients), where from the output it multiplies 6 (the up
    projections' input gradients again); one backward's bits."""
    forward, inputs, params, grad = _latent_heads(heads=16, q_rank=24, kv_rank=8)
    assert _both_ways(forward, inputs, params, grad) == (4, 4, 6)
    _, roots = _input_half(forward(), inputs, params, grad, limit=grad.nbytes)
    assert roots is not None and roots.bytes() < grad.nbytes


def test_where_the_products_gradients_take_more_the_weight_half_recomputes_them():
    """The H800 miniature's proportions (latents as wide as the heads): the gradients at
    the products hold more than the q, k and v gradient, so planc keeps that gradient
    and the weight half recomputes from it; a rank's experts so too (their gate's and
    up's gradients would be kept beside their output's)."""
    for forward, inputs, params, grad in (_latent_heads(heads=4, q_rank=48, kv_rank=32),
                                          _experts()):
        _, roots = _input_half(forward(), inputs, params, grad)
        assert roots.bytes() > grad.nbytes
        assert _input_half(forward(), inputs, params, grad, limit=grad.nbytes)[1] is None


def test_a_weight_half_from_the_experts_output_gradient_computes_no_routing_gradient():
    """Where the experts' weight half starts from their output gradient (their gate's and
    up's gradients would hold more), it goes back through their SwiGLU for gate's and
    up's gradients alone: the scales' (the routing weights, an input of the step) are
    the input half's, which computes them once. Both halves give one whole backward's
    bits."""
    forward, inputs, params, grad = _experts()
    whole = torch.autograd.grad(forward(), inputs + params, grad)
    out = forward()
    with counting(torch.ops.aten.sum.dim_IntList, torch.ops.aten.mul.Tensor) as input_pass:
        dinputs = torch.autograd.grad(out, inputs, grad, retain_graph=True)
    with counting(torch.ops.aten.sum.dim_IntList, torch.ops.aten.mul.Tensor) as weight_pass:
        dparams = torch.autograd.grad(out, params, grad)
    assert all(torch.equal(a, b) for a, b in zip(whole, [*dinputs, *dparams]))
    # the input half: the scales' gradient (two products and a sum), the weighted
    # gradient and its products with silu(gate) and up; the weight half: the last three
    assert (input_pass.count, weight_pass.count) == (6, 3)


def test_the_experts_swiglu_backward_holds_three_temporaries_at_most():
    """The SwiGLU's backward lets each temporary go once read: beside the gradient it
    is given, at most three of the experts' ffn-wide tensors at once in the input half,
    where all six (silu(gate), the weighted gradient, gate's and up's gradients, the
    scales' two products) were alive together."""
    forward, inputs, params, grad = _experts()
    out = forward()
    assert most_alive((5, 24), lambda: torch.autograd.grad(
        out, inputs, grad, retain_graph=True)) == 4
    assert most_alive((5, 24), lambda: torch.autograd.grad(out, params, grad)) == 4


PLAN = """plan mla_zb {
  model deepseek {
    layers = 4; hidden = 64; heads = HEADS; vocab = 128; seq = 32; batch = 8
    q_rank = Q_RANK; kv_rank = KV_RANK; nope_dim = 16; rope_dim = 8; v_dim = 16
    experts = 4; top_k = 2; expert_ffn = 48; shared_experts = 1; first_dense = 1; ffn = 128
    score = sigmoid
  }
  mesh { pp = 2 }
  schedule { microbatches = 4; pipeline = zb1p }
  train { steps = 1; optimizer = adamw(lr = 1e-3); seed = 0 }
}
"""

# Where each weight half of the step started, by its step: from the gradients at its
# products (the input half kept them) or from its output's.
RANK = """
import json, sys
import planc.runtime.worker as worker
from planc.runtime.engine.interpreter import Interpreter
started, weight = {}, Interpreter._weight
def noting(self, state, step, mb):
    for saved, grad in state.saved.get((step.node, mb), ()):
        where = "output" if saved.weight_roots is None else "products"
        started.setdefault(where, set()).add(step.node)
    return weight(self, state, step, mb)
Interpreter._weight = noting
status = worker.main([sys.argv[1], "--steps", "1"])
print(json.dumps({"status": status, **{k: sorted(v) for k, v in started.items()}}))
"""


@pytest.mark.parametrize("heads,q_rank,kv_rank,from_products", [
    (16, 24, 8, [["W/L0/qkv", "W/L1/qkv"], ["W/L2/qkv", "W/L3/qkv"]]),
    (4, 48, 32, [[], []])])
def test_a_rank_starts_mlas_weight_half_from_its_products_where_they_take_less(
        tmp_path, heads, q_rank, kv_rank, from_products):
    """Two zb1p stages of a deepseek model: at DeepSeek-V3's proportions each layer's
    ``qkv`` weight half starts from its products' gradients, every other from its output
    gradient (the experts' among them); at the H800 miniature's, every one from its
    output gradient."""
    from conftest import one_rank_printed, run_ranks

    text = PLAN.replace("HEADS", str(heads)).replace("Q_RANK", str(q_rank)).replace(
        "KV_RANK", str(kv_rank))
    ranks = [one_rank_printed(done) for done in
             run_ranks(RANK, tmp_path, world=2, plan_text=text)]
    assert [seen["status"] for seen in ranks] == [0, 0]
    assert [seen.get("products", []) for seen in ranks] == from_products
    assert "W/L3/moe" in ranks[1]["output"] and "W/L0/fc1" in ranks[0]["output"]
