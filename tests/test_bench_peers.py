"""bench/peers.py compares planc with PyTorch's own APIs on the same function: its PyTorch
peers start from planc's initial weights and train on planc's batches
(bench/peers_torch.py), so that their first loss is planc's. Checked here on the
module itself, in this process (the benchmark checks it again on every run)."""

from __future__ import annotations

import sys

import pytest

from tests.conftest import ROOT

torch = pytest.importorskip("torch")
# bench/ holds modules named like common ones (parse, compile, run): on the path only
# while the two benchmark modules are imported
_saved_path = list(sys.path)
sys.path.insert(0, str(ROOT / "bench"))
try:
    import peers  # noqa: E402
    import peers_torch  # noqa: E402
finally:
    sys.path[:] = _saved_path

from planc.lang import load_text  # noqa: E402
from planc.runtime.engine.data import batch_tokens  # noqa: E402
from planc.runtime.oracle.reference import forward_loss, initial_values  # noqa: E402


@pytest.fixture(scope="module")
def bench():
    loaded = load_text(peers.plan_text({}, 8), "bench.plan")
    assert loaded.ok, loaded.diagnostics
    return loaded.plan, peers_torch.Config(**peers_torch.DEFAULTS)


def test_the_peers_start_from_plancs_initial_weights(bench):
    plan, config = bench
    ours = initial_values(plan)
    model = peers_torch.GPT(config)
    theirs = dict(model.named_parameters())
    assert len(theirs) == len(ours) == 53
    for name, value in ours.items():
        peer, transposed = peers_torch._peer_name(name)
        assert torch.equal(theirs[peer].detach(), value.t() if transposed else value), name


def test_the_peers_first_loss_is_plancs(bench):
    """The batches are planc's, token for token, and the plain module's loss on the first
    one is the reference model's (the --check oracle's) to a few fp32 ulps."""
    plan, config = bench
    tokens = peers_torch.batch(config, 0)
    assert torch.equal(tokens, batch_tokens(plan, 0))
    assert not torch.equal(tokens, batch_tokens(plan, 1))
    with torch.no_grad():
        logits = peers_torch.GPT(config)(tokens[:, :-1])
        theirs = peers_torch.loss_fn(logits, tokens[:, 1:]).item()
        ours = forward_loss(plan, initial_values(plan), tokens).item()
    assert abs(theirs - ours) <= peers.SAME_LOSS * abs(ours), (theirs, ours)
    assert abs(ours - 7.6857) < 1e-4  # ln(2048) = 7.62 and the weights' spread


def test_a_different_function_stops_the_benchmark():
    with pytest.raises(SystemExit, match=r"dp 2: planc's first loss 7\.5 and the peer's 7\.6 "
                                         r"differ: the two sides do not train the same "
                                         r"function"):
        peers.same_function("dp 2", {"planc": 7.5, "peer": 7.6})
    peers.same_function("dp 2", {"planc": 7.685673236846924, "peer": 7.685673713684082})
