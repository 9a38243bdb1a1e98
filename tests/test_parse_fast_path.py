"""The parser's fast path (planc/lang/lalr.py) changes nothing but the time it takes.

``key = value`` entries with a one-token value are matched whole and, once a block's
cycle is known, appended without running the machine. Every input here is parsed both
ways, and the trees (spans included), the diagnostics and the refusals must be equal.
"""

from __future__ import annotations

import random

import pytest

from planc.lang import lalr
from planc.lang.parser import MAX_NESTING, _tables, parse
from tests.conftest import PLANS
from tests.test_fuzz import TEXT_MUTATORS

INVALID = PLANS.parent / "tests" / "invalid"
MODEL = "model gpt { layers = 4; hidden = 64; heads = 4; vocab = 256; seq = 32; batch = 16 }"


def both_ways(text: str):
    fast = parse(text, fast=True)
    general = parse(text, fast=False)
    assert fast == general
    return fast


def test_the_grammar_has_the_shape_the_fast_path_takes():
    # if a grammar change broke the shape, the fast path would silently turn off
    assert _tables().entry is not None


@pytest.mark.parametrize("path", sorted(PLANS.glob("*.plan")) + sorted(INVALID.glob("*.plan")),
                         ids=lambda p: p.name)
def test_every_plan_parses_the_same_both_ways(path):
    both_ways(path.read_bytes().decode("utf-8", errors="replace"))


EDGES = {
    "crlf": "plan p {\r\n  a = 1\r\n  b = x\r\n  c = \"s\"\r\n}\r\n",
    "comments after values": "plan p {\n  a = 1 # one\n  b = 2# two\n  c = 3 #\n}\n",
    "semicolons and blank lines": "plan p { a = 1; b = 2;; c = 3\n\n\n d = 4; }\n",
    "the last entry before the brace": "plan p { a = 1; b = 2 }\n",
    "a keyword as a key": "plan p {\n  plan = 1\n  a = 2\n}\n",
    "keyword arguments over lines": "plan p {\n  o = f(a = 1\n, b = 2\n)\n  c = 3\n}\n",
    "a list over lines": "plan p {\n  o = [1\n, 2\n]\n  c = 3\n}\n",
    "a dashed word": "plan p {\n  o = dgx-a100\n  c = 3\n}\n",
    "a string with a separator in it": 'plan p {\n  a = "x;y\\"z"\n  b = "#"\n}\n',
    "numbers with tails": "plan p {\n  a = 25GB/s\n  b = 1f1b\n  c = 1__0\n  d = 9" + "9" * 200
    + "\n}\n",
    "an entry outside the plan": "a = 1\nplan p { b = 2 }\n",
    "an entry after the plan": "plan p { b = 2 }\na = 1\n",
    "an equal sign too many": "plan p {\n  a = b = 1\n  c = 2\n}\n",
    "nested blocks": f"plan p {{\n  {MODEL}\n  mesh {{\n    tp = 2\n    dp = 2\n  }}\n"
    "  shard { dp { zero = 1 } }\n  x = 1\n}\n",
    "no new line at the end": "plan p {\n  a = 1\n  b = 2\n}",
    "an unterminated string": 'plan p {\n  a = "x\n  b = 2\n}\n',
    "a form feed and a vertical tab": "plan p {\n  a =\f1\n  b = 2\v\n}\n",
    "blocks on one line": "plan p { model gpt { a = 1; b = 2 } mesh { c = 3; d = 4; } }\n",
}


@pytest.mark.parametrize("text", EDGES.values(), ids=EDGES.keys())
def test_edge_cases_parse_the_same_both_ways(text):
    both_ways(text)


def test_a_long_block_parses_the_same_both_ways_with_exact_spans():
    text = "plan p {\n" + "".join(f"  k{i} = {i}\n" for i in range(300)) + "  s = \"x\"; w = y\n}\n"
    tree, diagnostics = both_ways(text)
    assert diagnostics == []
    assert len(tree.entries) == 302
    last_number = tree.entries[299]
    assert (last_number.key, last_number.value.value) == ("k299", 299)
    assert (last_number.key_span.line, last_number.key_span.column,
            last_number.key_span.end_column) == (301, 3, 7)
    assert (last_number.span.column, last_number.span.end_column) == (3, 13)
    string, word = tree.entries[300:]
    assert (string.value.value, string.value.span.column, string.value.span.end_column) == (
        "x", 7, 10)
    assert (word.value.text, word.span.line, word.span.column) == ("y", 302, 12)


def test_a_refusal_is_the_same_both_ways():
    text = "plan p {\n" + "".join(f"  k{i} = {i}\n" for i in range(50)) + "  k = ]\n}\n"
    for fast in (True, False):
        with pytest.raises(lalr.Stop) as stop:
            lalr.parse(text, _tables(), MAX_NESTING, fast)
        assert (stop.value.kind, stop.value.piece) == ("RSQB", ("]", 52, 7, 52, 8))


def test_mutants_parse_the_same_both_ways():
    rng = random.Random(20261123)
    bases = [p.read_text() for p in sorted(PLANS.glob("*.plan"))]
    for _ in range(1500):
        text = rng.choice(bases)
        for _ in range(rng.randint(1, 3)):
            text = rng.choice(TEXT_MUTATORS)(rng, text)
            if isinstance(text, bytes):
                text = text.decode("utf-8", errors="replace")
        both_ways(text)
