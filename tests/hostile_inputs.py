"""Hostile inputs for the real ``planc`` command line, and a driver that runs them.

Shared by tests/test_hostile.py (a few hundred runs, well under a minute) and
bench/hostile.py (thousands, with a report and reproducers under build/hostile/).

An *input* is a :class:`Case`: the bytes of a plan file, the special files that lie beside
it (named pipes, symbolic-link loops, sparse multi-GB files, directories, sockets,
calibrated topologies, token files) and one command line: ``planc check FILE``,
``planc check FILE --error-format json`` or ``planc compile FILE -o DIR`` (and, for the
``usage`` and ``file-name`` kinds, other argument lists). Inputs are generated
deterministically: the extremes are a fixed list, the mutants come from a seeded
``random.Random`` applied to plans/*.plan and tests/invalid/*.plan.

Every input runs in a child process of its own, under a wall-clock limit and an
address-space limit (RLIMIT_AS; also RLIMIT_FSIZE on what it writes and no core files):

- ``fork`` mode: the driver has imported planc once and forks; the child sets its limits,
  points its standard output and error at files and does what the ``planc`` console
  script does: ``sys.exit(planc.cli.main(argv))``, an uncaught exception printing its
  traceback and giving status 1. Start-up costs a few milliseconds instead of ~0.3 s.
- ``exec`` mode: the child sets the same limits and execs the real ``planc`` console
  script next to ``sys.executable`` (a fresh interpreter), as ``subprocess`` with a
  ``preexec_fn`` would.

What every run must do, whatever the input (:func:`problems`):

- no Python traceback ("Traceback (most recent call last)") on stdout or stderr, and no
  "Fatal Python error";
- exit status 0, 1 or 2, which planc/cli.py and planc/commands/__init__.py define as:
  0 success (warnings allowed), 1 errors in the input or a file that cannot be read,
  2 a wrong command line (argparse's usage errors, a malformed ``--set``);
- finish within the time limit, and not die of a signal;
- no memory blow-up: no MemoryError, no death under the address-space limit;
- ``--error-format json``: standard output is empty or one JSON document;
- a non-zero status says why (something on stderr or stdout);
- where a case names the statuses it may end with (``expect``, from the documentation),
  one of those.

Run as a script, this module is the driver: ``python tests/hostile_inputs.py drive
JOBS.json RESULTS.json``.
"""

from __future__ import annotations

import gc
import json
import math
import os
import random
import re
import resource
import shlex
import signal
import socket
import sys
import time
import traceback
from collections import Counter, deque
from dataclasses import asdict, dataclass
from pathlib import Path

from planc.lang import MAX_FILE_BYTES  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PLANS = ROOT / "plans"
INVALID = ROOT / "tests" / "invalid"

SEED = 20250611
# What an input may take: TIME_LIMIT seconds of CPU (RLIMIT_CPU in the child: a runaway
# computation costs the same CPU on an idle or a loaded machine, so the verdict does not
# depend on what else runs), and WALL_FACTOR times as long on the clock (a child that
# waits without computing: a lock, a FIFO, a sleep).
TIME_LIMIT = 20.0
WALL_FACTOR = 6
MEMORY_LIMIT = 2 << 30  # bytes of address space per input
OUTPUT_LIMIT = 1 << 30  # bytes a run may write to one file (its stdout, a build file)
GiB, MiB = 1 << 30, 1 << 20
MAX_PLAN_BYTES = MAX_FILE_BYTES  # as documented in docs/language.md
MAX_TOPOLOGY_BYTES = 1 * MiB  # planc.lang.check.MAX_TOPOLOGY_BYTES

COMMANDS = ("check", "check-json", "compile")
STATUSES = (0, 1, 2)

# Every character Python's str.splitlines() breaks a line at, and the two line endings.
SEPARATORS = {"FF": "\f", "VT": "\v", "FS": "\x1c", "GS": "\x1d", "RS": "\x1e",
              "NEL": "\x85", "LS": "\u2028", "PS": "\u2029", "CR": "\r", "CRLF": "\r\n"}

# A small valid plan (world 4, one node) that most extremes are made from.
BASE = """\
# hostile-input base plan
plan hostile {
  model gpt {
    layers = 2
    hidden = 64
    heads = 4
    vocab = 256
    seq = 32
    batch = 8
  }
  mesh { tp = 2; dp = 2 }
  topology { nodes = 1; devices_per_node = 4 }
  schedule { microbatches = 2 }
  train {
    steps = 1
    optimizer = adamw(lr = 1e-3, betas = [0.9, 0.95])
    data = synthetic
  }
}
"""

# Examples small enough that compiling a mutant stays well under a second.
SMALL_EXAMPLES = ("cp-ring-attention", "dp-only", "gpt-tiny", "llama-tiny", "pp-interleaved",
                  "tp-sequence-parallel", "unusual-placements", "zero3")


# --- inputs ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One hostile input: a plan file, what lies beside it, and one command line.

    ``files`` entries are ``(relative path, what, argument)`` with ``what`` one of
    ``bytes`` (argument: the content), ``fifo``, ``dir``, ``socket``, ``symlink``
    (argument: the target) or ``sparse`` (argument: ``(size, leading bytes)``).
    ``plan`` is the content of ``input.plan``; ``plan_path`` may name something else
    (a special file of ``files``, or an absolute path such as /dev/zero).
    ``command`` is check, check-json, compile, or ``args``: the arguments alone, where
    ``{plan}`` and ``{dir}`` stand for the plan's path and the case's directory.
    """

    kind: str
    name: str
    command: str
    plan: bytes | None = None
    files: tuple = ()
    args: tuple = ()
    plan_path: str = "input.plan"
    mode: str = "fork"
    expect: tuple = STATUSES
    note: str = ""

    def argv(self, directory: str) -> list[str]:
        plan = self.plan_path if os.path.isabs(self.plan_path) else os.path.join(
            directory, self.plan_path)
        if self.command == "check":
            return ["check", plan, *self.args]
        if self.command == "check-json":
            return ["check", plan, "--error-format", "json", *self.args]
        if self.command == "compile":
            return ["compile", plan, "-o", os.path.join(directory, "build"), *self.args]
        assert self.command == "args", self.command
        return [a.replace("{plan}", plan).replace("{dir}", directory) for a in self.args]


def materialize(case: Case, directory: str | os.PathLike) -> str:
    """Create the case's files in ``directory`` (made here); returns the directory."""
    directory = str(directory)
    os.makedirs(directory, exist_ok=True)
    if case.plan is not None:
        with open(os.path.join(directory, "input.plan"), "wb") as out:
            out.write(case.plan)
    for relative, what, argument in case.files:
        path = os.path.join(directory, relative)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if what == "bytes":
            with open(path, "wb") as out:
                out.write(argument)
        elif what == "fifo":
            os.mkfifo(path)
        elif what == "dir":
            os.makedirs(path, exist_ok=True)
        elif what == "socket":
            server = socket.socket(socket.AF_UNIX)
            try:
                server.bind(os.path.relpath(path))  # sun_path holds 108 bytes at most
            except OSError:
                server.bind(path)
            finally:
                server.close()
        elif what == "symlink":
            os.symlink(argument, path)
        elif what == "sparse":
            size, lead = argument
            with open(path, "wb") as out:
                out.write(lead)
                out.truncate(size)
        else:
            raise ValueError(f"unknown special file {what!r}")
    return directory


def reproducer(case: Case, directory: str | os.PathLike, problem: str = "") -> str:
    """Save the case under ``directory`` as files plus a ``repro.sh`` that recreates
    the special files and runs the command; returns the script's path."""
    directory = str(directory)
    os.makedirs(directory, exist_ok=True)
    lines = ["#!/bin/sh", f"# kind: {case.kind}; input: {case.name}"]
    lines += [f"# {line}" for line in (case.note, problem) if line]
    lines += ['cd "$(dirname "$0")"', "PLANC=${PLANC:-planc}",
              "rm -rf build fifo* loop* sock* 2>/dev/null"]
    if case.plan is not None:
        with open(os.path.join(directory, "input.plan"), "wb") as out:
            out.write(case.plan)
    for relative, what, argument in case.files:
        q = shlex.quote(relative)
        parent = os.path.dirname(relative)
        if parent:
            lines.append(f"mkdir -p {shlex.quote(parent)}")
        if what == "bytes":
            path = os.path.join(directory, relative)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as out:
                out.write(argument)
        elif what == "fifo":
            lines.append(f"rm -f {q}; mkfifo {q}")
        elif what == "dir":
            lines.append(f"mkdir -p {q}")
        elif what == "socket":
            lines.append(f"rm -f {q}; python3 -c 'import socket,sys; "
                         f"socket.socket(socket.AF_UNIX).bind(sys.argv[1])' {q}")
        elif what == "symlink":
            lines.append(f"rm -f {q}; ln -s {shlex.quote(argument)} {q}")
        elif what == "sparse":
            size, lead = argument
            octal = "".join("\\%03o" % b for b in lead)
            lines.append(f"rm -f {q}; printf '{octal}' > {q}; truncate -s {size} {q}")
    argv = case.argv(".")
    shown = " ".join(shlex.quote(a) for a in argv)
    if len(shown) > 2000:
        with open(os.path.join(directory, "args.json"), "w") as out:
            json.dump(argv, out)
        lines.append('python3 -c \'import json,os,sys; a=json.load(open("args.json")); '
                     'os.execvp(sys.argv[1], [sys.argv[1]] + a)\' "$PLANC"')
    else:
        lines.append(f'"$PLANC" {shown}')
    lines.append("echo \"exit status $?\"")
    script = os.path.join(directory, "repro.sh")
    with open(script, "w") as out:
        out.write("\n".join(lines) + "\n")
    os.chmod(script, 0o755)
    return script


def _with(text: str, old: str, new: str) -> str:
    assert old in text, old
    return text.replace(old, new, 1)


def _b(text: str) -> bytes:
    return text.encode("utf-8", errors="surrogatepass")


# A small valid token file: 1,024 raw uint16 tokens, all below BASE's vocab of 256.
TOKENS = bytes(b for i in range(1024) for b in (i % 256, 0))


def _header(width: int, version: int = 1) -> bytes:
    return b"PLANCTOK" + version.to_bytes(4, "little") + width.to_bytes(4, "little") + bytes(16)


CALIBRATED = {
    "format": "planc-topology", "version": 1, "name": "hostile machine", "devices_per_node": 2,
    "device": {"flops": 4e10, "memory": None, "efficiency": 1.0},
    "intra": {"bandwidth": 1e9, "latency": 1e-4,
              "collectives": {"all_reduce": {"bandwidth": 5e8, "latency": 2e-3}}},
    "inter": {"bandwidth": 1e8, "latency": 5e-4, "collectives": {}},
    "measured": {},
}


def _data_plan(path: str) -> bytes:
    return _b(_with(BASE, "data = synthetic", f"data = {path}"))


def _topology_plan(path: str) -> bytes:
    return _b(_with(BASE, "topology { nodes = 1; devices_per_node = 4 }",
                    f"topology {{ preset = {path}; nodes = 2 }}"))


def _json(value) -> bytes:
    return json.dumps(value).encode()


def _deep_json(depth: int) -> bytes:
    return b'{"format": "planc-topology", "version": 1, "devices_per_node": 2, "device": ' + \
        b"[" * depth + b"]" * depth + b"}"


def _calibrated(**change) -> bytes:
    document = json.loads(json.dumps(CALIBRATED))
    for dotted, value in change.items():
        *parents, last = dotted.split("__")
        target = document
        for parent in parents:
            target = target[parent]
        target[last] = value
    return json.dumps(document).encode()


def _raw_number(document: bytes, key: bytes, literal: bytes) -> bytes:
    return re.sub(rb'("' + key + rb'": )[^,}]+', lambda m: m.group(1) + literal, document,
                  count=1)


def extreme_cases() -> list[tuple[str, str, str, dict]]:
    """Every deliberate extreme as ``(tier, kind, name, Case fields)``, in a fixed order.

    ``tier`` is ``test`` for the inputs tests/test_hostile.py runs (each takes well under
    a second on a 2-core machine unless planc misbehaves) and ``bench`` for the heavier or
    more redundant ones only bench/hostile.py runs. The command is chosen by
    :func:`extremes` (the tests rotate through the commands, the bench runs each input
    under all three)."""
    out: list[tuple[str, str, str, dict]] = []

    def add(kind: str, name: str, plan=None, tier: str = "test", **fields):
        if isinstance(plan, str):
            plan = _b(plan)
        out.append((tier, kind, name, dict(plan=plan, **fields)))

    ok = (0,)
    # -- the base itself, so a broken base shows at once
    add("baseline", "base-plan", BASE, expect=ok)
    add("baseline", "base-plan-crlf", BASE.replace("\n", "\r\n"), expect=ok)

    # -- huge numbers
    huge = {"1e6": "1000000", "2^53": str(2**53), "2^53+1": str(2**53 + 1),
            "2^64": str(2**64), "100-digits": "9" * 100, "101-digits": "9" * 101,
            "4300-digits": "9" * 4300, "4301-digits": "9" * 4301,
            "100k-digits": "9" * 100_000,
            "underscored-1k": "_".join(["999"] * 1000), "zeros-then-1": "0" * 5000 + "1"}
    for label, number in huge.items():
        add("huge-number", f"layers-{label}", _with(BASE, "layers = 2", f"layers = {number}"))
    add("huge-number", "layers-1M-digits", _with(BASE, "layers = 2", "layers = " + "9" * 1_000_000),
        tier="bench")
    for label, number in (("4301-digits", "9" * 4301), ("100k-digits", "9" * 100_000)):
        add("huge-number", f"seed-{label}", _with(BASE, "steps = 1", f"steps = 1; seed = {number}"))
        add("huge-number", f"microbatches-{label}",
            _with(BASE, "microbatches = 2", f"microbatches = {number}"))
    reals = {"1e308": "1e308", "1e309": "1e309", "1e-400": "1e-400",
             "1e99999": "1e99999", "long-mantissa": "0." + "0" * 100_000 + "1",
             "long-exponent": "1e" + "9" * 5000}
    for label, number in reals.items():
        add("huge-number", f"lr-{label}", _with(BASE, "lr = 1e-3", f"lr = {number}"))
    for label, quantity in (("bucket-1e400MB", "1" + "0" * 400 + "MB"),
                            ("bucket-1e308PB", "1e308PB"), ("bucket-9x4301-B", "9" * 4301 + "B")):
        add("huge-number", label, _with(BASE, "schedule { microbatches = 2 }",
                                        f"schedule {{ microbatches = 2 }}\n  optimize {{ bucket = {quantity} }}"))
    add("huge-number", "latency-1e-999us", _with(
        BASE, "devices_per_node = 4 }", "devices_per_node = 4; intra { latency = 1e-999us } }"))
    add("huge-number", "product-beyond-2^53", _with(BASE, "layers = 2",
                                                   "layers = 99999999 * 99999999 * 99999999"))
    add("huge-number", "power-tower-2^1000", _with(BASE, "layers = 2",
                                                  "layers = " + " * ".join(["2"] * 1000)))
    add("huge-number", "min-int64", _with(BASE, "layers = 2", "layers = -9223372036854775808"))
    add("huge-number", "efficiency-1e400", _with(
        BASE, "devices_per_node = 4 }", "devices_per_node = 4; device { efficiency = 1e400 } }"))

    # -- unicode identifiers, names and strings
    unicode_edits = {
        "plan-name-greek": ("plan hostile", "plan π"),
        "plan-name-cjk": ("plan hostile", "plan 日本語"),
        "plan-name-nfd": ("plan hostile", "plan e\u0301te\u0301"),
        "plan-name-astral": ("plan hostile", "plan 𝓅𝓁𝒶𝓃"),
        "plan-name-100k": ("plan hostile", "plan " + "é" * 100_000),
        "key-cyrillic-a": ("layers = 2", "l\u0430yers = 2"),
        "key-fullwidth": ("layers = 2", "ｌａｙｅｒｓ = 2"),
        "key-dotless-i": ("heads = 4", "head\u0131 = 4"),
        "key-zero-width": ("layers = 2", "lay\u200bers = 2"),
        "key-combining": ("layers = 2", "layers\u0301 = 2"),
        "block-greek": ("mesh {", "μesh {"),
        "enum-fullwidth": ("microbatches = 2", "microbatches = 2; pipeline = 1f1\uff42"),
        "enum-zwsp": ("batch = 8", "batch = 8\n    dtype = bf16\u200b"),
        "digit-arabic-indic": ("layers = 2", "layers = \u0662"),
        "digit-superscript": ("layers = 2", "layers = \u00b2"),
        "digit-math-bold": ("layers = 2", "layers = \U0001d7d0"),
        "digit-fullwidth": ("hidden = 64", "hidden = 6\uff14"),
        "unit-kelvin-sign": ("microbatches = 2 }", "microbatches = 2 }\n  optimize { bucket = 1\u212aB }"),
        "unit-micro-sign": ("devices_per_node = 4 }", "devices_per_node = 4; intra { latency = 2\u00b5s } }"),
        "unit-greek-mu": ("devices_per_node = 4 }", "devices_per_node = 4; intra { latency = 2\u03bcs } }"),
        "rtl-override-comment": ("# hostile-input base plan", "# \u202eplan evil\u202c"),
        "rtl-override-key": ("layers = 2", "\u202elayers = 2"),
        "emoji-comment": ("# hostile-input base plan", "# 🚀🔥" * 1000),
        "emoji-key": ("layers = 2", "🚀 = 2"),
        "data-cjk": ("data = synthetic", 'data = "データ/トークン.bin"'),
        "data-lone-surrogate-escape": ("data = synthetic", r'data = "\ud800.bin"'),
        "data-low-surrogate-escape": ("data = synthetic", r'data = "\udcff"'),
        "data-nul-escape": ("data = synthetic", r'data = "a\x00b"'),
        "data-u0000-escape": ("data = synthetic", r'data = "\u0000"'),
        "data-newline-escape": ("data = synthetic", r'data = "a\nb"'),
        "data-bad-escape": ("data = synthetic", r'data = "\N{NO SUCH NAME}"'),
        "data-named-escape": ("data = synthetic", r'data = "\N{LATIN SMALL LETTER E WITH ACUTE}.bin"'),
        "data-truncated-escape": ("data = synthetic", r'data = "\u12"'),
        "data-octal-escape": ("data = synthetic", r'data = "\777"'),
        "preset-lone-surrogate-escape": ("nodes = 1; devices_per_node = 4", r'preset = "\ud800"'),
        "preset-nul-escape": ("nodes = 1; devices_per_node = 4", r'preset = "\x00"'),
    }
    for label, (old, new) in unicode_edits.items():
        add("unicode", label, _with(BASE, old, new))
    add("unicode", "surrogate-bytes", _b(BASE).replace(b"hostile {", b"hostile\xed\xa0\x80 {"))
    add("unicode", "overlong-utf8", _b(BASE).replace(b"hostile {", b"hostile\xc0\xaf {"))
    add("unicode", "latin1-comment", _b(BASE).replace(b"base plan", b"base pl\xe4n"))

    # -- NUL bytes
    for label, (old, new) in {
            "in-comment": ("base plan", "base\x00plan"),
            "in-string": ("data = synthetic", 'data = "a\x00b"'),
            "between-tokens": ("layers = 2", "layers =\x002"),
            "in-identifier": ("layers = 2", "lay\x00ers = 2"),
            "after-plan": ("}\n}\n", "}\n}\n\x00"),
            "line-of-nuls": ("  mesh {", "\x00" * 1000 + "\n  mesh {")}.items():
        add("nul", label, _with(BASE, old, new))
    add("nul", "at-start", "\x00" + BASE)
    add("nul", "only-nul", b"\x00")
    add("nul", "1MiB-of-nul", b"\x00" * MiB)
    add("nul", "nul-every-char", "\x00".join(BASE))

    # -- byte-order marks and encodings
    bom = b"\xef\xbb\xbf"
    add("bom", "utf8-bom", bom + _b(BASE), expect=ok)
    add("bom", "utf8-bom-twice", bom + bom + _b(BASE))
    add("bom", "utf8-bom-mid-file", _b(BASE).replace(b"  mesh", bom + b"  mesh"))
    add("bom", "utf8-bom-in-string", _b(BASE).replace(b"data = synthetic",
                                                     b'data = "' + bom + b't.bin"'))
    add("bom", "utf8-bom-only", bom)
    add("bom", "utf8-bom-crlf", bom + _b(BASE.replace("\n", "\r\n")), expect=ok)
    add("bom", "utf16-le", BASE.encode("utf-16"))
    add("bom", "utf16-be", b"\xfe\xff" + BASE.encode("utf-16-be"))
    add("bom", "utf32", BASE.encode("utf-32"))

    # -- line endings
    add("line-endings", "cr-only", BASE.replace("\n", "\r"))
    add("line-endings", "mixed", "".join(line + ("\r\n" if i % 2 else "\n")
                                         for i, line in enumerate(BASE.splitlines())))
    add("line-endings", "cr-cr-lf", BASE.replace("\n", "\r\r\n"))
    add("line-endings", "lf-cr", BASE.replace("\n", "\n\r"))
    add("line-endings", "no-final-newline", BASE.rstrip("\n"), expect=ok)
    add("line-endings", "final-cr", BASE.rstrip("\n") + "\r")
    add("line-endings", "crlf-in-list", _with(BASE, "betas = [0.9, 0.95]",
                                              "betas = [\r\n0.9,\r\n 0.95\r\n]").replace("\n", "\r\n"))
    add("line-endings", "cr-in-string", _with(BASE, "data = synthetic", 'data = "a\rb"'))
    for n, tier in ((20_000, "test"), (100_000, "bench")):
        add("line-endings", f"{n // 1000}k-blank-lines", _with(BASE, "  mesh", "\n" * n + "  mesh"),
            tier=tier)
        add("line-endings", f"{n // 1000}k-crlf-lines", _with(BASE, "  mesh", "\r\n" * n + "  mesh"),
            tier=tier)

    # -- very long lines and the file size limit
    add("long-line", "comment-1MiB", _with(BASE, "base plan", "x" * MiB))
    add("long-line", "comment-8MiB-then-error", _with(BASE, "base plan", "x" * (8 * MiB))
        .replace("heads = 4", "heads = 5"))
    add("long-line", "string-1MiB", _with(BASE, "data = synthetic", 'data = "' + "d" * MiB + '"'))
    add("long-line", "unterminated-string-1MiB", _with(BASE, "data = synthetic",
                                                       'data = "' + "d" * MiB))
    add("long-line", "key-100k", _with(BASE, "layers = 2", "layers = 2; " + "k" * 100_000 + " = 1"))
    add("long-line", "blanks-10MiB", _with(BASE, "layers = 2", "layers =" + " " * (10 * MiB) + "2"))
    for n, tier in ((20_000, "test"), (100_000, "bench")):
        add("long-line", f"semicolons-{n // 1000}k", _with(BASE, "layers = 2", "layers = 2" + ";" * n),
            tier=tier)
        add("long-line", f"list-{n // 1000}k", _with(BASE, "betas = [0.9, 0.95]",
                                                     "betas = [" + ", ".join(["0.9"] * n) + "]"), tier=tier)
        add("long-line", f"stages-{n // 1000}k", _with(BASE, "schedule", "shard { pp { stages = [" +
                                                       ", ".join(f"{i}..{i}" for i in range(n)) +
                                                       "] } }\n  schedule"), tier=tier)
    padded = _b(BASE) + b"#" + b"p" * (MAX_PLAN_BYTES - len(_b(BASE)) - 2) + b"\n"
    assert len(padded) == MAX_PLAN_BYTES
    add("long-line", "file-exactly-the-limit", padded, expect=ok)
    add("long-line", "file-the-limit-plus-1", padded + b"\n", expect=(1,))
    add("long-line", "file-the-limit-of-nul", b"\x00" * MAX_PLAN_BYTES)

    # -- files at the size limit made of the cheapest tokens: what does a maximal file cost?
    def filled(unit: str, before: str = "  mesh") -> bytes:
        room = MAX_PLAN_BYTES - len(_b(BASE)) - 2
        return _b(_with(BASE, before, unit * (room // len(_b(unit))) + "\n" + before))

    for label, unit, tier in (("blank-lines", "\n", "test"), ("unknown-keys", "k = 1\n", "test"),
                              ("semicolons", ";", "bench"), ("crlf-lines", "\r\n", "bench"),
                              ("comment-lines", "#\n", "bench"), ("spaces", " ", "bench"),
                              ("formfeeds", "\f", "bench"), ("line-separators", "\u2028", "bench")):
        add("big-file", f"limit-of-{label}", filled(unit), tier=tier)
    add("big-file", "4MiB-string", _with(BASE, "data = synthetic", 'data = "' + "d" * (4 * MiB) + '"'))
    add("big-file", "limit-string-value", _b(_with(BASE, "data = synthetic", 'data = "' + "d" * (
        MAX_PLAN_BYTES - len(_b(BASE)) - 16) + '"')), tier="bench")
    add("big-file", "limit-of-plus-chain", _with(BASE, "layers = 2", "layers = " + "+".join(
        ["1"] * ((MAX_PLAN_BYTES - len(_b(BASE))) // 2 - 8))), tier="bench")

    # -- deep nesting
    for n in (64, 65, 1000, 100_000):
        add("deep-nesting", f"brackets-{n}", _with(BASE, "schedule", "shard { pp { stages = " +
                                                   "[" * n + "0..1" + "]" * n + " } }\n  schedule"))
    add("deep-nesting", "unclosed-brackets-100k", _with(BASE, "schedule",
                                                        "shard { pp { stages = " + "[" * 100_000 + "\n  schedule"))
    add("deep-nesting", "closing-brackets-100k", _with(BASE, "layers = 2", "layers = 2" + "]" * 100_000))
    for n in (64, 199, 200, 201, 100_000):
        add("deep-nesting", f"parens-{n}", _with(BASE, "layers = 2", "layers = " + "(" * n + "2" + ")" * n))
    add("deep-nesting", "unclosed-parens-100k", _with(BASE, "layers = 2", "layers = " + "(" * 100_000 + "2"))
    for n in (64, 65, 1000, 100_000):
        add("deep-nesting", f"blocks-{n}", _with(BASE, "schedule", "shard { " + "tp { " * n +
                                                 "}" * n + " }\n  schedule"))
    add("deep-nesting", "unclosed-blocks-100k", _with(BASE, "schedule", "x {" * 100_000 + "\n  schedule"))
    add("deep-nesting", "closing-braces-100k", BASE + "}" * 100_000)
    for n in (2, 199, 200, 201, 1000, 20_000, 100_000):
        expression = "- " * n + "2" if n % 2 == 0 else "- " * n + "-2"
        add("deep-nesting", f"unary-minus-{n}", _with(BASE, "layers = 2", f"layers = {expression}"),
            tier="bench" if n > 20_000 else "test")
    add("deep-nesting", "unary-minus-glued-20k", _with(BASE, "layers = 2", "layers = " + "-" * 20_000 + "2"))
    add("deep-nesting", "unary-minus-glued-100k", _with(BASE, "layers = 2", "layers = " + "-" * 100_000 + "2"),
        tier="bench")
    add("deep-nesting", "unary-minus-parens-10k", _with(BASE, "layers = 2",
                                                        "layers = " + "-(" * 10_000 + "2" + ")" * 10_000))
    for n in (199, 200, 201, 1000, 20_000, 100_000):
        add("deep-nesting", f"plus-chain-{n}", _with(BASE, "layers = 2",
                                                     "layers = " + "+".join(["1"] * n) + f" - {n - 2}"),
            tier="bench" if n > 20_000 else "test")
    for n, tier in ((20_000, "test"), (100_000, "bench")):
        add("deep-nesting", f"times-chain-{n // 1000}k", _with(BASE, "layers = 2", "layers = " + "*".join(["1"] * n) + " * 2"),
            tier=tier)
        add("deep-nesting", f"names-chain-{n // 1000}k", _with(BASE, "layers = 2", "layers = " + "+".join(["heads"] * n)),
            tier=tier)
    add("deep-nesting", "division-chain-10k", _with(BASE, "hidden = 64", "hidden = 64" + " / 1" * 10_000))
    for n in (65, 10_000):
        add("deep-nesting", f"calls-{n}", _with(BASE, "optimizer = adamw(lr = 1e-3, betas = [0.9, 0.95])",
                                                "optimizer = " + "adamw(lr = " * n + "1e-3" + ")" * n))
    chain = "\n".join(f"    k{i} = k{i + 1}" for i in range(2000)) + "\n    k2000 = 2"
    add("deep-nesting", "reference-chain-2k", _with(BASE, "    layers = 2", chain + "\n    layers = k0"))
    cycle = "\n".join(f"    k{i} = k{(i + 1) % 2000}" for i in range(2000))
    add("deep-nesting", "reference-cycle-2k", _with(BASE, "    layers = 2", cycle + "\n    layers = k0"))
    add("deep-nesting", "mesh-reference-chain", _with(BASE, "mesh { tp = 2; dp = 2 }",
                                                      "mesh { tp = 2; dp = 2 * tp / 2 + 0 * (tp - tp) }"))

    # -- every line separator in every place
    places = {
        "comment": ("# hostile-input base plan", "# a comment{s}with more after it"),
        "string": ("data = synthetic", 'data = "tokens{s}.bin"'),
        "between-tokens": ("layers = 2", "layers ={s}2"),
        "line-start": ("  mesh {", "{s}  mesh {"),
        "in-list": ("betas = [0.9, 0.95]", "betas = [0.9,{s} 0.95]"),
        "entry-separator": ("layers = 2", "layers = 2{s}"),
        "end-of-file": ("}\n}\n", "}\n}{s}# after{s}"),
    }
    for label, sep in SEPARATORS.items():
        for place, (old, new) in places.items():
            text = _with(BASE, old, new.replace("{s}", sep))
            # A diagnostic after the separator: its snippet must still be the right line.
            tier = "test" if place in ("comment", "string", "between-tokens", "line-start") else "bench"
            add("separator", f"{label}-{place}", _with(text, "heads = 4", "heads = 5"), tier=tier)
            add("separator", f"{label}-{place}-clean", text, tier="bench")
        # The separator on the very line of the diagnostic, before and after its column.
        add("separator", f"{label}-before-error-column", _with(BASE, "heads = 4", f"heads ={sep}5"),
            tier="test")
        add("separator", f"{label}-after-error-column", _with(BASE, "heads = 4", f"heads = 5 #{sep}x"),
            tier="bench")
    add("separator", "all-in-one-comment", _with(BASE, "base plan", "".join(SEPARATORS.values())))
    add("separator", "all-between-every-token", re.sub(r" = ", lambda m: " =" + "".join(
        SEPARATORS.values()).replace("\n", "").replace("\r", "") + " ", BASE))

    # -- many diagnostics
    for n in (100, 1000, 3000, 10_000, 30_000):
        add("many-diagnostics", f"unknown-keys-one-line-{n}", _with(
            BASE, "mesh { tp = 2; dp = 2 }",
            "mesh { tp = 2; dp = 2; " + "; ".join(f"key{i} = 1" for i in range(n)) + " }"),
            note="known: quadratic diagnostics with thousands of unknown keys on one line",
            tier="bench" if n > 10_000 else "test")
    for n in (1000, 10_000):
        tier = "bench" if n > 1000 else "test"
        add("many-diagnostics", f"unknown-keys-own-lines-{n}", _with(
            BASE, "    layers = 2", "\n".join(f"    key{i} = 1" for i in range(n)) + "\n    layers = 2"),
            tier=tier)
        add("many-diagnostics", f"duplicate-keys-{n}", _with(
            BASE, "    layers = 2", "    layers = 2\n" * n), tier=tier)
    add("many-diagnostics", "similar-keys-one-line-3000", _with(
        BASE, "    layers = 2", "    layers = 2; " + "; ".join(f"layrs{i} = 1" for i in range(3000))))
    add("many-diagnostics", "unknown-blocks-one-line-5000", _with(
        BASE, "  mesh", "  " + " ".join(f"block{i} {{ }}" for i in range(5000)) + "\n  mesh"))
    add("many-diagnostics", "syntax-errors-10000", _with(BASE, "    layers = 2",
                                                         "    layers = = 2\n" * 10_000))
    add("many-diagnostics", "syntax-errors-one-line-10000", _with(
        BASE, "    layers = 2", "    layers = 2" + " = =" * 10_000))
    add("many-diagnostics", "semantic-errors-everywhere", _with(
        _with(_with(BASE, "heads = 4", "heads = 5"), "tp = 2", "tp = 3"), "batch = 8", "batch = 7"))

    # -- data paths: train { data = "..." } (docs/data.md)
    data = [
        ("fifo", '"fifo"', (("fifo", "fifo", None),), (1,)),
        ("dev-zero", '"/dev/zero"', (), (1,)),
        ("dev-null", '"/dev/null"', (), (1,)),
        ("dev-urandom", '"/dev/urandom"', (), (1,)),
        ("directory", '"d"', (("d", "dir", None),), (1,)),
        ("dot-slash", '"./"', (), (1,)),
        ("root", '"/"', (), (1,)),
        ("symlink-loop", '"loop-a"', (("loop-a", "symlink", "loop-b"), ("loop-b", "symlink", "loop-a")), (1,)),
        ("symlink-self", '"loop"', (("loop", "symlink", "loop"),), (1,)),
        ("symlink-dangling", '"dangling"', (("dangling", "symlink", "nowhere/at/all"),), None),
        ("symlink-to-dev-zero", '"zero"', (("zero", "symlink", "/dev/zero"),), (1,)),
        ("symlink-to-fifo", '"link"', (("fifo", "fifo", None), ("link", "symlink", "fifo")), (1,)),
        ("socket", '"sock"', (("sock", "socket", None),), (1,)),
        ("sparse-3GiB-raw", '"big.bin"', (("big.bin", "sparse", (3 * GiB, b"")),), (0,)),
        ("sparse-3GiB-plus-1", '"big.bin"', (("big.bin", "sparse", (3 * GiB + 1, b"")),), (1,)),
        ("sparse-16MiB-scanned", '"big.bin"', (("big.bin", "sparse", (16 * MiB, b"")),), (0,)),
        ("sparse-16MiB-plus-2", '"big.bin"', (("big.bin", "sparse", (16 * MiB + 2, b"")),), (0,)),
        ("sparse-5GiB-uint32", '"big.bin"', (("big.bin", "sparse", (5 * GiB + 32, _header(4))),), (0,)),
        ("sparse-5GiB-uint32-partial", '"big.bin"', (("big.bin", "sparse", (5 * GiB + 33, _header(4))),), (1,)),
        ("sparse-hole-then-large-id", '"big.bin"', (("big.bin", "sparse", (8 * MiB, b"\xff\xff" * 64)),), (1,)),
        ("header-only", '"h.bin"', (("h.bin", "bytes", _header(2)),), (1,)),
        ("header-width-8", '"h.bin"', (("h.bin", "bytes", _header(8) + bytes(800)),), (1,)),
        ("header-version-2", '"h.bin"', (("h.bin", "bytes", _header(2, 2) + bytes(800)),), (1,)),
        ("magic-only", '"h.bin"', (("h.bin", "bytes", b"PLANCTOK"),), (1,)),
        ("valid-tokens", '"t.bin"', (("t.bin", "bytes", TOKENS),), (0,)),
        ("id-too-large", '"t.bin"', (("t.bin", "bytes", TOKENS + b"\xff\xff"),), (1,)),
        ("proc-self-mem", '"/proc/self/mem"', (), None),
        ("proc-self-fd-0", '"/proc/self/fd/0"', (), (1,)),
        ("name-too-long", '"' + "n" * 5000 + '"', (), None),
        ("component-too-long", '"' + "/".join(["n" * 300] * 3) + '"', (), None),
        ("dot-dot-5000", '"' + "../" * 5000 + 'dev/zero"', (), (1,)),
        ("empty", '""', (), (1,)),
        ("the-plan-itself", '"input.plan"', (), (1,)),
        ("not-a-string", "fifo", (("fifo", "fifo", None),), (1,)),
    ]
    for label, value, files, expect in data:
        add("data-path", label, _data_plan(value), files=files, expect=expect or STATUSES)

    # -- calibrated topologies: topology { preset = "FILE" } (docs/language.md, docs/routes.md)
    good = _json(CALIBRATED)
    topology = [
        ("valid", (("machine.json", "bytes", good),), (0,)),
        ("fifo", (("machine.json", "fifo", None),), (1,)),
        ("dev-zero", (("machine.json", "symlink", "/dev/zero"),), (1,)),
        ("dev-null", (("machine.json", "symlink", "/dev/null"),), (1,)),
        ("dev-urandom", (("machine.json", "symlink", "/dev/urandom"),), (1,)),
        ("proc-self-mem", (("machine.json", "symlink", "/proc/self/mem"),), (1,)),
        ("directory", (("machine.json", "dir", None),), (1,)),
        ("symlink-loop", (("machine.json", "symlink", "machine.json"),), (1,)),
        ("dangling", (("machine.json", "symlink", "nowhere"),), (1,)),
        ("socket", (("machine.json", "socket", None),), (1,)),
        ("sparse-3GiB", (("machine.json", "sparse", (3 * GiB, b"")),), (1,)),
        ("padded-to-1MiB", (("machine.json", "bytes", good + b" " * (MAX_TOPOLOGY_BYTES - len(good))),), (0,)),
        ("padded-to-1MiB-plus-1", (("machine.json", "bytes", good + b" " * (MAX_TOPOLOGY_BYTES + 1 - len(good))),), (1,)),
        ("nested-100k", (("machine.json", "bytes", _deep_json(100_000)),), (1,)),
        ("nested-400k-bytes", (("machine.json", "bytes", b"[" * 400_000),), (1,)),
        ("flops-10^400", (("machine.json", "bytes", _raw_number(good, b"flops", b"1" + b"0" * 400)),), (1,)),
        ("flops-1e400", (("machine.json", "bytes", _raw_number(good, b"flops", b"1e400")),), (1,)),
        ("flops-5000-digits", (("machine.json", "bytes", _raw_number(good, b"flops", b"9" * 5000)),), (1,)),
        ("flops-nan", (("machine.json", "bytes", _raw_number(good, b"flops", b"NaN")),), (1,)),
        ("flops-infinity", (("machine.json", "bytes", _raw_number(good, b"flops", b"Infinity")),), (1,)),
        ("latency-10^400", (("machine.json", "bytes", _raw_number(good, b"latency", b"1" + b"0" * 400)),), (1,)),
        ("per-node-10^30", (("machine.json", "bytes", _calibrated(devices_per_node=10**30)),), (1,)),
        ("per-node-true", (("machine.json", "bytes", _calibrated(devices_per_node=True)),), (1,)),
        ("per-node-float", (("machine.json", "bytes", _calibrated(devices_per_node=2.0)),), (1,)),
        ("collective-bandwidth-10^400", (("machine.json", "bytes", _raw_number(
            _calibrated(intra__collectives__all_reduce__bandwidth=1), b"bandwidth",
            b"1" + b"0" * 400)),), (1,)),
        ("collectives-a-list", (("machine.json", "bytes", _calibrated(intra__collectives=[1, 2])),), (1,)),
        ("device-a-list", (("machine.json", "bytes", _calibrated(device=[])),), (1,)),
        ("overhead-negative", (("machine.json", "bytes", _calibrated(device__overhead=-1e-3)),), (1,)),
        ("overhead-a-string", (("machine.json", "bytes", _calibrated(device__overhead="1 ms")),), (1,)),
        ("overhead-10^400", (("machine.json", "bytes", _raw_number(
            _calibrated(device__overhead=1), b"overhead", b"1" + b"0" * 400)),), (1,)),
        ("backward-overhead-negative", (("machine.json", "bytes", _calibrated(
            device__backward_overhead=-1e-3)),), (1,)),
        ("backward-overhead-a-string", (("machine.json", "bytes", _calibrated(
            device__backward_overhead="2 ms")),), (1,)),
        ("handoff-negative", (("machine.json", "bytes", _calibrated(device__handoff=-1e-4)),), (1,)),
        ("handoff-a-list", (("machine.json", "bytes", _calibrated(device__handoff=[1])),), (1,)),
        ("exp-rate-zero", (("machine.json", "bytes", _calibrated(device__exp_rate=0)),), (1,)),
        ("exp-rate-a-string", (("machine.json", "bytes", _calibrated(device__exp_rate="1e9")),), (1,)),
        ("name-100k", (("machine.json", "bytes", _calibrated(name="é" * 100_000)),), (0,)),
        ("name-control-chars", (("machine.json", "bytes", _calibrated(name="\x00\x1b[31m\u2028")),), (0,)),
        ("a-list", (("machine.json", "bytes", b"[]"),), (1,)),
        ("not-json", (("machine.json", "bytes", b"plan p { }"),), (1,)),
        ("not-utf8", (("machine.json", "bytes", b'{"format": "\xff"}'),), (1,)),
        ("utf16", (("machine.json", "bytes", json.dumps(CALIBRATED).encode("utf-16")),), None),
        ("empty", (("machine.json", "bytes", b""),), (1,)),
    ]
    for label, files, expect in topology:
        add("topology-path", label, _topology_plan('"machine.json"'), files=files,
            expect=expect or STATUSES)
    for label, value, expect in (("nul-escape", r'"\x00"', None), ("empty-string", '""', None),
                                 ("name-too-long", '"' + "n" * 5000 + '"', (1,)),
                                 ("dot-dot-5000", '"' + "../" * 5000 + 'dev/zero"', (1,)),
                                 ("absolute-dev-zero", '"/dev/zero"', (1,))):
        add("topology-path", label, _topology_plan(value), expect=expect or STATUSES)

    # -- the plan file itself is something odd
    plan_files = [
        ("fifo", "fifo", (("fifo", "fifo", None),), (1,)),
        ("dev-zero", "/dev/zero", (), (1,)),
        ("dev-null", "/dev/null", (), (1,)),
        ("dev-urandom", "/dev/urandom", (), (1,)),
        ("directory", "d", (("d", "dir", None),), (1,)),
        ("symlink-loop", "loop", (("loop", "symlink", "loop"),), (1,)),
        ("dangling", "dangling", (("dangling", "symlink", "nowhere"),), (1,)),
        ("missing", "missing.plan", (), (1,)),
        ("socket", "sock", (("sock", "socket", None),), (1,)),
        ("sparse-3GiB", "big.plan", (("big.plan", "sparse", (3 * GiB, b"")),), (1,)),
        ("proc-self-mem", "/proc/self/mem", (), (1,)),
        ("root-directory", "/", (), (1,)),
    ]
    for label, path, files, expect in plan_files:
        add("plan-file", label, None, files=files, plan_path=path, expect=expect)

    # -- the language's limits (docs/language.md, section 5, "Limits": at most 524,288
    # ranks, 1,024 layers, 65,536 microbatches and pp * virtual * microbatches of 131,072;
    # "a plan that check accepts compiles in seconds"). Compiling a plan at a limit is the
    # deliberate extreme; one just beyond must be refused at once, and so must the far
    # larger ones (the limits of earlier versions, which compiled for minutes).
    tiny = ("plan limits {{\n  model gpt {{ layers = {layers}; hidden = 8; heads = 1; "
            "vocab = 2; seq = 2; batch = {batch} }}\n  mesh {{ {mesh} }}\n"
            "  schedule {{ microbatches = {micro}{pipeline} }}\n{shard}}}\n")
    interleaved = "; pipeline = interleaved"
    limits = {  # label: (tier, expected status, the plan's figures)
        "layers-1024": ("bench", 0, dict(layers=1024, batch=1, mesh="tp = 1", micro=1)),
        "layers-1025": ("test", 1, dict(layers=1025, batch=1, mesh="tp = 1", micro=1)),
        "layers-65536": ("test", 1, dict(layers=65536, batch=1, mesh="tp = 1", micro=1)),
        "ranks-524288": ("bench", 0, dict(layers=1, batch=524288, mesh="dp = 524288", micro=1)),
        "ranks-524289": ("test", 1, dict(layers=1, batch=524289, mesh="dp = 524289", micro=1)),
        "microbatches-65536": ("test", 0, dict(layers=1, batch=65536, mesh="tp = 1", micro=65536)),
        "microbatches-65537": ("test", 1, dict(layers=1, batch=65537, mesh="tp = 1", micro=65537)),
        "schedule-pp2-131072": ("test", 0, dict(layers=2, batch=65536, mesh="pp = 2", micro=65536)),
        "schedule-pp3-131073": ("test", 1, dict(layers=3, batch=43691, mesh="pp = 3", micro=43691)),
        "schedule-interleaved-131072": ("bench", 0, dict(
            layers=16, batch=8192, mesh="pp = 4", micro=8192, pipeline=interleaved,
            shard="  shard { pp { virtual = 4 } }\n")),
        "schedule-interleaved-131080": ("test", 1, dict(
            layers=40, batch=3277 * 4, mesh="pp = 4", micro=3277 * 4, pipeline=interleaved,
            shard="  shard { pp { virtual = 10 } }\n")),
        "pp-1024-microbatches-128": ("bench", 0, dict(layers=1024, batch=128, mesh="pp = 1024",
                                                      micro=128)),
        "pp-1024-microbatches-4096": ("test", 1, dict(layers=1024, batch=4096, mesh="pp = 1024",
                                                      micro=4096)),
        "stages-16384": ("bench", 1, dict(layers=16384, batch=16384, mesh="pp = 16384",
                                          micro=16384)),
        "chunks-16384": ("bench", 1, dict(layers=16384, batch=4, mesh="pp = 4", micro=4,
                                          pipeline=interleaved,
                                          shard="  shard { pp { virtual = 4096 } }\n")),
    }
    for label, (tier, status, values) in limits.items():
        text = tiny.format(**{"pipeline": "", "shard": "", **values})
        add("limits", label, text, expect=(status,), tier=tier,
            note="known: plans at the language limits compiled for minutes" if status == 0 else "")

    # -- file names and command lines
    valid = _b(BASE)
    for label, name in (("unicode-name", "планъ 計画.plan"), ("newline-name", "a\nb.plan"),
                        ("invalid-utf8-name", os.fsdecode(b"inv\xff\xfe.plan")),
                        ("ansi-escape-name", "\x1b[31mred\x1b[0m.plan"),
                        ("dash-name", "-x.plan"), ("space-name", " .plan"),
                        ("long-name", "n" * 250 + ".plan")):
        for command in ("check", "check-json", "compile"):
            args = {"check": ("check", "{dir}/" + name), "check-json": (
                "check", "{dir}/" + name, "--error-format", "json"),
                "compile": ("compile", "{dir}/" + name, "-o", "{dir}/build")}[command]
            broken = _b(_with(BASE, "heads = 4", "heads = 5"))
            for flavour, content in (("valid", valid), ("invalid", broken)):
                tier = "test" if (flavour == "valid") == (command == "compile") else "bench"
                add("file-name", f"{label}-{command}-{flavour}", None, command="args", args=args,
                    files=((name, "bytes", content),), plan_path=name, tier=tier)
    usage = {
        "set-no-equals": (("check", "{plan}", "--set", "mesh.tp"), (2,)),
        "set-empty-key": (("check", "{plan}", "--set", "=2"), (2,)),
        "set-empty-value": (("check", "{plan}", "--set", "mesh.tp="), (2,)),
        "set-double-dot": (("check", "{plan}", "--set", "mesh..tp=2"), (2,)),
        "set-unknown-key": (("check", "{plan}", "--set", "mesh.zz=2"), (1, 2)),
        "set-huge-value": (("check", "{plan}", "--set", "mesh.tp=" + "9" * 100_000), (1, 2)),
        "set-deep-value": (("check", "{plan}", "--set", "train.optimizer=" + "adamw(lr = " * 10_000 + "1" + ")" * 10_000), (1, 2)),
        "set-separator-value": (("check", "{plan}", "--set", "mesh.tp=2\u2028dp = 4"), (1, 2)),
        "set-formfeed-value": (("check", "{plan}", "--set", "mesh.tp=\f2"), (0, 1, 2)),
        "set-newline-value": (("check", "{plan}", "--set", "mesh.tp=2\nmesh { tp = 4 }"), (1, 2)),
        "set-brace-value": (("check", "{plan}", "--set", "mesh.tp=2 } plan x {"), (1, 2)),
        "set-long-key": (("check", "{plan}", "--set", "k" * 100_000 + "=1"), (1, 2)),
        "set-1000-times": (("check", "{plan}", *[a for i in range(1000) for a in ("--set", f"train.seed={i}")]), (0, 1, 2)),
        "set-json": (("check", "{plan}", "--error-format", "json", "--set", "mesh.tp=\x1c"), (1, 2)),
        "bad-error-format": (("check", "{plan}", "--error-format", "xml"), (2,)),
        "no-file": (("check",), (2,)),
        "empty-file-name": (("check", ""), (2,)),  # names nothing: a command line error
        "unknown-option": (("check", "{plan}", "--frobnicate"), (2,)),
        "unknown-command": (("frobnicate", "{plan}"), (2,)),
        "no-command": ((), (2,)),
        "path-100k": (("check", "x" * 100_000), (1,)),
        "compile-output-is-a-file": (("compile", "{plan}", "-o", "{plan}"), (2,)),
        "compile-output-under-a-file": (("compile", "{plan}", "-o", "{plan}/sub"), (1,)),
        "compile-output-dev-null": (("compile", "{plan}", "-o", "/dev/null"), (2,)),
        "compile-output-fifo": (("compile", "{plan}", "-o", "{dir}/fifo"), (2,)),
        "compile-output-loop": (("compile", "{plan}", "-o", "{dir}/loop/sub"), (1,)),
    }
    for label, (args, expect) in usage.items():
        add("usage", label, BASE, command="args", args=args, expect=expect,
            files=(("fifo", "fifo", None), ("loop", "symlink", "loop")))
    add("usage", "set-10k-times", BASE, command="args", tier="bench", args=(
        "check", "{plan}", *[a for i in range(10_000) for a in ("--set", f"train.seed={i}")]))
    return out


def extremes(commands_per_input: str = "rotate", tier: str = "bench") -> list[Case]:
    """The extremes as Cases: ``rotate`` gives each input one command (check, check-json,
    compile in turn, by position in the whole list), ``all`` each of the three; inputs
    whose command is part of the input (``args``) run once either way, and the limits
    are always compiled (the deliberate extreme). ``tier``: ``test`` for the tests'
    share, ``bench`` for all of them."""
    cases: list[Case] = []
    for index, (level, kind, label, fields) in enumerate(extreme_cases()):
        if tier == "test" and level != "test":
            continue
        name = f"{kind}-{label}"
        if fields.get("command") == "args":
            cases.append(Case(kind, name, **fields))
            continue
        if commands_per_input == "all":
            chosen = COMMANDS
        elif kind == "limits":
            chosen = ("compile",)
        elif kind in ("separator", "line-endings"):  # their point is the text excerpts
            chosen = (("check", "compile", "check")[index % 3],)
        else:
            chosen = (COMMANDS[index % 3],)
        for command in chosen:
            cases.append(Case(kind, f"{name}-{command}" if len(chosen) > 1 else name,
                              command, **fields))
    return cases


# --- mutants of the example and invalid plans ------------------------------------------

# Our own tokenizer (as tests/test_fuzz.py's): joining the tokens gives the text back.
TOKEN = re.compile(r"""
      \#[^\n]*
    | "(?:[^"\\\n]|\\.)*"?
    | [0-9][0-9_]*(?:\.[0-9][0-9_]*)?(?:[eE][+-]?[0-9]+)?(?:[A-Za-z_][A-Za-z0-9_]*(?:/[A-Za-z]+)?)?
    | [A-Za-z_][A-Za-z0-9_]*(?:-[A-Za-z_0-9][A-Za-z0-9_]*)*
    | \.\.
    | \r?\n
    | [ \t]+
    | .
""", re.VERBOSE | re.DOTALL)

TRICKY = [
    "{", "}", "[", "]", "(", ")", "=", ";", "..", '"', "#", ",", "+", "-", "*", "/", "1f1b",
    "0", "-1", "1e999", "99999999999999999999999", "25GB/s", "dgx-a100", "auto", "on", "off",
    "plan", "model", "gpt", "llama", "tp", "mesh", "stages", "0..0", "3..1", "adamw(lr = 1e-3)",
    "sgd()", "[0..1, 2..3]", "4 * hidden", "hidden / 0", "hidden / 7", "é", "日本", "\u00a0",
    "\ufeff", "\x00", "\\", '"unterminated', '"a\\"b"', "1_", "0x10", "1e", ".5", "nan", "inf",
    "--1", "+-+1", "((((", "]]]]", "}}}}", "{{{{", "1" + "0" * 400, "9" * 5000, '"/dev/zero"',
    '"fifo"', '"loop"', '"machine.json"', "preset", "data", "train", "topology", "\\u2028",
]
# Numbers at and beyond the language's limits: only for check, never compiled.
BOUNDARY = ["1024", "1025", "65536", "65537", "16384", "131072", "524288", "524289",
            str(2**53), str(2**53 + 1), "4096", "100000"]


def tokens_of(text: str) -> list[str]:
    tokens = TOKEN.findall(text)
    assert "".join(tokens) == text
    return tokens


def _solid(tokens: list[str]) -> list[int]:
    return [i for i, t in enumerate(tokens) if t.strip(" \t\r\n")] or [0]


def _m_delete(rng, text, pool):
    tokens = tokens_of(text)
    if tokens:
        del tokens[rng.choice(_solid(tokens))]
    return "".join(tokens)


def _m_duplicate(rng, text, pool):
    tokens = tokens_of(text)
    if tokens:
        i = rng.choice(_solid(tokens))
        tokens.insert(i, tokens[i] * rng.choice([1, 1, 2, 50]) + rng.choice(["", " ", "\n"]))
    return "".join(tokens)


def _m_swap(rng, text, pool):
    tokens = tokens_of(text)
    solid = _solid(tokens)
    if len(solid) >= 2:
        i, j = rng.sample(solid, 2)
        tokens[i], tokens[j] = tokens[j], tokens[i]
    return "".join(tokens)


def _m_replace(rng, text, pool):
    tokens = tokens_of(text)
    if tokens:
        solid = _solid(tokens)
        source = pool if rng.random() < 0.6 else [tokens[k] for k in solid]
        tokens[rng.choice(solid)] = rng.choice(source)
    return "".join(tokens)


def _m_insert(rng, text, pool):
    tokens = tokens_of(text)
    tokens.insert(rng.randrange(len(tokens) + 1), rng.choice(pool))
    return "".join(tokens)


def _m_separator(rng, text, pool):
    """A line separator at a token boundary, or in place of a blank or a new line."""
    tokens = tokens_of(text)
    sep = rng.choice(list(SEPARATORS.values()))
    blanks = [i for i, t in enumerate(tokens) if not t.strip(" \t\r\n")]
    if blanks and rng.random() < 0.5:
        tokens[rng.choice(blanks)] = sep
    else:
        tokens.insert(rng.randrange(len(tokens) + 1), sep)
    return "".join(tokens)


def _m_truncate(rng, text, pool):
    return text[:rng.randrange(len(text) + 1)]


def _m_duplicate_line(rng, text, pool):
    lines = text.splitlines(keepends=True)
    if lines:
        i = rng.randrange(len(lines))
        lines.insert(rng.randrange(len(lines) + 1), lines[i] * rng.choice([1, 1, 10, 200]))
    return "".join(lines)


def _m_delete_line(rng, text, pool):
    lines = text.splitlines(keepends=True)
    if lines:
        del lines[rng.randrange(len(lines))]
    return "".join(lines)


def _m_splice(rng, text, pool, others=()):
    """The start of this plan and the end of another (both cut at a line)."""
    if not others:
        return text
    other = rng.choice(others)
    a, b = text.splitlines(keepends=True), other.splitlines(keepends=True)
    return "".join(a[:rng.randrange(len(a) + 1)] + b[rng.randrange(len(b) + 1):])


def _m_line_endings(rng, text, pool):
    ending = rng.choice(["\r\n", "\r", "\u2028", "\x85", "\f\n", "\v"])
    return text.replace("\n", ending)


def _m_bom(rng, text, pool):
    return "\ufeff" + text


TEXT_MUTATORS = [_m_delete, _m_duplicate, _m_swap, _m_replace, _m_replace, _m_insert,
                 _m_separator, _m_separator, _m_truncate, _m_duplicate_line, _m_delete_line,
                 _m_splice, _m_line_endings, _m_bom]


def _byte_mutant(rng, data: bytes) -> bytes:
    data = bytearray(data)
    for _ in range(rng.choice([1, 1, 2, 3, 8])):
        kind = rng.randrange(4)
        if kind == 0 and data:
            del data[rng.randrange(len(data))]
        elif kind == 1:
            data.insert(rng.randrange(len(data) + 1), rng.randrange(256))
        elif kind == 2 and data:
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        else:
            data[rng.randrange(len(data) + 1):0] = rng.choice(
                [b"\x00", b"\xef\xbb\xbf", b"\xff", b"\xc0\xaf", b"\xed\xa0\x80", b"\xe2\x80\xa8",
                 b"\xc2\x85", b"\r"])
    return bytes(data)


def mutate(rng: random.Random, text: str, pool: list[str], others=()) -> bytes:
    """One to three stacked mutations of ``text``; the mutant's bytes."""
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        if rng.random() < 0.15:
            return _byte_mutant(rng, _b(text))
        mutator = rng.choice(TEXT_MUTATORS)
        text = mutator(rng, text, pool, others) if mutator is _m_splice else mutator(rng, text, pool)
    return _b(text)


def _read(path: Path) -> str:
    return path.read_bytes().decode("utf-8", errors="replace")


# Files a mutant may point at (a mutant's data or preset path can become one of these).
MUTANT_FILES = (("fifo", "fifo", None), ("loop", "symlink", "loop"),
                ("machine.json", "bytes", _json(CALIBRATED)))


def mutants(count: int, seed: int = SEED, source: str = "both") -> list[Case]:
    """``count`` mutants, alternating between the example plans and the invalid plans
    (``source``: both, examples or invalid). Mutants of the small examples alternate
    between check, check-json and compile; of the big ones and of the invalid plans,
    between check and check-json (compile for invalid ones too: most stop at check)."""
    examples = sorted(PLANS.glob("*.plan"))
    invalid = sorted(INVALID.glob("*.plan"))
    example_texts = [_read(p) for p in examples]
    invalid_texts = [_read(p) for p in invalid]
    cases = []
    for n in range(count):
        rng = random.Random(f"{seed}:mutant:{n}")
        from_invalid = source == "invalid" or (source == "both" and n % 2 == 1)
        paths, texts = (invalid, invalid_texts) if from_invalid else (examples, example_texts)
        i = rng.randrange(len(paths))
        small = from_invalid or paths[i].stem in SMALL_EXAMPLES
        command = COMMANDS[n % 3] if small else COMMANDS[n % 2]
        pool = TRICKY + (BOUNDARY if command != "compile" else [])
        plan = mutate(rng, texts[i], pool, texts)
        kind = "mutant-invalid" if from_invalid else "mutant-example"
        cases.append(Case(kind, f"{kind}-{n:05d}-{paths[i].stem}", command, plan=plan,
                          files=MUTANT_FILES, note=f"mutant {n} of {paths[i].name} (seed {seed})"))
    return cases


def originals() -> list[Case]:
    """Every example and invalid plan unchanged, under check-json (and compile for the
    examples): the baseline the mutants depart from. An example sits beside the files of
    plans/ it may name (the demo's measured topology, demo-machine.json)."""
    beside = tuple((p.name, "bytes", p.read_bytes()) for p in sorted(PLANS.glob("*.json")))
    cases = [Case("original", f"example-{p.stem}", "check-json", plan=p.read_bytes(),
                  files=beside, expect=(0,)) for p in sorted(PLANS.glob("*.plan"))]
    cases += [Case("original", f"example-{p.stem}-compile", "compile", plan=p.read_bytes(),
                   files=beside, expect=(0,)) for p in sorted(PLANS.glob("*.plan"))]
    cases += [Case("original", f"invalid-{p.stem}", "check", plan=p.read_bytes())
              for p in sorted(INVALID.glob("*.plan"))]
    return cases


# --- running: the driver -----------------------------------------------------------------


@dataclass
class Result:
    name: str
    status: int | None  # exit status; None when killed by a signal
    signal: int | None
    seconds: float
    maxrss_kb: int
    timed_out: bool  # killed at its wall-clock limit or its CPU limit
    stdout_bytes: int
    stderr_bytes: int
    stdout: str  # its head and tail
    stderr: str  # its head (64 KB) and tail
    harness_error: str = ""
    stdout_json: bool | None = None  # whether stdout is one JSON document (if asked)
    baseline_kb: int = 0  # the driver's resident set when it forked (part of maxrss_kb)
    markers: tuple = ()  # the MARKERS found anywhere in stdout or stderr
    cpu_seconds: float = 0.0  # user + system time of the child and what it waited for
    out_of_cpu: bool = False  # stopped by its CPU limit (else, if timed out, by the clock)


@dataclass
class Job:
    name: str
    argv: list  # planc's arguments (fork), or the whole command line (exec)
    cwd: str
    mode: str = "fork"  # fork: planc.cli.main in a forked child; exec: execv argv[0]
    time_limit: float = TIME_LIMIT  # seconds of CPU; WALL_FACTOR times that on the clock
    keep_stdout: bool = False  # parse stdout as JSON
    # seconds on the clock where not WALL_FACTOR times the CPU's (a job that must reach
    # its CPU limit first, however busy the machine)
    wall_limit: float | None = None

    @property
    def clock_limit(self) -> float:
        return self.wall_limit if self.wall_limit is not None else \
            self.time_limit * WALL_FACTOR


def planc_script() -> list[str]:
    """The command that starts the real planc entry point: the console script beside
    this interpreter, else ``python -m planc``."""
    script = Path(sys.executable).with_name("planc")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "planc"]


def job_for(case: Case, directory: str, time_limit: float = TIME_LIMIT) -> Job:
    argv = case.argv(directory)
    if case.mode == "exec":
        argv = planc_script() + argv
    json_mode = case.command == "check-json" or (
        "--error-format" in argv and argv[argv.index("--error-format") + 1:][:1] == ["json"])
    return Job(case.name, argv, directory, case.mode, time_limit, keep_stdout=json_mode)


HEAD, TAIL = 64 * 1024, 16 * 1024  # what a Result keeps of an output
JSON_LIMIT = 256 * MiB  # larger outputs are not parsed


def _excerpt(path: str, head: int) -> tuple[str, int]:
    """The first ``head`` and last TAIL bytes of a file (a cut marked ``[... N bytes
    ...]``) as text, and the file's size."""
    size = os.path.getsize(path)
    with open(path, "rb") as handle:
        if size <= head + TAIL:
            data = handle.read()
        else:
            first = handle.read(head)
            handle.seek(size - TAIL)
            data = first + b"\n[... %d bytes ...]\n" % (size - head - TAIL) + handle.read()
    return data.decode("utf-8", errors="backslashreplace"), size


MARKERS = ("Traceback (most recent call last)", "MemoryError", "Cannot allocate memory",
           "Fatal Python error")


def _markers(path: str) -> set[str]:
    """The MARKERS anywhere in a file, read in chunks that overlap by a marker's length."""
    found: set[str] = set()
    overlap = max(map(len, MARKERS))
    with open(path, "rb") as handle:
        previous = b""
        while chunk := handle.read(4 * MiB):
            window = (previous + chunk).decode("utf-8", errors="replace")
            found.update(m for m in MARKERS if m in window)
            previous = chunk[-overlap:]
    return found


def _is_json(path: str) -> bool | None:
    if os.path.getsize(path) > JSON_LIMIT:
        return None
    with open(path, "rb") as handle:
        data = handle.read()
    if not data.strip():
        return True  # nothing printed: nothing to parse
    try:
        json.loads(data)
    except ValueError:
        return False
    return True


def _resident_kb() -> int:
    try:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024
    except (OSError, ValueError, IndexError):
        return 0


def _child(job: Job, out_path: str, err_path: str, memory_limit: int) -> None:
    """In the forked child: limits, redirections, then planc (never returns)."""
    code = 125
    try:
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.setpgid(0, 0)
        for limit, value in ((resource.RLIMIT_AS, memory_limit),
                             (resource.RLIMIT_FSIZE, OUTPUT_LIMIT), (resource.RLIMIT_CORE, 0)):
            resource.setrlimit(limit, (value, value))
        # SIGXCPU at the limit (it ends the process: no handler is installed before
        # exec or planc's own), SIGKILL a second later should it be caught
        cpu = max(1, math.ceil(job.time_limit))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        null = os.open(os.devnull, os.O_RDONLY)
        out = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        err = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        for fd, target in ((null, 0), (out, 1), (err, 2)):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(job.cwd)
        if job.mode == "exec":
            os.execv(job.argv[0], job.argv)
        from planc import cli  # imported by the driver already: no cost here

        sys.argv = ["planc", *job.argv]
        try:  # what the console script does: sys.exit(planc.cli.main())
            code = cli.main(job.argv)
            code = 0 if code is None else code
        except SystemExit as exc:
            if exc.code is None:
                code = 0
            elif isinstance(exc.code, int):
                code = exc.code
            else:
                print(exc.code, file=sys.stderr)
                code = 1
        except BaseException:  # noqa: BLE001 - the interpreter prints it and exits with 1
            traceback.print_exc()
            code = 1
        try:
            sys.stdout.flush()
        except BaseException:  # noqa: BLE001 - as the interpreter at exit
            traceback.print_exc()
            code = 120
        sys.stderr.flush()
    except BaseException:  # noqa: BLE001 - the harness itself failed
        try:
            os.write(2, b"harness: " + traceback.format_exc().encode())
        except BaseException:  # noqa: BLE001
            pass
    finally:
        os._exit(code if isinstance(code, int) and 0 <= code < 256 else 1)


_PRELOADED = False


def preload() -> None:
    """Import what the commands need once, and parse a plan with a syntax error and one
    without and two ``--set`` values, so that forked children start at once: the parser's LALR tables and lexer
    (planc/lang/parser.py) are built on a process's first parse, which made each child
    build them again (30 ms of a 40 ms check). ``exec`` children start cold, as the
    ``planc`` script does."""
    global _PRELOADED
    if _PRELOADED:
        return
    import importlib

    from planc.cli import COMMAND_MODULES

    # every command's module (the command line imports them all to build its parser),
    # and what the read-only commands import when they run
    for module in ("planc.cli", *(f"planc.commands.{name}" for name in COMMAND_MODULES),
                   "planc.lang", "planc.compile", "planc.build.directory",
                   "planc.runtime.engine.data", "planc.views.summary_text",
                   "planc.views.plan_summary", "planc.estimate.memory",
                   "planc.views.memory_text", "planc.host.locks", "planc.verify.verifier",
                   "planc.views.program_text", "planc.views.explain_text", "planc.simulate",
                   "planc.views.simulate_text", "planc.views.graph", "planc.graph.select",
                   "planc.host.outputs", "multiprocessing"):
        try:
            importlib.import_module(module)
        except Exception:  # noqa: BLE001 - a child will show the failure as it happens
            pass
    try:
        from planc.lang import load_text
        from planc.lang.parser import parse_value

        for text in (BASE, BASE.replace("layers", "layers = = 1 layers", 1)):
            load_text(text, "preload.plan")
        for value in ("1", "[1,"):  # --set's values, and the lexer that diagnoses them
            parse_value(value)
    except Exception:  # noqa: BLE001 - as above
        pass
    _PRELOADED = True


def run_jobs(jobs: list[Job], scratch: str, workers: int = 2,
             memory_limit: int = MEMORY_LIMIT, progress=None) -> list[Result]:
    """Run every job in a child process, ``workers`` at a time; results in job order."""
    if any(job.mode == "fork" for job in jobs):
        preload()
    # The children inherit this process's heap (pytest, planc, often torch): frozen out
    # of the cyclic collector while they are forked, no child's collection scans it, nor
    # copies each page it touches (CPython's gc.freeze, advised before fork without exec)
    gc.freeze()
    try:
        return _run_jobs(jobs, scratch, workers, memory_limit, progress)
    finally:
        gc.unfreeze()


def _run_jobs(jobs: list[Job], scratch: str, workers: int, memory_limit: int,
              progress) -> list[Result]:
    os.makedirs(scratch, exist_ok=True)
    results: list[Result | None] = [None] * len(jobs)
    waiting = deque(enumerate(jobs))
    running: dict[int, tuple[int, Job, float, str, str, int]] = {}
    killed: set[int] = set()
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGCHLD])
    try:
        while waiting or running:
            while waiting and len(running) < workers:
                index, job = waiting.popleft()
                out_path = os.path.join(scratch, f"{index}.out")
                err_path = os.path.join(scratch, f"{index}.err")
                sys.stdout.flush()
                sys.stderr.flush()
                baseline = _resident_kb()
                pid = os.fork()
                if pid == 0:
                    _child(job, out_path, err_path, memory_limit)
                try:
                    os.setpgid(pid, pid)
                except OSError:
                    pass
                running[pid] = (index, job, time.monotonic(), out_path, err_path, baseline)
            pid, status, usage = os.wait4(-1, os.WNOHANG)
            if pid == 0:
                now = time.monotonic()
                next_deadline = min(start + job.clock_limit
                                    for _, job, start, _, _, _ in running.values())
                for child, (_, job, start, _, _, _) in running.items():
                    if now >= start + job.clock_limit and child not in killed:
                        try:
                            os.killpg(child, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
                        killed.add(child)
                signal.sigtimedwait([signal.SIGCHLD], max(0.001, min(0.5, next_deadline - now)))
                continue
            if pid not in running:
                continue
            index, job, start, out_path, err_path, baseline = running.pop(pid)
            seconds = time.monotonic() - start
            try:
                os.killpg(pid, signal.SIGKILL)  # anything it left behind
            except (ProcessLookupError, PermissionError):
                pass
            stdout, stdout_bytes = _excerpt(out_path, TAIL)
            stderr, stderr_bytes = _excerpt(err_path, HEAD)
            stdout_json = _is_json(out_path) if job.keep_stdout else None
            markers = tuple(sorted(_markers(out_path) | _markers(err_path)))
            os.unlink(out_path)
            os.unlink(err_path)
            cpu_seconds = usage.ru_utime + usage.ru_stime
            out_of_cpu = os.WIFSIGNALED(status) and (
                os.WTERMSIG(status) == signal.SIGXCPU or
                (os.WTERMSIG(status) == signal.SIGKILL and pid not in killed and
                 cpu_seconds >= math.ceil(job.time_limit)))
            timed_out = pid in killed or out_of_cpu
            killed.discard(pid)
            harness = ""
            if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 125 and "harness:" in stderr:
                harness = stderr[-2000:]
            results[index] = Result(
                job.name, os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
                os.WTERMSIG(status) if os.WIFSIGNALED(status) else None, seconds,
                usage.ru_maxrss, timed_out, stdout_bytes, stderr_bytes, stdout, stderr, harness,
                stdout_json, baseline, markers, cpu_seconds, out_of_cpu)
            if progress:
                progress(index, results[index])
    finally:
        for pid in running:
            try:
                os.killpg(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
    return results  # type: ignore[return-value]


def run_in_subprocess(jobs: list[Job], scratch: str, workers: int = 2,
                      memory_limit: int = MEMORY_LIMIT, timeout: float = 900) -> list[Result]:
    """:func:`run_jobs` in a fresh driver process (``python tests/hostile_inputs.py
    drive``), so that forked children carry nothing but planc."""
    import subprocess

    os.makedirs(scratch, exist_ok=True)
    jobs_path, results_path = os.path.join(scratch, "jobs.json"), os.path.join(scratch, "results.json")
    with open(jobs_path, "w") as out:
        json.dump([asdict(job) for job in jobs], out)
    done = subprocess.run([sys.executable, __file__, "drive", jobs_path, results_path,
                           "--workers", str(workers), "--memory-limit", str(memory_limit)],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"the driver failed ({done.returncode}):\n{done.stderr[-5000:]}")
    with open(results_path) as handle:
        return [Result(**r) for r in json.load(handle)]


# --- judging -------------------------------------------------------------------------------

TRACEBACK = "Traceback (most recent call last)"


def problems(case: Case, result: Result) -> list[str]:
    """Everything wrong with one run (empty when it behaved)."""
    found = []
    output = result.stdout + "\n" + result.stderr
    markers = set(result.markers) | {m for m in MARKERS if m in output}
    if result.harness_error:
        found.append(f"harness error: {result.harness_error.strip().splitlines()[-1]}")
    if result.out_of_cpu:
        found.append(f"time-out: out of CPU after {result.cpu_seconds:.1f} s of CPU "
                     f"({result.seconds:.1f} s on the clock)")
    elif result.timed_out:
        found.append(f"time-out: killed after {result.seconds:.1f} s")
    elif result.signal is not None:
        found.append(f"killed by signal {signal.Signals(result.signal).name}")
    if TRACEBACK in markers:
        found.append(f"traceback: {exception_line(output)}")
    if "MemoryError" in markers or "Cannot allocate memory" in markers:
        found.append("memory blow-up (MemoryError under the address-space limit)")
    if "Fatal Python error" in markers:
        found.append("fatal Python error")
    if result.status is not None:
        if result.status not in STATUSES:
            found.append(f"exit status {result.status}")
        elif result.status not in case.expect:
            found.append(f"exit status {result.status}, expected "
                         f"{' or '.join(map(str, case.expect))}")
        if result.status != 0 and not (result.stdout.strip() or result.stderr.strip()):
            found.append(f"exit status {result.status} without a word on stdout or stderr")
        if result.stdout_json is False and result.status in (0, 1):
            found.append(f"--error-format json: stdout is not one JSON document "
                         f"({ascii(result.stdout[:80])}...)")
    if case.command in ("check", "compile") and case.plan is not None and \
            case.plan_path == "input.plan" and result.status == 1:
        found += snippet_problems(case.plan, result.stderr)
    return found


_HEADER_LINE = re.compile(r"^(?:.*/)?input\.plan:(\d+):(\d+): (?:error|warning): ")
_SNIPPET = re.compile(r"^ *(\d+) \| (.*)$")
_MARKER = re.compile(r"^ +\| ([ \t]*)\^")


def _width(text: str) -> int:
    import unicodedata

    return sum(0 if unicodedata.combining(c) else
               2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in text)


def snippet_problems(plan: bytes, stderr: str) -> list[str]:
    """Text diagnostics whose excerpt is not the line and column they name.

    docs/language.md: lines end at ``\\n`` or ``\\r\\n`` and lines and columns count from 1
    (a leading byte-order mark is not content). For each ``input.plan:L:C:`` header that
    is followed by an excerpt, the excerpt must be numbered L; unless it was cut to a
    window ('...'), it must show line L: the same characters, where each printable one
    (other than a tab) is itself and any other may be shown as one substitute; its
    marker line must put the caret under column C (tabs kept, wide characters two
    columns); and neither line may hold a character that breaks a line (an excerpt that
    a terminal or an editor shows as two lines is misaligned)."""
    text = plan.removeprefix(b"\xef\xbb\xbf").decode("utf-8", errors="strict") \
        if _is_utf8(plan) else None
    if text is None:
        return []
    lines = [line.removesuffix("\r") for line in text.split("\n")]
    out = stderr.split("\n[... ")[0].split("\n")  # the head of a cut output
    found = []
    for i, line in enumerate(out[:-2]):
        header = _HEADER_LINE.match(line)
        snippet = _SNIPPET.match(out[i + 1])
        if not header or not snippet:
            continue
        number, column = int(header.group(1)), int(header.group(2))
        where = f"{number}:{column}"
        if int(snippet.group(1)) != number:
            found.append(f"misaligned excerpt: diagnostic at {where} shows line {snippet.group(1)}")
            continue
        shown = snippet.group(2)
        marker = _MARKER.match(out[i + 2])
        if len(out[i + 1].splitlines()) > 1 or len(out[i + 2].splitlines()) > 1:
            found.append(f"misaligned excerpt: the excerpt of {where} holds a line break "
                         f"({ascii(out[i + 1][:60])})")
            continue
        if shown.startswith("...") or shown.endswith("...") or not 1 <= number <= len(lines):
            continue
        source = lines[number - 1]
        same = len(shown) == len(source) and all(
            s == c for s, c in zip(shown, source) if c.isprintable() and c != "\t")
        if not same:
            found.append(f"misaligned excerpt: line {number} is {ascii(source[:60])}, the "
                         f"excerpt shows {ascii(shown[:60])}")
            continue
        if marker is None:
            found.append(f"misaligned excerpt: no caret under the excerpt of {where}")
            continue
        pad = marker.group(1)
        expected = "".join(c if c == "\t" else " " * _width(c) for c in shown[:column - 1])
        if column - 1 > len(shown) + 1 or pad != expected:
            found.append(f"misaligned excerpt: the caret of {where} is at display column "
                         f"{_width(pad.replace(chr(9), ' ')) + 1}, under "
                         f"{ascii(shown[len(pad):len(pad) + 10])}")
    return found


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def exception_line(output: str) -> str:
    """The exception of the last traceback in ``output`` and the innermost planc frame."""
    tail = output[output.rfind(TRACEBACK):]
    lines = [line for line in tail.splitlines() if line.strip()]
    where = ""
    for line in lines:
        m = re.match(r'\s*File "([^"]*)", line (\d+), in (\S+)', line)
        if m and "planc" in m.group(1) and "hostile" not in m.group(1):
            where = f"{Path(m.group(1)).name}:{m.group(2)} in {m.group(3)}"
    last = next((line.strip() for line in reversed(lines)
                 if re.match(r"[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Warning)?\b", line.strip())
                 and not line.startswith(" ")), lines[-1].strip() if lines else "")
    return f"{last[:200]}" + (f" (at {where})" if where else "")


def signature(case: Case, found: list[str]) -> str:
    """What makes two failures the same: the kind of problem and, for a traceback, the
    exception type and place."""
    parts = []
    for problem in found:
        if problem.startswith("traceback: "):
            exc = problem[len("traceback: "):]
            kind = re.match(r"[\w.]+", exc)
            where = re.search(r"\(at ([^)]*)\)", exc)
            parts.append(f"traceback {kind.group(0) if kind else '?'}"
                         f"{' at ' + where.group(1) if where else ''}")
        elif problem.startswith("time-out"):  # one class per input, whatever the command
            stem = re.sub(r"-(check|check-json|compile)$", "", case.name.removesuffix("-exec"))
            parts.append(f"time-out ({stem})")
        elif problem.startswith("exit status") and "expected" in problem:
            parts.append(problem.split(",")[0] + " (expected " + "/".join(map(str, case.expect)) + ")")
        else:
            parts.append(problem.split(" (")[0])
    return "; ".join(sorted(set(parts)))


def describe(case: Case, width: int = 160) -> str:
    """The input in a few words: what it changes in BASE (a line-by-line difference)
    when it is made from BASE, else the start of its bytes."""
    import difflib

    if case.plan is None:
        return f"no input.plan; the file: {case.plan_path!r}"
    try:
        text = case.plan.decode("utf-8")
    except UnicodeDecodeError:
        text = None

    def short(line: str) -> str:
        return ascii(line) if len(line) <= width else \
            f"{ascii(line[:width // 2])}...{ascii(line[-width // 4:])} ({len(line):,d} chars)"

    if text is not None and text != BASE:
        old, new = BASE.split("\n"), text.split("\n")
        if len(new) < 20 * len(old):
            changes = [(tag, old[i1:i2], new[j1:j2]) for tag, i1, i2, j1, j2 in
                       difflib.SequenceMatcher(None, old, new, autojunk=False).get_opcodes()
                       if tag != "equal"]
            if changes and sum(len(a) + len(b) for _, a, b in changes) <= 12 and \
                    sum(len(b) for _, _, b in changes) < len(new):
                parts = []
                for tag, a, b in changes:
                    parts += [f"- {short(line)}" for line in a] + [f"+ {short(line)}" for line in b]
                return "BASE (tests/hostile_inputs.py) with:\n      " + "\n      ".join(parts)
    elif text == BASE:
        return "BASE (tests/hostile_inputs.py) as it is"
    return f"{len(case.plan):,d} bytes: {compress(case.plan)}"


def compress(data: bytes, limit: int = 400) -> str:
    """``data`` as a Python expression with long runs written as repetitions
    (``b'# x\\n' + b'\\n' * 16,776,800 + b'}'``), cut at about ``limit`` characters."""
    parts, position = [], 0
    for run in re.finditer(rb"(.{1,8}?)\1{31,}", data, re.DOTALL):
        if run.start() > position:
            parts.append(repr(data[position:run.start()]))
        unit = run.group(1)
        parts.append(f"{unit!r} * {len(run.group(0)) // len(unit):_d}")
        position = run.end()
        if sum(map(len, parts)) > limit:
            break
    if position < len(data):
        parts.append(repr(data[position:position + limit]))
    text = " + ".join(parts)
    return text if len(text) <= limit else text[:limit] + " ..."


def summarize(cases: list[Case], results: list[Result]) -> dict:
    """Counts per kind and status, the slowest input, the peak memory, the failures."""
    by_kind: dict[str, Counter] = {}
    failures = []
    for case, result in zip(cases, results):
        counter = by_kind.setdefault(case.kind, Counter())
        counter["inputs"] += 1
        counter[f"exit {result.status}" if result.status is not None else "killed"] += 1
        found = problems(case, result)
        if found:
            counter["failed"] += 1
            failures.append((case, result, found))
    slowest = max(zip(cases, results), key=lambda cr: cr[1].seconds)
    biggest = max(zip(cases, results), key=lambda cr: cr[1].maxrss_kb)
    return {"by_kind": by_kind, "failures": failures, "slowest": slowest, "biggest": biggest}


# --- the driver as a script ----------------------------------------------------------------


def _drive(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="run hostile-input jobs (tests/hostile_inputs.py)")
    parser.add_argument("command", choices=["drive"])
    parser.add_argument("jobs")
    parser.add_argument("results")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--memory-limit", type=int, default=MEMORY_LIMIT)
    args = parser.parse_args(argv)
    with open(args.jobs) as handle:
        jobs = [Job(**job) for job in json.load(handle)]
    scratch = os.path.join(os.path.dirname(os.path.abspath(args.results)), "io")
    results = run_jobs(jobs, scratch, args.workers, args.memory_limit)
    with open(args.results, "w") as out:
        json.dump([asdict(r) for r in results], out)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(_drive(sys.argv[1:]))

