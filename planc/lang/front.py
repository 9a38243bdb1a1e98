"""The front end: .plan file to validated Plan (parse, check, estimate memory)."""

from __future__ import annotations

import errno
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from planc.host.collector import without_collector
from planc.diagnostics import Diagnostic, Span, error, in_source_order, warning
from planc.host.files import read_regular_file
from planc.lang.check import check
from planc.lang.overrides import Override, OverrideError, parse_overrides
from planc.lang.parser import parse
from planc.lang.group_spans import tp_placement_warnings
from planc.vocabulary.units import format_bytes
from planc.plan.plan import Plan
from planc.diagnostics import counted

# A plan is a few KB; even a generated one with an explicit stage list at the layer limit
# is well under 100 KB. Reading and checking costs up to about a second per MB of the
# densest input (bench/diagnostics.py), so bigger files are refused before they are parsed.
MAX_FILE_BYTES = 256 * 2**10

__all__ = ["MAX_FILE_BYTES", "Loaded", "Override", "OverrideError", "load_file",
           "load_text", "memory_warnings"]


@dataclass(frozen=True)
class Loaded:
    """The outcome of reading one .plan file."""

    path: str
    source: str | None
    plan: Plan | None
    diagnostics: tuple[Diagnostic, ...]
    overrides: tuple[Override, ...] = ()  # the --set overrides applied, in order

    @property
    def ok(self) -> bool:
        return self.plan is not None and not any(d.is_error for d in self.diagnostics)


def load_file(path: str | Path, overrides: Sequence[str] = ()) -> Loaded:
    """Read, parse and check a plan file with ``overrides`` (``KEY=VALUE`` texts, as
    given to ``--set``) applied; never raises for anything in the file. A malformed
    override raises OverrideError (a ValueError) before the file is read."""
    parsed = parse_overrides(overrides)
    name = str(path)
    too_large = error(f"file is larger than {MAX_FILE_BYTES // 2**10} KiB; a plan is a short "
                      f"text, and larger files are refused so that check stays interactive",
                      None)
    try:
        data = read_regular_file(path, MAX_FILE_BYTES + 1)
    except OSError as exc:
        if exc.errno == errno.EFBIG:
            return Loaded(name, None, None, (too_large,))
        if exc.errno == errno.EISDIR:
            return Loaded(name, None, None, (error("is a directory, not a .plan file", None),))
        return Loaded(name, None, None, (error(f"cannot read file: {exc.strerror}", None),))
    except ValueError:  # a path with a NUL character
        return Loaded(name, None, None, (error("cannot read file: the path holds a NUL "
                                               "character", None),))
    if len(data) > MAX_FILE_BYTES:  # a file that grew while it was read
        return Loaded(name, None, None, (too_large,))
    data = data.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte-order mark is not content
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        line_start = data.rfind(b"\n", 0, exc.start) + 1
        column = len(data[line_start:exc.start].decode("utf-8", errors="replace")) + 1
        return Loaded(name, None, None, (error(
            f"file is not valid UTF-8 (byte 0x{data[exc.start]:02x})", Span.point(line, column),
            "a plan file is UTF-8 text"),))
    return _load_text(text, name, parsed)


def load_text(text: str, path: str = "<plan>", overrides: Sequence[str] = ()) -> Loaded:
    """Parse and check the text of a plan file with ``overrides`` applied (see
    load_file); the overrides are checked only when the file parses."""
    return _load_text(text, path, parse_overrides(overrides))


@without_collector  # a plan's syntax tree and diagnostics hold no cycles (planc.host.collector)
def _load_text(text: str, path: str, overrides: tuple[Override, ...]) -> Loaded:
    tree, diagnostics = parse(text)
    plan = None
    if tree is not None:
        plan, diagnostics = check(tree, path, overrides)
        if plan is not None:
            diagnostics = diagnostics + memory_warnings(plan) + tp_placement_warnings(plan)
    return Loaded(path, text, plan, tuple(in_source_order(diagnostics)), overrides)


def memory_warnings(plan: Plan) -> list[Diagnostic]:
    from planc.estimate import memory

    estimate = memory.estimate(plan)
    if not estimate.overflows:
        return []
    peak = estimate.peak
    span = plan.sources.span("topology.device.memory", "topology.preset", "topology", "plan")
    stage = f" on pipeline stage {peak.stage}" if plan.mesh.pp > 1 else ""
    return [warning(
        f"estimated memory per device{stage} is {format_bytes(peak.total_bytes)}, more than "
        f"the device's {format_bytes(estimate.capacity)}", span,
        f"parameters {format_bytes(peak.parameter_bytes)}, gradients "
        f"{format_bytes(peak.gradient_bytes)}, optimizer state "
        f"{format_bytes(peak.optimizer_bytes)}, activations "
        f"{format_bytes(peak.activation_bytes)} ("
        f"{counted(peak.microbatches_in_flight, 'microbatch', 'microbatches')} in flight)"
        + (f", ZeRO-3's largest unit whole {format_bytes(peak.unsharded_bytes)}"
           if peak.unsharded_bytes else ""),
        "zero, recompute, more tp or pp, or a smaller microbatch would lower it")]
