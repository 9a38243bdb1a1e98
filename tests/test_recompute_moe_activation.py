"""optimize { recompute_moe_activation }: the experts' SwiGLU product is not kept for the
down projection's backward but computed again from gate and up (Megatron-Core's
recompute_modules "moe_act"): the check's messages, the estimate and the simulator's
price, the bytes a forward leaves held, and training that computes the same bits."""

from __future__ import annotations

import ctypes
import gc
import textwrap

import pytest

from planc.cli import main
from planc.compile import compile_plan
from planc.estimate.kernel_cost import KernelModel
from planc.estimate.in_flight import layers_in_flight
from planc.estimate.memory import layer_activation_bytes, stage_activation_bytes
from planc.lang import load_text
from planc.lower.tabulate_model import model_table
from planc.simulate import simulate
from tests.conftest import one_rank_printed, run_ranks
from tests.test_moe import plan_text

ON = "recompute_moe_activation = on"


def _warnings(source: str) -> list[str]:
    return [d.message for d in load_text(source).diagnostics if d.severity == "warning"]


@pytest.mark.parametrize("source,why", [
    ("plan g { model gpt { layers = 2; hidden = 32; heads = 4; vocab = 64; seq = 8; "
     "batch = 2 } optimize { recompute_moe_activation = on } }",
     "model gpt has no experts"),
    (plan_text(optimize=f"recompute = full; {ON}"),
     "recompute = full keeps only each block's input"),
    (plan_text(extra="; fp8 = blockwise", optimize=ON),
     "FP8 experts keep gate and up and compute the product again already"),
    (plan_text(layers=2, dense=2, optimize=ON), "every block is dense (first_dense = 2)"),
])
def test_where_no_mixture_keeps_the_product_the_key_is_warned_about(source, why):
    assert _warnings(source) == [f"recompute_moe_activation = on has no effect: {why}"]
    # and it has none: the model table tells the runtime off, the estimates price nothing
    plan = load_text(source).plan
    assert not plan.recomputes_moe_activation
    assert not model_table(plan).recompute_moe_activation


def test_a_mixture_that_keeps_the_product_takes_it_silently():
    assert _warnings(plan_text(optimize=ON)) == []
    plan = load_text(plan_text(optimize=ON)).plan
    assert plan.recomputes_moe_activation and model_table(plan).recompute_moe_activation


def test_the_estimate_drops_one_product_per_routed_and_shared_row():
    """Per block and microbatch: (top_k + shared) rows a token, each expert_ffn wide in the
    dtype (fp32 here), on the tokens of a microbatch, over tp."""
    keep = load_text(plan_text(shared=1, mesh="tp = 2", m=2)).plan
    again = load_text(plan_text(shared=1, mesh="tp = 2", m=2, optimize=ON)).plan
    tokens = 16 * 2  # seq x sequences a microbatch (batch 4 over 2 microbatches)
    product = (2 + 1) * tokens * 24 * 4 / 2
    assert layer_activation_bytes(keep) - layer_activation_bytes(again) == product
    # the stage holds every block's of every microbatch in flight less one block's, which
    # its backward holds again for a moment
    for stage in range(keep.mesh.pp):
        (held, _), (held_again, _) = (stage_activation_bytes(p, stage) for p in (keep, again))
        assert held - held_again == (layers_in_flight(keep, stage) - 1) * product


H100 = "topology { preset = dgx-h100; nodes = 1; devices_per_node = 2 }\n  mesh {"


@pytest.mark.parametrize("step,split", [("backward", False), ("backward", True),
                                        ("weight", False), ("forward", False)])
def test_the_simulator_prices_the_product_again_wherever_a_backward_unpacks_it(step, split):
    """Gate and up read and the product written, on the busiest rank's routed rows and on
    the shared expert's tokens, with a launch each: in a whole backward, and in both halves
    of a split one (autograd unpacks a GEMM's saved input in either); none in the
    forward."""
    text = plan_text(shared=1, mesh="dp = 2; ep = 2", m=2).replace("mesh {", H100)
    keep = KernelModel.of(load_text(text).plan)
    again = KernelModel.of(load_text(text.replace("train {", f"optimize {{ {ON} }}\n  "
                                                  "train {")).plan)
    assert again.mixture.product_recomputed and not keep.mixture.product_recomputed
    tokens = 1000.0
    widths = {"moe_experts": 24 * tokens * 2 * again.mixture.imbalance,  # ffn x routed rows
              "moe_shared": 24 * tokens, "moe_route": 0.0, "moe_combine": 0.0}
    for part, width in widths.items():
        more = again.mixture_part_seconds(part, step, tokens, split) - \
            keep.mixture_part_seconds(part, step, tokens, split)
        priced = 3 * width * 4 / again.bandwidth + again.gpu.launch \
            if width and step != "forward" else 0.0
        assert more == pytest.approx(priced, rel=1e-9, abs=1e-15), part


def test_simulate_takes_the_memory_off_and_the_time_on():
    def simulated(optimize: str = ""):
        return simulate(compile_plan(load_text(plan_text(
            shared=1, mesh="dp = 2; ep = 2", m=2, optimize=optimize).replace(
                "mesh {", H100)).plan))
    keep, again = simulated(), simulated(ON)
    assert again.step_seconds > keep.step_seconds
    assert again.stages[0].memory_bytes < keep.stages[0].memory_bytes


# --- what a forward leaves held --------------------------------------------------------------

class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def _in_use() -> int:
    """Bytes glibc's malloc has handed out (torch's CPU tensors come from it)."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _Mallinfo2
    gc.collect()
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped-gemms", "a-gemm-an-expert"])
def test_the_forward_leaves_the_product_unheld_and_the_backward_the_same_bits(grouped):
    torch = pytest.importorskip("torch")
    if not hasattr(ctypes.CDLL("libc.so.6"), "mallinfo2"):
        pytest.skip("glibc 2.33 or later is needed to count the bytes in use")
    from planc.runtime.families.moe_dispatch import Experts, outputs_by_expert

    experts, hidden, ffn, counts = 4, 64, 256, [256, 0, 512, 256]
    rows = sum(counts)

    def forward_and_backward(again: bool):
        g = torch.Generator().manual_seed(0)
        weights = [torch.randn(*shape, generator=g).requires_grad_() for shape in (
            (experts, hidden, ffn), (experts, hidden, ffn), (experts, ffn, hidden))]
        x = torch.randn(rows, hidden, generator=g).requires_grad_()
        scales = torch.rand(rows, 1, generator=g).requires_grad_()
        stacked = Experts(*weights)
        if not grouped:  # the loop an expert at a time (views of one product)
            object.__setattr__(stacked, "grouped", lambda _: False)
        before = _in_use()
        out = outputs_by_expert(x, scales, counts, stacked, None, again)
        held = _in_use() - before
        out.backward(torch.ones_like(out))
        return held, out.detach(), [t.grad for t in (*weights, x, scales)]

    forward_and_backward(False)  # torch's first allocations, out of the count
    kept, out_kept, grads_kept = forward_and_backward(False)
    recomputed, out_again, grads_again = forward_and_backward(True)
    product = rows * ffn * 4  # fp32: 1 MiB
    assert abs((kept - recomputed) - product) < 16 * 1024, (kept, recomputed)
    assert torch.equal(out_kept, out_again)
    assert all(torch.equal(a, b) for a, b in zip(grads_kept, grads_again))


# --- in real runs ------------------------------------------------------------------------

# How many times a rank computed a product again over one step.
RANK = textwrap.dedent("""
    import json, sys
    import planc.runtime.worker as worker
    from planc.runtime.families import recomputed_output
    computed = []
    view = recomputed_output._Product.view
    def counting(self, *layout):
        computed.append(self.whole is None)
        return view(self, *layout)
    recomputed_output._Product.view = counting
    status = worker.main([sys.argv[1], "--steps", "1"])
    print(json.dumps({"status": status, "computed": computed}))
""")


@pytest.mark.parametrize("optimize,expected", [(ON, 12), ("", 0)], ids=["on", "off"])
def test_each_rank_computes_each_product_once_in_the_backward(tmp_path, optimize, expected):
    """3 mixtures x 2 microbatches, each a routed and a shared expert's product: each
    computed again once, where its down projection's backward reads it."""
    ranks = run_ranks(RANK, tmp_path, world=2, plan_text=plan_text(
        shared=1, mesh="dp = 2; ep = 2", m=2, optimize=optimize))
    for done in ranks:
        seen = one_rank_printed(done)
        assert seen["status"] == 0
        assert seen["computed"] == [True] * expected


# --- training ----------------------------------------------------------------------------

def _trained(tmp_path, name: str, **plan) -> dict[str, bytes]:
    """The checkpoint's files after 2 steps of a real run of the plan (every run's plan
    of one name, which the manifest records)."""
    source = tmp_path / f"{name}.plan"
    source.write_text(plan_text("trained", **plan))
    build, checkpoints = tmp_path / f"build-{name}", tmp_path / f"checkpoints-{name}"
    assert main(["compile", str(source), "-o", str(build)]) == 0
    assert main(["run", str(build), "--steps", "2", "--checkpoint-dir", str(checkpoints)]) == 0
    step = checkpoints / "step-000002"
    return {f.name: f.read_bytes() for f in sorted(step.iterdir())}


LAYOUTS = {
    # the mixture in one step, its experts over ep behind the all-to-alls, shared experts
    "ep2-over-tp2-sp": dict(mesh="tp = 2; ep = 2", shared=1,
                            shard="tp { sequence_parallel = on }"),
    # cut at its all-to-alls, the experts' weight gradients a step of their own (zb1p)
    "ep2-over-dp2-pp2-zb1p-cut": dict(mesh="pp = 2; dp = 2; ep = 2", layers=4, m=4, batch=8,
                                      shared=1,
                                      schedule="; pipeline = zb1p; overlap_all_to_all = on"),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_training_computes_the_same_bits_as_keeping_the_product(tmp_path, layout):
    pytest.importorskip("torch")
    case = LAYOUTS[layout]
    keep = _trained(tmp_path, "keep", **case)
    again = _trained(tmp_path, "again", **case, optimize=ON)
    assert sorted(keep) == sorted(again)
    assert [name for name in keep if keep[name] != again[name]] == []
