"""This rank's parameters and gradients, in the flat buckets its program lists.

Each bucket of the program (:mod:`planc.passes.fuse`) is a flat fp32 buffer holding its
members at the offsets the compiler chose, padded to whole ZeRO shards, as in
Megatron-LM's param-and-grad buffer: a parameter is a view of its bucket, its gradient
a view of the bucket's gradient buffer, and backward steps accumulate into those views.
Under ZeRO the optimizer owns the rank's equal slice of the bucket (its shard); under
ZeRO-3 only the shard is kept, and a gather fills the whole bucket before each use
(its storage let go between a unit's forward and backward: the section at the end).
With ``mesh { ep }`` a bucket of routed experts (``over`` edp) holds this rank's experts'
rows of each member, and its ZeRO shard is its place in the experts' replicas (edp).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch

from planc.program.operands import StepKind
from planc.runtime.engine.context import RankContext
from planc.runtime.engine.model import drawn_at_once, initial_value, split_feature

FP32 = torch.float32


@dataclass(frozen=True)
class Member:
    bucket: str
    offset: int
    numel: int
    shape: tuple[int, ...]


def tp_piece(ctx: RankContext, value: torch.Tensor, split, tp_rank: int) -> torch.Tensor:
    """tp rank ``tp_rank``'s piece of a parameter's full ``value`` under the bucket
    member's ``tp_split`` ([dim, axis], or None: every tp rank holds all of it). The
    checkpoints (planc.runtime.checkpoint.checkpoints) cut and join with this same rule."""
    if split is None:
        return value
    dim, axis = split
    return split_feature(value, dim, ctx.tp, tp_rank, ctx.model, axis)


def piece_of(ctx: RankContext, value: torch.Tensor, member: dict, index: int
             ) -> torch.Tensor:
    """Piece ``index`` of a member's full ``value``: its ep index's rows of the experts
    (``ep_split``: ep contiguous parts of dimension 0), else its tp rank's piece."""
    if member.get("ep_split"):
        return value.chunk(member["ep_split"], 0)[index]
    return tp_piece(ctx, value, member["tp_split"], index)


def piece_index(ctx: RankContext, bucket: dict) -> int:
    """Which piece of its members this rank's copy of ``bucket`` holds."""
    return ctx.groups.index("ep", ctx.rank) if bucket.get("over") else ctx.tp_rank


def shard_index(ctx: RankContext, bucket: dict) -> int:
    """This rank's ZeRO shard of ``bucket``: its place in the group the bucket is
    reduced over (dp x cp, or an expert's replicas)."""
    return ctx.groups.index(bucket.get("over", "dp_cp"), ctx.rank)


class ParamStore:
    def __init__(self, ctx: RankContext, buckets: dict[str, dict]):
        self.buckets = buckets
        self.full: dict[str, torch.Tensor] = {}  # whole bucket (absent under ZeRO-3)
        self.shard: dict[str, torch.Tensor] = {}  # this rank's slice (sharded buckets)
        self.grad: dict[str, torch.Tensor] = {}
        self.grad_shard: dict[str, torch.Tensor] = {}
        self.shard_range: dict[str, tuple[int, int]] = {}  # [start, end) of the shard
        self.members: dict[str, Member] = {}
        # state that is not trained: name -> fp32 tensor, the same on every rank holding
        # it (a mixture's balancing bias, planc.runtime.engine.router_bias), kept beside
        # the parameters so that evaluations and checkpoints see it
        self.buffers: dict[str, torch.Tensor] = {}
        seed, initial = ctx.model.seed, ctx.model.parameters
        for bucket_id, bucket in buckets.items():
            flat = torch.zeros(bucket["padded"], dtype=FP32)
            piece = piece_index(ctx, bucket)

            def fill(m: dict) -> None:  # each member's own slice of flat
                rule = initial[m["param"]]  # the model table's rule for its initial value
                value = initial_value(seed, m["param"], tuple(m["full_shape"]), rule.mean,
                                      rule.std)
                flat[m["offset"]:m["offset"] + m["numel"]] = \
                    piece_of(ctx, value, m, piece).reshape(-1)

            if ctx.model.init is None:  # else read from it (planc.runtime.checkpoint.init_load)
                drawn_at_once(fill, bucket["members"])
            for m in bucket["members"]:
                self.members[m["param"]] = Member(bucket_id, m["offset"], m["numel"],
                                                  tuple(m["shape"]))
            flat = flat.to(ctx.device)
            if bucket["sharded"]:
                size, index = bucket["shard"], shard_index(ctx, bucket)
                self.shard_range[bucket_id] = (index * size, (index + 1) * size)
                self.shard[bucket_id] = self.own_shard(bucket_id, flat).clone()
                self.grad_shard[bucket_id] = torch.zeros_like(self.shard[bucket_id])
            if not bucket["zero3"]:
                self.full[bucket_id] = flat
            self.grad[bucket_id] = torch.zeros(bucket["padded"], dtype=FP32, device=ctx.device)

    def view(self, flat: torch.Tensor, name: str) -> torch.Tensor:
        """Parameter ``name`` inside a whole bucket ``flat``."""
        m = self.members[name]
        return flat[m.offset:m.offset + m.numel].view(m.shape)

    def param(self, name: str) -> torch.Tensor:
        return self.view(self.full[self.members[name].bucket], name)

    def grad_of(self, name: str) -> torch.Tensor:
        return self.view(self.whole_grad(self.members[name].bucket), name)

    def whole_grad(self, bucket: str) -> torch.Tensor:
        """The bucket's whole gradient buffer; zeros again where a reduce-scatter let it
        go (:meth:`let_go_grad`)."""
        grad = self.grad[bucket]
        if grad.untyped_storage().nbytes() == 0:
            _made_whole(grad).zero_()
        return grad

    def let_go_grad(self, bucket: str) -> None:
        """Free the whole gradient of a bucket whose shard has taken this microbatch's
        sum (ZeRO-2/3): between a bucket's reduce-scatter and the next backward adding
        into it, a rank holds only its shard, as the ZeRO paper's stage 2 counts (2Psi/N_d
        bytes of gradient; Rajbhandari et al. 2020, section 5.2), and as FSDP frees each
        unit's unsharded gradient once it is reduce-scattered."""
        let_go(self.grad[bucket])

    def own_shard(self, bucket: str, flat: torch.Tensor) -> torch.Tensor:
        """This rank's shard of a whole (sharded) bucket ``flat``."""
        start, end = self.shard_range[bucket]
        return flat[start:end]

    def current_grad(self, bucket: str) -> torch.Tensor:
        """The bucket's gradient as the next reduction sees it: the shard once reduced
        and scattered, else the whole buffer."""
        return self.grad_shard[bucket] if self.buckets[bucket]["sharded"] else \
            self.grad[bucket]

    def zero_grads(self) -> None:
        for grad in (*self.grad.values(), *self.grad_shard.values()):
            if grad.untyped_storage().nbytes():  # else let go: zeros when made again
                grad.zero_()


# --- ZeRO-3's whole buckets between a unit's forward and its backward ---
#
# A forward step of a ZeRO-3 unit reads its parameters as views of the bucket its gather
# filled, and autograd keeps those views (the parameters as leaves, the weights its GEMMs
# saved) until the backward. Were they kept as they are, every unit's whole parameters
# would stay from its forward to its backward, the whole model at the end of the forward,
# which is what ZeRO-3 exists to avoid (Rajbhandari et al., "ZeRO", 2020, section 5.3:
# parameters are gathered before each use and "discarded" after it).
#
# So, as PyTorch's FSDP does (its flat parameter's storage is resized to zero after the
# forward and gathered into again before the backward), the storage of the forward's
# gathered bucket is let go when the program frees its buffer (its last reader, the
# unit's last forward step, has run): the views keep their shapes but hold no bytes. The
# backward's own gather brings the shards in again, into that same storage where it
# was let go before the gather ran (pairs); else (the gather ran ahead of the
# forward on its own stream) before the unit's first backward step differentiates the
# forward's storage takes its values back from the gather's (refill). Views and
# their offsets are unchanged, so autograd reads the same parameters it saved.

# the steps whose gathers the backward reads again, by their own gather: the forward's
# buffer can go after them
_FORWARD = (StepKind.FORWARD, None)
GATHERED_PORT = "gathered"  # planc.graph.vocabulary.Port.GATHERED


def forward_gathers(steps: Iterable) -> frozenset[str]:
    """The gathers only forward steps read (bound compute steps with ``kind`` and
    ``gathered``): the buffers whose storage is let go when they are freed. A gather a
    backward or recomputation also reads is kept whole until its readers are done."""
    forward, others = set(), set()
    for step in steps:
        gathered = getattr(step, "gathered", None)
        if gathered:
            (forward if step.kind in _FORWARD else others).update(gathered.values())
    return frozenset(forward - others)


def pairs(steps: Iterable, forward_only: frozenset[str]) -> dict[str, str]:
    """Each backward gather -> the forward gather of the same unit it may fill again:
    the gathers of a step's forward (``forward_of``) and its own, bucket by bucket."""
    steps = [step for step in steps if getattr(step, "gathered", None)]
    by_node = {step.node: step for step in steps}
    out = {}
    for step in steps:
        forward = by_node.get(step.forward_of)
        if step.kind in _FORWARD or forward is None:
            continue
        for bucket, gather in step.gathered.items():
            first = forward.gathered.get(bucket)
            if first in forward_only:
                out[gather] = first
    return out


def let_go(value):
    """Free a whole bucket's bytes while views of it (autograd's) stay; returns it."""
    if isinstance(value, torch.Tensor):
        value.untyped_storage().resize_(0)
    return value


def _made_whole(flat: torch.Tensor) -> torch.Tensor:
    """A let-go flat buffer's storage grown back to its size (its values undefined)."""
    flat.untyped_storage().resize_(flat.numel() * flat.element_size())
    return flat


def filled_again(whole: torch.Tensor) -> torch.Tensor:
    """A let-go bucket's storage made whole again, as a tensor to write into: through
    .data, so that the write does not count as a change of the values autograd saved
    (the version counter every view shares)."""
    return _made_whole(whole).data


def refill(kept: dict[str, torch.Tensor], gathered: dict[str, torch.Tensor]) -> None:
    """Put each bucket's values back into the forward's storage ``kept`` (bucket ->
    whole bucket) from the backward's gather ``gathered``, where it was let go."""
    for bucket, whole in kept.items():
        if whole.untyped_storage().nbytes() != 0:
            continue  # never let go (a recomputation's), or already refilled
        source = gathered.get(bucket)
        if source is None:
            raise RuntimeError(f"the backward reads bucket {bucket} the forward let go, "
                               "but the program gives it no gather of that bucket")
        filled_again(whole).copy_(source)


# --- a GEMM's input gathered again for its backward (gathered_inputs = regather) ---
#
# Under sequence parallelism a column-parallel GEMM reads its input all-gathered over tp,
# and autograd keeps that whole input for the weight gradient. With gathered_inputs =
# regather the program frees the forward's gathered buffer after the GEMM, as Megatron-LM
# keeps only the shard (Korthikanti et al. 2022, section 4.2.2): its storage is let go
# while autograd's views of it stay, as ZeRO-3's buckets are above, and the backward's
# own all-gather of the kept shard fills it again before the step that differentiates it.


def regathered_inputs(steps: Iterable) -> tuple[dict[str, str], dict[str, tuple[str, ...]]]:
    """The backward all-gathers of GEMM inputs (what a backward or weight step takes
    through its ``gathered`` port), and the forward all-gathers whose outputs they make
    again: those, the inputs ``x`` of the forwards that step differentiates (its own, or,
    for the weight step of a GEMM that tp_overlap cut into pieces, every piece's), have
    their storage let go when the program frees them. Returns the pairs (backward gather
    -> forward gather) where the step differentiates one forward, whose storage the
    backward gather writes into, and, by the step that reads the gather again, the
    forward gathers it fills (let go, each dropped once that step has run: whole again,
    it is that step's alone). ``steps``: the bound instructions; compute steps are those
    naming a ``forward_of``."""
    computes = [step for step in steps if hasattr(step, "forward_of")]
    forwards = {step.node: step for step in computes if step.kind in _FORWARD}
    pieces: dict[str, list] = {}  # a weight step -> the input halves whose W it is
    for step in computes:
        if step.weight_grad is not None:
            pieces.setdefault(step.weight_grad, []).append(step)
    pairs, refilled = {}, {}
    for step in computes:
        again = [i.buffer for i in step.inputs if i.port == GATHERED_PORT]
        if step.kind in _FORWARD or not again:
            continue
        differentiated = [forwards.get(half.forward_of)
                          for half in pieces.get(step.node, [step])]
        first = [i.buffer for forward in differentiated if forward is not None
                 for i in forward.inputs if i.port == "x"]
        refilled[step.node] = tuple(first)
        if len(first) == 1:
            pairs[again[0]] = first[0]
    return pairs, refilled


def into_let_go(kept: torch.Tensor) -> torch.Tensor:
    """A let-go input's storage made whole again, as a tensor to write its values into
    (through .data: autograd's saved views of it see no change of version)."""
    kept.untyped_storage().resize_((kept.storage_offset() + kept.numel()) *
                                   kept.element_size())
    return kept.data


def fill_input(kept: torch.Tensor, gathered: torch.Tensor) -> None:
    """Put a let-go input's values back from the backward's all-gather ``gathered``,
    where the gather did not write them there itself (its forward's buffer was not let
    go before it ran); one whole already is left as it is."""
    if kept.untyped_storage().nbytes() == 0:
        into_let_go(kept).copy_(gathered)
