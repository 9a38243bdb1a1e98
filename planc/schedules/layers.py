"""Which layers each model chunk runs when ``stages = auto``: the rule, on plain numbers.

A chunk is an inclusive layer range ``(first, last)``; chunk c runs on the pipeline rank
its schedule's placement gives (c mod pp, or a V: planc.schedules.schedule.ChunkPlacement). A chunk with no transformer layer is written ``(first, first - 1)``: only the
model's first chunk (which still runs the embedding) and its last (the final norm, the
head and the loss) may be one, as in Llama 3's layout (Dubey et al. 2024, "The Llama 3
Herd of Models", section 3.3.2: "the first model chunk on the first stage has only the
embedding, and the last model chunk on the last stage has only output projection and
loss calculation").

When ``pp * virtual`` divides the layers every chunk gets the same number. Otherwise each
chunk gets ``layers // (pp * virtual)`` and the remaining layers go out one at a time to
the pipeline rank with the least work, counting the embedding as one layer's work on
rank 0 and the head with the loss as one on rank pp - 1 (Llama 3, section 3.3.2;
Megatron-Core's ``account_for_embedding_in_pipeline_split`` and
``account_for_loss_in_pipeline_split`` count them the same way), the lower rank first on
a tie; within a rank the layer goes to its earliest chunk still short of one, the model's
first and last chunks last. So 126 layers over 16 ranks of 2 chunks give the first and
the last chunk 3 layers and every other 4: ranks 0 and 15 hold 7 layers, the others 8.
"""

from __future__ import annotations

import heapq

from planc.schedules.schedule import LOOP, ChunkPlacement

Chunks = tuple[tuple[int, int], ...]

# The embedding, and the head with the loss, each weigh one layer in the balance.
EMBEDDING_WORK = HEAD_WORK = 1


def fewest_layers(pp: int, virtual: int) -> int:
    """The fewest layers ``pp`` ranks of ``virtual`` chunks can run: one per chunk, but
    the first and last chunk may hold the embedding or the head alone."""
    chunks = pp * virtual
    return max(chunks - 2, 1)


def balanced_chunks(layers: int, pp: int, virtual: int, placement: ChunkPlacement = LOOP,
                    ends: int = EMBEDDING_WORK) -> Chunks:
    """The chunks of ``stages = auto``, in chunk order (see the module's docstring), on
    the ranks ``placement`` puts them (round-robin, or a V: the head on rank 0).
    ``ends``: the layers' work the embedding and the head each count for (0: the layers
    alone, spread evenly, the lower ranks first; planc tune tries it).
    Needs ``layers >= fewest_layers(pp, virtual)``."""
    count = pp * virtual
    base, extra = divmod(layers, count)
    sizes = [base] * count
    rank_of = [placement.stage_of_chunk(c, pp, virtual) for c in range(count)]
    work = [virtual * base for _ in range(pp)]
    work[rank_of[0]] += ends
    work[rank_of[-1]] += ends
    ends = (0, count - 1)
    preference = {s: [c for c in range(count) if rank_of[c] == s and c not in ends]
                  + [c for c in ends if rank_of[c] == s] for s in range(pp)}
    filled = [0] * pp  # a rank's chunks take their extra layer in preference order
    waiting = [(work[s], s) for s in range(pp)]  # the least work first, then the lower rank
    heapq.heapify(waiting)
    for _ in range(extra):
        _, rank = heapq.heappop(waiting)
        sizes[preference[rank][filled[rank]]] += 1
        filled[rank] += 1
        work[rank] += 1
        if filled[rank] < virtual:
            heapq.heappush(waiting, (work[rank], rank))
    return ranges_of(sizes)


def ranges_of(sizes: list[int]) -> Chunks:
    """Consecutive inclusive ranges of the given sizes, from layer 0."""
    ranges, first = [], 0
    for size in sizes:
        ranges.append((first, first + size - 1))
        first += size
    return tuple(ranges)


def chunk_text(chunks: Chunks, chunk: int) -> str:
    """``layer 3``, ``layers 3-5``, or what a chunk with no layer runs."""
    first, last = chunks[chunk]
    if first > last:
        return "the embedding alone" if chunk == 0 else "the head alone"
    return f"layer {first}" if first == last else f"layers {first}-{last}"


def range_text(chunks: Chunks, chunk: int) -> str:
    """The chunk as a stages list writes it: ``0..3``, ``embedding`` or ``head``."""
    first, last = chunks[chunk]
    if first > last:
        return "embedding" if chunk == 0 else "head"
    return f"{first}..{last}"
