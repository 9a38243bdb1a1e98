"""The lines planc calibrate fits through its timings, and how sure each one is; no
torch, so that the command line reads a topology's timings without it.

A bandwidth is the inverse of the slope of time against message size. Its interval is
the slope's: the least-squares standard error of the slope through every timing of every
size (each repeat's slowest rank, not their medians), times Student's t at 95 % for the
timings' degrees of freedom (any statistics text, e.g. Montgomery and Runger, "Applied
Statistics and Probability for Engineers", section 11-4), around the slope of the
medians that the figure itself comes from.
"""

from __future__ import annotations

import math
import statistics

# Student's t, two-sided 95 % (the 0.975 quantile), for 1 to 30 degrees of freedom
# (standard tables); beyond, the Cornish-Fisher expansion around the normal's 1.96.
_T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201,
          2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074,
          2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
_Z_975 = 1.959964


def t_975(freedom: int) -> float:
    """Student's t at 0.975 for ``freedom`` (at least 1) degrees of freedom."""
    if freedom <= len(_T_975):
        return _T_975[freedom - 1]
    z = _Z_975
    return z + (z ** 3 + z) / (4 * freedom) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / \
        (96 * freedom ** 2)


def slope_fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(seconds per byte, seconds at zero bytes): the least-squares line through every
    measured size. The slope between the two largest sizes alone (this fit before) made
    noise a bandwidth: with 8 ranks on 2 cores a 1 MB all_reduce could take no longer
    than a 256 KB one, and calibrate printed 1.75e+06 GB/s. Where time does not grow
    with size even so, the slope is bounded by the largest size's whole time taken as
    its transfer (the least bandwidth that measurement allows), and the time at zero
    bytes is then what the smallest size took beyond that rate."""
    count = len(points)
    mean_bytes = sum(b for b, _ in points) / count
    mean_time = sum(t for _, t in points) / count
    spread = sum((b - mean_bytes) ** 2 for b, _ in points)
    slope = sum((b - mean_bytes) * (t - mean_time) for b, t in points) / spread
    if slope > 0:
        return slope, max(mean_time - slope * mean_bytes, 0.0)
    (small, t_small), (large, t_large) = min(points), max(points)
    slope = t_large / large
    return slope, max(t_small - slope * small, 0.0)


def medians(timings: list) -> list[tuple[int, float]]:
    """(bytes, the median of its timings) of each size: the points a figure is fitted to."""
    return [(int(nbytes), statistics.median(times)) for nbytes, times in timings]


def bandwidth_interval(timings) -> tuple[int, float, float | None] | None:
    """(the number of timings, the lowest and the highest bandwidth at 95 %, each as a
    multiple of the figure fitted to the medians): None where the timings cannot say
    (fewer than three, or fewer than two sizes). The highest is None where the slope's
    interval reaches zero: the timings allow any bandwidth above the lowest."""
    if not isinstance(timings, list) or not timings:
        return None
    try:
        observed = [(float(b), float(t)) for b, times in timings for t in times]
        slope, _ = slope_fit(medians(timings))
    except (TypeError, ValueError, ZeroDivisionError, statistics.StatisticsError):
        return None  # a topology edited by hand: no interval, rather than a traceback
    sizes = {b for b, _ in observed}
    if len(observed) < 3 or len(sizes) < 2:
        return None
    count = len(observed)
    mean_bytes = sum(b for b, _ in observed) / count
    mean_time = sum(t for _, t in observed) / count
    spread = sum((b - mean_bytes) ** 2 for b, _ in observed)
    fitted = sum((b - mean_bytes) * (t - mean_time) for b, t in observed) / spread
    at_zero = mean_time - fitted * mean_bytes
    residual = sum((t - at_zero - fitted * b) ** 2 for b, t in observed) / (count - 2)
    margin = t_975(count - 2) * math.sqrt(residual / spread)
    highest = slope / (slope - margin) if slope > margin else None
    return count, slope / (slope + margin), highest
