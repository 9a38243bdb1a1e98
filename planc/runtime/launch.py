"""``planc run``: start every rank of a plan on this machine, watch them, stop them together.

planc's own launcher, small on purpose (torchrun stays the way to launch on a cluster,
see planc.runtime.worker):

- **One store, on loopback.** The launcher holds the run's TCPStore server on a socket it
  bound to 127.0.0.1 (``master_listen_fd``), and every rank joins as a client, so nothing
  of the run listens on another interface (gloo's own listeners bind to loopback too).
  torch's launchers bind their stores to every interface.
- **Workers are forked from a fork server** that imported torch and planc once (Python's
  ``forkserver`` start method with a preload): a world of eight starts without importing
  torch eight times. CUDA runs use spawn, since CUDA cannot be forked.
- **Workers die with the launcher.** Each asks the kernel for SIGKILL when its parent
  dies (``PR_SET_PDEATHSIG``: its parent under spawn) and watches the launcher's process
  (under the fork server, whose children keep it alive), so a launcher killed with
  SIGKILL leaves no rank training.
- **One failure stops all.** When a rank exits with a non-zero status, every other rank
  is killed at once and the first failure's traceback is shown; a rank stopped (SIGSTOP)
  for ``--timeout`` seconds is named and stops the run too; Ctrl-C stops every rank,
  which ignore SIGINT themselves so that only the launcher speaks.

Every rank's standard output and error go to ``BUILD/logs/RUN_ID/RANK/`` and are copied
to this console line by line, prefixed ``[rank R]``.
"""

from __future__ import annotations

import ctypes
import datetime
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field

POLL_S = 0.05
EXIT_HANG = 3  # a rank that reported what it waited for (planc.runtime.worker)
PR_SET_PDEATHSIG = 1
HANG_REPORTS_GRACE_S = 2.0  # after a rank reports a hang, the others' reports may follow


def gpus() -> int:
    """CUDA devices on this machine (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


# --- in the worker process ------------------------------------------------------------


def rank_process(rank: int, env: dict[str, str], log_dir: str, argv: list[str],
                 launcher: int) -> None:
    """The body of one rank's process: die with the launcher, leave Ctrl-C to it, send
    output to the rank's log files, run the worker and exit with its status."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.update(env)
    os.makedirs(log_dir, exist_ok=True)
    for fd, name in ((1, "stdout.log"), (2, "stderr.log")):
        target = os.open(os.path.join(log_dir, name), os.O_WRONLY | os.O_CREAT | os.O_APPEND,
                         0o644)
        os.dup2(target, fd)
        os.close(target)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    threading.Thread(target=_watch_launcher, args=(launcher,), daemon=True).start()
    from planc.runtime.worker import run_rank

    status = run_rank(argv, os.path.join(log_dir, "error.txt"))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _die_with_parent() -> None:
    """SIGKILL when the parent dies (Linux); elsewhere the launcher watch below serves."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _watch_launcher(launcher: int) -> None:
    """Exit as soon as the launcher is gone. The parent-death signal cannot serve under
    the fork server: every rank holds the server's keep-alive pipe (Python's forkserver
    sends it to each child), so the server, a rank's parent, outlives a killed launcher.
    A launcher that is a zombie, or whose pid now names another process (its start time
    differs), is gone."""
    started = _start_time(launcher)
    while True:
        if started is None:
            try:
                os.kill(launcher, 0)
            except ProcessLookupError:
                os._exit(137)
            except PermissionError:
                pass
        elif _start_time(launcher) != started:
            os._exit(137)
        time.sleep(0.5)


def _start_time(pid: int) -> str | None:
    """The process's start time from /proc (Linux), '' once it is gone or a zombie, and
    None where /proc does not exist."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            fields = handle.read().rsplit(b")", 1)[1].split()
    except FileNotFoundError:
        return "" if os.path.isdir("/proc/self") else None
    except OSError:
        return ""
    return "" if fields[0] == b"Z" else fields[19].decode()


# --- in the launcher --------------------------------------------------------------------


@dataclass
class _Rank:
    rank: int
    process: multiprocessing.process.BaseProcess
    log_dir: str
    offsets: dict[str, int] = field(default_factory=lambda: {"stdout": 0, "stderr": 0})
    partial: dict[str, bytes] = field(default_factory=lambda: {"stdout": b"", "stderr": b""})
    stopped_since: float | None = None

    def state(self) -> str:
        """The kernel's state letter of the process ('T' when stopped), or ''."""
        try:
            with open(f"/proc/{self.process.pid}/stat", "rb") as handle:
                return handle.read().rsplit(b")", 1)[1].split()[0].decode()
        except (OSError, IndexError):
            return ""


def _loopback_store(world: int):
    """A TCPStore server on a socket bound to 127.0.0.1 only, and its port."""
    from torch.distributed import TCPStore

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(max(128, 2 * world))
        port = listener.getsockname()[1]
        fd = listener.detach()  # the store owns the socket from here on, and closes it
    store = TCPStore("127.0.0.1", port, world, True, datetime.timedelta(seconds=300),
                     wait_for_workers=False, master_listen_fd=fd)
    return store, port


def launch(build_dir: str, world: int, worker_args: list[str], backend: str,
           timeout: float = 120.0) -> int:
    """Run ``world`` ranks of the worker on ``build_dir``; 0 if every rank succeeded."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # ranks share this machine's cores
    # glibc returns freed blocks above a dynamic threshold to the system and maps them
    # again on the next step: thousands of page faults per step with activations of a few
    # MB each. Keeping freed memory (as PyTorch's CUDA caching allocator does on GPUs)
    # removes them; a user's own setting wins.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(64 * 2**20))
    os.environ.setdefault("MALLOC_TRIM_THRESHOLD_", str(256 * 2**20))
    run_id = f"planc-{uuid.uuid4().hex[:8]}"
    logs = os.path.join(build_dir, "logs", run_id)
    store, port = _loopback_store(world)
    method = "spawn" if backend == "nccl" else "forkserver"
    context = multiprocessing.get_context(method)
    if method == "forkserver":
        context.set_forkserver_preload(["planc.runtime.worker"])
    ranks: list[_Rank] = []
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        for rank in range(world):
            env = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                   "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(port), "PLANC_STORE": f"127.0.0.1:{port}"}
            log_dir = os.path.join(logs, str(rank))
            process = context.Process(
                target=rank_process, name=f"planc-rank-{rank}",
                args=(rank, env, log_dir, [build_dir, "--backend", backend, *worker_args],
                      os.getpid()))
            process.start()
            ranks.append(_Rank(rank, process, log_dir))
        return _watch(ranks, timeout)
    except (KeyboardInterrupt, _Terminated) as interrupt:
        _stop(ranks)
        _copy_output(ranks)
        number = 15 if isinstance(interrupt, _Terminated) else 2
        print(f"\nplanc: interrupted by signal {number}; every rank was stopped",
              file=sys.stderr)
        return 128 + number
    finally:
        signal.signal(signal.SIGTERM, previous)
        _stop(ranks)
        del store


class _Terminated(Exception):
    """SIGTERM reached the launcher: stop every rank, as for Ctrl-C."""


def _terminated(signum, frame) -> None:
    raise _Terminated()


def _watch(ranks: list[_Rank], timeout: float) -> int:
    """Copy output and wait until every rank is done, or the first one fails."""
    failed: list[_Rank] = []
    hang_reported_at = None
    while True:
        _copy_output(ranks)
        now = time.monotonic()
        for entry in ranks:
            code = entry.process.exitcode
            if code is not None and code != 0 and entry not in failed:
                failed.append(entry)
            if code is None and entry.state() in ("T", "t"):
                entry.stopped_since = entry.stopped_since or now
            elif code is None:
                entry.stopped_since = None
        stopped = [e for e in ranks if e.stopped_since is not None
                   and now - e.stopped_since >= timeout]
        if stopped:
            _stop(ranks)
            _copy_output(ranks)
            for entry in stopped:
                print(f"planc: rank {entry.rank} was stopped (by SIGSTOP or a debugger) for "
                      f"{timeout:g} s; the run was stopped", file=sys.stderr)
            return 1
        if failed:
            # a hang is reported by every rank that waits: let the others print theirs
            if all(e.process.exitcode == EXIT_HANG for e in failed):
                hang_reported_at = hang_reported_at or now
                if now - hang_reported_at < HANG_REPORTS_GRACE_S and any(
                        e.process.exitcode is None for e in ranks):
                    time.sleep(POLL_S)
                    continue
            _stop(ranks)
            _copy_output(ranks)
            print(_failure_report(failed), file=sys.stderr)
            return 1
        if all(e.process.exitcode == 0 for e in ranks):
            _copy_output(ranks)
            return 0
        time.sleep(POLL_S)


def _stop(ranks: list[_Rank]) -> None:
    """SIGKILL every rank still running (a stopped one too) and reap it."""
    for entry in ranks:
        if entry.process.exitcode is None:
            try:
                os.kill(entry.process.pid, signal.SIGKILL)
            except (ProcessLookupError, TypeError):
                pass
    for entry in ranks:
        entry.process.join(timeout=10)


def _copy_output(ranks: list[_Rank]) -> None:
    """New complete lines of every rank's output, to this console with ``[rank R]``."""
    for entry in ranks:
        for stream, console in (("stdout", sys.stdout), ("stderr", sys.stderr)):
            path = os.path.join(entry.log_dir, f"{stream}.log")
            try:
                with open(path, "rb") as handle:
                    handle.seek(entry.offsets[stream])
                    data = handle.read()
            except OSError:
                continue
            if not data:
                continue
            entry.offsets[stream] += len(data)
            data = entry.partial[stream] + data
            *lines, entry.partial[stream] = data.split(b"\n")
            if entry.process.exitcode is not None and entry.partial[stream]:
                lines.append(entry.partial[stream])
                entry.partial[stream] = b""
            for line in lines:
                console.write(f"[rank {entry.rank}] "
                              f"{line.decode('utf-8', errors='replace')}\n")
            console.flush()


def _failure_report(failed: list[_Rank]) -> str:
    lines = []
    for entry in sorted(failed, key=lambda e: e.rank):
        code = entry.process.exitcode
        if code == EXIT_HANG:
            what = "stopped after reporting what it waited for (above)"
        elif code is not None and code < 0:
            what = f"killed by signal {-code}"
        else:
            what = f"exited with status {code}"
        lines.append(f"planc: rank {entry.rank} {what}")
    first = failed[0]
    try:
        with open(os.path.join(first.log_dir, "error.txt"), encoding="utf-8",
                  errors="replace") as handle:
            trace = handle.read().rstrip()
    except OSError:
        trace = ""
    if first.process.exitcode != EXIT_HANG and trace:
        lines.append(f"planc: traceback of rank {first.rank}, the first to fail:")
        lines.append(trace)
    return "\n".join(lines)
