"""A ``planc run --metrics`` file read as untrusted input: one JSON object per step
(docs/metrics.md), for ``planc report`` and ``planc plot``. No torch.

Every number a reader uses is checked here, once, so that no later arithmetic (a float
of a huge integer, a division by a subnormal) overflows: a step is a whole number from 0
to :data:`MAX_STEP`, every value of :data:`NUMBERS` a number that is 0 or between
:data:`SMALLEST` and :data:`LARGEST` in magnitude."""

from __future__ import annotations

import errno
import itertools
import json
import math
import os
from typing import NamedTuple

from planc.host.files import open_regular_file
from planc.host.json_values import json_kind
from planc.vocabulary.units import LARGEST, SMALLEST

# A run of 10^6 steps writes about 600 MB; a record is under 1 KiB.
MAX_BYTES, MAX_LINE = 1 << 30, 1 << 20
TOO_LARGE = "it is larger than 1 GiB, more than planc reads of a metrics file"
MAX_STEP = 10**12  # far past any run, and a float holds every step up to it exactly
# The record's numeric keys (docs/metrics.md): every one planc plot --metric or planc
# report reads is here.
NUMBERS = ("loss", "eval_loss", "eval_s", "lr", "grad_norm", "tokens_per_s", "tflops_per_device", "mfu",
           "ep_imbalance", "moe_dropped", "moe_expert_imbalance",
           "time_s", "compute_s", "comm_s", "exposed_comm_s", "pipeline_wait_s", "max_rss_mb")
# What a diverging run computes as NaN or an infinity, and planc run writes as it is
# (JSON's NaN, Infinity): a curve draws it as a gap.
DIVERGING = ("loss", "eval_loss", "grad_norm")
NOT_WRITTEN = "it is not what planc run --metrics writes"


class Metrics(NamedTuple):
    """What :func:`read_metrics` read: the records, or the problem (one line) that keeps
    the file from being used; ``warning``: a line to print where the records are used."""

    records: list[dict] | None
    problem: str | None = None
    warning: str | None = None


def read_metrics(path: str) -> Metrics:
    """The records of a ``planc run --metrics`` file, one a step in step order (a file a
    resumed run appended to: :func:`history`), or why it cannot be read. A last line that
    is no JSON and has no newline is one a run stopped while writing (killed, or out of
    disk): the records before it are read, and ``warning`` says so."""
    numbered, cut = [], None
    try:
        with open_regular_file(path) as handle:  # not a device, a pipe or a directory
            for number, line in _lines(handle):
                if not line.strip():
                    continue
                try:
                    numbered.append((number, json.loads(line.decode("utf-8"))))
                except (ValueError, RecursionError):
                    if line.endswith(b"\n"):  # a whole line: the file is broken
                        raise
                    cut = number  # only the last line lacks its newline
    except OSError as exc:
        return Metrics(None, f"cannot read {path}: {exc.strerror or exc}")
    except _TooLong as exc:
        return Metrics(None, f"{path} is not a planc run metrics file (line {exc.args[0]} is "
                             f"longer than {MAX_LINE >> 20} MiB)")
    except (ValueError, RecursionError):  # not JSON, not UTF-8, nested past Python's stack
        return Metrics(None, f"{path} is not a planc run metrics file (one JSON object per "
                             f"line)")
    records = [record for _, record in numbered]
    if not records:
        return Metrics(None, f"{path} is not a planc run metrics file (no step records)")
    for line, record in numbered:
        problem = _not_a_step(record)
        if problem:
            return Metrics(None, f"{path} is not a planc run metrics file (line {line} "
                                 f"{problem})")
    if not all(seconds(r.get("exposed_comm_s", 0.0)) for r in records):
        return Metrics(None, f"{path} is not a planc run metrics file (an exposed_comm_s "
                             f"that is not a number of seconds)")
    if not all(isinstance(r.get("build", ""), str) for r in records):
        return Metrics(None, f"{path} is not a planc run metrics file (a build fingerprint "
                             f"that is not text)")
    for line, record in numbered:
        problem = record_problem(record)
        if problem:
            return Metrics(None, f"{path}: line {line} {problem}; {NOT_WRITTEN}")
    return Metrics(history(records), warning=None if cut is None else (
        f"{path}: line {cut}, the last, is cut short (a run stopped while writing it); read "
        f"the lines before it"))


def history(records: list[dict]) -> list[dict]:
    """The steps of the training the file records, in step order. A run resumed from a
    checkpoint appends to the file of the run it resumes, from the checkpoint's step on: a
    record whose step is not past the one before begins such a run, and replaces every
    record of that step and after (the resumed run trained them again, from another
    state). So each step is its last record in the file, and a step the resumed run has
    not reached yet is dropped: it followed steps that were replaced."""
    kept: list[dict] = []
    for record in records:
        while kept and kept[-1]["step"] >= record["step"]:
            kept.pop()
        kept.append(record)
    return kept


class _TooLong(Exception):
    """A line longer than MAX_LINE (its number in args)."""


def _lines(handle):
    """(number, bytes) of every line of an open file, one at a time: at most MAX_LINE
    bytes a line, MAX_BYTES in all (also of a file that grows while it is read)."""
    if os.fstat(handle.fileno()).st_size > MAX_BYTES:  # refused unread
        raise OSError(errno.EFBIG, TOO_LARGE)
    total = 0
    for number in itertools.count(1):
        line = handle.readline(MAX_LINE + 1)
        if not line:
            return
        total += len(line)
        if total > MAX_BYTES:
            raise OSError(errno.EFBIG, TOO_LARGE)
        if len(line) > MAX_LINE:
            raise _TooLong(number)
        yield number, line


def _not_a_step(record) -> str | None:
    """Why one line's JSON is no step record (a step's time is what every reader needs),
    or None."""
    if not isinstance(record, dict):
        return f"is a JSON {json_kind(record)}, not a step record"
    if "time_s" not in record:
        return "has no time_s, the step's time"
    value = record["time_s"]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"has a time_s that is a JSON {json_kind(value)}, not a number of seconds"
    if not seconds(value, positive=True):
        digits = len(str(abs(value))) if isinstance(value, int) else 0
        shown = (f"{value:g}" if math.isfinite(value) else json.dumps(value)) \
            if isinstance(value, float) else (
            str(value) if digits <= 20 else f"an integer of {digits:,} digits")
        return (f"has a time_s of {shown}; a step's time is above 0, from 1e-100 to 1e100 "
                f"seconds")
    return None


def record_problem(record: dict) -> str | None:
    """What is wrong with the step and the numbers of one record, or None."""
    step = record.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
        return "has no step number (a whole number from 0 to 10^12)"
    for key in NUMBERS:
        value = record.get(key)
        if value is not None and not in_range(value, key in DIVERGING):
            article = "an" if key[0] in "aeiou" else "a"
            return (f"(step {step + 1}) has {article} {key} that is not a number of "
                    f"magnitude 0 or 1e-100 to 1e100")
    for key in ("ep_imbalance", "moe_expert_imbalance"):  # the busiest over the mean
        value = record.get(key)
        if value is not None and value < 1:
            return f"(step {step + 1}) has an {key} under 1 (the busiest over the mean)"
    if not isinstance(record.get("plan", ""), str):  # plot and report group steps by it
        return f"(step {step + 1}) has a plan name that is not text"
    return None


def in_range(value, diverged: bool = False) -> bool:
    """Whether ``value`` is a number that is 0 or between SMALLEST and LARGEST in magnitude
    (``diverged``: NaN and the infinities too). An integer is compared as it is: a float
    of 10**400 overflows."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if isinstance(value, float) and not math.isfinite(value):
        return diverged
    return value == 0 or SMALLEST <= abs(value) <= LARGEST


def seconds(value, positive: bool = False) -> bool:
    """Whether ``value`` is a time a run can measure: a number in range (:func:`in_range`),
    not negative (``positive``: above zero, as a step's time must be to divide by)."""
    return in_range(value) and (value > 0 if positive else value >= 0)
