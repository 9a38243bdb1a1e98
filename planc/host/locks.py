"""Advisory locks on the directories a command writes: a build, a checkpoint directory.

Two runs (or a compile and a run) with the same ``-o`` or ``--checkpoint-dir`` must not
interleave: the second would replace the first one's build, logs included, or its
checkpoints, while it is still going. Each command that writes such a directory holds an
exclusive ``flock(2)`` on a lock file for as long as it uses it:

- a build directory's lock is a sibling, ``PARENT/.NAME.lock``: compiling replaces the
  directory as a whole (a rename), and a lock file inside it would go with it;
- a checkpoint directory's lock is ``D/.lock`` inside it (checkpoints are added, the
  directory stays).

The kernel releases a flock when the last descriptor of the open file is closed, so the
lock dies with its holder, even one killed with SIGKILL; the descriptor is opened with
O_CLOEXEC so that no rank started with exec inherits it (the ranks of ``planc run``
are forked from a fork server, which never had it). The holder writes its pid and
command into the file, for the message of whoever finds it locked, and removes the file
as it lets go, while it still holds the lock: whoever locked the file just before it was
removed sees that the path no longer names the file it locked, and tries again.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import stat
import time

BUILD_LOCK = ".{}.lock"  # a sibling of the build directory
DIRECTORY_LOCK = ".lock"  # inside a checkpoint directory (planc.checkpoint.format knows the name)
HOLDER_WAIT_S = 2.0  # how long to wait for a holder that has locked to write its name
MAX_HOLDER_BYTES = 4096
NAME_MAX = 255  # bytes in one file name (Linux, macOS)


class LockHeld(Exception):
    """Another process holds the lock; ``holder`` is what it wrote: "pid 1234: planc run
    ..." (or "pid unknown")."""

    def __init__(self, holder: str):
        super().__init__(holder)
        self.holder = holder


class LockError(Exception):
    """The lock file cannot be created or locked; the message says why, ``errno`` what
    the system said."""

    def __init__(self, message: str, code: int | None = None):
        super().__init__(message)
        self.errno = code


class ForeignLockFile(LockError):
    """A file that planc did not make is where the lock file goes: refused, never written."""


class Lock:
    """A held lock; ``release`` (or leaving a ``with``) removes the lock file and lets go."""

    def __init__(self, path: str, fd: int, created: list[str]):
        self.path, self._fd, self._created = path, fd, created

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            os.unlink(self.path)  # while still locked: see the module's docstring
        except OSError:
            pass
        os.close(self._fd)  # closing the last descriptor releases the flock
        self._fd = None
        for directory in reversed(self._created):  # made for the lock, and still empty
            try:
                os.rmdir(directory)
            except OSError:
                break

    def __enter__(self) -> Lock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def build_lock_path(directory: str) -> str:
    """The lock file of a build directory: a sibling, stable across its replacement. The
    directory's real path, so that two spellings of one directory share one lock."""
    real = os.path.realpath(directory)
    parent, name = os.path.split(real)
    lock = BUILD_LOCK.format(name or "root")
    if len(os.fsencode(lock)) > NAME_MAX:  # a name the compile refuses, with its reason
        lock = BUILD_LOCK.format(hashlib.sha256(os.fsencode(name)).hexdigest())
    return os.path.join(parent, lock)


def lock_build(directory: str, holder: str) -> Lock:
    """Lock the build directory ``directory`` (which may not exist yet) for ``holder``,
    a command line. Raises LockHeld or LockError."""
    return _acquire(build_lock_path(directory), holder)


def lock_beside(path: str, holder: str) -> Lock:
    """Lock a run's output file or directory (``--metrics``, ``--trace``,
    ``--tensorboard``) through a sibling lock file, as a build is locked: the output may
    be replaced by a rename, its sibling stays."""
    return _acquire(build_lock_path(path), holder)


def held_by(path: str) -> str | None:
    """Who holds ``path`` (a build or output through its sibling lock, a checkpoint
    directory through its lock inside), or None. Looked at with a shared lock taken and
    dropped at once, so that nothing is created or left behind."""
    for lock in (build_lock_path(path), os.path.join(path, DIRECTORY_LOCK)):
        try:
            fd = os.open(lock, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK |
                         getattr(os, "O_NOFOLLOW", 0))
        except OSError:  # no lock file, or none that can be opened: nobody holds it
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return _holder_of(fd)
            except OSError:
                continue
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
    return None


def lock_inside(directory: str, holder: str) -> Lock:
    """Lock ``directory`` (a checkpoint directory, created if missing, and removed again
    on release if it is then empty) through ``directory/.lock``."""
    return _acquire(os.path.join(os.path.abspath(directory), DIRECTORY_LOCK), holder)


def _acquire(path: str, holder: str) -> Lock:
    created = _make_parents(os.path.dirname(path))
    flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0)
    for _ in range(100):  # each round lost a race with a holder letting go
        try:
            fd = os.open(path, flags, 0o666)
        except FileNotFoundError:  # a holder removed the directory it had made
            created += _make_parents(os.path.dirname(path))
            continue
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # O_NOFOLLOW: a symbolic link in the file's place
                raise _foreign(path, "it is a symbolic link") from None
            if exc.errno == errno.EISDIR:  # O_RDWR on a directory in the file's place
                raise _foreign(path, "it is a directory") from None
            raise LockError(f"cannot create the lock file {path} ({_reason(exc)})",
                            exc.errno) from None
        foreign = _not_a_lock_file(fd)
        if foreign:
            os.close(fd)
            raise _foreign(path, foreign)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder_text = _holder_of(fd)
            os.close(fd)
            raise LockHeld(holder_text) from None
        except OSError as exc:
            os.close(fd)
            raise LockError(f"cannot lock {path} ({_reason(exc)})", exc.errno) from None
        if _names(path, fd):
            # What it holds is read once the lock is ours: no planc writes it then (a
            # holder truncates it before writing its record, which read before the lock
            # could catch empty-then-written or written-then-empty).
            foreign = _not_a_record(fd)
            if foreign:
                os.close(fd)
                raise _foreign(path, foreign)
            # a command line may hold file names that are not UTF-8: their bytes as they are
            record = f"pid {os.getpid()}: {holder}".encode(
                errors="surrogateescape")[:MAX_HOLDER_BYTES]
            try:
                os.ftruncate(fd, 0)
                os.pwrite(fd, record + b"\n", 0)
            except OSError:  # a full disk: the lock holds all the same, unnamed
                pass
            return Lock(path, fd, created)
        os.close(fd)  # locked a file its holder had just removed
    raise LockError(f"cannot lock {path}: it keeps being replaced")


def _make_parents(directory: str) -> list[str]:
    """Create ``directory`` and its missing parents; the ones created, outermost first."""
    missing = []
    while not os.path.isdir(directory) and directory not in missing:
        missing.append(directory)
        directory = os.path.dirname(directory)
    created = []
    for path in reversed(missing):
        try:
            os.mkdir(path)
            created.append(path)
        except FileExistsError:
            if not os.path.isdir(path):  # not one a racing holder made: the lock is not
                # made inside it (a dangling symbolic link: retried until given up)
                what = "a symbolic link to nothing" if os.path.islink(path) else \
                    "not a directory"
                raise LockError(f"cannot create {path} for its lock file (it is {what})",
                                errno.ENOTDIR) from None
        except OSError as exc:
            raise LockError(f"cannot create {path} for its lock file ({_reason(exc)})",
                            exc.errno) from None
    return created


def _names(path: str, fd: int) -> bool:
    """Whether ``path`` still names the open file ``fd``."""
    try:
        now = os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    mine = os.fstat(fd)
    return (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino)


def _foreign(path: str, why: str) -> ForeignLockFile:
    return ForeignLockFile(f"planc locks through {path}, but that file is not planc's "
                           f"({why}) and planc will not write over it: move it away")


def _not_a_lock_file(fd: int) -> str | None:
    """Why the open file ``fd`` cannot be one planc made to lock, by its kind (before it
    is locked: a named pipe is not waited on), or None: a regular file of one link (a
    hard link's other name would be destroyed with it)."""
    status = os.fstat(fd)
    if not stat.S_ISREG(status.st_mode):
        return "it is not a regular file"
    if status.st_nlink > 1:
        return "it is a hard link to another file"
    return None


def _not_a_record(fd: int) -> str | None:
    """Why the locked file ``fd`` is not one planc made (a file of someone else's, which
    truncating, writing and removing would destroy), or None: empty (just created, or
    left by a holder killed before it wrote its name) or a holder's record ("pid ...")
    of at most a record's size."""
    size = os.fstat(fd).st_size
    if size == 0:
        return None
    if size > MAX_HOLDER_BYTES + 1:
        return f"it holds {size:,} bytes, more than a lock file's record"
    try:
        head = os.pread(fd, 4, 0)
    except OSError as exc:
        return f"it cannot be read ({_reason(exc)})"
    return None if head == b"pid " else "it does not hold a planc holder's record"


def _holder_of(fd: int) -> str:
    """What the holder wrote; it writes right after it locks, so an empty file is waited
    for a moment."""
    deadline = time.monotonic() + HOLDER_WAIT_S
    while True:
        try:
            text = os.pread(fd, MAX_HOLDER_BYTES, 0).decode("utf-8", errors="replace").strip()
        except OSError:
            text = ""
        if text or time.monotonic() > deadline:
            return text or "pid unknown"
        time.sleep(0.02)


def _reason(exc: OSError) -> str:
    if exc.errno == errno.ELOOP:
        return "it is a symbolic link"
    return exc.strerror or str(exc)
