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
of little-endian ids (say, one numpy wrote) with the header instead.

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
import os
import re
import sys

from planc.data.tokens import DTYPES, HEADER_BYTES, header, write_tokens

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
    time; returns the number of tokens."""
    size = os.path.getsize(source)
    if size % width:
        raise ValueError(f"{source} has {size} bytes, not a whole number of "
                         f"{DTYPES[width]} tokens")
    with open(source, "rb") as src, open(output, "wb") as out:
        out.write(header(width))
        while block := src.read(chunk_bytes):
            out.write(block)
    return size // width


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
    args = parser.parse_args(argv)
    directory = os.path.dirname(os.path.abspath(args.output))
    os.makedirs(directory, exist_ok=True)
    if args.raw:
        if not args.text:
            parser.error("--raw needs the headerless token file")
        width = 2 if args.raw == "uint16" else 4
        count = wrap_raw(args.text, args.output, width)
        print(f"wrote {args.output}: {count} {args.raw} tokens after a {HEADER_BYTES}-byte "
              f"header")
        return 0
    if not 257 <= args.vocab <= 32000:
        parser.error("--vocab must be between 257 and 32000")
    if args.text:
        with open(args.text, encoding="utf-8") as f:
            text = f.read()
    else:
        text = tiny_text(args.chars)
    tokenizer = train(text, args.vocab)
    ids = encode(text, tokenizer)
    size = tokenizer.get_vocab_size()
    write_tokens(args.output, ids, args.width)
    stem = os.path.splitext(args.output)[0]
    tokenizer.save(stem + ".json")
    if not args.text:
        with open(stem + ".txt", "w", encoding="utf-8") as f:
            f.write(text)
    print(f"wrote {args.output}: {len(ids)} tokens of {len(text.encode('utf-8'))} bytes of "
          f"text ({len(text.encode('utf-8')) / max(len(ids), 1):.2f} bytes per token), "
          f"vocab {size}, largest id {max(ids, default=0)}; the tokenizer in "
          f"{stem}.json", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
