"""Token files for a run: checking one whole before the ranks start, and reading one
step's batch into a tensor. The format, opening a file and the chunked scan are
:mod:`planc.data.tokens` (torch-free; ``planc check`` reads files with it alone); this module
adds torch's scan of a chunk (GB/s) and the batches.

Sample j of a run starts where :func:`planc.data.sample_order.sample_start` says (consecutive
stretches wrapping around the file, or with ``shuffle`` a permutation per epoch); the batch of
step k is samples ``k * batch .. (k + 1) * batch - 1`` (docs/language.md, train). One
step's batch reads only that step's samples, from the file the run was checked on
(planc.data.identity).

This module imports torch only where a tensor is asked for (``batch_tokens``) or where
torch is asked to scan (``engine="torch"``).
"""

from __future__ import annotations

import errno
import os
import sys
from array import array
from dataclasses import dataclass
from typing import TYPE_CHECKING

from planc.data import tokens as token_files
from planc.data.identity import Identity, how_changed
from planc.runtime.engine.seeds import seed_of
from planc.data.blend import source_of
from planc.plan.data_source import blend_of, paths_of
from planc.data.sample_order import sample_start
from planc.runtime.launcher.torch_threads import one_torch_thread
from planc.data.tokens import (ARRAY_CODES, CHUNK_BYTES, DTYPES, HEADER_BYTES,  # noqa: F401 (API)
                          SCAN_LIMIT, DataChanged, DataError, DataMissing, TokenFile, header,
                          open_tokens, write_tokens)

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from planc.plan.plan import Plan


class TorchChunks:
    """Unsigned maxima with signed tensors: torch 2.x has uint16/uint32 tensors but no
    reductions over them ("max_all" not implemented), so the bytes are read as int16/int32.
    Non-negative values are the same either way; when a chunk has negative ones (ids at or
    above 2^15 or 2^31), flipping the sign bit maps unsigned order onto signed order.

    The scan runs on one torch thread (planc.runtime.launcher.torch_threads): the copy from the
    page cache is one thread anyway, a cache-sized chunk reduces in microseconds, and
    OpenMP's barriers cost far more than they win on a busy machine (2 GiB on 2 busy
    cores: 3 GB/s on one thread, 0.7 on two).
    """

    def __init__(self, width: int, chunk: int):
        import torch

        self.torch = torch
        self.dtype = {2: torch.int16, 4: torch.int32}[width]
        self.sign = -(1 << (8 * width - 1))
        self.bias = 1 << (8 * width - 1)
        self.scratch = torch.empty(chunk // width, dtype=self.dtype)
        self.one_thread = one_torch_thread()

    def __enter__(self):
        self.one_thread.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.one_thread.__exit__(*exc)

    def _values(self, data):
        return self.torch.frombuffer(data, dtype=self.dtype)

    def largest(self, data) -> int:
        values = self._values(data)
        low, high = self.torch.aminmax(values)
        if int(low) >= 0:
            return int(high)
        flipped = self.torch.bitwise_xor(values, self.sign, out=self.scratch[:len(values)])
        return int(flipped.max()) + self.bias

    def first(self, data, value: int) -> int:
        # Block by block: nonzero() over a whole chunk of equal ids would list them all.
        values = self._values(data)
        signed = value - 2 * self.bias if value >= self.bias else value
        block = 1 << 16
        for start in range(0, len(values), block):
            hits = (values[start:start + block] == signed).nonzero()
            if len(hits):
                return start + int(hits[0])
        raise ValueError(f"{value} is not in the chunk")


def _reducer(engine: str) -> type:
    """The chunk reducer of ``engine``: "torch", "python", or "auto" (torch when it can be
    imported, on a little-endian machine: torch.frombuffer reads native order)."""
    if engine == "auto":
        try:
            import torch  # noqa: F401
            engine = "torch"
        except ImportError:
            engine = "python"
    if engine == "torch" and sys.byteorder != "little":
        engine = "python"
    return {"torch": TorchChunks, "python": token_files.PythonChunks}[engine]


def largest_token(fd: int, tokens: TokenFile, chunk_bytes: int = CHUNK_BYTES,
                  engine: str = "auto") -> tuple[int, int]:
    """:func:`planc.data.tokens.largest_token`, each chunk reduced by ``engine``."""
    return token_files.largest_token(fd, tokens, chunk_bytes, _reducer(engine))


def check_file(path: str, name: str | None = None, *, seq: int | None = None,
               vocab: int | None = None, scan_limit: int | None = None,
               chunk_bytes: int = CHUNK_BYTES, engine: str = "auto") -> TokenFile:
    """:func:`planc.data.tokens.check_file`, the scan's chunks reduced by ``engine``."""
    return token_files.check_file(path, name, seq=seq, vocab=vocab, scan_limit=scan_limit,
                                  chunk_bytes=chunk_bytes, reducer=_reducer(engine))


def import_scanner(plan: Plan) -> None:
    """Import what :func:`check_data` scans the plan's token file with (torch, where it
    is installed), so that the caller can do it at a moment of its choosing: torch's
    import swallows a Ctrl-C that arrives during it (planc.host.interrupts)."""
    if any(data_files(plan)):
        _reducer("auto")


def _evaluation_file(plan: Plan) -> str | None:
    """The evaluation's own token file (or mixture), where it reads one other than the
    training's: checked with it before any rank starts."""
    train = plan.train
    evaluates = train.eval_every > 0 and train.eval_data not in ("synthetic", train.data)
    return train.eval_data if evaluates else None


def data_files(plan: Plan) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The token files a run of ``plan`` reads: the evaluation's own (none where it reads
    the training's, or does not evaluate) and the training's (none for synthetic data)."""
    evaluation = _evaluation_file(plan)
    return (() if evaluation is None else paths_of(evaluation),
            () if plan.train.data == "synthetic" else paths_of(plan.train.data))


def check_data(plan: Plan, chunk_bytes: int = CHUNK_BYTES,
               scan_limit: int | None = SCAN_LIMIT) -> Identity | None:
    """The identity of the plan's data file (None for synthetic data), or DataError:
    checked once, before any rank starts, because the file may have appeared or changed
    since planc check; the ranks then read that file and no other. The header, the size
    (whole tokens, at least one sample) always; every id below vocab only in a file of at
    most ``scan_limit`` bytes (None: any size), so that a 100 GB file starts at once:
    each step checks the ids it reads (:func:`batch_tokens`)."""
    evaluation, training = data_files(plan)
    # the evaluation's before the ranks start: else a run found it missing only after
    # eval_every steps of training (each evaluation takes its identity)
    for path in evaluation:
        check_file(path, seq=plan.model.seq, vocab=plan.model.vocab,
                   scan_limit=scan_limit, chunk_bytes=chunk_bytes)
    if not training:  # synthetic
        return None
    found = tuple(check_file(path, seq=plan.model.seq, vocab=plan.model.vocab,
                             scan_limit=scan_limit, chunk_bytes=chunk_bytes).identity
                  for path in training)
    return found if len(found) > 1 else found[0]  # a mixture: one a source


def data_problem(plan: Plan, chunk_bytes: int = CHUNK_BYTES) -> str | None:
    """Why the plan's data file cannot feed a run (:func:`check_data`), or None."""
    try:
        check_data(plan, chunk_bytes)
    except DataError as exc:
        return str(exc)
    return None


def _unchanged(path: str, identity: Identity | None, step: int, info=None,
               evaluation: int | None = None) -> None:
    change = how_changed(path, identity, info) if identity is not None else None
    if change is not None:
        raise DataChanged(path, change, step, evaluation)


# --- one step's batch --------------------------------------------------------------


@dataclass(frozen=True)
class DataSource:
    """What the batches are drawn from: ``path`` ("synthetic" or a token file), the run's
    seed and the batch's sizes (the build's model table, or a plan's)."""

    path: str
    seed: int
    batch: int
    seq: int
    vocab: int
    shuffle: bool = False  # a file's samples in a permutation per epoch (planc.data.sample_order)

    @staticmethod
    def of(plan_or_table) -> "DataSource":
        """The source of a plan (its model and train blocks) or of a model table
        (planc.program.model_table: its data, seed and sizes)."""
        if hasattr(plan_or_table, "train"):
            m, train = plan_or_table.model, plan_or_table.train
            return DataSource(train.data, train.seed, m.batch, m.seq, m.vocab, train.shuffle)
        t = plan_or_table
        return DataSource(t.data, t.seed, t.batch, t.seq, t.vocab, t.shuffle)


def batch_tokens(source, step: int, identity=None, evaluation: int | None = None
                 ) -> torch.Tensor:
    """The global batch of ``step``: (batch, seq + 1) token ids, int64. With
    ``evaluation`` (the training step, counted from 1, after which it runs), batch
    ``step`` of that evaluation: its problems name the evaluation, not a step.

    From a file, sample j of the run starts at token ``j * (seq + 1)`` modulo the number
    of sample starts (``count - seq``), so the run wraps around the file, or with shuffle
    at file sample ``permute(j mod n, n, seed, j // n)`` (planc.data.sample_order); only this
    step's samples are read. From a mixture, sample j is sample i of source d
    (planc.data.blend.source_of), read from that file as its own run's sample i with the
    seed ``seed + d``. Their ids are checked against vocab again, since a file may have
    changed since the run began. With ``identity`` (the file when the run began; a
    mixture's, one a source), a file that is not that one any more, before or after the
    reads, or a read that comes back short, raises DataChanged. ``source``: a
    :class:`DataSource`, or a plan or model table to take one from."""
    import torch

    m = source if isinstance(source, DataSource) else DataSource.of(source)
    if m.path == "synthetic":
        generator = torch.Generator().manual_seed(seed_of(m.seed, "data", step))
        return torch.randint(0, m.vocab, (m.batch, m.seq + 1), generator=generator)
    reader = f"step {step}" if evaluation is None else \
        f"batch {step} of the evaluation after step {evaluation}"
    samples = range(step * m.batch, (step + 1) * m.batch)
    pairs = blend_of(m.path)
    if pairs is None:
        return _samples(m, m.path, identity, [(j, j) for j in samples], m.seed, step,
                        evaluation, reader)
    weights = tuple(weight for weight, _ in pairs)
    identities = identity if isinstance(identity, tuple) else (None,) * len(pairs)
    wanted: dict[int, list[tuple[int, int]]] = {}
    for j in samples:
        d, i = source_of(j, weights)
        wanted.setdefault(d, []).append((i, j))
    out = torch.empty((m.batch, m.seq + 1), dtype=torch.int64)
    for d, taken in wanted.items():
        rows = [j - samples.start for _, j in taken]
        out[rows] = _samples(m, pairs[d][1], identities[d], taken, m.seed + d, step,
                             evaluation, reader)
    return out


def _samples(m: DataSource, path: str, identity: Identity | None,
             taken: list[tuple[int, int]], seed: int, step: int, evaluation: int | None,
             reader: str) -> torch.Tensor:
    """(len(taken), seq + 1) ids of the file at ``path``: its samples ``i`` of ``taken``
    ((i, the run's sample j) pairs), cut as a run on that file alone with ``seed`` would
    cut them."""
    import torch

    sample = m.seq + 1
    try:
        fd, tokens = open_tokens(path)
    except DataError as exc:
        _unchanged(path, identity, step, None, evaluation)  # removed, or its header or size
        if isinstance(exc, DataMissing):
            raise DataError(f"data file {path} cannot be read for {reader} "
                            f"({os.strerror(errno.ENOENT)})") from None
        raise
    try:
        _unchanged(path, identity, step, os.fstat(fd), evaluation)
        starts = tokens.count - sample + 1
        if starts < 1:
            raise DataError(f"data file {path} no longer holds one sample (seq + 1 = "
                            f"{sample} tokens)")
        width, rows, first = tokens.width, [], []
        for i, _ in taken:
            first.append(sample_start(i, tokens.count, m.seq, seed, m.shuffle))
            rows.append(os.pread(fd, sample * width, tokens.offset + first[-1] * width))
            if identity is not None and len(rows[-1]) != sample * width:
                raise DataChanged(path, f"a read of {sample * width} bytes returned "
                                  f"{len(rows[-1])}", step, evaluation)
        _unchanged(path, identity, step, os.fstat(fd), evaluation)  # changed while read
    except OSError as exc:
        raise DataError(f"data file {path} cannot be read for {reader} "
                        f"({exc.strerror})") from None
    finally:
        os.close(fd)
    if any(len(row) != sample * width for row in rows):
        raise DataError(f"data file {path} no longer holds one sample (seq + 1 = "
                        f"{sample} tokens)")
    raw = bytearray(b"".join(rows))
    if sys.byteorder != "little":
        ids = array(ARRAY_CODES[width])
        ids.frombytes(raw)
        ids.byteswap()
        raw = bytearray(ids.tobytes())
    signed = torch.frombuffer(raw, dtype={2: torch.int16, 4: torch.int32}[width])
    out = signed.to(torch.int64) & ((1 << (8 * width)) - 1)
    out = out.view(len(taken), sample)
    if int(out.max()) >= m.vocab:  # where, only when there is something to say
        row, column = (int(i) for i in (out >= m.vocab).nonzero()[0])
        raise DataError(f"data file {path} holds token id {int(out[row, column])} (token "
                        f"{first[row] + column} of the file, position {column} of sample "
                        f"{taken[row][1]}, read by {reader}), not below vocab = "
                        f"{m.vocab}")
    return out
