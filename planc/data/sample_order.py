"""Which tokens of a token file sample j of a run reads (docs/data.md, Samples and steps).

``train { shuffle = off }`` (the default): sample j starts at token
``(j * (seq + 1)) mod (count - seq)``, consecutive stretches wrapping around the file.

``train { shuffle = on }``: the file is cut into ``n = count // (seq + 1)`` whole samples
(sample i is tokens ``i * (seq + 1)`` to ``(i + 1) * (seq + 1) - 1``; a tail shorter than a
sample is never read), an epoch is n samples of the run, and sample j of the run reads
file sample ``permute(j mod n, n, seed, j // n)``: each epoch a new permutation, seeded by
train.seed and the epoch's number. The sample of step k therefore depends on the seed and
k alone, so a resumed run reads what an uninterrupted one would.

The permutation is a 4-round Feistel network on the smallest even number of bits b with
2^b >= n (at least 2), cycle-walked into [0, n) (Black and Rogaway, "Ciphers with
arbitrary finite domains", 2002): O(1) memory and time per sample whatever the file's size,
so a 100 GB file needs no permutation table. Round r maps the halves (L, R) of x to
(R, L xor F(r, R)), F(r, R) the low b / 2 bits of the little-endian 8-byte BLAKE2b digest
of the bytes of ``struct.pack("<QQBQ", seed, epoch, r, R)``. Torch-free: the ranks and the
single-process reference of ``planc run --check`` read the same samples through it.
"""

from __future__ import annotations

import hashlib
import struct

ROUNDS = 4
_ROUND = struct.Struct("<QQBQ")


def permute(index: int, count: int, seed: int, epoch: int) -> int:
    """The image of ``index`` (0 <= index < count) in the permutation of range(count)
    of ``seed`` and ``epoch``."""
    if not 0 <= index < count:
        raise ValueError(f"index {index} is outside 0..{count - 1}")
    bits = max(2, (count - 1).bit_length())
    half = (bits + 1) // 2
    mask = (1 << half) - 1
    value = _encrypt(index, half, mask, seed, epoch)
    while value >= count:  # cycle-walking: x's cycle returns into range(count)
        value = _encrypt(value, half, mask, seed, epoch)
    return value


def _encrypt(value: int, half: int, mask: int, seed: int, epoch: int) -> int:
    left, right = value >> half, value & mask
    for round_ in range(ROUNDS):
        digest = hashlib.blake2b(_ROUND.pack(seed, epoch, round_, right), digest_size=8)
        left, right = right, left ^ (int.from_bytes(digest.digest(), "little") & mask)
    return (left << half) | right


def sample_start(j: int, count: int, seq: int, seed: int, shuffle: bool) -> int:
    """The token index (after any header) where sample ``j`` of the run begins, in a file
    of ``count`` tokens holding at least one sample of ``seq + 1`` tokens."""
    sample = seq + 1
    if not shuffle:
        return j * sample % (count - seq)
    samples = count // sample
    return permute(j % samples, samples, seed, j // samples) * sample
