"""Signals at every moment of ``planc run``'s start-up (issue 20).

A Ctrl-C in the first seconds of a run was ignored in 3 of 10 tries (torch swallows a
KeyboardInterrupt raised while it imports numpy) and printed a fork-server traceback in 3
of 14; a launcher killed while the fork server imported torch left the server, the
resource tracker and a rank alive for minutes, holding the caller's pipes. Here the real
``planc run`` (gloo, 2 ranks, on a build whose ranks wait forever once they train) gets a
signal at moments spread evenly over its start-up, as measured on this machine by one run
that waits for its rank processes, from the first milliseconds (Python starting) to
the ranks waiting in their first step:

* ``SIGINT`` to the launcher alone (``kill -INT``), at 12 moments;
* ``SIGINT`` to its whole process group (a terminal's Ctrl-C), at 12 moments;
* ``SIGKILL`` to the launcher, at 8 moments.

After a SIGINT the run must end with status 130 (or, for a signal sent before planc's
first line had run, be killed by the signal, -2, or end with 1 from Python's own
start-up, see ``_before_planc``), print no traceback on its output or in any log of the
run (the fork server's included), and leave no process behind. Whether planc's first
line had run is an event, not a guess from the clock: a hook loaded by every process of
the test (``STARTED_HOOK``) writes a file named by its pid once the launcher imports
``planc.cli``, which it does only after installing its handler, and each trial looks for
that file just before it sends its signal. After a
SIGKILL every process of the run must be gone and the caller's pipes closed. Trials run
two at a time, each in a session of its own and on a copy of the build, so the machine
is busy as a loaded CI machine is; every wait is for an event (an exit, a pipe closing,
a process disappearing) under a generous deadline.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("torch")

from tests.conftest import ROOT  # noqa: E402
from planc.data.tokens import write_tokens  # noqa: E402
from tests.launched import kill_all, ranks, session, start, stuck_build  # noqa: E402

pytestmark = pytest.mark.slow

DEADLINE_S = 90.0  # for any one event, on a machine running another test suite beside
PARALLEL = 2


@pytest.fixture(scope="module")
def stuck(tmp_path_factory) -> Path:
    return stuck_build(tmp_path_factory.mktemp("signals"))


# Loaded by every Python process started with its directory on PYTHONPATH: once a
# process imports planc.cli (planc/__main__.py installs its SIGINT handler first), a file
# named by its pid appears in PLANC_TEST_STARTED.
STARTED_HOOK = """
import os, sys

class PlancStarted:
    def find_spec(self, name, path=None, target=None):
        if name == "planc.cli":
            sys.meta_path.remove(self)
            folder = os.environ.get("PLANC_TEST_STARTED")
            if folder:
                open(os.path.join(folder, str(os.getpid())), "w").close()
        return None

sys.meta_path.insert(0, PlancStarted())
"""


@pytest.fixture(scope="module")
def started(tmp_path_factory) -> Path:
    """A folder where the launcher of each trial marks that planc's first line has run."""
    root = tmp_path_factory.mktemp("started")
    (root / "hook").mkdir()
    (root / "hook" / "sitecustomize.py").write_text(STARTED_HOOK)
    (root / "marks").mkdir()
    return root


def _start(build: Path, started: Path | None = None):
    env = None if started is None else {
        "PYTHONPATH": f"{started / 'hook'}{os.pathsep}{ROOT}",
        "PLANC_TEST_STARTED": str(started / "marks")}
    return start(build, "--timeout", "600", env=env)


@pytest.fixture(scope="module")
def window(stuck, tmp_path_factory) -> float:
    """Seconds from starting planc run to both ranks running, measured here and now."""
    build = tmp_path_factory.mktemp("window") / "b"
    shutil.copytree(stuck, build)
    start = time.monotonic()
    process = _start(build)
    try:
        while len(ranks(process.pid)) < 2:
            assert process.poll() is None, process.communicate()
            assert time.monotonic() - start < DEADLINE_S, "the ranks did not start"
            time.sleep(0.02)
        return time.monotonic() - start
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()


@dataclass
class Trial:
    moment: float
    planc_started: bool = False  # planc's first line had run when the signal was sent
    status: int | None = None
    output: str = ""
    logs: str = ""
    left: list[int] | None = None  # processes of the run still alive at the deadline
    gone_after: float = 0.0  # seconds from the signal until the last process was gone


def _trial(stuck: Path, root: Path, started: Path, index: int, moment: float,
           send) -> Trial:
    build = root / f"b{index}"
    shutil.copytree(stuck, build)
    trial = Trial(moment)
    process = _start(build, started)
    try:
        time.sleep(moment)
        trial.planc_started = (started / "marks" / str(process.pid)).exists()
        sent = time.monotonic()
        send(process.pid)
        out, err = process.communicate(timeout=DEADLINE_S)
        while session(process.pid) and time.monotonic() - sent < DEADLINE_S:
            time.sleep(0.05)
        trial.gone_after = time.monotonic() - sent
        trial.left = session(process.pid)
    finally:
        for pid in session(process.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if process.poll() is None:
            process.kill()
            process.communicate()
    trial.status, trial.output = process.returncode, out + err
    trial.logs = "".join(p.read_text(errors="replace") for p in (build / "logs").rglob("*")
                         if p.is_file()) if (build / "logs").is_dir() else ""
    shutil.rmtree(build)
    return trial


def _trials(stuck: Path, root: Path, started: Path, window: float, count: int,
            send, offset: float = 0.0) -> list[Trial]:
    """``count`` trials at even moments from the first milliseconds to a little after the
    ranks started, shifted by ``offset`` of a step (the two Ctrl-C tests interleave theirs:
    together they try twice as many moments, each half as many runs)."""
    moments = [(window + 1.0) * min(i + offset, count - 1) / (count - 1)
               for i in range(count)]
    with ThreadPoolExecutor(PARALLEL) as pool:
        return list(pool.map(lambda im: _trial(stuck, root, started, im[0], im[1], send),
                             enumerate(moments)))


def _interrupt_launcher(pid: int) -> None:
    os.kill(pid, signal.SIGINT)


def _interrupt_group(pid: int) -> None:  # what a terminal's Ctrl-C does
    os.killpg(pid, signal.SIGINT)


def _kill_launcher(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


def _before_planc(trial: Trial, text: str) -> bool:
    """Python's own start-up, before the first line of planc runs: the .pth files of
    site-packages (its ``site`` module), then, for ``python -m planc``, finding the
    package. A SIGINT then is a KeyboardInterrupt raised in Python's code, which prints its
    traceback and exits with 1, or, once Python's main has started (runpy importing the
    package), by SIGINT itself (CPython re-raises it so that its parent sees the signal:
    status -2); planc's first line installs a handler (planc/__main__.py), so such a
    traceback has no frame of planc's. Only for a signal sent before the launcher had
    imported planc.cli (``Trial.planc_started``)."""
    tail = text.split("Traceback", 1)[-1]
    return (not trial.planc_started and trial.status in (1, -signal.SIGINT) and
            tail.rstrip().endswith("KeyboardInterrupt") and
            f'File "{ROOT / "planc"}' not in tail)


def _interrupted_problems(trials: list[Trial]) -> list[str]:
    problems = []
    for t in trials:
        at = f"SIGINT at {t.moment:.2f} s"
        if t.planc_started and t.status != 130:
            problems.append(f"{at}, after planc's first line: status {t.status}: "
                            f"{t.output[-300:]!r}")
        elif t.status not in (130, -signal.SIGINT) and not _before_planc(t, t.output):
            problems.append(f"{at}: status {t.status}: {t.output[-300:]!r}")
        if t.status == 130 and "planc: interrupted by signal 2" not in t.output:
            problems.append(f"{at}: no 'interrupted' line: {t.output[-300:]!r}")
        for where, text in (("output", t.output), ("logs", t.logs)):
            if ("Traceback" in text or "KeyboardInterrupt" in text) and \
                    not _before_planc(t, text):
                problems.append(f"{at}: a traceback in the {where}: {text[-600:]!r}")
        if t.left:
            problems.append(f"{at}: processes {t.left} still alive {DEADLINE_S:g} s later")
    return problems


def _interrupted_at_every_moment(stuck, started, window, tmp_path, send, offset) -> None:
    trials = _trials(stuck, tmp_path, started, window, 8, send, offset)
    assert _interrupted_problems(trials) == []
    # planc's own handling was tried: at least the trials sent once the ranks ran
    assert sum(t.planc_started for t in trials) >= 1


def test_ctrl_c_to_the_launcher_at_any_moment_stops_the_run(stuck, started, window,
                                                            tmp_path):
    _interrupted_at_every_moment(stuck, started, window, tmp_path, _interrupt_launcher, 0.0)


def test_ctrl_c_to_the_process_group_at_any_moment_stops_the_run(stuck, started, window,
                                                                 tmp_path):
    _interrupted_at_every_moment(stuck, started, window, tmp_path, _interrupt_group, 0.5)


def test_a_launcher_killed_at_any_moment_leaves_no_process(stuck, started, window,
                                                          tmp_path):
    trials = _trials(stuck, tmp_path, started, window, 6, _kill_launcher)
    assert [t.status for t in trials] == [-signal.SIGKILL] * len(trials)
    assert [(t.moment, t.left) for t in trials if t.left] == []
    # ranks watch the launcher every 0.5 s; the fork server ends once its import is done
    assert max(t.gone_after for t in trials) < 30


# Loaded by every Python process started with its directory on PYTHONPATH: a Ctrl-C that
# arrives exactly while the launcher imports numpy, as torch's own import does it, the
# moment where torch swallowed it and the run trained on (issue 20). The launcher imports
# torch to scan a token file (on a CPU build of torch, only then); the fork server, which
# imports it too, is left alone: it blocks SIGINT, as its ranks do.
CTRL_C_AT_NUMPY = """
import os, signal, sys

class CtrlCAtNumpy:
    fired = False

    def find_spec(self, name, path=None, target=None):
        if "multiprocessing" in sys.orig_argv[-1]:
            return None
        if name == "numpy" and not CtrlCAtNumpy.fired:
            CtrlCAtNumpy.fired = True
            os.kill(os.getpid(), signal.SIGINT)
        return None

sys.meta_path.insert(0, CtrlCAtNumpy())
"""


def test_ctrl_c_while_torch_imports_numpy_stops_the_run(tmp_path):
    (tmp_path / "hook").mkdir()
    (tmp_path / "hook" / "sitecustomize.py").write_text(CTRL_C_AT_NUMPY)
    write_tokens(tmp_path / "ids.tokens", [(7 * i) % 128 for i in range(1024)], 2)
    build = stuck_build(tmp_path, data=str(tmp_path / "ids.tokens"))
    process = start(build, "--timeout", "600",
                    env={"PYTHONPATH": f"{tmp_path / 'hook'}{os.pathsep}{ROOT}"})
    try:
        out, err = process.communicate(timeout=DEADLINE_S)
    finally:
        kill_all(process)
    assert process.returncode == 130, err
    assert err.endswith("planc: interrupted by signal 2\n"), err
    assert "Traceback" not in out + err and "running" not in err
    assert not (build / "logs").exists()  # no rank was started


# Loaded by every Python process started with its directory on PYTHONPATH. In the fork
# server alone (its command line runs multiprocessing.forkserver's `main(LISTENER, ...)`)
# the import of the ranks' modules, its preload, waits for good once the launcher has
# asked for rank 0 (a connection waits on the listener), after saying so on HELD: a fork
# server still importing torch, the longest step of the start-up, and one that a busy
# machine can stretch without bound (issue 34). A writer of RELEASE coming and going
# lets it go on.
HOLD_THE_FORK_SERVER = """
import os, re, select, sys

class HoldTheForkServer:
    def find_spec(self, name, path=None, target=None):
        if name == "planc.runtime.worker" and "multiprocessing.forkserver" in sys.orig_argv[-1]:
            sys.meta_path.remove(self)
            listener = int(re.search(r"main[(](\\d+),", sys.orig_argv[-1]).group(1))
            select.select([listener], [], [])
            release = os.open(RELEASE, os.O_RDONLY | os.O_NONBLOCK)
            with open(HELD, "w") as held:
                held.write("held\\n")
            select.select([release], [], [])
        return None

sys.meta_path.insert(0, HoldTheForkServer())
"""


def _readable(fd: int, process, what: str) -> None:
    """Wait until ``fd`` can be read, while ``process`` runs, under the deadline."""
    deadline = time.monotonic() + DEADLINE_S
    while not select.select([fd], [], [], 0.5)[0]:
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, what


@pytest.mark.parametrize("send", [_interrupt_launcher, _interrupt_group],
                         ids=["launcher", "process-group"])
def test_ctrl_c_while_the_fork_server_imports_torch_stops_the_run_at_once(stuck, tmp_path,
                                                                          send):
    """The launcher asks the fork server for rank 0 and waits for its process id, which
    comes once the server has imported torch. A Ctrl-C then was only recorded: the run
    went on for as long as that import took, and "running stuck ... on 2 ranks" was all
    it printed (issue 34). Here the import never ends: the run must stop at once, with
    the fork server, and no rank must ever start."""
    held, release = tmp_path / "held", tmp_path / "release"
    os.mkfifo(held)
    os.mkfifo(release)
    (tmp_path / "hook").mkdir()
    (tmp_path / "hook" / "sitecustomize.py").write_text(
        HOLD_THE_FORK_SERVER.replace("HELD", repr(str(held))).replace("RELEASE",
                                                                     repr(str(release))))
    build = tmp_path / "b"
    shutil.copytree(stuck, build)
    announced = os.open(held, os.O_RDONLY | os.O_NONBLOCK)
    process = start(build, "--timeout", "600",
                    env={"PYTHONPATH": f"{tmp_path / 'hook'}{os.pathsep}{ROOT}"})
    try:
        _readable(announced, process, "the fork server was not asked for rank 0")
        send(process.pid)
        try:
            out, err = process.communicate(timeout=DEADLINE_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"planc run was still running {DEADLINE_S:g} s after its SIGINT")
        deadline = time.monotonic() + DEADLINE_S
        while session(process.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = session(process.pid)
    finally:
        try:  # a fork server still held goes on with its import
            os.close(os.open(release, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:  # ENXIO: nothing holds it any more
            pass
        os.close(announced)
        kill_all(process)
    assert process.returncode == 130, err
    assert err.endswith("\nplanc: interrupted by signal 2; no rank had started\n"), err
    assert "Traceback" not in out + err
    assert left == []  # the fork server too, though its import never ended
    assert list((build / "logs").glob("*/0")) == []
    logs = "".join(p.read_text(errors="replace") for p in (build / "logs").rglob("*")
                   if p.is_file())
    assert "Traceback" not in logs


# Like HOLD_THE_FORK_SERVER, but the fork server is held once it has made rank 0 and
# before it tells the launcher so (os.register_at_fork runs in both processes around
# the fork), and rank 0 is held until the fork server is gone: a server stopped between
# making a rank and saying so leaves a rank that no launcher knows of.
HOLD_THE_FORK_SERVER_AFTER_A_FORK = """
import os, select, sys

def hold_the_server():
    release = os.open(RELEASE, os.O_RDONLY | os.O_NONBLOCK)
    with open(HELD, "w") as held:
        held.write("held\\n")
    select.select([release], [], [])

def hold_the_rank():
    server = os.pidfd_open(os.getppid())
    select.select([server], [], [])

if "multiprocessing.forkserver" in sys.orig_argv[-1]:
    os.register_at_fork(after_in_parent=hold_the_server, after_in_child=hold_the_rank)
"""


def test_a_rank_made_as_the_fork_server_is_stopped_dies_with_the_launcher(stuck, tmp_path):
    """A Ctrl-C while the fork server has made rank 0 but not yet said so: the launcher
    stops the server, never learns of the rank, and stops. The rank, left without the
    parent it would die with and before it asked for its parent-death signal, must not
    outlive the launcher (in its store's creation, which waits for the store's removed
    directory without letting its launcher watch run, it would for minutes)."""
    held, release = tmp_path / "held", tmp_path / "release"
    os.mkfifo(held)
    os.mkfifo(release)
    (tmp_path / "hook").mkdir()
    (tmp_path / "hook" / "sitecustomize.py").write_text(
        HOLD_THE_FORK_SERVER_AFTER_A_FORK.replace("HELD", repr(str(held))).replace(
            "RELEASE", repr(str(release))))
    build = tmp_path / "b"
    shutil.copytree(stuck, build)
    announced = os.open(held, os.O_RDONLY | os.O_NONBLOCK)
    process = start(build, "--timeout", "600",
                    env={"PYTHONPATH": f"{tmp_path / 'hook'}{os.pathsep}{ROOT}"})
    try:
        _readable(announced, process, "the fork server did not make rank 0")
        os.kill(process.pid, signal.SIGINT)
        try:
            out, err = process.communicate(timeout=DEADLINE_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"planc run was still running {DEADLINE_S:g} s after its SIGINT")
        deadline = time.monotonic() + DEADLINE_S
        while session(process.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = session(process.pid)
    finally:
        try:
            os.close(os.open(release, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass
        os.close(announced)
        kill_all(process)
    assert process.returncode == 130, err
    assert err.endswith("\nplanc: interrupted by signal 2; no rank had started\n"), err
    assert left == []
    logs = "".join(p.read_text(errors="replace") for p in (build / "logs").rglob("*")
                   if p.is_file())
    assert "Traceback" not in out + err + logs


def test_a_signal_inside_the_import_machinery_is_recorded_not_raised():
    """Python prints an exception raised in its frozen import machinery (a module lock's
    weakref callback) as "Exception ignored in ..." with a traceback, and drops it: a
    Ctrl-C 0.31 s into a run showed one (test above, on a fresh clone). Such a signal is
    recorded, and planc.cli.main acts on it when the command returns."""
    from types import SimpleNamespace

    from planc.host.interrupts import Interrupted, Interrupts

    def frame(filename):
        return SimpleNamespace(f_code=SimpleNamespace(co_filename=filename))

    interrupts = Interrupts()
    interrupts._handle(signal.SIGINT, frame("<frozen importlib._bootstrap>"))
    assert interrupts.received == signal.SIGINT
    with pytest.raises(Interrupted):
        interrupts.check()
    elsewhere = Interrupts()
    with pytest.raises(Interrupted):
        elsewhere._handle(signal.SIGTERM, frame(__file__))


def test_a_signal_that_python_wraps_in_another_exception_still_stops_the_command(
        monkeypatch, capsys):
    """Python 3.11 turns whatever a ``__set_name__`` raises into a RuntimeError: a Ctrl-C
    1.14 s into a run, while planc.plan.plan made its dataclasses, ended in that
    RuntimeError's traceback (CI, stop 45). Once a signal was received, the command ends
    with it: 128 + its number and one line."""
    from planc import cli

    class SignalsWhenNamed:
        def __set_name__(self, owner, name):
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):  # Python runs the handler between two bytecodes
                pass

    def dispatch(argv, interrupts):
        type("Made", (), {"field": SignalsWhenNamed()})
        return 0

    monkeypatch.setattr(cli, "_dispatch", dispatch)
    assert cli.main([]) == 130
    assert capsys.readouterr().err == "\nplanc: interrupted by signal 2\n"
