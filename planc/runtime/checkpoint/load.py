"""The resuming half of the ranks' checkpoints (:class:`planc.runtime.checkpoint.checkpoints.Checkpoints`
mixes it in): every rank fills what it keeps, reading only its slices and checking every
value it reads.

Every rank opens the files with ``safetensors.safe_open`` (only files
:mod:`planc.checkpoint.files` found to be regular files inside the step directory) and
reads, with ``get_slice``, only the boxes of each tensor that land in what it holds: its
tp piece of every member, and under ZeRO only the part of the bucket in its shard (the
parameters under ZeRO-3, the optimizer state under ZeRO-1/2/3). A flat range of a tensor
is cut into at most 2 x rank - 1 boxes, and a tp piece whose indices are not contiguous
(qkv's heads of q, k and v) into its contiguous runs, so no rank reads an element it does
not keep: torch.distributed.checkpoint's load-time resharding, in which each rank plans
reads of the saved chunks that overlap its own shards. Each block read is checked by
:func:`planc.runtime.checkpoint.values.refuse_bad_values`, so that a run started by
torchrun, which no ``planc run`` checked first, refuses a value no training writes.
"""

from __future__ import annotations

import math
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import torch
import torch.distributed as dist

from planc.checkpoint import format as fmt
from planc.checkpoint.files import checked_path
from planc.runtime.checkpoint.values import SECOND_MOMENTS, refuse_bad_values, rng_state
from planc.runtime.engine.store import shard_index, tp_piece

FP32 = torch.float32


class Loading:
    """What :class:`planc.runtime.checkpoint.checkpoints.Checkpoints` does on resume (it holds the
    store, the optimizers, the group and the tp split of every member)."""

    def load(self, directory: str, manifest: dict) -> None:
        """Fill this rank's buckets, ZeRO shards and optimizer state from the checkpoint,
        reading only what it keeps, and refusing values no training writes
        (planc.runtime.checkpoint.values): then every rank stops, the lowest rank that
        found the problem saying what it is."""
        start = time.perf_counter()
        from safetensors import SafetensorError, safe_open

        base = Path(directory)
        where = f"checkpoint {base}"
        step = manifest["step"]
        read = [0]  # elements read
        problem = None
        try:
            with ExitStack() as stack:
                opened: dict[str, object] = {}

                def source(file: str):
                    if file not in opened:  # a regular file inside the step directory
                        opened[file] = stack.enter_context(safe_open(
                            checked_path(base, file), framework="pt", device="cpu"))
                    return opened[file]

                for bucket_id in sorted(self.store.buckets):
                    self._load_bucket(bucket_id, manifest, source, where, read)
                self._load_scalars(manifest)
                self._load_buffers(manifest, source, where)
                file = manifest["rng"]["file"]
                rng = rng_state(where, file, source(file).get_tensor(fmt.RNG_TENSOR))
        except fmt.CheckpointError as exc:
            problem = str(exc)
        except (OSError, SafetensorError) as exc:  # changed since it was checked
            problem = f"{where} cannot be read ({fmt.reason(exc)})"
        if problem is None:
            torch.set_rng_state(rng)
        self.first_step = step
        self.history = list(manifest["history"])
        elapsed, most = self._agree(problem, time.perf_counter() - start, read[0])
        if self.rank == 0:
            print(f"planc: resumed from {base} at step {step} in {elapsed:.3f} s (at "
                  f"most {most / 1e6:.3f} MB read by one rank)", file=sys.stderr,
                  flush=True)

    def _agree(self, problem: str | None, elapsed: float, elements: int
               ) -> tuple[float, float]:
        """Every rank stops if any found a problem, the lowest such rank saying what it
        is; else (the slowest rank's seconds, the most bytes one rank read)."""
        # the third figure: world - rank on a rank that found a problem, so that the
        # maximum names the lowest such rank
        figures = torch.tensor([elapsed, float(elements * 4),
                                float(self.world - self.rank if problem else 0)],
                               dtype=torch.float64)
        if self.group is not None:
            dist.all_reduce(figures, op=dist.ReduceOp.MAX, group=self.group)
        if figures[2] > 0:
            reporter = self.world - int(figures[2])
            raise SystemExit(f"planc: error: {problem}" if self.rank == reporter else 1)
        return float(figures[0]), float(figures[1])

    def _load_bucket(self, bucket_id: str, manifest: dict, source, where: str,
                     read: list) -> None:
        bucket = self.store.buckets[bucket_id]
        params = manifest["parameters"]
        mine = self._load_parameters(bucket_id, lambda m: (params[m["param"]]["file"],
                                                           m["param"], False),
                                     source, where, read)
        optimizer = self.optimizers.get(bucket_id)
        if optimizer is None:
            return
        tensor = self._tensor(bucket_id)
        window = mine if bucket["sharded"] else (0, bucket["padded"])
        state = {}
        for key in self.keys:
            buffer = torch.zeros_like(tensor)
            with torch.no_grad():
                self._fill(buffer, window, bucket, lambda m, k=key: (
                    params[m["param"]]["optimizer_file"], fmt.state_name(m["param"], k),
                    k in SECOND_MOMENTS), source, where, read)
            state[key] = buffer
        if state or self.keys:
            optimizer.state = state

    def _load_parameters(self, bucket_id: str, locate, source, where: str, read: list
                         ) -> tuple[int, int]:
        """Fill a bucket's parameters (the whole bucket, or under ZeRO-3 only this rank's
        shard, and the ZeRO shard of a whole one) with what ``locate`` finds in ``source``
        (see :meth:`_fill`); returns this rank's shard's window of the bucket."""
        bucket = self.store.buckets[bucket_id]
        size, index = bucket["shard"], shard_index(self.ctx, bucket)
        mine = (index * size, (index + 1) * size)
        if bucket["zero3"]:
            target, window = self.store.shard[bucket_id], mine
        else:
            target, window = self.store.full[bucket_id], (0, bucket["padded"])
        with torch.no_grad():
            self._fill(target, window, bucket, locate, source, where, read)
            if bucket["sharded"] and not bucket["zero3"]:
                self.store.shard[bucket_id].copy_(target[mine[0]:mine[1]])
        return mine

    def _indices(self, member: dict, tp_rank: int) -> torch.Tensor:
        """Indices, along the split axis of the whole tensor, of tp rank ``tp_rank``'s
        piece (ep index's, for experts split over ep), in the piece's order: the store's
        own split applied to the indices."""
        full = member["full_shape"]
        if member.get("ep_split"):
            rows = full[0] // member["ep_split"]
            return torch.arange(tp_rank * rows, (tp_rank + 1) * rows)
        axis = member["tp_split"][1] % len(full)
        shape = [1] * len(full)
        shape[axis] = full[axis]
        positions = torch.arange(full[axis]).view(shape)
        return tp_piece(self.ctx, positions, member["tp_split"], tp_rank).reshape(-1)

    def _load_buffers(self, manifest: dict, source, where: str) -> None:
        """The stage's state that is not trained (a mixture's balancing bias), whole on
        every rank of the stage. A checkpoint of the same model holds it (the resume check
        compares every key of the model block); one edited by hand may not."""
        saved = manifest.get("buffers", {})
        for name, tensor in sorted(self.store.buffers.items()):
            info = saved.get(name)
            if info is None:
                raise fmt.CheckpointError(f"{where} holds no {name}, which the plan's "
                                          f"routing needs (model.bias_update)")
            if info["shape"] != list(tensor.shape):
                raise fmt.CheckpointError(f"{where}: {name} is {info['shape']}, the plan "
                                          f"needs {list(tensor.shape)}")
            value = source(info["file"]).get_tensor(name)
            refuse_bad_values(where, name, value)
            tensor.copy_(value)

    def _load_scalars(self, manifest: dict) -> None:
        """AdamW's step count, which torch keeps per tensor (a float32 scalar on the
        tensor's device for the fused kernel)."""
        steps = manifest["optimizer"].get("steps")
        if self.ctx.optimizer.name != "adamw":
            return
        if steps is None:
            steps = manifest["step"]
        for bucket_id, optimizer in self.optimizers.items():
            optimizer.state["step"] = torch.tensor(float(steps), dtype=FP32,
                                                   device=optimizer.tensor.device)

    def _fill(self, target: torch.Tensor, window: tuple[int, int], bucket: dict, locate,
              source, where: str, read: list) -> None:
        """Write into ``target`` (the bucket's elements window[0]..window[1]) every
        member's part in the window, read from the files (``locate(member)``: the file,
        the tensor's name and whether it is a second moment) and its values checked block
        by block (``where``: the checkpoint, for messages); padding stays zero."""
        target.zero_()
        low, high = window
        for m in bucket["members"]:
            first, last = max(low, m["offset"]), min(high, m["offset"] + m["numel"])
            if first >= last:
                continue
            file, name, non_negative = locate(m)
            values = self._read(source(file).get_slice(name), m, first - m["offset"],
                                last - m["offset"], lambda block, origin: refuse_bad_values(
                                    where, name, block, origin, non_negative))
            read[0] += values.numel()
            target[first - low:last - low].copy_(values)

    def _read(self, saved, member: dict, first: int, last: int, inspect) -> torch.Tensor:
        """Elements first..last of this rank's tp piece of a member, flattened, read from
        the whole tensor in the file box by box; ``inspect(block, origin)`` sees each
        block read with its first index in the whole tensor."""
        shape = list(member["shape"])
        split = member["tp_split"]
        runs_of = None
        if split is not None or member.get("ep_split"):
            axis = 0 if split is None else split[1] % len(shape)
            piece = self.ctx.groups.index("ep", self.ctx.rank) if member.get("ep_split") \
                else self.ctx.tp_rank
            global_index = self._indices(member, piece).tolist()

            def runs_of(lo: int, hi: int) -> list[tuple[int, int]]:
                """The contiguous runs of whole-tensor indices of local lo..hi."""
                out: list[tuple[int, int]] = []
                for g in global_index[lo:hi]:
                    if out and out[-1][1] == g:
                        out[-1] = (out[-1][0], g + 1)
                    else:
                        out.append((g, g + 1))
                return out
        values = []
        for starts, stops in boxes(shape, first, last):
            slices = [slice(a, b) for a, b in zip(starts, stops)]
            if runs_of is None:
                block = saved[tuple(slices)]
                inspect(block, starts)
                values.append(block.reshape(-1))
                continue
            blocks = []
            for a, b in runs_of(starts[axis], stops[axis]):
                slices[axis] = slice(a, b)
                block = saved[tuple(slices)]
                inspect(block, tuple(s.start for s in slices))
                blocks.append(block)
            values.append(torch.cat(blocks, dim=axis).reshape(-1))
        return torch.cat(values).to(FP32) if len(values) > 1 else values[0].to(FP32)


def boxes(shape: list[int], first: int, last: int) -> list[tuple[tuple, tuple]]:
    """Elements first..last (row-major) of a tensor of ``shape`` as boxes (start and stop
    per dimension), in order: a partial leading row, whole rows, a partial trailing row,
    each partial row cut the same way one dimension down."""
    if first >= last:
        return []
    if len(shape) == 1:
        return [((first,), (last,))]
    inner = math.prod(shape[1:])
    row, offset = divmod(first, inner)
    end_row, end_offset = divmod(last, inner)
    out = []

    def within(r: int, a: int, b: int) -> list:
        return [((r,) + s, (r + 1,) + e) for s, e in boxes(shape[1:], a, b)]

    if row == end_row:
        return within(row, offset, end_offset)
    if offset:
        out += within(row, offset, inner)
        row += 1
    if end_row > row:
        out.append(((row,) + (0,) * (len(shape) - 1), (end_row,) + tuple(shape[1:])))
    if end_offset:
        out += within(end_row, 0, end_offset)
    return out
