"""Token files: the format behind ``train { data = "..." }`` and reading it in bounded memory.

A token file is a flat array of little-endian unsigned token ids, optionally preceded by
a 32-byte header that names the width of a token (docs/data.md):

    offset  size  field
         0     8  magic b"PLANCTOK"
         8     4  version, uint32 little-endian: 1
        12     4  token width in bytes, uint32 little-endian: 2 (uint16) or 4 (uint32)
        16    16  reserved, zero in version 1

A file that does not begin with the magic is raw uint16, the layout nanoGPT's
``prepare.py`` writes (``np.memmap(..., dtype=np.uint16)``), so such files keep working
unchanged. uint32 is for vocabularies beyond 65,536 ids (Llama 3 has 128,256); it needs
the header, since the bytes alone cannot say which width they hold. The header is
fixed-size and aligned to 32 bytes so that token j of either width stays naturally
aligned at ``32 + j * width``. Like llm.c's token files (a magic, a version and the token
type in a fixed header) and Megatron's ``.idx`` (magic, version, dtype code), the width
travels with the data instead of with each plan that names it.

Whole-file validation reads the file in chunks of at most ``CHUNK_BYTES`` into one reused
buffer, so a 20 GiB file needs the same memory as a 20 MiB one. Only regular files are opened, and they are opened without
blocking, so a named pipe, a device such as ``/dev/zero``, a directory or a symbolic-link
loop is an error at once rather than a hang or an endless read.

No torch here (``planc check`` reads token files with this module alone): a whole-file
scan reduces each chunk with ``array`` unless given another reducer (planc.runtime.engine.data
passes torch's, GB/s); planc.runtime.engine.data reads one step's batch into a tensor.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import stat
import struct
import sys
from array import array
from dataclasses import dataclass

from planc.data import megatron
from planc.data.identity import Identity
from planc.host.files import kind_of

MAGIC = b"PLANCTOK"
VERSION = 1
HEADER_BYTES = 32
DTYPES = {2: "uint16", 4: "uint32"}  # token width in bytes -> its name
# What one read of a whole-file scan holds (a multiple of 4). Small enough to stay in the
# CPU's cache between the copy from the page cache and the reduction: on this project's
# 2-core test machine 4 MiB scanned 2 GiB at 3-11 GB/s, 64 MiB at 1.5-4.5 (docs/data.md).
CHUNK_BYTES = 4 << 20
# The largest file that planc check and planc run read whole (every id below vocab) before
# anything runs: tens of ms in Python, about 10 in torch. A larger file is checked as each
# step reads its samples (planc.runtime.engine.data.batch_tokens), so a 100 GB file starts at once.
SCAN_LIMIT = 16 << 20

_HEADER = struct.Struct("<8sII16s")
# Reading a data file: O_NONBLOCK keeps open(2) of a named pipe from waiting for a writer
READ_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
ARRAY_CODES = {2: "H", 4: "I" if array("I").itemsize == 4 else "L"}


class DataError(ValueError):
    """A data file cannot feed a run: the message names the file and what is wrong."""


class DataMissing(DataError):
    """The data file does not exist (``planc check`` only warns: ``planc run`` needs it)."""


class DataChanged(DataError):
    """The data file is no longer the file the run began with; ``detail`` says how.
    ``step`` read it, or, with ``evaluation`` (the training step, counted from 1, after
    which an evaluation ran), that evaluation's batch ``step`` did: the training steps up
    to it were trained, and the checkpoints before it written."""

    def __init__(self, path: str, detail: str, step: int, evaluation: int | None = None):
        if evaluation is None:
            text = (f"data file {path} changed during the run ({detail} at step {step}); "
                    f"nothing from step {step} on was trained or checkpointed")
        else:
            text = (f"eval_data file {path} changed during the run ({detail} when the "
                    f"evaluation after step {evaluation} read its batch {step}); steps 1 to "
                    f"{evaluation} were trained and the checkpoints before step {evaluation} "
                    f"written as asked; nothing from step {evaluation}'s evaluation on was "
                    f"recorded or checkpointed")
        super().__init__(text)
        self.path, self.detail, self.step, self.evaluation = path, detail, step, evaluation


@dataclass(frozen=True)
class TokenFile:
    """Where the tokens of an open data file lie: ``count`` tokens of ``width`` bytes from
    byte ``offset`` (0 for a raw uint16 file, ``HEADER_BYTES`` after a header), and the
    file's identity when it was opened."""

    path: str
    size: int  # bytes, header included
    offset: int
    width: int
    identity: Identity | None = None

    @property
    def count(self) -> int:
        return (self.size - self.offset) // self.width

    @property
    def dtype(self) -> str:
        return DTYPES[self.width]


def header(width: int) -> bytes:
    """The 32 bytes that begin a token file of ``width``-byte tokens."""
    if width not in DTYPES:
        raise ValueError(f"a token is 2 or 4 bytes wide, not {width}")
    return _HEADER.pack(MAGIC, VERSION, width, bytes(16))


def token_bytes(tokens, width: int = 4) -> bytes:
    """``tokens`` (ints) as a token file's bytes: header, then little-endian ids."""
    ids = array(ARRAY_CODES[width], tokens)
    if sys.byteorder != "little":
        ids.byteswap()
    return header(width) + ids.tobytes()


def write_tokens(path: str | os.PathLike, tokens, width: int = 4) -> None:
    """Write ``tokens`` (ints) as a token file: header, then little-endian ids."""
    with open(path, "wb") as out:
        out.write(token_bytes(tokens, width))


# --- opening -----------------------------------------------------------------------

def _not_regular(mode: int, name: str) -> DataError:
    return DataError(f"data path {name} is {kind_of(mode)}, not a regular file")


def open_tokens(path: str, name: str | None = None) -> tuple[int, TokenFile]:
    """Open a data file for reading: its descriptor and where its tokens lie.

    ``name`` is how messages show the path (``planc check`` quotes the plan's text).
    ``O_NONBLOCK`` keeps ``open`` of a named pipe from waiting for a writer (POSIX
    open(2)); it changes nothing for a regular file, the only kind accepted."""
    name = path if name is None else name
    pair = megatron.pair_of(path)
    if pair is not None:
        return _open_megatron(*pair, name)
    try:
        fd = os.open(path, READ_FLAGS)
    except OSError as exc:
        raise _open_error(exc, path, name) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise _not_regular(info.st_mode, name)
        try:
            return fd, dataclasses.replace(_layout(fd, path, info.st_size, name),
                                           identity=Identity.of(info))
        except OSError as exc:  # /proc/self/mem, a failing disk
            raise DataError(f"data file {name} cannot be read ({exc.strerror})") from None
    except BaseException:
        os.close(fd)
        raise


def _open_megatron(bin_path: str, idx_path: str, name: str) -> tuple[int, TokenFile]:
    """A Megatron-LM indexed dataset (planc.data.megatron): its ``.bin`` as the token
    stream, once its ``.idx`` has been checked against it."""
    what = f"data file {name} (a Megatron dataset)"
    try:
        fd = os.open(bin_path, READ_FLAGS)
    except OSError as exc:
        reason = "does not exist" if exc.errno == errno.ENOENT else f"cannot be opened " \
            f"({exc.strerror})"
        raise DataError(f"{what}: its .bin {reason}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise DataError(f"{what}: its .bin is {kind_of(info.st_mode)}, not a regular file")
        try:
            width, _ = megatron.check_index(idx_path, info.st_size, SCAN_LIMIT)
        except megatron.IndexDamage as exc:
            raise DataError(f"{what}: its .idx {exc}") from None
        except OSError as exc:
            raise DataError(f"{what}: its .idx cannot be read ({exc.strerror})") from None
        return fd, TokenFile(bin_path, info.st_size, 0, width, Identity.of(info))
    except BaseException:
        os.close(fd)
        raise


def _open_error(exc: OSError, path: str, name: str) -> DataError:
    if exc.errno == errno.ENOENT:
        return DataMissing(f"data file {name} does not exist")
    if exc.errno == errno.ELOOP:
        return DataError(f"data path {name} is a loop of symbolic links")
    try:  # a socket (ENXIO) or a directory on a system that refuses to open one
        mode = os.stat(path).st_mode
    except OSError:
        mode = None
    if mode is not None and not stat.S_ISREG(mode):
        return _not_regular(mode, name)
    return DataError(f"data file {name} cannot be opened ({exc.strerror})")


def _layout(fd: int, path: str, size: int, name: str) -> TokenFile:
    start = os.pread(fd, HEADER_BYTES, 0)
    if not start.startswith(MAGIC):
        if size % 2:
            raise DataError(f"data file {name} has an odd size ({size} bytes); expected "
                            f"little-endian uint16 tokens")
        return TokenFile(path, size, 0, 2)
    if len(start) < HEADER_BYTES:
        raise DataError(f"data file {name} begins with the {MAGIC.decode()} header but is only "
                        f"{size} bytes long; the header alone is {HEADER_BYTES}")
    _, version, width, reserved = _HEADER.unpack(start)
    if version != VERSION:
        raise DataError(f"data file {name} has a {MAGIC.decode()} header of version {version}; "
                        f"this planc reads version {VERSION}")
    if width not in DTYPES:
        raise DataError(f"data file {name} has a {MAGIC.decode()} header with a token width "
                        f"of {width} bytes; expected 2 (uint16) or 4 (uint32)")
    if any(reserved):
        raise DataError(f"data file {name} has a {MAGIC.decode()} header whose reserved bytes "
                        f"16..31 are not zero")
    if (size - HEADER_BYTES) % width:
        raise DataError(f"data file {name} holds {size - HEADER_BYTES} bytes after its header, "
                        f"not a whole number of {DTYPES[width]} tokens ({width} bytes each)")
    return TokenFile(path, size, HEADER_BYTES, width)


# --- whole-file scans --------------------------------------------------------------


def largest_token(fd: int, tokens: TokenFile, chunk_bytes: int = CHUNK_BYTES,
                  reducer: type | None = None) -> tuple[int, int]:
    """The largest token id of the file and the position (token index after any header)
    of its first occurrence, read ``chunk_bytes`` at a time.

    ``reducer`` reduces each chunk: :class:`PythonChunks` (``array``, tens of MB/s, the
    default) or another with its methods (planc.runtime.engine.data's torch reducer, GB/s).
    Every reducer reads the file the same way and gives the same answer."""
    if tokens.count == 0:
        raise ValueError("a file without tokens has no largest token")
    chunk = max(tokens.width, chunk_bytes - chunk_bytes % tokens.width)
    reduce = (reducer or PythonChunks)(tokens.width, chunk)
    with reduce:
        best, best_chunk = -1, (0, tokens.offset)
        for index, start, data in _chunks(fd, tokens, chunk):
            largest = reduce.largest(data)
            if largest > best:  # strictly: the first chunk holding the maximum wins
                best, best_chunk = largest, (index, start)
        index, start = best_chunk
        length = min(chunk, tokens.size - start)
        data = memoryview(_read_exactly(fd, start, length, tokens))
        try:
            position = reduce.first(data, best)
        except ValueError:  # the chunk was rewritten between the two reads
            raise DataError(f"data file {tokens.path} changed while it was being read") \
                from None
        return best, index * (chunk // tokens.width) + position


def _chunks(fd: int, tokens: TokenFile, chunk: int):
    """(index, byte offset, bytes) of each chunk, all read into one reused buffer."""
    buffer = bytearray(min(chunk, tokens.size - tokens.offset))
    view = memoryview(buffer)
    start, index = tokens.offset, 0
    while start < tokens.size:
        length = min(chunk, tokens.size - start)
        _read_into(fd, view[:length], start, tokens)
        yield index, start, view[:length]
        start += length
        index += 1


def _read_into(fd: int, view: memoryview, start: int, tokens: TokenFile) -> None:
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], start + done)
        if got == 0:
            raise DataError(f"data file {tokens.path} shrank while it was being read")
        done += got


def _read_exactly(fd: int, start: int, length: int, tokens: TokenFile) -> bytearray:
    out = bytearray(length)
    _read_into(fd, memoryview(out), start, tokens)
    return out


class PythonChunks:
    """Chunk maxima with ``array``: no torch needed."""

    def __init__(self, width: int, chunk: int):
        self.code = ARRAY_CODES[width]

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass

    def _ids(self, data) -> array:
        ids = array(self.code)
        ids.frombytes(data)
        if sys.byteorder != "little":
            ids.byteswap()
        return ids

    def largest(self, data) -> int:
        return max(self._ids(data))

    def first(self, data, value: int) -> int:
        return self._ids(data).index(value)


def check_file(path: str, name: str | None = None, *, seq: int | None = None,
               vocab: int | None = None, scan_limit: int | None = None,
               chunk_bytes: int = CHUNK_BYTES, reducer: type | None = None) -> TokenFile:
    """Check that a data file can feed a run, or raise DataError (DataMissing when it does
    not exist): a regular file, a valid header if any, whole tokens, at least one sample
    (``seq + 1`` tokens) and, for files of at most ``scan_limit`` bytes (None: any size),
    every token id below ``vocab`` (scanned with ``reducer``, :func:`largest_token`)."""
    fd, tokens = open_tokens(path, name)
    name = path if name is None else name
    try:
        if seq is not None and tokens.count < seq + 1:
            raise DataError(f"data file {name} holds {tokens.count} tokens, fewer than one "
                            f"sample (seq + 1 = {seq + 1})")
        if vocab is None or tokens.count == 0 or (scan_limit is not None
                                                  and tokens.size > scan_limit):
            return tokens
        try:
            largest, position = largest_token(fd, tokens, chunk_bytes, reducer)
        except OSError as exc:  # /proc/self/mem, a failing disk
            raise DataError(f"data file {name} cannot be read ({exc.strerror})") from None
        if largest >= vocab:
            raise DataError(f"data file {name} holds token id {largest} (token {position} "
                            f"of the file), not below vocab = {vocab}")
        if Identity.of(os.fstat(fd)) != tokens.identity:  # what was scanned is not the file
            raise DataError(f"data file {name} changed while it was being read")
        return tokens
    finally:
        os.close(fd)
