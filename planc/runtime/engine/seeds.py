"""The seeds of a run's random values: initial weights (planc.runtime.engine.model) and
synthetic batches (planc.runtime.engine.data), each from the plan's seed and a name, so that
every plan of one model starts from the same weights and sees the same data
(docs/language.md, train). Torch-free: both modules import it."""

from __future__ import annotations

import hashlib


def seed_of(*parts) -> int:
    """A 60-bit seed for a torch.Generator, from the parts' text."""
    return int(hashlib.sha256("/".join(map(str, parts)).encode()).hexdigest()[:15], 16)
