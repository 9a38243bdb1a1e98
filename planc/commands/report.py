"""``planc report``: one self-contained HTML page about a plan or build."""

from __future__ import annotations

import json
import os
import sys

from planc.commands import EXIT_OK, EXIT_USAGE, fail, load_programs


def _metrics(path: str) -> tuple[list[dict] | None, str | None]:
    """The records of a ``planc run --metrics`` file, or why it cannot be read."""
    try:
        with open(path, encoding="utf-8") as handle:
            records = [json.loads(line) for line in handle if line.strip()]
    except OSError as exc:
        return None, f"cannot read {path}: {exc.strerror or exc}"
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None, f"{path} is not a planc run metrics file (one JSON object per line)"
    if not records or not all(isinstance(r, dict) and isinstance(r.get("time_s"), (int, float))
                              for r in records):
        return None, f"{path} is not a planc run metrics file (no step records with time_s)"
    return records, None


def main(args) -> int:
    from planc.files import write_atomically
    from planc.simulate import simulate
    from planc.views import report_html

    if os.path.isdir(args.output):
        return fail(f"-o {args.output} is a directory; name the page, such as report.html",
                    EXIT_USAGE)
    metrics = None
    if args.metrics:
        metrics, problem = _metrics(args.metrics)
        if problem:
            return fail(problem)
    built, status = load_programs(args, verified=True)
    if built is None:
        return status
    result = simulate(built, keep_timeline=True)
    page = report_html.render(built, result, metrics)
    try:
        write_atomically(args.output, page.encode())
    except OSError as exc:
        return fail(f"cannot write {args.output}: {exc.strerror or exc}")
    print(f"report written to {args.output} ({len(page) // 1024} KB, self-contained)",
          file=sys.stderr)
    return EXIT_OK
