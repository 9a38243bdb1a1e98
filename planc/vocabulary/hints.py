"""Candidate values for a diagnostic's hint ("try tp = 4 or tp = 2"): the checker's and
the model families' checks share them."""

from __future__ import annotations

import itertools
import math


def divisors_below(limit: int, *numbers: int, count: int = 2) -> list[int]:
    """The largest ``count`` values d in 2..limit-1, and at most 4096, that divide every
    one of ``numbers``."""
    return largest_divisors(math.gcd(*numbers), min(limit, 4097), count, least=2)


def largest_divisors(n: int, below: int, count: int = 2, least: int = 1,
                     budget: int = 100_000) -> list[int]:
    """The largest ``count`` divisors of ``n`` that are less than ``below`` and at least
    ``least``, for a hint. Searched downward from the first value that could be one, over
    at most ``budget`` values: a hostile plan may write heads = 100000144 (a search from
    there took 6 s) or hidden = 10**30, and a hint is not worth more than a few
    milliseconds."""
    top = below - 1 if n == 0 else min(below - 1, n)  # every number divides 0
    found = (d for d in range(top, max(top - budget, least - 1), -1) if n % d == 0)
    return list(itertools.islice(found, count))


def try_values(name: str, candidates: list[int]) -> str:
    """'try tp = 4 or tp = 2'; "" without candidates."""
    return "try " + " or ".join(f"{name} = {c}" for c in candidates) if candidates else ""
