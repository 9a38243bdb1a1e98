"""Token dropping (issue 40): ``model moe { capacity = F }``. Each expert takes the first
ceil(F x seq x top_k / experts) tokens of each sequence that chose it, by position, the
rest of its (token, expert) pairs dropped, the same tokens in every plan as in one
process: so --check holds under tp, cp, pp, dp and ep; the simulator and the memory
estimate take the bound."""

from __future__ import annotations

import pytest

from planc.cli import main
from planc.lang import load_text
from planc.models import moe
from tests.test_moe_balance_bias import plan_text as balanced_plan
from tests.test_moe_sigmoid_gate import random_weights

torch = pytest.importorskip("torch")

def plan_text(mesh: str = "tp = 2; dp = 2; ep = 4", layers: int = 3) -> str:
    """tests/test_moe_balance_bias.py's plan (DeepSeek-V3's gate at toy size, sequence
    parallelism on) with a capacity of 1 in place of its balancing bias."""
    return balanced_plan(mesh, layers).replace("bias_update = 0.01", "capacity = 1.0")


def model(capacity: str = "1.0"):
    return load_text(plan_text().replace("capacity = 1.0", f"capacity = {capacity}")
                     ).plan.model


def test_each_expert_takes_the_first_tokens_of_each_sequence_by_position():
    from planc.vocabulary.model_options import expert_capacity
    from planc.runtime.families.moe_gate import kept

    m = model("0.375")  # ceil(0.375 x 32 x 2 / 8) = 3 rows per expert and sequence
    assert expert_capacity(m) == 3
    # two sequences of 32 tokens; in the first, expert 5 is every token's first choice
    experts = torch.stack([torch.full((64,), 5), torch.arange(64) % 4], dim=1)
    experts[32:, 0] = 6
    keep = kept(experts, 2, torch.arange(32), m)
    assert keep[:, 0].tolist() == ([True] * 3 + [False] * 29) * 2
    # expert t % 4 of each sequence: its first 3 tokens of that residue kept
    assert keep[:32, 1].tolist() == [t < 12 for t in range(32)]
    # positions out of order: the earliest positions win, wherever the rows lie
    reversed_keep = kept(experts[:32].flip(0), 1, torch.arange(31, -1, -1), m)
    assert torch.equal(reversed_keep.flip(0), keep[:32])


def test_a_large_capacity_drops_nothing_and_a_small_one_changes_the_output():
    from planc.runtime.families.moe import mixture

    generator = torch.Generator().manual_seed(11)
    weights = random_weights(model(), generator)
    tokens = torch.randn(64, 64, generator=generator)
    dropless = load_text(plan_text().replace("; capacity = 1.0", "")).plan.model
    expected = mixture(tokens, weights.__getitem__, dropless, 2)
    assert torch.equal(mixture(tokens, weights.__getitem__, model("4.0"), 2), expected)
    assert not torch.allclose(mixture(tokens, weights.__getitem__, model("0.5"), 2),
                              expected)


@pytest.mark.parametrize("mesh, layers", [
    ("tp = 2; dp = 2; ep = 4", 3),  # the tp share's choices gathered over tp
    ("tp = 2; cp = 2; ep = 4", 3),  # over tp x cp, the cp chunks out of position order
    ("pp = 2; dp = 2; ep = 2", 4),
], ids=["tp2-sp-dp2-ep4", "tp2-cp2-ep4", "pp2-dp2-ep2"])
def test_training_with_capacity_matches_the_reference(tmp_path, mesh, layers, capsys):
    (tmp_path / "c.plan").write_text(plan_text(mesh, layers))
    assert main(["run", str(tmp_path / "c.plan"), "-o", str(tmp_path / "c"), "--check"]) == 0
    assert "every loss and parameter matches" in capsys.readouterr().err


def test_the_simulator_and_the_memory_estimate_take_the_bound():
    capped = load_text(plan_text()).plan
    dropless = load_text(plan_text().replace("; capacity = 1.0", "")).plan
    assert moe.routing_imbalance(dropless.model) == moe.PUBLISHED_IMBALANCE
    assert moe.routing_imbalance(capped.model) == 1.0
    assert moe.routing_imbalance(model("1.25")) == 1.25
    assert moe.routing_imbalance(model("0.5")) == 0.5  # no rank above half the mean
    # 128 tokens of 4 sequences on a rank, over tp 2: every one of the 4 ep ranks may
    # send 64 x min(2, 2) rows without a bound, 4 sequences x 2 experts x 8 with it
    row = 2 * 64 + 3 * 48  # input and output, gate, up and product; fp32
    assert moe.dispatch_bytes(dropless.model, dropless.mesh, 128) == 4 * 64 * 2 * row * 4
    assert moe.dispatch_bytes(capped.model, capped.mesh, 128) == 4 * 4 * 2 * 8 * row * 4


def test_capacity_reads_a_positive_number():
    loaded = load_text(plan_text().replace("capacity = 1.0", "capacity = 0"))
    assert not loaded.ok and "expected a number > 0, got 0" in str(loaded.diagnostics[0])


def test_the_metrics_record_the_share_of_pairs_dropped_the_same_on_every_layout(tmp_path):
    """Step 0 starts from the same weights on every layout, and the drops do not depend
    on the layout: the share is the same number; a capacity that holds every pair
    records 0."""
    import json

    shares = []
    for mesh, layers in (("tp = 2; dp = 2; ep = 4", 3), ("dp = 2; ep = 2", 3)):
        (tmp_path / "c.plan").write_text(plan_text(mesh, layers))
        metrics = tmp_path / f"{len(shares)}.jsonl"
        assert main(["run", str(tmp_path / "c.plan"), "-o", str(tmp_path / "c"), "--force",
                     "--steps", "1", "--metrics", str(metrics)]) == 0
        (record,) = [json.loads(line) for line in metrics.read_text().splitlines()]
        shares.append(record["moe_dropped"])
    assert 0.02 < shares[0] < 0.5 and shares[0] == shares[1]
    (tmp_path / "c.plan").write_text(plan_text().replace("capacity = 1.0", "capacity = 4.0"))
    assert main(["run", str(tmp_path / "c.plan"), "-o", str(tmp_path / "c"), "--force",
                 "--steps", "1", "--metrics", str(tmp_path / "all.jsonl")]) == 0
    assert json.loads((tmp_path / "all.jsonl").read_text())["moe_dropped"] == 0.0


def test_explain_names_the_capacitys_all_gathers_and_their_bytes(tmp_path, capsys):
    """tp 2 shares each sequence: per microbatch, 2 sequences x 16 tokens x 2 choices and
    16 positions, int64, from each rank: 640 B."""
    (tmp_path / "c.plan").write_text(plan_text())
    assert main(["explain", str(tmp_path / "c.plan"), "--layer", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    at = lines.index("layer 1: the capacity's all-gathers over sequence (2 ranks: [0, 1]), "
                     "inside the mixture's instruction")
    assert lines[at + 1] == ("  F  all_gather over sequence  640 B per microbatch from each "
                             "rank  [its choices of experts and its tokens' positions: int64]")


def test_the_mixture_gathers_its_tokens_once_and_adds_each_experts_outputs_in_turn():
    """The one-process mixture (a rank without ep, and --check's reference): its (token,
    slot) pairs sorted by expert, the tokens gathered once (one index, one index_put in
    the backward, where gathering per expert zero-filled a whole gradient of the tokens
    for each of the 8 experts), and the outputs added to their tokens one expert after
    another on one copy (8 in-place index_adds, one clone): a token's sum in expert
    order on every device; pairs the capacity drops run no expert."""
    from planc.runtime.families.moe import mixture
    from tests.conftest import counting

    generator = torch.Generator().manual_seed(11)
    weights = {name: value.requires_grad_() for name, value in
               random_weights(model(), generator).items()}
    tokens = torch.randn(64, 64, generator=generator, requires_grad=True)
    ops = torch.ops.aten
    for capacity in ("4.0", "0.5"):
        with counting(ops.index_add_.default) as adds, counting(ops.clone.default) as clones:
            out = mixture(tokens, weights.__getitem__, model(capacity), 2)
        assert (adds.count, clones.count) == (8, 1)
        with counting(ops.index_put.default) as puts:
            torch.autograd.grad(out.sum(), [tokens])
        assert puts.count == 2  # the tokens, and the routing weights of the pairs
