"""Writing files the way every planc artifact is written: whole or not at all."""

from __future__ import annotations

import errno
import os
import stat
import tempfile


def read_regular_file(path: str | os.PathLike, limit: int) -> bytes:
    """Up to ``limit`` bytes of a regular file. A named pipe, a device, a socket or a
    directory raises OSError (EINVAL, with a strerror that says what it is) instead of
    blocking or reading without end; ``O_NONBLOCK`` keeps open(2) of a pipe from waiting
    for a writer."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = ("a directory" if stat.S_ISDIR(mode) else "a named pipe"
                    if stat.S_ISFIFO(mode) else "a device" if stat.S_ISCHR(mode) or
                    stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode) else
                    "not a file")
            raise OSError(errno.EINVAL, f"it is {kind}, not a regular file", str(path))
        chunks, left = [], limit
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def umask() -> int:
    """The process's umask (reading it means setting it, so it is set back at once)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_atomically(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same directory and a
    rename, so a reader sees the old file or the new one, never a part; the file gets the
    permissions the umask gives a new file."""
    directory = os.path.dirname(os.path.abspath(path))
    handle, temporary = tempfile.mkstemp(prefix=".planc-", dir=directory)
    try:
        with os.fdopen(handle, "wb") as out:
            out.write(data)
        os.chmod(temporary, 0o666 & ~umask())  # mkstemp's 0600 is not what users expect
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise
