"""planc tune (issue 25): the search, its pruning against exhaustive search, its output."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from planc.cli import main
from planc.lang import load_file, load_text
from planc.tune import bounds, tune
from planc.tune.candidate_text import with_settings, written_value
from planc.tune.space import candidates, dominates, of_plan
from tests.conftest import PLANS

SMALL = """# a small llama for the search's tests
plan small {
  model llama { layers = 4; hidden = 64; heads = 4; kv_heads = 2; ffn = 128; vocab = 256
                seq = 64; batch = 8 }
  mesh { dp = 4 }
  topology { preset = dgx-h100; devices_per_node = 4 }
  schedule { microbatches = 2 }
}
"""
# the schedule held, so that every candidate of the space can be simulated in a test
KEEP = ("schedule.pipeline", "schedule.microbatches", "shard.pp.virtual")


def _check(text: str):
    loaded = load_text(text)
    return loaded.plan if loaded.ok else None


def _exhaustive(plan, source: str, gpus: int, capacity: float) -> list[tuple[float, str]]:
    """Every candidate the checker accepts and that fits as planc run would hold it,
    simulated: (step, layout)."""
    from planc.estimate import memory
    from planc.compile import compile_plan
    from planc.simulate import simulate

    out = []
    for item in candidates(plan, gpus, KEEP):
        if isinstance(item, str):
            continue
        checked = _check(with_settings(source, {
            **item.settings(), "shard.pp.stages": bounds.stages_setting(plan, item)}))
        if checked is None or memory.estimate(checked).held_peak_bytes > capacity:
            continue
        out.append((simulate(compile_plan(checked)).step_seconds, item))
    return sorted(out, key=lambda e: (e[0], e[1].text()))


@pytest.mark.parametrize("capacity", [80e9, 2.2e6], ids=["roomy", "tight"])
def test_pruning_never_drops_the_best_layout(capacity):
    """Against every valid layout simulated: the same best step time, and the lower
    bound of each simulated candidate below its simulated time. With 2.2 MB a device
    the lighter settings do not fit and ZeRO and recomputation decide."""
    plan = load_text(SMALL).plan
    every = _exhaustive(plan, SMALL, 4, capacity)
    assert len(every) > 20
    search = tune(plan, SMALL, 4, top=3, capacity=capacity, keep=KEEP, check=_check,
                  per_node=4)
    assert search.best.step_seconds == pytest.approx(every[0][0], rel=1e-12)
    # a layout faster than tune's third is ranked, or is a heavier variant of one no
    # slower (more recomputation, a higher ZeRO stage: planc.tune.space.dominates)
    ranked = {r.candidate for r in search.ranked}
    third = search.ranked[2].step_seconds
    for step, item in every:
        if step < third and item not in ranked:
            assert any(dominates(other, item) and other_step <= step
                       for other_step, other in every), item.text()
    assert search.simulated < len(every)  # the pruning did prune
    assert search.considered == search.simulated + sum(search.pruned.values())
    estimator = bounds.Estimator(4)
    for ranked in search.ranked:
        assert estimator.lower_bound(ranked.plan) <= ranked.step_seconds


def test_the_best_plan_written_checks_compiles_and_simulates_to_its_step(tmp_path, capsys):
    source = tmp_path / "small.plan"
    source.write_text(SMALL)
    best = tmp_path / "best.plan"
    status = main(["tune", str(source), "--gpus", "4", "--top", "2", "--keep",
                   "schedule.microbatches", "-o", str(best), "--json"])
    result = json.loads(capsys.readouterr().out)
    assert status == 0
    assert result["format"] == "planc-tune" and result["version"] == 1
    assert set(result["best"]) == {"mesh", "order", "virtual", "microbatches", "pipeline",
                                   "zero", "sequence_parallel", "recompute", "stages",
                                   "step_seconds",
                                   "tflops_per_gpu", "mfu", "bubble", "exposed_seconds",
                                   "memory_bytes", "effective_step_seconds", "plan"}
    assert result["searched"] == result["simulated"] + sum(result["pruned"].values())
    text = best.read_text()
    assert text.startswith("# Chosen by planc tune ")
    assert text.endswith(result["best"]["plan"])
    status = main(["simulate", str(best), "--json"])
    simulated = json.loads(capsys.readouterr().out)
    assert status == 0
    assert simulated["step_seconds"] == pytest.approx(result["best"]["step_seconds"],
                                                      rel=1e-12)
    assert result["candidates"][0] == result["best"]
    assert result["candidates"][1]["step_seconds"] >= result["best"]["step_seconds"]


def test_the_header_of_the_best_plan_shows_any_file_name_on_one_comment_line(tmp_path,
                                                                             capsys):
    """A file name went into the header as it was: a newline in it ended the comment and
    put the rest into the plan (planc check then refused it, or took what it said), and
    bytes that are no UTF-8 stopped tune with a UnicodeEncodeError once it had searched."""
    source = tmp_path / "nl\n}}}junk.plan"
    source.write_text(SMALL)
    best = os.fsdecode(os.fsencode(str(tmp_path)) + b"/best\xff.plan")
    assert main(["tune", str(source), "--gpus", "4", "--top", "1", "--keep",
                 "schedule.microbatches", "-o", best]) == 0
    capsys.readouterr()
    with open(best, encoding="utf-8") as handle:
        first = handle.readline()
    assert first == (f"# Chosen by planc tune '{tmp_path}/nl\\n}}}}}}junk.plan' --gpus 4 "
                     f"--top 1 --keep schedule.microbatches -o '{tmp_path}/best\\xff.plan'\n")
    assert main(["check", best]) == 0


BIG_VOCAB = """plan big_vocab {
  model gpt { layers = 4; hidden = 1024; heads = 8; vocab = 128000; seq = 256; batch = 8
              dtype = bf16 }
  mesh { dp = 2 }
  topology { preset = dgx-h100; devices_per_node = 2 }
  train { optimizer = adamw(lr = 1e-4) }
}
"""


def test_a_layout_is_not_given_up_when_zero3_s_whole_unit_outweighs_what_it_shards(
        tmp_path, capsys):
    """A 128,000-word embedding is ZeRO-3's largest unit, held whole while it is used
    (1.05 GB beside the shards): ZeRO-2 needs less than ZeRO-3 here, and tune judged a
    layout hopeless by its ZeRO-3 variant alone (0 simulated, "no layout fits")."""
    source = tmp_path / "big.plan"
    source.write_text(BIG_VOCAB)
    keep = [arg for axis in ("tp", "cp", "pp", "dp") for arg in ("--keep", f"mesh.{axis}")]
    status = main(["tune", str(source), "--gpus", "2", "--memory", "3.85", "--top", "1",
                   "--json", *keep])
    result = json.loads(capsys.readouterr().out)
    assert status == 0
    assert (result["best"]["zero"], result["best"]["memory_bytes"]) == (2, 3_806_042_112)


ONE_LAYER_A_STAGE = """plan rc {
  model llama { layers = 2; hidden = 128; heads = 4; kv_heads = 2; ffn = 352; vocab = 4096
                seq = 256; batch = 4 }
  mesh { pp = 2 }
  topology { devices_per_node = 2; device { flops = 989TFLOP/s; memory = 80GB }
             intra { bandwidth = 450GB/s; latency = 2us } }
  train { optimizer = adamw(lr = 1e-3) }
}
"""


def test_a_layout_is_not_given_up_when_full_recomputation_is_not_its_lightest(
        tmp_path, capsys):
    """A stage of one layer holds about one layer's activations in flight; full
    recomputation keeps its inputs and recomputes a whole layer on top (44.0 MB at the
    peak), more than selective (39.3 MB) and even none (43.5 MB): tune judged the layout
    by its full-recomputation variant and found nothing under 39.5 MB."""
    source = tmp_path / "rc.plan"
    source.write_text(ONE_LAYER_A_STAGE)
    keep = [arg for key in ("mesh.tp", "mesh.cp", "mesh.pp", "mesh.dp", "schedule.pipeline",
                            "schedule.microbatches") for arg in ("--keep", key)]
    status = main(["tune", str(source), "--gpus", "2", "--memory", "0.0395", "--top", "1",
                   "--json", *keep])
    result = json.loads(capsys.readouterr().out)
    assert status == 0
    assert (result["best"]["recompute"], result["best"]["memory_bytes"]) == \
        ("selective", 39_262_208)


def test_a_file_written_for_other_devices_is_tuned_for_these(tmp_path, capsys):
    """The file's mesh needs 8 devices; tune lays it out on 2 (part of a node)."""
    source = tmp_path / "eight.plan"
    source.write_text(SMALL.replace("mesh { dp = 4 }", "mesh { tp = 2; dp = 4 }")
                      .replace("; devices_per_node = 4", ""))
    status = main(["tune", str(source), "--gpus", "2", "--top", "1", "--json",
                   "--keep", "schedule.microbatches"])
    result = json.loads(capsys.readouterr().out)
    assert status == 0
    mesh = result["best"]["mesh"]
    assert mesh["tp"] * mesh["cp"] * mesh["pp"] * mesh["dp"] == 2
    assert "devices_per_node = 2" in result["best"]["plan"]


@pytest.mark.parametrize("args, message", [
    (["--gpus", "0"], "planc: error: --gpus must be at least 1"),
    (["--gpus", "4", "--keep", "mesh.xp"],
     "planc: error: --keep mesh.xp: not a choice tune makes; it can keep mesh.tp, mesh.cp, "
     "mesh.pp, mesh.dp, mesh.ep, mesh.order, shard.pp.virtual, schedule.microbatches, "
     "schedule.pipeline, shard.dp.zero, shard.tp.sequence_parallel, optimize.recompute, "
     "shard.pp.stages, schedule.overlap_all_to_all"),
    (["--gpus", "6"], "planc: error: --gpus 6 does not fill whole nodes of 4 devices (the "
                      "topology's devices_per_node); try --gpus 4 or 8"),
    (["--gpus", "4", "--memory", "0"],
     "planc: error: --memory 0: memory per device must be more than 0 GB and at most "
     "1e+21 GB"),
    (["--gpus", "4", "--memory", "inf"],
     "planc: error: --memory inf: memory per device must be more than 0 GB and at most "
     "1e+21 GB"),
])
def test_bad_arguments_are_one_line_errors(tmp_path, capsys, args, message):
    source = tmp_path / "small.plan"
    source.write_text(SMALL)
    assert main(["tune", str(source), *args]) == 2
    captured = capsys.readouterr()
    assert captured.err.strip() == message and captured.out == ""


def test_settings_replace_the_file_s_values_and_add_what_it_lacks():
    out = with_settings(SMALL, {"mesh.tp": "2", "mesh.pp": "2", "shard.dp.zero": "1",
                                "shard.tp.sequence_parallel": "on",
                                "schedule.pipeline": "zb1p"})
    assert "mesh { dp = 4; tp = 2; pp = 2 }" in out
    assert "schedule { microbatches = 2; pipeline = zb1p }" in out
    assert "  shard { dp { zero = 1 }; tp { sequence_parallel = on } }\n}" in out
    assert out.startswith("# a small llama")  # comments kept
    assert written_value(out, "shard.dp.zero") == "1"
    assert written_value(out, "mesh.cp") is None
    assert load_text(out).ok


@pytest.mark.parametrize("inside", ["\f", "\v", "\x1c", "\x85", "\u2028", "\r"])
def test_settings_count_lines_as_the_lexer_does(inside):
    """A form feed (or another character str.splitlines() breaks at) inside a line does
    not end it for the lexer: the settings land where the parser's spans say. Before,
    tune refused every layout of such a plan ("no layout ... passes the checker")."""
    source = SMALL.replace("a small llama", f"a small{inside} llama")  # in a comment
    if inside == "\f":  # and between tokens, where it is a blank
        source = source.replace("mesh {", "\fmesh {")
    assert load_text(source).ok
    out = with_settings(source, {"mesh.tp": "2", "shard.dp.zero": "1"})
    assert (written_value(out, "mesh.tp"), written_value(out, "shard.dp.zero")) == ("2", "1")
    assert load_text(out).ok and out.count(inside) == source.count(inside)


def test_a_comment_at_the_end_of_a_changed_line_goes_with_the_old_value():
    """A tuned plan kept "# 128 nodes x 8 GPUs" beside 64 nodes (a run of random plans
    found it): the comment ending a line whose value changed is dropped, the others and
    a '#' inside a string stay."""
    source = (PLANS / "gpt3-175b.plan").read_text()
    out = with_settings(source, {"topology.nodes": "64", "schedule.microbatches": "48",
                                 "mesh.dp": "16"})
    assert "  topology { preset = dgx-a100; nodes = 64 }\n" in out
    assert "    microbatches = 48\n" in out and "    dp = 16\n" in out
    assert "# 128 nodes" not in out and "1536 / 8 data-parallel" not in out
    assert out.splitlines()[:5] == source.splitlines()[:5]  # its header, unchanged
    text = 'plan p {\n  train { data = "a#b.tokens"; steps = 2 }  # two steps\n}\n'
    assert with_settings(text, {"train.steps": "3"}) == \
        'plan p {\n  train { data = "a#b.tokens"; steps = 3 }\n}\n'
    assert with_settings(text, {"train.seed": "1"}) == \
        'plan p {\n  train { data = "a#b.tokens"; steps = 2; seed = 1 }\n}\n'


def test_the_report_of_the_best_plan_shows_the_runner_ups(tmp_path, capsys):
    source = tmp_path / "small.plan"
    source.write_text(SMALL)
    best, ranked, page = tmp_path / "best.plan", tmp_path / "tune.json", tmp_path / "r.html"
    assert main(["tune", str(source), "--gpus", "4", "--top", "3", "--keep",
                 "schedule.microbatches", "--keep", "schedule.pipeline", "-o", str(best),
                 "--json"]) == 0
    ranked.write_text(capsys.readouterr().out)
    assert main(["report", str(best), "--tune", str(ranked), "-o", str(page)]) == 0
    assert "warning" not in capsys.readouterr().err  # the best plan is written clean
    html = page.read_text()
    section = html[html.index("<h2>Layouts planc tune ranked</h2>"):]
    assert section.count("<tr>") == 1 + 3  # the header and the three layouts
    assert "<td>1 (this plan)</td>" in section
    ranked.write_text('{"format": "planc-tune", "version": 1, "candidates": [{"mesh": 1}]}')
    assert main(["report", str(best), "--tune", str(ranked), "-o", str(page), "--force"]) == 1
    assert capsys.readouterr().err.strip() == (
        f"planc: error: {ranked}: candidate 1 has no valid mesh; it is not what planc tune "
        f"--json writes")


def test_uneven_layer_ranges_are_searched_where_the_chunks_cannot_be_equal():
    """6 layers over 4 stages: stages = auto counts the embedding and the head as a layer
    each ([0..0, 1..2, 3..4, 5..5]: the middle stages take the extra layers); "even"
    spreads the layers alone, the lower stages first ([0..1, 2..3, 4..4, 5..5]); the
    file's own ranges are kept for its own layout; all three are simulated."""
    text = SMALL.replace("layers = 4", "layers = 6").replace(
        "schedule { microbatches = 2 }",
        "schedule { microbatches = 2 }\n  shard { pp { stages = [0..1, 2..2, 3..4, 5..5] } }"
    ).replace("mesh { dp = 4 }", "mesh { pp = 4 }")
    plan = load_text(text).plan
    found = [c for c in candidates(plan, 4, ("mesh.pp", "schedule.pipeline",
                                             "schedule.microbatches", "shard.dp.zero",
                                             "optimize.recompute", "mesh.cp", "mesh.tp"))
             if not isinstance(c, str)]
    assert sorted(c.stages for c in found) == ["auto", "even"]
    settings = {c.stages: bounds.stages_setting(plan, c) for c in found}
    assert settings == {"auto": "auto", "even": "[0..1, 2..3, 4..4, 5..5]"}
    assert bounds.chunks_for(plan, next(c for c in found if c.stages == "auto")) == \
        ((0, 0), (1, 2), (3, 4), (5, 5))
    even = next(c for c in found if c.stages == "even")
    assert load_text(with_settings(text, {"shard.pp.stages": settings["even"]})).ok
    search = tune(plan, text, 4, top=3, keep=("mesh.pp", "schedule.pipeline"),
                  check=_check, per_node=4)
    own = [r for r in search.ranked if r.candidate.stages == "file"]
    assert [r.plan.shard.pp.chunks for r in own] == [((0, 1), (2, 2), (3, 4), (5, 5))]
    assert even in {r.candidate for r in search.ranked}


@pytest.mark.parametrize("name", ["narayanan-3_6b", "megatron-h100-7_1b", "korthikanti-22b"])
def test_the_bound_is_below_the_simulated_step_of_published_plans(name):
    """The bound runs compute at the fastest kernel's rate (A100 presets: unfused
    attention, GEMMs at 80% of peak; H100: GEMMs at 79%, fused attention slower)."""
    from planc.compile import compile_plan
    from planc.simulate import simulate
    plan = load_file(PLANS / f"{name}.plan").plan
    step = simulate(compile_plan(plan)).step_seconds
    bound = bounds.Estimator(plan.topology.devices_per_node).lower_bound(plan)
    assert 0.5 * step < bound < step


def test_a_variant_keeps_the_plans_fp32_gradient_buffer():
    # planc tune estimates a variant's memory from bounds.plan_of: BLOOM's BF16
    # optimizer buffer (shard { dp { fp32_grads } }) must stay when zero changes.
    plan = load_file(PLANS / "bloom" / "bloom-176b.plan").plan
    variant = bounds.plan_of(plan, dataclasses.replace(of_plan(plan), zero=0), 8)
    assert (variant.shard.dp.zero, variant.shard.dp.fp32_grads) == (0, True)
    # ... and a reduction's dtype (shard { dp { reduce_dtype } }): BLOOM's is bf16's, the
    # model's; said fp32, a variant keeps it
    assert variant.reduce_dtype_bytes == 2
    fp32 = load_file(PLANS / "bloom" / "bloom-176b.plan", ("shard.dp.reduce_dtype=fp32",)).plan
    assert bounds.plan_of(fp32, dataclasses.replace(of_plan(fp32), zero=0),
                          8).reduce_dtype_bytes == 4
    # its ZeRO-1 all-reduce (grad_reduce) is ZeRO-1's alone: another zero reduce-scatters
    assert plan.shard.dp.grad_reduce == "all_reduce"
    assert variant.shard.dp.grad_reduce == "reduce_scatter"
    same = bounds.plan_of(plan, dataclasses.replace(of_plan(plan), zero=1), 8)
    assert same.shard.dp.grad_reduce == "all_reduce"


def test_the_best_plan_drops_the_shard_blocks_of_axes_it_does_not_use(tmp_path, capsys):
    """The file's tp placements kept under a best layout of tp 1 made every later check
    of the written plan warn that they did nothing."""
    from planc.tune.candidate_text import without_blocks

    text = ("plan p {\n  shard {\n    tp { qkv = column; proj = row }\n    dp { zero = 1 }\n"
            "  }\n  other { tp { a = 1 }; cp { b = 2 } }\n}\n")
    assert without_blocks(text, [("shard", "tp"), ("other", "tp"), ("shard", "cp")]) == (
        "plan p {\n  shard {\n    dp { zero = 1 }\n  }\n  other { cp { b = 2 } }\n}\n")
    best = tmp_path / "best.plan"
    # on 2 GPUs (a search of seconds, not of 20 at 8) the best layout is dp 2, tp 1
    assert main(["tune", str(PLANS / "gpt-tiny.plan"), "--gpus", "2", "--top", "1",
                 "-o", str(best)]) == 0
    capsys.readouterr()
    assert load_file(best).plan.mesh.tp == 1 and "tp {" not in best.read_text()
    assert main(["check", str(best)]) == 0
    assert capsys.readouterr().err == ""  # no warning


def test_a_best_layout_without_sequence_parallelism_drops_gathered_inputs(tmp_path, capsys):
    """gathered_inputs acts only with sequence parallelism: a best layout without it wrote
    the file's ``regather`` on, which every later check of the written plan warned of."""
    from planc.tune.candidate_text import without_blocks

    text = "plan p {\n  shard { tp { sequence_parallel = off; gathered_inputs = regather } }\n}\n"
    assert without_blocks(text, [("shard", "tp", "gathered_inputs")]) == (
        "plan p {\n  shard { tp { sequence_parallel = off } }\n}\n")
    source, best = tmp_path / "t.plan", tmp_path / "best.plan"
    source.write_text(SMALL.replace("mesh { dp = 4 }", "mesh { tp = 2 }\n  shard { tp { "
                                    "sequence_parallel = off; gathered_inputs = regather } }"
                                    ).replace("devices_per_node = 4", "devices_per_node = 2"))
    assert main(["tune", str(source), "--gpus", "2", "--keep", "mesh.tp", "--keep",
                 "shard.tp.sequence_parallel", "--top", "1", "-o", str(best)]) == 0
    capsys.readouterr()
    assert "sequence_parallel = off" in best.read_text()
    assert "gathered_inputs" not in best.read_text()
    assert main(["check", str(best)]) == 0
    assert capsys.readouterr().err == ""  # no warning


@pytest.mark.parametrize("inputs", ["keep", "regather"])
def test_a_layout_fits_only_as_planc_run_would_hold_it(inputs):
    """Under sequence parallelism with gathered_inputs = keep, planc's runtime holds each
    GEMM's gathered input whole: beyond the estimate (Megatron-LM's count), and tune
    counts it; with regather the runtime holds the estimate. A capacity between the two
    takes the one layout tp 2 with sequence parallelism (every key kept) out, or not."""
    from planc.estimate import memory
    from planc.tune.space import KEEPABLE

    source = SMALL.replace("mesh { dp = 4 }", "mesh { tp = 2 }\n  shard { tp { "
                           f"sequence_parallel = on; gathered_inputs = {inputs} }} }}"
                           ).replace("devices_per_node = 4", "devices_per_node = 2")
    plan = _check(source)
    estimate = memory.estimate(plan)
    keep = memory.estimate(dataclasses.replace(plan, shard=dataclasses.replace(
        plan.shard, tp=dataclasses.replace(plan.shard.tp, gathered_inputs="keep"))))
    assert keep.held_peak_bytes > estimate.peak.total_bytes
    capacity = (estimate.peak.total_bytes + keep.held_peak_bytes) / 2
    search = tune(plan, source, 2, top=1, capacity=capacity, keep=tuple(KEEPABLE),
                  check=_check, per_node=2)
    if inputs == "keep":
        assert search.ranked == [] and search.pruned["memory"] >= 1
    else:
        assert [r.candidate for r in search.ranked] == [of_plan(plan)]


def test_a_wrong_override_is_named_before_any_search(tmp_path, capsys):
    """The neutral layout tune reads a file by must not hide an override's own error:
    every candidate got the override too, and the search ended in 'no layout fits'."""
    output = tmp_path / "best.plan"
    assert main(["tune", str(PLANS / "demo.plan"), "--gpus", "8", "--set", "mesh.dp=0",
                 "-o", str(output)]) == 1
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [
        "--set mesh.dp=0:1:9: error: expected a positive integer, got 0",
        "   1 | mesh.dp=0", "     |         ^", "1 error generated."]
    assert captured.out == "" and not output.exists()


@pytest.mark.parametrize("override", ["schedule.microbatches=16", "schedule.pipeline=interleaved"])
def test_an_override_wrong_only_under_the_file_s_own_layout_is_searched(tmp_path, override):
    """The file's dp 2 leaves 8 sequences a replica, and it has no virtual stages: each
    override fails there, and the search finds layouts where it holds."""
    output = tmp_path / "best.plan"
    assert main(["tune", str(PLANS / "gpt-tiny.plan"), "--gpus", "8", "--top", "1",
                 "--set", override, "-o", str(output)]) == 0
    assert load_file(output, [override]).ok
