"""The parameters' half of the derivation: where each parameter is used on a chunk, its
bucket, its gradient's path to the optimizer, and its gathers under ZeRO.

Every parameter gets a bucket of its own here (planc.passes.fuse merges them). Its
gradient goes, as the ZeRO stage says (Rajbhandari et al. 2020), through: a gather over
tp of the slices a replicated parameter was used through, a sum over tp of the partial
sums one applied to split data produced, the reduction over dp x cp (all-reduce, or
reduce-scatter under ZeRO-1/2/3, every microbatch under ZeRO-2/3), the sum between the
two stages holding a tied embedding (Megatron), and the optimizer step; under ZeRO-1/2
the updated bucket is then gathered, under ZeRO-3 it is gathered before every use.

With ``mesh { ep }`` a routed expert's stacked weights (leading dimension ``experts``)
are split over the ep group, each rank keeping its own experts' rows, and replicated on
the other ranks of the stage holding the same experts, the expert-data-parallel group
(tp x cp x dp / ep; Megatron-Core's MoE Parallel Folding, arXiv 2504.14960): their
gradients, which cover every token dispatched to those experts from the whole ep group,
skip the tp sum and are reduced, and sharded under ZeRO, over that group instead.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from planc.graph import reasons
from planc.graph.builder import GraphBuilder
from planc.graph.ir import Axis, Kind, Op, Payload, Phase, Port, buckets, shard_numel
from planc.graph.sharding import Layout, gradient_layout
from planc.estimate.memory import head_unit_kept, last_block_kept
from planc.estimate.model import Parameter, all_parameters
from planc.graph.tensor_parallel import ParamUse
from planc.graph.walk_records import ForwardChunk

OPTIMIZER_FLOPS_PER_ELEMENT = {"adamw": 12, "sgd": 3}
GLOBAL_PARAMETERS = ("embedding.weight", "position.weight", "head.weight",
                     "final_ln.weight", "final_ln.bias")


def param_name(name: str, layer: int | None) -> str:
    """The global name of a parameter an operator of ``layer`` uses."""
    return name if layer is None or name in GLOBAL_PARAMETERS else f"layers.{layer}.{name}"


class _Use(NamedTuple):
    """One operator's use of a parameter."""

    forward: str  # the forward step that reads it
    backward: str  # the backward step that writes its gradient
    how: ParamUse


@dataclass(frozen=True)
class _Site:
    """A parameter as the operators of one chunk use it."""

    param: Parameter
    uses: tuple[_Use, ...]

    @property
    def storage(self) -> Layout:
        return self.uses[0].how.storage


class ParameterRules:
    """The parameters' buckets, gradient paths and optimizer steps, added to the graph
    ``builder`` makes once the walks over the chunks are done."""

    def __init__(self, builder: GraphBuilder):
        # what the rules read of the graph under construction, and how they add to it
        b = builder
        self.plan, self.graph, self.m, self.tp, self.replicas = \
            b.plan, b.graph, b.m, b.tp, b.replicas
        self.compute, self.transfer, self.edge = b.compute, b.transfer, b.edge
        self.layout, self.group_size = b.layout, b.group_size
        plan = self.plan
        self.zero = plan.shard.dp.zero
        self.params = {p.name: p for p in all_parameters(plan)}
        self.tied = plan.model.tie_embeddings and plan.head_stage != 0
        self._sites_of_stage: dict[int, dict[int, list[_Site]]] = {}
        # once per plan: each replays the head's stage's schedule
        self.kept_unit, self.kept_block = head_unit_kept(plan), last_block_kept(plan)

    # --- parameters ---------------------------------------------------------------------

    def _sites(self, chunk: int, forward: Sequence[ForwardChunk],
               backward_of: Mapping[str, str]) -> list[_Site]:
        """The parameters whose home is ``chunk``: the first chunk of its stage that uses
        them. A parameter two chunks of one stage use (a tied embedding in a V, where the
        embedding and the head both sit on stage 0) is one site with every use. The
        stage's sites are found once, for all its chunks: per chunk, the walk over the
        stage's chunks made an interleaved stage of v chunks cost v squared."""
        stage = self.plan.stage_of_chunk(chunk)
        if stage not in self._sites_of_stage:
            sites: dict[str, tuple[Parameter, list, int]] = {}
            for other in self.plan.chunks_of_stage(stage):
                for node, op, layer in forward[other].steps:
                    for use in self.layout(op).params:
                        name = param_name(use.name, layer)
                        sites.setdefault(name, (self.params[name], [], other))[1].append(
                            _Use(node, backward_of[node], use))
            by_home: dict[int, list[_Site]] = {}
            for param, uses, home in sites.values():
                by_home.setdefault(home, []).append(_Site(param, tuple(uses)))
            self._sites_of_stage[stage] = by_home
        return self._sites_of_stage[stage].get(chunk, [])

    def _local_shape(self, site: _Site) -> list[int]:
        shape = list(site.param.shape)
        if site.param.split_over_experts(self.plan.mesh.ep):
            shape[0] //= self.plan.mesh.ep
        elif site.storage.is_sharded and self.tp > 1:
            shape[site.uses[0].how.storage_axis] //= self.tp
        return shape

    def _replicated_over(self, param: Parameter) -> tuple[Axis, int]:
        """The group over which ``param``'s gradient is reduced (and ZeRO shards it), and
        its size: the expert-data-parallel group for a split expert, else dp x cp."""
        if param.split_over_experts(self.plan.mesh.ep):
            return Axis.EDP, self.group_size(Axis.EDP)
        return Axis.DP_CP, self.replicas

    def add(self, chunk: int, forward: Sequence[ForwardChunk],
                    backward_of: Mapping[str, str]) -> None:
        """``forward``: every chunk's forward walk; ``backward_of``: every forward step's
        backward step."""
        for site in self._sites(chunk, forward, backward_of):
            bucket = self._bucket(chunk, site)
            if buckets(self.graph)[bucket]["zero3"]:
                self._zero3_gathers(chunk, site, bucket)
            ready = self._gradient(chunk, site, bucket)
            self._optimizer(chunk, bucket, ready)

    def _bucket(self, chunk: int, site: _Site) -> str:
        """A bucket holding this one parameter: the derivation's starting point."""
        param, stage = site.param, self.plan.stage_of_chunk(chunk)
        tied = self.tied and param.name == "embedding.weight"
        bucket_id = param.name + (f"#s{stage}" if tied else "")
        shape = self._local_shape(site)
        numel = 1
        for size in shape:
            numel *= size
        use = site.uses[0].how
        axis, replicas = self._replicated_over(param)
        experts = axis == Axis.EDP
        fixup = use.gradient_transfer() if self.tp > 1 and not experts else None
        parts = replicas if self.zero >= 1 and replicas > 1 else 1
        shard = shard_numel(numel, parts)
        split = [use.storage.dim, use.storage_axis] if use.storage.is_sharded and \
            self.tp > 1 and not experts else None
        member = {"param": param.name, "offset": 0, "numel": numel, "shape": shape,
                  "full_shape": list(param.shape), "tp_split": split, "layer": param.layer}
        if experts:  # rows ep_index * E / ep ... of the experts dimension
            member["ep_split"] = self.plan.mesh.ep
        buckets(self.graph)[bucket_id] = {
            "stage": stage, "chunk": chunk, "dtype": "fp32", "members": [member],
            "numel": numel, "parts": parts, "shard": shard, "padded": shard * parts,
            "sharded": parts > 1, "zero3": self.zero == 3 and replicas > 1,
            "tp_sum_numel": numel if fixup is not None and fixup.kind == "all_reduce" else 0,
            "tied": tied,
            "reason": "one parameter (before fusion)", **({"over": axis.value} if experts
                                                          else {})}
        return bucket_id

    def _bucket_bytes(self, bucket: str) -> float:
        return buckets(self.graph)[bucket]["numel"] * self.plan.model.dtype_bytes

    def _zero3_gathers(self, chunk: int, site: _Site, bucket: str) -> None:
        param = site.param
        axis = self._replicated_over(param)[0]
        kept_unit, kept_block = self.kept_unit, self.kept_block
        for node, backward, _how in site.uses:
            op, layer = self.graph.nodes[node]["op"], self.graph.nodes[node]["layer"]
            # the head's unit, and the last block's, kept whole for their backward
            # (memory.head_unit_kept, memory.last_block_kept)
            kept = kept_unit and layer is None and op not in (Op.EMBEDDING, Op.POSITION) or \
                kept_block and layer == self.plan.model.layers - 1
            gather = None
            for letter, phase in (("F", Phase.FORWARD), ("B", Phase.BACKWARD)):
                consumer = node if letter == "F" else backward
                if gather is None or not kept:
                    # on the chunk of its reader (a V's tied head reads chunk 0's embedding)
                    reason = reasons.zero3_gather(self.plan, param.name, phase.value, axis,
                                                  kept=kept)
                    gather = self.transfer(
                        f"{letter}/{param.name}>{op}:all_gather@{axis}",
                        kind=Kind.ALL_GATHER, axis=axis, payload=Payload.PARAM,
                        phase=phase, chunk=self.graph.nodes[node]["chunk"],
                        layer=param.layer, nbytes=self._bucket_bytes(bucket),
                        repeat=self.m, reason=reason, bucket=bucket)
                self.edge(gather, consumer, port=Port.PARAM)
                again = self.graph.nodes[consumer].get("recompute_of")
                if letter == "B" and again is not None:
                    self.edge(gather, again, port=Port.PARAM)

    def _gradient(self, chunk: int, site: _Site, bucket: str) -> str | list[str]:
        """The gradient's path from its backward operators to the optimizer."""
        param = site.param
        use = site.uses[0].how
        stage = self.plan.stage_of_chunk(chunk)
        tied = buckets(self.graph)[bucket]["tied"]
        suffix = f"#s{stage}" if tied else ""
        nbytes = self._bucket_bytes(bucket)
        # The dp and tied reductions move the gradient in the plan's reduce dtype.
        reduced = buckets(self.graph)[bucket]["numel"] * self.plan.reduce_dtype_bytes
        last: list[str] = [use.backward for use in site.uses]
        axis, replicas = self._replicated_over(param)
        # ZeRO-2/3 keep only a shard of the gradient, so they reduce every microbatch.
        each_microbatch = self.zero >= 2 and replicas > 1
        sharded_grad = self.zero >= 1 and replicas > 1
        fixup = use.gradient_transfer() if self.tp > 1 and axis == Axis.DP_CP else None
        if fixup is not None and not fixup.is_transfer:
            fixup = None

        def step(kind: Kind, axis: Axis, size: float, per_microbatch: bool, reason: str,
                 **extra) -> None:
            nonlocal last
            node = self.transfer(f"G/{param.name}:{kind}@{axis}{suffix}", kind=kind,
                                 axis=axis, payload=Payload.GRAD, phase=Phase.BACKWARD,
                                 chunk=chunk, layer=param.layer, nbytes=size,
                                 repeat=self.m if per_microbatch else 1, reason=reason,
                                 stage=stage, per_microbatch=per_microbatch, bucket=bucket,
                                 **extra)
            for source in last:
                self.edge(source, node, port=Port.X)
            last = [node]

        # A slice's gradient is gathered, and a partial sum summed, over tp before the dp
        # reduction, at the same frequency: the sum then covers the bucket's leading range
        # (fuse lays the members that need it out first), whatever ZeRO shards later.
        if fixup is not None and fixup.kind == "all_gather":
            step(Kind.ALL_GATHER, Axis.TP, self._param_bytes(param, gradient_layout(
                site.storage)), each_microbatch,
                reasons.parameter_fixup(self.plan, param.name, fixup, use.data),
                tensor=param.name, dim=use.data.dim,
                slice_axis=use.dims.index(use.data.dim) if use.data.dim in use.dims else 0)
        if fixup is not None and fixup.kind == "all_reduce":
            step(Kind.ALL_REDUCE, Axis.TP, nbytes, each_microbatch,
                 reasons.parameter_fixup(self.plan, param.name, fixup, use.data),
                 elements=[0, buckets(self.graph)[bucket]["numel"]])
        # ZeRO-1 may sum the whole buffer and keep its shard of the sum (grad_reduce), as
        # DeepSpeed's pipeline engine does (_exec_reduce_grads)
        by_all_reduce = sharded_grad and self.zero == 1 and \
            self.plan.shard.dp.grad_reduce == "all_reduce"
        if replicas > 1:
            kind = Kind.ALL_REDUCE if self.zero == 0 or by_all_reduce else \
                Kind.REDUCE_SCATTER
            step(kind, axis, reduced, each_microbatch,
                 reasons.data_parallel(self.plan, param.name, kind.value, axis),
                 dtype=self.plan.reduce_dtype, **({"keeps_shard": True} if by_all_reduce
                                                  else {}))
        if tied:
            shard = self.replicas if sharded_grad else 1
            step(Kind.ALL_REDUCE, Axis.TIED, reduced / shard, False, reasons.tied(self.plan),
                 dtype=self.plan.reduce_dtype, collective=f"G/{param.name}:all_reduce@tied",
                 peer_stage=self.plan.head_stage if stage == 0 else 0)
        return last

    def _param_bytes(self, param: Parameter, storage: Layout) -> float:
        return param.numel * self.plan.model.dtype_bytes / (self.tp if storage.is_sharded else 1)

    def _optimizer(self, chunk: int, bucket: str, ready: list[str]) -> None:
        info = buckets(self.graph)[bucket]
        members = [m["param"] for m in info["members"]]
        layer = info["members"][0]["layer"]
        elements = info["padded"] // info["parts"]
        flops = elements * OPTIMIZER_FLOPS_PER_ELEMENT[self.plan.train.optimizer.name]
        node = self.compute(f"O/{bucket}/optimizer", op=Op.OPTIMIZER, phase=Phase.OPTIMIZER,
                            chunk=chunk, layer=layer, flops=flops,
                            nbytes=elements * self.plan.model.dtype_bytes, repeat=1,
                            params=members, sharded=info["sharded"], bucket=bucket,
                            per_microbatch=False)
        for source in ready:
            self.edge(source, node, port=Port.GRAD)
        if self.zero not in (1, 2) or not info["sharded"]:
            return
        axis = Axis(info.get("over", Axis.DP_CP.value))
        gather = self.transfer(f"O/{bucket}:all_gather@{axis}", kind=Kind.ALL_GATHER,
                               axis=axis, payload=Payload.PARAM, phase=Phase.OPTIMIZER,
                               chunk=chunk, layer=layer, nbytes=self._bucket_bytes(bucket),
                               repeat=1,
                               reason=reasons.zero_gather(self.plan, ", ".join(members), axis),
                               per_microbatch=False, bucket=bucket)
        self.edge(node, gather, port=Port.X)
