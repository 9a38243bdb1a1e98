"""ZeRO-3 holds shards between uses (planc.runtime.engine.store): a unit's gathered
parameters go once its forward is done, though autograd keeps views of them, and come
back, the same values, for its backward; a bucket's whole gradient goes once its shard
took the microbatch's sum. Seen from inside both ranks of a real 2-rank run."""

from __future__ import annotations

import textwrap

import pytest

from conftest import one_rank_printed, run_ranks

PLAN = """plan zero3_held {
  model llama { layers = 3; hidden = 64; heads = 4; kv_heads = 2; ffn = 176; vocab = 256;
                seq = 32; batch = 4; dtype = DTYPE }
  mesh { dp = 2 }
  topology { devices_per_node = 2; device { flops = 989TFLOP/s; memory = 80GB }
             intra { bandwidth = 450GB/s; latency = 2us } }
  shard { dp { zero = 3 } }
  schedule { microbatches = 2 }
  train { steps = 2; optimizer = adamw(lr = 1e-3); seed = 0 }
}
"""

# Every whole bucket the forward's gathers made is noted, by step and microbatch (its
# storage, which outlives the tensor the program frees); after each instruction, the
# bytes those of its step and microbatch still hold. After the run, the bytes each
# bucket's whole gradient holds.
RANK = textwrap.dedent("""
    import json, sys
    import planc.runtime.worker as worker
    from planc.runtime.engine.interpreter import Interpreter
    from planc.runtime.engine.store import ParamStore
    forward_wholes, held, stores = {}, {}, []
    transfer = Interpreter._transfer
    def noting(self, state, step, mb):
        out = transfer(self, state, step, mb)
        if step.node.startswith("F/") and ":all_gather@" in step.node:  # a forward's gather
            forward_wholes.setdefault((state.step, mb), []).append(out.untyped_storage())
        return out
    Interpreter._transfer = noting
    instruction = Interpreter.instruction
    def reporting(self, op, node, microbatch, frees):
        run = instruction(self, op, node, microbatch, frees)
        def ran(state):
            run(state)
            held[f"{state.step}:{node}#{microbatch}"] = sum(
                s.nbytes() for s in forward_wholes.get((state.step, microbatch), ()))
        return ran
    Interpreter.instruction = reporting
    from planc.runtime.engine.interpreter import StepState
    settle, parked = StepState.settle, []
    def settling(self):
        parked.append(sorted(f"{g}#{mb}" for g, mb in self.let_go))
        return settle(self)
    StepState.settle = settling
    init = ParamStore.__init__
    def keeping(self, *args, **kwargs):
        init(self, *args, **kwargs)
        stores.append(self)
    ParamStore.__init__ = keeping
    status = worker.main([sys.argv[1], "--steps", "2"])
    store = stores[0]
    print(json.dumps({
        "status": status, "held": held, "parked": parked,
        "bucket_bytes": {b: store.buckets[b]["padded"] for b in store.buckets},
        "grad_bytes": {b: g.untyped_storage().nbytes() for b, g in store.grad.items()}}))
""")


@pytest.mark.parametrize("dtype,size", [("fp32", 4), ("bf16", 2)])
def test_a_unit_holds_its_whole_parameters_only_while_it_is_used(tmp_path, dtype, size):
    ranks = run_ranks(RANK, tmp_path, world=2, plan_text=PLAN.replace("DTYPE", dtype))
    for done in ranks:
        seen = one_rank_printed(done)
        assert seen["status"] == 0
        buckets = seen["bucket_bytes"]
        # the units: the embedding, three blocks, the final norm and head
        assert len(buckets) == 5
        whole = sum(buckets.values()) * size
        largest = max(buckets.values()) * size
        # At the end of a microbatch's forward every unit had been gathered whole; all
        # but the head's (which the backward gathers at once, on its own stream) and
        # one block's (the next to be gathered for the backward) are let go.
        at_loss = seen["held"]["1:F/loss#0"]  # the second step
        assert at_loss <= 2 * largest < whole
        # a bucket's whole gradient is let go after its reduce-scatter
        assert seen["grad_bytes"] == {bucket: 0 for bucket in buckets}
        # every bucket let go went back to its backward: none waits until the step's end
        # (the head's, whose backward gather runs before its forward lets it go, did:
        # whole again for the backward, then held by the step for every microbatch)
        assert seen["parked"] == [[], []]


def _saved_matmul(whole):
    """``x @ w`` with ``w`` a view of ``whole``, as a ZeRO-3 forward step reads a
    parameter: autograd saves the view."""
    import torch

    torch.manual_seed(0)
    x = torch.randn(2, 3, requires_grad=True)
    w = whole[4:16].view(3, 4).detach().requires_grad_()
    return x, w, (x @ w).square().sum()


@pytest.mark.parametrize("how", ["gathered into", "refilled"])
def test_the_backward_reads_the_values_the_forward_saved_after_they_were_let_go(how):
    import torch

    from planc.runtime.engine import store

    source = torch.arange(20, dtype=torch.float32) / 7  # what both gathers bring
    x, w, loss = _saved_matmul(source.clone())
    expected = torch.autograd.grad(loss, [x, w])
    whole = source.clone()
    x, w, loss = _saved_matmul(whole)
    assert store.let_go(whole) is whole
    assert whole.untyped_storage().nbytes() == 0 and w.untyped_storage().nbytes() == 0
    if how == "gathered into":  # the backward's gather ran after the forward let it go
        store.filled_again(whole).copy_(source)
        store.refill({"b": whole}, {})  # nothing left to do: no gather needed
    else:  # it ran first, into a buffer of its own
        store.refill({"b": whole}, {"b": source})
    # the copy is not a change of what autograd saved: no version error, the same bits
    got = torch.autograd.grad(loss, [x, w])
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_a_let_go_bucket_with_no_gather_to_refill_it_is_a_clear_error():
    import torch

    from planc.runtime.engine import store

    whole = store.let_go(torch.ones(8))
    with pytest.raises(RuntimeError, match="^the backward reads bucket c0.b1 the forward "
                                           "let go, but the program gives it no gather "
                                           "of that bucket$"):
        store.refill({"c0.b1": whole}, {"c0.b2": torch.ones(8)})


def test_only_gathers_no_backward_reads_are_let_go_and_each_backward_gather_fills_its_own():
    from types import SimpleNamespace as Step

    from planc.program.operands import StepKind
    from planc.runtime.engine import store

    steps = [Step(node="F/a", kind=StepKind.FORWARD, forward_of=None,
                  gathered={"b0": "F/g0", "b1": "F/g1"}),
             Step(node="R/a", kind=StepKind.RECOMPUTE, forward_of="F/a",
                  gathered={"b0": "B/g0"}),
             Step(node="B/a", kind=StepKind.BACKWARD, forward_of="F/a",
                  gathered={"b0": "B/g0", "b1": "B/g1"}),
             Step(node="F/t", kind=None, forward_of=None, gathered={"b2": "F/g2"}),
             Step(node="F/u", kind=StepKind.FORWARD, forward_of=None, gathered={}),
             Step(node="X", kind=StepKind.OPTIMIZER, forward_of=None, gathered={})]
    forward = store.forward_gathers(steps)
    assert forward == {"F/g0", "F/g1", "F/g2"}
    assert store.pairs(steps, forward) == {"B/g0": "F/g0", "B/g1": "F/g1"}


@pytest.mark.parametrize("pipeline, backward_gathers", [("1f1b", 3 * 4), ("gpipe", 5 * 4)])
def test_the_heads_unit_is_kept_for_its_backward_where_it_follows_at_once(
        pipeline, backward_gathers):
    """Under 1F1B a microbatch's head backward comes right after its forward: the head's
    unit is not gathered a second time (FSDP2 keeps its root module so), nor is the last
    block's, whose backward follows the head's (torchtitan keeps it so): the backward
    gathers the embedding's, layer 0's and layer 1's units. Under GPipe every
    microbatch's forward comes first, and keeping each head would hold 4 units."""
    from planc.compile import compile_plan
    from planc.graph.ir import NodeType, Payload, Phase
    from planc.lang import load_text

    text = PLAN.replace("DTYPE", "fp32").replace("batch = 4", "batch = 8").replace(
        "microbatches = 2", f"microbatches = 4; pipeline = {pipeline}")
    graph = compile_plan(load_text(text).plan).graph
    gathers = {n: d for n, d in graph.nodes(data=True) if d["type"] == NodeType.TRANSFER
               and d.get("payload") == Payload.PARAM}
    counts = {phase: sum(d["repeat"] for d in gathers.values() if d["phase"] == phase)
              for phase in (Phase.FORWARD, Phase.BACKWARD)}
    assert counts == {Phase.FORWARD: 5 * 4, Phase.BACKWARD: backward_gathers}
    head = "F/c0.b0>head:all_gather@dp_cp"
    readers = sorted(graph.successors(head))
    if pipeline == "1f1b":
        assert readers == ["B/final_ln", "B/head", "F/final_ln", "F/head"]
        for unit in (head, "F/c0.b1>L2:all_gather@dp_cp"):
            assert gathers[unit]["reason"].endswith(
                "kept whole for its backward, which follows at once on the head's stage (as "
                "FSDP keeps its root module and torchtitan the last block)")
        assert sorted(graph.successors("F/c0.b1>L2:all_gather@dp_cp"))[:2] == \
            ["B/L2/fc1", "B/L2/fc2"]
    else:
        assert readers == ["F/final_ln", "F/head"]
        assert not any(s.startswith("B/") for s in
                       graph.successors("F/c0.b1>L2:all_gather@dp_cp"))


@pytest.mark.parametrize("pipeline", ["1f1b", "zb1p", "zbv"])
def test_the_kept_head_counts_among_the_two_units_gathered_at_once(pipeline):
    """The backward gathers the unit two after the head only once the head's backward is
    done: under a split backward the head's reduce-scatter waits for its W step, so
    nothing else held the third unit back (the head, L3 and L2 whole at once). The unit
    after the head is the last block's, kept from its forward: every unit the backward
    of the head's chunk gathers is at least the third."""
    import networkx as nx

    from planc.compile import compile_plan
    from planc.lang import load_text

    text = PLAN.replace("DTYPE", "fp32").replace("mesh { dp = 2 }", "mesh { pp = 2; dp = 2 }")
    text = text.replace("layers = 3", "layers = 8").replace("batch = 4", "batch = 8").replace(
        "devices_per_node = 2", "devices_per_node = 4").replace(
        "microbatches = 2", f"microbatches = 4; pipeline = {pipeline}").replace(
        "dp { zero = 3 }", "dp { zero = 3 }" + ("; pp { virtual = 2 }" if pipeline == "zbv"
                                                 else ""))
    loaded = load_text(text)
    assert loaded.plan is not None, [d.message for d in loaded.diagnostics]
    build = compile_plan(loaded.plan)
    graph = build.graph
    gathers = sorted(n for n in graph if n.startswith("B/") and ":all_gather@" in n
                     and graph.nodes[n]["chunk"] == graph.nodes["B/head"]["chunk"])
    two_after = [n for n in gathers if nx.has_path(graph, "B/head", n)]
    assert gathers and two_after == gathers, gathers


def test_an_evaluation_frees_the_gathers_training_keeps_for_the_backward():
    """The head's unit and the last block's are kept from their forward for their
    backward, whose last reader frees them; an evaluation batch runs no backward, so its
    forward's last reader of each frees it instead (without that, every microbatch's
    would stay until the batch ends)."""
    from planc.compile import compile_plan
    from planc.lang import load_text

    text = PLAN.replace("DTYPE", "fp32").replace("steps = 2;", "steps = 2; eval_every = 1;")
    program = compile_plan(load_text(text).plan).programs["stage0.json"]
    kept = ("F/c0.b0>head:all_gather@dp_cp", "F/c0.b1>L2:all_gather@dp_cp")

    def freeing(blocks):
        return {i.node: [b for b in i.frees if b in kept] for block in blocks.values()
                for i in block if set(i.frees) & set(kept)}

    assert all(not any(b in kept for b in i.frees) for i in program.blocks["F0"])
    assert freeing(program.for_evaluation().blocks) == {
        "F/L2/fc2": ["F/c0.b1>L2:all_gather@dp_cp"],
        "F/head": ["F/c0.b0>head:all_gather@dp_cp"]}
