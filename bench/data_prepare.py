"""Benchmark: ``planc data prepare`` of a JSONL corpus against the ``tokenizers`` library
alone on the same text.

The text is this machine's own: every ``.py`` and ``.txt`` file under the Python
installation's library, one document each (code, docstrings and prose, some tens of MB),
repeated until the JSONL holds ``--megabytes``. The tokenizer is a byte-level BPE of
``--vocab`` ids trained with ``tokenizers`` on the first 20 MB of that text, with Llama 3's
pre-tokenizing pattern. Each round runs, interleaved:

- **planc**: ``planc.data.prepare.prepare`` from the JSONL file to a token file (reading,
  parsing, cutting, writing, fsync), as ``planc data prepare`` runs it;
- **tokenizers alone**: the same documents, already in memory as Python strings, through
  ``encode_batch`` in the same batches, nothing read or written: what the library
  reaches by itself.

The figure is MB of JSONL a second, the median over ``--rounds`` rounds; the ratio is
planc's over the library's.

    .venv/bin/python bench/data_prepare.py [--megabytes 1000] [--rounds 3] [--vocab 32000]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Llama 3's pre-tokenizer pattern (its tokenizer.json's Split), as tiktoken's cl100k.
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?"
                  r"[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def library_documents() -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    texts = []
    for path in sorted(root.rglob("*")):
        if path.suffix in (".py", ".txt") and path.is_file():
            try:
                texts.append(path.read_text(encoding="utf-8"))
            except (UnicodeDecodeError, OSError):
                continue
    return [text for text in texts if text.strip()]


def make_tokenizer(texts: list[str], vocab: int, path: str) -> None:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|end_of_text|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    sample, size = [], 0
    for text in texts:
        sample.append(text)
        size += len(text)
        if size > 20_000_000:
            break
    tokenizer.train_from_iterator(sample, trainer)
    tokenizer.save(path)


def write_jsonl(texts: list[str], megabytes: float, path: str) -> int:
    target, written = int(megabytes * 1e6), 0
    with open(path, "w", encoding="utf-8") as out:
        while written < target:
            for text in texts:
                line = json.dumps({"text": text}) + "\n"
                out.write(line)
                written += len(line.encode("utf-8"))
                if written >= target:
                    break
    return written


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=float, default=1000.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--vocab", type=int, default=32000)
    args = parser.parse_args()
    if args.megabytes <= 0 or args.rounds < 1 or args.vocab < 300:
        parser.error("--megabytes must be positive, --rounds at least 1, --vocab at least 300")

    from planc.data.documents import Source, documents
    from planc.data.prepare import BATCH_BYTES, prepare
    from planc.data.tokenizer import Tokenizer

    with tempfile.TemporaryDirectory(prefix="planc-bench-prepare-") as work:
        texts = library_documents()
        tokenizer_path = os.path.join(work, "tokenizer.json")
        make_tokenizer(texts, args.vocab, tokenizer_path)
        jsonl = os.path.join(work, "corpus.jsonl")
        size = write_jsonl(texts, args.megabytes, jsonl)
        tokenizer = Tokenizer(tokenizer_path)
        # the library alone: the same documents and batches, in memory
        batches, batch, taken = [], [], 0
        for text, length in documents(Source.of(jsonl)):
            batch.append(text)
            taken += length
            if taken >= BATCH_BYTES:
                batches.append(batch)
                batch, taken = [], 0
        batches += [batch] if batch else []
        print(f"{size / 1e6:,.0f} MB of JSONL, {sum(map(len, batches)):,} documents, "
              f"vocabulary {tokenizer.vocab_size:,}, {os.cpu_count()} cores")
        planc, alone = [], []
        for round_ in range(args.rounds):
            start = time.perf_counter()
            progress = prepare([Source.of(jsonl)], os.path.join(work, "out.tokens"),
                               tokenizer)
            planc.append(size / 1e6 / (time.perf_counter() - start))
            start = time.perf_counter()
            tokens = sum(len(ids) for texts_ in batches for ids in tokenizer.encode(texts_))
            alone.append(size / 1e6 / (time.perf_counter() - start))
            assert tokens == progress.tokens, (tokens, progress.tokens)
            print(f"round {round_ + 1}: planc {planc[-1]:.1f} MB/s, tokenizers alone "
                  f"{alone[-1]:.1f} MB/s ({progress.tokens:,} tokens)")
        ours, theirs = statistics.median(planc), statistics.median(alone)
        print(f"median: planc data prepare {ours:.1f} MB/s, tokenizers alone {theirs:.1f} "
              f"MB/s: {ours / theirs:.2f} of the library's rate")
    return 0


if __name__ == "__main__":
    sys.exit(main())
