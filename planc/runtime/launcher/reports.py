"""What planc run's launcher says when a run fails or stops making progress, rank by rank
(planc.runtime.launcher.launch); each rank is the launcher's record of it (``rank``,
``process``, ``log_dir``, ``stopped_since``)."""

from __future__ import annotations

import os

from planc.runtime.launcher.protocol import ERROR_FILE, EXIT_HANG


def failure_report(failed: list, stopped: list = (), erred: list = ()) -> str:
    """What failed: the ranks that exited (``failed``, the first first) and those stopped
    after their own one-line error (``erred``), a rank that printed another's error
    (``same_as``: the launcher showed it once) said so, ranks with the same words in one
    line; the ranks ``stopped`` for it in one line; each traceback once, the first
    failure's first."""
    said: dict[str, list] = {}
    for entry in sorted([*failed, *erred], key=lambda e: e.rank):
        code = entry.process.exitcode
        if entry in erred:
            what = "failed with the error above" if entry.same_as is None else \
                f"failed with the same error as rank {entry.same_as} (above)"
        else:
            what = f"killed by signal {-code}" if code is not None and code < 0 else \
                f"exited with status {code}"
            if entry.same_as is not None:
                what += f", with the same error as rank {entry.same_as} (above)"
        said.setdefault(what, []).append(entry)
    lines = [f"planc: {_named(entries)} {what}" for what, entries in said.items()]
    if stopped:
        lines.append(stopped_line(stopped, [*failed, *erred]))
    # every traceback once, the first failure's first; ranks that raised the same, together
    traces: dict[str, list] = {}
    for entry in [failed[0], *sorted([*failed[1:], *erred], key=lambda e: e.rank)]:
        trace = _traceback(entry)
        if trace:
            traces.setdefault(trace, []).append(entry)
    for trace, entries in traces.items():
        first, *others = entries
        also = f" (and of {_named(others)}, the same)" if others else ""
        lines.append(f"planc: traceback of rank {first.rank}, the first to fail{also}:"
                     if first is failed[0] else f"planc: traceback of {_named(entries)}:")
        lines.append(trace)
    return "\n".join(lines)


def _traceback(entry) -> str:
    """The traceback a rank left in its log directory (ERROR_FILE), or ""."""
    try:
        with open(os.path.join(entry.log_dir, ERROR_FILE), encoding="utf-8",
                  errors="replace") as handle:
            return handle.read().rstrip()
    except OSError:
        return ""


def stopped_line(stopped: list, failed: list) -> str:
    """One line for the ranks stopped because others failed (each one's own report of
    the peer it lost is left out: the failure above is the cause)."""
    verb = "was" if len(stopped) == 1 else "were"
    return f"planc: {_named(stopped)} {verb} stopped because {_named(failed)} failed"


def _named(entries: list) -> str:
    """'rank 3', or 'ranks 0, 2, 5'."""
    numbers = sorted(e.rank for e in entries)
    return f"rank {numbers[0]}" if len(numbers) == 1 else \
        f"ranks {', '.join(map(str, numbers))}"


def hang_report(ranks: list, now: float, silent: list, grace: float) -> str:
    """Why a run that stopped making progress was stopped, rank by rank (what each rank
    waits for is above, in its own output). A stopped rank is named whether or not it
    has been stopped for the whole timeout: the others' reports may come first."""
    lines = []
    for entry in ranks:
        if entry.stopped_since is not None:
            lines.append(f"planc: rank {entry.rank} was stopped (by SIGSTOP or a debugger) "
                         f"for {now - entry.stopped_since:.0f} s; the run was stopped")
        elif entry in silent:
            where = "" if entry.training() else \
                " (it had not started training: it was still joining the process groups)"
            lines.append(f"planc: rank {entry.rank} did not report what it waits for within "
                         f"{grace:g} s{where}")
        elif entry.reported() or entry.process.exitcode == EXIT_HANG:
            lines.append(f"planc: rank {entry.rank} stopped after reporting what it waited "
                         f"for (above)")
    return "\n".join(lines)
