"""tp_overlap's pieces of a GEMM's input: a row-parallel GEMM (and, without sequence
parallelism, a column-parallel one) reads copies of its tokens' pieces, which its weight
gradient reads again. The attention's output projection keeps how to take each piece of
the attention's output again, not the copy: that output, which the attention's backward
keeps, is held once, not twice (bench/memory_live.py, llama-fp32-tp2-sp-overlap: 431.2
MiB at the peak, then 423.2, against 422.8 without tp_overlap). Elsewhere nothing else
keeps the whole, and the copies are its bytes. Real 2-rank runs; that training computes
the same bits is tests/test_runtime_comm.py's and tests/test_llama.py's --check rows.
"""

from __future__ import annotations

import textwrap

import pytest

from conftest import one_rank_printed, run_ranks

LLAMA = """plan pieces {{
  model llama {{ layers = 2; hidden = 64; heads = 4; kv_heads = 2; ffn = 176; vocab = 256;
                seq = 32; batch = 4 }}
  mesh {{ tp = 2 }}
  topology {{ devices_per_node = 2; device {{ flops = 989TFLOP/s; memory = 80GB }}
             intra {{ bandwidth = 450GB/s; latency = 2us }} }}
  shard {{ tp {{ sequence_parallel = {sp} }} }}
  schedule {{ microbatches = 2 }}
  optimize {{ tp_overlap = 2{optimize} }}
  train {{ steps = 1; optimizer = adamw(lr = 1e-3); seed = 0 }}
}}
"""

# After each forward step of one piece: the bytes its kept input holds, and the bytes of
# what autograd saved of it, once unpacked, as the weight gradient will read it.
RANK = textwrap.dedent("""
    import json, sys
    import planc.runtime.worker as worker
    from planc.runtime.engine.kernels import Kernels
    forward = Kernels.forward
    kept = {}
    def noting(self, spec, *args, **kwargs):
        out, saved = forward(self, spec, *args, **kwargs)
        mb = args[3]
        if spec.tokens is not None and "x" in saved.inputs:
            x = saved.inputs["x"]
            name = f"L{spec.layer}/{spec.op.value}#t{spec.tokens[0]}#{mb}"
            kept[name] = [x.untyped_storage().nbytes(),
                          x.numel() * x.element_size()]
        return out, saved
    Kernels.forward = noting
    status = worker.main([sys.argv[1], "--steps", "1"])
    print(json.dumps({"status": status, "kept": kept}))
""")


def _kept(tmp_path, sp: str, optimize: str = "") -> list[dict]:
    ranks = run_ranks(RANK, tmp_path, world=2, plan_text=LLAMA.format(sp=sp,
                                                                      optimize=optimize))
    seen = [one_rank_printed(done) for done in ranks]
    assert [s["status"] for s in seen] == [0, 0]
    return [s["kept"] for s in seen]


def pieces(gemms: tuple[str, ...]) -> list[str]:
    return sorted(f"L{layer}/{gemm}#t{j}#{mb}" for layer in (0, 1) for gemm in gemms
                  for j in (0, 1) for mb in (0, 1))


@pytest.mark.parametrize("sp,optimize,copies", [
    # qkv's and fc1's pieces are their own all-gathers' outputs, not copies
    ("on", "", ("fc2",)),
    # down's pieces go once read, made again from gate and up (recompute_activation)
    ("on", "; recompute_activation = on", ()),
    # the norms' outputs, which their backward does not keep
    ("off", "", ("qkv", "fc1", "fc2"))], ids=["sp", "sp-recompute-activation", "no-sp"])
def test_the_output_projections_pieces_keep_no_copy(tmp_path, sp, optimize, copies):
    for kept in _kept(tmp_path, sp, optimize):
        assert sorted(kept) == pieces(("qkv", "fc1", "proj", "fc2"))
        for name, (held, size) in kept.items():
            gemm = name.split("/")[1].split("#")[0]
            width = {"qkv": 64, "fc1": 64, "proj": 32, "fc2": 88}[gemm]
            # a microbatch's 64 tokens in two pieces: 32 on each rank, gathered (16 each
            # with sequence parallelism) or of the replicated input
            assert size == 32 * 4 // 2 // 2 * width * 4, name
            kept_whole = gemm in copies or (sp == "on" and gemm in ("qkv", "fc1"))
            assert held == (size if kept_whole else 0), name
