"""Which samples each step reads: train.shuffle's permutation per epoch (planc.data.sample_order,
docs/data.md), and a large token file that planc check and planc run never read whole."""

from __future__ import annotations

import hashlib
import os
import struct

import pytest

from planc.data.sample_order import permute, sample_start
from planc.data.tokens import SCAN_LIMIT, header, write_tokens


def documented_permutation(count: int, seed: int, epoch: int) -> list[int]:
    """docs/data.md's permutation, written again from its text: a 4-round Feistel network
    on the smallest even number of bits b with 2^b >= count (at least 2), cycle-walked."""
    bits = max(2, (count - 1).bit_length())
    bits += bits % 2
    half = bits // 2

    def encrypt(x: int) -> int:
        left, right = x >> half, x % (1 << half)
        for r in range(4):
            digest = hashlib.blake2b(struct.pack("<QQBQ", seed, epoch, r, right),
                                     digest_size=8).digest()
            left, right = right, left ^ (int.from_bytes(digest, "little") % (1 << half))
        return left * (1 << half) + right

    out = []
    for x in range(count):
        y = encrypt(x)
        while y >= count:
            y = encrypt(y)
        out.append(y)
    return out


@pytest.mark.parametrize("count", [1, 2, 3, 4, 5, 7, 16, 17, 100, 1000, 4097])
def test_each_epoch_is_a_permutation_as_documented(count):
    orders = []
    for seed, epoch in ((0, 0), (0, 1), (7, 0)):
        order = [permute(i, count, seed, epoch) for i in range(count)]
        assert sorted(order) == list(range(count))
        assert order == documented_permutation(count, seed, epoch)
        orders.append(order)
    if count >= 7:  # another epoch or seed: another order
        assert orders[0] != orders[1] and orders[0] != orders[2]
        assert orders[0] != list(range(count))


def test_the_permutation_of_a_huge_file_needs_no_table():
    count = 10**12  # samples: beyond any list
    seen = {permute(i, count, 3, 5) for i in range(1000)}
    assert len(seen) == 1000 and all(0 <= s < count for s in seen)
    with pytest.raises(ValueError):
        permute(count, count, 3, 5)


def test_shuffled_steps_read_every_whole_sample_once_per_epoch(tmp_path):
    pytest.importorskip("torch")
    from planc.runtime.engine.data import DataSource, batch_tokens

    # 10 whole samples of 8 tokens and a tail of 3 that is never read; sample i holds
    # the ids 8 i .. 8 i + 7, so a row names the file sample it came from
    path = tmp_path / "t.tokens"
    write_tokens(path, range(83), 4)
    source = DataSource(str(path), seed=11, batch=4, seq=7, vocab=128, shuffle=True)
    rows = [row for step in range(5) for row in batch_tokens(source, step).tolist()]
    assert all(row == list(range(row[0], row[0] + 8)) and row[0] % 8 == 0 for row in rows)
    read = [row[0] // 8 for row in rows]  # 20 samples: epochs 0 and 1
    assert read == documented_permutation(10, 11, 0) + documented_permutation(10, 11, 1)
    assert sorted(read[:10]) == sorted(read[10:]) == list(range(10))
    assert read[:10] != read[10:]
    # shuffle off: consecutive stretches, wrapping over the 83 - 7 = 76 sample starts
    plain = DataSource(str(path), seed=11, batch=4, seq=7, vocab=128)
    assert [row[0] for row in batch_tokens(plain, 2).tolist()] == \
        [8 * j % 76 for j in range(8, 12)]
    # the same seed and step, the same samples: a resumed run reads what the whole one did
    assert batch_tokens(source, 3).tolist() == rows[12:16]


# --- a 100 GB file --------------------------------------------------------------------

BIG = 100 * 10**9  # bytes of tokens after the header: 25 billion uint32 zeros


@pytest.fixture
def big_file(tmp_path):
    """A sparse 100 GB token file (zeros are token 0, valid): no disk space used."""
    path = tmp_path / "big.tokens"
    path.write_bytes(header(4))
    os.truncate(path, len(header(4)) + BIG)
    assert os.stat(path).st_blocks * 512 < 1 << 20  # really sparse
    return path


def plan_of(data, **train) -> str:
    extra = "".join(f"; {k} = {v}" for k, v in train.items())
    return (f'plan big {{\n  model gpt {{ layers = 2; hidden = 16; heads = 2; vocab = 64; '
            f'seq = 7; batch = 4 }}\n  mesh {{ dp = 2 }}\n  schedule {{ microbatches = 2 }}\n'
            f'  train {{ steps = 1; optimizer = sgd(lr = 0.1); data = "{data}"{extra} }}\n}}\n')


def test_planc_check_and_run_start_on_a_100_gb_file_without_reading_it(
        big_file, tmp_path, capfd, monkeypatch):
    pytest.importorskip("torch")
    from planc.data import tokens
    from planc.cli import main

    scanned = []  # every whole-file scan, by size: none of this file
    scan = tokens.largest_token
    monkeypatch.setattr(tokens, "largest_token",
                        lambda fd, t, *a, **k: scanned.append(t.size) or scan(fd, t, *a, **k))
    plan = tmp_path / "big.plan"
    for shuffle in ("off", "on"):
        plan.write_text(plan_of(big_file.name, shuffle=shuffle))
        assert main(["check", str(plan)]) == 0
        assert main(["run", str(plan), "-o", str(tmp_path / "b"), "--backend", "gloo",
                     "--check", "--timeout", "60"]) == 0
        err = capfd.readouterr().err
        assert "running big" in err and "every loss and parameter matches" in err
    assert scanned == []
    # a bad id where step 0 reads (shuffled) is found by that step's read, and named
    j = 2  # sample 2 of the run: step 0's third row
    start = sample_start(j, BIG // 4, 7, 0, True)
    with open(big_file, "r+b") as out:
        out.seek(len(header(4)) + 4 * (start + 5))
        out.write(struct.pack("<I", 64))
    assert main(["run", str(plan), "-o", str(tmp_path / "b"), "--backend", "gloo",
                 "--timeout", "60"]) == 1
    err = capfd.readouterr().err
    assert (f"data file {big_file} holds token id 64 (token {start + 5} of the file, "
            f"position 5 of sample 2, read by step 0), not below vocab = 64") in err
    assert scanned == [] and os.stat(big_file).st_size > SCAN_LIMIT
