"""The files of a checkpoint's step directory, checked against its manifest (no torch).

Every file is opened as a regular file inside the step directory, never through a
symbolic link (a link to a valid file elsewhere has the right sha256, yet it is not the
checkpoint's), by a name :mod:`planc.checkpoint.manifest` checked to be plain. Its size
and sha256 must be the manifest's; a safetensors header is checked as strictly as
safetensors' own reader checks it (tensors that tile the data exactly, known dtypes,
shapes that fit their bytes), so that ``safe_open`` never fails later on a rank; the
two index files must map the tensors to the files the manifest says.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from pathlib import Path

from planc.checkpoint.manifest import (FORMAT, MAX_DIMENSIONS, MODEL_INDEX, OPTIMIZER_INDEX,
                                       RNG_TENSOR, CheckpointError, parse_json, reason,
                                       state_name)
from planc.checkpoint.manifest_fields import MAX_WHOLE, PLAIN_NAME, shown
from planc.host.files import open_regular_file, read_regular_file

# Bytes per element of the dtypes safetensors knows (a planc checkpoint uses F32 and U8).
SAFETENSORS_DTYPES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2,
                      "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8,
                      "U64": 8, "F64": 8}
HEADER_LIMIT = 100 * 2**20  # safetensors' own limit on the JSON header
MAX_INDEX_BYTES = 64 << 20


def open_in(directory: Path, name: str):
    """The file ``name`` of a step directory, opened for reading if it is a regular file
    there (not a link, a pipe, a device or a directory)."""
    path = directory / name
    try:
        return open_regular_file(path, follow=False)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing (the manifest lists it)") from None
    except OSError as exc:
        raise CheckpointError(f"{path} cannot be read ({reason(exc, path)})") from None


def checked_path(directory: Path, name: str) -> str:
    """The path of a file the manifest lists, for a reader that opens it by name
    (``safetensors.safe_open``), once it is a plain name and a regular file inside the
    directory."""
    if not isinstance(name, str) or not PLAIN_NAME.fullmatch(name):
        raise CheckpointError(f"{directory}: {shown(name)} is not a plain file name")
    open_in(directory, name).close()
    return str(directory / name)


def sha256_of(handle) -> str:
    digest = hashlib.sha256()
    for block in iter(lambda: handle.read(1 << 20), b""):
        digest.update(block)
    return digest.hexdigest()


def safetensors_header(handle, size: int, path: Path) -> dict:
    """The tensors a safetensors file (``handle``, open at its start, of ``size`` bytes)
    holds (name -> dtype, shape, data_offsets), read from its header alone and checked
    against the file's size: a truncated file is refused without reading its data."""
    prefix = handle.read(8)
    if len(prefix) < 8:
        raise CheckpointError(f"{path} is truncated ({size} bytes)")
    (length,) = struct.unpack("<Q", prefix)
    if length > min(HEADER_LIMIT, size - 8):
        raise CheckpointError(f"{path} is truncated or not a safetensors file (header of "
                              f"{length} bytes in a file of {size})")
    raw = handle.read(length)
    if not raw.startswith(b"{"):
        raise CheckpointError(f"{path} is not a safetensors file (its header is not a JSON "
                              f"object)")
    try:
        header = parse_json(raw, path)
    except CheckpointError as exc:
        raise CheckpointError(f"{exc} (the header of a safetensors file)") from None
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or \
            not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(f"{path}: its __metadata__ is not an object of strings")
    spans = []
    for name, info in header.items():
        where = f"{path}: tensor {json.dumps(name)}"
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise CheckpointError(f"{where} has an invalid header entry (not dtype, shape "
                                  f"and data_offsets)")
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if not isinstance(dtype, str) or dtype not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"{where} has dtype {shown(dtype)}, which "
                                  f"safetensors does not know")
        if not isinstance(shape, list) or len(shape) > MAX_DIMENSIONS or \
                not all(type(n) is int and 0 <= n <= MAX_WHOLE for n in shape):
            raise CheckpointError(f"{where} has an invalid shape")
        if not isinstance(offsets, list) or len(offsets) != 2 or \
                not all(type(n) is int and 0 <= n <= size for n in offsets) or \
                offsets[0] > offsets[1]:
            raise CheckpointError(f"{where} has invalid data_offsets")
        count = math.prod(shape) * SAFETENSORS_DTYPES[dtype]
        if offsets[1] - offsets[0] != count:
            raise CheckpointError(f"{where} has {offsets[1] - offsets[0]} bytes for "
                                  f"{dtype} {shape} ({count})")
        spans.append((offsets[0], offsets[1], name))
    end = 0
    for first, last, name in sorted(spans):  # the tensors tile the data, as safetensors wants
        if first != end:
            raise CheckpointError(f"{path}: tensor {json.dumps(name)} starts at byte {first} "
                                  f"of the data, not {end} (tensors overlap or leave a gap)")
        end = last
    if size != 8 + length + end:
        raise CheckpointError(f"{path} has {size} bytes, its header describes "
                              f"{8 + length + end} (truncated or overwritten)")
    return header


def verify_files(directory: Path, manifest: dict, hashes: bool = True) -> None:
    """Every file the manifest names is a regular file of the directory with its size
    (and sha256, with ``hashes``); the safetensors files hold every tensor the manifest
    lists, in fp32, with its shape, and the RNG state; the indices map every tensor to
    its file. ``manifest`` is checked already (planc.checkpoint.manifest)."""
    headers: dict[str, dict] = {}
    for name, info in manifest["files"].items():
        path = directory / name
        with open_in(directory, name) as handle:
            size = os.fstat(handle.fileno()).st_size
            if size != info["bytes"]:
                raise CheckpointError(f"{path} has {size} bytes, the manifest says "
                                      f"{info['bytes']} (truncated or replaced)")
            try:
                if hashes and sha256_of(handle) != info["sha256"]:
                    raise CheckpointError(f"{path} does not match its sha256 in the manifest "
                                          f"(corrupted or replaced)")
                if name.endswith(".safetensors"):
                    handle.seek(0)
                    headers[name] = safetensors_header(handle, size, path)
            except OSError as exc:
                raise CheckpointError(f"{path} cannot be read ({reason(exc)})") from None
    keys = manifest["optimizer"]["state"]
    expected = [(where, tensor, info["shape"])
                for param, info in manifest["parameters"].items()
                for where, tensor in ((info["file"], param),
                                      *((info["optimizer_file"], state_name(param, key))
                                        for key in keys))]
    expected += [(info["file"], buffer, info["shape"])  # state that is not trained
                 for buffer, info in manifest.get("buffers", {}).items()]
    for file, tensor, shape in expected:
        entry = headers[file].get(tensor)
        if entry is None:
            raise CheckpointError(f"{directory}: {tensor} is not in {file}, the manifest "
                                  f"says it is")
        if entry["dtype"] != "F32" or entry["shape"] != shape:
            raise CheckpointError(f"{directory / file}: {tensor} is {entry['dtype']} "
                                  f"{entry['shape']}, the manifest says F32 {shape}")
    rng = manifest["rng"]["file"]
    listed = {(file, tensor) for file, tensor, _ in expected} | {(rng, RNG_TENSOR)}
    for file, header in headers.items():  # a file holding more than its manifest says is
        for tensor in sorted(header):  # not the checkpoint the manifest describes
            if (file, tensor) not in listed:
                raise CheckpointError(f"{directory / file} holds {json.dumps(tensor)}, "
                                      f"which the manifest does not list")
    entry = headers[rng].get(RNG_TENSOR)
    if entry is None or entry["dtype"] != "U8" or len(entry["shape"]) != 1:
        held = "nothing" if entry is None else f"{entry['dtype']} {entry['shape']}"
        raise CheckpointError(f"{directory / rng}: {RNG_TENSOR} is {held}, not the bytes "
                              f"(U8, one dimension) of torch's CPU generator state")
    for index, weight_map in indices(manifest).items():
        _check_index(directory / index, manifest, weight_map)


def indices(manifest: dict) -> dict[str, dict[str, str]]:
    """The weight map each index file holds: tensor -> file."""
    model, optimizer = {}, {}
    for param, info in manifest["parameters"].items():
        model[param] = info["file"]
        for key in manifest["optimizer"]["state"]:
            optimizer[state_name(param, key)] = info["optimizer_file"]
    for buffer, info in manifest.get("buffers", {}).items():  # beside the parameters
        model[buffer] = info["file"]
    return {MODEL_INDEX: dict(sorted(model.items())),
            OPTIMIZER_INDEX: dict(sorted(optimizer.items()))}


def _check_index(path: Path, manifest: dict, weight_map: dict[str, str]) -> None:
    """An index file (Hugging Face's ``model.safetensors.index.json``) says what the
    manifest says: the same tensors in the same files."""
    try:
        raw = read_regular_file(path, MAX_INDEX_BYTES + 1, follow=False)
    except OSError as exc:
        raise CheckpointError(f"{path} cannot be read ({reason(exc, path)})") from None
    if len(raw) > MAX_INDEX_BYTES:
        raise CheckpointError(f"{path} is larger than {MAX_INDEX_BYTES >> 20} MiB")
    index = parse_json(raw, path)
    total = sum(4 * math.prod(info["shape"]) for info in manifest["parameters"].values())
    metadata = {"format": FORMAT, "step": manifest["step"], "total_size": total}
    if not isinstance(index, dict) or set(index) != {"metadata", "weight_map"}:
        raise CheckpointError(f"{path} is not a safetensors index (an object of metadata "
                              f"and weight_map)")
    saved = index["weight_map"]
    if saved != weight_map:  # first: it names the tensor that differs
        if not isinstance(saved, dict):
            raise CheckpointError(f"{path}: its weight_map is {shown(saved)}, not an object")
        name = next(n for n in sorted(set(saved) | set(weight_map), key=str)
                    if saved.get(n) != weight_map.get(n))
        raise CheckpointError(f"{path}: its weight_map maps {json.dumps(name)} to "
                              f"{shown(saved.get(name))}, the manifest to "
                              f"{json.dumps(weight_map.get(name))}")
    if index["metadata"] != metadata:
        raise CheckpointError(f"{path}: its metadata is not {json.dumps(metadata)}, as the "
                              f"manifest says")
