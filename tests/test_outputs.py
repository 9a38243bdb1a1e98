"""The output rule (issue 34, planc/host/outputs.py, README "Outputs"): every output flag of
every command, pointed at every kind of path planc must not write over, is refused with
one line before any work, and leaves every file as it was.

The protected paths are real: a plan file, a build compiled from it (its own files and
its logs), a checkpoint directory and its ``latest`` from a real run, that run's metrics
(another run's records), a directory a live process holds with planc's lock, a user's
notes, and each command's own input. Every option of every command is listed below as
an output (with a case) or not: a new output flag without a case fails
``test_every_option_is_an_output_with_a_case_or_named_as_none``."""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from planc.cli import build_parser, main
from tests.conftest import PLANS, ROOT, free_port

DEADLINE_S = 300
# One rank and a model small enough that a run is a few seconds (the protected tree's).
ONE_RANK = """plan one {
  model gpt { layers = 1; hidden = 8; heads = 2; vocab = 64; seq = 8; batch = 2 }
  train { steps = STEPS; optimizer = sgd(lr = 0.01) }
}
"""

# Every output flag: the command line that writes OUT (a placeholder), from the inputs of
# the fixture's tree (PLAN, CKPT, METRICS).
OUTPUT_CASES = {
    ("compile", "-o"): ["compile", "PLAN", "-o", "OUT"],
    ("graph", "-o"): ["graph", "PLAN", "--format", "dot", "-o", "OUT"],
    ("simulate", "--trace"): ["simulate", "PLAN", "--trace", "OUT"],
    ("tune", "-o"): ["tune", "PLAN", "--gpus", "8", "--budget", "5", "-o", "OUT"],
    ("report", "-o"): ["report", "PLAN", "-o", "OUT"],
    ("export", "-o"): ["export", "PLAN", "-o", "OUT"],
    ("plot", "-o"): ["plot", "METRICS", "-o", "OUT"],
    ("calibrate", "-o"): ["calibrate", "-o", "OUT"],
    ("run", "-o"): ["run", "PLAN", "--steps", "1", "-o", "OUT"],
    ("run", "--metrics"): ["run", "PLAN", "--steps", "1", "-o", "BUILD2", "--metrics", "OUT"],
    ("run", "--trace"): ["run", "PLAN", "--steps", "1", "-o", "BUILD2", "--trace", "OUT"],
    ("run", "--tensorboard"): ["run", "PLAN", "--steps", "1", "-o", "BUILD2",
                               "--tensorboard", "OUT"],
    ("run", "--checkpoint-dir"): ["run", "PLAN", "--steps", "1", "-o", "BUILD2",
                                  "--checkpoint-dir", "OUT"],
    ("data prepare", "-o"): ["data", "prepare", "DOCS", "-o", "OUT", "--tokenizer",
                             "TOKENIZER"],
}
# Cases that write a second kind through the same flag.
MORE_CASES = {("export", "-o", "hf"): ["export", "CKPT", "--format", "hf", "-o", "OUT"]}

# Every other option of every command: none writes a file.
NOT_OUTPUTS = {
    "check": {"-h", "--error-format", "--max-errors", "--set", "-v"},
    "layout": {"-h", "--error-format", "--max-errors", "--set", "--json"},
    "compile": {"-h", "--error-format", "--max-errors", "--set", "--force"},
    "graph": {"-h", "--error-format", "--max-errors", "--set", "--force", "--format",
              "--stage", "--layers", "--microbatch", "--phase", "--axis", "--transfers-only",
              "--all"},
    "explain": {"-h", "--error-format", "--max-errors", "--set", "--layer", "--param",
                "--axis", "--buckets", "--routes"},
    "programs": {"-h", "--error-format", "--max-errors", "--set", "--rank", "--expand",
                 "--microbatch", "--code"},
    "verify": {"-h", "--error-format", "--max-errors", "--set"},
    "run": {"-h", "--error-format", "--max-errors", "--set", "--force", "--steps", "--backend",
            "--check", "--timeout", "--no-verify", "--checkpoint-every", "--checkpoint-async",
            "--resume", "--straggler-margin", "--on-failure",
            "--checkpoint-peer-memory"},
    "simulate": {"-h", "--error-format", "--max-errors", "--set", "--force", "--json",
                 "--mtbf", "--checkpoint-every", "--checkpoint-async", "--storage",
                 "--restart", "--imbalance-from"},
    "tune": {"-h", "--error-format", "--max-errors", "--set", "--force", "--gpus", "--top",
             "--memory", "--keep", "--budget", "--json", "--mtbf", "--checkpoint-async",
             "--storage", "--restart"},
    "report": {"-h", "--error-format", "--max-errors", "--set", "--force", "--metrics",
               "--tune"},
    "export": {"-h", "--error-format", "--max-errors", "--set", "--force", "--format",
               "--prefix"},
    "diff": {"-h", "--set-b", "--error-format"},
    "plot": {"-h", "--force", "--metric"},
    "calibrate": {"-h", "--force", "--ranks", "--nodes", "--repeats", "--quick"},
    "data": {"-h"},
    "data prepare": {"-h", "--force", "--tokenizer", "--text-key", "--sample-by", "--eos"},
}


def _commands(parser=None, prefix=""):
    """Every command's parser by name, a command's subcommands as "data prepare"."""
    parser = parser or build_parser()
    found = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, command in action.choices.items():
                found[prefix + name] = command
                found.update(_commands(command, f"{prefix}{name} "))
    return found


def test_every_option_is_an_output_with_a_case_or_named_as_none():
    declared, options = set(), {}
    for name, command in _commands().items():
        outputs = {flag for _, flag, _ in command.get_default("outputs") or ()}
        declared |= {(name, flag) for flag in outputs}
        options[name] = {a.option_strings[0] for a in command._actions if a.option_strings}
        assert options[name] - outputs == NOT_OUTPUTS[name], name
    assert declared == set(OUTPUT_CASES)
    assert set(options) == set(NOT_OUTPUTS)


# --- the protected tree --------------------------------------------------------------------


def _tree(root: Path) -> dict[str, str]:
    """Every entry under ``root``: a file's sha256, a directory, a link's target (the
    lock files of the holder are left out: they live while it does)."""
    out = {}
    for path in sorted(root.rglob("*")):
        key = str(path.relative_to(root))
        if path.is_symlink():
            out[key] = "-> " + os.readlink(path)
        elif path.is_dir():
            out[key] = "dir"
        else:
            out[key] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


@pytest.fixture(scope="module")
def protected(tmp_path_factory):
    """A tree of things planc must not write over, and a process holding two of them."""
    pytest.importorskip("torch")
    root = tmp_path_factory.mktemp("protected")
    plan = root / "my.plan"
    one: list[str] = []  # overrides every command of the tree takes
    plan.write_text(ONE_RANK.replace("STEPS", "1"))
    build, ckpt, metrics = root / "build", root / "ckpt", root / "m.jsonl"
    assert main(["compile", str(plan), "-o", str(build), *one]) == 0
    assert main(["run", str(build), "--steps", "1", "--checkpoint-dir", str(ckpt),
                 "--metrics", str(metrics)]) == 0
    assert (ckpt / "latest").read_text().strip() == "step-000001"
    (root / "notes.md").write_text("my notes\n")
    (root / "docs.jsonl").write_text('{"text": "the cat sat"}\n')
    _tokenizer(root / "tokenizer.json")
    busy = root / "busy"  # a build another run holds
    assert main(["compile", str(plan), "-o", str(busy), *one]) == 0
    held = root / "held"  # a checkpoint directory another run is writing
    held.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", f"""
import sys
from planc.host.locks import lock_build, lock_inside
a = lock_build({str(busy)!r}, "planc run busy")
b = lock_inside({str(held)!r}, "planc run x.plan --checkpoint-dir held")
print("locked", flush=True)
sys.stdin.read()
"""], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "locked\n"  # the event: both locks are held
    try:
        yield root, holder.pid, one
    finally:
        holder.stdin.close()
        holder.wait(DEADLINE_S)


TARGETS = {  # file or directory under the tree -> what it is
    "my.plan": "the plan file",
    "build/build.json": "a build's manifest",
    "build/plan.json": "a build's plan",
    "build/programs/ranks.json": "a build's rank table",
    "build/logs": "the run's logs",
    "ckpt": "a checkpoint directory",
    "ckpt/latest": "its latest",
    "ckpt/step-000001/manifest.json": "a checkpoint's manifest",
    "ckpt/new": "a new path inside a checkpoint directory",
    "m.jsonl": "another run's metrics",
    "busy": "a build another run holds",
    "busy/new": "a new path inside it",
    "held": "a checkpoint directory another run holds",
    "held/new": "a new path inside it",
    "notes.md": "a user's file",
}


def _tokenizer(path: Path) -> None:
    """A word-level Hugging Face tokenizer of four words, ``<eos>`` among them."""
    tokenizers = pytest.importorskip("tokenizers")
    words = {"<eos>": 0, "the": 1, "cat": 2, "sat": 3}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(words, unk_token="<eos>"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer.save(str(path))


def _argv(template: list[str], root: Path, target: str, one: list[str]) -> list[str]:
    values = {"PLAN": str(root / "my.plan"), "CKPT": str(root / "ckpt"),
              "DOCS": str(root / "docs.jsonl"), "TOKENIZER": str(root / "tokenizer.json"),
              "METRICS": str(root / "m.jsonl"), "BUILD2": str(root / "build2"),
              "OUT": str(root / target)}
    argv = [values.get(part, part) for part in template]
    return argv + (one if argv[0] in ("run", "compile", "simulate", "report") and
                   argv[1].endswith(".plan") else [])


@pytest.mark.parametrize("case", [*OUTPUT_CASES, *MORE_CASES], ids=lambda c: " ".join(c))
def test_no_output_flag_writes_over_a_protected_path(protected, case, capfd):
    root, holder_pid, one = protected
    template = {**OUTPUT_CASES, **MORE_CASES}[case]
    capfd.readouterr()
    for target in TARGETS:
        before = _tree(root)
        status = main(_argv(template, root, target, one))
        out, err = capfd.readouterr()
        lines = err.splitlines()
        assert status in (1, 2), (target, status, err)
        assert len(lines) == 1 and lines[0].startswith("planc: error: "), (target, err)
        assert "Traceback" not in err + out
        assert _tree(root) == before, (target, err)
        assert not (root / "build2").exists()
        if target in ("busy", "busy/new", "held", "held/new"):
            assert f"is in use by planc (pid {holder_pid}: planc run " in err, err
            assert status == 1


FILE_OUTPUTS = [("graph", "-o"), ("simulate", "--trace"), ("tune", "-o"), ("report", "-o"),
                ("plot", "-o"), ("calibrate", "-o"), ("run", "--metrics"), ("run", "--trace"),
                ("data prepare", "-o")]


@pytest.mark.parametrize("case", FILE_OUTPUTS, ids=lambda c: " ".join(c))
def test_a_file_output_named_with_a_trailing_slash_is_refused(protected, case, capfd):
    """'-o page.html/' names a directory; report wrote a file page.html there."""
    root, _, one = protected
    argv = [part + "/" if part == str(root / "new.out") else part  # Path drops the '/'
            for part in _argv(OUTPUT_CASES[case], root, "new.out", one)]
    before = _tree(root)
    capfd.readouterr()
    assert main(argv) == 2
    flag = case[1]
    assert capfd.readouterr().err == (f"planc: error: {flag} {root}/new.out/: ends with '/', "
                                      f"which names a directory; name a file\n")
    assert _tree(root) == before


def test_the_messages_say_what_each_protected_path_is(protected, capfd):
    root, holder_pid, one = protected
    graph = ["graph", str(root / "my.plan"), "--format", "dot", "-o"]
    expected = {
        "my.plan": "is the plan file this command reads; name another path",
        "build/plan.json": f"is plan.json of the build {root / 'build'}, which planc compile "
                           f"and planc run write; name a path outside them",
        "build/programs/ranks.json": f"is inside programs of the build {root / 'build'}, which "
                                     f"planc compile and planc run write; name a path "
                                     f"outside them",
        "ckpt/latest": f"is inside {root / 'ckpt'}, a checkpoint directory, which holds only "
                       f"checkpoints; name a path outside it",
        "m.jsonl": "exists and is not a graph that planc wrote (it is a metrics file from "
                   "planc run --metrics); planc never replaces such a file: name another "
                   "path, or remove it first",
        "notes.md": "exists and is not a graph that planc wrote; planc never replaces such "
                    "a file: name another path, or remove it first",
        "held/new": f"{root / 'held'}, which holds it, is in use by planc (pid {holder_pid}: "
                    f"planc run x.plan --checkpoint-dir held); wait for it to finish or name "
                    f"another path",
    }
    for target, message in expected.items():
        capfd.readouterr()
        status = main(graph + [str(root / target)])
        err = capfd.readouterr().err
        assert err == f"planc: error: -o {root / target}: {message}\n"
        assert status == (1 if target == "held/new" else 2)


# --- what may be written -------------------------------------------------------------------

REWRITABLE = {  # a command line writing OUT, and the name OUT takes
    "graph": (["graph", "PLAN", "-o", "OUT"], "g.svg"),
    "simulate": (["simulate", "PLAN", "--trace", "OUT"], "t.json"),
    "report": (["report", "PLAN", "-o", "OUT"], "r.html"),
    "plot": (["plot", "METRICS", "-o", "OUT"], "p.png"),
    "tune": (["tune", "PLAN", "--gpus", "2", "--top", "1", "--budget", "20", "-o", "OUT"],
             "best.plan"),
}


@pytest.mark.parametrize("command", REWRITABLE)
def test_an_earlier_output_is_replaced_only_with_force(protected, command, tmp_path, capfd):
    root, _, one = protected
    template, name = REWRITABLE[command]
    out = tmp_path / name
    out.write_bytes(b"")  # an empty file, as mktemp leaves: nothing to lose
    argv = [{"PLAN": str(root / "my.plan"), "METRICS": str(root / "m.jsonl"),
             "OUT": str(out)}.get(p, p) for p in template]
    argv += one if command in ("simulate", "report") else []
    assert main(argv) == 0, capfd.readouterr().err
    first = out.read_bytes()
    assert first
    capfd.readouterr()
    assert main(argv) == 2
    what, generator = {"graph": ("a graph", "planc graph"),
                       "simulate": ("a simulated trace", "planc simulate --trace"),
                       "report": ("a report", "planc report"), "plot": ("a plot", "planc plot"),
                       "tune": ("a tuned plan", "planc tune")}[command]
    flag = "--trace" if command == "simulate" else "-o"
    assert capfd.readouterr().err == (f"planc: error: {flag} {out}: holds {what} already "
                                      f"({generator} wrote it); replace it with --force, or "
                                      f"name another path\n")
    assert out.read_bytes() == first
    assert main(argv + ["--force"]) == 0
    assert sorted(os.listdir(tmp_path)) == [name]  # no temporaries left


def test_a_device_is_written_into_and_kept(protected, capfd):
    root, _, one = protected
    assert main(["simulate", str(root / "my.plan"), *one, "--trace", os.devnull]) == 0
    assert main(["report", str(root / "my.plan"), *one, "-o", os.devnull]) == 0
    capfd.readouterr()
    # calibrate's summary is of what its ranks measured, never of the output read back
    # (it read JSON from /dev/null and raised)
    assert main(["calibrate", "-o", os.devnull, "--quick", "--repeats", "1"]) == 0
    summary = capfd.readouterr().out
    assert summary.startswith("intra-node: ")
    assert summary.endswith(f"\nwritten into {os.devnull}\n")
    assert os.path.exists(os.devnull) and not os.path.isfile(os.devnull)


def test_a_named_pipe_without_a_reader_is_refused_in_one_line(tmp_path, capfd):
    """Opened without blocking, a pipe no process reads fails (ENXIO) where a blocking
    open would wait for ever; calibrate's rank raised it as a traceback, and then it was
    found only after the measurement: now before it, and no rank starts."""
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    assert main(["calibrate", "-o", str(pipe), "--quick", "--repeats", "1"]) == 1
    captured = capfd.readouterr()
    assert captured.err == (
        f"planc: error: cannot write the calibration to {pipe}: a named pipe that no "
        f"process reads; start its reader first; nothing was measured\n")
    assert captured.out == ""
    assert sorted(os.listdir(tmp_path)) == ["pipe"]
    reader = os.open(pipe, os.O_RDONLY | os.O_NONBLOCK)  # with a reader: the topology
    try:
        assert main(["calibrate", "-o", str(pipe), "--quick", "--repeats", "1"]) == 0
        topology = json.loads(os.read(reader, 1 << 20))
        assert topology["format"] == "planc-topology"
        assert os.read(reader, 1 << 20) == b""  # then one end of file: no writer is left
    finally:
        os.close(reader)


def test_a_run_s_trace_that_cannot_be_written_is_one_line(tmp_path, capfd):
    """Rank 0 raised the OSError (a traceback, then the other ranks' lost peer); the run
    trains, says why the trace is missing, and exits 1."""
    pytest.importorskip("torch")
    plan = tmp_path / "one.plan"
    plan.write_text(ONE_RANK.replace("STEPS", "1"))
    assert main(["run", str(plan), "-o", str(tmp_path / "b"), "--trace", "/dev/full"]) == 1
    err = capfd.readouterr().err
    assert "Traceback" not in err and "traceback" not in err
    assert "planc: error: cannot write the trace to /dev/full: No space left on device\n" in err


def test_a_calibration_rank_killed_while_writing_leaves_nothing(tmp_path, capfd,
                                                                monkeypatch):
    """Rank 0 killed after it made its temporary file: the calibration's private directory
    was not empty, and removing it raised; the rank is named by its signal."""
    import signal
    import tempfile

    import planc.runtime.calibrate as ranks

    def killed(path, data):  # the ranks are forked from this process: they inherit it
        (tmp_path / "wrote").write_text(path)
        open(os.path.join(os.path.dirname(path), ".planc-partial"), "wb").write(data[:10])
        os.kill(os.getpid(), signal.SIGKILL)

    monkeypatch.setattr(ranks, "write_atomically", killed)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where mkdtemp makes it
    output = tmp_path / "topology.json"
    assert main(["calibrate", "-o", str(output), "--quick", "--repeats", "1"]) == 1
    assert capfd.readouterr().err.splitlines()[-1] == (
        "planc: error: a calibration rank was killed by SIGKILL; nothing was written")
    assert sorted(os.listdir(tmp_path)) == ["wrote"] and not output.exists()


def _calibrated_by_hand(output) -> tuple[list[int], list[str]]:
    """Two ranks of python -m planc.runtime.calibrate -o ``output``, as torchrun starts
    them: their exit statuses and standard errors."""
    port = str(free_port())
    ranks = [subprocess.Popen(
        [sys.executable, "-m", "planc.runtime.calibrate", "--devices-per-node", "2", "-o",
         str(output), "--quick", "--repeats", "1"], cwd=ROOT, stderr=subprocess.PIPE,
        text=True, env={**os.environ, "RANK": str(rank), "WORLD_SIZE": "2",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
                        "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"})
        for rank in range(2)]
    errors = [rank.communicate(timeout=300)[1] for rank in ranks]
    return [rank.returncode for rank in ranks], errors


def test_calibrate_under_torchrun_says_why_its_output_cannot_be_written(tmp_path):
    """Started by hand or by torchrun, rank 0 writes the topology itself: one line, and
    exit status 1, where it raised the OSError."""
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    codes, errors = _calibrated_by_hand(pipe)
    assert codes == [1, 0]
    assert errors[0] == (f"planc calibrate: cannot write {pipe}: it is a named pipe that no "
                         f"process reads; start its reader first\n")


def test_run_finds_a_metrics_pipe_s_reader_before_any_work(tmp_path, capfd):
    """A metrics or trace pipe that no process reads is refused before the plan is
    compiled (a rank found it once the run had started); one that a process reads gets
    every record, then the end of the file: planc run's probe for the reader is a write
    end it holds until the run is done, so it ends nothing early and leaves nothing
    open."""
    pipe, plan = tmp_path / "pipe", tmp_path / "one.plan"
    os.mkfifo(pipe)
    plan.write_text(ONE_RANK.replace("STEPS", "3"))
    for flag in ("--metrics", "--trace"):  # the trace's pipe too: rank 0 found it last
        assert main(["run", str(plan), "-o", str(tmp_path / "b"), flag, str(pipe)]) == 1
        assert capfd.readouterr().err == (f"planc: error: {flag} {pipe}: a named pipe that "
                                          f"no process reads; start its reader first; "
                                          f"nothing was run\n")
        assert sorted(os.listdir(tmp_path)) == ["one.plan", "pipe"]
    reader = os.open(pipe, os.O_RDONLY | os.O_NONBLOCK)  # a reader, before the run
    try:
        assert main(["run", str(plan), "-o", str(tmp_path / "b"), "--metrics",
                     str(pipe)]) == 0
        records = os.read(reader, 1 << 16)  # three records: far less than a pipe holds
        assert [json.loads(line)["step"] for line in records.splitlines()] == [0, 1, 2]
        assert os.read(reader, 1 << 16) == b""  # no writer left: the end of the file
    finally:
        os.close(reader)


def test_calibrate_by_hand_never_replaces_a_file_planc_did_not_write(tmp_path):
    """python -m planc.runtime.calibrate -o FILE (docs/routes.md, on a cluster) replaced
    any file; rank 0 now checks -o as planc calibrate does, and every rank stops before
    measuring anything, rank 0 saying why (status 2, as for a wrong command line)."""
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    codes, errors = _calibrated_by_hand(notes)
    assert codes == [2, 2]
    assert errors == [f"planc calibrate: -o {notes}: exists and is not a calibrated "
                      f"topology that planc wrote; planc never replaces such a file: name "
                      f"another path, or remove it first\n", ""]
    assert notes.read_text() == "my notes\n"


def test_dev_stdout_on_a_pipe_is_written_into(protected):
    """/dev/stdout on a pipe is a link of /proc to "pipe:[N]", which names no path: it
    was refused as "cannot write there (/proc/N/fd: No such file or directory)"."""
    import subprocess
    import sys

    root, _, _ = protected
    done = subprocess.run([sys.executable, "-m", "planc", "graph", str(root / "my.plan"),
                           "--format", "dot", "-o", "/dev/stdout"], capture_output=True,
                          text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("// written by planc graph\ndigraph planc {\n")


def test_two_outputs_of_one_command_on_one_path(protected, tmp_path, capfd):
    root, _, one = protected
    same = tmp_path / "x.json"
    assert main(["run", str(root / "my.plan"), *one, "-o", str(tmp_path / "b"), "--metrics",
                 str(same), "--trace", str(same)]) == 2
    assert capfd.readouterr().err == (f"planc: error: --trace {same}: is also --metrics's "
                                      f"path; name another\n")
    assert os.listdir(tmp_path) == []


def test_tune_checks_its_output_before_searching_and_a_layout_that_does_not_fit(
        protected, tmp_path, capfd):
    """-o to a directory or an unwritable path was refused only after the whole search;
    with --memory 1e-9 every layout is over memory, yet one was ranked and written."""
    root, _, _ = protected
    plan = str(root / "my.plan")
    assert main(["tune", plan, "--gpus", "16", "-o", str(tmp_path)]) == 2
    assert capfd.readouterr().err == f"planc: error: -o {tmp_path}: is a directory; name a file\n"
    assert main(["tune", plan, "--gpus", "8", "--memory", "1e-9", "-o",
                 str(tmp_path / "best.plan")]) == 1
    out, err = capfd.readouterr()
    assert err.splitlines()[-1] == ("planc: error: no layout of this model on 8 devices "
                                    "passes the checker and fits in the memory of 1e-09 GB "
                                    "per device; nothing was written")
    assert os.listdir(tmp_path) == []
    assert main(["tune", plan, "--gpus", str(10**12)]) == 2
    assert capfd.readouterr().err == ("planc: error: --gpus 1000000000000: more than "
                                      "planc's limit of 524,288 ranks, the largest mesh a "
                                      "plan may have\n")


def test_export_refuses_its_own_checkpoint_and_plot_its_own_input(protected, capfd):
    root, _, _ = protected
    before = _tree(root)
    assert main(["export", str(root / "ckpt"), "--format", "hf", "-o", str(root / "ckpt")]) == 2
    assert capfd.readouterr().err == (f"planc: error: -o {root / 'ckpt'}: is the checkpoint "
                                      f"directory this command reads; name another path\n")
    shutil.copy(root / "m.jsonl", root / "mm.png")  # a metrics file with a .png name
    before = _tree(root)
    assert main(["plot", str(root / "mm.png"), "-o", str(root / "mm.png")]) == 2
    assert capfd.readouterr().err == (f"planc: error: -o {root / 'mm.png'}: is a metrics "
                                      f"file this command reads; name another path\n")
    assert _tree(root) == before
    (root / "mm.png").unlink()


def test_empty_paths_name_nothing(capfd):
    for argv in (["run", str(PLANS / "gpt-tiny.plan"), "--metrics", ""],
                 ["run", str(PLANS / "gpt-tiny.plan"), "--resume", ""],
                 ["run", str(PLANS / "gpt-tiny.plan"), "--trace", ""],
                 ["run", str(PLANS / "gpt-tiny.plan"), "--tensorboard", ""],
                 ["graph", str(PLANS / "gpt-tiny.plan"), "-o", ""]):
        with pytest.raises(SystemExit) as exited:
            main(argv)
        assert exited.value.code == 2
        flag = argv[2]
        assert capfd.readouterr().err.splitlines()[-1] == (
            f"planc {argv[0]}: error: argument {flag}{'/--output' if flag == '-o' else ''}: "
            f"an empty path names nothing")


def test_an_unwritable_tensorboard_directory_stops_the_run_before_compiling(tmp_path, capfd):
    """/proc takes no new directory, even for root, whom os.access lets through."""
    status = main(["run", str(PLANS / "gpt-tiny.plan"), "-o", str(tmp_path / "b"),
                   "--tensorboard", "/proc/tb"])
    err = capfd.readouterr().err
    assert status == 1
    assert err.startswith("planc: error: --tensorboard /proc/tb: cannot be created (/proc: ")
    assert os.listdir(tmp_path) == []


# --- runs: metrics, TensorBoard logs and checkpoints are a run's history ------------------


def _records(path: Path) -> list[int]:
    import json

    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_a_run_continues_its_own_history_and_replaces_another_only_with_force(tmp_path,
                                                                              capfd):
    """Issue 34: two runs with one --metrics file overwrote each other; a resumed run
    truncated its metrics; a fresh run replaced another run's step-000002 in its
    checkpoint directory; compiling an edited plan deleted a run's metrics and notes."""
    pytest.importorskip("torch")
    plan, build = tmp_path / "one.plan", tmp_path / "b"
    plan.write_text(ONE_RANK.replace("STEPS", "2"))
    metrics, ckpt, tb = build / "m.jsonl", tmp_path / "ckpt", tmp_path / "tb"
    outputs = ["--metrics", str(metrics), "--checkpoint-dir", str(ckpt), "--tensorboard",
               str(tb)]
    assert main(["run", str(plan), "-o", str(build), "--checkpoint-every", "1",
                 *outputs]) == 0, capfd.readouterr().err
    assert _records(metrics) == [0, 1]
    first = metrics.read_bytes()
    (events,) = os.listdir(tb)
    assert events.startswith("events.out.tfevents.") and events.endswith(".planc")
    before = _tree(tmp_path)
    capfd.readouterr()
    for argv, message in (
            (["--metrics", str(metrics)], f"--metrics {metrics}: holds a metrics file "
             f"already; continue it with --resume, replace it with --force, or name another "
             f"file"),
            (["--tensorboard", str(tb)], f"--tensorboard {tb}: holds TensorBoard logs "
             f"already (1 event file); continue them with --resume, replace them with "
             f"--force, or name another directory"),
            (["--checkpoint-dir", str(ckpt)], f"--checkpoint-dir {ckpt}: holds 2 checkpoints "
             f"of another run (the newest: step-000002); continue them with --resume {ckpt}, "
             f"replace them with --force, or name another directory")):
        assert main(["run", str(build), *argv]) == 2
        assert capfd.readouterr().err == f"planc: error: {message}\n"
    assert _tree(tmp_path) == before
    # a resumed run appends only to a file planc plot and planc report read
    damaged = tmp_path / "damaged.jsonl"
    damaged.write_bytes(first.replace(b'"step": 0', b'"step": "x"', 1))
    assert main(["run", str(build), "--resume", str(ckpt / "step-000001"), "--metrics",
                 str(damaged)]) == 2
    assert capfd.readouterr().err == (
        f"planc: error: --metrics: {damaged}: line 1 has no step number (a whole number "
        f"from 0 to 10^12); it is not what planc run --metrics writes; a resumed run "
        f"appends only to a metrics file planc plot and planc report can read\n")
    assert damaged.read_bytes() == first.replace(b'"step": 0', b'"step": "x"', 1)
    damaged.unlink()
    # a run stopped while writing a record leaves part of a line: the resumed run drops it
    with open(metrics, "ab") as handle:
        handle.write(b'{"step": 2, "loss": 4.1')
    (build / "notes.txt").write_text("mine\n")
    plan.write_text(ONE_RANK.replace("STEPS", "3"))  # edited: compiled again into b
    assert main(["run", str(plan), "-o", str(build), "--resume", str(ckpt / "step-000001"),
                 *outputs]) == 0
    err = capfd.readouterr().err
    assert (f"planc: replaced {build}, which held an earlier build of {plan}; its logs/, "
            f"m.jsonl and notes.txt are kept in the new build\n") in err
    assert (f"planc: warning: --metrics {metrics} ended with a partial record (a run stopped "
            f"while writing it); it was dropped before this run's records\n") in err
    assert metrics.read_bytes().startswith(first)  # continued, not replaced
    assert _records(metrics) == [0, 1, 1, 2]  # steps 1 and 2 of the resumed run after
    assert (build / "notes.txt").read_text() == "mine\n"
    assert len(os.listdir(tb)) == 2  # a second event file continues the logs
    assert sorted(os.listdir(ckpt)) == ["latest", "step-000001", "step-000002", "step-000003"]
    # --force: another run replaces them all
    assert main(["run", str(plan), "-o", str(build), "--steps", "1", "--force",
                 *outputs]) == 0
    err = capfd.readouterr().err
    assert (f"planc: --force: removed the 3 checkpoints of another run from {ckpt}\n") in err
    assert _records(metrics) == [0]
    assert sorted(os.listdir(ckpt)) == ["latest", "step-000001"]
    assert len(os.listdir(tb)) == 1


def test_a_live_run_holds_its_metrics(tmp_path):
    """Two runs with one --metrics file left NUL bytes and lost ~1,900 records: while a
    run writes its metrics, another run naming them is refused, even with --force."""
    pytest.importorskip("torch")
    plan = tmp_path / "long.plan"
    plan.write_text(ONE_RANK.replace("STEPS", "100000"))
    metrics = tmp_path / "m.jsonl"
    first = subprocess.Popen([sys.executable, "-m", "planc", "run", str(plan), "-o",
                              str(tmp_path / "a"), "--metrics", str(metrics)], cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
    try:
        for line in first.stderr:  # the event: its first step's progress line
            if "step 1/100000" in line:
                break
        else:
            pytest.fail("the first run ended before its first step")
        second = subprocess.run([sys.executable, "-m", "planc", "run", str(plan), "-o",
                                 str(tmp_path / "b"), "--metrics", str(metrics), "--force"],
                                cwd=ROOT, capture_output=True, text=True, timeout=DEADLINE_S)
        assert second.returncode == 1
        assert second.stderr == (
            f"planc: error: --metrics {metrics} is in use by planc (pid {first.pid}: planc run "
            f"{plan} -o {tmp_path / 'a'} --metrics {metrics}); wait for it to finish or use "
            f"another --metrics\n")
        assert not (tmp_path / "b").exists()
    finally:
        os.killpg(first.pid, 2)
        first.communicate(timeout=DEADLINE_S)
    assert first.returncode == 130
    assert all(line.startswith('{"step": ') for line in metrics.read_text().splitlines())


@contextlib.contextmanager
def _small_disk(tmp_path, size: str):
    """A tmpfs of ``size`` mounted for the test (skipped where it cannot be: root only)."""
    mount = tmp_path / "small"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}",
                                            "tmpfs", str(mount)]).returncode:
        pytest.skip("needs root to mount a small tmpfs")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)])


def test_an_export_that_fills_the_disk_leaves_nothing_and_replaces_nothing(tmp_path, capfd):
    """The first trace fitted and the second did not: the first stayed, in a directory
    the failed export had made (root only: a small tmpfs)."""
    with _small_disk(tmp_path, "60k") as mount:
        plan = PLANS / "gpt-tiny.plan"
        (mount / "filler").write_bytes(bytes(48_000))
        assert main(["export", str(plan), "-o", str(mount / "traces")]) == 1
        assert "No space left on device" in capfd.readouterr().err
        assert os.listdir(mount) == ["filler"]  # no traces/, no temporary
        (mount / "filler").unlink()
        assert main(["export", str(plan), "-o", str(mount / "traces")]) == 0
        before = {p.name: p.read_bytes() for p in (mount / "traces").iterdir()}
        space = os.statvfs(mount)
        free = space.f_bavail * space.f_frsize  # room for less than the second trace
        (mount / "filler").write_bytes(bytes(free - max(map(len, before.values())) // 2))
        assert main(["export", str(plan), "-o", str(mount / "traces"), "--force"]) == 1
        assert {p.name: p.read_bytes() for p in (mount / "traces").iterdir()} == before


def test_a_checkpoint_that_fills_the_disk_leaves_no_partial_directory(tmp_path, capfd):
    """The run fails with one line, the space its staging directory took is given back,
    and the checkpoints written before stay (root only: a small tmpfs)."""
    pytest.importorskip("torch")
    with _small_disk(tmp_path, "1200k") as mount:
        plan = tmp_path / "wide.plan"
        plan.write_text(ONE_RANK.replace("STEPS", "1").replace("hidden = 8", "hidden = 256")
                        .replace("vocab = 64", "vocab = 512"))
        status = main(["run", str(plan), "-o", str(tmp_path / "b"), "--checkpoint-dir",
                       str(mount / "ckpt")])
        err = capfd.readouterr().err
        assert status == 1, err
        assert "No space left on device" in err
        assert os.listdir(mount) == []  # no .step-000001.partial; ckpt, made for the run, too


@pytest.mark.parametrize("resume", [["--resume", "nosuchdir"], []])
def test_a_file_of_yours_in_a_checkpoint_staging_directory_is_never_removed(tmp_path, capfd,
                                                                            resume):
    """planc run removed every .step-N.partial directory when it ended, a refused run's
    too, with whatever was in it; one holding a file no checkpoint has is refused now,
    and kept."""
    pytest.importorskip("torch")
    plan = tmp_path / "one.plan"
    plan.write_text(ONE_RANK.replace("STEPS", "1"))
    notes = tmp_path / "ck" / ".step-000009.partial" / "notes.txt"
    notes.parent.mkdir(parents=True)
    notes.write_text("my notes\n")
    assert main(["run", str(plan), "-o", str(tmp_path / "b"), "--checkpoint-dir",
                 str(tmp_path / "ck"), *resume]) != 0
    capfd.readouterr()
    assert notes.read_text() == "my notes\n"


def test_a_worker_under_torchrun_keeps_the_rule_it_can_keep_alone(tmp_path):
    """Without planc run nobody checked the paths: rank 0 refuses a --trace that is not
    a run's trace, the leader a --metrics that is not a metrics file; neither is touched."""
    pytest.importorskip("torch")
    plan = tmp_path / "one.plan"
    plan.write_text(ONE_RANK.replace("STEPS", "1"))
    assert main(["compile", str(plan), "-o", str(tmp_path / "b")]) == 0
    notes = tmp_path / "notes.md"
    notes.write_text("mine\n")
    port = str(free_port())
    for flag in ("--trace", "--metrics"):
        done = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
             "--master-port", port, "-m", "planc.runtime.worker", str(tmp_path / "b"), flag,
             str(notes)], cwd=ROOT, capture_output=True, text=True, timeout=DEADLINE_S,
            env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert done.returncode != 0
        assert (f"planc: error: {flag} {notes}: exists and is not "
                f"{'a run' + chr(39) + 's trace' if flag == '--trace' else 'a metrics file'} "
                f"that planc wrote; planc never replaces such a file: name another path, or "
                f"remove it first") in done.stderr, done.stderr[-2000:]
        assert notes.read_text() == "mine\n"
