"""``planc tune``'s text: its progress, the ranked layouts, and the best as a plan file."""

from __future__ import annotations

import time
from typing import TextIO

from planc.vocabulary.units import TIME, format_bytes, format_quantity
from planc.tune.candidate_text import without_blocks
from planc.views.tables import table
from planc.diagnostics import counted

PRUNING_WORDS = {
    "memory": "over the memory per device (planc.estimate.memory's estimate, as planc run "
              "holds it)",
    "dominated": "the same layout with less recomputation or a lower ZeRO stage fits",
    "bound": "slower at best than the K-th best already simulated (compute at the fastest kernel's rate)",
    "check": "refused by planc check",
    "same plan": "the same plan as a candidate already simulated",
    "budget": "not simulated: the time budget (--budget) ran out; their estimates were "
              "worse than every candidate simulated",
    "unestimated": "neither estimated nor simulated: the estimates of the candidates "
                   "before them took half the time budget (--budget)",
}


class Progress:
    """A bar on a terminal, redrawn at most ten times a second; nothing elsewhere."""

    def __init__(self, stream: TextIO):
        self.stream = stream
        self.shown = hasattr(stream, "isatty") and stream.isatty()
        self.last = 0.0

    def __call__(self, phase: str, done: int, total: int) -> None:
        now = time.monotonic()
        if not self.shown or (now - self.last < 0.1 and done < total):
            return
        self.last = now
        filled = 24 * done // max(total, 1)
        self.stream.write(f"\rplanc tune: {phase:<10} [{'#' * filled}{'-' * (24 - filled)}] "
                          f"{done:,}/{total:,}")
        self.stream.flush()

    def close(self) -> None:
        if self.shown:
            self.stream.write("\r" + " " * 60 + "\r")
            self.stream.flush()


def _seconds(s: float) -> str:
    return format_quantity(s, TIME)


def _within(ratio: float, accuracy) -> str:
    """What a simulated speed-up is worth beside the simulator's expected error."""
    if accuracy is None:
        return ", by a model not measured on this device"
    if not accuracy.tells_apart(ratio):
        return (f"; within the simulator's expected error of ± {accuracy.median:.1%}, so "
                f"not a difference it can tell apart")
    return ""


def _tie(ratio: float) -> bool:
    """Whether two simulated steps are the same as the ratio is printed (to 0.1 %)."""
    return f"{ratio:.3f}" == "1.000"


TIE = "the same simulated step to 0.1 %: a tie, ranked by the layouts' text"


def _own_line(search, accuracy) -> list[str]:
    """Where the file's own layout ranks, and whether #1 is told apart from it."""
    own = next((k for k, r in enumerate(search.ranked) if r.candidate == search.own), None)
    if own is None:
        return []
    if own == 0:
        return ["", "the file's own layout is #1."]
    ratio = search.ranked[own].step_seconds / search.ranked[0].step_seconds
    if _tie(ratio):
        return ["", f"the file's own layout is #{own + 1}, with #1 {TIE}."]
    return ["", f"the file's own layout is #{own + 1}: #1 is {ratio:.3f}x faster by the "
                f"simulator{_within(ratio, accuracy)}."]


def render(search, gpus: int, top: int, accuracy=None, mtbf: float | None = None) -> str:
    """``accuracy``: the simulator's expected error for the plan
    (planc.simulate.accuracy), None where it was not measured; ``mtbf``: the hours
    between failures the layouts were ranked with (planc tune --mtbf)."""
    pruned = sum(search.pruned.values())
    lines = [f"planc tune: {counted(search.considered, 'layout')} on {gpus:,} devices in "
             f"{search.seconds:.1f} s: {pruned:,} pruned, {search.simulated:,} simulated"]
    for reason, count in sorted(search.pruned.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {count:>8,} {reason}" + (f": {PRUNING_WORDS[reason]}"
                                                  if reason in PRUNING_WORDS else ""))
    if not search.ranked:
        return "\n".join(lines) + "\n"
    rows = [[k + 1, r.candidate.text(), _seconds(r.step_seconds), f"{r.tflops_per_gpu:.1f}",
             f"{r.mfu:.1%}", f"{r.bubble:.1%}", _seconds(r.exposed_seconds),
             format_bytes(r.memory_bytes)] for k, r in enumerate(search.ranked[:top])]
    header = ["#", "layout", "step", "TFLOP/s", "MFU", "bubble", "exposed", "memory"]
    if mtbf is not None:  # ranked by this column
        header.append("all in")
        for row, r in zip(rows, search.ranked):
            row.append(_seconds(r.effective_seconds))
    lines += ["", table(header, rows)]
    if mtbf is not None:
        lines.append(f"all in: the step with checkpoints at Young's interval and a failure "
                     f"every {mtbf:g} h (planc simulate --mtbf, docs/simulate.md); ranked by it")
    lines += _own_line(search, accuracy)
    if len(search.ranked) > 1 and search.ranked[1].build is not None:
        from planc.views import diff_text

        best, next_ = search.ranked[0], search.ranked[1]
        ratio = next_.step_seconds / best.step_seconds
        lines += ["", f"#1 beside #2 ({TIE}):" if _tie(ratio) else
                  f"why #1 beats #2 ({ratio:.3f}x faster{_within(ratio, accuracy)}):",
                  diff_text.render([("#2", next_.build, next_.simulation, []),
                                    ("#1", best.build, best.simulation, [])]).rstrip()]
    return "\n".join(lines) + "\n"


def best_file(search, gpus: int, argv: list[str]) -> str:
    """The best layout's plan file, with a header saying how it was chosen."""
    best = search.best
    runner = f"; #2 ({search.ranked[1].candidate.text()}) {_seconds(search.ranked[1].step_seconds)}" \
        if len(search.ranked) > 1 else ""
    header = [f"# Chosen by planc {' '.join(map(_shown_argument, argv))}",
              f"# on {gpus:,} devices: {best.candidate.text()}",
              f"# simulated step {_seconds(best.step_seconds)}, {best.tflops_per_gpu:.1f} "
              f"TFLOP/s per device, MFU {best.mfu:.1%}{runner}",
              f"# out of {search.considered:,} layouts ({search.simulated:,} simulated, "
              f"{sum(search.pruned.values()):,} pruned)."]
    text = best.text if best.text.endswith("\n") else best.text + "\n"
    chosen = best.candidate
    text = without_blocks(text, [("shard", axis) for axis in ("tp", "cp", "pp")
                                 if getattr(chosen, axis) == 1] +
                          ([] if chosen.sequence_parallel or chosen.tp == 1 else
                           [("shard", "tp", "gathered_inputs")]))
    return "\n".join(header) + "\n" + text


def _shown_argument(argument: str) -> str:
    """An argument on one line of printable text, quoted for a shell where it needs to be:
    a path's bytes that are no UTF-8 (held as surrogates) as ``\\xff``, and an argument
    with a newline or another unprintable character as Python's ``ascii`` writes it, so
    that a file name cannot end the header's comment and put its rest into the plan."""
    import shlex

    text = argument.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    return shlex.quote(text) if text.isprintable() else ascii(text)
