"""Megatron-LM's indexed datasets, read as they are: ``train { data = "PREFIX" }`` with
``PREFIX.bin`` and ``PREFIX.idx`` beside each other (or either file named).

The layout is Megatron-Core's (``megatron/core/datasets/indexed_dataset.py``, written by
``tools/preprocess_data.py``). The ``.bin`` holds every sequence's token ids one after the
other, in the index's dtype; the ``.idx`` describes them:

    offset         size   field
         0            9   magic b"MMIDIDX\\x00\\x00"
         9            8   version, uint64 little-endian: 1
        17            1   dtype code: 8 uint16, 4 int32 (also 1 uint8, 2 int8, 3 int16,
                          5 int64, 6 float64, 7 float32, which hold no token file planc reads)
        18            8   S, the number of sequences, uint64
        26            8   D, the number of document indices, uint64
        34        4 * S   each sequence's length in tokens, int32
    34 + 4S       8 * S   each sequence's byte offset in the .bin, int64
    34 + 12S      8 * D   the document indices: the sequence each document starts at, from 0,
                          non-decreasing, the last S
    (34 + 12S + 8D  S     each sequence's mode, int8: multimodal datasets only)

Since the sequences lie end to end, the ``.bin`` is a flat token stream, which planc cuts
into samples as it does a token file (docs/data.md): uint16 ids as they are, int32 ids as
uint32 (an id cannot be negative: one is refused as too large for the vocabulary). An
``.idx`` is untrusted input: its magic, version, dtype, its size against its counts, and,
for an index of at most ``scan_limit`` bytes (planc.data.tokens.SCAN_LIMIT), every
length, offset and document index, so that a damaged pair is one line naming what is
wrong, never a traceback or a wrong read.
"""

from __future__ import annotations

import errno
import os
import struct
import sys
from array import array

from planc.host.files import open_regular_file

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER = struct.Struct("<9sQBQQ")
WIDTHS = {8: 2, 4: 4}  # dtype code -> token width: uint16, int32 (read as uint32)
DTYPE_NAMES = {1: "uint8", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 6: "float64",
               7: "float32", 8: "uint16"}


class IndexDamage(ValueError):
    """A Megatron index that cannot describe its ``.bin`` (planc.data.tokens turns it into
    a DataError naming the files)."""


def pair_of(path: str) -> tuple[str, str] | None:
    """(.bin, .idx) when ``path`` names a Megatron dataset: its ``.idx``, its ``.bin``
    with an ``.idx`` beside it, or the prefix of both; None otherwise (a ``.bin`` alone
    is nanoGPT's raw uint16 file)."""
    if path.endswith(".idx"):
        return path[:-4] + ".bin", path
    if path.endswith(".bin") and os.path.exists(path[:-4] + ".idx"):
        return path, path[:-4] + ".idx"
    if not os.path.lexists(path) and os.path.exists(path + ".idx"):
        return path + ".bin", path + ".idx"
    return None


def stream_path(path: str) -> str:
    """The file whose bytes are the tokens ``path`` names: a Megatron dataset's ``.bin``,
    or ``path`` itself."""
    pair = pair_of(path)
    return path if pair is None else pair[0]


def _ints(code: str, data: bytes) -> array:
    values = array(code)
    values.frombytes(data)
    if sys.byteorder != "little":
        values.byteswap()
    return values


def check_index(path: str, bin_size: int, scan_limit: int | None) -> tuple[int, int]:
    """(token width, documents) of the index at ``path`` for a ``.bin`` of ``bin_size``
    bytes, or IndexDamage saying what is wrong."""
    try:
        handle = open_regular_file(path)  # never a pipe or a device to block on
    except OSError as exc:
        if exc.errno in (errno.EISDIR, errno.EINVAL):
            raise IndexDamage("is not a regular file") from None
        raise
    with handle:
        size = os.fstat(handle.fileno()).st_size
        if size < HEADER.size:
            raise IndexDamage(f"is {size} bytes long; its header alone is {HEADER.size}")
        magic, version, code, sequences, indices = HEADER.unpack(handle.read(HEADER.size))
        if magic != MAGIC:
            raise IndexDamage("does not begin with Megatron's MMIDIDX magic")
        if version != VERSION:
            raise IndexDamage(f"is of version {version}; planc reads version {VERSION}")
        if code not in WIDTHS:
            kind = DTYPE_NAMES.get(code)
            raise IndexDamage(f"holds {kind} tokens; planc reads uint16 or int32 token ids"
                              if kind else f"has the unknown dtype code {code}")
        width = WIDTHS[code]
        expected = HEADER.size + 12 * sequences + 8 * indices
        if size == expected + sequences and sequences:
            raise IndexDamage("is a multimodal index (each sequence has a mode); planc "
                              "reads token datasets")
        if size != expected:
            raise IndexDamage(f"is {size:,} bytes long, but its counts ({sequences:,} "
                              f"sequences, {indices:,} document indices) make {expected:,}")
        if indices < 1:
            raise IndexDamage("has no document index (the first is always 0)")
        if scan_limit is None or size <= scan_limit:
            _check_arrays(handle.read(size - HEADER.size), width, sequences, indices,
                          bin_size)
        else:  # the ends only: a bigger index is checked where it can go wrong at once
            _check_ends(handle.fileno(), width, sequences, indices, bin_size)
    return width, indices - 1


def _check_arrays(data: bytes, width: int, sequences: int, indices: int, bin_size: int
                  ) -> None:
    """``data``: the index after its header."""
    lengths_at, pointers_at = 0, 4 * sequences
    documents_at = pointers_at + 8 * sequences
    lengths = _ints("i", data[lengths_at:pointers_at])
    pointers = _ints("q", data[pointers_at:documents_at])
    documents = _ints("q", data[documents_at:documents_at + 8 * indices])
    offset = 0
    for i, (length, pointer) in enumerate(zip(lengths, pointers)):
        if length < 0:
            raise IndexDamage(f"gives sequence {i} a negative length ({length})")
        if pointer != offset:
            raise IndexDamage(f"puts sequence {i} at byte {pointer:,} of the .bin, but the "
                              f"sequences before it end at {offset:,}")
        offset += length * width
    _check_documents(documents, sequences)
    if offset != bin_size:
        raise IndexDamage(f"describes {offset // width:,} tokens ({offset:,} bytes), but the "
                          f".bin holds {bin_size:,} bytes")


def _check_documents(documents: array, sequences: int) -> None:
    if documents[0] != 0:
        raise IndexDamage(f"starts its document indices at {documents[0]}, not 0")
    for i in range(1, len(documents)):
        if documents[i] < documents[i - 1]:
            raise IndexDamage(f"has document index {i} ({documents[i]}) below the one "
                              f"before it ({documents[i - 1]})")
    if documents[-1] != sequences:
        raise IndexDamage(f"ends its document indices at {documents[-1]}, not at its "
                          f"{sequences:,} sequences")


def _check_ends(fd: int, width: int, sequences: int, indices: int, bin_size: int) -> None:
    def read(code: str, at: int) -> int:
        return _ints(code, os.pread(fd, array(code).itemsize, at))[0]

    pointers_at = HEADER.size + 4 * sequences
    documents_at = pointers_at + 8 * sequences
    if not sequences and bin_size:
        raise IndexDamage(f"describes no sequence, but the .bin holds {bin_size:,} bytes")
    if sequences:
        last_length, first = read("i", pointers_at - 4), read("q", pointers_at)
        last = read("q", documents_at - 8)
        if first != 0 or last_length < 0 or last + last_length * width != bin_size:
            raise IndexDamage(f"does not end its sequences where the .bin ends "
                              f"({bin_size:,} bytes)")
    _check_documents(array("q", [read("q", documents_at)] + (
        [read("q", documents_at + 8 * (indices - 1))] if indices > 1 else [])), sequences)
