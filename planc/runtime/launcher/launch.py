"""``planc run``: start every rank of a plan on this machine, watch them, stop them together.

planc's own launcher, small on purpose (torchrun stays the way to launch on a cluster,
see planc.runtime.worker):

- **A private store, nothing beyond loopback.** The ranks meet in a torch FileStore in a
  directory of the run's logs that only this user may enter (0700), removed when the run
  ends; torch's launchers serve a TCPStore that anyone who reaches its port may use.
  gloo's listeners are bound to the loopback interface (GLOO_SOCKET_IFNAME), so nothing
  of the run listens on another one (docs/launching.md).
- **Workers are forked from a fork server** that imported torch and planc once (Python's
  ``forkserver`` start method with a preload): a world of eight starts without importing
  torch eight times. CUDA runs use spawn, since CUDA cannot be forked.
- **Workers die with the launcher.** Each asks the kernel for SIGKILL when its parent
  dies (``PR_SET_PDEATHSIG``: its parent under spawn) and watches the launcher's process
  (under the fork server, whose children keep it alive), against the start time the
  launcher read of itself, so a launcher killed with SIGKILL, even before a rank
  started, leaves no rank training; a rank whose fork server the launcher stopped before
  the rank asked for its signal is the launcher's child by then (a child subreaper), and
  dies with it. The fork server and multiprocessing's resource tracker write to
  ``launcher.log`` in the run's log directory, never to the caller's terminal or pipe.
- **One failure stops all.** When a rank exits with a non-zero status, every other rank
  is killed at once and the first failure's traceback is shown. The cause is shown
  once: the same one-line error from several ranks (which read the same bad batch) is
  copied from the first only, and the other ranks' reports of the peer they lost are
  left out for one line that names them (a rank marks where such a report begins, in
  its log). When a rank stops making progress (it reports what its streams wait for
  after ``--timeout`` seconds, also while it starts) or is stopped (SIGSTOP) for
  ``--timeout`` seconds, every other live rank is given the time to report too, then
  all are stopped.
- **Ctrl-C at any moment.** From the first line of ``planc run`` (planc.host.interrupts) a
  signal is never lost: while torch is imported and while a rank's process is made it
  is recorded and acted on right after; the wait for the fork server to answer, which
  lasts until it has imported torch, is a helper thread's, so that a signal then stops
  the launch, and the fork server, at once; ranks, and the fork server they come from,
  start with SIGINT blocked (planc.host.interrupts.blocked_in_children), so a Ctrl-C sent to
  the whole process group reaches only the launcher, which stops every rank.

Every rank's standard output and error go to ``BUILD/logs/RUN_ID/RANK/`` and are copied
to this console line by line, prefixed ``[rank R]``.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import tempfile
import time
import uuid
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable

from planc.host.interrupts import Interrupts, blocked_in_children
from planc.runtime.launcher.protocol import (EXIT_HANG, LOST_PEER_FILE, REPORT_FILE,
                                             STEPS_FILE, TRAINING_FILE)
from planc.runtime.launcher.rank_process import (PR_SET_CHILD_SUBREAPER, prctl, rank_process,
                                                 start_time, stat_fields)
from planc.runtime.launcher.rendezvous import private_store, rank_environment, remove_store
from planc.runtime.launcher.console import copy_output
from planc.runtime.launcher.reports import failure_report, hang_report, stopped_line
from planc.runtime.options import RunOptions

POLL_S = 0.05


def gpus() -> int:
    """CUDA devices on this machine (0 without CUDA). A torch built for CPUs only ships
    neither libtorch_cuda nor libtorch_hip (ROCm's): there the answer is 0 without
    importing torch, whose seconds of import would delay the fork server, which imports
    it again."""
    import importlib.util

    spec = importlib.util.find_spec("torch")
    if spec is None:
        raise ModuleNotFoundError("No module named 'torch'", name="torch")
    library = os.path.join(os.path.dirname(spec.origin or ""), "lib")
    if not any(os.path.exists(os.path.join(library, f"libtorch_{kind}.so"))
               for kind in ("cuda", "hip")):
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


# --- in the launcher --------------------------------------------------------------------


@dataclass
class _Rank:
    rank: int
    process: multiprocessing.process.BaseProcess
    log_dir: str
    offsets: dict[str, int] = field(default_factory=lambda: {"stdout": 0, "stderr": 0})
    partial: dict[str, bytes] = field(default_factory=lambda: {"stdout": b"", "stderr": b""})
    stopped_since: float | None = None
    lost_peer_at: int | None = None  # where its report of a lost peer begins in stderr.log
    errors: list[str] = field(default_factory=list)  # its one-line errors copied
    same_as: int | None = None  # the rank whose one-line error it printed too

    def reported(self) -> bool:
        """Whether the rank has reported what its streams wait for."""
        return os.path.exists(os.path.join(self.log_dir, REPORT_FILE))

    def training(self) -> bool:
        """Whether the rank has started its first step."""
        return os.path.exists(os.path.join(self.log_dir, TRAINING_FILE))

    def lost_peer(self) -> int | None:
        """Where the rank's report of a lost peer begins in its stderr.log, or None."""
        if self.lost_peer_at is None:
            try:
                with open(os.path.join(self.log_dir, LOST_PEER_FILE), encoding="utf-8") as f:
                    self.lost_peer_at = int(f.read())
            except (OSError, ValueError):
                pass
        return self.lost_peer_at

    def steps_done(self) -> int | None:
        """The steps the run had finished, as the leader last counted them (None: no
        count in this rank's log)."""
        try:
            with open(os.path.join(self.log_dir, STEPS_FILE), encoding="utf-8") as handle:
                return int(handle.read())
        except (OSError, ValueError):
            return None

    def state(self) -> str:
        """The kernel's state letter of the process ('T' when stopped), or ''."""
        try:
            return stat_fields(self.process.pid)[0].decode()
        except (OSError, IndexError):
            return ""


@dataclass(frozen=True)
class Outcome:
    """How a launch ended. ``status``: its exit status, None when ``until`` stopped it;
    ``lost``: with ``lost_devices``, the ranks whose device is taken as gone (killed by a
    signal the launcher did not send, or stopped for the timeout), which the others
    failed for; ``failed_at``: the time (time.time()) the first was seen; ``steps_done``:
    the steps the run had finished by then, as its leader counted them."""

    status: int | None
    lost: tuple[int, ...] = ()
    failed_at: float | None = None
    steps_done: int | None = None


def launch(options: RunOptions, world: int, interrupts: Interrupts | None = None) -> int:
    """Run ``world`` ranks of the worker with ``options`` (its build directory and backend
    set); 0 if every rank succeeded.
    ``interrupts``: the command's signal handlers (planc.host.interrupts); a fresh set is
    installed for the launch when none is given."""
    with (nullcontext(interrupts) if interrupts else Interrupts()) as signals:
        return _launch(options, world, signals).status


def launch_watched(options: RunOptions, world: int, interrupts: Interrupts,
                   until: Callable[[], bool] | None = None,
                   devices: tuple[int, ...] | None = None) -> Outcome:
    """:func:`launch` for planc run --on-failure replan: the ranks lost in a failure are
    named (a whole node's, killed together, within LOSS_GRACE_S of each other); ``until()``,
    asked every POLL_S, stops every rank when it turns true (status None); ``devices``: the
    GPUs rank 0, 1, ... use (CUDA_VISIBLE_DEVICES), for a world of fewer GPUs than the
    machine's."""
    return _launch(options, world, interrupts, until, devices, lost_devices=True)


def threads_per_rank(ranks: int) -> int:
    """Intra-op (OpenMP) threads for each of ``ranks`` ranks started on this machine: its
    cores shared evenly (the cores this process may run on), at least one. One thread
    for each of more ranks than cores; a 1-rank run on 2 cores gets both (with one, the
    bench's 1-rank plan took 551 ms a step, with two 315 ms: docs/launching.md). A
    user's OMP_NUM_THREADS wins."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
        (os.cpu_count() or 1)
    return max(1, cores // max(ranks, 1))


def _launch(options: RunOptions, world: int, interrupts: Interrupts,
            until: Callable[[], bool] | None = None, devices: tuple[int, ...] | None = None,
            lost_devices: bool = False) -> Outcome:
    # ranks share this machine's cores
    os.environ.setdefault("OMP_NUM_THREADS", str(threads_per_rank(world)))
    # glibc returns freed blocks above a dynamic threshold to the system and maps them
    # again on the next step: thousands of page faults per step with activations of a few
    # MB each. Keeping freed memory (as PyTorch's CUDA caching allocator does on GPUs)
    # removes them; a user's own setting wins.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(64 * 2**20))
    os.environ.setdefault("MALLOC_TRIM_THRESHOLD_", str(256 * 2**20))
    run_id = f"planc-{uuid.uuid4().hex[:8]}"
    logs = os.path.join(options.build, "logs", run_id)
    ranks: list[_Rank] = []
    # From here on a signal only sets interrupts.received: starting a process is never
    # cut in half (a rank started but not yet listed would never be stopped), and the
    # watch loop below looks at it every POLL_S.
    with interrupts.deferred(raise_at_end=False):
        store = private_store(logs)
        try:
            _start_ranks(ranks, world, logs, options, store, interrupts, devices)
            outcome = None if interrupts.received else _watch(
                ranks, options.timeout, interrupts, until, lost_devices)
            if outcome is not None:
                return outcome
            _stop(ranks)
            copy_output(ranks, lost_peers=True)
            started = any(e.process.pid is not None for e in ranks)
            print(f"\nplanc: interrupted by signal {interrupts.received}; "
                  f"{'every rank was stopped' if started else 'no rank had started'}",
                  file=sys.stderr)
            return Outcome(128 + interrupts.received)
        finally:
            _stop(ranks)
            remove_store(store)


# A Unix socket's path holds at most 107 bytes (sun_path, Linux's unix(7)); Python's fork
# server listens at TMPDIR/pymp-XXXXXXXX/listener-XXXXXXXX, 32 bytes beyond TMPDIR.
SOCKET_PATH_MAX, FORK_SERVER_SUFFIX = 107, 32


def fork_server_problem(backend: str) -> str | None:
    """Why the fork server that starts gloo ranks could not listen, before trying: a
    temporary directory too long a path for its socket (else a traceback from deep
    inside multiprocessing)."""
    if backend == "nccl":
        return None
    directory = tempfile.gettempdir()
    length = len(os.fsencode(directory))
    if length + FORK_SERVER_SUFFIX <= SOCKET_PATH_MAX:
        return None
    return (f"the temporary directory {directory} is too long a path ({length} bytes) for "
            f"the Unix socket through which the ranks are started (at most "
            f"{SOCKET_PATH_MAX - FORK_SERVER_SUFFIX} bytes): set TMPDIR to a shorter "
            f"directory; nothing was run")


def _start_ranks(ranks: list[_Rank], world: int, logs: str, options: RunOptions, store: str,
                 interrupts: Interrupts, devices: tuple[int, ...] | None = None) -> None:
    """Start every rank, listing each before it starts; stop starting at a signal."""
    method = "spawn" if options.backend == "nccl" else "forkserver"
    context = multiprocessing.get_context(method)
    me, started = os.getpid(), start_time(os.getpid())
    if method == "forkserver":
        context.set_forkserver_preload(["planc.runtime.launcher.fork_server"])
    _start_helpers(method, os.path.join(logs, "launcher.log"))
    joining = rank_environment(store)
    if devices is not None and options.backend == "nccl":  # device d: the d-th visible one
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        names = visible.split(",") if visible else [str(d) for d in range(max(devices) + 1)]
        joining["CUDA_VISIBLE_DEVICES"] = ",".join(names[d] for d in devices)
    for rank in range(world):
        if interrupts.received:
            return
        env = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": str(world), **joining}
        log_dir = os.path.join(logs, str(rank))
        process = context.Process(
            target=rank_process, name=f"planc-rank-{rank}",
            args=(rank, env, log_dir, options, me, started))
        ranks.append(_Rank(rank, process, log_dir))
        # The fork server answers once it has imported torch (its preload): the longest
        # step of the start-up, tens of seconds on a busy machine, without end if that
        # import hangs. A signal meanwhile stops it: a rank it made after the launcher
        # had stopped the others would be no one's.
        if not interrupts.wait_for(_start_rank, process, stop=_stop_fork_server):
            return


def _start_rank(process: multiprocessing.process.BaseProcess) -> None:
    """Start a rank's process with SIGINT blocked in this thread (a helper's:
    Interrupts.wait_for), for a child made here to inherit: the rank itself under spawn,
    under forkserver a fork server started again (planc.host.interrupts.blocked_in_children)."""
    with blocked_in_children(signal.SIGINT):
        process.start()


def _stop_fork_server() -> None:
    """SIGKILL the fork server, which has not answered yet: the wait for it ends at once,
    with the rank's process id if the server had made the rank (stopped then as any
    other). multiprocessing keeps the server's process id in its ForkServer object and
    has no public way to it (CPython's Lib/multiprocessing/forkserver.py); none under
    spawn."""
    from multiprocessing import forkserver

    pid = getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)
    if pid is not None:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _start_helpers(method: str, log_path: str) -> None:
    """Start multiprocessing's resource tracker and, for ``forkserver``, Python's fork
    server, with their standard output and error in ``log_path``: they outlive a killed
    launcher by the seconds the server takes to import torch, and must not hold the
    caller's terminal or pipe meanwhile (a shell pipeline around planc would wait for
    them). The tracker comes first and on its own: starting it unblocks SIGINT in this
    thread (it blocks and then unblocks the signals it ignores), which must not undo the
    block the fork server is started under."""
    from multiprocessing import forkserver, resource_tracker

    if method == "forkserver":
        _adopt_orphans()
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    target = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
    try:
        os.dup2(target, 1)
        os.dup2(target, 2)
        resource_tracker.ensure_running()
        if method == "forkserver":
            with blocked_in_children(signal.SIGINT):
                forkserver.ensure_running()
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, target):
            os.close(fd)


def _adopt_orphans() -> None:
    """Be the parent of what the fork server leaves when it dies (Linux's child subreaper,
    prctl(2)), rather than init: a rank it made just as _stop_fork_server killed it, too
    early to have asked for its parent-death signal, then asks for it with this launcher
    as its parent, and dies with it."""
    prctl(PR_SET_CHILD_SUBREAPER, 1)


def _watch(ranks: list[_Rank], timeout: float, interrupts: Interrupts,
           until: Callable[[], bool] | None = None, lost_devices: bool = False
           ) -> Outcome | None:
    """Copy output and wait until every rank is done, or one fails: a crash stops the
    world at once; a hang (a rank that reported what it waits for, or one stopped for
    ``timeout`` seconds) stops it once every other live rank has reported too, or after
    ``_reports_grace(timeout)``. None when a signal came first. With ``lost_devices``, a
    rank killed by a signal is waited on for LOSS_GRACE_S more, for the rest of its node
    (:class:`Outcome`)."""
    failed: list[_Rank] = []
    reports_due = lost_since = None
    while interrupts.received is None:
        copy_output(ranks)
        now = time.monotonic()
        for entry in ranks:
            code = entry.process.exitcode
            if code is not None and code != 0 and entry not in failed:
                failed.append(entry)
            if code is None and entry.state() in ("T", "t"):
                entry.stopped_since = entry.stopped_since or now
            elif code is None:
                entry.stopped_since = None
        crashed = [e for e in failed if e.process.exitcode != EXIT_HANG]
        # a device or host that goes away: SIGKILL (the OOM killer too) or SIGTERM; a
        # segfault or an abort is the program's, and is reported as any crash
        killed = [e.rank for e in crashed if -e.process.exitcode in LOST_SIGNALS] \
            if lost_devices else []
        if killed and lost_since is None:
            lost_since, failed_at = now, time.time()
        if crashed and not (killed and now - lost_since < LOSS_GRACE_S):
            steps = _steps_done(ranks)
            _stop(ranks)
            copy_output(ranks)  # without the others' reports of the peer they lost
            # a rank that exited with an error of its own while the others were stopped
            crashed += [e for e in ranks if e not in crashed
                        and (e.process.exitcode or 0) > 0 and e.process.exitcode != EXIT_HANG]
            # stopped here after printing their own one-line error: they failed too
            erred = [e for e in ranks
                     if e not in crashed and (e.errors or e.same_as is not None)]
            # the ranks that did not fail by themselves: stopped here, or for want of a peer
            stopped = [e for e in ranks if e not in crashed and e not in erred
                       and e.process.exitcode != 0]
            if killed:  # the others failed for want of them
                print("\n".join(f"planc: rank {r} killed by signal "
                                f"{-ranks[r].process.exitcode}: taken as lost, with its "
                                f"device" for r in sorted(killed)), file=sys.stderr)
                others = [e for e in crashed if e.rank not in killed]
                if others:  # failed by themselves: their status and traceback
                    print(failure_report(others, (), erred), file=sys.stderr)
                if stopped:
                    print(stopped_line(stopped, crashed + erred), file=sys.stderr)
                return Outcome(1, tuple(sorted(killed)), failed_at, steps)
            print(failure_report(crashed, stopped, erred), file=sys.stderr)
            return Outcome(1)
        stopped = [e for e in ranks if e.stopped_since is not None
                   and now - e.stopped_since >= timeout]
        if reports_due is None and (failed or stopped or any(e.reported() for e in ranks)):
            reports_due = now + _reports_grace(timeout)
        if reports_due is not None and not crashed:
            silent = [e for e in ranks if e.process.exitcode is None
                      and e.stopped_since is None and not e.reported()]
            if silent and now < reports_due:
                time.sleep(POLL_S)
                continue
            steps = _steps_done(ranks)
            _stop(ranks)
            copy_output(ranks, lost_peers=True)  # no rank failed: what each waited for
            print(hang_report(ranks, now, silent, _reports_grace(timeout)), file=sys.stderr)
            # a stopped rank is what the others wait for, however long it has been
            lost = tuple(e.rank for e in ranks if e.stopped_since is not None) \
                if lost_devices else ()
            return Outcome(1, lost, time.time() if lost else None, steps)
        if all(e.process.exitcode == 0 for e in ranks):
            copy_output(ranks, lost_peers=True)
            return Outcome(0)
        if until is not None and lost_since is None and until():
            _stop(ranks)
            copy_output(ranks, lost_peers=True)
            return Outcome(None, steps_done=_steps_done(ranks))
        time.sleep(POLL_S)
    return None


# How long after a rank killed by a signal the others are left running under
# --on-failure replan: the ranks of a node that went away die within it of each other, and
# are all counted lost (their peers, which lose a connection, wait PEER_LOST_GRACE_S).
LOSS_GRACE_S = 1.0
LOST_SIGNALS = (signal.SIGKILL, signal.SIGTERM)


def _steps_done(ranks: list[_Rank]) -> int | None:
    counts = [n for n in (e.steps_done() for e in ranks) if n is not None]
    return max(counts) if counts else None


def _reports_grace(timeout: float) -> float:
    """How long the other ranks may take to report once one has: each reports after
    ``timeout`` seconds without progress, counted from its own last step forward, which
    comes at most a step's work after the first's."""
    return min(timeout, 30.0) + 5.0


def _stop(ranks: list[_Rank]) -> None:
    """SIGKILL every rank still running (a stopped one too) and reap it."""
    started = [e for e in ranks if e.process.pid is not None]
    for entry in started:
        if entry.process.exitcode is None:
            try:
                os.kill(entry.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for entry in started:
        entry.process.join(timeout=10)
