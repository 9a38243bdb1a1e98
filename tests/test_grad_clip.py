"""train { grad_clip }: the global gradient norm as the compiler derives, lowers, verifies,
explains and simulates it, and real runs that clip (C = 0.05, far below the norm of the
first step) under every axis, against the single process that clips with
torch.nn.utils.clip_grad_norm_ (planc run --check)."""

from __future__ import annotations

import copy
import json
from collections import Counter
from dataclasses import replace

import pytest

from planc.compile import compile_plan
from planc.graph.grad_norm import COLLECTIVE
from planc.lang import load_text
from planc.program.program import Opcode, Program
from planc.verify.verifier import verify
from tests import test_llama, test_moe
from tests.runtime_matrix import plan_text as gpt_text
from tests.runtime_matrix import run

CLIP = 0.05

# The gpt, llama and moe plans that clip, axes combined, 4 ranks each: tp with sequence
# parallelism, pp (1F1B and interleaved), cp, ZeRO 1, 2 and 3, a tied embedding, ep; and
# one rank, whose world group is itself.
GPT = {
    "clip-single": dict(mesh=""),
    "clip-tp2-sp-pp2-tied": dict(mesh="tp = 2; pp = 2", m=2, model="; tie_embeddings = on",
                                 shard="tp { sequence_parallel = on }"),
    "clip-cp2-dp2-zero1": dict(mesh="cp = 2; dp = 2", m=2, shard="dp { zero = 1 }"),
    "clip-pp2-dp2-zero3-tied": dict(mesh="pp = 2; dp = 2", m=2, model="; tie_embeddings = on",
                                    shard="dp { zero = 3 }"),
}
LLAMA = {
    "clip-pp2-dp2-zero2-interleaved": dict(mesh="pp = 2; dp = 2", m=4, schedule="; pipeline "
                                           "= interleaved", shard="pp { virtual = 2 }; "
                                           "dp { zero = 2 }"),
    "clip-tp2-sp-cp2-ring": dict(mesh="tp = 2; cp = 2", shard="tp { sequence_parallel = on }; "
                                 "cp { attention = ring }"),
}
MOE = {
    "clip-ep2-over-tp2-sp-dp2": dict(mesh="tp = 2; dp = 2; ep = 2", m=2, shared=1,
                                     shard="tp { sequence_parallel = on }"),
}


def clipped(text: str) -> str:
    """A plan's text with grad_clip = 0.05 added to its train block."""
    head, _, tail = text.rpartition("train {")
    return f"{head}train {{ grad_clip = {CLIP}; {tail.lstrip()}"


def texts() -> dict[str, str]:
    out = {f"gpt-{n}": clipped(gpt_text(n, **case)) for n, case in GPT.items()}
    out.update({f"llama-{n}": clipped(test_llama.plan_text(n, **case))
                for n, case in LLAMA.items()})
    out.update({f"moe-{n}": clipped(test_moe.plan_text(n, **case)) for n, case in MOE.items()})
    return out


def built(text: str):
    loaded = load_text(text)
    assert loaded.ok, loaded.diagnostics
    return compile_plan(loaded.plan)


def gpt(name: str, **changes) -> str:
    return clipped(gpt_text(name, **{**GPT.get(name, {}), **changes}))


# --- the language ---------------------------------------------------------------------------

def test_grad_clip_is_off_by_default_and_reads_a_norm():
    assert load_text(gpt_text("t")).plan.train.grad_clip is None
    assert load_text(gpt("t")).plan.train.grad_clip == CLIP
    text = gpt_text("t").replace("seed = 3", "seed = 3; grad_clip = off")
    assert load_text(text).plan.train.grad_clip is None
    assert load_text(text.replace("= off", "= 1")).plan.train.grad_clip == 1.0


@pytest.mark.parametrize("value, message", [
    ("on", "expected off or a number > 0, got 'on'"),
    ("0", "expected a number > 0, got 0"),
    ("-1", "expected a number > 0, got -1"),
    ("[1]", "expected a number > 0, got a list"),
])
def test_a_bad_grad_clip_is_an_error_at_its_value(value, message):
    text = gpt_text("t").replace("seed = 3", f"seed = 3; grad_clip = {value}")
    loaded = load_text(text)
    (error,) = [d for d in loaded.diagnostics if d.severity == "error"]
    line = text.splitlines().index(next(x for x in text.splitlines() if "grad_clip" in x))
    assert (error.message, error.span.line, error.span.column) == \
        (message, line + 1, text.splitlines()[line].index(f"grad_clip = {value}") + 13)


# --- the graph and the programs ----------------------------------------------------------------

def norm_steps(build) -> dict[int, dict[str, object]]:
    """Each stage's share, sum and clip instructions."""
    out: dict[int, dict[str, object]] = {}
    for program in build.programs.values():
        for i in program.written():
            operands = i.operands
            if operands is not None and (operands.kernel in ("grad_norm", "grad_clip") or
                                         operands.payload == "grad_norm"):
                role = operands.kernel if operands.kernel else "sum"
                out.setdefault(program.stage, {})[role] = i
    return out


def test_without_grad_clip_there_is_no_norm_and_no_world_group():
    build = built(gpt_text("t", mesh="pp = 2; dp = 2", m=2))
    assert norm_steps(build) == {}
    assert build.groups.rule("world") is None
    assert not any(d.get("axis") == "world" for _, d in build.graph.nodes(data=True))


def test_each_stage_sums_its_share_over_the_world_then_clips_before_its_optimizer():
    build = built(gpt("clip-tp2-sp-pp2-tied"))
    steps = norm_steps(build)
    assert sorted(steps) == [0, 1]
    for stage, found in steps.items():
        assert set(found) == {"grad_norm", "sum", "grad_clip"}
        program = build.programs[f"stage{stage}.json"]
        epilogue = [i.node for i in program.epilogue if i.op not in ("record", "wait", "sync")]
        at = {node: k for k, node in enumerate(epilogue)}
        share, total, clip = (found[r].node for r in ("grad_norm", "sum", "grad_clip"))
        optimizers = [k for node, k in at.items() if node.startswith("O/") and "optimizer" in node]
        assert at[share] < at[total] < at[clip] < min(optimizers)
        assert found["sum"].operands.group == "world" and found["sum"].operands.bytes == 8
        assert found["grad_clip"].operands.max_norm == CLIP
        assert build.graph.nodes[total]["collective"] == COLLECTIVE
    assert build.groups.rule("world").axes == ("tp", "cp", "pp", "dp")
    assert build.groups.size("world") == 4


def weights(build, stage: int) -> dict[str, float]:
    """Each parameter of the stage -> the weight of its squares in the rank's share."""
    (share,) = [i for i in build.programs[f"stage{stage}.json"].written()
                if i.operands is not None and i.operands.kernel == "grad_norm"]
    out = {}
    for bucket_id, bucket in build.programs[f"stage{stage}.json"].buckets.items():
        for m in bucket["members"]:
            (weight,) = {w for b, s, e, w in share.operands.norm_ranges
                         if b == bucket_id and s <= m["offset"] < e}
            out[m["param"]] = weight
    return out


@pytest.mark.parametrize("mesh, shard, expected", [
    # tp 2 x dp 2, ZeRO 0: a tp slice is held by its 2 dp replicas, a layer norm by all 4
    ("tp = 2; dp = 2", "", {"layers.0.qkv.weight": 0.5, "layers.0.ln1.weight": 0.25,
                            "embedding.weight": 0.5, "position.weight": 0.25}),
    # ZeRO 1 shards over dp: each element once per tp copy
    ("tp = 2; dp = 2", "dp { zero = 1 }", {"layers.0.qkv.weight": 1.0,
                                          "layers.0.ln1.weight": 0.5}),
    # cp replicates like dp; ZeRO 3 shards over dp x cp
    ("cp = 2; dp = 2", "", {"layers.0.qkv.weight": 0.25}),
    ("cp = 2; dp = 2", "dp { zero = 3 }", {"layers.0.qkv.weight": 1.0}),
])
def test_each_value_is_weighted_one_over_the_ranks_holding_it(mesh, shard, expected):
    found = weights(built(gpt("w", mesh=mesh, shard=shard, m=2)), 0)
    assert {k: found[k] for k in expected} == expected


def test_a_tied_embedding_counts_half_on_each_of_its_stages():
    build = built(gpt("tied", mesh="pp = 2", m=2, model="; tie_embeddings = on"))
    assert weights(build, 0)["embedding.weight"] == 0.5
    assert weights(build, 1)["embedding.weight"] == 0.5
    assert weights(build, 1)["final_ln.weight"] == 1.0


def test_experts_count_once_per_expert_data_parallel_replica():
    build = built(clipped(test_moe.plan_text("e", **MOE["clip-ep2-over-tp2-sp-dp2"])))
    found = weights(build, 0)
    # 4 ranks: each expert's rows on 2 of them (edp = 4 / ep 2), a router on all 4
    experts = {k: v for k, v in found.items() if ".experts." in k}
    assert experts and set(experts.values()) == {0.5}
    assert found["layers.0.router.weight"] == 0.25


# --- the verifier ---------------------------------------------------------------------------------

def problems(build, programs=None) -> list[str]:
    return verify(build.plan, build.graph, programs or build.programs, build.table,
                  build.groups, build.routes).problems


def changed(build, name: str, change) -> dict[str, Program]:
    data = copy.deepcopy(build.programs[name].to_json())
    change(data)
    return {**build.programs, name: Program.from_json(data)}


@pytest.mark.parametrize("name", sorted(texts()))
def test_every_clipping_plan_verifies(name):
    assert problems(built(texts()[name])) == []


def test_a_stage_without_the_norm_all_reduce_is_refused():
    build = built(gpt("clip-tp2-sp-pp2-tied"))

    def drop(data):
        data["epilogue"] = [i for i in data["epilogue"]
                            if i.get("node") != f"{COLLECTIVE}#s1"]

    found = problems(build, changed(build, "stage1.json", drop))
    assert found[:4] == [
        f"ranks 2, 3 (stage1.json): {COLLECTIVE}#s1 is never issued; every node of stage 1 "
        "runs exactly once per step (per microbatch in its block)",
        # its record stays behind, for an all-reduce that no longer runs
        f"ranks 2, 3 (stage1.json): epilogue records done:{COLLECTIVE}#s1 on stream comm "
        f"where {COLLECTIVE}#s1 has not run on that stream before it: the event would say "
        f"{COLLECTIVE}#s1 finished while it may still run",
        "program stage1.json: 0 instructions all-reduces the gradient norm once per step in "
        "the epilogue; grad_clip = 0.05 needs exactly one, after the gradients are final and "
        "before the optimizer steps",
        f"world group [0, 2]: collective 1 on this group is all_reduce {COLLECTIVE}#s0 on "
        "rank 0 but nothing (it stops earlier) on rank 2: the group would deadlock or mix up "
        "data"]


def test_an_optimizer_step_before_the_clip_is_refused():
    build = built(gpt("clip-cp2-dp2-zero1"))
    (name,) = build.programs
    moved = []

    def early(data):
        epilogue = data["epilogue"]
        step = next(k for k, i in enumerate(epilogue) if i.get("node", "").startswith("O/")
                    and i["node"].endswith("/optimizer"))
        clip = next(k for k, i in enumerate(epilogue) if i.get("node") == "N/grad_clip#s0")
        moved.append(epilogue[step]["node"])
        epilogue.insert(clip, epilogue.pop(step))

    found = [p for p in problems(build, changed(build, name, early)) if "clipped" in p]
    assert found == [f"program {name}: compute {moved[0]} on stream compute updates with "
                     f"gradients that compute N/grad_clip#s0 on stream compute has not "
                     f"clipped yet"]


def test_a_share_that_counts_a_replicated_value_twice_is_refused():
    build = built(gpt("w", mesh="tp = 2; dp = 2", m=2))
    (name,) = build.programs

    def doubled(data):
        for item in data["epilogue"]:
            if item.get("node") == "N/grad_norm#s0":
                item["operands"]["norm_ranges"] = [
                    [b, s, e, min(1.0, 2 * w)] for b, s, e, w in item["operands"]["norm_ranges"]]

    # head.weight, split over tp (vocabulary-parallel), is held alike by the 2 dp replicas
    assert problems(build, changed(build, name, doubled)) == [
        f"{name}: the operands of compute N/grad_norm#s0 are not those graph.json implies",
        f"program {name}: compute N/grad_norm#s0 on stream compute counts head.weight (bucket "
        f"c0.b0, elements 0..2047, held alike by 2 ranks) 2 times in the gradient norm; every "
        f"element counts once"]


# --- the group table: every group the programs name, on every mesh ---------------------------

def named_groups(build) -> set[str]:
    """Every group an instruction of the build's programs names."""
    out = set()
    for program in build.programs.values():
        for i in program.written():
            if i.operands is not None:
                out |= {g for g in (i.operands.group, i.operands.counts_group) if g}
    return out


MESHES = [("gpt", mesh) for mesh in ("", "tp = 2", "cp = 2", "pp = 2", "dp = 2",
                                     "tp = 2; pp = 2; dp = 2")] + \
    [("llama", ""), ("llama", "tp = 2; cp = 2"), ("moe", ""), ("moe", "dp = 2; ep = 2"),
     ("moe", "tp = 2; ep = 2")]


@pytest.mark.parametrize("clip", [False, True], ids=["no-clip", "clip"])
@pytest.mark.parametrize("family, mesh", MESHES, ids=[f"{f}-{m or 'one-rank'}" for f, m in MESHES])
def test_the_group_table_holds_every_group_the_programs_name(family, mesh, clip):
    m = 2 if "pp" in mesh else 1
    text = {"gpt": lambda: gpt_text("g", mesh=mesh, m=m, model="; tie_embeddings = on"),
            "llama": lambda: test_llama.plan_text("l", mesh=mesh, m=m),
            "moe": lambda: test_moe.plan_text("e", mesh=mesh, m=m, extra="; aux_loss = 0.1")}
    build = built(clipped(text[family]()) if clip else text[family]())
    named = named_groups(build)
    assert ("world" in named) == clip
    assert named <= {rule.ref for rule in build.groups.rules}


def test_programs_that_name_a_group_the_table_lacks_are_refused():
    build = built(gpt("clip-cp2-dp2-zero1"))
    (name,) = build.programs
    groups = replace(build.groups, rules=tuple(r for r in build.groups.rules
                                               if r.ref != "world"))
    stream = next(i.stream for i in build.programs[name].epilogue
                  if i.node == f"{COLLECTIVE}#s0")
    assert verify(build.plan, build.graph, build.programs, build.table, groups,
                  build.routes).problems == [
        f"program {name}: all_reduce {COLLECTIVE}#s0 on stream {stream} uses group 'world', "
        f"which groups.json lacks"]


# --- every command on a plan of one rank that clips ------------------------------------------

def planc(capsys, *args, stream: str = "out") -> tuple[int, list[str]]:
    """``planc ARGS`` in this process: its status and the lines it wrote to ``stream``
    (out or err), each with its spaces collapsed (tables pad their columns to their
    widest cell); nothing on the other stream."""
    from planc.cli import main

    status = main([*map(str, args)])
    written = capsys.readouterr()._asdict()
    assert written.pop("err" if stream == "out" else "out") == ""
    return status, [" ".join(line.split()) for line in written[stream].splitlines()]


@pytest.fixture
def one_rank(tmp_path):
    source = tmp_path / "single.plan"
    source.write_text(gpt("clip-single"))
    return source


def test_simulate_a_one_rank_plan_that_clips(one_rank, capsys):
    status, lines = planc(capsys, "simulate", one_rank)
    assert status == 0
    assert lines[0].startswith("clip_single: 1 rank, 1 pipeline stage: one step takes ")
    assert lines[4] == "exposed communication (worst stage, per axis): none"


def test_report_a_one_rank_plan_that_clips(one_rank, tmp_path, capsys):
    page = tmp_path / "report.html"
    status, lines = planc(capsys, "report", one_rank, "-o", page, stream="err")
    text = page.read_text()
    assert (status, lines) == (0, [f"report written to {page} ({len(text) // 1024} KB, "
                                   f"self-contained)"])
    assert text.startswith("<!doctype html>") and "world" in text


def test_diff_clipping_on_one_rank(tmp_path, capsys):
    source = tmp_path / "plain.plan"
    source.write_text(gpt_text("plain"))
    status, lines = planc(capsys, "diff", source, source, "--set-b", "train.grad_clip=1.0")
    assert status == 0
    assert "overrides train.grad_clip=1.0" in lines
    assert "transfers over world 0, 0 B 1, 8 B" in lines


def test_tune_a_one_rank_plan_that_clips(one_rank, capsys):
    status, lines = planc(capsys, "tune", one_rank, "--gpus", 1)
    assert status == 0
    assert lines[0].startswith("planc tune: 16 layouts on 1 devices in ")
    assert "1 dp 1 | 1f1b m 1 | zero 0" in " ".join(lines)
    assert "transfers over world 1, 8 B 1, 8 B 1.00x" in lines
    # four layouts of one simulated step (to the last bits of a sum): a tie, not a
    # "1.000x faster", ranked by the layouts' text
    assert "the file's own layout is #1." in lines
    assert "#1 beside #2 (the same simulated step to 0.1 %: a tie, ranked by the layouts' " \
        "text):" in lines


def test_tune_says_the_files_own_layout_ties_with_the_best(one_rank):
    """The search of the test above, its layouts' steps equal to 0.1 %, read as if the
    file's own were the last of them."""
    import dataclasses

    from planc.lang import load_file, load_text
    from planc.tune import tune
    from planc.views.tune_text import render

    def check(text: str):
        checked = load_text(text)
        return checked.plan if checked.ok else None

    search = tune(load_file(one_rank).plan, one_rank.read_text(), 1, check=check)
    assert len(search.ranked) == 4
    last = dataclasses.replace(search, own=search.ranked[-1].candidate)
    assert "the file's own layout is #4, with #1 the same simulated step to 0.1 %: a tie, " \
        "ranked by the layouts' text." in render(last, 1, 5).splitlines()


def test_export_a_one_rank_plan_that_clips(one_rank, tmp_path, capsys):
    from tests.test_export import _attributes, _fields, _messages

    status, lines = planc(capsys, "export", one_rank, "-o", tmp_path / "traces", stream="err")
    assert (status, lines) == (0, [f"wrote 1 Chakra execution trace (one per pipeline stage's "
                                   f"first rank) to {tmp_path / 'traces'}/: planc.0.et"])
    _, *nodes = _messages((tmp_path / "traces" / "planc.0.et").read_bytes())
    # the norm's all-reduce, a collective (node type 7) over the world group
    assert [_attributes(_fields(n))["pg_name"] for n in nodes
            if dict(_fields(n))[3] == 7].count("world") == 1


def test_explain_the_world_group_of_one_rank(one_rank, capsys):
    status, lines = planc(capsys, "explain", one_rank, "--axis", "world")
    assert status == 0
    assert lines.count("O all_reduce over world (1 rank, intra-node: [0]) 8 B per step "
                       "[grad_norm]") == 1
    assert "one all-reduce of that fp64 number over its one rank (tp x cp x pp x dp = 1 x 1 " \
        "x 1 x 1) gives every rank the same norm" in " ".join(lines)


# --- planc explain and planc simulate ------------------------------------------------------------

def test_explain_lists_the_norm_all_reduce_with_its_group_and_why(tmp_path, capsys):
    from planc.cli import main

    source = tmp_path / "clip.plan"
    source.write_text(gpt("clip-cp2-dp2-zero1", mesh="cp = 2; pp = 2"))
    assert main(["explain", str(source), "--axis", "world"]) == 0
    out = capsys.readouterr().out
    lines = [line.strip() for line in out.splitlines()]
    # one collective of every rank, shown once though each stage has its node
    assert lines.count("O  all_reduce over world (4 ranks, intra-node: [0, 1, 2, 3])  8 B per "
                       "step  [grad_norm]") == 1
    assert "outside the layers: embedding, head, loss and pipeline: 1 transfer over world" \
        in lines
    text = " ".join(lines)
    assert "grad_clip = 0.05 clips every gradient by their global L2 norm" in text
    assert "one all-reduce of that fp64 number over all 4 ranks (tp x cp x pp x dp = 1 x 2 x " \
        "2 x 1)" in text


def test_the_simulator_charges_the_norm_and_joins_the_stages_at_it():
    from planc.simulate import simulate
    from planc.estimate.instruction_cost import InstructionCosts

    build = built(gpt("clip-tp2-sp-pp2-tied"))
    costs = InstructionCosts(build.plan, build.groups)
    total = norm_steps(build)[0]["sum"]
    seconds = costs.cost.transfer_seconds("all_reduce", 8, 4,
                                          build.groups.crosses_nodes("world"))
    assert costs(total, 0) == pytest.approx(seconds, rel=1e-12) and seconds > 0
    stages = simulate(build).stages
    # every stage leaves the norm together: the last to reach it held the other
    waited = sorted(s.exposed_seconds["world"] for s in stages)
    assert waited[0] == pytest.approx(seconds, rel=1e-9) and waited[1] > 1.01 * seconds
    ends = [s.step_seconds for s in stages]
    assert max(ends) - min(ends) < 0.01 * max(ends)


# --- real runs -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def curves() -> dict[str, list[float]]:
    return {}


# The llama and mixture plans that clip, each with the other features beyond the layout
# at once (tests/runtime_matrix.py FEATURES: a cosine schedule with a warm-up step and
# evaluations after steps 2 and 4, over 4 steps; the mixture with its balance loss, which
# the evaluation's loss leaves out as the step's reported loss does). The gpt plans that
# clip train in tests/test_runtime.py's FEATURE_RUNS (as written, and tp2-sp-pp2-tied
# with overlap off: each collective of the norm on the compute stream after a sync),
# which also shows the clip against the same model without it. Fusion off (a bucket per
# parameter) only changes how many ranges the share reads: the verifier's tests cover it.
RUNS = sorted(name for name in texts() if not name.startswith("gpt-"))
MIN_LR = "1e-4"


def feature_overrides(name: str) -> tuple[str, ...]:
    return ("train.steps=4", f"train.lr_schedule=cosine(warmup = 1, min_lr = {MIN_LR})",
            "train.eval_every=2", "train.eval_batches=2",
            *(["model.aux_loss=0.01"] if name.startswith("moe-") else []))


@pytest.mark.parametrize("name", RUNS)
def test_every_clipping_plan_trains_exactly_like_one_process(name, tmp_path, capfd, curves):
    pytest.importorskip("torch")
    from tests.runtime_matrix import check_features

    text = texts()[name]
    source, metrics = tmp_path / "clip.plan", tmp_path / "metrics.jsonl"
    source.write_text(text)
    overrides = feature_overrides(name)
    status, err = run([source, "-o", tmp_path / "build", "--check", "--metrics", metrics,
                       "--timeout", "60", *(a for o in overrides for a in ("--set", o))],
                      capfd)
    assert status == 0, err
    assert "every loss" in err and "matches" in err
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    lr = load_text(text, "<plan>", overrides).plan.train.optimizer.lr
    # 4 steps at the schedule's lr; the coefficient C / (norm + 1e-6) below 1 at every
    # step (the run really clipped) from the single process's first norm; evaluations
    # after steps 2 and 4, both compared
    check_features(records, err, text, lr, float(MIN_LR), overrides)
    curves[name] = [r["loss"] for r in records]


def test_llama_plans_with_every_feature_follow_one_curve(curves):
    """The two llama layouts (one model) on one curve under the schedule and the clip."""
    names = [name for name in RUNS if name.startswith("llama-")]
    if len(names) != 2 or any(n not in curves for n in names):
        pytest.skip("needs the llama runs")
    assert curves[names[1]] == pytest.approx(curves[names[0]], rel=1e-5)


# (A resumed run clips exactly as an uninterrupted one: tests/test_checkpoint.py's
# resumed run under the lr schedule, which clips and evaluates too.)


@pytest.mark.parametrize("text", [
    gpt_text("many", mesh="tp = 2; pp = 2", m=2, optimize="bucket = 8KB",
             shard="tp { sequence_parallel = on }"),
    test_llama.plan_text("zb", mesh="pp = 2; dp = 2", m=4, schedule="; pipeline = zb1p",
                         shard="dp { zero = 1 }", optimize="bucket = 8KB"),
])
def test_clipping_adds_the_norm_and_changes_nothing_else(text):
    """The same buckets (fusion reads when each gradient is final, not the clip the
    optimizer waits for), the same blocks, prologue and receives: only the epilogue
    gains the norm's three steps per stage."""
    plain, clip = built(text), built(clipped(text))
    assert len(plain.graph.graph["buckets"]) > 2
    assert clip.graph.graph["buckets"] == plain.graph.graph["buckets"]
    added = set(clip.graph.nodes) - set(plain.graph.nodes)
    assert set(plain.graph.nodes) <= set(clip.graph.nodes) and len(added) == 3 * 2
    for name, program in plain.programs.items():
        other = clip.programs[name]
        assert (other.blocks, other.prologue, other.receives, other.schedule) == \
            (program.blocks, program.prologue, program.receives, program.schedule)
        rest = [i for i in other.epilogue if i.node not in added and
                not (i.event or "").removeprefix("done:") in added]
        # the same instructions, in the same order but for the waits, which the clip's
        # steps may bring forward
        assert Counter(rest) == Counter(program.epilogue) and len(rest) > 4
        assert [i for i in rest if i.op is not Opcode.WAIT] == \
            [i for i in program.epilogue if i.op is not Opcode.WAIT]
