"""What a Hugging Face checkpoint directory holds, read without torch: its ``config.json``
and, from the safetensors headers alone, every tensor's file, dtype and shape.

A directory written by transformers' ``save_pretrained(safe_serialization=True)`` holds
``model.safetensors``, or, past ``max_shard_size``, ``model-0000I-of-0000N.safetensors``
files and ``model.safetensors.index.json`` whose ``weight_map`` names each tensor's file.
A safetensors file starts with 8 bytes, the little-endian length N of a JSON header,
then N bytes of header: ``{NAME: {"dtype", "shape", "data_offsets": [begin, end]}}``,
offsets counted from the end of the header (github.com/huggingface/safetensors, format);
the tensors tile the data after the header, each beginning where the previous ends, and
an optional ``__metadata__`` maps strings to strings.
Reading it costs N + 8 bytes whatever the model's size, so ``planc check`` validates a
405B checkpoint in milliseconds. Symbolic links are followed: the Hugging Face hub's
cache (``snapshots/REVISION/``) is a directory of links to its blobs. Every problem is a :class:`HFCheckpointError` with one
line that names the file, never a traceback.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from planc.host.files import open_regular_file, read_regular_file

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
HEADER_LIMIT = 100 << 20  # safetensors' own limit on a header
JSON_LIMIT = 64 << 20
# bytes per element of the dtypes a safetensors file may name
ITEM_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2,
              "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "F64": 8, "I64": 8, "U64": 8}
# what planc starts from: a floating tensor it holds exactly in its fp32 master weights
FLOATS = ("F32", "BF16", "F16")


class HFCheckpointError(Exception):
    """A Hugging Face checkpoint directory that cannot be read as one; the message says
    which file and why, in one line."""


@dataclass(frozen=True)
class StoredTensor:
    file: str  # its file's name inside the directory
    dtype: str  # safetensors' name: F32, BF16, ...
    shape: tuple[int, ...]


def _why(exc: OSError) -> str:
    return exc.strerror or str(exc)


def read_json(directory: Path, name: str) -> dict:
    """The JSON object in file ``name`` of ``directory``."""
    path = directory / name
    try:
        data = json.loads(read_regular_file(path, JSON_LIMIT))
    except FileNotFoundError:
        raise HFCheckpointError(f"{directory} has no {name}") from None
    except OSError as exc:
        raise HFCheckpointError(f"{path} cannot be read ({_why(exc)})") from None
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise HFCheckpointError(f"{path} is not JSON ({str(exc).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise HFCheckpointError(f"{path} is not a JSON object")
    return data


def read_config(directory: str | os.PathLike) -> dict:
    """The directory's ``config.json``."""
    return read_json(_directory(directory), CONFIG)


def _directory(directory: str | os.PathLike) -> Path:
    path = Path(directory)
    if not path.exists():
        raise HFCheckpointError(f"no such directory: {path}")
    if not path.is_dir():
        raise HFCheckpointError(f"{path} is not a directory")
    return path


def header(path: Path) -> dict[str, StoredTensor]:
    """The tensors of one safetensors file, from its header, each checked to lie within
    the file with as many bytes as its dtype and shape take."""
    try:
        with open_regular_file(path) as handle:
            size = os.fstat(handle.fileno()).st_size
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise HFCheckpointError(f"{path} is not a safetensors file (it has {size} "
                                        f"bytes, fewer than the 8 of a header's length)")
            length = int.from_bytes(prefix, "little")
            if length > HEADER_LIMIT or length > size - 8:
                raise HFCheckpointError(
                    f"{path} is not a safetensors file (its header would take {length} "
                    f"bytes of the {size - 8} after its length)")
            text = handle.read(length)
    except FileNotFoundError:
        raise HFCheckpointError(f"{path.parent} has no {path.name}") from None
    except OSError as exc:
        raise HFCheckpointError(f"{path} cannot be read ({_why(exc)})") from None
    try:
        table = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise HFCheckpointError(f"{path} is not a safetensors file (its header is not JSON: "
                                f"{str(exc).splitlines()[0]})") from None
    if not isinstance(table, dict):
        raise HFCheckpointError(f"{path} is not a safetensors file (its header is not a "
                                f"JSON object)")
    data_bytes = size - 8 - length
    metadata = table.get("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str)
                                                 for v in metadata.values()):
        raise HFCheckpointError(f"{path} is not a safetensors file (its __metadata__ is not "
                                f"a map of strings to strings)")
    out, spans = {}, []
    for name, entry in table.items():
        if name == "__metadata__":
            continue
        out[name] = _entry(path, name, entry, data_bytes)
        spans.append((*entry["data_offsets"], name))
    _tiles(path, sorted(spans), data_bytes)
    return out


def _tiles(path: Path, spans: list[tuple[int, int, str]], data_bytes: int) -> None:
    """The (begin, end, name) spans, sorted, tile the ``data_bytes`` after the header, as
    the safetensors format requires (its reader refuses the file otherwise, once a rank
    has started): the first begins at 0, each where the previous ends, the last at the
    end."""
    end, last = 0, None
    for begin, stop, name in [*spans, (data_bytes, data_bytes, None)]:
        if begin < end:
            raise HFCheckpointError(f"{path} is not a safetensors file ({name} at bytes "
                                    f"{begin}..{stop} after the header overlaps {last[2]} "
                                    f"at bytes {last[0]}..{last[1]})")
        if begin > end:
            raise HFCheckpointError(f"{path} is not a safetensors file (bytes {end}..{begin} "
                                    f"after the header belong to no tensor)")
        end, last = stop, (begin, stop, name)


def _entry(path: Path, name: str, entry, data_bytes: int) -> StoredTensor:
    bad = f"{path}: the header's entry of {name}"
    if not isinstance(entry, dict):
        raise HFCheckpointError(f"{bad} is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in ITEM_BYTES:
        raise HFCheckpointError(f"{bad} has dtype {dtype!r}, not a safetensors dtype")
    if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
        raise HFCheckpointError(f"{bad} has shape {shape!r}, not a list of sizes")
    if not (isinstance(offsets, list) and len(offsets) == 2 and
            all(type(n) is int for n in offsets) and 0 <= offsets[0] <= offsets[1]):
        raise HFCheckpointError(f"{bad} has data_offsets {offsets!r}, not [begin, end]")
    need = math.prod(shape) * ITEM_BYTES[dtype]
    if offsets[1] - offsets[0] != need or offsets[1] > data_bytes:
        raise HFCheckpointError(
            f"{path} is truncated or damaged: {name} ({dtype} {shape}, {need} bytes) would "
            f"lie at bytes {offsets[0]}..{offsets[1]} of the {data_bytes} after the header")
    return StoredTensor(path.name, dtype, tuple(shape))


def _weight_map(directory: Path) -> dict[str, str]:
    index = read_json(directory, INDEX)
    weight_map = index.get("weight_map")
    path = directory / INDEX
    if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise HFCheckpointError(f"{path} has no weight_map of tensor names to files")
    for file in set(weight_map.values()):
        if os.path.basename(file) != file or file in ("", ".", ".."):
            raise HFCheckpointError(f"{path} names the file {file!r}, which does not lie in "
                                    f"its directory")
    return weight_map


def stored_tensors(directory: str | os.PathLike) -> dict[str, StoredTensor]:
    """Every tensor of the directory's safetensors files: of ``model.safetensors``, or of
    the files ``model.safetensors.index.json`` names, each tensor in the file the index
    says."""
    path = _directory(directory)
    if (path / INDEX).exists():
        weight_map = _weight_map(path)
        headers = {file: header(path / file) for file in sorted(set(weight_map.values()))}
        out = {}
        for name, file in weight_map.items():
            if name not in headers[file]:
                raise HFCheckpointError(f"{path / INDEX} puts {name} in {file}, which does "
                                        f"not hold it")
            out[name] = headers[file][name]
        return out
    if (path / SINGLE).exists():
        return header(path / SINGLE)
    raise HFCheckpointError(f"{path} holds neither {SINGLE} nor {INDEX} (a Hugging Face "
                            f"checkpoint saved with safe_serialization=True)")


def check_tensors(directory: str | os.PathLike, expected: dict[str, tuple[int, ...]]
                  ) -> dict[str, StoredTensor]:
    """The stored tensors, after checking that every expected one (name -> shape) is
    there, of that shape and a floating dtype planc holds exactly (F32, BF16, F16)."""
    stored = stored_tensors(directory)
    for name, shape in expected.items():
        found = stored.get(name)
        if found is None:
            raise HFCheckpointError(f"{directory} has no tensor {name} (of shape "
                                    f"{list(shape)})")
        if found.shape != tuple(shape):
            raise HFCheckpointError(f"{directory}: {name} in {found.file} has shape "
                                    f"{list(found.shape)}; the plan's model needs "
                                    f"{list(shape)}")
        if found.dtype not in FLOATS:
            raise HFCheckpointError(f"{directory}: {name} in {found.file} is {found.dtype}; "
                                    f"planc starts from {', '.join(FLOATS)} tensors")
    return stored
