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

Sample j of a run starts at token ``j * (seq + 1)``, wrapping around the file; the batch of
step k is samples ``k * batch .. (k + 1) * batch - 1`` (docs/language.md, train).

Whole-file validation reads the file in chunks of at most ``CHUNK_BYTES`` into one reused
buffer, so a 20 GiB file needs the same memory as a 20 MiB one; one step's batch reads
only that step's samples, from the file the run was checked on
(planc.runtime.data_identity). Only regular files are opened, and they are opened without
blocking, so a named pipe, a device such as ``/dev/zero``, a directory or a symbolic-link
loop is an error at once rather than a hang or an endless read.

This module imports torch only where a tensor is asked for (``batch_tokens``) or where
torch is asked to scan (``engine="torch"``): ``planc check`` uses it without torch.
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
from typing import TYPE_CHECKING

from planc.files import kind_of
from planc.runtime.data_identity import Identity, how_changed
from planc.runtime.seeds import seed_of
from planc.runtime.torch_threads import one_torch_thread

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from planc.plan import Plan

MAGIC = b"PLANCTOK"
VERSION = 1
HEADER_BYTES = 32
DTYPES = {2: "uint16", 4: "uint32"}  # token width in bytes -> its name
# What one read of a whole-file scan holds (a multiple of 4). Small enough to stay in the
# CPU's cache between the copy from the page cache and the reduction: on this project's
# 2-core test machine 4 MiB scanned 2 GiB at 3-11 GB/s, 64 MiB at 1.5-4.5 (docs/data.md).
CHUNK_BYTES = 4 << 20

_HEADER = struct.Struct("<8sII16s")
_ARRAY_CODES = {2: "H", 4: "I" if array("I").itemsize == 4 else "L"}


class DataError(ValueError):
    """A data file cannot feed a run: the message names the file and what is wrong."""


class DataMissing(DataError):
    """The data file does not exist (``planc check`` only warns: ``planc run`` needs it)."""


class DataChanged(DataError):
    """The data file is no longer the file the run began with; ``detail`` says how."""

    def __init__(self, path: str, detail: str, step: int):
        super().__init__(f"data file {path} changed during the run ({detail} at step {step}); "
                         f"nothing from step {step} on was trained or checkpointed")
        self.path, self.detail, self.step = path, detail, step


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


def write_tokens(path: str | os.PathLike, tokens, width: int = 4) -> None:
    """Write ``tokens`` (ints) as a token file: header, then little-endian ids."""
    ids = array(_ARRAY_CODES[width], tokens)
    if sys.byteorder != "little":
        ids.byteswap()
    with open(path, "wb") as out:
        out.write(header(width))
        out.write(ids.tobytes())


# --- opening -----------------------------------------------------------------------

def _not_regular(mode: int, name: str) -> DataError:
    return DataError(f"data path {name} is {kind_of(mode)}, not a regular file")


def open_tokens(path: str, name: str | None = None) -> tuple[int, TokenFile]:
    """Open a data file for reading: its descriptor and where its tokens lie.

    ``name`` is how messages show the path (``planc check`` quotes the plan's text).
    ``O_NONBLOCK`` keeps ``open`` of a named pipe from waiting for a writer (POSIX
    open(2)); it changes nothing for a regular file, the only kind accepted."""
    name = path if name is None else name
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
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
                  engine: str = "auto") -> tuple[int, int]:
    """The largest token id of the file and the position (token index after any header)
    of its first occurrence, read ``chunk_bytes`` at a time.

    ``engine`` "torch" reduces each chunk with torch (GB/s), "python" with ``array``
    (tens of MB/s; no torch needed), "auto" picks torch when it can be imported. Both read
    the file the same way and give the same answer."""
    if tokens.count == 0:
        raise ValueError("a file without tokens has no largest token")
    if engine == "auto":
        try:
            import torch  # noqa: F401
            engine = "torch"
        except ImportError:
            engine = "python"
    if engine == "torch" and sys.byteorder != "little":
        engine = "python"  # torch.frombuffer reads native order; array can byteswap
    chunk = max(tokens.width, chunk_bytes - chunk_bytes % tokens.width)
    reduce = {"torch": _TorchChunks, "python": _PythonChunks}[engine](tokens.width, chunk)
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


class _PythonChunks:
    def __init__(self, width: int, chunk: int):
        self.code = _ARRAY_CODES[width]

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


class _TorchChunks:
    """Unsigned maxima with signed tensors: torch 2.x has uint16/uint32 tensors but no
    reductions over them ("max_all" not implemented), so the bytes are read as int16/int32.
    Non-negative values are the same either way; when a chunk has negative ones (ids at or
    above 2^15 or 2^31), flipping the sign bit maps unsigned order onto signed order.

    The scan runs on one torch thread (planc.runtime.torch_threads): the copy from the
    page cache is one thread anyway, a cache-sized chunk reduces in microseconds, and
    OpenMP's barriers cost far more than they win on a busy machine (2 GiB on 2 busy
    cores: 3 GB/s on one thread, 0.7 on two).
    """

    def __init__(self, width: int, chunk: int):
        import torch

        self.torch = torch
        self.dtype = {2: torch.int16, 4: torch.int32}[width]
        self.sign = -(1 << (8 * width - 1))
        self.bias = 1 << (8 * width - 1)
        self.scratch = torch.empty(chunk // width, dtype=self.dtype)
        self.one_thread = one_torch_thread()

    def __enter__(self):
        self.one_thread.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.one_thread.__exit__(*exc)

    def _values(self, data):
        return self.torch.frombuffer(data, dtype=self.dtype)

    def largest(self, data) -> int:
        values = self._values(data)
        low, high = self.torch.aminmax(values)
        if int(low) >= 0:
            return int(high)
        flipped = self.torch.bitwise_xor(values, self.sign, out=self.scratch[:len(values)])
        return int(flipped.max()) + self.bias

    def first(self, data, value: int) -> int:
        # Block by block: nonzero() over a whole chunk of equal ids would list them all.
        values = self._values(data)
        signed = value - 2 * self.bias if value >= self.bias else value
        block = 1 << 16
        for start in range(0, len(values), block):
            hits = (values[start:start + block] == signed).nonzero()
            if len(hits):
                return start + int(hits[0])
        raise ValueError(f"{value} is not in the chunk")


def check_file(path: str, name: str | None = None, *, seq: int | None = None,
               vocab: int | None = None, scan_limit: int | None = None,
               chunk_bytes: int = CHUNK_BYTES, engine: str = "auto") -> TokenFile:
    """Check that a data file can feed a run, or raise DataError (DataMissing when it does
    not exist): a regular file, a valid header if any, whole tokens, at least one sample
    (``seq + 1`` tokens) and, for files of at most ``scan_limit`` bytes (None: any size),
    every token id below ``vocab``."""
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
            largest, position = largest_token(fd, tokens, chunk_bytes, engine)
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


def check_data(plan: Plan, chunk_bytes: int = CHUNK_BYTES) -> Identity | None:
    """The identity of the plan's data file, checked whole (None for synthetic data), or
    DataError: checked once, before any rank starts, because the file may have appeared
    or changed since planc check (which scans only files up to 16 MiB of tokens); the
    ranks then read that file and no other. Scans the whole file, in bounded memory."""
    if plan.train.data == "synthetic":
        return None
    return check_file(plan.train.data, seq=plan.model.seq, vocab=plan.model.vocab,
                      chunk_bytes=chunk_bytes).identity


def data_problem(plan: Plan, chunk_bytes: int = CHUNK_BYTES) -> str | None:
    """Why the plan's data file cannot feed a run (:func:`check_data`), or None."""
    try:
        check_data(plan, chunk_bytes)
    except DataError as exc:
        return str(exc)
    return None


def _unchanged(path: str, identity: Identity | None, step: int, info=None) -> None:
    change = how_changed(path, identity, info) if identity is not None else None
    if change is not None:
        raise DataChanged(path, change, step)


# --- one step's batch --------------------------------------------------------------


@dataclass(frozen=True)
class DataSource:
    """What the batches are drawn from: ``path`` ("synthetic" or a token file), the run's
    seed and the batch's sizes (the build's model table, or a plan's)."""

    path: str
    seed: int
    batch: int
    seq: int
    vocab: int

    @staticmethod
    def of(plan_or_table) -> "DataSource":
        """The source of a plan (its model and train blocks) or of a model table
        (planc.lower.model_table: its data, seed and sizes)."""
        if hasattr(plan_or_table, "train"):
            m, train = plan_or_table.model, plan_or_table.train
            return DataSource(train.data, train.seed, m.batch, m.seq, m.vocab)
        t = plan_or_table
        return DataSource(t.data, t.seed, t.batch, t.seq, t.vocab)


def batch_tokens(source, step: int, identity: Identity | None = None) -> torch.Tensor:
    """The global batch of ``step``: (batch, seq + 1) token ids, int64.

    From a file, sample j of the run starts at token ``j * (seq + 1)`` modulo the number
    of sample starts (``count - seq``), so the run wraps around the file; only this
    step's samples are read. Their ids are checked against vocab again, since the file
    may have changed since the run began. With ``identity`` (the file when the run
    began), a file that is not that one any more, before or after the reads, or a read
    that comes back short, raises DataChanged. ``source``: a :class:`DataSource`, or a
    plan or model table to take one from."""
    import torch

    m = source if isinstance(source, DataSource) else DataSource.of(source)
    shape = (m.batch, m.seq + 1)
    if m.path == "synthetic":
        generator = torch.Generator().manual_seed(seed_of(m.seed, "data", step))
        return torch.randint(0, m.vocab, shape, generator=generator)
    path, sample = m.path, m.seq + 1
    try:
        fd, tokens = open_tokens(path)
    except DataError as exc:
        _unchanged(path, identity, step)  # removed, or a header or size now wrong
        if isinstance(exc, DataMissing):
            raise DataError(f"data file {path} cannot be read for step {step} "
                            f"({os.strerror(errno.ENOENT)})") from None
        raise
    try:
        _unchanged(path, identity, step, os.fstat(fd))
        starts = tokens.count - sample + 1
        if starts < 1:
            raise DataError(f"data file {path} no longer holds one sample (seq + 1 = "
                            f"{sample} tokens)")
        width, rows = tokens.width, []
        for j in range(step * m.batch, (step + 1) * m.batch):
            rows.append(os.pread(fd, sample * width,
                                 tokens.offset + (j * sample) % starts * width))
            if identity is not None and len(rows[-1]) != sample * width:
                raise DataChanged(path, f"a read of {sample * width} bytes returned "
                                  f"{len(rows[-1])}", step)
        _unchanged(path, identity, step, os.fstat(fd))  # changed while it was read
    except OSError as exc:
        raise DataError(f"data file {path} cannot be read for step {step} "
                        f"({exc.strerror})") from None
    finally:
        os.close(fd)
    if any(len(row) != sample * width for row in rows):
        raise DataError(f"data file {path} no longer holds one sample (seq + 1 = "
                        f"{sample} tokens)")
    raw = bytearray(b"".join(rows))
    if sys.byteorder != "little":
        ids = array(_ARRAY_CODES[width])
        ids.frombytes(raw)
        ids.byteswap()
        raw = bytearray(ids.tobytes())
    signed = torch.frombuffer(raw, dtype={2: torch.int16, 4: torch.int32}[width])
    out = signed.to(torch.int64) & ((1 << (8 * width)) - 1)
    out = out.view(m.batch, sample)
    largest = int(out.max())
    if largest >= m.vocab:
        raise DataError(f"data file {path} holds token id {largest} in the batch "
                        f"of step {step}, not below vocab = {m.vocab}")
    return out
