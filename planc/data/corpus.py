"""A tiny tokenised corpus for ``planc run``, made offline from this file and the
``tokenizers`` library.

    python -m planc.data.corpus -o data/tiny-corpus.tokens          # or: make corpus
    python -m planc.data.corpus notes.txt -o data/notes.tokens --vocab 4000
    python -m planc.data.corpus --raw uint32 ids.bin -o data/ids.tokens

Without a text file it writes short stories generated from a small grammar by a seeded
generator (splitmix64, so the same bytes on every machine and Python version), trains a
byte-level BPE tokenizer on the text itself and writes the ids as a token file of uint32
with the PLANCTOK header (docs/data.md), beside ``<output>.json``, the tokenizer as a
Hugging Face ``tokenizer.json`` (which ``planc data prepare --tokenizer`` takes for more
text), and ``<output>.txt`` holding the text. ``--raw`` wraps an existing headerless file
of little-endian ids (say, one numpy wrote) with the header instead. Its outputs follow
planc's rule (README, "Outputs"): each written whole or not at all, none replacing a file
this tool did not write, and one it wrote only with ``--force``.

The tokenizer is the byte-pair encoding of Sennrich et al. (2016) over bytes, as GPT-2
uses it (Radford et al. 2019), trained by Hugging Face's ``tokenizers`` (its
``BpeTrainer``, deterministic: the most frequent pair first, ties by the pair): text is
split into pieces (a word with its leading space, a digit, a run of punctuation, a run of
blanks), each piece starts as its UTF-8 bytes and the most frequent adjacent pair inside
pieces is merged into a new id until the vocabulary is full or no pair occurs twice.
Digits stay single pieces, so numbers are spelled digit by digit (as in Llama's
tokenizer) and the arithmetic in the stories is learnable. Id 0 is ``<|endoftext|>``,
the end-of-text token ``planc data prepare`` ends documents with.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

from planc.data.tokens import DTYPES, HEADER_BYTES, header, token_bytes

DEFAULT_VOCAB = 1024
DEFAULT_CHARS = 200_000
SEED = 2024

# A word with its leading space, one digit, a run of other symbols, a run of blanks.
# GPT-2's pattern, but every digit alone and no special case for contractions.
_PIECE = re.compile(r" ?[^\W\d_]+| ?\d| ?[^\s\w]+|_+|\s+(?!\S)|\s+")


# --- the text ------------------------------------------------------------------------


class SplitMix64:
    """Steele, Lea and Flood's SplitMix64 (OOPSLA 2014): a seeded stream of 64-bit words
    that is the same everywhere, unlike ``random``'s methods across Python versions."""

    MASK = (1 << 64) - 1

    def __init__(self, seed: int):
        self.state = seed & self.MASK

    def next(self) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) & self.MASK
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & self.MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & self.MASK
        return z ^ (z >> 31)

    def below(self, n: int) -> int:
        return self.next() % n

    def pick(self, items):
        return items[self.below(len(items))]


NAMES = (("Mira", "she"), ("Tobin", "he"), ("Ada", "she"), ("Pell", "he"), ("Rosa", "she"),
         ("Ivo", "he"), ("Lena", "she"), ("Otto", "he"), ("Noor", "she"), ("Wren", "they"),
         ("Basil", "he"), ("Juno", "she"))
ANIMALS = ("otter", "fox", "heron", "badger", "mole", "hare", "owl", "crow", "beaver",
           "lynx", "wren", "toad")
PLACES = ("a cold river", "an old mill", "the north wood", "a quiet harbour",
          "the high meadow", "a stone bridge", "a hollow oak", "the salt marsh")
OBJECTS = ("shell", "lantern", "key", "feather", "map", "bell", "kite", "marble", "acorn",
           "compass", "button", "ribbon")
COLOURS = ("red", "blue", "green", "silver", "golden", "grey", "white", "brown")
TIMES = ("One windy morning", "On a grey afternoon", "Late one evening", "At dawn",
         "After the first snow", "On the longest day of the year")
FEELINGS = (("happy", "sang a short song"), ("curious", "looked at it for a long time"),
            ("tired", "sat down on a flat stone"), ("brave", "walked on into the dark"),
            ("worried", "asked a friend for help"))
NUMBERS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
           "ten", "eleven", "twelve")
_VERB = {"she": "was", "he": "was", "they": "were"}


def story(rng: SplitMix64) -> str:
    """One short story: characters, a found object, counting and a little arithmetic."""
    first, second = rng.below(len(NAMES)), rng.below(len(NAMES) - 1)
    (name, pron), (other, _) = NAMES[first], NAMES[second + (second >= first)]
    animal, animal2 = rng.pick(ANIMALS), rng.pick(ANIMALS)
    thing, colour, place = rng.pick(OBJECTS), rng.pick(COLOURS), rng.pick(PLACES)
    feeling, action = rng.pick(FEELINGS)
    start, length = rng.below(6), 3 + rng.below(5)
    count = ", ".join(NUMBERS[start:start + length])
    a, b = rng.below(10), rng.below(10)
    subject = pron.capitalize()
    lines = [
        f"{name} the {animal} lived near {place}.",
        f"{rng.pick(TIMES)}, {pron} found a {colour} {thing} by {rng.pick(PLACES)}.",
        f'"Who left this {thing} here?" {pron} asked.',
        f"{subject} {_VERB[pron]} {feeling}, so {pron} {action}.",
        (f'{other} the {animal2} came by and said, "It is mine. I lost it '
         f'{NUMBERS[1 + rng.below(9)]} days ago."'),
        f"Together they counted the stones on the path: {count}.",
        f"{a} and {b} make {a + b}, said {other}, and {a + b} minus {b} is {a}.",
        f"So {name} gave the {colour} {thing} back, and the two of them walked home.",
    ]
    if rng.below(3) == 0:
        lines.insert(5, f"The {thing} was {colour}, and the sky over {place} was "
                        f"{rng.pick(COLOURS)}.")
    return " ".join(lines)


def tiny_text(chars: int = DEFAULT_CHARS, seed: int = SEED) -> str:
    """Stories until the text holds at least ``chars`` characters (all ASCII)."""
    rng, parts, size = SplitMix64(seed), [], 0
    while size < chars:
        parts.append(story(rng))
        size += len(parts[-1]) + 2
    return "\n\n".join(parts) + "\n"


# --- the tokenizer -------------------------------------------------------------------

END_OF_TEXT = "<|endoftext|>"


def pieces(text: str) -> list[str]:
    """The pre-tokenizer: pieces whose concatenation is ``text``; merges stay inside one."""
    return _PIECE.findall(text)


def train(text: str, vocab: int = DEFAULT_VOCAB):
    """A byte-level BPE tokenizer (``tokenizers.Tokenizer``) of at most ``vocab`` ids
    learnt on ``text``: the end-of-text token, the 256 bytes, then the merges."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab < 257:
        raise ValueError(f"a byte-level vocabulary holds at least 257 ids (the end-of-text "
                         f"token and 256 bytes), not {vocab}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_PIECE.pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, min_frequency=2, show_progress=False,
                                  special_tokens=[END_OF_TEXT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([text], trainer)
    return tokenizer


def encode(text: str, tokenizer) -> list[int]:
    return tokenizer.encode(text).ids


def decode(ids: list[int], tokenizer) -> str:
    return tokenizer.decode(ids)


# --- files ---------------------------------------------------------------------------


def wrap_raw(source: str, output: str, width: int, chunk_bytes: int = 4 << 20) -> int:
    """Copy a headerless file of little-endian ids behind a PLANCTOK header, a chunk at a
    time, replacing ``output`` whole at the end; returns the number of tokens."""
    from planc.host.files import real_path, replacing

    size = os.path.getsize(source)
    if size % width:
        raise ValueError(f"{source} has {size} bytes, not a whole number of "
                         f"{DTYPES[width]} tokens")
    with open(source, "rb") as src, replacing(real_path(output)) as out:
        out.write(header(width))
        while block := src.read(chunk_bytes):
            out.write(block)
    return size // width


MAX_TOKENIZER_BYTES = 64 << 20  # far above a 32,000-word tokenizer.json (about 2 MB)


def written_here(tokenizer_path: str) -> bool:
    """Whether ``tokenizer_path`` is a tokenizer.json this tool wrote: it splits text with
    this tool's own pattern and knows its end-of-text token."""
    try:
        if os.path.getsize(tokenizer_path) > MAX_TOKENIZER_BYTES:
            return False
        with open(tokenizer_path, encoding="utf-8") as f:
            document = json.load(f)
    except (OSError, ValueError, RecursionError):
        return False
    return json.dumps(_PIECE.pattern) in json.dumps(document.get("pre_tokenizer")) and \
        END_OF_TEXT in json.dumps(document.get("added_tokens")) \
        if isinstance(document, dict) else False


def outputs_problem(args) -> str | None:
    """Why the outputs of ``args`` may not be written, or None: the token file as every
    planc output (planc.host.outputs); the tokenizer and the text beside it only where
    this tool wrote them (with ``--force``) or nothing is there."""
    from planc.host import outputs
    from planc.host.output_kinds import TOKENS

    inputs = [("the file it reads", args.text)] if args.text else []
    refusal = outputs.first_problem([outputs.Output("-o", args.output, TOKENS)],
                                    args.force, inputs=inputs)
    if refusal is not None:
        return refusal.message
    if args.raw:
        return None
    stem = os.path.splitext(args.output)[0]
    if args.output in (stem + ".json", stem + ".txt"):
        return (f"-o {args.output}: the tokenizer and the text are written beside the token "
                f"file as {stem}.json and {stem}.txt; name it NAME.tokens")
    ours = written_here(stem + ".json")
    for path, what in ((stem + ".json", "the tokenizer"), (stem + ".txt", "the text")):
        if (what == "the text" and args.text) or not os.path.lexists(path):
            continue
        if not ours:
            return (f"{path} is there, and this tool writes {what} beside -o {args.output}: "
                    f"planc did not write it; move it, or name another -o")
        if not args.force:
            return (f"{path} is {what} of an earlier corpus; --force replaces it (and "
                    f"{args.output})")
        if not os.path.isfile(path):
            return f"{path} is not a regular file; {what} is written there"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m planc.data.corpus",
        description="Write a token file for train { data = ... } (docs/data.md).")
    parser.add_argument("text", nargs="?", help="a UTF-8 text file; default: the built-in "
                        "generated stories")
    parser.add_argument("-o", "--output", required=True, help="the token file to write")
    parser.add_argument("--vocab", type=int, default=DEFAULT_VOCAB,
                        help=f"largest vocabulary to train (default {DEFAULT_VOCAB}; at "
                             f"most 32000)")
    parser.add_argument("--chars", type=int, default=DEFAULT_CHARS,
                        help="size of the generated text in characters")
    parser.add_argument("--width", type=int, choices=(2, 4), default=4,
                        help="bytes per token in the file (default 4: uint32)")
    parser.add_argument("--raw", choices=("uint16", "uint32"),
                        help="TEXT is a headerless token file of this type: add the header")
    parser.add_argument("--force", action="store_true",
                        help="replace the files an earlier run of this tool wrote there")
    args = parser.parse_args(argv)
    if args.raw and not args.text:
        parser.error("--raw needs the headerless token file")
    if not args.raw and not 257 <= args.vocab <= 32000:
        parser.error("--vocab must be between 257 and 32000")
    if not args.raw and not 1 <= args.chars <= MAX_CHARS:
        parser.error(f"--chars must be between 1 and {MAX_CHARS:,}")
    directory = os.path.dirname(os.path.abspath(args.output))
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as exc:
        return _failed(f"cannot make {directory} ({exc.strerror or exc}); nothing was written")
    problem = outputs_problem(args)
    if problem is not None:
        return _failed(problem)
    try:
        return _write(args)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        where = getattr(exc, "filename", None) or args.text or args.output
        return _failed(f"{where}: {reason}; {args.output} was not written")


MAX_CHARS = 100_000_000  # generated text held in memory at once


def _failed(message: str) -> int:
    print(f"planc: error: {message}", file=sys.stderr)
    return 1


def _write(args) -> int:
    from planc.host.files import write_atomically

    if args.raw:
        width = 2 if args.raw == "uint16" else 4
        count = wrap_raw(args.text, args.output, width)
        print(f"wrote {args.output}: {count} {args.raw} tokens after a {HEADER_BYTES}-byte "
              f"header")
        return 0
    if args.text:
        with open(args.text, encoding="utf-8") as f:
            text = f.read()
    else:
        text = tiny_text(args.chars)
    tokenizer = train(text, args.vocab)
    ids = encode(text, tokenizer)
    size = tokenizer.get_vocab_size()
    stem = os.path.splitext(args.output)[0]
    # the tokenizer and the text first: the token file, last, is what a plan reads
    write_atomically(stem + ".json", tokenizer.to_str(pretty=True).encode())
    if not args.text:
        write_atomically(stem + ".txt", text.encode("utf-8"))
    write_atomically(args.output, token_bytes(ids, args.width))
    print(f"wrote {args.output}: {len(ids)} tokens of {len(text.encode('utf-8'))} bytes of "
          f"text ({len(text.encode('utf-8')) / max(len(ids), 1):.2f} bytes per token), "
          f"vocab {size}, largest id {max(ids, default=0)}; the tokenizer in "
          f"{stem}.json", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
