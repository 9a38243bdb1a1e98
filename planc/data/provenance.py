"""What a prepared token file was cut from: the description ``planc data prepare`` writes
beside it, and the check that joins it to an ``init`` checkpoint.

``OUT.tokens`` gets ``OUT.tokens.json``: the tokenizer's identity (planc.data.tokenizer),
the documents and tokens counted, each source with its documents and bytes, and the token
file's size, by which a description that no longer matches its file is told apart. A
token file made another way (``make corpus``, numpy) has none, and nothing is compared.

``planc check`` refuses a plan whose ``init`` checkpoint ships a tokenizer other than the
one its data was cut with: the ids would mean other words to the model. Tokenizers are the
same when their ``tokenizer.json`` bytes are, or, saved by another version, when the JSON
they hold is (the same vocabulary, merges, added tokens and pre-processing).
"""

from __future__ import annotations

import json
import os

from planc.data.tokenizer import TOKENIZER_FILE, sha256_of
from planc.host.files import open_regular_file
from planc.vocabulary.versions import is_version

GENERATOR = "planc data prepare"
FORMAT = "planc-token-sources"
VERSION = 1
MAX_BYTES = 1 << 20  # a description is a few hundred bytes a source


def description_path(tokens_path: str) -> str:
    return tokens_path + ".json"


def description(identity, tokens: int, documents: int, width: int, size: int,
                sources: list[dict], tokenizer_path: str) -> bytes:
    """The description of a token file, as its bytes (the generator's key first, which
    marks it as planc's: planc.host.output_kinds)."""
    record = {"generator": GENERATOR, "format": FORMAT, "version": VERSION,
              "tokenizer": {**identity.to_json(), "path": tokenizer_path},
              "tokens": tokens, "documents": documents, "width": width, "size": size,
              "sources": sources}
    return (json.dumps(record, indent=1) + "\n").encode()


class DescriptionError(ValueError):
    """The description beside a token file is damaged or describes another file."""


def read_description(tokens_path: str, name: str | None = None) -> dict | None:
    """The description beside ``tokens_path`` (shown as ``name``, quoted), None when
    there is none, or DescriptionError."""
    name = name or tokens_path
    path, shown = description_path(tokens_path), f"'{description_path(name)}'"
    try:  # a named pipe or a device there is an error at once, never a hang
        with open_regular_file(path) as handle:
            data = handle.read(MAX_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise DescriptionError(f"{shown} cannot be read ({exc.strerror})") from None
    try:
        record = json.loads(data) if len(data) <= MAX_BYTES else None
    except (ValueError, RecursionError):
        record = None
    tokenizer = record.get("tokenizer") if isinstance(record, dict) else None
    if not isinstance(record, dict) or record.get("format") != FORMAT or \
            not is_version(record.get("version"), VERSION) or not isinstance(tokenizer, dict) or \
            not isinstance(tokenizer.get("sha256"), str) or \
            not isinstance(record.get("size"), int):
        raise DescriptionError(f"{shown} is not a description planc data prepare wrote "
                               f"(damaged, or of another version); prepare the data again")
    try:
        size = os.stat(tokens_path).st_size
    except OSError:
        return record
    if size != record["size"]:
        raise DescriptionError(f"{shown} describes a token file of {record['size']:,} bytes, "
                               f"but '{name}' has {size:,}; prepare the data again")
    return record


def _same_json(first: str, second: str) -> bool:
    """Whether two tokenizer.json files hold the same JSON (the same bytes do too)."""
    try:
        with open(first, "rb") as a, open(second, "rb") as b:
            return json.load(a) == json.load(b)
    except (OSError, ValueError, RecursionError):
        return False


def tokenizer_mismatch(tokens_path: str, init: str, name: str) -> str | None:
    """Why the token file at ``tokens_path`` (shown as ``name``, quoted) was not cut by the
    tokenizer of the checkpoint directory ``init``, or None: the same tokenizer, or
    nothing to compare (no description, no tokenizer.json in the checkpoint)."""
    try:
        record = read_description(tokens_path, name)
    except DescriptionError as exc:
        return str(exc)
    shipped = os.path.join(init, TOKENIZER_FILE)
    if record is None or not os.path.isfile(shipped):
        return None
    recorded, theirs = record["tokenizer"], sha256_of(shipped)
    used = recorded.get("path")
    if recorded["sha256"] == theirs or \
            isinstance(used, str) and os.path.isfile(used) and _same_json(used, shipped):
        return None
    return (f"data file '{name}' was cut by another tokenizer than the init checkpoint's "
            f"(its tokenizer.json has SHA-256 {recorded['sha256'][:12]}..., the "
            f"checkpoint's {theirs[:12]}...): its ids would be other words to the model")


def vocabulary_overflow(tokens_path: str, vocab: int, name: str) -> str | None:
    """Why a token file whose description names a tokenizer of more ids than the model's
    ``vocab`` cannot feed it (a large file's ids are otherwise checked only as each step
    reads them), or None."""
    try:
        record = read_description(tokens_path, name)
    except DescriptionError as exc:
        return str(exc)
    size = record["tokenizer"].get("vocab_size") if record is not None else None
    if isinstance(size, int) and size > vocab:
        return (f"data file '{name}' was cut by a tokenizer of {size:,} ids, more than the "
                f"model's vocab = {vocab:,}")
    return None

