"""Locks on the directories a run or a compile writes (issue 20, planc/host/locks.py): two runs
with one --checkpoint-dir, or two commands with one -o, replaced each other's checkpoints
and builds, logs included, while the first was still going. Now the second gets one line
naming the holder's pid and command, before anything is compiled or any rank starts; the
lock dies with its holder, and no process the holder starts inherits it."""

from __future__ import annotations

import os
import queue
import shlex
import signal
import subprocess
import sys
import threading
import time

import pytest

from planc.host.locks import DIRECTORY_LOCK, LockHeld, build_lock_path, lock_build, lock_inside
from tests.conftest import ROOT, unprivileged

DEADLINE_S = 300  # generous: the suite runs on a busy 2-core machine
# One rank, a model small enough for thousands of steps a minute: a run that holds its
# locks until the test kills it.
LONG_PLAN = """plan long {
  model gpt { layers = 1; hidden = 8; heads = 2; vocab = 64; seq = 8; batch = 2 }
  train { steps = 100000; optimizer = sgd(lr = 0.01) }
}
"""


def test_a_lock_is_exclusive_names_its_holder_and_leaves_nothing_behind(tmp_path):
    build = tmp_path / "builds" / "b"  # neither exists yet
    with lock_build(str(build), "planc compile x.plan -o b"):
        lock_file = tmp_path / "builds" / ".b.lock"
        assert build_lock_path(str(build)) == str(lock_file)
        assert lock_file.read_text() == f"pid {os.getpid()}: planc compile x.plan -o b\n"
        with pytest.raises(LockHeld) as caught:  # another open file, as another process has
            lock_build(str(tmp_path / "builds" / "." / "b"), "planc run b")
        assert caught.value.holder == f"pid {os.getpid()}: planc compile x.plan -o b"
    assert list(tmp_path.iterdir()) == []  # the lock file, and the parent made for it, gone
    checkpoints = tmp_path / "ckpt"
    with lock_inside(str(checkpoints), "planc run x.plan --checkpoint-dir ckpt"):
        assert os.listdir(checkpoints) == [DIRECTORY_LOCK]
        with pytest.raises(LockHeld):
            lock_inside(str(checkpoints), "planc run y.plan --checkpoint-dir ckpt")
    assert list(tmp_path.iterdir()) == []  # made for the lock, empty again: removed


def test_a_lock_dies_with_its_holder_and_no_child_inherits_it(tmp_path):
    """The holder starts a child (with exec, as ranks under spawn are) and is killed with
    SIGKILL: the child does not keep the lock, and the next command takes it."""
    ready = tmp_path / "ready"
    holder = subprocess.Popen([sys.executable, "-c", f"""
import subprocess, sys, time
from planc.host.locks import lock_build
lock = lock_build({str(tmp_path / 'b')!r}, "planc run held.plan -o b")
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                         close_fds=False)
open({str(ready)!r}, "w").write(str(child.pid))
time.sleep(600)
"""], cwd=ROOT)
    child = None
    try:
        _wait(lambda: ready.exists() and ready.read_text(), holder, "the holder to lock")
        child = int(ready.read_text())
        with pytest.raises(LockHeld) as caught:
            lock_build(str(tmp_path / "b"), "planc run b")
        assert caught.value.holder == f"pid {holder.pid}: planc run held.plan -o b"
        holder.kill()
        holder.wait(timeout=60)
        os.kill(child, 0)  # the child lives on
        with lock_build(str(tmp_path / "b"), "planc run b"):
            pass
    finally:
        holder.kill()
        holder.wait(timeout=60)
        if child is not None:
            os.kill(child, signal.SIGKILL)


@pytest.mark.slow
def test_a_second_run_or_compile_is_refused_while_a_run_holds_its_directories(tmp_path):
    pytest.importorskip("torch")
    plan, other = tmp_path / "long.plan", tmp_path / "other.plan"
    plan.write_text(LONG_PLAN)
    other.write_text(LONG_PLAN.replace("plan long", "plan other"))
    build, checkpoints = tmp_path / "b", tmp_path / "ckpt"
    argv = ["run", str(plan), "-o", str(build), "--checkpoint-dir", str(checkpoints)]
    holder = subprocess.Popen([sys.executable, "-m", "planc", *argv], cwd=ROOT,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines = _lines(holder)
    try:
        running = _next_line(lines, holder, "planc: running ")
        assert running == f"planc: running long from {build} on 1 rank (gloo), 100000 steps"
        _wait(lambda: list((build / "logs").glob("*/0/stderr.log")), holder, "the rank")
        manifest = (build / "build.json").read_bytes()
        who = f"pid {holder.pid}: {shlex.join(['planc', *argv])}"
        in_use = (f"planc: error: {build} is in use by planc ({who}); wait for it to finish "
                  f"or use another -o\n")
        for command in (["run", plan, "-o", build, "--steps", "1"],
                        ["run", build, "--steps", "1"],
                        ["compile", plan, "-o", build],
                        ["compile", other, "-o", build, "--force"]):
            result = _planc(*command)
            expected = in_use.replace(" or use another -o", "") if command[1] == build \
                else in_use
            assert (result.returncode, result.stderr, result.stdout) == (1, expected, ""), \
                command
        result = _planc("run", other, "-o", tmp_path / "b2", "--checkpoint-dir", checkpoints)
        assert (result.returncode, result.stderr) == (
            1, f"planc: error: --checkpoint-dir {checkpoints} is in use by planc ({who}); wait "
               f"for it to finish or use another --checkpoint-dir\n")
        assert sorted(os.listdir(tmp_path)) == [".b.lock", "b", "ckpt", "long.plan",
                                                "other.plan"]  # no b2, nor its lock
        assert (build / "build.json").read_bytes() == manifest
        assert holder.poll() is None
    finally:
        holder.kill()
        holder.wait(timeout=60)
    # The lock died with the holder (SIGKILL); its ranks stop on their own.
    result = _planc("run", plan, "-o", build, "--steps", "1", "--checkpoint-dir", checkpoints)
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(os.listdir(tmp_path)) == ["b", "ckpt", "long.plan", "other.plan"]
    assert sorted(os.listdir(checkpoints)) == ["latest", "step-000001"]
    assert len(list((build / "logs").iterdir())) == 2  # the killed run's logs are kept


@pytest.mark.slow
def test_a_build_whose_parent_cannot_be_written_is_locked_from_inside(tmp_path,
                                                                      permissions_apply):
    """No one without write access to the parent can replace the build, so a lock inside
    it (removed again) keeps two runs of it apart; the run goes on."""
    pytest.importorskip("torch")
    plan = tmp_path / "long.plan"
    plan.write_text(LONG_PLAN)
    shared = tmp_path / "shared"
    assert _planc("compile", plan, "-o", shared / "b").returncode == 0
    shared.chmod(0o555)
    try:
        result = unprivileged([sys.executable, "-m", "planc", "run", str(shared / "b"),
                               "--steps", "1"], timeout=DEADLINE_S)
    finally:
        shared.chmod(0o755)
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(os.listdir(shared)) == ["b"]
    assert sorted(os.listdir(shared / "b")) == ["build.json", "graph.json", "logs", "plan.json",
                                                "programs", "summary.json"]


# --- helpers ---------------------------------------------------------------------------------


def _planc(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "planc", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=DEADLINE_S)


def _wait(ready, process: subprocess.Popen, what: str):
    deadline = time.monotonic() + DEADLINE_S
    while not (found := ready()):
        assert process.poll() is None, f"the process ended while waiting for {what}"
        assert time.monotonic() < deadline, f"waited {DEADLINE_S} s for {what}"
        time.sleep(0.02)
    return found


def _lines(process: subprocess.Popen) -> queue.Queue:
    """The process's standard error, line by line, read on a thread (and drained to the
    end, so that a full pipe never stops it)."""
    lines: queue.Queue = queue.Queue()

    def read() -> None:
        for line in process.stderr:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    return lines


def _next_line(lines: queue.Queue, process: subprocess.Popen, prefix: str) -> str:
    deadline = time.monotonic() + DEADLINE_S
    seen = []
    while time.monotonic() < deadline:
        line = lines.get(timeout=DEADLINE_S)
        if line is None:
            raise AssertionError(f"ended without {prefix!r}: {seen[-20:]}")
        if line.startswith(prefix):
            return line
        seen.append(line)
    raise AssertionError(f"no {prefix!r} in {DEADLINE_S} s")


def test_a_directory_that_is_a_dangling_symbolic_link_is_named_so(tmp_path):
    """A lock inside a directory that is a symbolic link to nothing (planc run
    --checkpoint-dir LINK) said the lock file "keeps being replaced": the open failed
    and was retried as if a holder had removed the directory."""
    from planc.host.locks import LockError

    (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    with pytest.raises(LockError) as refused:
        lock_inside(str(tmp_path / "link"), "planc run")
    assert str(refused.value) == (f"cannot create {tmp_path / 'link'} for its lock file (it "
                                  f"is a symbolic link to nothing)")
    assert not (tmp_path / "nowhere").exists()
