"""A ``planc run --metrics`` file read as untrusted input: one JSON object per step
(docs/metrics.md), for ``planc report`` and ``planc plot``. No torch."""

from __future__ import annotations

import json
import math


def read_metrics(path: str) -> tuple[list[dict] | None, str | None]:
    """The records of a ``planc run --metrics`` file, or why it cannot be read."""
    try:
        with open(path, encoding="utf-8") as handle:
            records = [json.loads(line) for line in handle if line.strip()]
    except OSError as exc:
        return None, f"cannot read {path}: {exc.strerror or exc}"
    except (ValueError, RecursionError):  # not JSON, not UTF-8, nested past Python's stack
        return None, f"{path} is not a planc run metrics file (one JSON object per line)"
    if not records or not all(isinstance(r, dict) and seconds(r.get("time_s"), positive=True)
                              for r in records):
        return None, f"{path} is not a planc run metrics file (no step records with time_s)"
    if not all(seconds(r.get("exposed_comm_s", 0.0)) for r in records):
        return None, (f"{path} is not a planc run metrics file (an exposed_comm_s that is "
                      f"not a number of seconds)")
    if not all(isinstance(r.get("build", ""), str) for r in records):
        return None, (f"{path} is not a planc run metrics file (a build fingerprint that is "
                      f"not text)")
    return records, None


def seconds(value, positive: bool = False) -> bool:
    """Whether ``value`` is a time a run can measure: a finite number, not negative
    (``positive``: above zero, as a step's time must be to divide by)."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and \
        math.isfinite(value) and (value > 0 if positive else value >= 0)
