"""planc run's launcher under faults (issue 12): nothing listens beyond loopback, workers
die with their launcher, a stopped rank is named and stops the run, Ctrl-C prints no
traceback, a failed run leaves no files in the temporary directory, and a timeout that
is not a number of seconds is refused before any rank starts.

Each test runs the real ``planc run`` in a process of its own (gloo, 2 ranks) on a build
whose stage 0 never sends its activations, so both ranks wait until something stops
them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

from planc.cli import main  # noqa: E402
from tests.conftest import ROOT  # noqa: E402

pytestmark = pytest.mark.slow

PLAN = """plan stuck {
  model gpt { layers = 2; hidden = 32; heads = 4; vocab = 128; seq = 16; batch = 4 }
  mesh { pp = 2 }
  schedule { microbatches = 2 }
  train { steps = 2 }
}
"""


@pytest.fixture(scope="module")
def stuck(tmp_path_factory) -> Path:
    """A build whose ranks wait forever: stage 0 does not send its forward activations."""
    directory = tmp_path_factory.mktemp("stuck")
    (directory / "stuck.plan").write_text(PLAN)
    assert main(["compile", str(directory / "stuck.plan"), "-o", str(directory / "b")]) == 0
    path = directory / "b" / "programs" / "stage0.json"
    data = json.loads(path.read_text())
    data["blocks"] = {name: [x for x in block if x["op"] != "send"]
                      for name, block in data["blocks"].items()}
    path.write_text(json.dumps(data))
    return directory / "b"


def _start(build: Path, *args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "planc", "run", str(build), "--no-verify",
                             *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, env={**os.environ, **(env or {})})


def _descendants(pid: int) -> list[int]:
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(parent)],
                             capture_output=True, text=True).stdout.split()
        found += map(int, out)
        frontier += map(int, out)
    return found


def _ranks(pid: int) -> dict[int, int]:
    """Rank -> process id, for the rank processes under the launcher ``pid``: those whose
    standard output is a rank's log file (BUILD/logs/RUN/RANK/stdout.log)."""
    found = {}
    for child in _descendants(pid):
        try:
            target = os.readlink(f"/proc/{child}/fd/1")
        except OSError:
            continue
        if target.endswith("/stdout.log"):
            found[int(Path(target).parent.name)] = child
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _wait_for_ranks(process: subprocess.Popen, count: int = 2) -> list[int]:
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        ranks = _ranks(process.pid)
        if len(ranks) >= count:
            time.sleep(3)  # both in the step, waiting
            return ranks
        assert process.poll() is None, process.communicate()
        time.sleep(0.2)
    raise AssertionError("the ranks did not start")


def _kill_all(process: subprocess.Popen, extra: list[int] = ()) -> None:
    for pid in [*extra, process.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _listening_sockets(pids: list[int]) -> list[str]:
    """Local addresses of the TCP sockets these processes listen on (from /proc)."""
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                address, port = fields[1].split(":")
                if len(address) == 8:
                    shown = ".".join(str(b) for b in bytes.fromhex(address)[::-1])
                else:
                    shown = "::1" if address == "0" * 24 + "01000000" else \
                        ("::" if address == "0" * 32 else address)
                found.append(f"{shown}:{int(port, 16)}")
    return found


def test_nothing_listens_beyond_loopback(stuck):
    process = _start(stuck, "--timeout", "600")
    try:
        ranks = _wait_for_ranks(process)
        addresses = _listening_sockets([process.pid, *_descendants(process.pid)])
        assert addresses, "the store and gloo listen somewhere"
        assert [a for a in addresses if not a.startswith("127.0.0.1:")] == []
        assert len(ranks) >= 2
    finally:
        _kill_all(process, _descendants(process.pid))
        process.communicate()


def test_workers_die_with_a_launcher_killed_with_sigkill(stuck):
    process = _start(stuck, "--timeout", "600")
    try:
        _wait_for_ranks(process)
        everyone = _descendants(process.pid)
        os.kill(process.pid, signal.SIGKILL)
        # the launcher stays a zombie until reaped: the ranks must see it gone anyway
        time.sleep(3)
        zombie_phase = [p for p in everyone if _alive(p)]
        process.communicate(timeout=30)  # its pipes close when the last rank is gone
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_alive(p) for p in everyone):
            time.sleep(0.2)
        assert [p for p in everyone if _alive(p)] == []
        assert zombie_phase == [], "ranks outlived their launcher while it was a zombie"
    finally:
        _kill_all(process, _descendants(process.pid))


def test_a_stopped_rank_is_named_and_stops_the_run_after_the_timeout(stuck):
    process = _start(stuck, "--timeout", "5")
    try:
        _wait_for_ranks(process)
        rank_pids = _ranks(process.pid)
        stopped_at = time.monotonic()
        os.kill(rank_pids[1], signal.SIGSTOP)
        _, err = process.communicate(timeout=60)
        took = time.monotonic() - stopped_at
    finally:
        _kill_all(process, _descendants(process.pid))
    assert process.returncode == 1
    assert "planc: rank 1 was stopped (by SIGSTOP or a debugger) for 5 s; the run was " \
           "stopped" in err
    assert took < 15


def test_ctrl_c_prints_no_traceback(stuck):
    process = _start(stuck, "--timeout", "600")
    try:
        ranks = list(_wait_for_ranks(process).values())
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=30)
    finally:
        _kill_all(process, _descendants(process.pid))
    assert process.returncode == 130
    assert "planc: interrupted by signal 2; every rank was stopped" in err
    assert "Traceback" not in err + out and "KeyboardInterrupt" not in err + out
    assert [p for p in ranks if _alive(p)] == []


def test_a_failed_run_leaves_no_error_files_in_the_temporary_directory(stuck, tmp_path):
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    process = _start(stuck, "--timeout", "2", env={"TMPDIR": str(temporary)})
    _, err = process.communicate(timeout=120)
    assert process.returncode == 1
    assert "made no progress for 2 s" in err
    # torch keeps its compiler cache there (torchinductor_USER); no error files
    assert [p.name for p in temporary.iterdir() if not p.name.startswith("torchinductor_")] \
        == []


@pytest.mark.parametrize("value", ["nan", "inf", "1e308", "-inf", "0", "604801"])
def test_a_timeout_that_is_not_a_number_of_seconds_is_refused(stuck, capfd, value):
    assert main(["run", str(stuck), f"--timeout={value}"]) == 2
    err = capfd.readouterr().err
    assert err.startswith("planc: error: --timeout must be a number of seconds above 0 and at "
                          "most 604800 (a week), not ")
    assert "running" not in err
