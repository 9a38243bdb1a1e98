"""Plan to communication graph: every compute step and transfer of one training step.

The graph is SPMD twice over. A node stands for the same operation on every group of
the tp, cp and dp axes (docs/semantics.md, the graph), and for the same operation on
every microbatch: ``repeat`` says how many times one rank runs it per step (the number
of microbatches for per-microbatch work, 1 for once-per-step work such as gradient
reductions), and the order of the microbatches on each stage is the pipeline schedule
in ``graph.graph["schedule"]``. Folding the microbatches keeps the graph of the
1T-parameter plan (128 layers x 512 microbatches) at thousands of nodes instead of
millions. Node and edge attributes follow :mod:`planc.graph.ir`.

Transfers come from four rules:
- tp: :mod:`planc.graph.tensor_parallel` fixes every activation's layout; wherever a
  producer's layout differs from its consumer's, :func:`planc.graph.sharding.redistribute`
  inserts a collective, forward on the activation and backward on its gradient (a
  local slice moves no data and is marked on the edge); replicated parameters applied
  to sharded data get their gradients fixed up.
- cp: K and V are all-gathered (reduce-scattered in backward), or passed around the cp
  ring (Liu et al. 2023, ring attention).
- pp: one send and one receive per microbatch, chunk boundary and direction.
- dp: gradients are reduced over dp x cp as the ZeRO stage says (Rajbhandari et al.
  2020); tied embeddings are summed between the first and the last stage (Megatron).

Every parameter gets a bucket of its own, with its reductions and its optimizer step
(:mod:`planc.graph.parameters`); :mod:`planc.passes.fuse` merges buckets.

The forward walk of each chunk returns a record of it (:mod:`planc.graph.walk_records`);
the backward walks, from the last chunk to the first, read those records and return
theirs, and the parameters' rules come last, over all of them. Every node and edge is
made through :class:`planc.graph.builder.GraphBuilder`, which the derivation, its axis
rules and its parameter rules share.
"""

from __future__ import annotations

from collections.abc import Mapping

import networkx as nx

from planc.estimate.model import forward_flops
from planc.graph import reasons
from planc.graph.axes import PHASE_OF, AxisRules
from planc.graph.builder import GraphBuilder
from planc.graph.grad_norm import add_grad_norm
from planc.graph.router_bias import add_router_bias
from planc.graph.ir import (
    GRAPH_FORMAT_VERSION,
    Axis,
    EdgeKind,
    Kind,
    Op,
    Payload,
    Phase,
    Port,
    buckets,
)
from planc.graph.kernels import kernel_attributes
from planc.graph.parameters import ParameterRules
from planc.graph.schedules import schedule_text
from planc.graph.sharding import Layout, S, gradient_layout
from planc.graph.tensor_parallel import FP32_BYTES, LOSS_REDUCTIONS, features_split_flops
from planc.graph.walk_records import (
    BackwardChunk,
    ForwardChunk,
    ForwardWalk,
    Held,
    Link,
    Step,
)
from planc.models import family_of
from planc.models.family import INPUT, LOSS_PART_FLOPS_PER_LOGIT
from planc.plan.plan import Plan

LOSS_PART_OP = {"max": Op.LOSS_MAX, "sum_exp": Op.LOSS_SUM_EXP}


class _Derivation(GraphBuilder):
    """The walks over the chunks, and the rules they call on."""

    def __init__(self, plan: Plan):
        super().__init__(plan)
        self.last_chunk = len(self.chunks) - 1
        self.zero = plan.shard.dp.zero
        self.recompute = plan.optimize.recompute
        self.family = family_of(plan)
        self.axes = AxisRules(self)
        self.parameters = ParameterRules(self)

    def _op_node(self, letter: str, chunk: int, layer: int | None, op: str,
                 forward_of: str | None = None) -> str:
        """A compute node: F (forward), B (backward) or R (recomputed forward, which like
        the backward names its forward step in ``forward_of``)."""
        layout = self.layout(op)
        flops = features_split_flops(op, self.shapes, self.tp, layout)
        if flops is None:
            flops = forward_flops(op, self.shapes) / (self.tp if layout.sharded else 1)
        extra = kernel_attributes(self.plan, self.family, self.shapes, op, layer, layout)
        if forward_of is not None:
            extra["forward_of"] = forward_of
        return self.compute(f"{self.prefix(letter, layer)}{op}", op=Op(op),
                            phase=PHASE_OF[letter], chunk=chunk, layer=layer,
                            flops=flops * (2 if letter == "B" else 1),
                            nbytes=self.local_bytes(self.family.output_tensor[op],
                                                    layout.output),
                            repeat=self.m, recompute=letter == "R", **extra)

    # --- forward ------------------------------------------------------------------------

    def _forward_step(self, walk: ForwardWalk, layer: int | None, op: str) -> str:
        node = self._op_node("F", walk.chunk, layer, op)
        walk.steps.append(Step(node, op, layer))
        return node

    def link(self, walk: ForwardWalk, u: str, v: str, *, layer: int | None,
             ops: tuple[str, str], source: Layout | None = None, tensor: str | None = None,
             port: Port = Port.X, within_layer: bool = True) -> None:
        """A forward data edge u -> v into v's input ``port``, with whatever transfers the
        layouts need; ``ops``: the (producer, consumer) operators."""
        producer_op, consumer_op = ops
        consumer = self.layout(consumer_op)
        source = source or self.layout(producer_op).output
        tensor = tensor or self.family.output_tensor[producer_op]
        # One value redistributed once, however many consumers read it (the embedding's
        # partial sum feeds both the first norm and the first residual).
        key = (u, str(source), str(consumer.input))
        carried = walk.carried.get(key) or self.axes.tp_transfer(
            u, letter="F", chunk=walk.chunk, layer=layer, tensor=tensor, source=source,
            target=consumer.input, ops=ops)
        walk.carried[key] = carried
        self.axes.connect(u, v, carried, port)  # with cp, the local queries and K/V block
        if (producer_op, consumer_op) == ("qkv", "attention") and self.cp > 1:
            self.axes.cp_forward("F", walk.chunk, layer, carried[0], v)
        walk.links.append(Link(u, v, tensor, source, consumer.input, consumer.grad_input,
                               layer, ops, port, within_layer and layer is not None))

    def _forward_chunk(self, chunk: int, entry: Held | None) -> ForwardChunk:
        """``entry``: what the chunk before hands on (None on chunk 0)."""
        walk = ForwardWalk(chunk)
        first, last = self.chunks[chunk]
        x = entry
        if chunk == 0:
            for op in self.family.embedding_ops:
                node = self._forward_step(walk, None, op)
                if x is not None:
                    self.link(walk, x.node, node, layer=None, ops=(x.op, op))
                x = Held(op, node)
        for layer in range(first, last + 1):
            x = self._forward_layer(walk, layer, x)
        output = next_entry = None
        if chunk == self.last_chunk:
            self._forward_head(walk, x)
        elif self._local(chunk, chunk + 1):  # no transfer: the next chunk reads x
            next_entry = x
        else:
            # A first chunk of the embedding alone sends the embedding's output as it is;
            # the next chunk's first layer redistributes it as it would on chunk 0.
            send, recv = self.axes.pipeline(Phase.FORWARD, chunk, chunk + 1,
                                            self.layout(x.op).output)
            self.edge(x.node, send, port=Port.X)
            self.axes.into_send(send)
            next_entry = Held(x.op, recv)
        if chunk != self.last_chunk:
            output = next(step for step in walk.steps if step.node == x.node)
        return ForwardChunk(chunk, tuple(walk.steps), tuple(walk.links), entry, output,
                            next_entry)

    def _forward_layer(self, walk: ForwardWalk, layer: int, x: Held) -> Held:
        """One block, wired as its family's links say; the block's input is the residual
        stream, whose layout the plan fixes."""
        ops, links = self.family.block(self.plan.model, layer)
        n = {op: self._forward_step(walk, layer, op) for op in ops}
        for producer, consumer, port in links:
            if producer == INPUT:
                # The residual stream, except straight after the embedding, whose own
                # layout (a partial sum when vocabulary-parallel) is redistributed here.
                source = self.layout(x.op).output if x.op in self.family.embedding_ops \
                    else self.tpp.stream
                self.link(walk, x.node, n[consumer], layer=layer, ops=(x.op, consumer),
                          source=source, tensor="stream", port=Port(port),
                          within_layer=False)
            else:
                self.link(walk, n[producer], n[consumer], layer=layer,
                          ops=(producer, consumer), port=Port(port))
        output = self.family.layer_output
        return Held(output, n[output])

    def _forward_head(self, walk: ForwardWalk, x: Held) -> None:
        chunk = walk.chunk
        final = self._forward_step(walk, None, "final_ln")
        head = self._forward_step(walk, None, "head")
        loss = self._forward_step(walk, None, "loss")
        self.link(walk, x.node, final, layer=None, ops=(x.op, "final_ln"),
                  source=self.tpp.stream, tensor="stream")
        self.link(walk, final, head, layer=None, ops=("final_ln", "head"))
        if self.layout("loss").input == S("vocab") and self.tp > 1:
            # Vocabulary-parallel cross-entropy (Megatron): a max and a sum of exponentials
            # over the vocabulary, each an all-reduce of one fp32 number per token.
            # The local parts read the logits (and the reduced max); the loss reads all.
            reduced: dict[Port, str] = {}
            for part in LOSS_REDUCTIONS:
                port = Port(part)
                local = self.compute(f"F/loss_{part}", op=LOSS_PART_OP[part],
                                     phase=Phase.FORWARD, chunk=chunk, layer=None,
                                     flops=self.shapes.elements("logits") *
                                     LOSS_PART_FLOPS_PER_LOGIT / self.tp,
                                     nbytes=self.shapes.elements("tokens") * FP32_BYTES,
                                     repeat=self.m, tp_input="S(vocab)", tp_output="P",
                                     params=[])
                reduce = self.transfer(f"F/loss_{part}:all_reduce@tp", kind=Kind.ALL_REDUCE,
                                       axis=Axis.TP, payload=Payload.LOSS_STAT,
                                       phase=Phase.FORWARD, chunk=chunk, layer=None,
                                       nbytes=self.shapes.elements("tokens") * FP32_BYTES,
                                       repeat=self.m,
                                       reason=reasons.vocab_loss(self.plan, part), dtype="fp32",
                                       tensor=f"loss_{part}", source_layout="P",
                                       target_layout="R",
                                       reduce_op="max" if part == "max" else "sum")
                self.edge(head, local, port=Port.X)
                for name, node in reduced.items():
                    self.edge(node, local, port=name)
                self.edge(local, reduce, port=Port.X)
                self.edge(reduce, loss, port=port)
                reduced[port] = reduce
        self.link(walk, head, loss, layer=None, ops=("head", "loss"))
        report = self.transfer("F/loss:all_reduce@stage", kind=Kind.ALL_REDUCE,
                               axis=Axis.STAGE, payload=Payload.LOSS, phase=Phase.FORWARD,
                               chunk=chunk, layer=None, nbytes=FP32_BYTES, repeat=1,
                               reason=reasons.loss_report(self.plan), dtype="fp32",
                               tensor="loss", per_microbatch=False)
        self.edge(loss, report, port=Port.X)

    # --- backward -----------------------------------------------------------------------

    def _backward_chunk(self, forward: ForwardChunk, before: ForwardChunk | None,
                        after: BackwardChunk | None) -> BackwardChunk:
        """The backward walk of one chunk, from its forward walk; ``before``: the forward
        walk of the chunk before (None on chunk 0); ``after``: the backward walk of the
        chunk after (None on the last)."""
        chunk = forward.chunk
        early = after.early_backward if after is not None else None
        backward = {}  # forward node -> the node that receives its output's gradient
        for step in forward.steps:
            made_early = early is not None and step.node == forward.output.node
            backward[step.node] = early if made_early else self._backward_of(chunk, step)
        if after is not None and after.gradient_receive is not None:
            self.edge(after.gradient_receive, backward[forward.output.node], port=Port.GRAD)
        backward_of = {step.node: backward[step.node] for step in forward.steps}
        send = receive = made_for_before = None
        if before is not None and self._local(chunk - 1, chunk):
            made_for_before = self._backward_of(chunk - 1, before.output)
            backward[before.output.node] = made_for_before
        elif before is not None:
            send, receive = self.axes.pipeline(Phase.BACKWARD, chunk, chunk - 1,
                                               self.layout(forward.entry.op).output)
            backward[forward.entry.node] = send
        first, last = self.chunks[chunk]
        by_layer: dict[int, list[Link]] = {}
        for link in forward.links:
            if link.within_layer:
                by_layer.setdefault(link.layer, []).append(link)
        recomputed = {layer: self._recompute_layer(forward, layer, by_layer.get(layer, []),
                                                   backward)
                      for layer in range(first, last + 1)}
        for link in reversed(forward.links):
            self._backward_link(chunk, link, backward)
        if self.plan.regathers_gemm_inputs:
            self._regathers(forward, backward)
        if send is not None:
            self.axes.into_send(send)
        for layer in range(first, last + 1):
            self._recompute_just_in_time(forward, layer, backward, recomputed[layer])
        return BackwardChunk(backward_of, gradient_receive=receive,
                             early_backward=made_for_before)

    def _regathers(self, forward: ForwardChunk, backward: Mapping[str, str]) -> None:
        """shard { tp { gathered_inputs = regather } }: each GEMM that differentiates its
        own forward (not a recomputation) gets its gathered input again (AxisRules.regather)."""
        for link in forward.links:
            if self.graph.nodes[link.consumer].get("recomputed"):
                continue
            for gather, _, edge in list(self.graph.in_edges(link.consumer, data=True)):
                if edge.get("port") == link.port and \
                        self.graph.nodes[gather].get("producer") == link.ops[0]:
                    self.axes.regather(gather, link.producer, backward[link.consumer])

    def _local(self, chunk: int, other: int) -> bool:
        """Whether two chunks share a stage (then nothing travels between them)."""
        return self.stage_of[chunk] == self.stage_of[other]

    def _backward_of(self, chunk: int, step: Step) -> str:
        b = self._op_node("B", chunk, step.layer, step.op, forward_of=step.node)
        self.edge(step.node, b, kind=EdgeKind.SAVED)
        return b

    def _recompute_just_in_time(self, forward: ForwardChunk, layer: int,
                                backward: Mapping[str, str],
                                recomputed: Mapping[str, str]) -> None:
        """A recomputation starts once the gradient it is recomputed for is on its way
        (order edges from whatever feeds that gradient), not at the start of the
        backward: else every layer would be recomputed at once and held.
        ``recomputed``: the layer's recomputed steps by operator."""
        if self.recompute == "none":
            return
        op, first = ("attention", "attention") if self.recompute == "selective" else \
            ("attention", self.family.layer_ops[0]) if self.recompute == "attention_inputs" \
            else (self.family.layer_output, self.family.layer_ops[0])
        gradient_of = backward[forward.node(layer, op)]
        for source, _, data in list(self.graph.in_edges(gradient_of, data=True)):
            if data.get("port") == Port.GRAD:
                self.edge(source, recomputed[first], kind=EdgeKind.ORDER)

    def _backward_link(self, chunk: int, link: Link, backward: dict[str, str]) -> None:
        """Gradient of a forward edge: consumer's backward -> producer's backward."""
        grad_from, grad_to = backward[link.consumer], backward[link.producer]
        target = gradient_layout(link.source)
        ops = (link.ops[1], link.ops[0])
        layer = link.layer
        ring = self.plan.shard.cp.attention == "ring"
        if link.ops != ("qkv", "attention") or self.cp == 1 or ring:
            # (ring attention's own K/V gradients come home inside its backward step)
            if ring and link.ops == ("qkv", "attention") and self.cp > 1:
                self.axes.ring_attention(grad_from, forward=False)
            carried = self.axes.tp_transfer(grad_from, letter="B", chunk=chunk, layer=layer,
                                            tensor=link.tensor, source=link.grad,
                                            target=target, ops=ops, backward=True)
            self.axes.connect(grad_from, grad_to, carried, Port.GRAD, grad_of=link.port)
            return
        # K and V gradients come back over cp; the query gradient is local.
        kv = self.transfer(f"B/L{layer}/dkv:reduce_scatter@cp", kind=Kind.REDUCE_SCATTER,
                           axis=Axis.CP, payload=Payload.DKV, phase=Phase.BACKWARD,
                           chunk=chunk, layer=layer, nbytes=self.axes.kv_bytes() * self.cp,
                           repeat=self.m, reason=reasons.context_allgather(self.plan, True),
                           tensor="dkv", dim="seq")
        self.edge(grad_from, kv, port=Port.X, grad_of=Port.KV)
        # The gradients of this rank's K and V (from kv) and of its queries (straight
        # from attention) meet, through the tp redistribution if there is one.
        carrier, local = self.axes.tp_transfer(kv, letter="B", chunk=chunk, layer=layer,
                                               tensor=link.tensor, source=link.grad,
                                               target=target, ops=ops, backward=True)
        if carrier == kv:
            self.edge(kv, grad_to, port=Port.GRAD, local_slice=local)
            self.edge(grad_from, grad_to, port=Port.GRAD, grad_of=Port.X, local_slice=local)
        else:
            self.edge(grad_from, carrier, port=Port.X, grad_of=Port.X)
            self.edge(kv, carrier, port=Port.X)
            self.edge(carrier, grad_to, port=Port.GRAD)

    def _recompute_layer(self, forward: ForwardChunk, layer: int, links: list[Link],
                         backward: Mapping[str, str]) -> dict[str, str]:
        """The layer's recomputed steps, by operator (none without recomputation)."""
        chunk = forward.chunk
        if self.recompute == "selective":
            attention = forward.node(layer, "attention")
            again = self._op_node("R", chunk, layer, "attention", forward_of=attention)
            if self.cp > 1 and self.plan.shard.cp.attention == "ring":
                self.axes.ring_attention(again, forward=True)  # its blocks travel again
            self.edge(attention, again, kind=EdgeKind.SAVED)
            self.edge(again, backward[attention], kind=EdgeKind.SAVED)
            self._recomputed_by(attention, backward[attention], again)
            return {"attention": again}
        if self.recompute not in ("full", "attention_inputs"):
            return {}
        # Full recomputation runs the layer's forward again from its checkpointed input,
        # transfers included, just before its backward; attention_inputs runs its
        # operators up to the attention core (the norm, qkv, attention) again from the
        # same input, so that only the attention's output is kept of them (DeepSeek-V3's
        # recomputation of its norms and MLA's up-projections, arXiv 2412.19437,
        # section 3.2.3).
        ops, block_links = self.family.block(self.plan.model, layer)
        if self.recompute == "attention_inputs":
            ops = ops[:ops.index("attention") + 1]
        nodes = {op: self._op_node("R", chunk, layer, op, forward_of=forward.node(layer, op))
                 for op in ops}
        for producer, consumer, _port in block_links:
            if producer == INPUT and consumer in nodes:  # reads the checkpointed input
                self.edge(forward.node(layer, consumer), nodes[consumer],
                          kind=EdgeKind.SAVED)
        for link in links:
            producer, consumer = link.ops
            if producer not in nodes or consumer not in nodes:
                continue
            u, v = nodes[producer], nodes[consumer]
            carried = self.axes.tp_transfer(u, letter="R", chunk=chunk, layer=layer,
                                            tensor=link.tensor, source=link.source,
                                            target=link.target, ops=link.ops)
            self.axes.connect(u, v, carried, link.port)
            if link.ops == ("qkv", "attention") and self.cp > 1:
                self.axes.cp_forward("R", chunk, layer, carried[0], v)
        for op in ops:
            step = forward.node(layer, op)
            self.edge(nodes[op], backward[step], kind=EdgeKind.SAVED)
            self._recomputed_by(step, backward[step], nodes[op])
        return nodes

    def _recomputed_by(self, forward: str, backward: str, again: str) -> None:
        """The backward step differentiates the recomputed forward; the original forward
        keeps only its inputs."""
        self.graph.nodes[backward]["recompute_of"] = again
        self.graph.nodes[forward]["recomputed"] = True

    # --- the whole step ---------------------------------------------------------------------

    def derive(self) -> nx.DiGraph:
        forward: list[ForwardChunk] = []
        for chunk in range(len(self.chunks)):
            forward.append(self._forward_chunk(chunk, forward[-1].next_entry if forward
                                               else None))
        backward_of: dict[str, str] = {}  # every forward step -> its backward step
        after = None
        for chunk in reversed(range(len(self.chunks))):
            before = forward[chunk - 1] if chunk > 0 else None
            after = self._backward_chunk(forward[chunk], before, after)
            backward_of.update(after.backward_of)
        for chunk in range(len(self.chunks)):
            self.parameters.add(chunk, forward, backward_of)
        self.graph.graph.update(self._attributes())
        return self.graph

    def _attributes(self) -> dict:
        plan, virtual = self.plan, self.plan.shard.pp.virtual
        return {
            "format": "planc-graph", "version": GRAPH_FORMAT_VERSION, "plan": plan.name,
            "family": plan.model.family,
            "sizes": plan.mesh.sizes,
            "microbatches": self.m, "microbatch_size": plan.microbatch_size,
            "pipeline": plan.schedule.pipeline, "virtual": virtual,
            "chunks": [list(c) for c in self.chunks], "dtype": plan.model.dtype,
            "zero": self.zero, "recompute": self.recompute,
            "stream_layout": str(self.tpp.stream),
            "pp_scatter_gather": self.axes.scatter_gather_decision(),
            "layouts": {op: {"input": str(o.input), "output": str(o.output),
                             "grad_input": str(o.grad_input), "sharded": o.sharded}
                        for op, o in self.tpp.ops.items()},
            "schedule": {str(stage): schedule_text(plan.schedule.pipeline, stage, self.pp,
                                                   self.m, virtual)
                         for stage in range(self.pp)},
            "buckets": buckets(self.graph),
            "passes": [],
        }


def derive(plan: Plan) -> nx.DiGraph:
    """The raw communication graph of one training step of ``plan``."""
    return add_router_bias(plan, add_grad_norm(plan, _Derivation(plan).derive()))
