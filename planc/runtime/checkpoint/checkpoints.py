"""The ranks' half of checkpoints: consolidate and write after a step, reshard on resume.

The format, and finding and checking a checkpoint, are :mod:`planc.checkpoint.format` (no
torch); docs/checkpoints.md describes both halves.

**Writing** (after every N-th step and after the last): one rank per pipeline stage, the
one with tp = cp = dp = 0, is its stage's writer. Every other rank of the stage sends it
what only it holds, bucket by bucket over a gloo group of its own: the whole bucket (the
ranks with ZeRO shard index 0) or its ZeRO shard (every rank, for a sharded bucket: the
shard is what the optimizer updated, the whole bucket is gathered again only by the next
step), for the parameters and each optimizer state. The writer joins the shards into each tp rank's
bucket, cuts the members out and joins the tp pieces into whole tensors with the rule
the parameter store cut them with (:func:`planc.runtime.engine.store.tp_piece`), the way
Megatron-LM's consolidation of a distributed optimizer gathers shards before saving.
Each writer writes its stage's ``model-`` and ``optimizer-`` safetensors file into the
staging directory (temporary name, fsync, rename); after a barrier rank 0 writes the
indices, the RNG state and, last, the manifest with every file's sha256, renames the
staging directory into place and replaces ``latest``: the commit protocol of
torch.distributed.checkpoint, whose coordinator writes ``.metadata`` only after every
rank's data is durable.

**Resuming** (:mod:`planc.runtime.checkpoint.load`): every rank reads, with
``safetensors``' ``get_slice``, only the boxes of each tensor that land in what it holds,
and checks every value it reads.
"""

from __future__ import annotations

import math
import os
import shutil
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from planc.checkpoint import format as fmt
from planc.runtime.checkpoint.background import Background
from planc.runtime.checkpoint.tensor_file import write_tensor_file
from planc.runtime.checkpoint.load import FP32, Loading, boxes  # noqa: F401 (boxes: API)
from planc.runtime.engine.context import RankContext
from planc.runtime.engine.exchange import (PeerDataError, gather_json, integer, list_of, map_of,
                                    one_of, record, text)
from planc.runtime.engine.interpreter import Interpreter
from planc.runtime.engine import router_bias
from planc.runtime.engine.store import piece_index, shard_index


def _layer_key(name: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in name.split("."))


class Checkpoints(Loading):
    """Writes and loads this rank's part of consolidated checkpoints. Every rank of the
    world builds one (it creates a process group), with the same arguments."""

    def __init__(self, ctx: RankContext, all_buckets: dict[str, dict],
                 interpreter: Interpreter):
        """``all_buckets``: every stage's buckets (those of every program of the build)."""
        self.ctx, self.interpreter, self.store = ctx, interpreter, interpreter.store
        self.record = ctx.record
        self.world = dist.get_world_size()
        self.rank = ctx.rank
        # A gloo group of its own: checkpoint traffic never queues behind training's
        # collectives, and works on CPU tensors whatever the training backend.
        self.group = dist.new_group(list(range(self.world)), backend="gloo") \
            if self.world > 1 else None
        # (stage, piece, shard) -> rank, for the buckets over dp x cp (piece: tp rank)
        # and for the experts split over ep (piece: ep index, shard: place in edp)
        self.where, self.where_experts = self._places()
        self.stages = ctx.ranks.pp
        self.writer = self.where[(ctx.stage, 0, 0)]
        self.owner: dict[str, int] = {}  # parameter -> the stage whose file holds it
        self.shapes: dict[str, list[int]] = {}
        for bucket in all_buckets.values():
            for m in bucket["members"]:
                self.owner[m["param"]] = min(self.owner.get(m["param"], bucket["stage"]),
                                             bucket["stage"])
                self.shapes[m["param"]] = list(m["full_shape"])
        # the state that is not trained, by name: every stage's, as rank 0 commits them,
        # each kept by the stage of its block's parameters
        self.buffer_shapes = router_bias.shapes(ctx.model)
        for name, router in router_bias.beside(ctx.model).items():
            self.owner[name] = self.owner[router]
        self.optimizers = {interpreter.optimized[node]: optimizer
                           for node, optimizer in interpreter.optimizers.items()}
        self.keys = fmt.state_keys(ctx.optimizer.to_json())
        self.history: list[dict] = []
        self.first_step = 0
        self._writer = Background()  # a checkpoint written in the background

    # --- what this rank holds ------------------------------------------------------------

    def _tensor(self, bucket_id: str) -> torch.Tensor:
        """The flat tensor the bucket's optimizer updates (as the interpreter binds it)."""
        sharded = self.store.buckets[bucket_id]["sharded"]
        return self.store.shard[bucket_id] if sharded else self.store.full[bucket_id]

    def _state(self, bucket_id: str, key: str) -> torch.Tensor:
        state = self.optimizers[bucket_id].state
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
            state = optimizer.state if optimizer else {}
            if "step" in state:
                steps.add(int(float(state["step"])))
        return steps.pop() if len(steps) == 1 else None

    # --- writing -------------------------------------------------------------------------

    def save(self, root: str, step: int, background: bool = False) -> float:
        """Write the checkpoint of the state after ``step`` steps (the next to run is
        ``step``) into ``root``; every rank calls it at the same step boundary. Returns
        the seconds the step boundary waited for it.

        ``background`` (``planc run --checkpoint-async``, as Megatron-LM's
        ``--async-save`` and torchtitan's ``async_mode``): the state is copied out to
        host memory here (the consolidation's sends and joins make copies on the stage's
        writer), and a thread of this rank writes, hashes and commits it while the next
        steps train, over the checkpoint's own gloo group. A checkpoint is visible only
        once committed, as before; the next checkpoint first waits for this one, so two
        never write at once; an error of the writer is raised at that wait or at
        :meth:`wait`."""
        start = time.perf_counter()
        self.wait()  # the previous checkpoint is committed first
        root_path = Path(root)
        staging = root_path / fmt.staging_name(step)
        if self.rank == 0:
            try:
                root_path.mkdir(parents=True, exist_ok=True)
                if staging.exists():  # left by a run killed while writing this step
                    shutil.rmtree(staging)
                fmt.remove_stray_temporaries(root_path)
                staging.mkdir()
                fmt.fsync_directory(root_path)
            except OSError as exc:
                raise SystemExit(f"planc: error: cannot write checkpoint {staging}: "
                                 f"{exc.strerror or exc}") from None
        self._barrier()
        params, states = self._consolidate()
        rng, optimizer_steps = torch.get_rng_state(), self._optimizer_steps()  # now, not later
        if not background:
            self._finish(root_path, staging, step, params, states, rng, optimizer_steps,
                         start)
            return time.perf_counter() - start
        self._writer.start(self._finish, (root_path, staging, step, params, states, rng,
                                          optimizer_steps, start), f"planc-checkpoint-{step}")
        return time.perf_counter() - start

    def wait(self) -> None:
        """Until the checkpoint being written in the background is committed; its
        writer's error, if it failed, is raised here."""
        self._writer.wait()

    def _finish(self, root_path: Path, staging: Path, step: int, params: dict,
                states: dict, rng: torch.Tensor, optimizer_steps: int | None,
                start: float) -> None:
        """Write the stage's files, then rank 0 commits once every stage's are durable."""
        files = self._write_stage(staging, step, params, states)
        self._barrier()  # every stage's files are durable before the manifest names them
        gathered = self._gather_files(files)
        # files, bytes, seconds: rank 0 commits, the leader says so (see _say_written)
        written = torch.zeros(3, dtype=torch.float64)
        if self.rank == 0:
            try:
                written = self._commit(root_path, staging, step, gathered, start, rng,
                                       optimizer_steps)
            except OSError as exc:
                raise SystemExit(f"planc: error: cannot write checkpoint "
                                 f"{root_path / fmt.step_name(step)}: {exc.strerror}") from None
        if self.group is not None:
            dist.broadcast(written, src=0, group=self.group)
        if self.rank == self.ctx.leader:
            self._say_written(root_path / fmt.step_name(step), step, written)
        self._barrier()

    @staticmethod
    def _say_written(final: Path, step: int, written: torch.Tensor) -> None:
        """The line of a committed checkpoint, printed by the rank that prints the
        progress (its step's line is out by now): the launcher copies each rank's output
        apart, so lines of two ranks would come in the order it happens to read them."""
        files, size, seconds = written.tolist()
        # said by the thread that wrote it: a background writer's while the steps went on
        aside = "" if threading.current_thread() is threading.main_thread() else \
            ", in the background"
        print(f"planc: checkpoint {final} written: step {step}, {int(files)} files, "
              f"{size / 1e6:.2f} MB in {seconds:.3f} s{aside}", file=sys.stderr, flush=True)

    def _write_stage(self, staging: Path, step: int, params: dict, states: dict,
                     stage: int | None = None) -> dict:
        """The stage's writer writes the stage's files of what :meth:`_consolidate`
        joined (``stage``: another stage's, which this rank was sent: a copy in peer
        memory). Returns {file: {sha256, bytes, tensors}} of the files this rank wrote."""
        if stage is None and self.rank != self.writer:
            return {}
        stage, stages = self.ctx.stage if stage is None else stage, self.stages
        metadata = {"format": "pt", "planc": fmt.FORMAT, "step": str(step),
                    "stage": str(stage)}
        out = {}
        for name, tensors in ((fmt.model_file(stage, stages), params),
                              (fmt.optimizer_file(stage, stages), states)):
            try:
                written = write_tensor_file(staging / name, tensors, metadata)
            except OSError as exc:
                raise SystemExit(f"planc: error: cannot write checkpoint file "
                                 f"{staging / name}: {exc.strerror}") from None
            out[name] = {**written, "tensors": sorted(tensors)}
        return out

    def _consolidate(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """On the stage's writer: every parameter and optimizer state the stage's file
        keeps, whole. On the other ranks: the sends of their pieces (returns empty)."""
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
            where = self.where_experts if bucket.get("over") else self.where
            pieces_count = 1 + max(t for (_, t, _) in where)
            replicas = 1 + max(i for (_, _, i) in where)
            for key in (None, *self.keys):
                local = self._tensor(bucket_id) if key is None else self._state(bucket_id, key)
                pieces: list[torch.Tensor] = []
                for t in range(pieces_count):
                    parts = []
                    for i in range(replicas if sharded else 1):
                        tag += 1
                        source = where[(stage, t, i)]
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
        if writer:  # the same on every rank of the stage: the writer's own
            params.update({name: value.detach().to("cpu", FP32).clone()
                           for name, value in self.store.buffers.items()})
        return params, states

    def _places(self) -> tuple[dict[tuple, int], dict[tuple, int]]:
        """(stage, tp rank, ZeRO shard index) -> rank, and (stage, ep index, place among
        the expert's replicas) -> rank, for every rank: each tells the others its place as
        five integers; together each map must cover the mesh once."""
        ctx, experts = self.ctx, {"over": "edp"}
        mine = torch.tensor([ctx.stage, ctx.tp_rank, shard_index(ctx, {}),
                             piece_index(ctx, experts), shard_index(ctx, experts)],
                            dtype=torch.int64)
        slots = [mine]
        if self.group is not None:
            slots = [torch.empty_like(mine) for _ in range(self.world)]
            dist.all_gather(slots, mine, group=self.group)
        places = [slot.tolist() for slot in slots]
        where = {(s, t, i): rank for rank, (s, t, i, _, _) in enumerate(places)}
        size = {axis: size for axis, (size, _) in self.ctx.ranks.axes.items()}
        ep, stage = ctx.groups.size("ep"), size["tp"] * size["dp"] * size["cp"]
        where_experts = {(s, j, i): rank for rank, (s, _, _, j, i) in enumerate(places)} \
            if ep > 1 else where  # without ep no bucket is split over experts
        if set(where) != {(s, t, i) for s in range(size["pp"]) for t in range(size["tp"])
                          for i in range(size["dp"] * size["cp"])} or \
                ep > 1 and set(where_experts) != {(s, j, i) for s in range(size["pp"])
                                                  for j in range(ep)
                                                  for i in range(stage // ep)} or \
                len(where) != self.world or len(where_experts) != self.world:
            raise PeerDataError("the ranks' places in the mesh (stage, tp rank, ZeRO shard) "
                                "do not cover it once; the run was stopped")
        return where, where_experts

    def _gather_files(self, files: dict) -> list[dict] | None:
        """Every rank's files (what :meth:`_write_stage` returns), on rank 0, as JSON;
        together they must hold every tensor of the checkpoint once."""
        if self.group is None:
            return [files]
        names = {name(s, self.stages) for s in range(self.stages)
                 for name in (fmt.model_file, fmt.optimizer_file)}
        tensors = [*self.shapes, *(fmt.state_name(n, k) for n in self.shapes
                                   for k in self.keys), *self.buffer_shapes]
        form = map_of(record(sha256=text, bytes=integer, tensors=list_of(one_of(tensors))),
                      names)
        gathered = gather_json(files, 0, form, "the checkpoint files it wrote", self.group)
        written = None if gathered is None else sorted(
            t for stage_files in gathered for info in stage_files.values()
            for t in info["tensors"])
        if written is not None and written != sorted(tensors):
            raise PeerDataError("the stages' writers did not write every tensor of the "
                                "checkpoint once; the run was stopped")
        return gathered

    def _join(self, bucket: dict, pieces: list[torch.Tensor], key: str | None,
              out: dict[str, torch.Tensor]) -> None:
        """The whole tensors of a bucket's members from every tp rank's flat bucket."""
        for m in bucket["members"]:
            name = m["param"]
            if self.owner[name] != self.ctx.stage:
                continue
            local = [p[m["offset"]:m["offset"] + m["numel"]].view(m["shape"]) for p in pieces]
            split = m["tp_split"]
            if m.get("ep_split"):  # each ep index's rows of the experts, in order
                whole = torch.cat(local, 0)
            elif split is None:
                whole = local[0].clone()
            else:
                axis = split[1] % len(m["full_shape"])
                whole = torch.empty(m["full_shape"], dtype=FP32)
                for t, piece in enumerate(local):
                    whole.index_copy_(axis, self._indices(m, t), piece)
            out[name if key is None else fmt.state_name(name, key)] = whole.contiguous()

    def _commit(self, root: Path, staging: Path, step: int, gathered: list[dict],
                start: float, rng: torch.Tensor, optimizer_steps: int | None
                ) -> torch.Tensor:
        """Rank 0, once every stage's files are durable: the indices, the RNG state, the
        manifest (last), then the step directory into place and ``latest`` to it.
        Returns the files written, their bytes and the seconds the checkpoint took."""
        files: dict[str, dict] = {}
        for written in gathered:
            files.update(written)
        weight_map, optimizer_map, parameters = {}, {}, {}
        for name, info in files.items():
            for tensor in info.pop("tensors"):
                (weight_map if name.startswith("model-") else optimizer_map)[tensor] = name
        for name in sorted(self.shapes, key=_layer_key):
            parameters[name] = {"shape": self.shapes[name], "file": weight_map[name],
                                "optimizer_file": fmt.optimizer_file(self.owner[name],
                                                                     self.stages)}
        buffers = {name: {"shape": list(self.buffer_shapes[name]), "file": file}
                   for name, file in sorted(weight_map.items()) if name not in self.shapes}
        total = sum(4 * math.prod(self.shapes[n]) for n in parameters)
        for index, mapping in ((fmt.MODEL_INDEX, weight_map),
                               (fmt.OPTIMIZER_INDEX, optimizer_map)):
            data = fmt.dump_json({"metadata": {"format": fmt.FORMAT, "step": step,
                                               "total_size": total},
                                  "weight_map": dict(sorted(mapping.items()))})
            files[index] = {"sha256": fmt.write_durably(staging / index, data),
                            "bytes": len(data)}
        files[fmt.RNG_FILE] = write_tensor_file(staging / fmt.RNG_FILE, {fmt.RNG_TENSOR: rng},
                                                {"format": "pt"})
        history = self.history + [fmt.history_segment(self.record, self.first_step, step - 1)]
        manifest = fmt.make_manifest(self.record, step, parameters, dict(sorted(files.items())),
                                     history, optimizer_steps, buffers)
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
        return torch.tensor([len(files), size, time.perf_counter() - start],
                            dtype=torch.float64)

    def _barrier(self) -> None:
        if self.group is not None:
            dist.barrier(group=self.group)
