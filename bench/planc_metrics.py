"""``planc run`` of a plan for a benchmark: its records, not its progress lines."""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path


def run_for_metrics(text: str, directory: Path) -> tuple[list[dict] | None, str]:
    """``planc run`` of the plan ``text`` inside ``directory`` (the plan file, its build
    and its metrics there), what it prints held back: the metrics records, one a step, or
    None and the last 3,000 characters it printed when it failed. A run stopped by a
    signal stops the benchmark with planc's status, 128 + the signal's number."""
    from planc.cli import main

    (directory / "bench.plan").write_text(text)
    metrics = directory / "metrics.jsonl"
    captured = io.StringIO()
    with contextlib.redirect_stderr(captured), contextlib.redirect_stdout(io.StringIO()):
        status = main(["run", str(directory / "bench.plan"), "-o", str(directory / "build"),
                       "--metrics", str(metrics), "--force"])
    if status > 128:  # planc run was stopped by a signal (Ctrl-C, a time limit): so is
        sys.stderr.write(captured.getvalue()[-3000:])  # the benchmark, as a shell would
        raise SystemExit(status)
    if status != 0:
        return None, captured.getvalue()[-3000:]
    return [json.loads(line) for line in metrics.read_text().splitlines()], ""
