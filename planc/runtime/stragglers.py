"""Naming the straggler: a rank whose streams are busy consistently longer than its peers'
(issue 39), before its slowness becomes a hang.

Ranks of one pipeline stage run the same program on other data or other shards (dp, cp,
tp and ep peers), so their compute stream's busy time (``compute_s``) should match
within noise; a rank on a throttled GPU or a busy host computes longer, and its peers wait
for it (their exposed communication grows, not their busy time). A rank is a straggler
once, for ``patience`` steps in a row after the first ``warmup``, its compute stream is
busy more than ``1 + margin`` times the median of its peers' (the Llama 3 report,
Dubey et al. 2024, section 3.3.4, describes such stragglers slowing whole jobs and the
tracing that finds them). Ranks of other stages are not peers: a pipeline's stages
differ by design.

Pure Python on the per-step table the metrics gather; no torch.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

# The compute stream only: its busy time is the rank's own. A collective's time on a
# transfer stream includes waiting for the slowest member (a fast rank's all-reduce lasts
# until the straggler joins it), so per-rank stream times cannot tell a slow link from
# the ranks that wait on it (bench/straggler.py saw a fast rank's comm_s 38x its peer's).
STREAMS = (("compute", "compute_s"),)
DEFAULT_MARGIN = 0.2  # 20 % over the peers' median
DEFAULT_PATIENCE = 5  # steps in a row
# The first steps are left out, as benchmarks leave them: each rank warms its allocator and
# caches at its own pace, and on a machine with more ranks than cores the scheduler's
# noise alone can put one rank 20 % behind for a few steps.
WARMUP_STEPS = 2
NOISE_S = 1e-3  # excess below a millisecond is timer noise, not a straggler


@dataclass
class StragglerWatch:
    """``peers``: the groups of ranks that run the same program (one per stage)."""

    peers: list[list[int]]
    margin: float = DEFAULT_MARGIN
    patience: int = DEFAULT_PATIENCE
    warmup: int = WARMUP_STEPS
    streak: dict[tuple[int, str], int] = field(default_factory=dict)
    seen: int = 0

    def observe(self, busy: dict[str, list[float]]) -> dict | None:
        """One step's busy seconds by field (``compute_s``, ``comm_s``), each a list
        indexed by rank: the straggler it names (rank, stream, how much slower than its
        peers' median, for how many steps), or None."""
        self.seen += 1
        if self.seen <= self.warmup:
            return None
        named = None
        for group in self.peers:
            if len(group) < 2:
                continue
            for stream, key in STREAMS:
                times = busy[key]
                for rank in group:
                    others = statistics.median(times[r] for r in group if r != rank)
                    slow = times[rank] > (1 + self.margin) * others and \
                        times[rank] - others > NOISE_S
                    streak = self.streak.get((rank, stream), 0) + 1 if slow else 0
                    self.streak[(rank, stream)] = streak
                    if streak >= self.patience:
                        slower = times[rank] / others - 1 if others > 0 else float("inf")
                        if named is None or slower > named["slower_by"]:
                            named = {"rank": rank, "stream": stream,
                                     "slower_by": round(slower, 3), "steps": streak}
        return named


def describe(named: dict) -> str:
    """The progress line's words for a straggler."""
    return (f"straggler: rank {named['rank']}'s {named['stream']} stream "
            f"{named['slower_by']:.0%} slower than its peers' for {named['steps']} steps")
