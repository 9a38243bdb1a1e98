"""Ctrl-C and SIGTERM for planc's commands: every one stops the command, none is lost.

Python turns SIGINT into KeyboardInterrupt wherever the main thread happens to be, and
some code swallows it: torch's import of numpy catches any exception the import raises
and carries on (a Ctrl-C in the first seconds of ``planc run`` was ignored, and the run
trained to the end with status 0). So the command line installs :class:`Interrupts`:
a signal raises :class:`Interrupted` at once, except inside :meth:`Interrupts.deferred`
sections (imports of torch, starting and watching ranks), where it is recorded and acted
on when the section ends or when the code there looks (``received``). Code that looks must
never wait where it cannot look: a wait on another process that is slow to answer goes
through :meth:`Interrupts.wait_for`. The first signal wins; later ones change nothing, so
a second Ctrl-C cannot interrupt the clean-up of the first.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager

SIGNALS = (signal.SIGINT, signal.SIGTERM)
WAIT_POLL_S = 0.05  # how often Interrupts.wait_for looks at a signal
STOPPED_WAIT_S = 10.0  # for a call whose wait Interrupts.wait_for has stopped


class Interrupted(BaseException):
    """A signal stopped the command. A BaseException, as KeyboardInterrupt is, so that no
    ``except Exception`` on the way up mistakes it for an error it can handle."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum

    @property
    def status(self) -> int:
        """The shell's convention for a process stopped by a signal: 128 + its number."""
        return 128 + self.signum


class Interrupts:
    """The SIGINT and SIGTERM handlers of one command, installed by ``with``."""

    def __init__(self) -> None:
        self.received: int | None = None  # the first signal's number
        self._deferring = 0
        self._previous: dict[int, object] = {}

    def __enter__(self) -> Interrupts:
        if threading.current_thread() is threading.main_thread():  # signal.signal's rule
            for number in SIGNALS:
                self._previous[number] = signal.signal(number, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        if self.received is not None:
            return
        self.received = signum
        if not self._deferring and not _inside_import_machinery(frame):
            raise Interrupted(signum)

    @contextmanager
    def deferred(self, raise_at_end: bool = True):
        """Record signals instead of raising them; at the end of the outermost section,
        raise the one received (unless ``raise_at_end`` is false: the section's code
        looks at ``received`` itself)."""
        self._deferring += 1
        try:
            yield self
        finally:
            self._deferring -= 1
        if raise_at_end and not self._deferring and self.received is not None:
            raise Interrupted(self.received)

    def wait_for(self, call, *args, stop=None) -> bool:
        """Run ``call(*args)`` in a helper thread and wait for it here, looking at
        ``received``: True once it returned (what it raised is raised here), False when a
        signal came first. Then ``stop()`` is to end the wait inside ``call`` (by stopping
        the process it waits on), and the call has STOPPED_WAIT_S to end, what it raises
        ignored: its effects are whole when this returns. Without ``stop``, or past that,
        the call is left to its thread, a daemon, which does not keep the process alive.

        A wait in the main thread cannot serve: Python runs signal handlers in the main
        thread only, between bytecodes, and a system call (a pipe's read) is cut short
        only in the thread the kernel delivers the signal to, not at all while that thread
        blocks it (signal(7)), so a main thread waiting in C for a child that is slow to
        answer would hold a Ctrl-C back for as long as the child takes."""
        raised: list[BaseException] = []

        def run() -> None:
            try:
                call(*args)
            except BaseException as exc:  # noqa: BLE001 - raised again in the waiting thread
                raised.append(exc)

        helper = threading.Thread(target=run, daemon=True,
                                  name=f"planc-{getattr(call, '__name__', 'wait')}")
        helper.start()
        while helper.is_alive():
            if self.received is not None:
                if stop is not None:
                    stop()
                    helper.join(STOPPED_WAIT_S)
                return False
            helper.join(WAIT_POLL_S)
        if raised:
            raise raised[0]
        return True

    def check(self) -> None:
        """Raise the signal received, if any (at a point where stopping is safe)."""
        if self.received is not None:
            raise Interrupted(self.received)


def _inside_import_machinery(frame) -> bool:
    """Whether the signal arrived while Python's frozen import machinery ran (a module
    lock's weakref callback, say): an exception raised there is printed as "Exception
    ignored in ..." with a traceback and then dropped, so the signal is only recorded;
    the command line acts on it when the command returns (planc.cli.main)."""
    return frame is not None and frame.f_code.co_filename.startswith("<frozen ")


@contextmanager
def blocked_in_children(*numbers: int):
    """Block signals in this thread while child processes are made: a child inherits the
    mask through fork and exec, so a Ctrl-C sent to the whole process group (a
    terminal's) reaches this process alone, which stops the children itself; a child
    interrupted in the middle of its imports would only print a traceback. A signal sent
    to this process meanwhile arrives when the block ends."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, numbers or (signal.SIGINT,))
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)

