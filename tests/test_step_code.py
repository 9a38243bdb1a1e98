"""The step's generated code (planc.program.step_code): it issues exactly its program's
instructions, in order, on each stream, and the check refuses code that drops,
reorders, repeats or adds one; planc programs --code prints it."""

from __future__ import annotations

import ast
import re

import pytest

from planc.compile import compile_plan
from planc.lang import load_text
from planc.program import step_code
from planc.program.expansion import expand
from planc.program.program import EVENT_OPS, Opcode
from tests.conftest import PLANS
from tests.runtime_matrix import MATRIX, plan_text

# Every kind of step: each schedule, ZeRO, tp with sequence parallelism, ring attention,
# the mixture of experts, tied embeddings over the pipeline, an evaluation.
CASES = ["single", "tp-sequence-parallel", "cp-ring", "pp-gpipe-uneven", "pp-1f1b-uneven",
         "pp-interleaved-uneven-auto-tp-sp", "tied-pp-interleaved-uneven", "dp-zero3",
         "tp2-pp2-dp2"]
SCHEDULES = ["zb1p", "interleaved_zb", "zbv", "dualpipev"]


def _build(text: str):
    loaded = load_text(text, "step.plan")
    assert loaded.ok, loaded.diagnostics
    return compile_plan(loaded.plan)


def _programs(text: str) -> dict:
    return _build(text).programs


def _cases():
    for name in CASES:
        yield name, plan_text(name, **MATRIX[name])
    for schedule in SCHEDULES:
        virtual = "; virtual = 2" if schedule != "zb1p" else ""
        yield schedule, plan_text(schedule, mesh="pp = 2", m=4,
                                  shard=f"pp {{ stages = auto{virtual} }}" if virtual else "",
                                  schedule=f"; pipeline = {schedule}")
    yield "moe-tiny", (PLANS / "moe-tiny.plan").read_text()
    # every collective on the compute stream and a sync of every stream before the
    # epilogue
    yield "tp2-pp2-dp2-overlap-off", plan_text("off", **{**MATRIX["tp2-pp2-dp2"],
                                                        "optimize": "overlap = off"})


CASE_TEXTS = dict(_cases())


def _calls(source: str) -> dict[str, list[str]]:
    """Each function's statements that issue an instruction, as written."""
    out = {}
    for function in ast.parse(source).body:
        out[function.name] = [ast.unparse(s.value) for s in function.body
                              if isinstance(s, ast.Expr) and not
                              ast.unparse(s.value).startswith(("R(", "Z("))]
    return out


@pytest.mark.parametrize("name", list(CASE_TEXTS))
def test_the_code_issues_the_programs_instructions_in_order_on_each_stream(name):
    for program in _programs(CASE_TEXTS[name]).values():
        code = step_code.generate(program)
        step_code.check(code, program)
        events = {event: j for j, event in enumerate(code.events)}
        per_stream: dict[str, list[str]] = {}
        for item in expand(program):
            per_stream.setdefault(item.stream, []).append(
                f"E[{events[item.event]}].set()" if item.op is Opcode.RECORD else
                f"W(E[{events[item.event]}])" if item.op is Opcode.WAIT else
                f"Y({item.index})" if item.op is Opcode.SYNC else f"X[{item.index}](S)")
        calls = _calls(code.source)
        assert [s.name for s in code.streams] == list(per_stream)
        functions = {f.name: f for f in ast.parse(code.source).body}
        for stream in code.streams:
            assert calls[stream.function] == per_stream[stream.name]
            # a stop check (Z) right before the first instruction of every block, and
            # nowhere else: the stream's instructions counted before each check
            checks, issued = [], 0
            for statement in functions[stream.function].body:
                text = ast.unparse(statement)
                if not isinstance(statement, ast.Expr) or text.startswith("R("):
                    continue
                if text == "Z()":
                    checks.append(issued)
                else:
                    issued += 1
            items = stream.items
            starts = [k for k in range(len(items))
                      if k == 0 or items[k].where != items[k - 1].where]
            assert checks == starts and issued == len(items)
        # a sync (Y) waits until every other stream has issued what the expansion puts
        # before it: per stream slot, that many instructions
        expanded = list(expand(program))
        slots = {name: k for k, name in enumerate(dict.fromkeys(i.stream for i in expanded))}
        assert code.syncs == {
            item.index: tuple((slots[other], sum(1 for i in expanded[:k] if i.stream == other))
                              for other in slots if other != item.stream)
            for k, item in enumerate(expanded) if item.op is Opcode.SYNC}
        # the trace variant issues the same and reports each compute and transfer once
        traced = step_code.generate(program, trace=True)
        step_code.check(traced, program)
        assert _calls(traced.source) == calls
        reported = re.findall(r"R\(\((\d+), t0, t1\)\)", traced.source)
        assert sorted(map(int, reported)) == sorted(
            item.index for item in expand(program) if item.op not in EVENT_OPS)


def _lines(code: step_code.StepCode) -> list[str]:
    return code.source.splitlines()


def _tampered(code: step_code.StepCode, lines: list[str]) -> step_code.StepCode:
    return step_code.StepCode("\n".join(lines) + "\n", code.streams, code.events, code.syncs)


@pytest.fixture(scope="module")
def pipelined():
    programs = _programs(CASE_TEXTS["tp2-pp2-dp2"])
    program = programs[sorted(programs)[0]]
    return program, step_code.generate(program)


def _instruction_lines(code, stream: str = "compute") -> list[int]:
    """The lines of ``stream``'s function that issue an instruction."""
    lines = _lines(code)
    function = next(s.function for s in code.streams if s.name == stream)
    start = lines.index(f"def {function}(S, X, E, W, Y, Z, D, T, R):")
    end = lines.index("    return compute, comm, exposed, pipeline", start)
    return [k for k in range(start, end) if re.match(r"    (Z\(\); )?(X\[|W\(|E\[)", lines[k])]


def test_dropping_an_instruction_is_refused(pipelined):
    program, code = pipelined
    lines = _lines(code)
    k = _instruction_lines(code)[5]
    dropped = lines[k].split("#")[-1].split(" (")[0]
    del lines[k]
    with pytest.raises(step_code.StepCodeError, match=re.escape(
            "differ from instruction 6 of the stream on (the program's #" + dropped)):
        step_code.check(_tampered(code, lines), program)


def test_reordering_two_instructions_is_refused(pipelined):
    program, code = pipelined
    lines = _lines(code)
    a, b = _instruction_lines(code)[7:9]
    lines[a], lines[b] = lines[b], lines[a]
    with pytest.raises(step_code.StepCodeError, match="differ from instruction 8 of the stream on"):
        step_code.check(_tampered(code, lines), program)


def test_repeating_an_instruction_is_refused(pipelined):
    program, code = pipelined
    lines = _lines(code)
    k = _instruction_lines(code)[3]
    lines.insert(k, lines[k])
    with pytest.raises(step_code.StepCodeError, match="differ from instruction 5 of the stream on"):
        step_code.check(_tampered(code, lines), program)


def test_moving_an_instruction_to_another_stream_is_refused(pipelined):
    program, code = pipelined
    lines = _lines(code)
    k = next(k for k in _instruction_lines(code, "dp") if "X[" in lines[k])
    moved = lines.pop(k)
    lines.insert(_instruction_lines(code)[-1] + 1, moved)  # into the compute stream
    with pytest.raises(step_code.StepCodeError, match="stream 'dp': the generated code "
                                                      "issues 5 instructions where the "
                                                      "program has 6"):
        step_code.check(_tampered(code, lines), program)


@pytest.mark.parametrize("statement, message", [
    ("    if D[0]:\n        pass", "a statement that is no instruction"),
    ("    import os", "a statement that is no instruction"),
    ("    print(S)", "a call that is no instruction"),
    ("    t0 = X[0](S)", "a call inside an assignment"),
    # the clock T() takes nothing: a call hidden among its arguments would run unseen
    ("    t1 = T(X[0](S))", "a call inside an assignment"),
    ("    X[D[0]](S)", "an index that is not a number"),
])
def test_code_that_does_anything_else_is_refused(pipelined, statement, message):
    program, code = pipelined
    lines = _lines(code)
    k = _instruction_lines(code)[0]
    lines.insert(k, statement)
    with pytest.raises(step_code.StepCodeError, match=message):
        step_code.check(_tampered(code, lines), program)


def test_code_outside_the_streams_functions_is_refused(pipelined):
    program, code = pipelined
    with pytest.raises(step_code.StepCodeError, match="defines other things"):
        step_code.check(_tampered(code, _lines(code) + ["import os"]), program)


def test_names_from_the_program_appear_only_in_comments():
    """A build is untrusted: a node named like code (a newline, an import, a quote, a
    comment's end) is a string in a comment, and the code does not change."""
    import json

    from planc.program.program import Program

    text = CASE_TEXTS["single"]
    program = next(iter(_programs(text).values()))
    code = step_code.generate(program)
    hostile = "F/L0/qkv\n    import os; os.system('x')  # ' \"\"\" \\"
    renamed = Program.from_json(json.loads(json.dumps(program.to_json()).replace(
        '"F/L0/qkv', json.dumps(hostile)[:-1])))
    assert any(i.node == hostile for i in renamed.blocks["F0"])
    changed = step_code.generate(renamed)
    ast.parse(changed.source)
    before, after = _lines(code), _lines(changed)
    assert len(after) == len(before)
    assert [line.split("  #")[0] for line in after] == [line.split("  #")[0] for line in before]
    assert any(line.endswith(f"compute {hostile!r} mb 0 ('F0 mb 0')") for line in after)
    for line in after:
        assert "import os" not in line.split("  #")[0]


def test_planc_programs_code_prints_the_ranks_step(run_planc, tmp_path):
    build = tmp_path / "b"
    (tmp_path / "p.plan").write_text(CASE_TEXTS["tp2-pp2-dp2"])
    assert run_planc("compile", tmp_path / "p.plan", "-o", build).returncode == 0
    shown = run_planc("programs", build, "--rank", "1", "--code")
    assert shown.returncode == 0, shown.stderr
    header, source = shown.stdout.split("\n", 1)
    program = _build(CASE_TEXTS["tp2-pp2-dp2"])
    name = program.table.program_of(1)
    code = step_code.generate(program.programs[name])
    assert source == code.source
    count = sum(len(s.items) for s in code.streams)
    assert header == f"# rank 1: program {name}, {count:,} instructions on " \
                     f"{len(code.streams)} streams"
    refused = run_planc("programs", build, "--code", "--expand")
    assert refused.returncode == 2
    assert refused.stderr == "planc: error: --code prints the whole step; it takes neither " \
                             "--expand nor --microbatch\n"


def test_a_wait_for_an_event_nobody_records_stops_an_unverified_run_in_one_line(
        tmp_path, capfd):
    """planc verify refuses such a program; run with --no-verify (or started by torchrun
    on a build nobody verified), each rank stops at the code's generation with the
    instruction named, never a traceback."""
    import json

    from planc.cli import main

    (tmp_path / "p.plan").write_text(CASE_TEXTS["dp-zero3"])
    assert main(["compile", str(tmp_path / "p.plan"), "-o", str(tmp_path / "b")]) == 0
    path = tmp_path / "b" / "programs" / "stage0.json"
    program = json.loads(path.read_text())
    wait = next(item for items in program["blocks"].values() for item in items
                if item["op"] == "wait")
    wait["event"] = "done:nowhere"
    path.write_text(json.dumps(program))
    capfd.readouterr()
    assert main(["run", str(tmp_path / "b"), "--no-verify", "--steps", "1",
                 "--timeout", "60"]) == 1
    err = capfd.readouterr().err
    assert "Traceback" not in err
    stopped = [rank for rank in (0, 1) if re.search(
        rf"\[rank {rank}\] planc: error: rank {rank}: #\d+ wait 'done:nowhere#0' mb 0 "
        rf"\('\w+ mb 0'\) on stream '\w+' waits for an event no instruction records\n", err)]
    # both, unless one stopped while the other still connected its groups (a busy
    # machine): that one then says it lost its peer there, in one line, or the launcher
    # stops it first and it says nothing
    assert stopped, err
    if stopped != [0, 1]:
        other = 1 - stopped[0]
        said = [line for line in err.splitlines() if line.startswith(f"[rank {other}]")]
        assert all(line == f"[rank {other}] rank {other} lost a peer while creating the "
                   f"process groups of the plan (new_group)" for line in said), err
