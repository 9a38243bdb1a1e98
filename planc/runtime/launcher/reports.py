"""What planc run's launcher says when a run fails or stops making progress, rank by rank
(planc.runtime.launcher.launch); each rank is the launcher's record of it (``rank``,
``process``, ``log_dir``, ``stopped_since``)."""

from __future__ import annotations

import os

from planc.runtime.launcher.protocol import ERROR_FILE, EXIT_HANG


def failure_report(failed: list) -> str:
    """What failed, and the traceback of the first rank to fail."""
    lines = []
    for entry in sorted(failed, key=lambda e: e.rank):
        code = entry.process.exitcode
        what = f"killed by signal {-code}" if code is not None and code < 0 else \
            f"exited with status {code}"
        lines.append(f"planc: rank {entry.rank} {what}")
    first = failed[0]
    try:
        with open(os.path.join(first.log_dir, ERROR_FILE), encoding="utf-8",
                  errors="replace") as handle:
            trace = handle.read().rstrip()
    except OSError:
        trace = ""
    if trace:
        lines.append(f"planc: traceback of rank {first.rank}, the first to fail:")
        lines.append(trace)
    return "\n".join(lines)


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
