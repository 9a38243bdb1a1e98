"""The flat-buffer collectives under the names of the torch that runs.

torch 2.13 calls them ``all_gather_single`` and ``reduce_scatter_single``; earlier
releases (2.11 on the GPU machines this was checked on) ``all_gather_into_tensor`` and
``reduce_scatter_tensor``, with the same arguments. planc pins 2.13 for its tests; a
cluster's own torch may be older.
"""

from __future__ import annotations

import torch.distributed as dist

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or \
    dist.reduce_scatter_tensor
