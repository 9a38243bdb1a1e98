"""planc run's launcher under faults (issues 12 and 20): nothing listens beyond loopback,
workers die with their launcher, a stopped rank is named and every other rank reports
what it waits for before the run stops (in a step or while starting), Ctrl-C prints no
traceback and leaves no process, a failed run leaves no files in the temporary
directory, and a timeout that is not a number of seconds is refused before any rank
starts.

Each test runs the real ``planc run`` in a session of its own (gloo, 2 or 4 ranks) on a
build whose stage 0 never sends its activations, so the ranks wait until something stops
them (tests/launched.py)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import tempfile
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

from planc.cli import main  # noqa: E402
from tests.launched import (alive, descendants, kill_all, listening, ranks,  # noqa: E402
                            start, state, stuck_build, wait_for_training)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stuck(tmp_path_factory):
    return stuck_build(tmp_path_factory.mktemp("stuck"))


@pytest.fixture(scope="module")
def stuck4(tmp_path_factory):
    """The stuck build on four ranks (pp 2 x dp 2)."""
    return stuck_build(tmp_path_factory.mktemp("stuck4"), "pp = 2; dp = 2")


def test_nothing_listens_beyond_loopback(stuck):
    process = start(stuck, "--timeout", "600")
    try:
        pids = wait_for_training(process)
        addresses = listening([process.pid, *descendants(process.pid)])
        assert addresses, "gloo listens somewhere"
        assert [a for a, _ in addresses if a != "127.0.0.1"] == []
        assert len(pids) >= 2
    finally:
        kill_all(process)
        process.communicate()


def test_workers_die_with_a_launcher_killed_with_sigkill(stuck):
    process = start(stuck, "--timeout", "600")
    try:
        wait_for_training(process)
        everyone = descendants(process.pid)
        os.kill(process.pid, signal.SIGKILL)
        # Not reaped yet, the launcher stays a zombie: the ranks must see it gone anyway.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and any(alive(p) for p in everyone):
            time.sleep(0.05)
        assert [p for p in everyone if alive(p)] == []
        assert state(process.pid) == "Z", "the launcher was reaped before its ranks were gone"
        process.communicate(timeout=30)  # its pipes are closed: nothing holds them
    finally:
        kill_all(process)


def test_a_stopped_rank_is_named_and_stops_the_run_after_the_timeout(stuck):
    process = start(stuck, "--timeout", "5")
    try:
        rank_pids = wait_for_training(process)
        stopped_at = time.monotonic()
        os.kill(rank_pids[1], signal.SIGSTOP)
        _, err = process.communicate(timeout=60)
        took = time.monotonic() - stopped_at
    finally:
        kill_all(process)
    assert process.returncode == 1
    # the other rank's report may come first (it waited since before the stop), so the
    # stopped rank may not have been stopped for the whole timeout yet
    assert re.search(r"^planc: rank 1 was stopped \(by SIGSTOP or a debugger\) for \d+ s; "
                     r"the run was stopped$", err, re.M), err
    assert "planc: rank 0 stopped after reporting what it waited for (above)" in err
    assert took < 25  # the timeout, then the report of rank 0, on a busy machine


def test_every_live_rank_reports_before_the_world_goes_down(stuck4):
    """Four ranks, one stopped: the three others each say what they wait for (issue 20:
    only two of them did, the launcher killed the rest first)."""
    returncode, err = _signalled_in_training(stuck4, 3, signal.SIGSTOP, "5")
    assert returncode == 1
    for rank in (0, 1, 2):
        assert re.search(rf"^\[rank {rank}\] rank {rank} \(stage \d, tp 0, cp 0, dp \d\) "
                         rf"(made no progress for 5 s|lost a peer) in step 0; its streams "
                         rf"wait on:$", err, re.M), err
        assert f"planc: rank {rank} stopped after reporting what it waited for (above)" in err
    assert re.search(r"^planc: rank 3 was stopped \(by SIGSTOP or a debugger\) for \d+ s; "
                     r"the run was stopped$", err, re.M), err
    assert "did not report" not in err


def test_a_rank_killed_by_a_signal_is_the_cause_and_its_peers_are_named_in_one_line(stuck4):
    """Four ranks waiting in step 0, rank 0 killed: its peers lose their connections and
    report it in their logs (a lost peer), which the console leaves out for one line
    after the cause; the launcher's lines are exactly these two."""
    returncode, err = _signalled_in_training(stuck4, 0, signal.SIGKILL, "600")
    assert returncode == 1
    assert "lost a peer" not in err and "Traceback" not in err
    assert [line for line in err.splitlines() if not line.startswith("planc: running")] == [
        "planc: rank 0 killed by signal 9",
        "planc: ranks 1, 2, 3 were stopped because rank 0 failed"], err


def _signalled_in_training(build, rank: int, signum: int, timeout: str) -> tuple[int, str]:
    """A run of four ranks whose ``rank`` gets ``signum`` once all are training: its
    return code and stderr."""
    process = start(build, "--timeout", timeout)
    try:
        pids = wait_for_training(process, 4)
        os.kill(pids[rank], signum)
        _, err = process.communicate(timeout=90)
    finally:
        kill_all(process)
    return process.returncode, err


def _stopped_while_starting(build) -> tuple[int, str]:
    """A run whose rank 3 is stopped as soon as it exists: its return code and stderr."""
    process = start(build, "--timeout", "5")
    try:
        deadline = time.monotonic() + 120
        while len(ranks(process.pid)) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(ranks(process.pid)[3], signal.SIGSTOP)
        _, err = process.communicate(timeout=90)
    finally:
        kill_all(process)
    return process.returncode, err


def test_ranks_stuck_while_starting_report_too(stuck4):
    """A rank stopped before it joined the world: the others wait inside torch's start-up
    collectives, not in a step, and say so instead of waiting silently. The rank is
    stopped as soon as it exists; on a busy machine it may already have joined (forked
    from a process that imported torch, a rank starts in about 0.1 s), and the run then
    stops in step 0 instead: that attempt is made again, up to three times."""
    for _ in range(3):
        code, err = _stopped_while_starting(stuck4)
        if " in step 0; its streams wait on:" not in err:
            break
    assert code == 1
    for rank in (0, 1, 2):
        assert re.search(rf"^\[rank {rank}\] rank {rank} made no progress for 5 s while "
                         rf"[^:]+\): it waits for the other ranks there$", err, re.M), err
        assert f"planc: rank {rank} stopped after reporting what it waited for (above)" in err
    assert "did not report" not in err


def test_ctrl_c_prints_no_traceback_and_stops_every_process(stuck):
    process = start(stuck, "--timeout", "600")
    try:
        wait_for_training(process)
        everyone = descendants(process.pid)  # the ranks, the fork server, its tracker
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=60)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and any(alive(p) for p in everyone):
            time.sleep(0.05)
    finally:
        kill_all(process)
    assert process.returncode == 130
    assert "planc: interrupted by signal 2; every rank was stopped" in err
    assert "Traceback" not in err + out and "KeyboardInterrupt" not in err + out
    assert [p for p in everyone if alive(p)] == []


def test_a_failed_run_leaves_no_error_files_in_the_temporary_directory(stuck):
    # beside the runner's own temporary files: a tmp_path may be too deep for a socket
    temporary = Path(tempfile.mkdtemp(prefix="planc-t-"))
    try:
        process = start(stuck, "--timeout", "2", env={"TMPDIR": str(temporary)})
        _, err = process.communicate(timeout=120)
        assert process.returncode == 1
        assert "made no progress for 2 s" in err
        # torch keeps its compiler cache there (torchinductor_USER); no error files
        assert [p.name for p in temporary.iterdir()
                if not p.name.startswith("torchinductor_")] == []
    finally:
        shutil.rmtree(temporary, ignore_errors=True)


def test_a_temporary_directory_too_long_for_the_fork_servers_socket_is_an_error(stuck,
                                                                              tmp_path):
    temporary = tmp_path / ("t" * 100)
    temporary.mkdir()
    process = start(stuck, env={"TMPDIR": str(temporary)})
    out, err = process.communicate(timeout=120)
    assert process.returncode == 1
    assert err.endswith(f"planc: error: the temporary directory {temporary} is too long a "
                        f"path ({len(str(temporary))} bytes) for the Unix socket through "
                        f"which the ranks are started (at most 75 bytes): set TMPDIR to a "
                        f"shorter directory; nothing was run\n")
    assert "Traceback" not in out + err
    assert list(temporary.iterdir()) == []


@pytest.mark.parametrize("value", ["nan", "inf", "1e308", "-inf", "0", "604801"])
def test_a_timeout_that_is_not_a_number_of_seconds_is_refused(stuck, capfd, value):
    assert main(["run", str(stuck), f"--timeout={value}"]) == 2
    err = capfd.readouterr().err
    assert err.startswith("planc: error: --timeout must be a number of seconds above 0 and at "
                          "most 604800 (a week), not ")
    assert "running" not in err


def test_ranks_share_the_machines_cores_as_intra_op_threads():
    """planc run gives each of its ranks the cores over the ranks, at least one; the
    suite pins one (tests/conftest.py), a caller's OMP_NUM_THREADS wins."""
    from planc.runtime.launcher.launch import threads_per_rank

    cores = len(os.sched_getaffinity(0))
    assert threads_per_rank(1) == cores
    assert threads_per_rank(2) == max(1, cores // 2)
    assert threads_per_rank(cores) == 1
    assert threads_per_rank(8 * cores) == 1
    assert os.environ["OMP_NUM_THREADS"] == "1"


def test_every_failed_rank_s_traceback_is_shown_once(tmp_path):
    """Two ranks that raised different errors: both tracebacks, the first failure's
    first (only the first's was shown, and the second's was nowhere on the console since
    a rank's traceback goes to its error.txt alone); two that raised the same, once."""
    from types import SimpleNamespace

    from planc.runtime.launcher.protocol import ERROR_FILE
    from planc.runtime.launcher.reports import failure_report

    def rank(number: int, code: int, trace: str | None):
        log_dir = tmp_path / str(number)
        log_dir.mkdir()
        if trace is not None:
            (log_dir / ERROR_FILE).write_text(trace + "\n")
        return SimpleNamespace(rank=number, process=SimpleNamespace(exitcode=code),
                               log_dir=str(log_dir), same_as=None, errors=[])

    first, second, third = rank(2, 1, "KeyError: 'a'"), rank(0, 1, "ValueError: b"), \
        rank(3, 1, "KeyError: 'a'")
    assert failure_report([first, second, third], [rank(1, -9, None)]) == (
        "planc: ranks 0, 2, 3 exited with status 1\n"
        "planc: rank 1 was stopped because ranks 0, 2, 3 failed\n"
        "planc: traceback of rank 2, the first to fail (and of rank 3, the same):\n"
        "KeyError: 'a'\n"
        "planc: traceback of rank 0:\n"
        "ValueError: b")

