"""Benchmark: diagnostics cost O(problems + size), on five hostile inputs (issue 11).

- 10,000 unknown keys in `mesh { }`, on one line (`k0 = 0; k1 = 1; ...`);
- 10,000 duplicate keys (`tp = 2` once per line);
- 10,000 syntax errors (`k0 = = 0`, once per line), every one of them counted;
- a 10 MB file on a single line (the plan on one line, with a 10 MB string in it);
- 100,000 nested brackets.

Each case is read, checked and printed as `planc check` does (text, the first 20
diagnostics and the summary line), in this process; the time is the median of
``--repeat`` runs. Goal: under 1 s per MB of input on a 2-core machine. A second table
doubles each case to show the growth is linear (ratio near 2, where quadratic code
gives 4).

    .venv/bin/python bench/diagnostics.py [--repeat N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from planc.host.collector import without_collector  # noqa: E402
from planc.diagnostics import MAX_SHOWN, render_text, summary_line  # noqa: E402
from planc.lang import load_text  # noqa: E402

BASE = (Path(__file__).resolve().parents[1] / "plans" / "gpt-tiny.plan").read_text()
MESH = "    tp = 2\n"


def unknown_keys(n: int) -> str:
    return BASE.replace(MESH, MESH.rstrip("\n") + "; " + "; ".join(
        f"k{i} = {i}" for i in range(n)) + "\n", 1)


def duplicate_keys(n: int) -> str:
    return BASE.replace(MESH, MESH * (n + 1), 1)


def syntax_errors(n: int) -> str:
    return BASE.replace(MESH, MESH + "".join(f"    k{i} = = {i}\n" for i in range(n)), 1)


def single_line(megabytes: float) -> str:
    """The whole plan on one line of ~``megabytes`` MB: in `mesh { }`, an unknown key whose
    value is one long string, then a duplicate key after it, so that diagnostics point
    at both ends of the line."""
    flat = []
    for line in BASE.splitlines():
        code = line.split("#")[0].strip()
        if code:
            flat.append(code)
    text = " ".join(f"{c};" if not c.endswith("{") else c for c in flat)
    assert "tp = 2;" in text and "\n" not in text
    long = '"' + "x" * int(megabytes * 1e6) + '"'
    return text.replace("tp = 2;", f"tp = 2; notes = {long}; tp = 2;", 1) + "\n"


def nested(n: int) -> str:
    return BASE.replace(MESH, MESH + "    x = " + "[" * n + "]" * n + "\n", 1)


CASES = {
    "10k unknown keys (one line)": lambda scale: unknown_keys(10_000 * scale),
    "10k duplicate keys": lambda scale: duplicate_keys(10_000 * scale),
    "10k syntax errors": lambda scale: syntax_errors(10_000 * scale),
    "10 MB on a single line": lambda scale: single_line(10 * scale),
    "100k nested brackets": lambda scale: nested(100_000 * scale),
}


@without_collector  # as planc.commands.load_plan runs
def check_and_print(text: str) -> tuple[int, int]:
    """What `planc check` does with a file: its diagnostics, and their printed length."""
    loaded = load_text(text, "hostile.plan")
    shown = render_text(loaded.diagnostics, "hostile.plan", loaded.source, limit=MAX_SHOWN)
    return len(loaded.diagnostics), len(shown) + len(summary_line(loaded.diagnostics))


def measure(text: str, repeat: int) -> tuple[float, int, int]:
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        found, printed = check_and_print(text)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples), found, printed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    load_text(BASE)  # build the parser's tables once, outside the timings

    print(f"{'case':30} {'size':>9} {'found':>7} {'printed':>8} {'time':>8} {'s/MB':>6}  "
          f"goal (< 1 s/MB)")
    failed = 0
    rows = []
    for name, make in CASES.items():
        text = make(1)
        seconds, found, printed = measure(text, args.repeat)
        per_mb = seconds / (len(text.encode()) / 1e6)
        ok = per_mb < 1.0
        failed += not ok
        rows.append((name, seconds))
        print(f"{name:30} {len(text.encode()) / 1e6:7.2f}MB {found:7d} {printed:7d}B "
              f"{seconds:7.3f}s {per_mb:6.2f}  {'ok' if ok else 'MISSED'}")

    print(f"\n{'doubled':30} {'time':>8} {'ratio':>6}  (linear: about 2; quadratic: 4)")
    for name, seconds in rows:
        doubled, _, _ = measure(CASES[name](2), args.repeat)
        print(f"{name:30} {doubled:7.3f}s {doubled / seconds:6.2f}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
