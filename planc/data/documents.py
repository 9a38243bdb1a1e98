"""The documents of the sources ``planc data prepare`` reads, one text at a time.

- **JSONL** (``.jsonl``, ``.json``, ``.ndjson``, each optionally ``.gz``): one JSON object
  a line, its text in a field (``text`` unless told otherwise), as Megatron-LM's
  ``preprocess_data.py`` and most released corpora (The Pile, SlimPajama, FineWeb's
  JSONL) have it.
- **Plain text** (any other file, decompressed if its name ends in ``.gz``): documents cut
  as the Hugging Face ``text`` loader cuts them, ``line`` (each line; its default),
  ``paragraph`` (blank lines between) or ``document`` (the whole file).
- **Parquet** (``.parquet``, through ``pyarrow``): the text column, row group by row
  group, as FineWeb and most Hugging Face datasets store them.
- **A Hugging Face dataset** saved by ``save_to_disk`` (a directory with
  ``dataset_info.json``, ``state.json`` or ``dataset_dict.json``), or any other
  directory of data files datasets reads (a Hub dataset's snapshot in the local cache, a
  folder of JSONL, CSV or Parquet files), streamed; its ``train`` split, through
  ``datasets``, read locally, never over the network.

A document of white space alone (an empty file read whole, a JSONL record whose text is
"") is no document: planc.data.prepare skips it and says how many it skipped, rather
than write an end-of-text id alone (Megatron-LM's ``preprocess_data.py`` leaves out a
document that cuts into no ids). A blank line between documents is no document either.

A source that cannot be read stops with its path (and line, for JSONL) and what is wrong;
planc data prepare then writes nothing.
"""

from __future__ import annotations

import gzip
import itertools
import json
import os
import zlib
from dataclasses import dataclass
from typing import Iterator

from planc.host.json_values import json_kind

SAMPLE_BY = ("line", "paragraph", "document")
JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson", ".jsonl.gz", ".json.gz", ".ndjson.gz")
PARQUET_SUFFIX = ".parquet"
DATASET_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")


class SourceError(ValueError):
    """A source cannot be read: the message names it."""


@dataclass(frozen=True)
class Source:
    """A path and how to read it: ``kind`` is jsonl, text, parquet or dataset."""

    path: str
    kind: str

    @staticmethod
    def of(path: str) -> "Source":
        if os.path.isdir(path):
            if any(os.path.isfile(os.path.join(path, name)) for name in DATASET_MARKERS):
                return Source(path, "dataset")
            return Source(path, "repository")
        if not os.path.exists(path):
            raise SourceError(f"source {path} does not exist")
        if not os.path.isfile(path):
            raise SourceError(f"source {path} is not a regular file")
        lower = path.lower()
        if lower.endswith(JSONL_SUFFIXES):
            return Source(path, "jsonl")
        if lower.endswith(PARQUET_SUFFIX):
            return Source(path, "parquet")
        return Source(path, "text")


def documents(source: Source, text_key: str = "text", sample_by: str = "line"
              ) -> Iterator[tuple[str, int]]:
    """(text, bytes of the source it took) for each document of ``source``."""
    if source.kind == "jsonl":
        return _jsonl(source.path, text_key)
    if source.kind == "text":
        return _text(source.path, sample_by)
    if source.kind == "parquet":
        return _parquet(source.path, text_key)
    if source.kind == "repository":
        return _repository(source.path, text_key)
    return _dataset(source.path, text_key)


def _open_binary(path: str):
    return gzip.open(path, "rb") if path.lower().endswith(".gz") else open(path, "rb")


def _jsonl(path: str, key: str) -> Iterator[tuple[str, int]]:
    try:
        with _open_binary(path) as handle:
            for number, line in enumerate(handle, 1):
                if not line.strip():
                    continue
                yield _jsonl_text(path, number, line, key), len(line)
    except (OSError, EOFError, zlib.error) as exc:  # gzip's damaged streams
        raise _unreadable(path, exc) from None


def _unreadable(path: str, exc: Exception) -> SourceError:
    """Why a source could not be read, in words about the file: gzip's and zlib's own
    texts (``Not a gzipped file (b'th')``, ``Error -3 while decompressing``) say what
    the library met, not what is wrong with the file."""
    if isinstance(exc, gzip.BadGzipFile):  # a header's magic, or a trailer's CRC or size
        why = "its gzip stream is damaged" if _gzip_magic(path) else \
            "its name ends in .gz and it is not a gzip file"
    elif isinstance(exc, EOFError):
        why = "its gzip stream ends early (the file is cut short)"
    elif isinstance(exc, zlib.error):
        why = "its gzip stream is damaged"
    else:
        why = getattr(exc, "strerror", None) or str(exc)
    return SourceError(f"source {path} cannot be read: {why}")


def _gzip_magic(path: str) -> bool:
    """Whether the file starts as every gzip stream does (RFC 1952: 1f 8b)."""
    try:
        with open(path, "rb") as handle:
            return handle.read(2) == b"\x1f\x8b"
    except OSError:
        return False


def _jsonl_text(path: str, number: int, line: bytes, key: str) -> str:
    try:
        record = json.loads(line)
    except (ValueError, RecursionError) as exc:
        detail = exc.msg if isinstance(exc, json.JSONDecodeError) else "not JSON"
        raise SourceError(f"{path}:{number}: not a JSON object ({detail})") from None
    if not isinstance(record, dict):
        raise SourceError(f"{path}:{number}: a JSON {json_kind(record)}, not an object "
                          f"with a {key!r} field")
    if key not in record:
        raise SourceError(f"{path}:{number}: the object has no {key!r} field (it has "
                          f"{', '.join(map(repr, list(record)[:5])) or 'none'}); name the "
                          f"text's field with --text-key")
    text = record[key]
    if not isinstance(text, str):
        raise SourceError(f"{path}:{number}: the {key!r} field is a JSON "
                          f"{json_kind(text)}, not a string")
    try:  # JSON's \ud800 escapes decode to lone surrogates, which no tokenizer takes
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise SourceError(f"{path}:{number}: the {key!r} field holds a lone surrogate "
                          f"({ascii(text[exc.start])[1:-1]}), not Unicode text") from None
    return text


def _text(path: str, sample_by: str) -> Iterator[tuple[str, int]]:
    try:
        with _open_binary(path) as handle:
            if sample_by == "document":
                data = handle.read()
                yield _decoded(path, data), len(data)
                return
            paragraph: list[bytes] = []
            for line in handle:
                if sample_by == "line":
                    if line.strip():
                        yield _decoded(path, line.rstrip(b"\r\n")), len(line)
                    continue
                if line.strip():
                    paragraph.append(line)
                elif paragraph:
                    yield _paragraph(path, paragraph)
                    paragraph = []
            if paragraph:
                yield _paragraph(path, paragraph)
    except (OSError, EOFError, zlib.error) as exc:  # gzip's damaged streams
        raise _unreadable(path, exc) from None


def _paragraph(path: str, lines: list[bytes]) -> tuple[str, int]:
    data = b"".join(lines)
    return _decoded(path, data.rstrip(b"\r\n")), len(data)


def _decoded(path: str, data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SourceError(f"source {path} is not UTF-8 text (byte {exc.start} of a "
                          f"document: {exc.reason})") from None


def _parquet(path: str, key: str) -> Iterator[tuple[str, int]]:
    try:
        import pyarrow.parquet as parquet
    except ImportError:
        raise SourceError(f"source {path}: reading Parquet needs pyarrow, which is not "
                          f"installed: pip install pyarrow") from None
    try:
        table = parquet.ParquetFile(path)
        _has_column(path, key, table.schema_arrow.names)
        for batch in table.iter_batches(columns=[key]):
            yield from _texts(batch.column(0).to_pylist())
    except SourceError:
        raise
    except Exception as exc:  # pyarrow's own errors (ArrowInvalid, OSError)
        raise SourceError(f"source {path} cannot be read as Parquet: "
                          f"{str(exc).splitlines()[0].rstrip('.')}") from None


def _import_datasets(path: str):
    # never the network: a source is what is on this machine (the variables are read when
    # huggingface_hub is first imported, so they are set before)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    try:
        import datasets
    except ImportError:
        raise SourceError(f"source {path}: reading a Hugging Face dataset needs the "
                          f"datasets package, which is not installed: pip install "
                          f"datasets") from None
    return datasets


def _repository(path: str, key: str) -> Iterator[tuple[str, int]]:
    """A dataset repository's files (a Hub snapshot in the cache, or a directory of
    JSONL, CSV or Parquet files), streamed by datasets' builders: its train split."""
    datasets = _import_datasets(path)
    try:
        rows = iter(datasets.load_dataset(path, split="train", streaming=True))
        first = next(rows, None)
    except Exception as exc:  # datasets' own errors: no data files, no train split
        raise SourceError(f"source {path} is neither a dataset saved by save_to_disk nor a "
                          f"directory of data files datasets can read: "
                          f"{str(exc).splitlines()[0].rstrip('.')}") from None
    if first is None:
        return
    _has_column(path, key, list(first))
    yield from _texts(row.get(key) for row in itertools.chain([first], rows))


def _dataset(path: str, key: str) -> Iterator[tuple[str, int]]:
    datasets = _import_datasets(path)
    try:
        dataset = datasets.load_from_disk(path)
    except Exception as exc:  # datasets' own errors
        raise SourceError(f"source {path} cannot be loaded as a dataset: "
                          f"{str(exc).splitlines()[0].rstrip('.')}") from None
    if isinstance(dataset, datasets.DatasetDict):
        if "train" not in dataset:
            raise SourceError(f"source {path} holds the splits {', '.join(dataset)}, no "
                              f"'train'; save the split to read with save_to_disk")
        dataset = dataset["train"]
    _has_column(path, key, dataset.column_names)
    yield from _texts(row[key] for row in dataset.select_columns([key]))


def _has_column(path: str, key: str, names: list[str]) -> None:
    if key not in names:
        raise SourceError(f"source {path} has no column {key!r} (it has "
                          f"{', '.join(names[:5])}); name the text's column with "
                          f"--text-key")


def _texts(values) -> Iterator[tuple[str, int]]:
    """(text, its UTF-8 bytes) of each value of a column that is a string (a null row,
    None, is skipped)."""
    for text in values:
        if isinstance(text, str):
            yield text, len(text.encode("utf-8"))
