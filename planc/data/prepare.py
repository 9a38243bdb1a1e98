"""Text to a token file: ``planc data prepare SOURCE... -o OUT.tokens --tokenizer T``.

Each document of each source (planc.data.documents) is cut by the tokenizer
(planc.data.tokenizer) and followed by its end-of-text id, as Megatron-LM's
``preprocess_data.py --append-eod`` does; the ids go to a token file with the header
(docs/data.md), 2 bytes a token when the vocabulary fits in 65,536 ids, else 4, and a
description beside it (planc.data.provenance) records the tokenizer and the sources.

Batches of documents go to the tokenizer's ``encode_batch``, which spreads them over the
machine's cores (tokenizers' Rust thread pool) while this thread reads the next batch:
the reading (a JSON parse per line) and the cutting overlap.

Atomic: the tokens go to a hidden temporary file beside the output, renamed over it only
once every source has been read; a source that fails, a full disk or a Ctrl-C removes
it, and the output is as it was. The description is written after the rename.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
from array import array
from dataclasses import dataclass, field
from itertools import chain
from typing import Callable, Iterator

from planc.data.documents import Source, documents
from planc.diagnostics import counted
from planc.data.provenance import description, description_path
from planc.data.tokenizer import Tokenizer
from planc.data.tokens import ARRAY_CODES, header
from planc.host.files import replacing, write_atomically

BATCH_BYTES = 1 << 20  # text handed to the tokenizer at once
UINT16_IDS = 1 << 16


class PrepareError(ValueError):
    """The sources gave nothing to write."""


@dataclass
class Progress:
    documents: int = 0
    blank: int = 0  # documents of white space alone, skipped (planc.data.documents)
    tokens: int = 0
    bytes_read: int = 0
    started: float = field(default_factory=time.perf_counter)
    sources: list[dict] = field(default_factory=list)

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.started

    @property
    def megabytes_per_second(self) -> float:
        return self.bytes_read / 1e6 / max(self.seconds, 1e-9)


def width_for(vocab_size: int) -> int:
    return 2 if vocab_size <= UINT16_IDS else 4


def _batches(sources: list[Source], text_key: str, sample_by: str, batch_bytes: int
             ) -> Iterator[tuple[int, list[str], int, int]]:
    """(source index, texts, bytes read, blank documents skipped) of about
    ``batch_bytes`` of text at a time."""
    for index, source in enumerate(sources):
        texts, size, blank = [], 0, 0
        for text, taken in documents(source, text_key, sample_by):
            size += taken
            if not text or text.isspace():
                blank += 1
            else:
                texts.append(text)
            if size >= batch_bytes:
                yield index, texts, size, blank
                texts, size, blank = [], 0, 0
        if texts or blank:
            yield index, texts, size, blank


def _read_ahead(batches: Iterator, depth: int = 2) -> Iterator:
    """``batches``, read by a thread of its own ``depth`` batches ahead, so that parsing
    the sources overlaps the tokenizer (which releases the GIL while it cuts). An error
    of the reader is raised here, in order."""
    done = object()
    pending: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def read() -> None:
        try:
            for batch in batches:
                while not stop.is_set():
                    try:
                        pending.put(batch, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            pending.put(done)
        except BaseException as exc:  # handed to the consumer, raised there
            pending.put(exc)

    reader = threading.Thread(target=read, name="planc-prepare-reader", daemon=True)
    reader.start()
    try:
        while True:
            item = pending.get()
            if item is done:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        reader.join()


def prepare(sources: list[Source], output: str, tokenizer: Tokenizer, *,
            text_key: str = "text", sample_by: str = "line",
            report: Callable[[Progress], None] | None = None,
            batch_bytes: int = BATCH_BYTES) -> Progress:
    """Cut every document of ``sources`` into ``output`` and its description; the
    progress so far after each batch goes to ``report``."""
    width = width_for(tokenizer.vocab_size)
    progress = Progress(sources=[{"path": os.path.abspath(s.path), "kind": s.kind,
                                  "documents": 0, "bytes": 0} for s in sources])
    target = os.path.realpath(output)
    with replacing(target, durable=True) as out:
        out.write(header(width))
        for index, texts, size, blank in _read_ahead(_batches(sources, text_key, sample_by,
                                                              batch_bytes)):
            ids = array(ARRAY_CODES[width],
                        chain.from_iterable(tokenizer.encode(texts) if texts else ()))
            out.write(ids.tobytes() if sys.byteorder == "little" else _swapped(ids))
            progress.documents += len(texts)
            progress.blank += blank
            progress.tokens += len(ids)
            progress.bytes_read += size
            progress.sources[index]["documents"] += len(texts)
            progress.sources[index]["bytes"] += size
            if report is not None:
                report(progress)
        if progress.documents == 0:
            blank = counted(progress.blank, "blank document", grouped=True)
            blank = f" ({blank} skipped)" if progress.blank else ""
            raise PrepareError(f"the sources hold no document{blank}: nothing to write")
    write_atomically(description_path(target), description(
        tokenizer.identity, progress.tokens, progress.documents, width,
        os.stat(target).st_size, progress.sources, os.path.abspath(tokenizer.path)))
    return progress


def _swapped(ids: array) -> bytes:
    ids.byteswap()
    return ids.tobytes()
