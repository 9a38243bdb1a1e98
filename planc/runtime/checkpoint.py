"""The ranks' half of checkpoints: consolidate and write after a step, reshard on resume.

The format, and finding and checking a checkpoint, are :mod:`planc.checkpoint` (no
torch); docs/checkpoints.md describes both halves.

**Writing** (after every N-th step and after the last): one rank per pipeline stage, the
one with tp = cp = dp = 0, is its stage's writer. Every other rank of the stage sends it
what only it holds, bucket by bucket over a gloo group of its own: the whole bucket (the
ranks with ZeRO shard index 0) or its ZeRO shard (every rank, for a sharded bucket: the
shard is what the optimizer updated, the whole bucket is gathered again only by the next
step), for the parameters and each optimizer state. The writer joins the shards into each tp rank's
bucket, cuts the members out and joins the tp pieces into whole tensors with the rule
the parameter store cut them with (:func:`planc.runtime.store.tp_piece`), the way
Megatron-LM's consolidation of a distributed optimizer gathers shards before saving.
Each writer writes its stage's ``model-`` and ``optimizer-`` safetensors file into the
staging directory (temporary name, fsync, rename); after a barrier rank 0 writes the
indices, the RNG state and, last, the manifest with every file's sha256, renames the
staging directory into place and replaces ``latest``: the commit protocol of
torch.distributed.checkpoint, whose coordinator writes ``.metadata`` only after every
rank's data is durable.

**Resuming**: every rank opens the files with ``safetensors.safe_open`` and reads, with
``get_slice``, only the boxes of each tensor that land in what it holds: its tp piece of
every member, and under ZeRO only the part of the bucket in its shard (the parameters
under ZeRO-3, the optimizer state under ZeRO-1/2/3). A flat range of a tensor is cut into
at most 2 x rank - 1 boxes, and a tp piece whose indices are not contiguous (qkv's
heads of q, k and v) into its contiguous runs, so no rank reads an element it does not
keep: torch.distributed.checkpoint's load-time resharding, in which each rank plans reads
of the saved chunks that overlap its own shards.
"""

from __future__ import annotations

import math
import os
import shutil
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import torch
import torch.distributed as dist

from planc import checkpoint as fmt
from planc.runtime.context import RankContext
from planc.runtime.interpreter import Interpreter
from planc.runtime.store import tp_piece

FP32 = torch.float32


def _layer_key(name: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in name.split("."))


class Checkpoints:
    """Writes and loads this rank's part of consolidated checkpoints. Every rank of the
    world builds one (it creates a process group), with the same arguments."""

    def __init__(self, ctx: RankContext, graph, interpreter: Interpreter, shard_index: int):
        self.ctx, self.interpreter, self.store = ctx, interpreter, interpreter.store
        self.plan = ctx.plan
        self.world = dist.get_world_size()
        self.rank = ctx.rank
        self.shard_index = shard_index
        # A gloo group of its own: checkpoint traffic never queues behind training's
        # collectives, and works on CPU tensors whatever the training backend.
        self.group = dist.new_group(list(range(self.world)), backend="gloo") \
            if self.world > 1 else None
        everyone = [None] * self.world
        mine = (ctx.stage, ctx.tp_rank, shard_index)
        if self.group is not None:
            dist.all_gather_object(everyone, mine, group=self.group)
        else:
            everyone = [mine]
        self.where = {tuple(place): rank for rank, place in enumerate(everyone)}
        self.stages = self.plan.mesh.pp
        self.writer = self.where[(ctx.stage, 0, 0)]
        all_buckets = graph.graph["buckets"]
        self.owner: dict[str, int] = {}  # parameter -> the stage whose file holds it
        self.shapes: dict[str, list[int]] = {}
        for bucket in all_buckets.values():
            for m in bucket["members"]:
                self.owner[m["param"]] = min(self.owner.get(m["param"], bucket["stage"]),
                                             bucket["stage"])
                self.shapes[m["param"]] = list(m["full_shape"])
        self.optimizers = {graph.nodes[node]["bucket"]: optimizer
                           for node, optimizer in interpreter.optimizers.items()}
        self.keys = fmt.state_keys(fmt.as_json(self.plan.train.optimizer))
        self.history: list[dict] = []
        self.first_step = 0

    # --- what this rank holds ------------------------------------------------------------

    def _tensor(self, bucket_id: str) -> torch.Tensor:
        """The flat tensor the bucket's optimizer updates (as the interpreter binds it)."""
        sharded = self.store.buckets[bucket_id]["sharded"]
        return self.store.shard[bucket_id] if sharded else self.store.full[bucket_id]

    def _state(self, bucket_id: str, key: str) -> torch.Tensor:
        optimizer = self.optimizers[bucket_id]
        state = optimizer.state.get(self._tensor(bucket_id), {})
        if key not in state:
            raise RuntimeError(f"bucket {bucket_id} has no optimizer state {key!r} yet")
        return state[key]

    def _written_buckets(self) -> list[str]:
        """This stage's buckets that hold a parameter its file keeps (a tied embedding's
        copy on the last stage is kept by the first stage's file)."""
        return [b for b in sorted(self.store.buckets)
                if any(self.owner[m["param"]] == self.ctx.stage
                       for m in self.store.buckets[b]["members"])]

    def _optimizer_steps(self) -> int | None:
        steps = set()
        for bucket_id in self.store.buckets:
            optimizer = self.optimizers.get(bucket_id)
            state = optimizer.state.get(self._tensor(bucket_id), {}) if optimizer else {}
            if "step" in state:
                steps.add(int(float(state["step"])))
        return steps.pop() if len(steps) == 1 else None

    # --- writing -------------------------------------------------------------------------

    def save(self, root: str, step: int) -> None:
        """Write the checkpoint of the state after ``step`` steps (the next to run is
        ``step``) into ``root``; every rank calls it at the same step boundary."""
        start = time.perf_counter()
        root_path = Path(root)
        staging = root_path / fmt.staging_name(step)
        if self.rank == 0:
            try:
                root_path.mkdir(parents=True, exist_ok=True)
                if staging.exists():  # left by a run killed while writing this step
                    shutil.rmtree(staging)
                staging.mkdir()
                fmt.fsync_directory(root_path)
            except OSError as exc:
                raise SystemExit(f"planc: error: cannot write checkpoint {staging}: "
                                 f"{exc.strerror}") from None
        self._barrier()
        files = self._write_stage(staging, step)
        self._barrier()  # every stage's files are durable before the manifest names them
        gathered = [None] * self.world if self.rank == 0 else None
        if self.group is not None:
            dist.gather_object(files, gathered, dst=0, group=self.group)
        else:
            gathered = [files]
        if self.rank == 0:
            try:
                self._commit(root_path, staging, step, gathered, start)
            except OSError as exc:
                raise SystemExit(f"planc: error: cannot write checkpoint "
                                 f"{root_path / fmt.step_name(step)}: {exc.strerror}") from None
        self._barrier()

    def _write_stage(self, staging: Path, step: int) -> dict:
        """Send this rank's pieces to its stage's writer; the writer writes the stage's
        files. Returns {file: {sha256, bytes, tensors}} of the files this rank wrote."""
        params, states = self._consolidate()
        if self.rank != self.writer:
            return {}
        from safetensors.torch import save

        stage, stages = self.ctx.stage, self.stages
        metadata = {"format": "pt", "planc": fmt.FORMAT, "step": str(step),
                    "stage": str(stage)}
        out = {}
        for name, tensors in ((fmt.model_file(stage, stages), params),
                              (fmt.optimizer_file(stage, stages), states)):
            data = save(tensors, metadata)
            try:
                digest = fmt.write_durably(staging / name, data)
            except OSError as exc:
                raise SystemExit(f"planc: error: cannot write checkpoint file "
                                 f"{staging / name}: {exc.strerror}") from None
            out[name] = {"sha256": digest, "bytes": len(data), "tensors": sorted(tensors)}
        return out

    def _consolidate(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """On the stage's writer: every parameter and optimizer state the stage's file
        keeps, whole. On the other ranks: the sends of their pieces (returns empty)."""
        tp, replicas = self.ctx.tp, self._replicas()
        stage, me = self.ctx.stage, self.rank
        writer = me == self.writer
        pending, tag = [], 0
        params: dict[str, torch.Tensor] = {}
        states: dict[str, torch.Tensor] = {}
        for bucket_id in self._written_buckets():
            bucket = self.store.buckets[bucket_id]
            # Under ZeRO the shards are the truth: ZeRO-1/2 gather the whole bucket again
            # only at the start of the next step (in its prologue, with overlap on).
            sharded = bucket["sharded"]
            for key in (None, *self.keys):
                local = self._tensor(bucket_id) if key is None else self._state(bucket_id, key)
                pieces: list[torch.Tensor] = []
                for t in range(tp):
                    parts = []
                    for i in range(replicas if sharded else 1):
                        tag += 1
                        source = self.where[(stage, t, i)]
                        if source == me and not writer:
                            pending.append(dist.isend(local.detach().to("cpu", FP32)
                                                      .contiguous(), self.writer,
                                                      group=self.group, tag=tag))
                        elif writer:
                            if source == me:
                                parts.append(local.detach().to("cpu", FP32).clone())
                            else:
                                size = bucket["shard"] if sharded else bucket["padded"]
                                buffer = torch.empty(size, dtype=FP32)
                                dist.recv(buffer, source, group=self.group, tag=tag)
                                parts.append(buffer)
                    if writer:
                        pieces.append(torch.cat(parts) if len(parts) > 1 else parts[0])
                if writer:
                    self._join(bucket, pieces, key, params if key is None else states)
        for work in pending:
            work.wait()
        return params, states

    def _replicas(self) -> int:
        return max(i for (_, _, i) in self.where) + 1

    def _join(self, bucket: dict, pieces: list[torch.Tensor], key: str | None,
              out: dict[str, torch.Tensor]) -> None:
        """The whole tensors of a bucket's members from every tp rank's flat bucket."""
        for m in bucket["members"]:
            name = m["param"]
            if self.owner[name] != self.ctx.stage:
                continue
            local = [p[m["offset"]:m["offset"] + m["numel"]].view(m["shape"]) for p in pieces]
            split = m["tp_split"]
            if split is None:
                whole = local[0].clone()
            else:
                axis = split[1] % len(m["full_shape"])
                whole = torch.empty(m["full_shape"], dtype=FP32)
                for t, piece in enumerate(local):
                    whole.index_copy_(axis, self._indices(m, t), piece)
            out[name if key is None else fmt.state_name(name, key)] = whole.contiguous()

    def _indices(self, member: dict, tp_rank: int) -> torch.Tensor:
        """Indices, along the split axis of the whole tensor, of tp rank ``tp_rank``'s
        piece, in the piece's order: the store's own split applied to the indices."""
        full = member["full_shape"]
        axis = member["tp_split"][1] % len(full)
        shape = [1] * len(full)
        shape[axis] = full[axis]
        positions = torch.arange(full[axis]).view(shape)
        return tp_piece(self.ctx, positions, member["tp_split"], tp_rank).reshape(-1)

    def _commit(self, root: Path, staging: Path, step: int, gathered: list[dict],
                start: float) -> None:
        """Rank 0, once every stage's files are durable: the indices, the RNG state, the
        manifest (last), then the step directory into place and ``latest`` to it."""
        from safetensors.torch import save

        files: dict[str, dict] = {}
        for record in gathered:
            files.update(record)
        weight_map, optimizer_map, parameters = {}, {}, {}
        for name, info in files.items():
            for tensor in info.pop("tensors"):
                (weight_map if name.startswith("model-") else optimizer_map)[tensor] = name
        for name in sorted(self.shapes, key=_layer_key):
            parameters[name] = {"shape": self.shapes[name], "file": weight_map[name],
                                "optimizer_file": fmt.optimizer_file(self.owner[name],
                                                                     self.stages)}
        total = sum(4 * math.prod(self.shapes[n]) for n in parameters)
        for index, mapping in ((fmt.MODEL_INDEX, weight_map),
                               (fmt.OPTIMIZER_INDEX, optimizer_map)):
            data = fmt.dump_json({"metadata": {"format": fmt.FORMAT, "step": step,
                                               "total_size": total},
                                  "weight_map": dict(sorted(mapping.items()))})
            files[index] = {"sha256": fmt.write_durably(staging / index, data),
                            "bytes": len(data)}
        rng = save({"torch.cpu": torch.get_rng_state()}, {"format": "pt"})
        files[fmt.RNG_FILE] = {"sha256": fmt.write_durably(staging / fmt.RNG_FILE, rng),
                               "bytes": len(rng)}
        history = self.history + [fmt.history_segment(self.plan, self.first_step, step - 1)]
        manifest = fmt.make_manifest(self.plan, step, parameters, dict(sorted(files.items())),
                                     history, self._optimizer_steps())
        fmt.write_durably(staging / fmt.MANIFEST, fmt.dump_json(manifest))
        final = root / fmt.step_name(step)
        if final.exists():  # an older run's checkpoint of this step: swap it out
            old = root / f".{fmt.step_name(step)}.old-{os.getpid()}"
            os.rename(final, old)
            os.rename(staging, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(staging, final)
        fmt.fsync_directory(root)
        fmt.write_durably(root / fmt.LATEST, (final.name + "\n").encode())
        size = sum(info["bytes"] for info in files.values())
        print(f"planc: checkpoint {final} written: step {step}, "
              f"{len(files)} files, {size / 1e6:.2f} MB in "
              f"{time.perf_counter() - start:.3f} s", file=sys.stderr, flush=True)

    def _barrier(self) -> None:
        if self.group is not None:
            dist.barrier(group=self.group)

    # --- resuming ------------------------------------------------------------------------

    def load(self, directory: str, manifest: dict) -> None:
        """Fill this rank's buckets, ZeRO shards and optimizer state from the checkpoint,
        reading only what it keeps."""
        start = time.perf_counter()
        from safetensors import safe_open

        base = Path(directory)
        step = manifest["step"]
        read = [0]  # elements read
        with ExitStack() as stack:
            opened: dict[str, object] = {}

            def source(file: str):
                if file not in opened:
                    opened[file] = stack.enter_context(
                        safe_open(str(base / file), framework="pt", device="cpu"))
                return opened[file]

            for bucket_id in sorted(self.store.buckets):
                self._load_bucket(bucket_id, manifest, source, read)
            self._load_scalars(manifest)
            rng = source(fmt.RNG_FILE).get_tensor("torch.cpu")
            torch.set_rng_state(rng)
        self.first_step = step
        self.history = list(manifest["history"])
        elapsed = time.perf_counter() - start
        figures = torch.tensor([elapsed, float(read[0] * 4)], dtype=torch.float64)
        if self.group is not None:
            dist.all_reduce(figures, op=dist.ReduceOp.MAX, group=self.group)
        if self.rank == 0:
            print(f"planc: resumed from {base} at step {step} in {figures[0]:.3f} s (at "
                  f"most {figures[1] / 1e6:.3f} MB read by one rank)", file=sys.stderr,
                  flush=True)

    def _load_bucket(self, bucket_id: str, manifest: dict, source, read: list) -> None:
        bucket = self.store.buckets[bucket_id]
        size, index = bucket["shard"], self.shard_index
        mine = (index * size, (index + 1) * size)
        params = manifest["parameters"]
        # the parameters: the whole bucket, or under ZeRO-3 only this rank's shard
        if bucket["zero3"]:
            target, window = self.store.shard[bucket_id], mine
        else:
            target, window = self.store.full[bucket_id], (0, bucket["padded"])
        with torch.no_grad():
            self._fill(target, window, bucket, lambda m: (params[m["param"]]["file"],
                                                          m["param"]), source, read)
            if bucket["sharded"] and not bucket["zero3"]:
                self.store.shard[bucket_id].copy_(target[mine[0]:mine[1]])
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
                    params[m["param"]]["optimizer_file"], fmt.state_name(m["param"], k)),
                    source, read)
            state[key] = buffer
        if state or self.keys:
            optimizer.state[tensor] = state

    def _load_scalars(self, manifest: dict) -> None:
        """AdamW's step count, which torch keeps per tensor (a float32 scalar on the
        tensor's device for the fused kernel)."""
        steps = manifest["optimizer"].get("steps")
        if self.plan.train.optimizer.name != "adamw":
            return
        if steps is None:
            steps = manifest["step"]
        for bucket_id, optimizer in self.optimizers.items():
            tensor = self._tensor(bucket_id)
            optimizer.state[tensor]["step"] = torch.tensor(float(steps), dtype=FP32,
                                                           device=tensor.device)

    def _fill(self, target: torch.Tensor, window: tuple[int, int], bucket: dict, where,
              source, read: list) -> None:
        """Write into ``target`` (the bucket's elements window[0]..window[1]) every
        member's part in the window, read from the files; padding stays zero."""
        target.zero_()
        low, high = window
        for m in bucket["members"]:
            first, last = max(low, m["offset"]), min(high, m["offset"] + m["numel"])
            if first >= last:
                continue
            file, name = where(m)
            values = self._read(source(file).get_slice(name), m, first - m["offset"],
                                last - m["offset"])
            read[0] += values.numel()
            target[first - low:last - low].copy_(values)

    def _read(self, saved, member: dict, first: int, last: int) -> torch.Tensor:
        """Elements first..last of this rank's tp piece of a member, flattened, read from
        the whole tensor in the file box by box."""
        shape = list(member["shape"])
        split = member["tp_split"]
        runs_of = None
        if split is not None:
            axis = split[1] % len(shape)
            global_index = self._indices(member, self.ctx.tp_rank).tolist()

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
                values.append(saved[tuple(slices)].reshape(-1))
                continue
            blocks = []
            for a, b in runs_of(starts[axis], stops[axis]):
                slices[axis] = slice(a, b)
                blocks.append(saved[tuple(slices)])
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
