"""PyTorch's own distributed APIs training planc's ``gpt`` model: the peers planc is
compared with.

Every peer trains the same function from the same initial weights on the same data with
the same optimizer, so their losses must agree with the one-process run (``plain``)
except ``floor``, which skips gradient synchronisation on purpose. The weights and the
batches are planc's own for the bench plan (planc.runtime.engine.model and .data), so
the first loss of every peer equals planc's (bench/peers.py checks it). Multi-rank peers run
as 2 processes (torch.multiprocessing, 'spawn') over gloo on 127.0.0.1; every rank
process uses one intra-op thread (2 cores, 2 ranks). As with any 'spawn' start, a script
that calls run_peer must do so under ``if __name__ == "__main__":``.

Interface::

    run_peer(name, config=None, steps=8) -> dict   # one peer, all of its ranks
    PEERS                                          # name -> description
    .venv/bin/python bench/peers_torch.py PEER [PEER ...] [--steps N] [--set KEY=VALUE]

``run_peer`` returns {"peer", "ranks", "step_times" (s, per step, max over ranks),
"losses" (global mean loss of every step), "max_rss_mb" (per rank),
"collectives_per_step" (int: max over ranks), "collective_ops" (per rank: op -> count),
"wall_s" (the whole run, process start included), "notes"}.

Measuring: a rank times each step (forward, backward, optimizer.step, zero_grad) with
time.perf_counter, no barrier inside; each rank writes its lists to a file that run_peer
reads after the run.
Collectives are counted on one extra, untimed step after the measured ones (its loss is
not reported) under a TorchDispatchMode that counts every op of the ``c10d`` (process
group: DDP's reducer, FSDP2, send/recv of pipelining) and ``_c10d_functional`` (DTensor)
namespaces that the rank issues; ``wait_tensor`` is not counted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import socket
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from planc.lower.tabulate_model import INIT_STD, initial_mean  # noqa: E402
from planc.runtime.engine.data import DataSource, batch_tokens  # noqa: E402
from planc.runtime.engine.host_memory import keep_freed_memory  # noqa: E402
from planc.runtime.engine.model import initial_value  # noqa: E402

DEFAULTS = {"layers": 4, "hidden": 256, "heads": 8, "ffn": 1024, "vocab": 2048, "seq": 128,
            "batch": 16, "seed": 1, "lr": 1e-3, "weight_decay": 0.01}

PEERS = {
    "plain": "1 process, 1 thread: the module and torch.optim.AdamW (the 1-rank baseline)",
    "ddp": "2 ranks: DistributedDataParallel(static_graph=True), 25 MiB buckets after a "
           "1 MiB first bucket, 8 sequences per rank",
    "floor": "2 ranks: ddp without any gradient communication (local gradients, local "
             "AdamW): the no-communication floor of data parallelism",
    "fsdp2": "2 ranks: FSDP2 fully_shard on every Block and on the root (ZeRO-3), "
             "8 sequences per rank",
    "tp": "2 ranks: DTensor tensor parallelism (Megatron): vocab-parallel embedding, "
          "colwise qkv/fc1, rowwise proj/fc2, colwise head with loss_parallel",
    "tp_sp": "2 ranks: tp plus sequence parallelism as torchtitan does it (LayerNorms and "
             "the residual stream sharded on the sequence)",
    "pp_1f1b": "2 ranks: torch.distributed.pipelining, Schedule1F1B, 4 microbatches of 4",
    "pp_gpipe": "2 ranks: torch.distributed.pipelining, ScheduleGPipe, 4 microbatches of 4",
    "pp_interleaved": "2 ranks: torch.distributed.pipelining, ScheduleInterleaved1F1B, "
                      "2 chunks of 1 layer per rank, 4 microbatches of 4",
    "pp_interleaved_zb": "2 ranks: torch.distributed.pipelining, "
                         "ScheduleInterleavedZeroBubble, 2 chunks of 1 layer per rank, "
                         "4 microbatches of 4",
    # the V schedules: two one-layer stages per rank, stage r and stage 3 - r on rank r
    "pp_zbv": "2 ranks: torch.distributed.pipelining, ScheduleZBVZeroBubble, 4 stages in a "
              "V (virtual 2), 4 microbatches of 4",
    "pp_dualpipev": "2 ranks: torch.distributed.pipelining, ScheduleDualPipeV, 4 stages in a "
                    "V (virtual 2), 4 microbatches of 4",
}
RANKS = {name: 1 if name == "plain" else 2 for name in PEERS}


# --- the model -------------------------------------------------------------------------

@dataclass(frozen=True)
class Config:
    layers: int
    hidden: int
    heads: int
    ffn: int
    vocab: int
    seq: int
    batch: int
    seed: int
    lr: float
    weight_decay: float


class Position(nn.Module):
    """Learned position embedding added to the token embedding: x + weight[:seq]."""

    def __init__(self, seq: int, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(seq, hidden))

    def forward(self, x):
        return x + self.weight[: x.shape[1]]


class Attention(nn.Module):
    """Causal multi-head softmax attention. qkv's output features are [q | k | v], each
    heads x head_dim; the number of heads is read from qkv's (local) output so the same
    code runs on a tensor-parallel rank's heads (see ``interleave_qkv``)."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.head_dim = hidden // heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x):
        b, s = x.shape[0], x.shape[1]
        q, k, v = self.qkv(x).view(b, s, 3, -1, self.head_dim).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # 1/sqrt(head_dim)
        return self.proj(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    """fc2(gelu_tanh(fc1(x)))."""

    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.fc1 = nn.Linear(hidden, ffn)
        self.fc2 = nn.Linear(ffn, hidden)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class Block(nn.Module):
    """Pre-LayerNorm transformer block."""

    def __init__(self, c: Config):
        super().__init__()
        self.ln1 = nn.LayerNorm(c.hidden, eps=1e-5)
        self.attn = Attention(c.hidden, c.heads)
        self.ln2 = nn.LayerNorm(c.hidden, eps=1e-5)
        self.mlp = MLP(c.hidden, c.ffn)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """planc's ``gpt``: token + position embedding, ``layers`` Blocks, final LayerNorm,
    untied head without bias. Weights are set here, before any wrapping, to planc's
    initial values of the same plan (:func:`planc_initial_values`: matrices, embeddings
    and biases N(0, 0.02), LayerNorm weights 1 + N(0, 0.02), each drawn from the seed,
    its name and its shape). A pipeline stage sets the parts it does not own to None
    (tok, pos, norm, head) or deletes them (layers), as torchtitan."""

    def __init__(self, c: Config):
        super().__init__()
        self.tok = nn.Embedding(c.vocab, c.hidden)
        self.pos = Position(c.seq, c.hidden)
        self.layers = nn.ModuleDict({str(i): Block(c) for i in range(c.layers)})
        self.norm = nn.LayerNorm(c.hidden, eps=1e-5)
        self.head = nn.Linear(c.hidden, c.vocab, bias=False)
        values = planc_initial_values(c)
        with torch.no_grad():
            for name, p in self.named_parameters():
                p.copy_(values[name])

    def forward(self, x):
        if self.tok is not None:
            x = self.pos(self.tok(x))
        for block in self.layers.values():
            x = block(x)
        if self.norm is not None:
            x = self.norm(x)
        return self.head(x) if self.head is not None else x


def loss_fn(logits, targets):
    """Mean cross-entropy over every predicted token of ``targets``."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))


def batch(c: Config, step: int) -> torch.Tensor:
    """The global batch of ``step``: (batch, seq + 1) token ids, planc's synthetic batch of
    that step (planc.runtime.engine.data), so both sides see the same tokens."""
    source = DataSource("synthetic", c.seed, c.batch, c.seq, c.vocab)
    return batch_tokens(source, step)


# planc's parameter names -> the peer's, and whether planc's (in, out) matrix is the
# transpose of the peer's nn.Linear weight (out, in).
def _peer_name(name: str) -> tuple[str, bool]:
    fixed = {"embedding.weight": ("tok.weight", False), "position.weight": ("pos.weight", False),
             "final_ln.weight": ("norm.weight", False), "final_ln.bias": ("norm.bias", False),
             "head.weight": ("head.weight", True)}
    if name in fixed:
        return fixed[name]
    _, layer, module, kind = name.split(".")
    owner = {"qkv": "attn.qkv", "proj": "attn.proj", "fc1": "mlp.fc1", "fc2": "mlp.fc2",
             "ln1": "ln1", "ln2": "ln2"}[module]
    return f"layers.{layer}.{owner}.{kind}", kind == "weight" and module not in ("ln1", "ln2")


def planc_initial_values(c: Config) -> dict[str, torch.Tensor]:
    """planc's initial values of the bench plan's parameters (planc.runtime.engine.model:
    each from the seed, its name and its shape), under the peer's names: both sides
    start from the same weights, so their first losses must be equal."""
    values = {}
    shapes = {"embedding.weight": (c.vocab, c.hidden), "position.weight": (c.seq, c.hidden),
              "final_ln.weight": (c.hidden,), "final_ln.bias": (c.hidden,),
              "head.weight": (c.hidden, c.vocab)}
    for i in range(c.layers):
        for module, shape in (("ln1", (c.hidden,)), ("qkv", (c.hidden, 3 * c.hidden)),
                              ("proj", (c.hidden, c.hidden)), ("ln2", (c.hidden,)),
                              ("fc1", (c.hidden, c.ffn)), ("fc2", (c.ffn, c.hidden))):
            shapes[f"layers.{i}.{module}.weight"] = shape
            shapes[f"layers.{i}.{module}.bias"] = (shape[-1],)
    for name, shape in shapes.items():
        value = initial_value(c.seed, name, shape, initial_mean(name), INIT_STD)
        peer, transposed = _peer_name(name)
        values[peer] = value.t().contiguous() if transposed else value
    return values


def make_optimizer(c: Config, model: nn.Module) -> torch.optim.Optimizer:
    """AdamW as a careful user sets it up: torch's fused kernel (one kernel over every
    parameter, as planc's ranks run it over each bucket) where the parameters allow it;
    on DTensor shards (FSDP2, tensor parallelism) torch 2.13's fused AdamW refuses the
    plain step counters beside them, and its default, foreach, runs."""
    from torch.distributed.tensor import DTensor

    parameters = list(model.parameters())
    fused = not any(isinstance(p, DTensor) for p in parameters)
    return torch.optim.AdamW(parameters, lr=c.lr, betas=(0.9, 0.999), eps=1e-8,
                             weight_decay=c.weight_decay, fused=fused or None)


# --- the peers: each builds (step function, notes) in every rank -----------------------
# A step function takes the global batch of the step and returns the loss this rank sees
# (a tensor, or None where the rank computes none); the last returned loss is
# the one reported, averaged over ranks for the data-parallel peers.

def _data_parallel_step(c, model, rows):
    opt = make_optimizer(c, model)

    def step(tokens):
        local = tokens[rows]
        loss = loss_fn(model(local[:, :-1]), local[:, 1:])  # local mean: DDP/FSDP average
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()
    return step


def _dp_rows(c: Config):
    rank, world = dist.get_rank(), dist.get_world_size()
    per = c.batch // world
    return slice(rank * per, (rank + 1) * per)


def build_plain(c: Config):
    """One module, AdamW (``torch.optim.AdamW``), all 16 sequences."""
    return _data_parallel_step(c, GPT(c), slice(None)), ""


def build_floor(c: Config):
    """ddp's work without DDP: each rank steps on the gradients of its own 8 sequences."""
    return _data_parallel_step(c, GPT(c), _dp_rows(c)), "no gradient communication"


def build_ddp(c: Config):
    """``torch.nn.parallel.DistributedDataParallel(model, static_graph=True)``: buckets of
    25 MiB (DDP's default bucket_cap_mb) after a first bucket of DDP's default 1 MiB.
    bucket_cap_mb is left unset on purpose: in torch 2.13 passing it, even as 25, also
    sets the first bucket's cap to it (one 17 MB bucket for this model)."""
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(GPT(c), static_graph=True)
    return _data_parallel_step(c, model, _dp_rows(c)), (
        "default buckets; DDP's reducer issues its all-reduces (one per bucket) through "
        "the c10d ops, so they are counted")


def build_fsdp2(c: Config):
    """``torch.distributed.fsdp.fully_shard`` on every Block, then on the root (ZeRO-3:
    parameters, gradients and AdamW state sharded; all-gather before use,
    reduce-scatter of gradients), over a CPU ``DeviceMesh`` whose backend is gloo. As
    torchtitan's ``apply_fsdp`` sets it by default, the last Block is not resharded after
    its forward (its backward would gather it again at once), nor is the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = GPT(c)
    blocks = list(model.layers.values())
    for index, block in enumerate(blocks):
        fully_shard(block, mesh=mesh, reshard_after_forward=index < len(blocks) - 1)
    fully_shard(model, mesh=mesh)
    return _data_parallel_step(c, model, _dp_rows(c)), \
        "the last block kept after its forward, as torchtitan"


def interleave_qkv(attn: Attention, tp: int) -> None:
    """Reorder qkv's output features from [q | k | v] to [q_0 k_0 v_0 | q_1 k_1 v_1 | ...]
    (q_r: the heads of tensor-parallel rank r) so that ColwiseParallel's even split gives
    each rank whole heads of q, k and v; a rank's slice is again [q_r | k_r | v_r], which
    Attention reads as it reads the full tensor. Training is unchanged: the function is
    the same and AdamW is elementwise."""
    hidden = attn.proj.in_features
    order = torch.arange(3 * hidden).view(3, tp, hidden // tp).transpose(0, 1).reshape(-1)
    with torch.no_grad():
        attn.qkv.weight.copy_(attn.qkv.weight[order])
        attn.qkv.bias.copy_(attn.qkv.bias[order])


def reduce_partial_grads(model: nn.Module) -> None:
    """All-reduce, once, each gradient DTensor left Partial by backward (with sequence
    parallelism: the LayerNorm and position parameters and the proj/fc2 biases, whose
    gradients sum over the sequence shards). DTensor reduces them lazily otherwise, in
    AdamW's lerp_ and again in its addcmul_: two all-reduces per such parameter."""
    from torch.distributed.tensor import DTensor, Replicate

    for p in model.parameters():
        g = p.grad
        if isinstance(g, DTensor) and any(x.is_partial() for x in g.placements):
            p.grad = g.redistribute(placements=[Replicate()] * g.device_mesh.ndim)


def _build_tp(c: Config, sequence_parallel: bool):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        loss_parallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = GPT(c)
    sp = sequence_parallel
    # The residual stream between the parts below: replicated (tp) or Shard(1) (tp_sp).
    stream = Shard(1) if sp else Replicate()
    plan = {
        "tok": RowwiseParallel(input_layouts=Replicate(), output_layouts=stream),
        "head": ColwiseParallel(input_layouts=stream, output_layouts=Shard(-1),
                                use_local_output=False),
    }
    if sp:
        plan["pos"] = SequenceParallel(use_local_output=True)
        plan["norm"] = SequenceParallel()
    parallelize_module(model, mesh, plan)
    for block in model.layers.values():
        interleave_qkv(block.attn, mesh.size())
        layer = {"attn.qkv": ColwiseParallel(),
                 "attn.proj": RowwiseParallel(output_layouts=stream),
                 "mlp.fc1": ColwiseParallel(),
                 "mlp.fc2": RowwiseParallel(output_layouts=stream)}
        if sp:
            layer.update({
                "ln1": SequenceParallel(), "ln2": SequenceParallel(),
                "attn": PrepareModuleInput(input_layouts=(Shard(1),),
                                           desired_input_layouts=(Replicate(),)),
                "mlp": PrepareModuleInput(input_layouts=(Shard(1),),
                                          desired_input_layouts=(Replicate(),))})
        parallelize_module(block, mesh, layer)
    opt = make_optimizer(c, model)

    def step(tokens):
        with loss_parallel():  # the backward too, as the API requires
            loss = loss_fn(model(tokens[:, :-1]), tokens[:, 1:])
            loss.backward()
        reduce_partial_grads(model)
        opt.step()
        opt.zero_grad()
        return loss.detach()
    return step, ("qkv rows interleaved per rank (interleave_qkv); head ColwiseParallel "
                  "with loss_parallel (vocab-sharded logits, no gather)")


def build_tp(c: Config):
    """``parallelize_module`` (torch.distributed.tensor.parallel), Megatron style: the token
    embedding vocab-parallel (``RowwiseParallel(input_layouts=Replicate())``: all-reduce of
    its output), qkv and fc1 ``ColwiseParallel``, proj and fc2 ``RowwiseParallel``
    (all-reduce), attention on the rank's own heads (``interleave_qkv``), the head
    ``ColwiseParallel`` with vocab-sharded logits fed to ``loss_parallel``. LayerNorms and
    the position embedding stay replicated plain parameters. Both ranks read all 16
    sequences."""
    return _build_tp(c, sequence_parallel=False)


def build_tp_sp(c: Config):
    """tp with sequence parallelism as torchtitan: the residual stream is sharded on the
    sequence (Shard(1)); the embedding and proj/fc2 reduce-scatter into it
    (``output_layouts=Shard(1)``), the LayerNorms and the position embedding run on the
    local sequence chunk with replicated parameters (``SequenceParallel``), and
    ``PrepareModuleInput`` all-gathers the sequence before attention and the MLP, and
    ``ColwiseParallel(input_layouts=Shard(1))`` before the head."""
    return _build_tp(c, sequence_parallel=True)


def _build_pp(c: Config, schedule_class, virtual: int = 1):
    """Stage 0: embeddings + the first half of the layers; stage 1: the second half, the
    final LayerNorm and the head; with ``virtual`` chunks per rank, chunk k on rank
    k mod 2 (a multi-stage schedule). ``PipelineStage`` infers the shapes it sends at its
    first step; the schedule averages the microbatch gradients (scale_grads=True)."""
    from torch.distributed.pipelining import PipelineStage

    rank, ranks = dist.get_rank(), dist.get_world_size()
    chunks = ranks * virtual
    models = [_chunk_of(GPT(c), index, chunks) for index in range(rank, chunks, ranks)]
    stages = [PipelineStage(m, index, chunks, torch.device("cpu"))
              for m, index in zip(models, range(rank, chunks, ranks))]
    schedule = schedule_class(stages[0] if virtual == 1 else stages, n_microbatches=4,
                              loss_fn=loss_fn)
    model = models[0] if virtual == 1 else nn.ModuleList(models)
    opt = make_optimizer(c, model)
    step = _schedule_step(schedule, opt, first=rank == 0, last=rank == ranks - 1)
    return step, f"{c.layers // chunks} layers per chunk, {virtual} per rank, 4 microbatches"


def _chunk_of(model: GPT, chunk: int, chunks: int) -> GPT:
    """``model`` cut down to pipeline chunk ``chunk`` of ``chunks``: its share of the
    layers, the embeddings on the first chunk, the final LayerNorm and head on the last."""
    layers = len(model.layers)
    per = layers // chunks
    for i in range(layers):
        if not chunk * per <= i < (chunk + 1) * per:
            del model.layers[str(i)]
    if chunk != 0:
        model.tok = model.pos = None
    if chunk != chunks - 1:
        model.norm = model.head = None
    return model


def _schedule_step(schedule, opt, first: bool, last: bool):
    """One step of a pipeline schedule on this rank: the rank holding the first stage
    feeds the inputs, the one holding the last the targets (in a V, rank 0 does both)."""
    def step(tokens):
        losses = []
        inputs = (tokens[:, :-1],) if first else ()
        targets = dict(target=tokens[:, 1:], losses=losses, return_outputs=False) \
            if last else {}
        schedule.step(*inputs, **targets)
        opt.step()
        opt.zero_grad()
        return torch.stack(losses).mean().detach() if losses else None
    return step


def build_pp_1f1b(c: Config):
    """``torch.distributed.pipelining.Schedule1F1B`` over two ``PipelineStage``s."""
    from torch.distributed.pipelining import Schedule1F1B
    return _build_pp(c, Schedule1F1B)


def build_pp_gpipe(c: Config):
    """``torch.distributed.pipelining.ScheduleGPipe`` over two ``PipelineStage``s."""
    from torch.distributed.pipelining import ScheduleGPipe
    return _build_pp(c, ScheduleGPipe)


def build_pp_interleaved(c: Config):
    """``torch.distributed.pipelining.ScheduleInterleaved1F1B``, 2 chunks per rank."""
    from torch.distributed.pipelining import ScheduleInterleaved1F1B
    return _build_pp(c, ScheduleInterleaved1F1B, virtual=2)


def build_pp_interleaved_zb(c: Config):
    """``torch.distributed.pipelining.ScheduleInterleavedZeroBubble``, 2 chunks per rank:
    backward split into input and weight gradients, the weights' deferred."""
    from torch.distributed.pipelining import ScheduleInterleavedZeroBubble
    return _build_pp(c, ScheduleInterleavedZeroBubble, virtual=2)


def _build_pp_v(c: Config, schedule_class):
    """Two stages per rank in a V, as torch's V schedules place them: model chunk k (its
    share of the layers; the embeddings on chunk 0, the final LayerNorm and the head on
    the last) runs on rank k for k < ranks, on rank 2 x ranks - 1 - k after, so rank 0
    holds the first and the last chunk and feeds both the tokens and the targets."""
    import copy

    from torch.distributed.pipelining import PipelineStage

    rank, ranks = dist.get_rank(), dist.get_world_size()
    chunks = 2 * ranks
    full, per = GPT(c), c.layers // chunks
    modules, stages = [], []
    for chunk in (rank, chunks - 1 - rank):
        model = _chunk_of(copy.deepcopy(full), chunk, chunks)
        modules.append(model)
        stages.append(PipelineStage(model, chunk, chunks, torch.device("cpu")))
    schedule = schedule_class(stages, n_microbatches=4, loss_fn=loss_fn)
    opt = make_optimizer(c, nn.ModuleList(modules))
    step = _schedule_step(schedule, opt, first=rank == 0, last=rank == 0)
    return step, f"{per} layers per chunk, 2 chunks per rank in a V, 4 microbatches"


def build_pp_zbv(c: Config):
    """``torch.distributed.pipelining.ScheduleZBVZeroBubble``: split backward in a V."""
    from torch.distributed.pipelining import ScheduleZBVZeroBubble
    return _build_pp_v(c, ScheduleZBVZeroBubble)


def build_pp_dualpipev(c: Config):
    """``torch.distributed.pipelining.ScheduleDualPipeV``: overlapped F and B in a V."""
    from torch.distributed.pipelining import ScheduleDualPipeV
    return _build_pp_v(c, ScheduleDualPipeV)


BUILDERS = {name: globals()[f"build_{name}"] for name in PEERS}


# --- running a peer --------------------------------------------------------------------

class CountCollectives(TorchDispatchMode):
    """Counts the communication ops this thread issues: process-group ops (``c10d``) and
    DTensor's functional collectives (``_c10d_functional``), not their waits."""

    def __init__(self):
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        # Let DTensor run first (as CommDebugMode does): the collectives it lowers to
        # come back through this mode on plain tensors.
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        op = func.__name__.split(".")[0]
        if getattr(func, "namespace", "") in ("c10d", "_c10d_functional") and \
                op not in ("wait_tensor", "_wrap_tensor_autograd"):
            name = f"{func.namespace}.{op}"
            self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _rank_main(rank: int, name: str, config: dict, steps: int, world: int, port: int,
               out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    # The allocator settings planc's ranks run with (planc.runtime.engine.host_memory):
    # freed memory kept for the next step instead of mapped again page by page.
    keep_freed_memory()
    # Raised by the vocab-parallel embedding's hooks, whose input (token ids) has no grad.
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world)
    c = Config(**config)
    step, notes = BUILDERS[name](c)
    batches = [batch(c, k) for k in range(steps + 1)]
    times, losses = [], []
    for k in range(steps):
        start = time.perf_counter()
        loss = step(batches[k])
        times.append(time.perf_counter() - start)
        losses.append(None if loss is None else float(
            loss.full_tensor() if hasattr(loss, "full_tensor") else loss))
    counter = CountCollectives()
    with counter:  # one extra step, untimed, to count its communication
        step(batches[steps])
    mine = {"times": times, "losses": losses, "counts": counter.counts,
            "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "notes": notes}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:  # gathered by run_peer
        json.dump(mine, f)
    if world > 1:
        dist.destroy_process_group()
    # Skip interpreter finalization: a gloo worker thread may still be freeing the last
    # collective's work, whose tensors need the GIL; if Python is finalizing then, that
    # thread calls std::terminate and the rank dies with SIGABRT after its work is done
    # (1 run in ~10 here, with or without destroy_process_group; pytorch issue 190489).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _environment(**values):
    """Set environment variables for the processes started inside, then restore them."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_peer(name: str, config: dict | None = None, steps: int = 8) -> dict:
    """Train ``steps`` steps of peer ``name`` (a key of PEERS) in fresh processes, one per
    rank, and return its measurements (see the module docstring). ``config`` overrides
    DEFAULTS (layers, hidden, heads, ffn, vocab, seq, batch, seed, lr, weight_decay)."""
    if name not in PEERS:
        raise ValueError(f"unknown peer {name!r}; one of {', '.join(PEERS)}")
    c = asdict(Config(**{**DEFAULTS, **(config or {})}))
    world = RANKS[name]
    if c["hidden"] % c["heads"]:
        raise ValueError("hidden must be divisible by heads")
    if c["batch"] % (4 * world) or c["heads"] % world or c["layers"] % world \
            or c["seq"] % world:
        raise ValueError(f"{name} needs batch divisible by {4 * world} and heads, layers "
                         f"and seq by {world}")
    port = _free_port()
    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        with _environment(OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_=str(64 * 2**20),
                          MALLOC_TRIM_THRESHOLD_=str(256 * 2**20), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo"):
            mp.start_processes(_rank_main, args=(name, c, steps, world, port, out),
                               nprocs=world, start_method="spawn")
        wall = time.perf_counter() - start
        ranks = []
        for rank in range(world):
            with open(os.path.join(out, f"rank{rank}.json")) as f:
                ranks.append(json.load(f))
    losses = [next((r["losses"][k] for r in reversed(ranks) if r["losses"][k] is not None),
                   None) for k in range(steps)]
    if name in ("ddp", "floor", "fsdp2"):  # each rank saw its own rows: average
        losses = [sum(r["losses"][k] for r in ranks) / world for k in range(steps)]
    counts = [r["counts"] for r in ranks]
    notes = "; ".join(filter(None, [r["notes"] for r in ranks[:1]] + [
        "collectives counted on one extra untimed step (c10d + _c10d_functional ops)"]))
    return {
        "peer": name,
        "ranks": world,
        "step_times": [max(r["times"][k] for r in ranks) for k in range(steps)],
        "losses": losses,
        "max_rss_mb": [round(r["rss_mb"], 1) for r in ranks],
        "collectives_per_step": max(sum(n.values()) for n in counts),
        "collective_ops": counts,
        "wall_s": round(wall, 2),
        "notes": notes,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("peers", nargs="+", choices=list(PEERS), metavar="PEER",
                        help="one or more of: " + ", ".join(PEERS))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value, e.g. --set layers=2")
    args = parser.parse_args(argv)
    config = {}
    for item in args.set:
        key, _, value = item.partition("=")
        if key not in DEFAULTS:
            parser.error(f"unknown config key {key!r}; one of {', '.join(DEFAULTS)}")
        config[key] = type(DEFAULTS[key])(value)
    for name in args.peers:
        try:
            result = run_peer(name, config, args.steps)
        except ValueError as exc:
            parser.error(str(exc))
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
