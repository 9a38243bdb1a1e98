"""The rank's side of planc run's launcher (planc.runtime.launcher.launch): the body of a
rank's process, which dies with the launcher, leaves Ctrl-C to it and writes its output
to the rank's log files; and the process facts both sides read (a process's start time,
Linux's prctl)."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

from planc.runtime.engine.host_memory import keep_freed_memory
from planc.runtime.options import RunOptions

PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 1, 36  # prctl(2)


def rank_process(rank: int, env: dict[str, str], log_dir: str, options: RunOptions,
                 launcher: int, launcher_started: str | None) -> None:
    """The body of one rank's process: die with the launcher, leave Ctrl-C to it, send
    output to the rank's log files, run the worker and exit with its status. SIGINT is
    already blocked here (inherited from the launcher: planc.host.interrupts.blocked_in_children),
    so a Ctrl-C sent to the whole process group cannot reach a rank before it ignores it."""
    # Before this process's first thread: a thread that allocates before glibc is told
    # to keep one arena gets an arena of its own, and the stream threads then share it
    # (planc.runtime.engine.host_memory).
    keep_freed_memory()
    _die_with_parent()
    if _launcher_gone(launcher, launcher_started):  # before that signal could serve
        os._exit(137)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # planc run's own signal (--on-failure replan: the devices are back), also when it is
    # sent to the whole process group
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    threading.Thread(target=_watch_launcher, args=(launcher, launcher_started),
                     daemon=True).start()
    os.environ.update(env)
    os.makedirs(log_dir, exist_ok=True)
    for fd, name in ((1, "stdout.log"), (2, "stderr.log")):
        target = os.open(os.path.join(log_dir, name), os.O_WRONLY | os.O_CREAT | os.O_APPEND,
                         0o644)
        os.dup2(target, fd)
        os.close(target)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    from planc.runtime.worker import run_rank

    status = run_rank(options, log_dir)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _die_with_parent() -> None:
    """SIGKILL when the parent dies (Linux); elsewhere the launcher watch below serves.
    The parent is the one at the time it dies: a rank whose fork server was stopped
    before it got here is the launcher's by then (_adopt_orphans)."""
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def prctl(option: int, value: int) -> None:
    """Linux's prctl(2); nothing elsewhere."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(option, value, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _watch_launcher(launcher: int, started: str | None) -> None:
    """Exit as soon as the launcher is gone. The parent-death signal cannot serve under
    the fork server: every rank holds the server's keep-alive pipe (Python's forkserver
    sends it to each child), so the server, a rank's parent, outlives a killed launcher.
    ``started`` is the launcher's start time as the launcher itself read it, so a
    launcher already gone when the rank starts (killed while the fork server was still
    importing torch) is seen as gone at once; a zombie, or a pid that now names another
    process (another start time), is gone too."""
    while not _launcher_gone(launcher, started):
        time.sleep(0.5)
    os._exit(137)


def _launcher_gone(launcher: int, started: str | None) -> bool:
    if started is None:  # no /proc: only whether the pid exists
        try:
            os.kill(launcher, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass
        return False
    return start_time(launcher) != started


def stat_fields(pid: int) -> list[bytes]:
    """The fields of /proc/PID/stat after the command name, which may hold spaces and
    parentheses (proc(5)): the state first; OSError where it cannot be read."""
    with open(f"/proc/{pid}/stat", "rb") as handle:
        return handle.read().rsplit(b")", 1)[1].split()


def start_time(pid: int) -> str | None:
    """The process's start time from /proc (Linux), '' once it is gone or a zombie, and
    None where /proc does not exist."""
    try:
        fields = stat_fields(pid)
    except FileNotFoundError:
        return "" if os.path.isdir("/proc/self") else None
    except OSError:
        return ""
    return "" if fields[0] == b"Z" else fields[19].decode()
