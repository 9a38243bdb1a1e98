"""shard { tp { gathered_inputs = regather } }: under sequence parallelism the forward of a
column-parallel GEMM keeps its input's shard and the backward all-gathers it again over tp
(Megatron-LM; Korthikanti et al. 2022, section 4.2.2). The graph's transfers, where the
programs issue them, what the memory estimate says, and, in real 2-rank runs, that the
gathered input is let go after the forward and that training computes the same bits as
keeping it."""

from __future__ import annotations

import json
import textwrap

import pytest

from planc.compile import compile_plan
from planc.estimate.memory import estimate, gathered_inputs_bytes
from planc.graph.ir import EdgeKind, Port
from planc.lang import load_text
from planc.program.expansion import expand

from conftest import one_rank_printed, run_ranks

PLAN = """plan regather {{
  model llama {{ layers = 2; hidden = 64; heads = 4; kv_heads = 2; ffn = 176; vocab = 256;
                seq = 32; batch = 4 }}
  mesh {{ tp = 2{mesh} }}
  topology {{ devices_per_node = 2; device {{ flops = 989TFLOP/s; memory = 80GB }}
             intra {{ bandwidth = 450GB/s; latency = 2us }} }}
  shard {{ tp {{ sequence_parallel = on; gathered_inputs = {inputs} }}{shard} }}
  schedule {{ microbatches = 2{schedule} }}
  optimize {{ recompute = {recompute}{optimize} }}
  train {{ steps = 2; optimizer = adamw(lr = 1e-3); seed = 0 }}
}}
"""


def text(inputs: str = "regather", recompute: str = "none", mesh: str = "", shard: str = "",
         schedule: str = "", optimize: str = "") -> str:
    return PLAN.format(inputs=inputs, recompute=recompute, mesh=mesh, shard=shard,
                       schedule=schedule, optimize=optimize)


def plan_of(source: str):
    loaded = load_text(source)
    assert loaded.ok, [d.message for d in loaded.diagnostics]
    return loaded.plan


def regathers(graph) -> dict[str, dict]:
    return {n: d for n, d in graph.nodes(data=True) if "regathers" in d}


QKV = ("B/L0/ln1>qkv:all_gather@tp", "B/L1/ln1>qkv:all_gather@tp")
FC1 = ("B/L0/ln2>fc1:all_gather@tp", "B/L1/ln2>fc1:all_gather@tp")
HEAD = ("B/final_ln>head:all_gather@tp",)


@pytest.mark.parametrize("recompute,expected", [
    ("none", QKV + FC1 + HEAD), ("selective", QKV + FC1 + HEAD),
    # qkv's input comes again from the recomputation, or the whole layer's does
    ("attention_inputs", FC1 + HEAD), ("full", HEAD)])
def test_each_gemm_that_differentiates_its_own_forward_gathers_its_input_again(
        recompute, expected):
    graph = compile_plan(plan_of(text(recompute=recompute))).graph
    found = regathers(graph)
    assert sorted(found) == sorted(expected)
    for node, data in found.items():
        forward = "F" + node[1:]
        assert data["regathers"] == forward
        assert (data["kind"], data["axis"], data["dim"], data["phase"]) == \
            ("all_gather", "tp", "seq", "backward")
        assert data["bytes"] == graph.nodes[forward]["bytes"]
        assert data["reason"].startswith(f"{data['consumer']}'s weight gradient reads its "
                                         f"input whole, which sequence parallelism")
        # from the shard the norm wrote, into the step that computes the weight gradient
        producer = "F/" + node.split("/", 1)[1].split(">")[0]
        assert graph.edges[producer, node]["port"] == Port.X
        (reader,) = graph.successors(node)
        assert graph.edges[node, reader]["port"] == Port.GATHERED
        layer = f"L{data['layer']}/" if data["layer"] is not None else ""
        assert graph.nodes[reader]["forward_of"] == f"F/{layer}{data['consumer']}"


def test_keeping_the_gathered_inputs_gathers_nothing_again():
    assert regathers(compile_plan(plan_of(text(inputs="keep"))).graph) == {}


def test_the_weight_half_of_a_split_backward_waits_for_it_and_the_input_half_does_not():
    # weight_grad_overlap splits each backward whose input gradient a tp collective takes
    graph = compile_plan(plan_of(text())).graph
    for node in QKV + FC1 + HEAD:
        (reader,) = graph.successors(node)
        assert reader.startswith("W/"), reader
        half = graph.nodes[reader]["weight_grad_of"]
        assert not any(e.get("port") == Port.GATHERED
                       for _, _, e in graph.in_edges(half, data=True))


def test_it_is_issued_once_the_gradient_is_a_step_away():
    """The qkv input's gather is ordered after the projection's backward and issued
    before the attention's, so that it travels while the attention's backward computes;
    the fc1 input's after fc2's backward, before SwiGLU's."""
    build = compile_plan(plan_of(text(optimize="; tp_overlap = off")))
    graph = build.graph
    assert (("B/L1/proj", QKV[1]) in graph.edges and
            graph.edges["B/L1/proj", QKV[1]]["kind"] == EdgeKind.ORDER)
    order = [(i.op, i.node) for i in expand(build.programs["stage0.json"], only=0)
             if i.node is not None and i.microbatch == 0 and i.op != "wait"]
    issued = [node for _, node in order]
    for before, gather, after in (("B/L1/proj", QKV[1], "B/L1/attention"),
                                  ("B/L1/fc2", FC1[1], "B/L1/swiglu"),
                                  ("B/loss", HEAD[0], "B/head")):
        assert issued.index(before) < issued.index(gather) < issued.index(after)


def test_under_tp_overlap_it_is_issued_once_the_input_half_is_done():
    """Collective matmul gives the projection's and fc2's backward a weight step of their
    own; the gather stays ordered after their input half (its last piece), not after that
    weight step, which runs after the next GEMM's pieces and left the gather exposed."""
    build = compile_plan(plan_of(text(optimize="; tp_overlap = 2")))
    graph = build.graph
    for gather, source in ((QKV[1], "B/L1/proj#t1"), (FC1[1], "B/L1/fc2#t1")):
        orders = [u for u, _, e in graph.in_edges(gather, data=True)
                  if e["kind"] == EdgeKind.ORDER]
        assert orders == [source]
    issued = [i.node for i in expand(build.programs["stage0.json"], only=0)
              if i.node is not None and i.microbatch == 0 and i.op != "wait"]
    for before, gather, after in (("B/L1/proj#t1", QKV[1], "B/L1/attention"),
                                  ("B/L1/fc2#t1", FC1[1], "B/L1/swiglu")):
        assert issued.index(before) < issued.index(gather) < issued.index(after)


def test_under_a_zero_bubble_schedule_one_input_is_whole_at_a_time():
    """zb1p defers the weight steps to the chunk's W block: a gather ordered after the
    input halves held every input of the chunk whole until then (4 at once on a stage of
    2 layers). It runs in the W block, after the weight halves it was ordered after, and
    its weight step lets it go."""
    build = compile_plan(plan_of(text(mesh="; pp = 2", schedule="; pipeline = zb1p")
                                 .replace("microbatches = 2", "microbatches = 4")))
    graph = build.graph
    stage = "stage0.json"
    whole, most = set(), 0
    for i in expand(build.programs[stage]):
        if i.node is None or i.op == "wait":
            continue
        data = graph.nodes[i.node]
        if "regathers" in data:
            whole.add((i.node, i.microbatch))
        elif data.get("weight_grad_of") is not None:
            whole -= {(g, i.microbatch) for g in graph.predecessors(i.node)}
        most = max(most, len(whole))
    assert most == 1
    for gather in (QKV[0], FC1[0]):
        orders = [u for u, _, e in graph.in_edges(gather, data=True)
                  if e["kind"] == EdgeKind.ORDER]
        assert orders and all(u.startswith("W/") for u in orders), orders


def test_fp8_gemms_keep_their_codes_and_nothing_is_gathered_again():
    """model { fp8 }: each GEMM keeps FP8 codes of its whole input for its weight
    gradient, so a gather again would be read by nothing: check warns, the graph has none,
    and the estimate counts the inputs as kept."""
    source = text().replace("vocab = 256;", "vocab = 256; fp8 = blockwise; fp8_tile = 8;")
    loaded = load_text(source)
    assert [d.message for d in loaded.diagnostics if d.severity == "warning"] == [
        "gathered_inputs = regather has no effect with fp8: the FP8 GEMMs keep FP8 codes "
        "of their whole input for the weight gradient"]
    assert not loaded.plan.regathers_gemm_inputs
    assert regathers(compile_plan(loaded.plan).graph) == {}
    assert gathered_inputs_bytes(loaded.plan, 0) == gathered_inputs_bytes(
        plan_of(source.replace("gathered_inputs = regather", "gathered_inputs = keep")), 0) > 0


def test_tp_overlap_cuts_the_gemms_and_gathers_their_whole_inputs_once_again():
    """Collective matmul cuts qkv and fc1 into pieces, each saving its piece of the
    gathered input; the backward gathers the whole input once, into the weight step,
    which gives each piece its tokens."""
    build = compile_plan(plan_of(text(optimize="; tp_overlap = 2")))
    graph = build.graph
    record = next(p for p in graph.graph["passes"] if p["name"] == "tp_overlap")
    chunks = {d["node"]: d["chunks"] for d in record["decisions"]}
    assert chunks == {f"F/L{i}/{op}": 2 for i in (0, 1)
                      for op in ("qkv", "proj", "fc1", "fc2")}
    assert sorted(regathers(graph)) == sorted(QKV + FC1 + HEAD)
    for node in QKV + FC1:
        (reader,) = graph.successors(node)
        assert reader == "W" + node[1:].split(">")[0].rsplit("/", 1)[0] + "/" + \
            regathers(graph)[node]["consumer"]
        assert graph.nodes[reader]["weight_grad_of"].endswith("#t1")
        assert graph.nodes[regathers(graph)[node]["regathers"] + "#t0"]["token_piece"] == \
            [0, 2, 2]


def test_the_estimate_is_what_the_runtime_holds():
    """With keep, planc's runtime holds the gathered inputs beyond Korthikanti's count,
    which the estimate is; with regather it holds that count."""
    keep, again = plan_of(text(inputs="keep")), plan_of(text())
    assert gathered_inputs_bytes(keep, 0) > 0
    assert gathered_inputs_bytes(again, 0) == 0
    assert estimate(again).peak.total_bytes == estimate(keep).peak.total_bytes


# --- in real runs ---------------------------------------------------------------------------

# After every instruction of the rank's step, the bytes that the forward's gathered GEMM
# inputs of that step and microbatch still hold (their storage outlives the tensor the
# program frees), and what each backward step that reads one found in it.
RANK = textwrap.dedent("""
    import json, sys
    import planc.runtime.worker as worker
    from planc.runtime.engine.interpreter import Interpreter
    gathered, held, filled, waiting = {}, {}, [], {}
    transfer = Interpreter._transfer
    def noting(self, state, step, mb):
        out = transfer(self, state, step, mb)
        if step.node.startswith("F/") and ":all_gather@tp" in step.node:
            gathered.setdefault((state.step, mb), {})[step.node] = out.untyped_storage()
        return out
    Interpreter._transfer = noting
    instruction = Interpreter.instruction
    def reporting(self, op, node, microbatch, frees):
        run = instruction(self, op, node, microbatch, frees)
        def ran(state):
            run(state)
            mine = gathered.get((state.step, microbatch), {})
            held[f"{state.step}:{node}#{microbatch}"] = {g: s.nbytes() for g, s in mine.items()}
            # what the let-go storage waiting for a fill holds (nothing, once filled),
            # once a compute step has run: the steps that fill it run on that stream's
            # thread, so a transfer's thread could find one halfway
            if op == "compute":
                waiting[f"{state.step}:{node}#{microbatch}"] = sum(
                    t.untyped_storage().nbytes() for t in state.let_go.values())
        return ran
    Interpreter.instruction = reporting
    import planc.runtime.engine.store as store
    fill = store.fill_input
    def counting(kept, value):
        was = kept.untyped_storage().nbytes()
        fill(kept, value)
        filled.append([was, kept.untyped_storage().nbytes()])
    store.fill_input = counting
    status = worker.main([sys.argv[1], "--steps", "1"])
    print(json.dumps({"status": status, "held": held, "filled": filled,
                      "waiting": waiting}))
""")


def test_a_rank_lets_the_gathered_input_go_after_the_forward_and_fills_it_again(tmp_path):
    ranks = run_ranks(RANK, tmp_path, world=2, plan_text=text(optimize="; tp_overlap = off"))
    for done in ranks:
        seen = one_rank_printed(done)
        assert seen["status"] == 0
        held = seen["held"]
        whole = held["0:F/L0/ln1>qkv:all_gather@tp#0"]["F/L0/ln1>qkv:all_gather@tp"]
        assert whole == 32 * 4 // 2 * 64 * 4  # the microbatch's 64 tokens x 64, fp32
        # gone once the GEMM that read it has run, and all of them by the loss
        assert held["0:F/L0/qkv#0"]["F/L0/ln1>qkv:all_gather@tp"] == 0
        assert held["0:F/loss#0"] == {g: 0 for g in held["0:F/loss#0"]}
        assert sorted(held["0:F/loss#0"]) == sorted("F" + g[1:] for g in QKV + FC1 + HEAD)
        # the backward's gather writes into the forward's storage, which autograd saved:
        # whole again once it has run, and no copy left for the step that reads it
        for gather in QKV + FC1 + HEAD:
            assert held[f"0:{gather}#0"]["F" + gather[1:]] == whole
        assert seen["filled"] == [[whole, whole]] * 10  # 5 inputs, 2 microbatches
        assert set(seen["waiting"].values()) == {0}


def test_under_tp_overlap_each_piece_is_let_go_and_filled_from_the_whole(tmp_path):
    ranks = run_ranks(RANK, tmp_path, world=2, plan_text=text(optimize="; tp_overlap = 2"))
    whole = 32 * 4 // 2 * 64 * 4
    pieces = [f"F{g[1:]}#t{j}" for g in QKV + FC1 for j in (0, 1)]
    for done in ranks:
        seen = one_rank_printed(done)
        assert seen["status"] == 0
        at_loss = seen["held"]["0:F/loss#0"]
        assert at_loss == {g: 0 for g in pieces + ["F" + HEAD[0][1:]]}
        # per microbatch: the head's input, which its gather wrote into, then 4 GEMMs
        # of 2 pieces, each filled from empty with its half of the tokens
        per_microbatch = [[whole, whole]] + [[0, whole // 2]] * 8
        assert seen["filled"] == per_microbatch * 2
        # each piece, filled again, is its weight step's alone: no bytes kept for a
        # fill already done (the step held the 8 pieces, 32 MiB in bench/memory_live.py)
        assert set(seen["waiting"].values()) == {0}
        # and each piece goes once its weight gradient has run: the whole gathered input
        # and one piece at a time, not every piece, while the weight step runs
        for gather in QKV + FC1:
            layer, gemm = gather.split("/")[1], gather.split(">")[1].split(":")[0]
            for mb in (0, 1):
                after = seen["held"][f"0:W/{layer}/{gemm}#{mb}"]
                assert [after[f"F{gather[1:]}#t{j}"] for j in (0, 1)] == [0, 0]


def _trained(tmp_path, inputs: str, schedule: str, mesh: str, chunks: str
             ) -> dict[str, bytes]:
    """The checkpoint's files after 2 steps of a real run of the plan."""
    from planc.cli import main

    plan = tmp_path / f"{inputs}.plan"
    plan.write_text(text(inputs=inputs, mesh=mesh, schedule=schedule,
                         optimize=f"; tp_overlap = {chunks}"))
    out = tmp_path / f"build-{inputs}"
    assert main(["compile", str(plan), "-o", str(out)]) == 0
    checkpoints = tmp_path / f"checkpoints-{inputs}"
    assert main(["run", str(out), "--steps", "2", "--checkpoint-dir", str(checkpoints)]) == 0
    step = checkpoints / "step-000002"
    return {f.name: f.read_bytes() for f in sorted(step.iterdir())}


@pytest.mark.parametrize("mesh,schedule,chunks", [
    ("", "", "off"), ("; pp = 2", "; pipeline = zb1p", "off"), ("", "", "2")],
    ids=["tp2", "tp2-pp2-zb1p", "tp2-tp-overlap-2"])
def test_training_computes_the_same_bits_as_keeping_the_inputs(tmp_path, mesh, schedule,
                                                               chunks):
    keep = _trained(tmp_path, "keep", schedule, mesh, chunks)
    again = _trained(tmp_path, "regather", schedule, mesh, chunks)
    assert sorted(keep) == sorted(again)
    assert [name for name in keep if keep[name] != again[name]] == []
    assert json.loads(keep["manifest.json"])["data"]["next_step"] == 2
