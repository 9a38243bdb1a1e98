"""``planc run --checkpoint-peer-memory``: after every step, a checkpoint in host memory,
each stage's part held on its writer's node and on the next node (Gemini, Wang et al.,
SOSP'23: checkpoints in CPU memory, each replicated on a peer machine, so that a lost
machine recovers from its peer's memory, not from remote storage).

Host memory is a tmpfs directory per node, ``ROOT/node-K/``: the writer of a stage on
node n writes its part (the same files as the file system's checkpoint) into node n's
and node (n + 1) mod N's, then rank 0 writes the RNG state, the indices and the manifest
into every node's and renames each into place: ``node-K/step-NNNNNN``, holding the parts
node K keeps. Only the newest is kept. It is a checkpoint of its own, with its own gloo
group and its own :class:`Checkpoints` (an asynchronous file-system checkpoint may be
using the other's at that moment); planc.checkpoint.peer_copy puts one together from
the nodes left after a failure.
"""

from __future__ import annotations

import copy
import math
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist

from planc.checkpoint import format as fmt
from planc.checkpoint.peer_copy import node_directory
from planc.runtime.checkpoint.background import Background
from planc.runtime.checkpoint.checkpoints import Checkpoints


class PeerMemory:
    """Writes this rank's share of the checkpoint in peer memory after a step."""

    def __init__(self, checkpoints: Checkpoints, root: str, devices_per_node: int):
        """``checkpoints``: a :class:`Checkpoints` of its own (its own group)."""
        self.checkpoints, self.root = checkpoints, Path(root)
        self.per_node = devices_per_node
        self.nodes = -(-checkpoints.world // devices_per_node)
        self.node = checkpoints.rank // devices_per_node
        self._copier = Background()

    def follow(self, resumed: Checkpoints) -> None:
        """Carry the training history a resumed run's checkpoints carry."""
        self.checkpoints.history = list(resumed.history)
        self.checkpoints.first_step = resumed.first_step

    def save(self, step: int, background: bool = False) -> float:
        """The checkpoint after ``step`` steps, into the nodes' memory; all ranks call it.
        ``background`` (with --checkpoint-async): the state is copied out here, and a
        thread sends, writes and commits it while the next steps train (the next copy
        waits for it). Returns the seconds it held the step boundary up."""
        start = time.perf_counter()
        self.wait()
        ck = self.checkpoints
        staging = fmt.staging_name(step)
        if ck.rank == 0:
            for node in range(self.nodes):
                directory = node_directory(self.root, node) / staging
                shutil.rmtree(directory, ignore_errors=True)
                directory.mkdir(parents=True)
        ck._barrier()
        state = (step, *ck._consolidate(), torch.get_rng_state(), ck._optimizer_steps(), start)
        if not background:
            self._finish(*state)
        else:
            self._copier.start(self._finish, state, f"planc-peer-memory-{step}")
        return time.perf_counter() - start

    def wait(self) -> None:
        """Until the copy being made in the background is committed; its error, if it
        failed, is raised here."""
        self._copier.wait()

    def _finish(self, step: int, params: dict, states: dict, rng: torch.Tensor,
                optimizer_steps: int | None, start: float) -> None:
        """Write the stage's part on this node and send it to the next; rank 0 commits
        every node's copy once all are written."""
        ck, staging = self.checkpoints, fmt.staging_name(step)
        here = node_directory(self.root, self.node) / staging
        files = ck._write_stage(here, step, params, states)
        for stage, (peer_params, peer_states) in self._exchange(params, states).items():
            ck._write_stage(here, step, peer_params, peer_states, stage)
        ck._barrier()
        gathered = ck._gather_files(files)
        if ck.rank == 0:
            for node in range(self.nodes):
                directory = node_directory(self.root, node)
                ck._commit(directory, directory / staging, step, copy.deepcopy(gathered),
                           start, rng, optimizer_steps)
            for node in range(self.nodes):  # once every node holds the new step
                for older in node_directory(self.root, node).iterdir():
                    if older.name != fmt.step_name(step) and older.is_dir() and \
                            fmt.STEP_DIR.fullmatch(older.name):
                        shutil.rmtree(older, ignore_errors=True)
        ck._barrier()

    def _peer(self, rank: int) -> int:
        """The rank of the next node with ``rank``'s place on its node."""
        return (rank + self.per_node) % self.checkpoints.world

    def _names(self, stage: int) -> tuple[list[str], list[tuple[str, str]]]:
        """The tensors of ``stage``'s model file (its parameters and buffers: a
        mixture's balancing biases) and its optimizer states (each with its parameter),
        in the order sent."""
        ck = self.checkpoints
        params = sorted(name for name in ck.shapes if ck.owner[name] == stage)
        buffers = sorted(name for name in ck.buffer_shapes if ck.owner[name] == stage)
        return sorted(params + buffers), sorted((fmt.state_name(n, k), n) for n in params
                                                for k in ck.keys)

    def _exchange(self, params: dict, states: dict) -> dict[int, tuple[dict, dict]]:
        """A writer sends its stage's tensors, as one buffer, to its peer on the next
        node; returns {stage: (parameters, states)} of what this rank received."""
        ck, pending, received = self.checkpoints, [], {}
        if self.nodes < 2:  # no other node to hold a copy
            return {}
        if ck.rank == ck.writer:
            params_of, states_of = self._names(ck.ctx.stage)
            if sorted(params) != params_of or sorted(states) != [s for s, _ in states_of]:
                raise RuntimeError("the consolidated state is not the stage's file")
            flat = torch.cat([t.reshape(-1) for t in (*(params[n] for n in params_of),
                                                      *(states[s] for s, _ in states_of))])
            pending.append(dist.isend(flat, self._peer(ck.rank), group=ck.group))
        for stage in range(ck.stages):
            writer = ck.where[(stage, 0, 0)]
            if self._peer(writer) != ck.rank or writer == ck.rank:
                continue
            params_of, states_of = self._names(stage)
            names = (params_of, [s for s, _ in states_of])
            shape_of = {**ck.shapes, **ck.buffer_shapes}
            shapes = [shape_of[n] for n in params_of] + [ck.shapes[n] for _, n in states_of]
            flat = torch.empty(sum(math.prod(s) for s in shapes), dtype=torch.float32)
            pending.append(dist.irecv(flat, writer, group=ck.group))
            received[stage] = (names, shapes, flat)
        for work in pending:
            work.wait()
        out = {}
        for stage, (names, shapes, flat) in received.items():
            tensors = [piece.view(shape) for piece, shape in
                       zip(torch.split(flat, [math.prod(s) for s in shapes]), shapes)]
            out[stage] = (dict(zip(names[0], tensors[:len(names[0])])),
                          dict(zip(names[1], tensors[len(names[0]):])))
        return out
