"""``--set KEY=VALUE``: overriding a key of a plan from the command line.

An override replaces or adds a key (creating blocks the file lacks) and the result is
checked as if it had been written in the file; its diagnostics point into the override
(``--set mesh.tp=8:1:9: error: ...``), a malformed override is a command-line error
(exit status 2), and the plan records the overrides it was built with.
"""

from __future__ import annotations

import json
import os

import pytest

from planc import cli
from planc.diagnostics import (
    Source,
    Span,
    error,
    in_source_order,
    render_json,
    render_text,
)
from planc.lang import OverrideError, load_file, load_text
from planc.lang.overrides import parse_override
from planc.plan.plan import Mesh, Optimizer

BASE = """\
plan base {
  model gpt {
    layers = 2
    hidden = 96
    heads  = 12
    vocab  = 256
    seq    = 32
    batch  = 16
  }
  mesh {
    tp = 2
    dp = 2
  }
  schedule { microbatches = 2 }
}
"""


@pytest.fixture
def base(tmp_path):
    path = tmp_path / "base.plan"
    path.write_text(BASE, encoding="utf-8")
    return path


def loaded_with(*overrides: str, text: str = BASE):
    return load_text(text, "base.plan", overrides)


def text_of(loaded) -> str:
    return render_text(loaded.diagnostics, loaded.path, loaded.source)


def edited(old: str, new: str) -> str:
    assert old in BASE
    return BASE.replace(old, new)


def planc(capsys, *args: str) -> tuple[int, str, str]:
    """Run planc.cli.main; returns status, stdout and stderr. argparse's exits count."""
    try:
        status = cli.main([str(a) for a in args])
    except SystemExit as exc:
        status = exc.code
    out, err = capsys.readouterr()
    return status, out, err


def usage_error(err: str) -> str:
    """What follows argparse's usage lines (their wrapping depends on the terminal)."""
    assert err.startswith("usage: planc ")
    return err[err.index("\nplanc ") + 1:]


# --- valid overrides change the plan --------------------------------------------------


def test_a_valid_override_changes_the_plan_and_is_recorded(base):
    loaded = load_file(base, ["mesh.tp=4", "mesh.dp=1"])
    assert loaded.ok and loaded.diagnostics == ()
    plan = loaded.plan
    assert plan.mesh == Mesh(tp=4, cp=1, pp=1, dp=1)
    assert plan.topology.nodes * plan.topology.devices_per_node == 4
    assert plan.sources.overrides == ("mesh.tp=4", "mesh.dp=1")
    assert [o.text for o in loaded.overrides] == ["mesh.tp=4", "mesh.dp=1"]
    # The overridden settings remember that they were written in an override.
    assert plan.sources.span("mesh.tp") == Span(1, 9, 1, 10,
                                                Source("--set mesh.tp=4", "mesh.tp=4", 1))
    assert plan.sources.span("mesh.dp") == Span(1, 9, 1, 10,
                                                Source("--set mesh.dp=1", "mesh.dp=1", 2))
    assert plan.sources.span("model.heads") == Span(5, 14, 5, 16)
    # Everything else is what the file says.
    assert plan == load_text(edited("tp = 2\n    dp = 2", "tp = 4\n    dp = 1"), "x").plan


def test_an_override_replaces_a_key_the_file_sets():
    plan = loaded_with("model.layers=4").plan
    assert plan.model.layers == 4
    assert plan == load_text(edited("layers = 2", "layers = 4"), "x").plan


def test_an_override_adds_a_key_and_the_blocks_the_file_lacks():
    loaded = loaded_with("optimize.fuse=off", "shard.tp.sequence_parallel=on",
                         "topology.device.memory=80GB")
    assert loaded.ok and loaded.diagnostics == ()
    plan = loaded.plan
    assert plan.optimize.fuse is False
    assert plan.shard.tp.sequence_parallel is True
    assert plan.topology.device.memory == 80e9
    assert plan == load_text(BASE.replace("  schedule", "  optimize { fuse = off }\n"
                                          "  shard { tp { sequence_parallel = on } }\n"
                                          "  topology { device { memory = 80GB } }\n"
                                          "  schedule"), "x").plan
    # The added blocks are located at their names in the overrides.
    assert plan.sources.span("optimize").source.name == "--set optimize.fuse=off"
    assert plan.sources.span("shard.tp") == Span(
        1, 7, 1, 9, Source("--set shard.tp.sequence_parallel=on",
                           "shard.tp.sequence_parallel=on", 2))


def test_an_expression_override_is_evaluated_in_its_block():
    plan = loaded_with("model.layers=2*4", "model.ffn=2 * hidden + 8").plan
    assert (plan.model.layers, plan.model.ffn) == (8, 200)


def test_a_list_override():
    plan = loaded_with("mesh.order=[dp, pp, cp, tp]").plan
    assert plan.mesh.order == ("dp", "pp", "cp", "tp")


def test_a_call_override():
    plan = loaded_with("train.optimizer=adamw(lr = 3e-4)").plan
    assert plan.train.optimizer == Optimizer("adamw", lr=3e-4, momentum=0.0,
                                             betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def test_quantities_words_ranges_and_strings_read_as_in_a_file(tmp_path):
    loaded = loaded_with("optimize.bucket=50MB", "schedule.pipeline=gpipe",
                         "mesh.pp=2", "shard.pp.stages=[0..0, 1..1]", 'train.data="t.bin"',
                         "topology.preset=dgx-a100", "topology.devices_per_node=8")
    plan = loaded.plan
    assert plan.optimize.bucket == 50e6
    assert plan.schedule.pipeline == "gpipe"
    assert plan.shard.pp.chunks == ((0, 0), (1, 1))
    assert plan.topology.preset == "dgx-a100"
    assert plan.train.data.endswith("t.bin")  # relative to the plan file, as in a file
    assert [d.message for d in loaded.diagnostics] == [
        "data file 't.bin' does not exist (yet); planc run will need it"]


def test_the_last_of_two_overrides_of_one_key_wins():
    loaded = loaded_with("mesh.tp=3", "mesh.tp=4")
    assert loaded.ok and loaded.plan.mesh.tp == 4
    assert loaded.plan.sources.overrides == ("mesh.tp=3", "mesh.tp=4")


def test_no_overrides_changes_nothing():
    loaded = load_text(BASE, "base.plan")
    assert loaded.plan.sources.overrides == () and loaded.overrides == ()
    assert all(span.source is None for span in loaded.plan.sources.spans.values())


# --- diagnostics point into the override ------------------------------------------------


def test_an_unknown_key_gets_a_did_you_mean_in_the_override():
    assert text_of(loaded_with("mesh.tpp=2")) == (
        "--set mesh.tpp=2:1:6: error: unknown key 'tpp' in mesh { }\n"
        "   1 | mesh.tpp=2\n"
        "     |      ^~~\n"
        "  hint: did you mean 'tp'?")


def test_an_unknown_block_on_the_path():
    assert text_of(loaded_with("meshh.tp=2")) == (
        "--set meshh.tp=2:1:1: error: unknown block 'meshh' at the top of the plan\n"
        "   1 | meshh.tp=2\n"
        "     | ^~~~~\n"
        "  hint: did you mean 'mesh'?")


def test_a_key_without_its_block_says_where_it_belongs():
    assert text_of(loaded_with("tp=2")) == (
        "--set tp=2:1:1: error: unknown key 'tp' at the top of the plan\n"
        "   1 | tp=2\n"
        "     | ^~\n"
        "  hint: 'tp' belongs in mesh { }")


def test_a_value_of_the_wrong_type():
    assert text_of(loaded_with("mesh.tp=fast")) == (
        "--set mesh.tp=fast:1:9: error: expected a positive integer, got the word 'fast'\n"
        "   1 | mesh.tp=fast\n"
        "     |         ^~~~")


def test_a_divisibility_error_caused_by_the_override_is_reported_at_it():
    assert text_of(loaded_with("mesh.dp=3")) == (
        "--set mesh.dp=3:1:9: error: batch (16) must divide by dp (3)\n"
        "   1 | mesh.dp=3\n"
        "     |         ^\n"
        "  hint: try dp = 2 or batch = 18")
    assert text_of(loaded_with("mesh.tp=8")) == (
        "--set mesh.tp=8:1:9: error: heads (12) must divide by tp (8)\n"
        "   1 | mesh.tp=8\n"
        "     |         ^\n"
        "  hint: tp must divide heads; try tp = 4 or tp = 2")


def test_a_rule_pointing_at_a_key_of_the_file_stays_in_the_file():
    # batch comes from the override, but the rule is reported at dp, in the file.
    assert text_of(loaded_with("model.batch=15")) == (
        "base.plan:12:10: error: batch (15) must divide by dp (2)\n"
        "  12 |     dp = 2\n"
        "     |          ^\n"
        "  hint: try batch = 16")


def test_file_diagnostics_come_first_then_overrides_in_command_line_order():
    text = BASE.replace("layers = 2", "layers = two")
    loaded = load_text(text, "base.plan", ["mesh.cp=fast", "model.dtype=fp64"])
    assert [(d.span.source.name if d.span.source else "base.plan", d.span.line,
             d.span.column, d.message) for d in loaded.diagnostics] == [
        ("base.plan", 3, 14, "expected a positive integer, got the word 'two'"),
        ("--set mesh.cp=fast", 1, 9, "expected a positive integer, got the word 'fast'"),
        ("--set model.dtype=fp64", 1, 13,
         "unknown value 'fp64'; expected fp32, bf16 or fp16"),
    ]


def test_a_warning_about_an_overridden_key():
    loaded = loaded_with("topology.device.memory=1MB")
    assert loaded.ok
    assert text_of(loaded) == (
        "--set topology.device.memory=1MB:1:24: warning: estimated memory per device is "
        "2.93 MB, more than the device's 1 MB\n"
        "   1 | topology.device.memory=1MB\n"
        "     |                        ^~~\n"
        "  hint: parameters 561 KB, gradients 561 KB, optimizer state 0 B, activations "
        "1.81 MB (1 microbatch in flight)\n"
        "  hint: zero, recompute, more tp or pp, or a smaller microbatch would lower it")


def test_a_duplicate_key_of_the_file_names_the_override_that_replaced_the_first():
    text = BASE.replace("dp = 2", "dp = 2\n    tp = 2")
    assert text_of(load_text(text, "base.plan", ["mesh.tp=4"])) == (
        "base.plan:13:5: error: duplicate key 'tp' (first given by --set mesh.tp=4)\n"
        "  13 |     tp = 2\n"
        "     |     ^~")


def test_the_overrides_are_not_checked_when_the_file_does_not_parse():
    loaded = load_text(BASE.replace("tp = 2", "tp 2"), "base.plan", ["mesh.tpp=8"])
    assert [(d.span.line, d.message) for d in loaded.diagnostics] == [
        (11, "unexpected '2'; expected '=', '{' or a name")]


def test_json_names_the_override_as_the_file():
    loaded = loaded_with("mesh.tp=8")
    assert json.loads(render_json(loaded.diagnostics, loaded.path)) == {
        "version": 1, "diagnostics": [{
            "severity": "error", "message": "heads (12) must divide by tp (8)",
            "file": "--set mesh.tp=8", "line": 1, "column": 9, "end_line": 1,
            "end_column": 10, "hints": ["tp must divide heads; try tp = 4 or tp = 2"]}],
        "errors": 1, "warnings": 0}


def test_spans_of_several_sources_sort_the_file_first():
    override = Source("--set mesh.tp=8", "mesh.tp=8", 1)
    later = Source("--set mesh.dp=3", "mesh.dp=3", 2)
    spans = [Span(1, 9, 1, 10, later), Span(1, 9, 1, 10, override), Span(20, 1, 20, 2),
             Span(1, 9, 1, 10)]
    assert sorted(spans) == [Span(1, 9, 1, 10), Span(20, 1, 20, 2),
                             Span(1, 9, 1, 10, override), Span(1, 9, 1, 10, later)]
    assert Span(1, 9, 1, 10, override) != Span(1, 9, 1, 10)
    # The same message at the same place of two overrides is two diagnostics.
    twice = [error("bad", Span(1, 9, 1, 10, override)), error("bad", Span(1, 9, 1, 10, later))]
    assert len(in_source_order(twice)) == 2
    assert repr(Span(1, 2, 1, 3)) == "Span(line=1, column=2, end_line=1, end_column=3)"


# --- malformed overrides ----------------------------------------------------------------


@pytest.mark.parametrize("text, message", [
    ("mesh.tp", "'mesh.tp' has no '='; write KEY=VALUE, such as mesh.tp=2"),
    ("=4", "'=4' names no key before '='; write KEY=VALUE, such as mesh.tp=2"),
    ("mesh..tp=4", ("'mesh..tp' is not a key path: write the block names and the key joined "
                    "by '.', such as mesh.tp or shard.dp.zero")),
    ("mesh tp=4", ("'mesh tp' is not a key path: write the block names and the key joined "
                   "by '.', such as mesh.tp or shard.dp.zero")),
    ("mesh.tp=", "mesh.tp has no value after '='"),
    ("mesh.tp=(8", "unexpected end of the value: '(' at column 9 is never closed"),
    ("mesh.tp=8 8", "unexpected '8'; expected the end of the value"),
    ("mesh.tp=8;", "unexpected ';'; expected the end of the value"),
    ("mesh.tp=8)", "unexpected ')': it closes nothing"),
    ("optimize.bucket=25 MB", "unexpected 'MB'; expected the end of the value"),
    ('train.data="x', "unterminated string"),
    ("mesh.tp=" + "[" * 65, "brackets nested more than 64 deep"),
    ("mesh=4", "'mesh' is a block, not a key; name one of its keys, such as mesh.tp"),
    ("shard.tp=1", ("'shard.tp' is a block, not a key; name one of its keys, such as "
                    "shard.tp.embedding")),
    ("mesh.tp.size=4", "'mesh.tp' is a key, not a block: it holds a value, not 'size'"),
    ("model.gpt.layers=4", ("the path of a key of model gpt { } names the block, not its "
                            "family: write model.layers")),
    ("mesh.tp=2\nmesh.dp=2",
     "'mesh.tp=2\\nmesh.dp=2' holds a line break; an override is one line"),
])
def test_a_malformed_override_raises(text, message):
    with pytest.raises(OverrideError) as caught:
        parse_override(text)
    assert str(caught.value) == message
    with pytest.raises(OverrideError):
        load_text(BASE, "base.plan", [text])


def test_a_malformed_override_is_reported_before_the_file_is_read(tmp_path):
    with pytest.raises(OverrideError):
        load_file(tmp_path / "missing.plan", ["mesh.tp"])


def test_overrides_are_a_sequence_of_texts():
    with pytest.raises(TypeError):
        load_text(BASE, "base.plan", "mesh.tp=2")


def test_blanks_around_the_key_and_value_are_allowed():
    override = parse_override(" mesh.tp = 4 ")
    assert override.path == ("mesh", "tp")
    assert override.path_spans[1] == Span(1, 7, 1, 9, override.source)
    assert override.value.span == Span(1, 12, 1, 13, override.source)


# --- the command line -------------------------------------------------------------------


def test_check_with_overrides(capsys, base):
    status, out, err = planc(capsys, "check", base, "--set", "mesh.tp=4", "--set",
                             "optimize.fuse=off")
    assert (status, err) == (0, "")
    assert out == (f"{base}: ok: plan base, 276K parameters, 8 ranks (tp 4 x cp 1 x pp 1 x "
                   f"dp 2) on 1 x 8 devices, 1.78 MB per device at peak (2 overrides "
                   f"applied)\n")


def test_check_verbose_mentions_the_overrides_first(capsys, base):
    status, out, err = planc(capsys, "check", base, "-v", "--set", "mesh.tp=4")
    assert (status, err) == (0, "")
    lines = out.split("\n")
    assert lines[0].endswith(" per device at peak (1 override applied)")
    assert lines[2].startswith("model gpt  layers 2, hidden 96, heads 12")
    assert "mesh       tp 4 x cp 1 x pp 1 x dp 2 = 8 ranks" in out


def test_check_reports_an_override_in_text(capsys, base):
    status, out, err = planc(capsys, "check", base, "--set", "mesh.tp=8")
    assert (status, out) == (1, "")
    assert err == ("--set mesh.tp=8:1:9: error: heads (12) must divide by tp (8)\n"
                   "   1 | mesh.tp=8\n"
                   "     |         ^\n"
                   "  hint: tp must divide heads; try tp = 4 or tp = 2\n"
                   "1 error generated.\n")


def test_check_reports_an_override_in_json(capsys, base):
    status, out, err = planc(capsys, "check", base, "--error-format", "json",
                             "--set", "mesh.tpp=2")
    assert (status, err) == (1, "")
    assert out == """\
{
  "version": 1,
  "diagnostics": [
    {
      "severity": "error",
      "message": "unknown key 'tpp' in mesh { }",
      "file": "--set mesh.tpp=2",
      "line": 1,
      "column": 6,
      "end_line": 1,
      "end_column": 9,
      "hints": [
        "did you mean 'tp'?"
      ]
    }
  ],
  "errors": 1,
  "warnings": 0
}
"""


@pytest.mark.parametrize("command", ["check", "compile", "run"])
def test_a_malformed_override_exits_2(capsys, base, command):
    status, out, err = planc(capsys, command, base, "--set", "mesh.tp=(8")
    assert (status, out) == (2, "")
    assert usage_error(err) == (
        f"planc {command}: error: argument --set: mesh.tp=(8: unexpected end of the value: "
        f"'(' at column 9 is never closed\n"
        f"   1 | mesh.tp=(8\n"
        f"     |         ^\n"
        f"  hint: add ')' to close it\n")


def test_an_override_without_equal_sign_exits_2(capsys, base):
    status, out, err = planc(capsys, "check", base, "--set", "mesh.tp")
    assert (status, out) == (2, "")
    assert usage_error(err) == ("planc check: error: argument --set: 'mesh.tp' has no '='; "
                                "write KEY=VALUE, such as mesh.tp=2\n")


def test_an_override_naming_a_block_exits_2(capsys, base):
    status, out, err = planc(capsys, "check", base, "--set", "shard.dp=1")
    assert (status, out) == (2, "")
    assert usage_error(err) == (
        "planc check: error: argument --set: shard.dp=1: 'shard.dp' is a block, not a key; "
        "name one of its keys, such as shard.dp.zero\n"
        "   1 | shard.dp=1\n"
        "     |       ^~\n")


def test_overrides_with_a_build_directory_exit_2(capsys, tmp_path):
    build = tmp_path / "build"
    build.mkdir()
    status, out, err = planc(capsys, "run", build, "--set", "mesh.tp=2")
    assert (status, out) == (2, "")
    assert err == (f"planc: error: --set needs a .plan file, but {build} is a directory (a "
                   f"build is already compiled); run the plan file with --set instead\n")


def test_every_command_reading_a_plan_file_takes_overrides(capsys, base, tmp_path):
    status, out, err = planc(capsys, "layout", base, "--set", "mesh.tp=2", "--json")
    assert (status, err) == (0, "") and '"sizes":{"tp":2,' in out
    for command in ("graph", "explain", "programs", "verify"):
        status, _, err = planc(capsys, command, base, "--set", "mesh.tp=2")
        assert (status, err) == (0, ""), command
    build = tmp_path / "build"
    build.mkdir()
    for command in ("graph", "explain", "programs", "verify"):
        status, out, err = planc(capsys, command, build, "--set", "mesh.tp=2")
        assert (status, out) == (2, "") and err.startswith("planc: error: --set needs a "
                                                             ".plan file"), command


def test_compile_with_overrides_builds_the_overridden_plan(capsys, base, tmp_path):
    output = tmp_path / "out"
    status, out, err = planc(capsys, "compile", base, "-o", output, "--set", "mesh.tp=4",
                             "--set", "schedule.microbatches=1")
    assert (status, err) == (0, "")
    assert out.split("\n")[0].endswith(f"build written to {os.path.join(output, '')}")
    plan = json.loads((output / "plan.json").read_text())
    assert (plan["mesh"]["tp"], plan["mesh"]["dp"], plan["schedule"]["microbatches"]) == (4, 2, 1)


def test_compile_reports_an_override_and_writes_nothing(capsys, base, tmp_path):
    output = tmp_path / "out"
    status, out, err = planc(capsys, "compile", base, "-o", output, "--set", "mesh.dp=3")
    assert (status, out) == (1, "")
    assert err == ("--set mesh.dp=3:1:9: error: batch (16) must divide by dp (3)\n"
                   "   1 | mesh.dp=3\n"
                   "     |         ^\n"
                   "  hint: try dp = 2 or batch = 18\n"
                   "1 error generated.\n")
    assert not output.exists()


def test_the_real_command_line(run_planc, base):
    """The installed entry point, in a process of its own."""
    result = run_planc("check", base, "--set", "mesh.tp=8", "--set", "mesh.dp=3")
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr == ("--set mesh.tp=8:1:9: error: heads (12) must divide by tp (8)\n"
                             "   1 | mesh.tp=8\n"
                             "     |         ^\n"
                             "  hint: tp must divide heads; try tp = 4 or tp = 2\n"
                             "--set mesh.dp=3:1:9: error: batch (16) must divide by dp (3)\n"
                             "   1 | mesh.dp=3\n"
                             "     |         ^\n"
                             "  hint: try dp = 2 or batch = 18\n"
                             "2 errors generated.\n")
    result = run_planc("check", base, "--set", "model.heads=12.5")
    assert result.returncode == 1
    assert result.stderr.startswith("--set model.heads=12.5:1:13: error: expected an integer, "
                                    "got 12.5\n")
    result = run_planc("compile", base, "--set", "mesh.tp")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.endswith("planc compile: error: argument --set: 'mesh.tp' has no "
                                  "'='; write KEY=VALUE, such as mesh.tp=2\n")
