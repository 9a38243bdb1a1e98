"""A rank of the ep group whose experts receive no row in a microbatch (routing that
collapses onto other ranks' experts, as DeepSeek-V3's sigmoid gate can early in
training) still runs the backward all-to-alls its peers wait for. Before the fix, it
skipped them and the group hung: moe-tiny with the sigmoid gate stopped at step 15."""

from __future__ import annotations

import pytest

from tests.conftest import script_on_ranks

pytest.importorskip("torch")

RANKS = r'''
import sys
from datetime import timedelta
import torch, torch.distributed as dist
from planc.lang import load_text
from planc.runtime.engine.kernels import Peers
from planc.runtime.families.moe import expert_parallel_mixture, mixture

rank, path = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", rank=rank, world_size=2, store=dist.FileStore(path, 2),
                        timeout=timedelta(seconds=30))
m = load_text("""plan p {
  model moe { layers = 2; hidden = 8; heads = 2; vocab = 16; seq = 4; batch = 2
              experts = 4; top_k = 2; expert_ffn = 8 }
  mesh { dp = 2; ep = 2 }
}""").plan.model
g = torch.Generator().manual_seed(0)
router = torch.full((8, 4), -1.0)
router[:, :2] = 1.0  # every token prefers experts 0 and 1, both on rank 0
weights = {"router.weight": router, "experts.gate.weight": torch.randn(4, 8, 8, generator=g),
           "experts.up.weight": torch.randn(4, 8, 8, generator=g),
           "experts.down.weight": torch.randn(4, 8, 8, generator=g)}
mine = {k: (v[2 * rank:2 * rank + 2] if k.startswith("experts.") else v).clone()
        .requires_grad_() for k, v in weights.items()}
tokens = (torch.rand(4, 8, generator=torch.Generator().manual_seed(1 + rank)) + 0.1) \
    .requires_grad_()
out = expert_parallel_mixture(tokens, mine.__getitem__, m, Peers(None, (0, 1), rank), 1, 1)
out.sum().backward()
alone = {k: v.clone().requires_grad_() for k, v in weights.items()}
same = tokens.detach().clone().requires_grad_()
mixture(same, alone.__getitem__, m).sum().backward()
print(torch.allclose(out, mixture(tokens.detach(), weights.__getitem__, m), atol=1e-6),
      torch.allclose(tokens.grad, same.grad, atol=1e-5),
      float(mine["experts.gate.weight"].grad.abs().sum()) > 0 if rank == 0 else
      mine["experts.gate.weight"].grad is None)
sys.stdout.flush()
os = __import__("os")
os._exit(0)
'''


def test_a_rank_whose_experts_get_no_rows_still_joins_the_backward(tmp_path):
    outputs = script_on_ranks(RANKS, tmp_path)
    # the output and the tokens' gradients as one process computes them; rank 0's experts
    # took every row (gradients), rank 1's none (no gradient: they never ran)
    assert [out.strip() for out, _ in outputs] == ["True True True"] * 2, outputs
