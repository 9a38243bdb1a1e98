"""A safetensors file written straight from the tensors' memory, hashed as it is written.

``safetensors.torch.save`` builds the whole file in a new buffer and hands it to Python
as bytes: two copies of a stage's state, the second holding the interpreter lock, and
the pages of both faulted in anew at every checkpoint. Here the file is the same
(the format's layout as the library writes it: an 8-byte little-endian header length, the
JSON header with the tensors ordered by dtype, then by name, padded with spaces to a
multiple of 8, then the data), written from views of the tensors in chunks that the
sha256 and the write each take without the interpreter lock: an asynchronous
checkpoint's writer thread then leaves the training thread alone (docs/checkpoints.md,
"Asynchronous checkpoints"). safetensors reads it as its own (tests/test_checkpoint.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct

import torch

from planc.host.files import replacing

DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
          torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16",
          torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}
# The library orders a file's tensors by its Dtype enum, last member first, then by name.
DTYPE_ORDER = ("I64", "F64", "F32", "I32", "BF16", "F16", "I16", "I8", "U8", "BOOL")
CHUNK_BYTES = 8 << 20  # a write and a hash update at a time


def tensor_file_bytes(tensors: dict[str, torch.Tensor], metadata: dict[str, str]
                      ) -> tuple[bytes, list[memoryview]]:
    """The file's header (length and JSON) and views of its data, in the file's order."""
    names = sorted(tensors, key=lambda n: (DTYPE_ORDER.index(DTYPES[tensors[n].dtype]), n))
    # the library writes the metadata in its hash map's order; here, by key
    header: dict = {"__metadata__": dict(sorted(metadata.items()))} if metadata else {}
    offset, pieces = 0, []
    for name in names:
        tensor = tensors[name].detach()
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            tensor = tensor.to("cpu").contiguous()
        size = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": DTYPES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
        if size:
            pieces.append(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, pieces


def write_tensor_file(path: str | os.PathLike, tensors: dict[str, torch.Tensor],
                      metadata: dict[str, str]) -> dict:
    """Write ``tensors`` to ``path`` as a safetensors file, whole or not at all, also after
    a crash (fsynced, renamed into place, the directory fsynced: planc.host.files.replacing);
    returns its ``sha256`` and ``bytes``."""
    head, pieces = tensor_file_bytes(tensors, metadata)
    digest = hashlib.sha256(head)
    with replacing(os.fspath(path), durable=True) as out:
        out.write(head)
        for piece in pieces:
            for start in range(0, len(piece), CHUNK_BYTES):
                chunk = piece[start:start + CHUNK_BYTES]
                digest.update(chunk)
                out.write(chunk)
    return {"sha256": digest.hexdigest(), "bytes": len(head) + sum(len(p) for p in pieces)}
