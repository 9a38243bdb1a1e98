"""Output paths a user names (issue 12): a name too long for the file system is a clear
error, a symbolic link is followed (its target written, the link kept), and a device or a
named pipe is written into, never replaced by a regular file."""

from __future__ import annotations

import json
import os
import stat
import threading

from planc.cli import main
from tests.conftest import PLANS

TINY = str(PLANS / "gpt-tiny.plan")


def test_compile_to_a_name_longer_than_the_file_system_allows(tmp_path, capsys):
    name = "n" * 256
    assert main(["compile", TINY, "-o", str(tmp_path / name)]) == 1
    err = capsys.readouterr().err
    assert err == (f"planc: error: the name {'n' * 40}... is 256 bytes; a file name holds at "
                   f"most 255, and planc needs 16 more for the temporary directory it writes "
                   f"first\n")
    assert list(tmp_path.iterdir()) == []


def test_graph_through_a_symbolic_link_writes_its_target(tmp_path, capsys):
    link = tmp_path / "graph.dot"
    link.symlink_to(tmp_path / "real.dot")
    assert main(["graph", TINY, "-o", str(link)]) == 0
    assert link.is_symlink() and os.readlink(link) == str(tmp_path / "real.dot")
    assert (tmp_path / "real.dot").read_text().startswith("// written by planc graph\ndigraph")


def test_graph_into_a_named_pipe_writes_into_it(tmp_path, capsys):
    fifo = tmp_path / "graph.dot"
    os.mkfifo(fifo)
    received = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_bytes()))
    reader.start()
    try:
        assert main(["graph", TINY, "-o", str(fifo), "--format", "dot"]) == 0
    finally:
        reader.join(timeout=30)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert received and received[0].startswith(b"// written by planc graph\ndigraph")


def test_graph_into_a_named_pipe_without_a_reader_is_an_error(tmp_path, capsys):
    fifo = tmp_path / "graph.dot"
    os.mkfifo(fifo)
    assert main(["graph", TINY, "-o", str(fifo), "--format", "dot"]) == 1
    assert "cannot write" in capsys.readouterr().err
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)


def test_graph_to_dev_null_keeps_the_device(capsys):
    assert main(["graph", TINY, "-o", os.devnull, "--format", "dot"]) == 0
    assert stat.S_ISCHR(os.stat(os.devnull).st_mode)


def _full_tmpfs(tmp_path):
    """A 64 KiB tmpfs filled to the brim (root only), or None."""
    import subprocess

    mount = tmp_path / "full"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs",
                                            str(mount)], capture_output=True).returncode:
        return None
    try:
        with open(mount / "filler", "wb") as handle:
            handle.write(b"\0" * (1 << 20))
    except OSError:
        pass
    return mount


def test_metrics_on_a_full_disk_is_refused_before_any_rank_starts(tmp_path, capsys):
    import subprocess

    import pytest

    mount = _full_tmpfs(tmp_path)
    if mount is None:
        pytest.skip("needs root to mount a small tmpfs")
    try:
        status = main(["run", TINY, "-o", str(tmp_path / "b"), "--metrics",
                       str(mount / "m.jsonl")])
        err = capsys.readouterr().err
        assert status == 1  # a full disk: the work cannot be done (README, "Exit status")
        assert f"planc: error: --metrics {mount / 'm.jsonl'}: the file system of {mount} is " \
               f"full (less than 1 MiB free)" in err
        assert "running" not in err
        status = main(["run", TINY, "-o", str(mount / "b")])
        assert status == 1
        assert f"the file system of {mount} is full" in capsys.readouterr().err
    finally:
        subprocess.run(["umount", str(mount)], capture_output=True)


def test_run_writes_metrics_and_trace_through_links_and_into_devices(tmp_path, capsys):
    import pytest

    pytest.importorskip("torch")
    metrics, trace = tmp_path / "metrics.jsonl", tmp_path / "trace.json"
    metrics.symlink_to(tmp_path / "real-metrics.jsonl")
    trace.symlink_to(tmp_path / "real-trace.json")
    assert main(["run", TINY, "-o", str(tmp_path / "b"), "--steps", "1",
                 "--metrics", str(metrics), "--trace", str(trace)]) == 0
    assert metrics.is_symlink() and trace.is_symlink()
    assert (tmp_path / "real-metrics.jsonl").read_text().count("\n") == 1
    assert (tmp_path / "real-trace.json").read_text().startswith(
        '{"otherData": {"generator": "planc run --trace"}, "traceEvents"')
    assert main(["run", str(tmp_path / "b"), "--steps", "1", "--metrics", os.devnull,
                 "--trace", os.devnull]) == 0
    assert stat.S_ISCHR(os.stat(os.devnull).st_mode)


def test_metrics_into_a_named_pipe_without_a_reader_is_an_error(tmp_path, capfd):
    """Opened for writing, a pipe no process reads blocks forever: the rank says so and
    the run stops, instead of every other rank reporting itself stuck --timeout later."""
    import pytest

    pytest.importorskip("torch")
    fifo = tmp_path / "metrics.fifo"
    os.mkfifo(fifo)
    assert main(["run", TINY, "-o", str(tmp_path / "b"), "--steps", "1", "--metrics",
                 str(fifo), "--timeout", "300"]) == 1
    assert (f"planc: error: --metrics {fifo}: a named pipe that no process reads; start "
            f"its reader first") in capfd.readouterr().err
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)


def test_metrics_on_a_disk_that_fills_during_the_run(tmp_path, capfd):
    """/dev/full is what a disk that filled after the run started looks like: it opens,
    and its file system (/dev) has room, so the launcher's check before the run passes;
    then every write fails with ENOSPC. The leader warns once, training goes on to the
    last step, and the run succeeds."""
    import pytest

    pytest.importorskip("torch")
    full = "/dev/full"
    if not os.path.exists(full) or not stat.S_ISCHR(os.stat(full).st_mode):
        pytest.skip("needs /dev/full")
    room = os.statvfs(os.path.dirname(full))
    if room.f_bavail * room.f_frsize < 2**20:  # planc.commands.run.MIN_FREE_BYTES
        pytest.skip("the file system of /dev/full has less than 1 MiB free: the launcher "
                    "refuses it before the run, another test's case")
    build = tmp_path / "b"
    status = main(["run", TINY, "-o", str(build), "--steps", "2", "--metrics", full])
    out, err = capfd.readouterr()
    assert status == 0, err[-3000:]
    warnings = [line for line in err.splitlines() if "planc: warning:" in line]
    assert len(warnings) == 1, err[-3000:]
    assert warnings[0].endswith("planc: warning: cannot write the metrics of step 1 (No "
                                "space left on device); no more metrics are written")
    assert "step 2/2" in err.split(warnings[0])[1]  # trained on after the warning
    logs = list((build / "logs").rglob("*.log"))
    assert logs
    for log in logs + [None]:
        text = err + out if log is None else log.read_text(errors="replace")
        assert "Traceback" not in text and "Exception ignored" not in text, (log, text[-2000:])
    assert stat.S_ISCHR(os.stat(full).st_mode)


ONE_RANK = """plan x {
  model gpt { layers = 1; hidden = 8; heads = 2; vocab = 64; seq = 8; batch = 2 }
  train { steps = 1; optimizer = sgd(lr = LR) }
}
"""


def _files(directory) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def test_run_never_replaces_the_build_of_another_plan(tmp_path, capfd, monkeypatch):
    """Issue 20: `planc run FILE` compiled into build/<stem> and replaced, logs included,
    the build a user had compiled from an edited copy of the plan and was inspecting. Now
    it refuses (exit 1, nothing run) unless --force, which keeps the logs; a build of the
    same plan is run as it is; the run says which build it runs."""
    import pytest

    pytest.importorskip("torch")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.plan").write_text(ONE_RANK.replace("LR", "0.1"))
    (tmp_path / "copy").mkdir()
    (tmp_path / "copy" / "x.plan").write_text(ONE_RANK.replace("LR", "0.2"))
    build = tmp_path / "build" / "x"
    assert main(["run", "copy/x.plan"]) == 0
    assert "planc: running x from build/x on 1 rank (gloo), 1 step\n" in capfd.readouterr().err
    before = _files(build)
    assert main(["run", "x.plan"]) == 2
    assert capfd.readouterr().err == (
        f"planc: error: build/x holds the build of {tmp_path / 'copy' / 'x.plan'} (another "
        f"plan); compile elsewhere with -o DIR, or replace it with --force\n")
    assert _files(build) == before
    manifest = os.stat(build / "build.json")
    assert main(["run", "copy/x.plan"]) == 0  # the same plan: run as it is, not rewritten
    err = capfd.readouterr().err
    assert "planc: running x from build/x on 1 rank (gloo), 1 step\n" in err
    assert "replaced" not in err
    after = os.stat(build / "build.json")
    assert (after.st_ino, after.st_mtime_ns) == (manifest.st_ino, manifest.st_mtime_ns)
    assert len(list((build / "logs").iterdir())) == 2
    assert main(["run", "x.plan", "--force"]) == 0
    err = capfd.readouterr().err
    assert (f"planc: replaced build/x, which held the build of {tmp_path / 'copy' / 'x.plan'} "
            f"(another plan; --force); its logs/ are kept in the new build\n") in err
    assert "planc: running x from build/x on 1 rank (gloo), 1 step\n" in err
    assert len(list((build / "logs").iterdir())) == 3
    assert json.loads((build / "build.json").read_text())["source"] == str(tmp_path / "x.plan")


def test_output_with_a_build_directory_is_a_command_line_error(tmp_path, capsys):
    assert main(["compile", TINY, "-o", str(tmp_path / "b")]) == 0
    capsys.readouterr()
    assert main(["run", str(tmp_path / "b"), "-o", str(tmp_path / "c")]) == 2
    assert capsys.readouterr().err == (
        f"planc: error: -o names the build directory a plan file is compiled into, but "
        f"{tmp_path / 'b'} is a build directory already; run it without -o\n")
    assert sorted(os.listdir(tmp_path)) == ["b"]


def _tmpfs(tmp_path, size: str):
    """A tmpfs of ``size`` mounted in ``tmp_path`` (root only; None elsewhere)."""
    import subprocess

    mount = tmp_path / "small"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}",
                                            "tmpfs", str(mount)],
                                           capture_output=True).returncode:
        return None
    return mount


def _fill(mount, pages_left: int) -> None:
    """Fill ``mount`` (a tmpfs) until ``pages_left`` pages of it are free. A page that a
    file has begun is the file's: it takes writes until it is full, and then the next
    page is not there."""
    filler = mount / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        while True:  # unbuffered: nothing is left to write when the file is closed
            os.write(fd, b"\0" * (1 << 16))
    except OSError:
        pass  # full: the filler ends on a page boundary
    finally:
        os.close(fd)
    page = os.statvfs(mount).f_frsize
    os.truncate(filler, os.path.getsize(filler) - pages_left * page)
    assert os.statvfs(mount).f_bavail == pages_left


def _run_filling(argv: list[str], mount, pages_left: int, build):
    """``planc argv`` in a child, ``mount`` filled to ``pages_left`` free pages once the
    launcher has checked its outputs (its "planc: running" line) and before a rank has
    begun (they start after it: python, torch, the build), so that the disk fills during
    the run. Returns (exit status, stderr, the text of every rank's log)."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    child = subprocess.Popen([sys.executable, "-m", "planc", *map(str, argv)], cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        head = []
        for line in child.stderr:
            head.append(line)
            if line.startswith("planc: running"):
                _fill(mount, pages_left)
                break
        out, rest = child.communicate(timeout=600)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    err = "".join(head) + rest
    logs = [log.read_text(errors="replace") for log in (build / "logs").rglob("*.log")]
    assert logs, err[-3000:]
    return child.returncode, err + out, logs


def _unmount(mount) -> None:
    import subprocess

    subprocess.run(["umount", str(mount)], capture_output=True)


def test_a_metrics_file_on_a_disk_that_fills_ends_with_a_whole_line(tmp_path):
    """The disk fills part way through a record (a tmpfs with one page left): the record
    is cut off again rather than left half written, the leader warns once and trains on,
    and planc plot reads the file without a warning."""
    import pytest

    pytest.importorskip("torch")
    mount = _tmpfs(tmp_path, "2m")
    if mount is None:
        pytest.skip("needs root to mount a small tmpfs")
    try:
        (tmp_path / "x.plan").write_text(ONE_RANK.replace("LR", "0.1"))
        metrics, build = mount / "m.jsonl", tmp_path / "b"
        status, err, logs = _run_filling(["run", tmp_path / "x.plan", "-o", build,
                                          "--steps", 30, "--metrics", metrics], mount, 1, build)
        assert status == 0, err[-3000:]
        warnings = [line for line in err.splitlines() if "warning" in line]
        text = metrics.read_text()
        lines = text.splitlines()
        assert 6 <= len(lines) < 30 and os.path.getsize(metrics) <= 4096  # one page
        assert text.endswith("\n") and [json.loads(line)["step"] for line in lines] == \
            list(range(len(lines)))
        assert len(warnings) == 1 and warnings[0].endswith(
            f"planc: warning: cannot write the metrics of step {len(lines) + 1} (No space "
            f"left on device); no more metrics are written"), err[-3000:]
        assert "step 30/30" in err.split(warnings[0])[1]  # trained on after the warning
        for text in [err, *logs]:
            assert "Traceback" not in text and "Exception ignored" not in text, text[-2000:]
        assert main(["plot", str(metrics), "-o", str(tmp_path / "p.png")]) == 0
    finally:
        _unmount(mount)


def test_tensorboard_on_a_full_disk_is_refused_before_any_rank_starts(tmp_path, capsys):
    """As --metrics: a file system with less than 1 MiB free, at the start, is refused."""
    import pytest

    mount = _full_tmpfs(tmp_path)
    if mount is None:
        pytest.skip("needs root to mount a small tmpfs")
    try:
        (tmp_path / "x.plan").write_text(ONE_RANK.replace("LR", "0.1"))
        status = main(["run", str(tmp_path / "x.plan"), "-o", str(tmp_path / "b"),
                       "--tensorboard", str(mount / "tb")])
        assert (status, capsys.readouterr().err) == (1, (
            f"planc: error: --tensorboard {mount / 'tb'}: the file system of {mount} is full "
            f"(less than 1 MiB free)\n"))
        assert not (tmp_path / "b").exists() and not (mount / "tb").exists()
    finally:
        _unmount(mount)


def _steps_logged(directory) -> tuple[dict[int, set[str]], set[str]]:
    """The tags of every step of the one event file in ``directory``, and the tags of its
    first step (every scalar a step of this run writes)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory))
    events.Reload()
    steps: dict[int, set[str]] = {}
    for tag in events.Tags()["tensors"]:
        for event in events.Tensors(tag):
            steps.setdefault(event.step, set()).add(tag)
    return steps, steps.get(1, set())


def test_tensorboard_on_a_disk_that_fills_during_the_run(tmp_path):
    """The disk fills during the run (a tmpfs left one page once the launcher has checked
    it): the leader warns once, as for --metrics, writes no more TensorBoard logs, and
    trains to the last step; the writer's thread prints nothing. The event file holds
    every step before the one warned of whole, and nothing after it."""
    import pytest

    pytest.importorskip("tensorboard")
    mount = _tmpfs(tmp_path, "2m")
    if mount is None:
        pytest.skip("needs root to mount a small tmpfs")
    try:
        (tmp_path / "x.plan").write_text(ONE_RANK.replace("LR", "0.1"))
        build = tmp_path / "b"
        status, err, logs = _run_filling(["run", tmp_path / "x.plan", "-o", build,
                                          "--steps", 40, "--tensorboard", mount / "tb"],
                                         mount, 1, build)
        assert status == 0, err[-3000:]
        steps, every = _steps_logged(mount / "tb")
        last = max(steps)
        assert {"loss", "lr", "time_s", "tflops_per_device"} <= every and last < 40
        assert all(steps[k] == every for k in range(1, last)), steps
        failed = last + (steps[last] == every)  # the step whose events did not all fit
        warnings = [line for line in err.splitlines() if "warning" in line]
        assert len(warnings) == 1 and warnings[0].endswith(
            f"planc: warning: cannot write the TensorBoard logs of step {failed} (No space "
            f"left on device); no more TensorBoard logs are written"), err[-3000:]
        assert "step 40/40" in err.split(warnings[0])[1]  # trained on after the warning
        for text in [err, *logs]:
            assert "Traceback" not in text and "Exception ignored" not in text and \
                "Exception in thread" not in text, text[-2000:]
    finally:
        _unmount(mount)


def test_a_tensorboard_log_on_a_disk_full_when_the_rank_starts_is_a_warning(tmp_path):
    """The disk filled between planc run's check and the leader's start: the leader
    warns and trains without the log, and the writer's thread is never started (its
    first event would fail there, with a traceback)."""
    import subprocess
    import sys

    import pytest

    pytest.importorskip("tensorboard")
    mount = _full_tmpfs(tmp_path)
    if mount is None:
        pytest.skip("needs root to mount a small tmpfs")
    try:
        code = ("from planc.runtime.step_metrics import open_tensorboard; "
                f"assert open_tensorboard({str(mount / 'tb')!r}) is None")
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=300)
        assert (done.returncode, done.stderr) == (0, (
            f"planc: warning: cannot write TensorBoard logs into {mount / 'tb'} (No space "
            f"left on device); training goes on without them\n"))
    finally:
        _unmount(mount)
