"""Writing files the way every planc artifact is written: whole or not at all."""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from contextlib import contextmanager
from pathlib import Path


# The hidden temporary beside a file being replaced (:func:`replacing`); a process killed
# between writing and renaming leaves it (planc.checkpoint.format removes them).
TEMPORARY_PREFIX = ".planc-"

# What a path that is not a regular file is, for messages ("it is a named pipe (FIFO)").
KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a named pipe (FIFO)"),
         (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
         (stat.S_ISSOCK, "a socket"))


def kind_of(mode: int) -> str:
    return next((what for test, what in KINDS if test(mode)), "not a regular file")


def unwritable_ancestor(path: str | os.PathLike) -> Path | None:
    """For a directory that does not exist yet: its nearest existing ancestor when that
    is no directory this process may create entries in (so the directory cannot be
    made), else None."""
    parent = Path(path).absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        return parent
    return None


def read_regular_file(path: str | os.PathLike, limit: int, follow: bool = True) -> bytes:
    """Up to ``limit`` bytes of a regular file, refused as :func:`open_regular_file`
    refuses what is not one. A file whose size is ``limit`` or more raises OSError
    (EFBIG) unread."""
    with open_regular_file(path, follow) as handle:
        if os.fstat(handle.fileno()).st_size >= limit:  # refused without reading it
            raise OSError(errno.EFBIG, f"it is larger than {limit - 1} bytes", str(path))
        return handle.read(limit)


def append_line(handle, line: str) -> None:
    """Write ``line`` (ending in a newline) at the end of the file open as ``handle``, with
    one write(2) where the system takes it whole, so that a reader never sees a half line
    that a failure could have avoided: when the disk fills part way through, the part
    written is cut off again (a regular file; a pipe or a device keeps what it took) and
    the OSError raised."""
    handle.flush()  # what went through the file object goes first
    fd = handle.fileno()
    data = line.encode("utf-8")
    try:
        start = os.lseek(fd, 0, os.SEEK_END)
    except OSError:
        start = None  # a pipe or a terminal: nothing to cut off
    written = 0
    try:
        while written < len(data):  # a short write (a pipe, a full disk): the rest, or why not
            written += os.write(fd, data[written:])
    except OSError:
        if written and start is not None:
            try:
                os.ftruncate(fd, start)
            except OSError:
                pass  # a device: what it took is gone already
        raise


def umask() -> int:
    """The process's umask (reading it means setting it, so it is set back at once)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


NO_READER = "a named pipe that no process reads; start its reader first"


def held_pipe(path: str) -> int | None:
    """A write end of the named pipe at ``path``, opened without waiting, for the caller
    to keep open while other processes write into the pipe (planc run's ranks): its
    reader sees the end of the file only once every writer closed, so probing for it ends
    nothing, and a pipe that no process reads is found before any work (OSError ENXIO,
    :data:`NO_READER`). None where ``path`` is not a named pipe."""
    try:
        if not stat.S_ISFIFO(os.stat(path).st_mode):
            return None
    except OSError:
        return None
    try:
        return os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ENXIO:
            raise OSError(errno.ENXIO, NO_READER, path) from None
        raise


def _write_into(path: str, data: bytes) -> None:
    """Write into an existing device or named pipe (a pipe without a reader is an error,
    ENXIO, rather than a wait)."""
    try:
        fd = os.open(path, os.O_WRONLY | getattr(os, "O_NONBLOCK", 0)
                     | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        if exc.errno == errno.ENXIO and stat.S_ISFIFO(os.stat(path).st_mode):
            raise OSError(errno.ENXIO, f"it is {NO_READER}", path) from None
        raise
    try:
        os.set_blocking(fd, True)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)


def fsync_directory(path: str | os.PathLike) -> None:
    """Make a rename or a new entry in ``path`` durable (POSIX: fsync the directory)."""
    try:
        handle = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(handle)
    except OSError:
        pass  # some file systems cannot sync a directory; the rename is still atomic
    finally:
        os.close(handle)


def real_path(path: str | os.PathLike) -> str:
    """What ``path`` names once its symbolic links are followed; a link of /proc that
    names no path (/dev/stdout on a pipe: "pipe:[N]") but opens stays as it is."""
    real = os.path.realpath(path)
    if not os.path.lexists(real) and os.path.exists(path):
        return os.path.abspath(path)
    return real


def write_atomically(path: str | os.PathLike, data: bytes, durable: bool = False) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same directory and a
    rename, so a reader sees the old file or the new one, never a part; the file gets the
    permissions the umask gives a new file. A symbolic link is followed (its target is
    written); a device or a named pipe is written into, never replaced: ``-o /dev/null``
    as root must not replace /dev/null. ``durable`` (checkpoints) also fsyncs the file
    before the rename and the directory after it, so that the write survives a crash."""
    path = real_path(path)  # a symbolic link: write what it names, keep the link
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        mode = None
    if mode is not None and stat.S_ISDIR(mode):
        raise IsADirectoryError(errno.EISDIR, "is a directory", path)
    if mode is not None and not stat.S_ISREG(mode):
        _write_into(path, data)  # /dev/null, a terminal, a pipe: written, never replaced
        return
    with replacing(path, durable) as out:
        out.write(data)


def write_together(files: dict[str, bytes]) -> None:
    """Write every file of ``files`` (regular files, or none yet, at paths whose links
    are followed) each into a hidden temporary beside its place, and only once all are
    written rename them into place: a failure part way (a full disk) removes the
    temporaries and leaves every path as it was."""
    staged: list[tuple[str, str]] = []
    path = None
    try:
        for path, data in files.items():
            handle, temporary = tempfile.mkstemp(prefix=TEMPORARY_PREFIX,
                                                 dir=os.path.dirname(path))
            staged.append((temporary, path))
            with os.fdopen(handle, "wb") as out:
                out.write(data)
            os.chmod(temporary, 0o666 & ~umask())
    except BaseException as exc:
        if isinstance(exc, OSError) and exc.filename is None:
            exc.filename = path  # a full disk: the file it stopped in
        for temporary, _ in staged:
            if os.path.exists(temporary):
                os.unlink(temporary)
        raise
    for temporary, path in staged:
        os.replace(temporary, path)


@contextmanager
def replacing(path: str, durable: bool = False):
    """A binary file open for writing that replaces the regular file (or nothing) at
    ``path`` when the block ends, through a hidden temporary file beside it and a rename;
    an exception in the block (a Ctrl-C, a full disk) removes the temporary file and
    leaves ``path`` as it was. ``durable``: fsync before the rename."""
    handle, temporary = tempfile.mkstemp(prefix=TEMPORARY_PREFIX, dir=os.path.dirname(path))
    try:
        with os.fdopen(handle, "wb") as out:
            yield out
            if durable:
                out.flush()
                os.fsync(out.fileno())
        os.chmod(temporary, 0o666 & ~umask())  # mkstemp's 0600 is not what users expect
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise
    if durable:
        fsync_directory(os.path.dirname(path))


def open_regular_file(path: str | os.PathLike, follow: bool = True):
    """``path`` opened for binary reading if it is a regular file. A directory raises
    OSError EISDIR, a named pipe, a device or a socket OSError EINVAL (each with a
    strerror that says what it is) instead of blocking or reading without end;
    ``O_NONBLOCK`` keeps open(2) of a pipe from waiting for a writer. ``follow=False``: a
    symbolic link is refused too (OSError ELOOP, "it is a symbolic link"), for a file that
    must lie inside the directory that names it."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    if not follow:
        flags |= os.O_NOFOLLOW
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP and not follow and os.path.islink(path):
            raise OSError(errno.ELOOP, "it is a symbolic link", str(path)) from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            code = errno.EISDIR if stat.S_ISDIR(mode) else errno.EINVAL
            raise OSError(code, f"it is {kind_of(mode)}, not a regular file", str(path))
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
