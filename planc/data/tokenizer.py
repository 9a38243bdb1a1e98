"""The tokenizer text is cut with before it becomes a token file, and its identity.

A tokenizer is a Hugging Face ``tokenizer.json``, named by the file or by the directory
that holds it: the one that an ``init`` checkpoint ships beside its weights (Llama 3's,
Qwen's), or the one ``make corpus`` trains for the tiny corpus (planc.data.corpus). It is
loaded with the ``tokenizers`` library (Hugging Face's Rust implementation, the one
transformers' fast tokenizers wrap).

Its identity is the SHA-256 of the ``tokenizer.json`` bytes, with its vocabulary size and
end-of-text id: ``planc data prepare`` records it beside the token file it writes
(planc.data.provenance) and ``planc check`` compares it with the ``init`` checkpoint's.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass

from planc.host.files import read_regular_file

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
MAX_CONFIG_BYTES = 16 << 20  # a tokenizer_config.json is a few KB (a chat template at most)
# How every refusal of a tokenizer_config.json ends: --eos reads no config.
NAME_IT = "or name the end-of-text token with --eos"
# The end-of-text tokens of the common families, tried when the tokenizer's config names
# none: Llama 3's, GPT-2's and Qwen's, Llama 2's and Mistral's, Gemma's.
END_OF_TEXT_NAMES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>")


class TokenizerError(ValueError):
    """A tokenizer cannot be used: the message names the path and what is wrong."""


@dataclass(frozen=True)
class TokenizerIdentity:
    """What a token file's ids mean: the tokenizer.json's SHA-256, its vocabulary size
    (with the added tokens) and the id that ends each document."""

    sha256: str
    vocab_size: int
    eos_id: int

    def to_json(self) -> dict:
        return {"sha256": self.sha256, "vocab_size": self.vocab_size, "eos_id": self.eos_id}


def tokenizer_file(path: str) -> str:
    """The tokenizer.json that ``path`` names: the file itself, or the one in the
    directory."""
    if os.path.isdir(path):
        inside = os.path.join(path, TOKENIZER_FILE)
        if not os.path.isfile(inside):
            raise TokenizerError(f"tokenizer directory {path} has no {TOKENIZER_FILE} (a "
                                 f"Hugging Face tokenizer saved by save_pretrained)")
        return inside
    if not os.path.exists(path):
        raise TokenizerError(f"tokenizer {path} does not exist")
    if not os.path.isfile(path):
        raise TokenizerError(f"tokenizer {path} is not a file or a directory")
    return path


def sha256_of(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class Tokenizer:
    """A loaded tokenizer: ``encode(texts)`` gives each text's ids, the end-of-text id
    appended, and ``identity`` what a token file records of it."""

    def __init__(self, path: str, eos: str | None = None):
        try:
            import tokenizers
        except ImportError:
            raise TokenizerError("planc data prepare needs the tokenizers package, which is "
                                 "not installed: pip install 'planc[run]'") from None
        self.path = tokenizer_file(path)
        try:
            self.tokenizer = tokenizers.Tokenizer.from_file(self.path)
        except Exception as exc:  # the Rust side raises its own exception type
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise TokenizerError(f"tokenizer {self.path} cannot be read: {first}") from None
        # ids, not entries: a vocabulary may leave gaps, and a token file's width and
        # the plan's vocab must hold its largest id
        self.vocab_size = max(self.tokenizer.get_vocab_size(with_added_tokens=True),
                              max(self.tokenizer.get_vocab(with_added_tokens=True).values(),
                                  default=-1) + 1)
        self.eos_id = self._end_of_text(eos)
        self.identity = TokenizerIdentity(sha256_of(self.path), self.vocab_size, self.eos_id)
        # encode_batch_fast (tokenizers 0.21) skips the offsets nobody reads here
        self._batch = getattr(self.tokenizer, "encode_batch_fast", self.tokenizer.encode_batch)

    def _end_of_text(self, eos: str | None) -> int:
        if eos is not None and not _utf8(eos):  # bytes of the command line, not text
            raise TokenizerError(f"--eos {eos!r} is not valid UTF-8 text, so no token of "
                                 f"tokenizer {self.path} can be named so")
        if eos is not None:
            found = self.tokenizer.token_to_id(eos)
            if found is None:
                raise TokenizerError(f"tokenizer {self.path} has no token {eos!r} (--eos)")
            return found
        configured = self._configured_eos()
        if configured is not None:  # the model's own: another name would cut elsewhere
            found = self.tokenizer.token_to_id(configured)
            if found is None:
                raise TokenizerError(f"{self._config()} gives eos_token "
                                     f"{_shown(configured)}, which tokenizer {self.path} "
                                     f"has no token for: repair it, {NAME_IT}")
            return found
        for name in END_OF_TEXT_NAMES:
            found = self.tokenizer.token_to_id(name)
            if found is not None:
                return found
        raise TokenizerError(f"tokenizer {self.path} names no end-of-text token (its "
                             f"{TOKENIZER_CONFIG} has no eos_token, and it has none of "
                             f"{', '.join(END_OF_TEXT_NAMES)}): give one with --eos")

    def _config(self) -> str:
        return os.path.join(os.path.dirname(self.path), TOKENIZER_CONFIG)

    def _configured_eos(self) -> str | None:
        """The end-of-text name the tokenizer_config.json beside the tokenizer gives; None
        without the file or its eos_token (or with eos_token null). A config that is there
        but cannot be read, or whose eos_token names no token, is refused, not passed
        over: the documents would be cut at whichever end-of-text name the tokenizer also
        has (Llama 3's base and instruct tokenizers hold the same tokens; their configs
        name <|end_of_text|> and <|eot_id|>)."""
        config = self._config()
        if not os.path.lexists(config):
            return None
        if not os.path.exists(config):
            raise TokenizerError(f"{config} is a symbolic link that leads to no file: "
                                 f"repair or remove it, {NAME_IT}")
        try:  # a regular file of bounded size: a named pipe there would block
            data = json.loads(read_regular_file(config, MAX_CONFIG_BYTES).decode("utf-8"))
        except (OSError, ValueError, RecursionError) as exc:
            raise TokenizerError(f"{config} cannot be read ({_unreadable(exc)}): repair or "
                                 f"remove it, {NAME_IT}") from None
        if not isinstance(data, dict):
            raise TokenizerError(f"{config} holds no JSON object: repair or remove it, "
                                 f"{NAME_IT}")
        eos = data.get("eos_token")
        if isinstance(eos, dict):  # transformers' AddedToken, serialised
            eos = eos.get("content")
        if eos is None:
            return None
        # a name with a lone surrogate (JSON's "\ud800") names no token either
        if not isinstance(eos, str) or not _utf8(eos):
            raise TokenizerError(f"{config} gives eos_token {_shown(eos)}, which is not a "
                                 f"token's name: repair it, {NAME_IT}")
        return eos

    def encode(self, texts: list[str]) -> list[list[int]]:
        """Each text's ids as the model's tokenizer gives them (its special tokens, such
        as Llama 3's <|begin_of_text|>, included), then the end-of-text id."""
        return [encoding.ids + [self.eos_id] for encoding in self._batch(texts)]


def _unreadable(exc: BaseException) -> str:
    """Why a JSON file could not be read, in a few words."""
    if isinstance(exc, OSError):
        return exc.strerror or str(exc)
    if isinstance(exc, UnicodeDecodeError):
        return "it is not UTF-8 text"
    if isinstance(exc, json.JSONDecodeError):  # some of its messages end in "at"
        return f"it is not JSON: {exc.msg.removesuffix(' at')}, line {exc.lineno}, " \
            f"column {exc.colno}"
    if isinstance(exc, RecursionError):
        return "it nests too deep"
    if "digits" in str(exc):  # int()'s limit on the digits it converts
        return "it holds a number too long to read"
    return str(exc).split("\n")[0]


def _shown(value) -> str:
    """A JSON value, short (it may be a list of any length)."""
    text = json.dumps(value, ensure_ascii=True)
    return text if len(text) <= 48 else text[:40] + "..."


def _utf8(text: str) -> bool:
    """Whether ``text`` is text UTF-8 can write: no lone surrogates (which Python uses for
    a command line's bytes that are not UTF-8, and which JSON's \\u escapes can make)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
