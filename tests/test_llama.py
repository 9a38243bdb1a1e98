"""The llama family end to end: checks, the derivation and real runs on every axis.

Every plan of the matrix runs on real gloo processes with ``planc run --check``, which
trains the same model in one process (planc.runtime.oracle.reference) and compares every loss
and final parameter; all plans of one model must then follow the same loss curve.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from planc.cli import main
from planc.lang import load_text
from planc.estimate import memory
from tests.conftest import PLANS

TEMPLATE = """plan {name} {{
  model llama {{ layers = 4; hidden = 32; heads = 4; kv_heads = {kv}; ffn = 48; vocab = 128;
                seq = 16; batch = 8{model} }}
  mesh {{ {mesh} }}
  shard {{ {shard} }}
  schedule {{ microbatches = {m}{schedule} }}
  optimize {{ {optimize} }}
  train {{ steps = {steps}; optimizer = adamw(lr = 0.01, weight_decay = 0.1); seed = 5{train} }}
}}
"""

# What each plan exercises is in its name; "kv1"/"tp4": fewer k/v heads than tp ranks,
# so ranks share a k/v head and sum its gradient over tp (Megatron's replication).
MATRIX = {
    "single": dict(),
    "tp2": dict(mesh="tp = 2"),
    "tp2-kv1-shared": dict(mesh="tp = 2", kv=1),
    "tp4-kv2-shared": dict(mesh="tp = 4", kv=2),
    "tp2-sequence-parallel": dict(mesh="tp = 2", shard="tp { sequence_parallel = on }"),
    "tp2-kv1-sp": dict(mesh="tp = 2", kv=1, shard="tp { sequence_parallel = on }"),
    "tp2-qkv-replicate-kv1": dict(mesh="tp = 2", kv=1, shard="tp { qkv = replicate }"),
    "tp2-embedding-hidden": dict(mesh="tp = 2", shard="tp { embedding = hidden }"),
    "tp2-mlp-replicate-sp": dict(mesh="tp = 2", shard="tp { fc1 = replicate; fc2 = replicate;"
                                 " sequence_parallel = on }"),
    "cp2-allgather": dict(mesh="cp = 2"),
    "cp2-ring": dict(mesh="cp = 2", shard="cp { attention = ring }"),
    "cp2-ring-kv1-no-load-balance": dict(mesh="cp = 2", kv=1,
                                         shard="cp { attention = ring; load_balance = off }"),
    "cp2-ring-tp2-sp": dict(mesh="cp = 2; tp = 2", shard="cp { attention = ring }; "
                            "tp { sequence_parallel = on }"),
    "cp2-no-load-balance": dict(mesh="cp = 2", shard="cp { load_balance = off }"),
    "cp2-tp2-kv1": dict(mesh="cp = 2; tp = 2", kv=1),
    "pp2-1f1b": dict(mesh="pp = 2", m=4),
    "pp2-interleaved": dict(mesh="pp = 2", m=4, shard="pp { virtual = 2 }",
                            schedule="; pipeline = interleaved"),
    # Uneven interleaving (Llama 3's layout in small): the first chunk runs the embedding
    # alone and the last the head alone, with tp and sequence parallelism; then chunks of
    # 1 and 2 layers written out, with ZeRO 1.
    "pp2-interleaved-uneven-tp2-sp": dict(mesh="pp = 2; tp = 2", m=4,
                                          shard="pp { virtual = 3 }; tp { sequence_parallel = "
                                                "on }", schedule="; pipeline = interleaved"),
    "pp2-dp2-interleaved-uneven-zero1": dict(mesh="pp = 2; dp = 2", m=2,
                                             schedule="; pipeline = interleaved",
                                             shard="pp { virtual = 2; stages = [0..1, 2, 3, "
                                                   "head] }; dp { zero = 1 }"),
    "dp2-zero0": dict(mesh="dp = 2", m=2),
    "dp2-zero1": dict(mesh="dp = 2", m=2, shard="dp { zero = 1 }"),
    "dp2-zero2": dict(mesh="dp = 2", m=2, shard="dp { zero = 2 }"),
    "dp2-zero3-kv1-tp2": dict(mesh="dp = 2; tp = 2", kv=1, shard="dp { zero = 3 }"),
    "recompute-selective": dict(mesh="tp = 2", optimize="recompute = selective"),
    "recompute-full-cp2": dict(mesh="cp = 2", optimize="recompute = full"),
    "fuse-off-overlap-off": dict(mesh="tp = 2; dp = 2", m=2,
                                 optimize="fuse = off; overlap = off"),
    "tp2-pp2-dp2-sp-zero1": dict(mesh="tp = 2; pp = 2; dp = 2", m=2,
                                 shard="tp { sequence_parallel = on }; dp { zero = 1 }"),
    "tied-over-pp": dict(mesh="pp = 2", m=2, model="; tie_embeddings = on"),
    # The zero-bubble schedules: input and weight gradients in blocks of their own.
    "pp2-zb1p-tp2-sp-zero2": dict(mesh="tp = 2; pp = 2; dp = 2", m=2,
                                  schedule="; pipeline = zb1p",
                                  shard="tp { sequence_parallel = on }; dp { zero = 2 }"),
    "pp2-interleaved-zb-cp2-ring": dict(mesh="cp = 2; pp = 2", m=4,
                                        schedule="; pipeline = interleaved_zb",
                                        shard="cp { attention = ring }; pp { virtual = 2 }"),
    "pp2-zb1p-uneven-tied": dict(mesh="pp = 2", m=4, schedule="; pipeline = zb1p",
                                 model="; tie_embeddings = on",
                                 shard="pp { stages = [0..2, 3..3] }"),
    # the V schedules: chunk 0 and the last chunk on stage 0
    "pp2-zbv-tp2-sp-kv1": dict(mesh="tp = 2; pp = 2", m=4, kv=1, schedule="; pipeline = zbv",
                               shard="tp { sequence_parallel = on }; pp { virtual = 2 }"),
    "pp2-dualpipev-tied-zero2": dict(mesh="pp = 2; dp = 2", m=4, model="; tie_embeddings = on",
                                     schedule="; pipeline = dualpipev",
                                     shard="pp { virtual = 2 }; dp { zero = 2 }"),
    # tp_overlap forced to split (on gloo the cost model keeps every GEMM whole)
    "tp2-tp-overlap-4": dict(mesh="tp = 2", optimize="tp_overlap = 4"),
    "tp2-sp-kv1-tp-overlap-2": dict(mesh="tp = 2", kv=1, m=2, optimize="tp_overlap = 2",
                                    shard="tp { sequence_parallel = on }"),
    # optimize { recompute_activation }: down's input made again, in pieces, in both steps
    # of the backward tp_overlap splits
    "tp2-pp2-tp-overlap-2-act": dict(mesh="tp = 2; pp = 2", m=4,
                                     optimize="tp_overlap = 2; recompute_activation = on"),
    # (a cosine schedule with a warm-up, with grad_clip and evaluations: the llama runs of
    # tests/test_grad_clip.py)
}


def plan_text(name: str, **case) -> str:
    values = dict(kv=2, model="", mesh="", shard="", m=1, schedule="", optimize="", steps=2,
                  train="")
    values.update(case)
    return TEMPLATE.format(name=name.replace("-", "_"), **values)


@pytest.fixture(scope="module")
def curves() -> dict[str, list[float]]:
    return {}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MATRIX))
def test_every_llama_plan_trains_exactly_like_one_process(name, tmp_path, capfd, curves):
    pytest.importorskip("torch")
    plan = tmp_path / f"{name}.plan"
    plan.write_text(plan_text(name, **MATRIX[name]))
    metrics = tmp_path / "metrics.jsonl"
    status = main(["run", str(plan), "-o", str(tmp_path / "build"), "--check", "--metrics",
                   str(metrics), "--timeout", "60"])
    err = capfd.readouterr().err
    assert status == 0, err
    assert "every loss and parameter matches" in err
    curves[name] = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]


@pytest.mark.slow
def test_every_llama_plan_of_one_model_follows_the_same_curve(curves):
    if len(curves) < len(MATRIX):
        pytest.skip("needs the whole matrix")
    groups = {}
    for name, curve in curves.items():
        kv = MATRIX[name].get("kv", 2)
        tied = "tie_embeddings" in MATRIX[name].get("model", "")
        schedule = MATRIX[name].get("train", "")
        groups.setdefault((kv, tied, schedule), []).append((name, curve))
    for members in groups.values():
        first = members[0][1]
        for name, curve in members:
            assert curve == pytest.approx(first, rel=1e-5), name


def test_llama_parameters_and_gqa_shapes():
    plan = load_text(plan_text("shapes", kv=1)).plan
    # per layer: 2 norms (32) + q (32x32) + k, v (32x8 each) + o (32x32) + gate, up, down
    per_layer = 2 * 32 + 32 * 32 + 2 * 32 * 8 + 32 * 32 + 3 * 32 * 48
    assert memory.total_parameters(plan) == 128 * 32 + 4 * per_layer + 32 + 32 * 128
    tp2 = load_text(plan_text("shapes", kv=1, mesh="tp = 2")).plan
    # q, o, gate, up, down split over tp; the single k/v head and the norms whole
    assert memory.layer_parameters(tp2) == (2 * 32 + 32 * 16 + 2 * 32 * 8 + 16 * 32
                                            + 3 * 32 * 24)


def _errors(text: str) -> list[str]:
    loaded = load_text(text)
    return [f"{d.span.line}:{d.span.column}: {d.message}" for d in loaded.diagnostics
            if d.is_error]


def _llama(keys: str, rest: str = "") -> str:
    return (f"plan bad {{ model llama {{ layers = 2; hidden = 32; heads = 4; {keys}; "
            f"vocab = 128; seq = 16; batch = 8 }} {rest} }}")


def test_llama_checks_name_the_rule_at_its_place():
    assert _errors(_llama("kv_heads = 3; ffn = 48")) == [
        "1:73: kv_heads (3) must divide heads (4): each key/value head serves a group of "
        "query heads"]
    assert _errors(_llama("kv_heads = 2")) == ["1:12: model llama is missing the key 'ffn'"]
    assert _errors(_llama("ffn = 48", "mesh { tp = 2 } shard { tp { qkv = row } }")) == [
        "1:142: qkv = row is not a placement of model llama"]
    odd = ("plan bad { model llama { layers = 2; hidden = 36; heads = 12; ffn = 48; "
           "vocab = 128; seq = 16; batch = 8 } }")
    assert _errors(odd) == ["1:59: the head dimension hidden / heads = 3 is odd; rotary "
                            "embedding turns pairs of features"]
    three = ("plan bad { model llama { layers = 2; hidden = 96; heads = 12; kv_heads = 3; "
             "ffn = 48; vocab = 128; seq = 16; batch = 8 } mesh { tp = 2 } }")
    assert _errors(three) == [
        "1:134: kv_heads (3) and tp (2) must divide one another: each rank takes kv_heads / "
        "tp key/value heads, or shares one with tp / kv_heads ranks"]
    # one error for a misspelt preset, not one per key it would have set
    assert _errors("plan bad { model llama { preset = llama3-9b; batch = 8 } }") == [
        "1:35: unknown value 'llama3-9b'; expected llama3-8b, llama3-70b, llama3-405b or "
        "qwen3-8b"]


def test_llama_presets_are_the_published_configurations_and_keys_override_them():
    plan = load_text("plan p { model llama { preset = llama3-8b; batch = 4; layers = 2 } }").plan
    m = plan.model
    assert (m.family, m.layers, m.hidden, m.heads, m.kv_heads, m.ffn, m.vocab, m.seq,
            m.rope_theta, m.dtype) == ("llama", 2, 4096, 32, 8, 14336, 128256, 8192,
                                       500000.0, "bf16")
    big = load_text((PLANS / "llama3-405b.plan").read_text()).plan
    assert memory.total_parameters(big) == 405_853_388_800  # "405B" (Dubey et al. 2024)
    assert (big.mesh.tp, big.mesh.cp, big.mesh.pp, big.mesh.dp) == (8, 1, 16, 128)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_rotary_embedding_of_q_and_k_is_the_rotate_half_formula_bit_for_bit(dtype):
    """RotateQK (one output, its gradient by hand) against rotate-half applied to q and
    k and concatenated with v, differentiated by autograd: the same bits forward and
    backward, with 8 query heads, 4 key/value heads of 32 features and odd positions."""
    import torch

    from planc.runtime.families.llama import RotateQK, rotary_tables, rotate, rotate_qk_formula

    kind = getattr(torch, dtype)
    heads, kv, hd, b, s = 8, 4, 32, 3, 5
    generator = torch.Generator().manual_seed(7)
    out = torch.randn(b, s, (heads + 2 * kv) * hd, generator=generator).to(kind)
    grad = torch.randn(out.shape, generator=generator).to(kind)
    cos, sin = rotary_tables(torch.tensor([3, 4, 9, 10, 17]), hd, 10000.0, kind)

    def by_formula(x):
        q = x[..., :heads * hd].reshape(b, s, heads, hd)
        k = x[..., heads * hd:(heads + kv) * hd].reshape(b, s, kv, hd)
        return torch.cat([rotate(q, cos, sin).reshape(b, s, -1),
                          rotate(k, cos, sin).reshape(b, s, -1),
                          x[..., (heads + kv) * hd:]], dim=-1)

    leaves = [out.clone().requires_grad_(True) for _ in range(2)]
    expected = by_formula(leaves[0])
    got = RotateQK.apply(leaves[1], cos, sin, (heads + kv) * hd, hd)
    assert torch.equal(got, expected)
    # the formula optimize { compile = on } hands to torch.compile, run eagerly: the same
    assert torch.equal(rotate_qk_formula(out, cos, sin, (heads + kv) * hd, hd),
                       expected.detach())
    (expected_grad,) = torch.autograd.grad(expected, leaves[0], grad)
    (got_grad,) = torch.autograd.grad(got, leaves[1], grad)
    assert torch.equal(got_grad, expected_grad)
    # v passes through untouched, and the rotation moved q and k
    assert torch.equal(got[..., (heads + kv) * hd:], out[..., (heads + kv) * hd:])
    assert not torch.equal(got[..., :heads * hd], out[..., :heads * hd])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_swiglu_is_silu_of_the_gate_times_up_bit_for_bit(dtype):
    """SwiGLU (its gradient by hand into one tensor) against silu(gate) * up on the two
    halves, differentiated by autograd: the same bits forward and backward."""
    import torch
    import torch.nn.functional as F

    from planc.runtime.families.llama import SwiGLU

    kind = getattr(torch, dtype)
    generator = torch.Generator().manual_seed(11)
    both = torch.randn(3, 5, 2 * 24, generator=generator).to(kind)
    grad = torch.randn(3, 5, 24, generator=generator).to(kind)
    leaves = [both.clone().requires_grad_(True) for _ in range(2)]
    gate, up = leaves[0].chunk(2, dim=-1)
    expected = F.silu(gate) * up
    got = SwiGLU.apply(leaves[1])
    assert torch.equal(got, expected)
    (expected_grad,) = torch.autograd.grad(expected, leaves[0], grad)
    (got_grad,) = torch.autograd.grad(got, leaves[1], grad)
    assert torch.equal(got_grad, expected_grad)
    assert not torch.equal(got_grad[..., :24], got_grad[..., 24:])


def test_swiglus_backward_lets_silu_of_the_gate_go_once_read():
    """Its backward makes silu(gate) again, reads it for up's gradient, and lets it go
    before gate's gradient needs a temporary of the same width: one ffn-wide tensor at a
    time beside the two halves' gradient."""
    import torch

    from planc.runtime.families.llama import SwiGLU
    from tests.conftest import most_alive

    both = torch.randn(3, 5, 48, requires_grad=True)
    out = SwiGLU.apply(both)
    grad = torch.randn(3, 5, 24)
    assert most_alive((3, 5, 24), lambda: torch.autograd.grad(out, both, grad)) == 1


def _saved_shapes(run):
    """The shapes of the tensors autograd keeps for the backward of what ``run`` computes,
    and whether each shares the storage of one of ``run``'s own tensors."""
    import torch

    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        out = run()
    return out, kept


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_swiglu_keeps_its_input_alone(dtype):
    """Megatron-LM's fused bias-SwiGLU keeps its input and computes silu(gate) again in
    the backward: nothing ffn-wide beside the input (autograd would keep silu(gate))."""
    import torch

    from planc.runtime.families.llama import SwiGLU

    both = torch.randn(3, 5, 48).to(getattr(torch, dtype)).requires_grad_(True)
    _, kept = _saved_shapes(lambda: SwiGLU.apply(both))
    assert [tuple(t.shape) for t in kept] == [(3, 5, 48)]
    assert kept[0].untyped_storage().data_ptr() == both.untyped_storage().data_ptr()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("shape", [(3, 5, 24), (2, 7, 512), (4, 33), (2, 3, 4, 64)])
def test_rms_norm_by_hand_is_the_formula_bit_for_bit_and_keeps_less(dtype, shape):
    """RMSNorm with its backward by hand against transformers' formula differentiated by
    autograd (its derivative rules, operation for operation): the same bits forward and
    backward, for a block's norm and for a head's q/k norm (4-d); it keeps the input, the
    weight and one root per row, where autograd keeps the normalised input too (and, for
    a 16-bit input, an fp32 copy of it)."""
    import torch

    from planc.runtime.families.llama import RMSNorm, rms_norm_formula

    kind = getattr(torch, dtype)
    generator = torch.Generator().manual_seed(5)
    x = (3 * torch.randn(*shape, generator=generator)).to(kind)
    weight = torch.randn(shape[-1], generator=generator).to(kind)
    grad = torch.randn(*shape, generator=generator).to(kind)
    formula = [x.clone().requires_grad_(True), weight.clone().requires_grad_(True)]
    by_hand = [x.clone().requires_grad_(True), weight.clone().requires_grad_(True)]
    expected, kept_by_autograd = _saved_shapes(lambda: rms_norm_formula(*formula, 1e-5))
    got, kept = _saved_shapes(lambda: RMSNorm.apply(*by_hand, 1e-5))
    assert torch.equal(got, expected)
    for a, b in zip(torch.autograd.grad(got, by_hand, grad),
                    torch.autograd.grad(expected, formula, grad)):
        assert torch.equal(a, b)
    rows = shape[:-1] + (1,)
    assert [(tuple(t.shape), t.dtype) for t in kept] == [
        (shape, kind), ((shape[-1],), kind), (rows, torch.float32)]
    assert sum(t.numel() * t.element_size() for t in kept) < \
        sum(t.numel() * t.element_size() for t in kept_by_autograd)
    # a weight of another dtype than the input (fp32 beside a 16-bit input): the same bits
    formula[1], by_hand[1] = (weight.float().requires_grad_(True) for _ in range(2))
    expected = rms_norm_formula(*formula, 1e-5)
    got = RMSNorm.apply(*by_hand, 1e-5)
    assert torch.equal(got, expected)
    for a, b in zip(torch.autograd.grad(got, by_hand, grad.to(got.dtype)),
                    torch.autograd.grad(expected, formula, grad.to(got.dtype))):
        assert torch.equal(a, b)


def test_each_pass_of_a_split_backward_computes_one_gradient_of_the_norm():
    """zb1p's B step asks the norm for its input's gradient and its W step for its
    weight's: each pass computes its own (one sum each: the root's gradient over the
    features, the weight's over the tokens), and they are the formula's, bit for bit."""
    import torch

    from planc.runtime.families.llama import normed, rms_norm_formula
    from tests.conftest import counting

    generator = torch.Generator().manual_seed(6)
    x = torch.randn(3, 5, 32, generator=generator, requires_grad=True)
    weight = torch.randn(32, generator=generator, requires_grad=True)
    grad = torch.randn(3, 5, 32, generator=generator)
    whole = torch.autograd.grad(rms_norm_formula(x, weight, 1e-5), [x, weight], grad)
    out = normed(x, weight, 1e-5)
    with counting(torch.ops.aten.sum.dim_IntList) as inputs_pass:
        (dx,) = torch.autograd.grad(out, [x], grad, retain_graph=True)
    with counting(torch.ops.aten.sum.dim_IntList) as weights_pass:
        (dw,) = torch.autograd.grad(out, [weight], grad)
    assert (inputs_pass.count, weights_pass.count) == (1, 1)
    assert torch.equal(dx, whole[0]) and torch.equal(dw, whole[1])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("layout", ["contiguous", "column-major", "strided"])
def test_joined_weights_multiply_as_their_concatenation_bit_for_bit(dtype, layout):
    """x @ cat(q, k, v) in one GEMM, keeping the weights instead of their concatenation,
    against autograd's matmul of the concatenation: the same bits forward and backward,
    whole or split into an input half and a weight half (zero-bubble's B and W)."""
    import torch

    from planc.runtime.engine.fp8 import joined_matmul

    kind = getattr(torch, dtype)
    generator = torch.Generator().manual_seed(7)
    if layout == "column-major":
        x = torch.randn(32, 40, generator=generator).to(kind).t()  # (40, 32), transposed
    elif layout == "strided":
        x = torch.randn(2, 20, 64, generator=generator).to(kind)[..., ::2]
    else:
        x = torch.randn(2, 20, 32, generator=generator).to(kind)
    weights = [torch.randn(32, n, generator=generator).to(kind) for n in (32, 8, 8)]
    grad = torch.randn(*x.shape[:-1], 48, generator=generator).to(kind)
    leaves = [[x.detach().requires_grad_(True)] + [w.clone().requires_grad_(True)
                                                   for w in weights] for _ in range(3)]
    expected = leaves[0][0] @ torch.cat(leaves[0][1:], dim=1)
    got = joined_matmul(leaves[1][0], leaves[1][1:])
    assert torch.equal(got, expected)
    wanted = torch.autograd.grad(expected, leaves[0], grad)
    for a, b in zip(torch.autograd.grad(got, leaves[1], grad), wanted):
        assert torch.equal(a, b)
    split = joined_matmul(leaves[2][0], leaves[2][1:])
    (first,) = torch.autograd.grad(split, leaves[2][:1], grad, retain_graph=True)
    assert torch.equal(first, wanted[0])
    for a, b in zip(torch.autograd.grad(split, leaves[2][1:], grad), wanted[1:]):
        assert torch.equal(a, b)


def test_joined_weights_keep_no_copy_and_each_half_of_a_split_backward_one_gemm():
    """What the forward leaves allocated is its output, not a copy of the weights (64 MiB
    here, glibc's count of the bytes in use); the input half of a split backward runs one
    GEMM and the weight half one, as autograd's own mm derivative computes only what is
    asked (a hand-written backward computed both each time)."""
    import ctypes

    import torch
    from torch.profiler import ProfilerActivity, profile

    from planc.runtime.engine.fp8 import joined_matmul

    class Mallinfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
            "uordblks", "fordblks", "keepcost")]

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = Mallinfo2

    def in_use() -> int:
        info = libc.mallinfo2()
        return info.uordblks + info.hblkhd

    weights = [torch.randn(4096, 2048).requires_grad_(True) for _ in range(2)]
    x = torch.randn(8, 4096).requires_grad_(True)
    before = in_use()
    out = joined_matmul(x, weights)
    # the output (128 KiB) and the GEMM library's first buffers, not the 64 MiB copy
    assert in_use() - before < 16 << 20
    grad = torch.randn_like(out)
    for targets in ([x], weights):
        with profile(activities=[ProfilerActivity.CPU]) as run:
            torch.autograd.grad(out, targets, grad, retain_graph=True)
        assert sum(e.count for e in run.key_averages() if e.key == "aten::mm") == 1


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.parametrize("device,dtype,tolerance", [
    ("cpu", "float32", 1e-5),
    pytest.param("cuda", "bfloat16", 2e-2, marks=pytest.mark.skipif(
        not _cuda_available(), reason="needs a CUDA GPU"))])
def test_grouped_query_attention_keeps_the_key_value_heads_unrepeated(device, dtype,
                                                                       tolerance):
    """On a CPU, and on CUDA in 16 bits (its flash kernel), torch's attention reads each
    k/v head for its group of query heads: the backward keeps q, k, v and the output as
    they are, never k and v repeated per query head (heads / kv_heads times their size);
    the values are the repeated heads' (the gradients of k and v are their groups' sums,
    in another order)."""
    import torch
    import torch.nn.functional as F

    from planc.runtime.families.llama import attention

    heads, kv, hd, b, s = 8, 2, 16, 2, 12
    model = SimpleNamespace(heads=heads, key_value_heads=kv, head_dim=hd, hidden=heads * hd)
    k = SimpleNamespace(head_dim=hd, ctx=SimpleNamespace(model=model, tp=1))
    spec = SimpleNamespace(ring=None)
    qkv = torch.randn(b, s, (heads + 2 * kv) * hd, generator=torch.Generator().manual_seed(3))
    qkv = qkv.to(device=device, dtype=getattr(torch, dtype))
    leaf = qkv.clone().requires_grad_(True)
    out, kept = _saved_shapes(lambda: attention(k, spec, {"x": leaf}, None, 0, 0, {}))
    q = qkv[..., :heads * hd].reshape(b, s, heads, hd).transpose(1, 2)
    key, v = qkv[..., heads * hd:].reshape(b, s, 2, kv, hd).permute(2, 0, 3, 1, 4).unbind(0)
    expected = F.scaled_dot_product_attention(
        q, key.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1),
        is_causal=True).transpose(1, 2).reshape(b, s, heads * hd)
    assert torch.allclose(out, expected, rtol=tolerance, atol=tolerance / 10)
    # q, k and v as they came, and the output; beside them CUDA's flash kernel keeps a
    # statistic a query row (seen on an H200: its logsumexp, b x heads x s x 1)
    four_d = [tuple(t.shape) for t in kept if t.dim() == 4 and t.shape[-1] == hd]
    assert sorted(four_d) == sorted([(b, heads, s, hd), (b, kv, s, hd), (b, kv, s, hd),
                                     (b, heads, s, hd)])
    assert all(t.numel() <= b * heads * s for t in kept if t.dim() == 4 and t.shape[-1] != hd)
