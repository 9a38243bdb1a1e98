"""DeepSeek-V3's FP8 GEMMs (issue 40): ``model { fp8 = blockwise }``, emulated. The
quantisation's groups and numbers, its gradients, why a tp shard must hold whole tiles
(the compiler's check), and --check of a dense and a moe plan under tp, pp, dp and ep,
whose first loss is held to fp32's tolerance."""

from __future__ import annotations

import pytest

from planc.cli import main
from planc.lang import load_text
from tests.conftest import counting, script_on_ranks

torch = pytest.importorskip("torch")

DENSE = """plan f8 {
  model llama {
    layers = 2; hidden = 64; heads = 4; kv_heads = 2; ffn = 128; vocab = 128; seq = 32
    batch = 8; fp8 = blockwise; fp8_tile = 16
  }
  mesh { MESH }
  shard { tp { sequence_parallel = on } }
  schedule { microbatches = 2 }
  train { steps = 4; optimizer = sgd(lr = 0.1, momentum = 0.9); seed = 0 }
}
"""
TWO_HOPS = """plan hops {
  model moe { layers = 1; hidden = 32; heads = 4; vocab = 128; seq = 16; batch = 16
              experts = 4; top_k = 1; expert_ffn = 16; fp8 = blockwise; fp8_tile = 4 }
  mesh { tp = 2; ep = 2 }
  topology { nodes = 2 }
  schedule { microbatches = 16 }
  optimize { moe_dispatcher = two_hop }
  train { steps = 3; optimizer = sgd(lr = 0.5, momentum = 0.9); seed = 5 }
}
"""
MOE = DENSE.replace("model llama {", "model moe {").replace(
    "ffn = 128;", "ffn = 128; experts = 8; top_k = 2; expert_ffn = 48; shared_experts = 1; "
                  "first_dense = 1;").replace("layers = 2", "layers = 3")


def test_a_tile_is_scaled_to_its_amax_and_rounded_to_e4m3():
    from planc.runtime.engine.fp8 import quantised_blocks, quantised_rows

    # amax 0.4 -> 448: 0.1, 0.2 and 0.4 land on E4M3 numbers (112, 224, 448); 0.3 on 336,
    # halfway between 320 and 352, rounds to the even mantissa, 320
    assert quantised_rows(torch.tensor([[0.1, 0.2, 0.3, 0.4]]), 4)[0].tolist() == \
        pytest.approx([0.1, 0.2, 0.4 * 320 / 448, 0.4], rel=1e-6)
    # tiles of 2 along the features, each with its own scale, a shorter last tile: in the
    # first, 1 x 448 / 3 = 149.3 rounds to 144 (E4M3 steps by 16 from 128 to 256)
    x = torch.tensor([[1.0, 3.0, 1000.0, 0.0, 5.0]])
    assert quantised_rows(x, 2)[0].tolist() == \
        pytest.approx([144 * 3 / 448, 3.0, 1000.0, 0.0, 5.0], rel=1e-6)
    # blocks of 2 x 2: a zero block stays zero; in the other, amax 1: 0.3 x 448 = 134.4
    # rounds to 128, 0.2 x 448 = 89.6 to 88 (steps of 8 below 128), 0.4 x 448 to 176
    w = torch.tensor([[0.0, 0.0, 1.0, 0.3], [0.0, 0.0, 0.2, 0.4]])
    assert quantised_blocks(w, 2).reshape(-1).tolist() == pytest.approx(
        [0.0, 0.0, 1.0, 128 / 448, 0.0, 0.0, 88 / 448, 176 / 448], rel=1e-6)


def test_no_rows_quantise_encode_and_decode_to_no_rows():
    """A hop of a two-hop dispatch may carry no rows (a random plan's did: a traceback
    reshaping 0 elements into [0, -1])."""
    from planc.runtime.engine.fp8 import decoded_rows, encoded_rows, quantised_rows

    empty = torch.zeros(0, 5)
    assert quantised_rows(empty, 2).shape == (0, 5)
    codes, scale = encoded_rows(empty, 2)
    assert decoded_rows(codes, scale, 5).shape == (0, 5)
    x = torch.tensor([[1.0, 3.0, 1000.0, 0.0, 5.0]])
    assert torch.equal(decoded_rows(*encoded_rows(x, 2), 5), quantised_rows(x, 2))


def _fp32_tensors_made(numel: int, run) -> int:
    """How many tensors of fp32 with ``numel`` elements, each with storage of its own,
    ``run()`` made (an in-place operation's output is its input's storage again)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    made: list = []  # held, so that no storage is freed and its address used again

    class Made(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and out.dtype == torch.float32 \
                    and out.numel() == numel:
                made.append(out)
            return out

    with Made():
        run()
    return len({t.untyped_storage().data_ptr() for t in made})


def test_quantising_reads_its_input_in_its_own_dtype_and_decoding_scales_in_place():
    """Rows and a weight in bf16 whose widths the tile divides are encoded as they are:
    no fp32 copy and no padding, each a whole pass over the tensor (on a GPU most of an
    FP8 GEMM's time beside the block-scaled product): the only fp32 tensors are the
    division's quotient, made a piece at a time (fp8.codes.PIECES: 8 of the rows' 64
    rows at a time; the weight's 2 rows of blocks one at a time), never whole. Decoding
    scales the fp32 copy it makes in place. The bits are an fp32 copy's (the amax is
    exact in any float dtype; the division promotes each element). Through an fp32 copy
    and a padding, encoding made four tensors of their size and decoding two; then the
    division one."""
    from planc.runtime.engine.fp8 import decoded_rows, encoded_blocks, encoded_rows

    generator = torch.Generator().manual_seed(8)
    x = torch.randn(64, 256, generator=generator).to(torch.bfloat16)
    w = torch.randn(256, 128, generator=generator).to(torch.bfloat16)
    assert _fp32_tensors_made(x.numel(), lambda: encoded_rows(x, 128)) == 0
    assert _fp32_tensors_made(x.numel() // 8, lambda: encoded_rows(x, 128)) == 8
    assert _fp32_tensors_made(w.numel(), lambda: encoded_blocks(w, 128)) == 0
    assert _fp32_tensors_made(w.numel() // 2, lambda: encoded_blocks(w, 128)) == 2
    codes, scale = encoded_rows(x, 128)
    assert _fp32_tensors_made(x.numel(), lambda: decoded_rows(codes, scale, 256)) == 1
    for got, expected in ((encoded_rows(x, 128), encoded_rows(x.float(), 128)),
                          (encoded_blocks(w, 128), encoded_blocks(w.float(), 128))):
        assert torch.equal(got[0].view(torch.uint8), expected[0].view(torch.uint8))
        assert torch.equal(got[1], expected[1])


def test_one_weights_product_is_not_copied_beside_itself():
    """A GEMM of one weight (an expert's down, the attention's output) returns its product
    as the kernel wrote it, emulated and on the tensor cores' path alike, and the
    emulation multiplies the weight's quantised blocks as they are: a concatenation
    only where several weights are multiplied at once (q, k, v; gate, up). Through a
    concatenation of one, each copied its product or its weight whole."""
    from planc.runtime.engine.fp8 import GRADIENT_FORMATS, ONE_WEIGHT, Recipe, _Fp8Matmul
    from tests.conftest import counting

    recipe = Recipe(16, GRADIENT_FORMATS["e4m3"])
    generator = torch.Generator().manual_seed(9)
    x = torch.randn(32, 48, generator=generator)
    a, b = torch.randn(48, 32, generator=generator), torch.randn(48, 16, generator=generator)
    cat = torch.ops.aten.cat.default
    # emulated: no concatenation for one weight, one for two
    for weights, cats in (((a,), 0), ((a, b), 1)):
        with counting(cat) as mode:
            _Fp8Matmul.apply(recipe, False, ONE_WEIGHT, x, *weights)
        assert mode.count == cats
    # on the tensor cores' path (the tiles, run here by the CPU's kernel): each weight's
    # product pads its rows once (a concatenation), and two are joined once
    for weights, cats in (((a,), 1), ((a, b), 3)):
        with counting(cat) as mode:
            _Fp8Matmul.apply(recipe, True, ONE_WEIGHT, x, *weights)
        assert mode.count == cats


def test_a_linear_keeps_its_input_as_fp8_bytes_and_a_scale_a_tile():
    from planc.runtime.engine.fp8 import decoded_rows, encoded_rows, quantised_rows

    x = torch.randn(3, 5, 40, generator=torch.Generator().manual_seed(2))
    codes, scale = encoded_rows(x, 16)
    assert codes.dtype == torch.float8_e4m3fn and codes.element_size() == 1
    assert codes.shape == (3, 5, 3, 16) and scale.shape == (3, 5, 3, 1)  # 40 -> 3 tiles
    assert torch.equal(decoded_rows(codes, scale, 40), quantised_rows(x, 16))


def test_a_shard_of_whole_tiles_quantises_as_the_whole_and_a_shard_across_tiles_does_not():
    from planc.runtime.engine.fp8 import quantised_blocks, quantised_rows

    generator = torch.Generator().manual_seed(0)
    w = torch.randn(32, 64, generator=generator)
    x = torch.randn(5, 64, generator=generator)
    for tile in (8, 16):
        assert torch.equal(quantised_blocks(w, tile)[:, 32:], quantised_blocks(w[:, 32:], tile))
        assert torch.equal(quantised_rows(x, tile)[:, 16:48], quantised_rows(x[:, 16:48], tile))
    assert not torch.equal(quantised_rows(x, 16)[:, 8:40], quantised_rows(x[:, 8:40], 16))


def test_the_three_gemms_take_quantised_inputs():
    from planc.runtime.engine.fp8 import Recipe, matmul, quantised_blocks, quantised_rows

    generator = torch.Generator().manual_seed(1)
    x = torch.randn(3, 7, 32, generator=generator, requires_grad=True)
    a = torch.randn(32, 16, generator=generator, requires_grad=True)
    b = torch.randn(32, 8, generator=generator, requires_grad=True)
    grad = torch.randn(3, 7, 24, generator=generator)
    out = matmul(x, [a, b], Recipe(8))
    xq = quantised_rows(x.detach(), 8)
    wq = torch.cat([quantised_blocks(a.detach(), 8), quantised_blocks(b.detach(), 8)], 1)
    assert torch.equal(out, xq @ wq)
    out.backward(grad)
    # the output's gradient in tiles along its features, each weight's columns apart
    gq = torch.cat([quantised_rows(grad[..., :16], 8), quantised_rows(grad[..., 16:], 8)], -1)
    assert torch.allclose(x.grad, gq @ wq.t(), rtol=1e-6, atol=1e-6)
    dw = xq.reshape(-1, 32).t() @ gq.reshape(-1, 24)
    assert torch.allclose(a.grad, dw[:, :16], rtol=1e-6, atol=1e-6)
    assert torch.allclose(b.grad, dw[:, 16:], rtol=1e-6, atol=1e-6)
    # without fp8: the plain product
    assert torch.equal(matmul(x.detach(), [a.detach(), b.detach()], None),
                       x.detach() @ torch.cat([a.detach(), b.detach()], 1))
    # TransformerEngine's HYBRID format: the output gradients in E5M2
    x.grad = None
    matmul(x, [a, b], Recipe(8, torch.float8_e5m2)).backward(grad)
    g5 = torch.cat([quantised_rows(grad[..., :16], 8, torch.float8_e5m2),
                    quantised_rows(grad[..., 16:], 8, torch.float8_e5m2)], -1)
    assert torch.allclose(x.grad, g5 @ wq.t(), rtol=1e-6, atol=1e-6)
    assert not torch.allclose(g5, gq)


def _emulated_and_scaled(function, recipe, inputs, grad) -> list[list]:
    """``function``'s output and its inputs' gradients, emulated and then on the tensor
    cores' path."""
    results = []
    for scaled in (False, True):
        from planc.runtime.engine.fp8 import ONE_WEIGHT

        leaves = [t.clone().requires_grad_() for t in inputs]
        out = function.apply(recipe, scaled, ONE_WEIGHT, *leaves)
        out.backward(grad)
        results.append([out.detach()] + [t.grad for t in leaves])
    return results


@pytest.mark.parametrize("gradients", ["e4m3", "e5m2"])
def test_the_tensor_core_gemms_compute_what_the_emulation_computes(gradients):
    """The path a GPU with FP8 tensor cores takes (torch._scaled_mm per tile of the
    contraction, the scales applied in fp32 on promotion), run through the same kernel's
    CPU implementation: the forward and both gradients of a linear and of an expert's
    SwiGLU equal the emulation's to fp32's rounding, with widths and features that leave
    tiles partly padded. A CPU tensor never takes it by itself."""
    from planc.runtime.engine.fp8 import (GRADIENT_FORMATS, Recipe, _Fp8Matmul,
                                          _Fp8SwiGLUDown, encoded_blocks, encoded_rows,
                                          scaled_product, tensor_cores)

    recipe = Recipe(16, GRADIENT_FORMATS[gradients])
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(2, 21, 40, generator=generator)  # 42 rows: padded to 48
    a, b = torch.randn(40, 24, generator=generator), torch.randn(40, 8, generator=generator)
    grad = torch.randn(2, 21, 32, generator=generator)
    assert not tensor_cores(x.device, 16)
    results = _emulated_and_scaled(_Fp8Matmul, recipe, (x, a, b), grad)
    for emulated, scaled in zip(*results):
        assert torch.allclose(scaled, emulated, rtol=1e-5, atol=1e-5)
    # the FP8 products themselves are exact: only the order of fp32 sums differs
    assert 0 < (results[1][0] - results[0][0]).abs().max() < 1e-4
    gate, up = torch.randn(2, 2, 48, 40, generator=generator)
    down, grad = torch.randn(40, 24, generator=generator), torch.randn(2, 48, 24,
                                                                      generator=generator)
    for emulated, scaled in zip(*_emulated_and_scaled(
            _Fp8SwiGLUDown, recipe, (torch.cat([gate, up], -1), down), grad)):
        assert torch.allclose(scaled, emulated, rtol=1e-5, atol=1e-5)
    # an expert that no token chose
    codes, scale = encoded_rows(gate[0, :0], 16)
    assert scaled_product(codes, scale, *encoded_blocks(down, 16)).shape == (0, 32)


@pytest.mark.parametrize("scaled", [False, True])
def test_a_ranks_experts_in_fp8_at_once_compute_what_each_expert_alone_computes(scaled):
    """A rank's routed experts quantise their rows and their stacked weights once a GEMM
    (experts_swiglu's Groups): the output and every gradient (rows, routing weights,
    the three stacks) equal, bit for bit, those of each expert's SwiGLU run alone on its
    rows, as planc ran them before; emulated and on the tensor cores' path (run here by
    the CPU's kernel), with an expert that no row chose and widths that leave tiles
    padded; each quantisation of rows once for all the experts (counted below)."""
    from planc.runtime.engine import fp8
    from planc.runtime.engine.fp8 import ONE_WEIGHT, Groups, Recipe, _Fp8Matmul, _Fp8SwiGLUDown
    from tests.conftest import counting

    recipe, counts = Recipe(16), (5, 0, 12, 3)
    generator = torch.Generator().manual_seed(11)
    rows = torch.randn(sum(counts), 40, generator=generator)
    scales = torch.rand(sum(counts), 1, generator=generator)
    stacks = [torch.randn(len(counts), *shape, generator=generator)
              for shape in ((40, 24), (40, 24), (24, 40))]
    grad = torch.randn(sum(counts), 40, generator=generator)

    def run(forward):
        leaves = [t.clone().requires_grad_() for t in (rows, scales, *stacks)]
        out = forward(*leaves)
        out.backward(grad)
        return [out.detach()] + [t.grad for t in leaves]

    def at_once(x, s, gate, up, down):
        groups = Groups(counts)
        gate_up = _Fp8Matmul.apply(recipe, scaled, groups, x, gate, up)
        return _Fp8SwiGLUDown.apply(recipe, scaled, groups, gate_up, down, s)

    def expert_by_expert(x, s, gate, up, down):
        outs = []
        for e, (part, weight) in enumerate(zip(x.split(counts), s.split(counts))):
            if part.shape[0]:
                gate_up = _Fp8Matmul.apply(recipe, scaled, ONE_WEIGHT, part, gate[e], up[e])
                outs.append(_Fp8SwiGLUDown.apply(recipe, scaled, ONE_WEIGHT, gate_up,
                                                 down[e], weight))
        return torch.cat(outs)

    expected, got = run(expert_by_expert), run(at_once)
    assert [t.shape for t in got] == [t.shape for t in expected]
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert torch.equal(got[3][1], torch.zeros(40, 24))  # the expert no row chose
    # planc's entry point quantises each row-wide tensor once for every expert: 14
    # quantisations (an amax each) where each expert alone ran 14 of its own, but for
    # the product the backward recomputes, quantised once a run of experts (here 3 runs:
    # 16), and, emulated (this CPU), the weights, whose blocks are quantised an expert
    # with rows at a time (3 here), so that no fp32 copy of every expert's is made: the
    # 6 quantisations of a stack (gate, up and down, forward and input gradient) are 18
    # (on FP8 tensor cores a stack is encoded once); the GEMMs are the same 6 an expert
    # (a forward's 2, an input gradient's 2, a weight gradient's 2)
    leaves = [t.clone().requires_grad_() for t in (rows, scales, *stacks)]
    with counting(torch.ops.aten.amax.default, torch.ops.aten.aminmax.default) as quantised, \
            counting(torch.ops.aten.mm.default, torch.ops.aten.mm.out) as gemms:
        fp8.experts_swiglu(leaves[0], leaves[1], list(counts), *leaves[2:],
                           recipe).backward(grad)
    assert len(Groups(counts).runs()) == 3
    assert (quantised.count, gemms.count) == (14 + 3 - 1 - 6 + 6 * 3, 6 * 3)
    with counting(torch.ops.aten.amax.default, torch.ops.aten.aminmax.default) as quantised:
        run(expert_by_expert)
    assert quantised.count == 14 * 3


def test_the_experts_swiglu_backward_holds_no_temporary_of_every_row():
    """A rank's FP8 experts' SwiGLU backward runs a run of experts at a time (fp8.groups.RUNS):
    of every row it holds only the gradient it returns (gate's and up's side by side, in
    one tensor), not the decoded inputs, silu, the product and its gradient over all the
    rows at once."""
    from planc.runtime.engine.fp8 import Groups, Recipe, _Fp8SwiGLUDown
    from tests.conftest import most_alive

    counts, hidden, ffn = (64,) * 8, 32, 16
    rows = sum(counts)
    generator = torch.Generator().manual_seed(6)
    gate_up = torch.randn(rows, 2 * ffn, generator=generator).requires_grad_()
    weights = torch.rand(rows, 1, generator=generator).requires_grad_()
    down = torch.randn(len(counts), ffn, hidden, generator=generator).requires_grad_()
    out = _Fp8SwiGLUDown.apply(Recipe(16), False, Groups(counts), gate_up, down, weights)
    grad = torch.randn(out.shape, generator=generator)

    def backward():
        torch.autograd.grad(out, (gate_up, down, weights), grad, retain_graph=True)

    assert most_alive((rows, ffn), backward) == 0
    assert most_alive((rows, 2 * ffn), backward) == 1


def _fp32_made(numel: int, run) -> list[tuple[str, tuple[int, ...]]]:
    """(operation, shape) of each fp32 tensor of ``numel`` elements or more, with storage
    of its own (no view), that ``run()`` made, but for zeros (a weight gradient's stack,
    which is returned)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    made: list = []

    class Made(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            given = {t.untyped_storage().data_ptr() for t in
                     torch.utils._pytree.tree_leaves((args, kwargs))
                     if isinstance(t, torch.Tensor)}
            if isinstance(out, torch.Tensor) and out.dtype == torch.float32 \
                    and out.numel() >= numel and func is not torch.ops.aten.zeros.default \
                    and out.untyped_storage().data_ptr() not in given:
                made.append((str(func), tuple(out.shape)))
            return out

    with Made():
        run()
    return made


def test_a_ranks_fp8_experts_make_no_fp32_copy_of_their_every_weight():
    """Emulated, a rank's FP8 experts decode an expert's quantised weights as its rows
    meet them, and encoding divides the weights by their scales a piece of the stack at a
    time (fp8.codes.PIECES): neither the forward nor the backward makes an fp32 tensor
    the size of a stack of weights (at the H200's moe-fp8 shapes, 32 experts' gate
    weights are 192 MiB in fp32), where each GEMM decoded every expert's at once and each
    encoding divided them all at once. The gradient of gate's and up's outputs is written
    into one tensor: no copy joins gate's and up's."""
    from planc.runtime.engine import fp8

    counts, hidden, ffn = (16,) * 8, 64, 64
    rows = sum(counts)
    generator = torch.Generator().manual_seed(12)
    x = torch.randn(rows, hidden, generator=generator).requires_grad_()
    scales = torch.rand(rows, 1, generator=generator).requires_grad_()
    stacks = [torch.randn(len(counts), *shape, generator=generator).requires_grad_()
              for shape in ((hidden, ffn), (hidden, ffn), (ffn, hidden))]
    out = []

    def forward():
        out[:] = [fp8.experts_swiglu(x, scales, list(counts), *stacks, fp8.Recipe(16))]

    stack = len(counts) * hidden * ffn  # twice the rows' gate and up side by side
    assert _fp32_made(stack, forward) == []
    grad = torch.randn(out[0].shape, generator=generator)
    backward = _fp32_made(rows * 2 * ffn, lambda: torch.autograd.grad(
        out[0], [x, scales, *stacks], grad))  # as planc's runtime asks (no .grad to fill)
    assert [op for op, shape in backward if shape[-1] == 2 * ffn] == [
        "aten.new_empty.default"]  # gate's and up's gradient, written half by half
    assert [op for op, shape in backward if shape[0] == len(counts)] == []


def test_the_experts_weight_gradients_decode_their_rows_a_run_of_experts_at_a_time():
    """The weights' pass of a rank's FP8 experts (Groups) decodes their rows and output
    gradients from FP8 a run of experts at a time (fp8.groups.RUNS, an eighth of
    the rows here), never every row at once in fp32 (1 GiB and 768 MiB at the H200's
    moe-fp8 shapes); each expert's gradient is its decoded rows' product, bit for bit."""
    from planc.runtime.engine.fp8 import Groups, Recipe, _Fp8Matmul, quantised_rows
    from tests.conftest import most_alive

    counts, hidden, ffn = (64,) * 8, 32, 16
    rows = sum(counts)
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(rows, hidden, generator=generator)
    gate, up = (torch.randn(len(counts), hidden, ffn, generator=generator).requires_grad_()
                for _ in range(2))
    out = _Fp8Matmul.apply(Recipe(16), False, Groups(counts), x, gate, up)
    grad = torch.randn(out.shape, generator=generator)
    got = []

    def weights_pass():
        got[:] = torch.autograd.grad(out, (gate, up), grad, retain_graph=True)

    assert most_alive((rows, hidden), weights_pass) == 0  # the rows, decoded
    assert most_alive((rows, ffn), weights_pass) == 0  # each weight's output gradient
    for e, (part, grad_part) in enumerate(zip(x.split(counts), grad.split(counts))):
        decoded = quantised_rows(part, 16).t()
        assert torch.equal(got[0][e], decoded @ quantised_rows(grad_part[:, :ffn], 16))
        assert torch.equal(got[1][e], decoded @ quantised_rows(grad_part[:, ffn:], 16))


def test_an_experts_swiglu_keeps_its_inputs_in_fp8_and_recomputes_its_output():
    """DeepSeek-V3's section 3.3.4: the forward is the FP8 down GEMM of silu(gate) * up;
    the backward reads gate and up as their FP8 tiles decode, recomputes the product from
    them for the weight gradient, and keeps no product."""
    from planc.runtime.engine.fp8 import (Recipe, matmul, quantised_blocks, quantised_rows,
                                          swiglu_down)
    import torch.nn.functional as F

    generator = torch.Generator().manual_seed(3)
    gate = torch.randn(6, 24, generator=generator, requires_grad=True)
    up = torch.randn(6, 24, generator=generator, requires_grad=True)
    down = torch.randn(24, 16, generator=generator, requires_grad=True)
    grad = torch.randn(6, 16, generator=generator)
    out = swiglu_down(gate, up, down, Recipe(8))
    product = F.silu(gate.detach()) * up.detach()
    assert torch.equal(out, matmul(product, [down.detach()], Recipe(8)))
    saved = out.grad_fn.saved_tensors
    assert [t.dtype for t in saved] == [torch.float8_e4m3fn, torch.float32] * 2 + [torch.float32]
    assert [tuple(t.shape) for t in saved[:4]] == [(6, 3, 8), (6, 3, 1)] * 2
    # the weight itself, not a copy for each call: the backward quantises it again
    assert saved[4].data_ptr() == down.data_ptr()
    other = torch.randn(24, 8, generator=generator, requires_grad=True)
    linear = matmul(gate, [down, other], Recipe(8))
    kept = linear.grad_fn.saved_tensors  # the input's codes and scales, the weights
    assert [t.dtype for t in kept[:2]] == [torch.float8_e4m3fn, torch.float32]
    assert [t.data_ptr() for t in kept[2:]] == [down.data_ptr(), other.data_ptr()]
    out.backward(grad)
    # the reference: autograd through the decoded inputs, the down GEMM's products in FP8
    g8, u8 = (quantised_rows(t.detach(), 8).requires_grad_() for t in (gate, up))
    wq, gq = quantised_blocks(down.detach(), 8), quantised_rows(grad, 8)
    recomputed = F.silu(g8) * u8
    (recomputed * (gq @ wq.t())).sum().backward()
    assert torch.allclose(gate.grad, g8.grad, rtol=1e-5, atol=1e-6)
    assert torch.allclose(up.grad, u8.grad, rtol=1e-5, atol=1e-6)
    dw = quantised_rows(recomputed.detach(), 8).t() @ gq
    assert torch.allclose(down.grad, dw, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(gate.grad, (gq @ wq.t()) * up.detach() * torch.sigmoid(
        gate.detach()) * (1 + gate.detach() * (1 - torch.sigmoid(gate.detach()))))


def test_each_pass_of_a_split_backward_computes_only_the_products_it_is_asked_for():
    """A split backward (zb1p's B then W) runs the graph twice: the inputs' pass computes
    no weight gradient and the weights' pass no input gradient (autograd's own GEMMs skip
    them; a Function's ``needs_input_grad`` would not), and the two passes give the
    gradients of one backward, bit for bit. The weights' pass computes the SwiGLU's
    input gradient again: the gate-and-up GEMM's weight gradient reads it."""
    from planc.runtime.engine.fp8 import Recipe, matmul, swiglu_down

    generator = torch.Generator().manual_seed(4)
    x = torch.randn(6, 16, generator=generator, requires_grad=True)
    gate_w, up_w = (torch.randn(16, 24, generator=generator, requires_grad=True)
                    for _ in range(2))
    down = torch.randn(24, 16, generator=generator, requires_grad=True)
    grad = torch.randn(6, 16, generator=generator)

    def forward():
        gate, up = matmul(x, [gate_w, up_w], Recipe(8)).chunk(2, dim=-1)
        return swiglu_down(gate, up, down, Recipe(8))

    whole = torch.autograd.grad(forward(), [x, gate_w, up_w, down], grad)
    out = forward()
    with counting(torch.ops.aten.mm.default) as inputs_pass:
        (dx,) = torch.autograd.grad(out, [x], grad, retain_graph=True)
    with counting(torch.ops.aten.mm.default) as weights_pass:
        dws = torch.autograd.grad(out, [gate_w, up_w, down], grad)
    assert (inputs_pass.count, weights_pass.count) == (2, 3)
    assert all(torch.equal(a, b) for a, b in zip(whole, (dx, *dws)))


def test_the_memory_estimate_keeps_the_experts_gradients_for_their_weight_half_in_fp8():
    """zb1p with the mixture cut at its all-to-alls: an experts piece's weight half reads
    its output gradient, the rows sent to it in FP8 and kept so until then
    (planc.runtime.engine.fp8.EncodedRows): per (token, expert) row, at the priced
    imbalance, 64 features at 1.25 bytes (tile 16) rather than fp32's 4, in each of a
    chunk's mixtures (the first layer is dense); a microbatch is one 32-token sequence."""
    from planc.estimate import weight_half
    from planc.models import moe

    text = MOE.replace("MESH", "pp = 2; dp = 2; ep = 2").replace(
        "schedule { microbatches = 2 }",
        "schedule { microbatches = 4; pipeline = zb1p; overlap_all_to_all = on }")
    plain, f8 = (load_text(text.replace("fp8 = blockwise; fp8_tile = 16", extra)).plan
                 for extra in ("fp8_tile = 16", "fp8 = blockwise; fp8_tile = 16"))
    assert [f8.shard.pp.chunks[c] for c in (0, 1)] == [(0, 1), (2, 2)]
    row = 32 * 2 * moe.routing_imbalance(f8.model) * 64  # top_k 2
    for chunk, mixtures in ((0, 1), (1, 1)):
        gap = weight_half._weight_half_bytes(plain, chunk) - \
            weight_half._weight_half_bytes(f8, chunk)
        assert gap == pytest.approx(mixtures * row * (4 - 1.25), rel=1e-12)


def test_the_memory_estimate_keeps_an_experts_swiglu_inputs_in_fp8_and_no_product():
    """Per (token, expert) row a mixture keeps its rows, gate and up outputs and the
    product, (64 + 48 + 2 x 48) x 4 bytes in fp32; with fp8 the rows, gate and up as FP8
    (1.25 bytes an element at tile 16) and the product not at all, (64 + 2 x 48) x 1.25;
    llama's part changes as test_the_memory_estimate_keeps_the_gemm_inputs_in_fp8 has
    it, less its dense MLP's down input, which a mixture does not keep."""
    from planc.models import llama, moe_memory

    plain, fp8 = (load_text(MOE.replace("MESH", "dp = 2").replace(
        "fp8 = blockwise; fp8_tile = 16", extra).replace("first_dense = 1", "first_dense = 0")
    ).plan.model for extra in ("fp8_tile = 16", "fp8 = blockwise; fp8_tile = 16"))
    shape = dict(seq=32, seq_full=32, batch=1, tp=1, sequence_parallel=False,
                 recompute="selective")
    llama_gap = llama.activation_bytes(plain, **shape) - llama.activation_bytes(fp8, **shape)
    dense_mlp_gap = 32 * 128 * (4 - 1.25)  # the dense MLP's down input, taken out
    rows = 32 * 3  # top_k 2 and the shared expert
    per_row = (64 + 48 + 2 * 48) * 4 - (64 + 2 * 48) * 1.25
    kept = [moe_memory.activation_bytes(model, **shape) for model in (plain, fp8)]
    assert kept[0] - kept[1] == pytest.approx(llama_gap - dense_mlp_gap + rows * per_row,
                                              rel=1e-12)


def test_a_tp_shard_across_tiles_is_refused_at_the_key():
    loaded = load_text(DENSE.replace("MESH", "tp = 2").replace("fp8_tile = 16",
                                                               "fp8_tile = 64"))
    assert not loaded.ok
    (found,) = loaded.diagnostics
    assert found.message == (
        "fp8 scales tiles of 64 features, but a tp rank holds 32 of the features of q "
        "(tp = 2): a shard must hold whole tiles to quantise as one process does")
    assert (found.span.line, found.span.column) == (4, 44)  # at fp8_tile's value
    assert found.hints == ("try fp8_tile = 32 or fp8_tile = 16",)
    assert load_text(DENSE.replace("MESH", "dp = 2").replace("fp8_tile = 16",
                                                             "fp8_tile = 64")).ok
    # nothing split over tp: nothing to cut
    assert load_text(DENSE.replace("MESH", "tp = 2").replace("fp8_tile = 16", "fp8_tile = 64")
                     .replace("sequence_parallel = on", "qkv = replicate; proj = replicate; "
                              "fc1 = replicate; fc2 = replicate")).ok
    # gpt has no FP8 recipe
    assert not load_text(DENSE.replace("model llama", "model gpt").replace(
        "kv_heads = 2; ffn = 128; ", "").replace("MESH", "dp = 2")).ok


@pytest.mark.parametrize("text, mesh", [
    (DENSE, "tp = 2; pp = 2; dp = 2"),
    (MOE, "tp = 2; pp = 2; ep = 2"),
    (MOE, "dp = 2; ep = 2"),
    (DENSE.replace("fp8_tile = 16", "fp8_tile = 16; fp8_gradients = e5m2"), "tp = 2; dp = 2"),
    # two hops over 2 "nodes", 16 microbatches of one sequence: a hop that carries no
    # rows (a random plan found it)
    (TWO_HOPS, ""),
    # and a rank whose first hop sends no rows at all, in an evaluation (a second run)
    (TWO_HOPS.replace("top_k = 1; expert_ffn = 16", "top_k = 2; expert_ffn = 24; capacity = "
                      "1.0; score = sigmoid").replace("layers = 1", "layers = 5").replace(
        "experts = 4", "experts = 8").replace("microbatches = 16", "microbatches = 8").replace(
        "fp8_tile = 4", "fp8_tile = 8").replace("sgd(lr = 0.5, momentum = 0.9); seed = 5",
                                                "adamw(lr = 0.01); seed = 37; eval_every = 1; "
                                                "eval_batches = 2").replace("steps = 3",
                                                                            "steps = 1"), ""),
], ids=["llama-tp2-pp2-dp2", "moe-tp2-pp2-ep2", "moe-dp2-ep2", "llama-e5m2-tp2-dp2",
        "moe-two-hops-tp2-ep2", "moe-two-hops-evaluated"])
def test_fp8_training_matches_the_reference(tmp_path, text, mesh, capsys):
    (tmp_path / "f.plan").write_text(text.replace("MESH", mesh))
    assert main(["run", str(tmp_path / "f.plan"), "-o", str(tmp_path / "b"), "--check"]) == 0
    err = capsys.readouterr().err
    if "adamw" in text:  # AdamW: the losses and the evaluation's (docs/language.md)
        assert "and 1 evaluation against the single-process run (relative tolerance 0.02, " \
               "step 0's loss 1e-05): every loss matches." in err, err
    else:
        assert "(relative tolerance 0.02, step 0's loss 1e-05): every loss and parameter " \
               "matches" in err, err


FP8_GPU = pytest.mark.skipif(
    "not __import__('torch').cuda.is_available() or "
    "__import__('torch').cuda.get_device_capability() < (8, 9)",
    reason="needs a GPU with FP8 tensor cores (compute capability 8.9 or later)")


@FP8_GPU
@pytest.mark.parametrize("gradients", ["e4m3", "e5m2"])
def test_on_fp8_tensor_cores_a_linear_computes_what_the_cpu_emulation_computes(gradients):
    """On a GPU the forward and the input gradient run torch._scaled_mm; the CPU runs the
    emulation: the two agree to the tensor cores' accumulation, the weight gradient (the
    same emulation on both) too. Leaving the quantisation out moves these products by 4%
    of their largest value, 80 times what this allows."""
    from planc.runtime.engine.fp8 import GRADIENT_FORMATS, Recipe, matmul, tensor_cores

    recipe = Recipe(128, GRADIENT_FORMATS[gradients])
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(2, 64, 384, generator=generator)
    a, b = torch.randn(384, 320, generator=generator), torch.randn(384, 128,
                                                                   generator=generator)
    grad = torch.randn(2, 64, 448, generator=generator)
    results = []
    for device in ("cpu", "cuda"):
        leaves = [t.to(device).requires_grad_() for t in (x.clone(), a.clone(), b.clone())]
        assert tensor_cores(leaves[0].device, 128) == (device == "cuda")
        out = matmul(leaves[0], leaves[1:], recipe)
        out.backward(grad.to(device))
        results.append([t.cpu() for t in [out.detach()] + [t.grad for t in leaves]])
    for emulated, scaled in zip(*results):
        # Hopper's FP8 tensor cores accumulate with about 14 bits inside a tile (DeepSeek-V3,
        # section 3.3.2): seen on an H200, differences of 2.6e-3 in outputs of about 50
        assert (scaled - emulated).abs().max() <= 2**-11 * emulated.abs().max()


def test_the_blockwise_kernel_is_hoppers_alone_and_128_wide():
    """cuBLASLt's block scaling (one call that applies the recipe's scales itself) runs
    on Hopper with 128-wide tiles alone; a CPU and other tiles go tile by tile."""
    from planc.runtime.engine.fp8 import blockwise_kernel

    assert blockwise_kernel(torch.device("cpu"), 128) is None
    if torch.cuda.is_available():
        assert blockwise_kernel(torch.device("cuda", 0), 16) is None


HOPPER = pytest.mark.skipif(
    "not __import__('torch').cuda.is_available() or "
    "__import__('torch').cuda.get_device_capability() != (9, 0)",
    reason="needs a Hopper GPU (compute capability 9.0)")


@HOPPER
def test_on_hopper_one_blockwise_call_computes_what_the_tiles_compute():
    """The one-call product (the scales applied by cuBLASLt) against the tile-by-tile one
    (the scales applied by PyTorch in fp32): rows that leave the padding to 16 partly
    filled, tiles and blocks of very different scales, a weight read transposed (the
    input gradient's), and no rows at all. Its output dtype is printed: fp32 where
    cuBLASLt gives it (seen on an H200: 1.7e-7 of the largest product apart), else bf16,
    each held to its own rounding; with 5 tiles of the contraction, the weight's scales
    padded to 8 (PyTorch asks for a multiple of 4)."""
    from planc.runtime.engine.fp8 import (blockwise_kernel, blockwise_product,
                                          encoded_blocks, encoded_rows, scaled_product,
                                          tiled_product)

    device = torch.device("cuda", 0)
    output = blockwise_kernel(device, 128)
    print("blockwise kernel's products:", output)
    assert output in (torch.float32, torch.bfloat16)
    tolerance = 2**-16 if output == torch.float32 else 2**-7
    generator = torch.Generator(device=device).manual_seed(6)
    rows = torch.randn(3, 37, 640, device=device, generator=generator) \
        * torch.rand(3, 37, 1, device=device, generator=generator).mul(100)
    weight = torch.randn(640, 384, device=device, generator=generator)
    weight[256:384] *= 1000
    codes, scale = encoded_rows(rows, 128)
    for block, block_scale in (encoded_blocks(weight, 128),
                               [t.t() for t in encoded_blocks(weight.t(), 128)]):
        expected = tiled_product(codes, scale, block, block_scale)
        got = blockwise_product(codes, scale, block, block_scale, output)
        assert got.shape == expected.shape == (111, block.shape[1])
        assert (got - expected).abs().max() <= tolerance * expected.abs().max()
        assert torch.equal(scaled_product(codes, scale, block, block_scale), got)
    assert scaled_product(codes[:, :0], scale[:, :0], block, block_scale).shape == (0, 384)


@FP8_GPU
@pytest.mark.parametrize("family", ["llama", "moe", "deepseek"])
def test_fp8_training_on_one_gpu_matches_the_cpu_reference(tmp_path, family, capsys):
    """One rank on nccl, its GEMMs on FP8 tensor cores, against the one-process run on
    the CPU, which emulates them; DeepSeek-V3's attention and gate as well."""
    from tests.test_deepseek_mla import plan_text

    deepseek = plan_text("", "; fp8 = blockwise; fp8_tile = 16").replace(
        "adamw(lr = 1e-3, weight_decay = 0.01)", "sgd(lr = 0.1, momentum = 0.9)")
    text = {"llama": DENSE, "moe": MOE, "deepseek": deepseek}[family]
    (tmp_path / "f.plan").write_text(text.replace("MESH", ""))
    assert main(["run", str(tmp_path / "f.plan"), "-o", str(tmp_path / "b"), "--check",
                 "--backend", "nccl"]) == 0
    err = capsys.readouterr().err
    assert "every loss and parameter matches" in err, err


def test_the_first_step_is_held_to_fp32s_tolerance_and_the_rest_to_fp8s():
    from planc.runtime.oracle.check import exact, first_step_tolerance

    fp8 = load_text(DENSE.replace("MESH", "dp = 2")).plan
    assert not exact(fp8)
    assert [first_step_tolerance(fp8, step, 2e-2) for step in (0, 1)] == [1e-5, 2e-2]
    # on FP8 tensor cores, whose sums keep about 14 bits (DeepSeek-V3, section 3.3.2)
    assert [first_step_tolerance(fp8, step, 2e-2, tensor_cores=True) for step in (0, 1)] \
        == [1e-4, 2e-2]
    plain = load_text(DENSE.replace("MESH", "dp = 2").replace(
        "; fp8 = blockwise; fp8_tile = 16", "")).plan
    assert exact(plain) and first_step_tolerance(plain, 0, 1e-5) == 1e-5


# --- the simulator ------------------------------------------------------------------------

H100 = """plan big {
  model llama { preset = llama3-8b; batch = 64; FP8 }
  mesh { tp = 8; dp = 2 }
  topology { preset = PRESET }
  schedule { microbatches = 8 }
}
"""


def _h100(fp8: bool, preset: str = "dgx-h100"):
    return load_text(H100.replace("FP8", "fp8 = blockwise" if fp8 else "")
                     .replace("PRESET", preset))


def test_a_gemm_in_fp8_runs_at_the_fp8_peak_on_an_h100():
    from planc.estimate.kernel_cost import KernelModel

    model = KernelModel.of(_h100(True).plan)
    assert model.fp8_speedup == pytest.approx(1979 / 989)  # the datasheet's peaks
    launch = model.gpu.launch
    big = (16384, 8192, 8192)
    assert model.gemm_seconds(*big, fp8=True) - launch == pytest.approx(
        (model.gemm_seconds(*big) - launch) * 989 / 1979)
    # without fp8 in the plan, an FP8 GEMM is priced as any other
    plain = KernelModel.of(_h100(False).plan)
    assert plain.fp8_speedup is None
    assert plain.gemm_seconds(*big, fp8=True) == plain.gemm_seconds(*big)


def test_simulate_prices_the_fp8_recipe_below_bf16():
    from planc.compile import compile_plan
    from planc.simulate import simulate

    fp8, bf16 = (simulate(compile_plan(_h100(flag).plan)) for flag in (True, False))
    # pinned: pricing any of the four linears in bf16 moves it (0.900 with fc1 alone)
    assert round(fp8.step_seconds / bf16.step_seconds, 3) == 0.842
    # the MFU of the FP8 recipe is of the FP8 peak (H100: 1,979 TFLOP/s against 989 in
    # bf16, scaled like the plan's declared peak), so it never passes 100 %
    plan = _h100(True).plan
    assert (fp8.mfu_of_fp8, bf16.mfu_of_fp8) == (True, False)
    assert fp8.peak_flops == plan.topology.device.flops * 1979 / 989
    assert bf16.peak_flops == plan.topology.device.flops
    assert fp8.mfu == fp8.model_flops / fp8.step_seconds / fp8.world / fp8.peak_flops


def test_simulate_says_where_it_prices_fp8_at_the_dtype_rate():
    from planc.compile import compile_plan
    from planc.simulate import simulate
    from planc.views import simulate_text

    line = ("  fp8: its GEMMs are priced at the dtype's rate: the simulator knows an FP8 "
            "rate only on a GPU preset that has one (dgx-h100)")
    on_cpu, on_h100, plain = (simulate(compile_plan(_h100(fp8, preset).plan))
                              for fp8, preset in ((True, "cpu"), (True, "dgx-h100"),
                                                  (False, "cpu")))
    assert on_cpu.fp8_at_the_dtype_rate and on_cpu.to_json()["fp8_at_the_dtype_rate"]
    assert line in simulate_text.render(on_cpu).splitlines()
    # on an H100 the GEMMs run at its FP8 peak; without fp8 there is nothing to say
    for result in (on_h100, plain):
        assert not result.fp8_at_the_dtype_rate
        assert "fp8" not in simulate_text.render(result)


def test_fp8_on_a_machine_without_fp8_tensor_cores_is_refused():
    loaded = _h100(True, "dgx-a100")
    assert not loaded.ok
    (found,) = [d for d in loaded.diagnostics if d.severity == "error"]
    assert found.message == (
        "fp8 multiplies on FP8 tensor cores, which the dgx-a100 machine's GPUs do not have: "
        "NVIDIA DGX A100: 8x A100 80GB, NVLink 3, 8x HDR 200 Gb/s IB")
    assert found.hints == ("try preset = dgx-h100",)
    assert _h100(False, "dgx-a100").ok
    assert _h100(True, "cpu").ok  # emulated there


def test_the_memory_estimate_keeps_the_gemm_inputs_in_fp8():
    from planc.models import llama
    from planc.vocabulary.model_options import gemm_input_bytes

    plain, fp8 = (load_text(DENSE.replace("MESH", "tp = 2").replace(
        "fp8 = blockwise; fp8_tile = 16", extra)).plan.model
        for extra in ("fp8_tile = 16", "fp8 = blockwise; fp8_tile = 16"))
    assert gemm_input_bytes(plain) == 4 and gemm_input_bytes(fp8) == 1.25
    shape = dict(seq=32, seq_full=32, batch=4, tp=2, sequence_parallel=True,
                 recompute="none")
    # the inputs of q/k/v and gate/up (2 x 128 tokens x 64 / tp) and of o and down
    # (128 x (64 + 128) / tp) held in 1.25 bytes an element instead of 4
    inputs = 2 * 128 * 64 / 2 + 128 * (64 + 128) / 2
    assert llama.activation_bytes(plain, **shape) - llama.activation_bytes(fp8, **shape) == \
        pytest.approx(inputs * (4 - 1.25))


def test_the_head_stays_in_the_dtype():
    from planc.estimate.kernel_cost import KernelModel

    fp8, plain = (KernelModel.of(_h100(flag).plan) for flag in (True, False))
    assert fp8.linear_seconds("head", "forward", 1e12) == \
        plain.linear_seconds("head", "forward", 1e12)
    for linear in ("qkv", "proj", "fc1", "fc2"):  # each in FP8, on the H100's FP8 peak
        for step in ("forward", "backward"):
            assert fp8.linear_seconds(linear, step, 1e12) < \
                plain.linear_seconds(linear, step, 1e12), (linear, step)


DISPATCH = r'''
import sys
import torch, torch.distributed as dist
from planc.runtime.engine import fp8
from planc.runtime.families.moe import _Fp8Dispatch

rank, path = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", rank=rank, world_size=2, store=dist.FileStore(path, 2))
rows = (torch.randn(5, 40, generator=torch.Generator().manual_seed(rank)) * 3).requires_grad_()
sent, received = ([2, 3], [2, 1]) if rank == 0 else ([1, 4], [3, 4])
got = _Fp8Dispatch.apply(rows, sent, received, None, 16)
# what each peer sent, as its FP8 GEMM would read it
theirs = [torch.randn(5, 40, generator=torch.Generator().manual_seed(r)) * 3 for r in (0, 1)]
first = [0, 0] if rank == 0 else [2, 1]  # where each sender's rows for me start
expected = torch.cat([fp8.quantised_rows(theirs[r][first[r]:first[r] + received[r]], 16)
                      for r in (0, 1)])
got.backward(torch.ones_like(got))
print(torch.equal(got, expected), got.dtype, rows.grad.sum().item())
sys.stdout.flush()
import os
os._exit(0)
'''


def test_the_dispatch_sends_fp8_bytes_and_the_gradients_back_in_the_dtype(tmp_path):
    """Two ranks exchange rows through the FP8 dispatch: each receives exactly what its
    experts' FP8 GEMM would read of the rows sent to it, and the backward returns every
    row's gradient (ones) whole."""
    outputs = script_on_ranks(DISPATCH, tmp_path)
    assert [out.strip() for out, _ in outputs] == ["True torch.float32 200.0"] * 2, outputs


COMBINE = r'''
import sys
import torch, torch.distributed as dist
from planc.runtime.engine import fp8
from planc.runtime.families.moe import _Fp8Combine
from planc.runtime.families.moe_dispatch import exchange_gradients

rank, path = int(sys.argv[1]), sys.argv[2]
form = fp8.GRADIENT_FORMATS[sys.argv[3]]
dist.init_process_group("gloo", rank=rank, world_size=2, store=dist.FileStore(path, 2))
outputs = torch.randn(5, 40, generator=torch.Generator().manual_seed(rank)).requires_grad_()
sent, received = ([2, 3], [2, 1]) if rank == 0 else ([1, 4], [3, 4])
got = _Fp8Combine.apply(outputs, sent, received, None, fp8.Recipe(16, form))
theirs = [torch.randn(5, 40, generator=torch.Generator().manual_seed(r)) for r in (0, 1)]
first = [0, 0] if rank == 0 else [2, 1]  # where each sender's rows for me start
whole = torch.equal(got, torch.cat([theirs[r][first[r]:first[r] + received[r]]
                                    for r in (0, 1)]))
# the gradients of what arrived, 3 x the row's position, go back as FP8
got_grad = torch.arange(got.shape[0] * 40, dtype=torch.float32).reshape(-1, 40) * 3
got.backward(got_grad)
grads = {r: torch.arange(n * 40, dtype=torch.float32).reshape(-1, 40) * 3
         for r, n in ((0, 3), (1, 7))}  # the gradient of each rank's received rows
expected = torch.cat([fp8.quantised_rows(grads[peer][at:at + n], 16, form)
                      for peer, at, n in ((0, 0, 2), (1, 0, 3))] if rank == 0 else
                     [fp8.quantised_rows(grads[peer][at:at + n], 16, form)
                      for peer, at, n in ((0, 2, 1), (1, 3, 4))])
# the cut mixture's transfer of the same gradients keeps them as they arrived, one byte
# an element, and decodes them to the same bits
kept = exchange_gradients(got_grad, received, sent, None, fp8.Recipe(16, form))
print(whole, torch.equal(outputs.grad, expected),
      torch.equal(outputs.grad, torch.cat([grads[0][:2], grads[1][:3]]) if rank == 0
                  else torch.cat([grads[0][2:3], grads[1][3:7]])),
      type(kept).__name__, kept.codes.dtype == form, kept.codes.element_size(),
      tuple(kept.scale.shape), torch.equal(kept.decoded(), outputs.grad))
sys.stdout.flush()
import os
os._exit(0)
'''


@pytest.mark.parametrize("form", ["e4m3", "e5m2"])
def test_the_combine_returns_the_dtype_and_sends_its_gradients_to_the_experts_in_fp8(
        tmp_path, form):
    """DeepSeek-V3 (section 3.3) sends the activation gradient before the experts'
    down-projections in FP8, the combine itself in BF16: two ranks combine rows exactly,
    and each gets back exactly what FP8 leaves of its rows' gradients, not the gradients
    whole, in the recipe's format of gradients (which the down GEMM's backward reads).
    The cut mixture's transfer keeps them as they arrived (5 rows of 3 tiles of 16 one
    byte each, a scale a tile) for the experts' input and weight halves to decode alike."""
    outputs = script_on_ranks(COMBINE, tmp_path, 2, form)
    assert [out.strip() for out, _ in outputs] == [
        "True True False EncodedRows True 1 (5, 3, 1) True"] * 2, outputs


def test_the_simulator_prices_what_goes_to_the_experts_in_fp8_and_the_rest_in_the_dtype():
    from planc.compile import compile_plan
    from planc.estimate.instruction_cost import InstructionCosts

    text = """plan m {
      model moe { layers = 2; hidden = 4096; heads = 32; kv_heads = 8; vocab = 32000;
                  seq = 4096; batch = 64; experts = 64; top_k = 8; expert_ffn = 1024;
                  dtype = bf16 FP8 }
      mesh { dp = 16; ep = 16 }
      topology { preset = dgx-h100 }
      schedule { microbatches = 4 }
    }"""
    exchanges, one = {}, {}
    for flag in ("", "; fp8 = blockwise"):
        build = compile_plan(load_text(text.replace("FP8", flag)).plan)
        costs = InstructionCosts(build.plan, build.groups)
        assert costs.dispatch_share == (pytest.approx((1 + 4 / 128) / 2) if flag else 1.0)
        for instruction in build.programs["stage0.json"].written():
            if instruction.operands is not None and instruction.operands.kernel == "moe":
                costs(instruction, 0)
                step = instruction.operands.step.value
                exchanges[(flag, step)] = costs.exchanges[instruction.node]
                group = instruction.operands.group
                # one all-to-all of the busiest rank's rows in the dtype, and in FP8
                rows = instruction.operands.bytes * costs.mixture.imbalance
                one[(flag, step)] = tuple(
                    costs.expert_all_to_all(instruction.operands.group, rows * share, 0)
                    for share in (1.0, costs.dispatch_share))
    for step in ("forward", "backward"):
        dtype, fp8 = one[("; fp8 = blockwise", step)]
        assert fp8 < dtype and one[("", step)] == (dtype, dtype)
        # a forward's counts before its dispatch: 64 experts of 8 bytes, in neither dtype
        counts = costs.expert_all_to_all(group, 64 * 8, 0) if step == "forward" else 0.0
        # the dtype: both ways; FP8: to the experts only, the way back in the dtype
        assert exchanges[("", step)] == pytest.approx(2 * dtype + counts, rel=1e-12)
        assert exchanges[("; fp8 = blockwise", step)] == \
            pytest.approx(fp8 + dtype + counts, rel=1e-12)
    assert exchanges[("; fp8 = blockwise", "forward")] < exchanges[("", "forward")]
    # a backward's combine (the gradients to the experts) in FP8, its dispatch back not
    assert exchanges[("; fp8 = blockwise", "backward")] == pytest.approx(
        exchanges[("; fp8 = blockwise", "forward")] - costs.expert_all_to_all(group, 64 * 8, 0),
        rel=1e-12)
    assert exchanges[("; fp8 = blockwise", "backward")] < exchanges[("", "backward")]


# Every run of a cut mixture's experts on a rank: whether the program told it to drop
# its received rows, and the bytes those rows hold once it has run.
EXPERTS_RAN = r'''
import json, sys
import planc.runtime.worker as worker
from planc.graph.ir import Op
from planc.runtime.families import moe
ran, experts = [], moe.KERNELS[Op.MOE_EXPERTS]
def noting(k, spec, x, p, step, mb, extra):
    out = experts(k, spec, x, p, step, mb, extra)
    ran.append([spec.drops_rows, x["x"].rows.untyped_storage().nbytes()])
    return out
moe.KERNELS[Op.MOE_EXPERTS] = noting
print(json.dumps({"status": worker.main([sys.argv[1], "--steps", "1"]), "ran": ran}))
'''


@pytest.mark.parametrize("fp8", [True, False])
def test_the_experts_let_their_received_rows_go_where_the_program_says(tmp_path, fp8):
    """A cut mixture's experts (ep 2, two mixtures, two microbatches): with FP8 each of
    the four forwards drops the rows it received, as its operands say, and the step
    trains; without FP8 (their backward reads them) each keeps them."""
    from tests.conftest import one_rank_printed, run_ranks
    from tests.test_moe_overlap import plan_text

    text = plan_text(extra="fp8 = blockwise; fp8_tile = 16" if fp8 else "")
    for done in run_ranks(EXPERTS_RAN, tmp_path, world=2, plan_text=text):
        printed = one_rank_printed(done)
        assert printed["status"] == 0
        assert [drops for drops, _ in printed["ran"]] == [fp8] * 4
        assert [nbytes == 0 for _, nbytes in printed["ran"]] == [fp8] * 4


def test_a_split_bf16_product_is_an_fp32_product_to_16_bits():
    """The weight gradient on CUDA's bf16 tensor cores (split_product, Henry et al.
    2019): three bf16 products of high and low parts, here multiplied in fp32 as the
    GPU's accumulate, within 2^-15 of fp32's product for inputs of 28 significant bits
    (E4M3 codes times fp32 scales, as the recipe's decoded rows are), where one bf16
    product of the same inputs is 2^-9 away, and the CPU never takes it by itself."""
    from planc.runtime.engine.fp8 import decoded_rows, encoded_rows, split_product
    from planc.runtime.engine.fp8.tensor_cores import bf16_pair, split_weight_gradient

    generator = torch.Generator().manual_seed(12)
    x = decoded_rows(*encoded_rows(torch.randn(256, 96, generator=generator) * 3, 32), 96)
    grad = decoded_rows(*encoded_rows(torch.randn(256, 64, generator=generator), 32), 64)
    exact = x.double().t() @ grad.double()
    split = split_product(tuple(t.t() for t in bf16_pair(x)), bf16_pair(grad))
    one_bf16 = (x.bfloat16().t().float() @ grad.bfloat16().float()).double()
    largest = exact.abs().max()
    assert split.dtype == torch.float32 and split.shape == (96, 64)
    assert (split.double() - exact).abs().max() < 2**-15 * largest
    assert (one_bf16 - exact).abs().max() > 2**-11 * largest  # what the split avoids
    assert not split_weight_gradient(torch.device("cpu"))


@pytest.mark.skipif("not __import__('torch').cuda.is_available()", reason="needs a CUDA GPU")
def test_on_cuda_a_weight_gradient_multiplies_split_bf16_on_the_tensor_cores():
    """On a GPU, torch.mm's bf16 products in fp32 (out_dtype) give split_product the
    same figure as the CPU's fp32 products of the same bf16 parts, to 2^-16 of it (one
    bf16 GEMM would be 2^-8 away: the CPU test above)."""
    from planc.runtime.engine.fp8 import decoded_rows, encoded_rows, split_product
    from planc.runtime.engine.fp8.tensor_cores import bf16_pair, split_weight_gradient

    device = torch.device("cuda", 0)
    assert split_weight_gradient(device)
    generator = torch.Generator().manual_seed(13)
    x = decoded_rows(*encoded_rows(torch.randn(512, 256, generator=generator), 128), 256)
    grad = decoded_rows(*encoded_rows(torch.randn(512, 384, generator=generator), 128), 384)
    on_cpu = split_product(tuple(t.t() for t in bf16_pair(x)), bf16_pair(grad))
    on_gpu = split_product(tuple(t.t() for t in bf16_pair(x.to(device))),
                           bf16_pair(grad.to(device))).cpu()
    assert on_gpu.dtype == torch.float32
    assert (on_gpu - on_cpu).abs().max() <= 2**-16 * on_cpu.abs().max()
