"""Weighted mixtures of token files: ``train { data = [0.7, "web.tokens", 0.3, "code.tokens"] }``.

Which source each sample of the run comes from follows Megatron-LM's blended datasets
(``megatron/core/datasets/helpers.cpp``, ``build_blending_indices``): sample ``p`` goes to
the source whose share lags its weight most, ``argmax_d (w_d * max(p, 1) - n_d)`` over
the samples ``n_d`` it has had (ties to the first source). Megatron runs that over the
whole run, so finding sample ``j``'s source needs every sample before it; here it runs
over blocks of ``BLOCK`` samples, the same every block, so sample ``j`` is found from
``j`` alone: its block ``j // BLOCK`` and its place in it. Each source's share of every
block is its weight to within one sample (1/1024), and of any stretch of the run to within
two samples.

Sample ``i`` of source ``d`` (the ``i``-th sample the run takes from it) is cut from that
file as sample ``i`` of a run on it alone (planc.data.sample_order), with the seed
``seed + d``, so each source is read in its own order and, with ``shuffle``, once per
epoch of its own. The samples of step ``k`` therefore depend only on the seed, the
weights and ``k``: a run resumed under another layout reads what the whole run would.

The plan keeps a mixture as the text of a JSON list of ``[weight, path]`` pairs (paths
resolved, weights as written), where a single source keeps its path: no path planc
stores starts with ``[``, since every one is absolute.
"""

from __future__ import annotations

from functools import lru_cache

from planc.plan.data_source import blend_of

BLOCK = 1024


@lru_cache(maxsize=16)
def _block(weights: tuple[float, ...]) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
    """(the source of each place of a block, the samples each source has had before each
    place), by build_blending_indices' rule."""
    total = sum(weights)
    shares = [w / total for w in weights]
    counts = [0] * len(shares)
    sources, before = [], []
    for p in range(BLOCK):
        before.append(tuple(counts))
        lag = [share * max(p, 1) - n for share, n in zip(shares, counts)]
        chosen = lag.index(max(lag))
        sources.append(chosen)
        counts[chosen] += 1
    before.append(tuple(counts))
    return tuple(sources), tuple(before)


def source_of(j: int, weights: tuple[float, ...]) -> tuple[int, int]:
    """(source, its sample index) of sample ``j`` of the run."""
    sources, before = _block(weights)
    block, place = divmod(j, BLOCK)
    d = sources[place]
    return d, block * before[BLOCK][d] + before[place][d]


def samples_taken(samples: int, weights: tuple[float, ...]) -> tuple[int, ...]:
    """How many of the run's first ``samples`` samples each source gave."""
    _, before = _block(weights)
    block, place = divmod(samples, BLOCK)
    return tuple(block * whole + part for whole, part in zip(before[BLOCK], before[place]))


def shares(data: str, samples: int) -> dict[str, float] | None:
    """Each source's share of the run's first ``samples`` samples, by path; None for one
    source."""
    pairs = blend_of(data)
    if pairs is None:
        return None
    taken = samples_taken(samples, tuple(weight for weight, _ in pairs))
    return {path: round(n / max(samples, 1), 6) for (_, path), n in zip(pairs, taken)}
