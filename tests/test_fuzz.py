"""Fuzzing the front end: no mutant of an example plan may make ``load_text`` raise.

Every example plan in plans/ is mutated thousands of times (deterministically, from a
seeded ``random.Random``) at the level of tokens, bytes and lines. For each mutant the
front end must return a ``Loaded`` whose diagnostics are well formed (a message, a
valid severity, a span inside the file or none), whose plan is present exactly when
no diagnostic is an error, and which both renderers can print.
"""

from __future__ import annotations

import json
import random
import re
import traceback
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planc.diagnostics import ERROR, WARNING, render_json, render_text
from planc.lang import Loaded, load_file, load_text
from tests.conftest import PLANS

EXAMPLES = sorted(PLANS.glob("*.plan"))
MUTANTS_PER_PLAN = 520  # x 9 examples: about 4,700 mutants in all
SEED = 20240611

# Our own tokenizer (deliberately not planc's): comments, strings, numbers with a glued
# unit or enum tail, names with inner hyphens, '..', single punctuation, new lines,
# runs of blanks, and any other single character. Joining the tokens gives the text back.
TOKEN = re.compile(r"""
      \#[^\n]*
    | "(?:[^"\\\n]|\\.)*"?
    | [0-9][0-9_]*(?:\.[0-9][0-9_]*)?(?:[eE][+-]?[0-9]+)?(?:[A-Za-z_][A-Za-z0-9_]*(?:/[A-Za-z]+)?)?
    | [A-Za-z_][A-Za-z0-9_]*(?:-[A-Za-z_][A-Za-z0-9_]*)*
    | \.\.
    | \r?\n
    | [ \t\f\r]+
    | .
""", re.VERBOSE | re.DOTALL)

TRICKY = [
    "{", "}", "[", "]", "(", ")", "=", ";", "..", '"', "#", ",", "+", "-", "*", "/",
    "1f1b", "0", "-1", "1e999", "-1e999", "99999999999999999999999", "25GB/s", "dgx-a100",
    "auto", "on", "off", "plan", "model", "gpt", "tp", "mesh", "stages", "0..0", "3..1",
    "adamw(lr = 1e-3)", "sgd()", "[0..1, 2..3]", "4 * hidden", "hidden / 0", "hidden / 7",
    "é", "ß", "Ω", "µs", "日本", "\u2028", "\u00a0", "\ufeff", "\x00", "\x0b", "\x0c",
    "\r", "\t", "\n", "\\", '"unterminated', '"a\\"b"', "1_", "1__0", "0x10", "1e", "1.e5",
    ".5", "5.", "nan", "inf", "--1", "+-+1", "((((", "]]]]", "}}}}", "{{{{",
    "1" + "0" * 400, "1" + "0" * 400 + "MB", "9" * 5000, "0.5_", "1_e5",
]


def tokens_of(text: str) -> list[str]:
    tokens = TOKEN.findall(text)
    assert "".join(tokens) == text
    return tokens


def _solid(tokens: list[str]) -> list[int]:
    """Indices of the tokens that are not blanks or new lines (the ones worth mutating)."""
    return [i for i, t in enumerate(tokens) if t.strip(" \t\f\r\n")] or [0]


# --- mutators: each takes (rng, text) and returns str (or bytes for byte mutants) ---


def delete_token(rng, text):
    tokens = tokens_of(text)
    if tokens:
        del tokens[rng.choice(_solid(tokens))]
    return "".join(tokens)


def duplicate_token(rng, text):
    tokens = tokens_of(text)
    if tokens:
        i = rng.choice(_solid(tokens))
        tokens.insert(i, tokens[i] + rng.choice(["", " ", "\n"]))
    return "".join(tokens)


def swap_tokens(rng, text):
    tokens = tokens_of(text)
    solid = _solid(tokens)
    if len(solid) >= 2:
        i, j = rng.sample(solid, 2)
        tokens[i], tokens[j] = tokens[j], tokens[i]
    return "".join(tokens)


def replace_token(rng, text):
    tokens = tokens_of(text)
    if tokens:
        solid = _solid(tokens)
        source = TRICKY if rng.random() < 0.6 else [tokens[k] for k in solid]
        tokens[rng.choice(solid)] = rng.choice(source)
    return "".join(tokens)


def insert_token(rng, text):
    tokens = tokens_of(text)
    tokens.insert(rng.randrange(len(tokens) + 1), rng.choice(TRICKY))
    return "".join(tokens)


def truncate(rng, text):
    return text[:rng.randrange(len(text) + 1)]


def duplicate_line(rng, text):
    lines = text.splitlines(keepends=True)
    if lines:
        i = rng.randrange(len(lines))
        lines.insert(rng.randrange(len(lines) + 1), lines[i])
    return "".join(lines)


def delete_line(rng, text):
    lines = text.splitlines(keepends=True)
    if lines:
        del lines[rng.randrange(len(lines))]
    return "".join(lines)


def _byte_edit(rng, data: bytearray) -> None:
    kind = rng.randrange(3)
    if kind == 0 and data:
        del data[rng.randrange(len(data))]
    elif kind == 1:
        data.insert(rng.randrange(len(data) + 1), rng.randrange(256))
    elif data:
        i = rng.randrange(len(data))
        data[i] ^= 1 << rng.randrange(8)


def mutate_bytes(rng, text):
    data = bytearray(text.encode("utf-8"))
    for _ in range(rng.choice([1, 1, 1, 2, 3, 8])):
        _byte_edit(rng, data)
    return bytes(data)


TEXT_MUTATORS = [delete_token, duplicate_token, swap_tokens, replace_token, replace_token,
                 insert_token, truncate, duplicate_line, delete_line]


def mutate(rng, text):
    """One to three stacked mutations; the result is str, or bytes for byte mutants."""
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        if rng.random() < 0.2:
            return mutate_bytes(rng, text)
        text = rng.choice(TEXT_MUTATORS)(rng, text)
    return text


# --- the invariants -----------------------------------------------------------------


def check_loaded(loaded: Loaded, text: str | None, raw: bytes | None = None) -> None:
    """Everything a caller of the front end relies on, whatever the input."""
    assert isinstance(loaded, Loaded)
    if text is not None:
        lines = text.split("\n")
    else:
        lines = raw.decode("utf-8", errors="replace").split("\n")
    for d in loaded.diagnostics:
        assert d.severity in (ERROR, WARNING), d
        assert isinstance(d.message, str) and d.message.strip(), d
        assert all(isinstance(h, str) and h.strip() for h in d.hints), d
        if d.span is not None:
            s = d.span
            assert 1 <= s.line <= len(lines) + 1, (d, len(lines))
            assert s.column >= 1, d
            if s.line <= len(lines):
                assert s.column <= len(lines[s.line - 1]) + 2, (d, lines[s.line - 1])
            assert (s.end_line, s.end_column) >= (s.line, s.column), d
            assert s.end_line <= len(lines) + 1, (d, len(lines))
    has_error = any(d.is_error for d in loaded.diagnostics)
    assert (loaded.plan is None) == has_error, loaded.diagnostics
    assert loaded.ok == (not has_error)
    for color in (False, True):
        rendered = render_text(loaded.diagnostics, loaded.path, loaded.source, color)
        assert isinstance(rendered, str)
    document = json.loads(render_json(loaded.diagnostics, loaded.path))
    assert len(document["diagnostics"]) == len(loaded.diagnostics)


def _where(exc: BaseException) -> str:
    """Exception type and the innermost frame in planc that it came from."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "planc" in f.filename]
    frame = frames[-1] if frames else traceback.extract_tb(exc.__traceback__)[-1]
    return f"{type(exc).__name__} at {Path(frame.filename).name}:{frame.lineno}"


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_mutants_of_example_never_crash_the_front_end(path, tmp_path):
    original = path.read_text(encoding="utf-8")
    rng = random.Random(f"{SEED}:{path.name}")
    on_disk = tmp_path / "mutant.plan"
    # Distinct failures (by kind and place), each with the shortest mutant that shows it.
    failures: dict[str, tuple[str, object]] = {}
    for n in range(MUTANTS_PER_PLAN):
        mutant = mutate(rng, original)
        try:
            if isinstance(mutant, bytes) and n % 2:
                # Bytes through load_file: invalid UTF-8 and the BOM are covered too.
                on_disk.write_bytes(mutant)
                check_loaded(load_file(on_disk), None, mutant)
                continue
            if isinstance(mutant, bytes):
                mutant = mutant.decode("utf-8", errors="replace")
            check_loaded(load_text(mutant, "mutant.plan"), mutant)
        except AssertionError as exc:
            key = f"invariant: {str(exc).splitlines()[0][:120] if str(exc) else 'assert'}"
            if key not in failures or len(mutant) < len(failures[key][1]):
                failures[key] = (str(exc)[:500], mutant)
        except BaseException as exc:  # noqa: BLE001 - any exception at all is a bug
            key = _where(exc)
            if key not in failures or len(mutant) < len(failures[key][1]):
                failures[key] = (f"{exc!r}"[:300], mutant)
    assert not failures, "\n\n".join(
        f"{key}: {message}\n  shortest mutant of {path.name}: {mutant!r}"
        for key, (message, mutant) in failures.items())


def test_the_fuzzer_covers_thousands_of_mutants():
    assert len(EXAMPLES) * MUTANTS_PER_PLAN >= 4000


def test_the_tokenizer_round_trips_every_example():
    for path in EXAMPLES:
        text = path.read_text(encoding="utf-8")
        assert "".join(tokens_of(text)) == text
        assert "1f1b" in tokens_of(text) or "1f1b" not in text


# --- hypothesis: arbitrary text -----------------------------------------------------

_PLAN_WORDS = st.sampled_from(TRICKY + ["plan p {", "model gpt {", "layers = 2", "hidden",
                                        "heads", " ", "\n", "mesh {", "}"])


@settings(max_examples=300, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(
    st.text(max_size=400),
    st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=0x7F), max_size=400),
    st.lists(_PLAN_WORDS, max_size=60).map(" ".join),
))
def test_arbitrary_text_never_raises(text):
    check_loaded(load_text(text, "random.plan"), text)


# --- number literals the lexer accepts but Python's int() and float() do not -----------

HOSTILE_LITERALS = {
    "double-underscore": ("model gpt", "layers = 1__0"),
    "trailing-underscore": ("model gpt", "layers = 1_"),
    "underscore-before-point": ("train", "optimizer = sgd(lr = 1_.5)"),
    "underscore-before-exponent": ("train", "optimizer = sgd(lr = 1_e5)"),
    "trailing-underscore-float": ("train", "optimizer = sgd(lr = 0.5_)"),
    "5000-digit-integer": ("train", "seed = " + "9" * 5000),
    "400-digit-size": ("optimize", "bucket = 1" + "0" * 400 + "MB"),
    "400-digit-time": ("topology { intra", "latency = 1" + "0" * 400 + "us }"),
    "400-digit-real": ("train", "optimizer = sgd(lr = 1" + "0" * 400 + ")"),
    "400-digit-beta": ("train", "optimizer = adamw(lr = 0.1, betas = [1" + "0" * 400 + ", 0.9])"),
    "400-digit-efficiency": ("topology { device", "efficiency = 1" + "0" * 400 + " }"),
}


@pytest.mark.parametrize("block, entry", list(HOSTILE_LITERALS.values()),
                         ids=list(HOSTILE_LITERALS))
def test_hostile_number_literals_are_diagnosed(block, entry):
    text = f"plan p {{\n  {block} {{\n    {entry}\n  }}\n}}\n"
    try:
        loaded = load_text(text, "n.plan")
    except BaseException as exc:  # noqa: BLE001
        raise AssertionError(f"load_text raised {exc!r} on {entry[:60]!r}") from exc
    check_loaded(loaded, text)
    assert any(d.is_error and d.span and d.span.line == 3 for d in loaded.diagnostics), \
        loaded.diagnostics
