"""Plan to communication graph: every compute step and transfer of one training step.

The graph is SPMD twice over. A node stands for the same operation on every group of
the tp, cp and dp axes (semantics.md section 3), and for the same operation on every
microbatch: ``repeat`` says how many times one rank runs it per step (the number of
microbatches for per-microbatch work, 1 for once-per-step work such as gradient
reductions), and the order of the microbatches on each stage is the pipeline schedule
in ``graph.graph["schedule"]``. Folding the microbatches keeps the graph of the
1T-parameter plan (128 layers x 512 microbatches) at thousands of nodes instead of
millions; :func:`planc.graph.expand.expand` unfolds any part of it.

Transfers come from four rules, each of semantics.md:
- tp: :mod:`planc.graph.tensor_parallel` fixes every activation's layout; wherever a
  producer's layout differs from its consumer's, :func:`planc.graph.layouts.redistribute`
  inserts a collective, forward on the activation and backward on its gradient;
  replicated parameters applied to sharded data get their gradients fixed up.
- cp: K and V are all-gathered (reduce-scattered in backward), or passed around the cp
  ring (Liu et al. 2023, ring attention).
- pp: one send and one receive per microbatch, chunk boundary and direction.
- dp: gradients are reduced over dp x cp as the ZeRO stage says (Rajbhandari et al.
  2020); tied embeddings are summed between the first and the last stage (Megatron).
"""

from __future__ import annotations

from dataclasses import dataclass

import networkx as nx

from planc.graph import reasons
from planc.graph.layouts import Layout, S, gradient_layout, redistribute
from planc.graph.model import (LAYER_OPS, OP_KIND, OUTPUT_TENSOR, Parameter, Shapes,
                               all_parameters, forward_flops)
from planc.graph.schedules import action_text, schedule
from planc.graph.tensor_parallel import (FP32_BYTES, LOSS_REDUCTIONS, OpLayout, ParamUse,
                                         plan_tensor_parallel)
from planc.plan import Plan

GRAPH_FORMAT_VERSION = 1
OPTIMIZER_FLOPS_PER_ELEMENT = {"adamw": 12, "sgd": 3}
GLOBAL_PARAMETERS = ("embedding.weight", "position.weight", "head.weight",
                     "final_ln.weight", "final_ln.bias")


@dataclass(frozen=True)
class _Link:
    """A forward data edge, remembered to derive its backward twin."""

    producer: str  # node id: a compute node, or the pipeline receive that starts a chunk
    consumer: str
    tensor: str
    source: Layout  # producer's output layout over tp
    target: Layout  # consumer's input layout over tp
    grad: Layout  # layout of the gradient the consumer returns for this input
    layer: int | None
    ops: tuple[str, str]  # (producer, consumer) operator names
    port: str = "x"  # the consumer's input


@dataclass(frozen=True)
class _Site:
    """A parameter as the operators of one chunk use it."""

    param: Parameter
    group: str  # optimizer group: "L3", "embedding" or "head"
    uses: tuple[tuple[str, ParamUse], ...]  # (forward node, use)


class _Derivation:
    def __init__(self, plan: Plan):
        self.plan = plan
        self.graph = nx.DiGraph()
        self.tpp = plan_tensor_parallel(plan)
        self.shapes = Shapes.of(plan)
        self.m = plan.schedule.microbatches
        self.tp, self.cp, self.pp = plan.mesh.tp, plan.mesh.cp, plan.mesh.pp
        self.replicas = plan.mesh.dp * plan.mesh.cp
        self.chunks = plan.shard.pp.chunks
        self.last_chunk = len(self.chunks) - 1
        self.zero = plan.shard.dp.zero
        self.recompute = plan.optimize.recompute
        self.params = {p.name: p for p in all_parameters(plan)}
        self.links: dict[int, list[_Link]] = {c: [] for c in range(len(self.chunks))}
        self.forward_ops: dict[int, list[tuple[str, str, int | None]]] = {
            c: [] for c in range(len(self.chunks))}
        self.chunk_output: dict[int, str] = {}

    # --- nodes and edges ----------------------------------------------------------------

    def _node(self, node_id: str, per_microbatch: bool = True, **attrs) -> str:
        """``per_microbatch``: runs ``repeat / microbatches`` times for each microbatch;
        otherwise ``repeat`` times per step."""
        assert node_id not in self.graph, f"duplicate node {node_id}"
        self.graph.add_node(node_id, microbatch=None, per_microbatch=per_microbatch, **attrs)
        return node_id

    def compute(self, node_id: str, op: str, phase: str, chunk: int, layer: int | None,
                flops: float, nbytes: float, repeat: int, **extra) -> str:
        return self._node(node_id, type="compute", op=OP_KIND.get(op, op), name=op,
                          phase=phase, stage=chunk % self.pp, chunk=chunk, layer=layer,
                          repeat=repeat, flops=float(flops), bytes=int(nbytes), **extra)

    def transfer(self, node_id: str, kind: str, axis: str, phase: str, chunk: int,
                 layer: int | None, nbytes: float, repeat: int, reason: str,
                 stage: int | None = None, dtype: str | None = None, **extra) -> str:
        return self._node(node_id, type="transfer", kind=kind, axis=axis,
                          group_size=self._group_size(axis), phase=phase,
                          stage=chunk % self.pp if stage is None else stage, chunk=chunk,
                          layer=layer, repeat=repeat, bytes=int(round(nbytes)),
                          dtype=dtype or self.plan.model.dtype, reason=reason, **extra)

    def _group_size(self, axis: str) -> int:
        return {"tp": self.tp, "cp": self.cp, "pp": 2, "dp_cp": self.replicas, "tied": 2,
                "stage": self.tp * self.replicas}[axis]

    def edge(self, u: str, v: str, kind: str = "data", port: str | None = None,
             grad_of: str | None = None) -> None:
        """``port``: the input of v this edge feeds (x, skip, kv, max, sum_exp, grad);
        ``grad_of``: on an edge out of a backward node, whose gradient it carries (the
        forward input's port)."""
        attrs = {"kind": kind}
        if port is not None:
            attrs["port"] = port
        if grad_of is not None:
            attrs["grad_of"] = grad_of
        self.graph.add_edge(u, v, **attrs)

    def layout(self, op: str) -> OpLayout:
        return self.tpp.ops[op]

    @staticmethod
    def _prefix(letter: str, layer: int | None) -> str:
        return f"{letter}/L{layer}/" if layer is not None else f"{letter}/"

    def _op_node(self, letter: str, chunk: int, layer: int | None, op: str) -> str:
        """A compute node: F (forward), B (backward) or R (recomputed forward)."""
        layout = self.layout(op)
        flops = forward_flops(op, self.shapes) / (self.tp if layout.sharded else 1)
        phase = "forward" if letter == "F" else "backward"
        params = [self._param_name(u.name, layer) for u in layout.params]
        node = self.compute(f"{self._prefix(letter, layer)}{op}", op, phase, chunk, layer,
                            flops * (2 if letter == "B" else 1),
                            self._local_bytes(OUTPUT_TENSOR[op], layout.output), self.m,
                            recompute=letter == "R", tp_input=str(layout.input),
                            tp_output=str(layout.output), params=params)
        if letter == "F":
            self.forward_ops[chunk].append((node, op, layer))
        return node

    def _local_bytes(self, tensor: str, layout: Layout) -> float:
        return self.shapes.bytes(tensor) / (self.tp if layout.is_sharded else 1)

    @staticmethod
    def _param_name(name: str, layer: int | None) -> str:
        return name if layer is None or name in GLOBAL_PARAMETERS else f"layers.{layer}.{name}"

    # --- tp, cp and pp transfers ------------------------------------------------------

    def _tp(self, letter: str, chunk: int, layer: int | None, tensor: str, source: Layout,
            target: Layout, ops: tuple[str, str], u: str, backward: bool = False,
            grad_of: str | None = None) -> str:
        """Insert the tp transfer from ``source`` to ``target`` after ``u``; return the
        node that now carries the tensor (``u`` itself when no transfer is needed)."""
        move = redistribute(source, target)
        if move is None or not move.is_transfer or self.tp == 1:
            return u
        node = self.transfer(
            f"{self._prefix(letter, layer)}{ops[0]}>{ops[1]}:{move.kind}@tp", move.kind, "tp",
            "forward" if letter == "F" else "backward", chunk, layer,
            self.shapes.bytes(tensor) * move.buffer_fraction(self.tp), self.m,
            reasons.tensor_parallel(self.plan, self.tpp, ops, move, backward, letter == "R"),
            tensor=tensor, dim=move.dim, source_layout=str(move.source),
            target_layout=str(move.target), producer=ops[0], consumer=ops[1])
        self.edge(u, node, port="x", grad_of=grad_of)
        return node

    def _kv_bytes(self) -> float:
        """This rank's K and V for one microbatch: local tokens, local heads."""
        heads_sharded = self.layout("attention").input.is_sharded and self.tp > 1
        return self.shapes.bytes("kv") / (self.tp if heads_sharded else 1)

    def _cp_forward(self, letter: str, chunk: int, layer: int, source: str, attention: str):
        """K and V over cp, between the (tp-redistributed) qkv and attention."""
        phase = "forward" if letter == "F" else "backward"
        if self.plan.shard.cp.attention == "allgather":
            node = self.transfer(f"{letter}/L{layer}/kv:all_gather@cp", "all_gather", "cp",
                                 phase, chunk, layer, self._kv_bytes() * self.cp, self.m,
                                 reasons.context_allgather(self.plan, False, letter == "R"),
                                 tensor="kv", dim="seq")
            self.edge(source, node, port="x")
        else:
            node = self._ring(letter, chunk, layer, "kv", self.cp - 1, source)
        self.edge(node, attention, port="kv")

    def _ring(self, letter: str, chunk: int, layer: int, tensor: str, steps: int,
              source: str, grad_of: str | None = None) -> str:
        """One ring shift over cp (a send to the next rank, a receive from the previous),
        run ``steps`` times; returns the receive."""
        phase = "forward" if letter == "F" else "backward"
        reason = reasons.context_ring(self.plan, tensor)
        send = self.transfer(f"{letter}/L{layer}/{tensor}:send@cp", "send", "cp", phase, chunk,
                             layer, self._kv_bytes(), self.m * steps, reason, tensor=tensor,
                             ring_steps=steps, peer="next")
        recv = self.transfer(f"{letter}/L{layer}/{tensor}:recv@cp", "recv", "cp", phase, chunk,
                             layer, self._kv_bytes(), self.m * steps, reason, tensor=tensor,
                             ring_steps=steps, peer="prev")
        self.edge(source, send, port="x", grad_of=grad_of)
        self.edge(send, recv, port="x")
        return recv

    def _pipeline(self, phase: str, source_chunk: int, target_chunk: int) -> tuple[str, str]:
        letter = phase[0].upper()
        nbytes = self._local_bytes("stream", self.tpp.stream)
        reason = reasons.pipeline(self.plan, phase, source_chunk, target_chunk)
        name = f"{letter}/c{source_chunk}>c{target_chunk}"
        send = self.transfer(f"{name}:send@pp", "send", "pp", phase, source_chunk, None, nbytes,
                             self.m, reason, tensor="stream", peer_stage=target_chunk % self.pp)
        recv = self.transfer(f"{name}:recv@pp", "recv", "pp", phase, target_chunk, None, nbytes,
                             self.m, reason, tensor="stream", peer_stage=source_chunk % self.pp)
        self.edge(send, recv)
        return send, recv

    # --- forward ------------------------------------------------------------------------

    def link(self, chunk: int, layer: int | None, producer_op: str, u: str, consumer_op: str,
             v: str, source: Layout | None = None, tensor: str | None = None,
             port: str = "x") -> None:
        """A forward data edge u -> v into v's input ``port``, with whatever transfers the
        layouts need."""
        consumer = self.layout(consumer_op)
        source = source or self.layout(producer_op).output
        tensor = tensor or OUTPUT_TENSOR[producer_op]
        carrier = self._tp("F", chunk, layer, tensor, source, consumer.input,
                           (producer_op, consumer_op), u)
        self.edge(carrier, v, port=port)  # with cp, the local queries and K/V block
        if (producer_op, consumer_op) == ("qkv", "attention") and self.cp > 1:
            self._cp_forward("F", chunk, layer, carrier, v)
        self.links[chunk].append(_Link(u, v, tensor, source, consumer.input,
                                       consumer.grad_input, layer, (producer_op, consumer_op),
                                       port))

    def _forward_chunk(self, chunk: int) -> None:
        first, last = self.chunks[chunk]
        if chunk == 0:
            embedding = self._op_node("F", chunk, None, "embedding")
            position = self._op_node("F", chunk, None, "position")
            self.link(chunk, None, "embedding", embedding, "position", position)
            x = ("position", position)
        else:
            x = ("mlp_residual", self.chunk_input[chunk])
        for layer in range(first, last + 1):
            x = self._forward_layer(chunk, layer, x)
        if chunk == self.last_chunk:
            self._forward_head(chunk, x)
        else:
            send, recv = self._pipeline("forward", chunk, chunk + 1)
            self.edge(x[1], send, port="x")
            self.chunk_input[chunk + 1] = recv
            self.chunk_output[chunk] = x[1]

    def _forward_layer(self, chunk: int, layer: int, x: tuple[str, str]) -> tuple[str, str]:
        n = {op: self._op_node("F", chunk, layer, op) for op in LAYER_OPS}
        x_op, x_node = x
        stream = self.tpp.stream
        self.link(chunk, layer, x_op, x_node, "ln1", n["ln1"], source=stream, tensor="stream")
        for producer, consumer in (("ln1", "qkv"), ("qkv", "attention"), ("attention", "proj"),
                                   ("proj", "attn_residual")):
            self.link(chunk, layer, producer, n[producer], consumer, n[consumer])
        self.link(chunk, layer, x_op, x_node, "attn_residual", n["attn_residual"],
                  source=stream, tensor="stream", port="skip")  # the residual connection
        for producer, consumer in (("attn_residual", "ln2"), ("ln2", "fc1"), ("fc1", "gelu"),
                                   ("gelu", "fc2"), ("fc2", "mlp_residual")):
            self.link(chunk, layer, producer, n[producer], consumer, n[consumer])
        self.link(chunk, layer, "attn_residual", n["attn_residual"], "mlp_residual",
                  n["mlp_residual"], port="skip")
        return "mlp_residual", n["mlp_residual"]

    def _forward_head(self, chunk: int, x: tuple[str, str]) -> None:
        final = self._op_node("F", chunk, None, "final_ln")
        head = self._op_node("F", chunk, None, "head")
        loss = self._op_node("F", chunk, None, "loss")
        x_op, x_node = x
        self.link(chunk, None, x_op, x_node, "final_ln", final, source=self.tpp.stream,
                  tensor="stream")
        self.link(chunk, None, "final_ln", final, "head", head)
        if self.layout("loss").input == S("vocab") and self.tp > 1:
            # Vocabulary-parallel cross-entropy (Megatron): a max and a sum of exponentials
            # over the vocabulary, each an all-reduce of one fp32 number per token.
            # The local parts read the logits (and the reduced max); the loss reads all.
            reduced: dict[str, str] = {}
            for part in LOSS_REDUCTIONS:
                local = self.compute(f"F/loss_{part}", "loss", "forward", chunk, None,
                                     self.shapes.elements("logits") * 2 / self.tp,
                                     self.shapes.elements("tokens") * FP32_BYTES, self.m,
                                     part=part, recompute=False, tp_input="S(vocab)",
                                     tp_output="P", params=[])
                reduce = self.transfer(f"F/loss_{part}:all_reduce@tp", "all_reduce", "tp",
                                       "forward", chunk, None,
                                       self.shapes.elements("tokens") * FP32_BYTES, self.m,
                                       reasons.vocab_loss(self.plan, part), dtype="fp32",
                                       tensor=f"loss_{part}", source_layout="P",
                                       target_layout="R",
                                       reduce_op="max" if part == "max" else "sum")
                self.edge(head, local, port="x")
                for name, node in reduced.items():
                    self.edge(node, local, port=name)
                self.edge(local, reduce, port="x")
                self.edge(reduce, loss, port=part)
                reduced[part] = reduce
        self.link(chunk, None, "head", head, "loss", loss)
        report = self.transfer("F/loss:all_reduce@stage", "all_reduce", "stage", "forward",
                               chunk, None, FP32_BYTES, 1, reasons.loss_report(self.plan),
                               dtype="fp32", tensor="loss", per_microbatch=False)
        self.edge(loss, report, port="x")

    # --- backward -----------------------------------------------------------------------

    def _backward_chunk(self, chunk: int) -> None:
        backward = {}  # forward node -> the node that receives its output's gradient
        for node, op, layer in self.forward_ops[chunk]:
            b = self._op_node("B", chunk, layer, op)
            self.edge(node, b, "saved")
            backward[node] = b
        if chunk != self.last_chunk:  # the pair was made with the next chunk's backward
            self.edge(self.gradient_input[chunk], backward[self.chunk_output[chunk]],
                      port="grad")
        if chunk > 0:
            send, self.gradient_input[chunk - 1] = self._pipeline("backward", chunk, chunk - 1)
            backward[self.chunk_input[chunk]] = send
        first, last = self.chunks[chunk]
        for layer in range(first, last + 1):
            self._recompute_layer(chunk, layer)
        for link in reversed(self.links[chunk]):
            self._backward_link(chunk, link, backward)

    def _backward_link(self, chunk: int, link: _Link, backward: dict[str, str]) -> None:
        """Gradient of a forward edge: consumer's backward -> producer's backward."""
        grad_from, grad_to = backward[link.consumer], backward[link.producer]
        target = gradient_layout(link.source)
        ops = (link.ops[1], link.ops[0])
        layer = link.layer
        port = link.port
        if link.ops != ("qkv", "attention") or self.cp == 1:
            carrier = self._tp("B", chunk, layer, link.tensor, link.grad, target, ops,
                               grad_from, backward=True, grad_of=port)
            if carrier == grad_from:
                self.edge(grad_from, grad_to, port="grad", grad_of=port)
            else:
                self.edge(carrier, grad_to, port="grad")
            return
        # K and V gradients come back over cp; the query gradient is local.
        if self.plan.shard.cp.attention == "allgather":
            kv = self.transfer(f"B/L{layer}/dkv:reduce_scatter@cp", "reduce_scatter", "cp",
                               "backward", chunk, layer, self._kv_bytes() * self.cp, self.m,
                               reasons.context_allgather(self.plan, True), tensor="dkv",
                               dim="seq")
            self.edge(grad_from, kv, port="x", grad_of="kv")
        else:
            # Ring backward, as TransformerEngine does it: the K/V blocks go around the
            # ring again, and each block's dK/dV accumulator travels with it, then home.
            kv_source = link.producer
            self.edge(self._ring("B", chunk, layer, "kv", self.cp - 1, kv_source), grad_from,
                      port="kv")
            kv = self._ring("B", chunk, layer, "dkv", self.cp, grad_from, grad_of="kv")
        # The gradients of this rank's K and V (from kv) and of its queries (straight
        # from attention) meet, through the tp redistribution if there is one.
        carrier = self._tp("B", chunk, layer, link.tensor, link.grad, target, ops, kv,
                           backward=True)
        if carrier == kv:
            self.edge(kv, grad_to, port="grad")
            self.edge(grad_from, grad_to, port="grad", grad_of="x")
        else:
            self.edge(grad_from, carrier, port="x", grad_of="x")
            self.edge(carrier, grad_to, port="grad")

    def _recompute_layer(self, chunk: int, layer: int) -> None:
        if self.recompute == "selective":
            again = self._op_node("R", chunk, layer, "attention")
            self.edge(f"F/L{layer}/attention", again, "saved")
            self.edge(again, f"B/L{layer}/attention", "saved")
            return
        if self.recompute != "full":
            return
        # Full recomputation runs the layer's forward again from its checkpointed input,
        # transfers included, just before its backward.
        nodes = {op: self._op_node("R", chunk, layer, op) for op in LAYER_OPS}
        self.edge(f"F/L{layer}/ln1", nodes["ln1"], "saved")
        self.edge(f"F/L{layer}/attn_residual", nodes["attn_residual"], "saved")
        for link in self.links[chunk]:
            if link.layer != layer or link.producer.split("/")[1] != f"L{layer}":
                continue
            producer, consumer = link.ops
            u, v = nodes[producer], nodes[consumer]
            carrier = self._tp("R", chunk, layer, link.tensor, link.source, link.target,
                               link.ops, u)
            self.edge(carrier, v, port=link.port)
            if link.ops == ("qkv", "attention") and self.cp > 1:
                self._cp_forward("R", chunk, layer, carrier, v)
        for op in LAYER_OPS:
            self.edge(nodes[op], f"B/L{layer}/{op}", "saved")

    # --- parameters ---------------------------------------------------------------------

    def _sites(self, chunk: int) -> list[_Site]:
        sites: dict[str, tuple[Parameter, str, list]] = {}
        for node, op, layer in self.forward_ops[chunk]:
            for use in self.layout(op).params:
                name = self._param_name(use.name, layer)
                group = (f"L{layer}" if layer is not None else
                         "embedding" if op in ("embedding", "position") else "head")
                entry = sites.setdefault(name, (self.params[name], group, []))
                entry[2].append((node, use))
        return [_Site(param, group, tuple(uses)) for param, group, uses in sites.values()]

    def _param_bytes(self, param: Parameter, storage: Layout) -> float:
        elements = 1
        for size in param.shape:
            elements *= size
        return elements * self.plan.model.dtype_bytes / (self.tp if storage.is_sharded else 1)

    def _parameters(self, chunk: int) -> None:
        groups: dict[str, list[str]] = {}
        for site in self._sites(chunk):
            if self.zero == 3 and self.replicas > 1:
                self._zero3_gathers(chunk, site)
            groups.setdefault(site.group, []).extend(self._gradient(chunk, site))
        for group, ready in groups.items():
            self._optimizer(chunk, group, ready,
                            [s for s in self._sites(chunk) if s.group == group])

    def _zero3_gathers(self, chunk: int, site: _Site) -> None:
        param = site.param
        storage = site.uses[0][1].storage
        for node, _use in site.uses:
            op = self.graph.nodes[node]["name"]
            for letter, phase in (("F", "forward"), ("B", "backward")):
                consumer = node.replace("F/", f"{letter}/", 1)
                gather = self.transfer(f"{letter}/{param.name}>{op}:all_gather@dp_cp",
                                       "all_gather", "dp_cp", phase, chunk, param.layer,
                                       self._param_bytes(param, storage), self.m,
                                       reasons.zero3_gather(self.plan, param.name, phase),
                                       tensor=param.name)
                self.edge(gather, consumer, port="param")
                recomputed = node.replace("F/", "R/", 1)
                if letter == "B" and recomputed in self.graph:
                    self.edge(gather, recomputed, port="param")

    def _gradient(self, chunk: int, site: _Site) -> list[str]:
        """The gradient's path from its backward operators to the optimizer."""
        param = site.param
        use = site.uses[0][1]
        storage = use.storage
        last = [node.replace("F/", "B/", 1) for node, _ in site.uses]
        stage = chunk % self.pp
        tied = param.name == "embedding.weight" and self.plan.model.tie_embeddings \
            and self.pp > 1
        suffix = f"#s{stage}" if tied else ""
        nbytes = self._param_bytes(param, storage)
        # ZeRO-2/3 keep only a shard of the gradient, so they reduce every microbatch.
        each_microbatch = self.zero >= 2 and self.replicas > 1
        sharded_grad = self.zero >= 1 and self.replicas > 1
        fixup = use.gradient_transfer() if self.tp > 1 else None
        if fixup is not None and not fixup.is_transfer:
            fixup = None

        def step(kind: str, axis: str, size: float, per_microbatch: bool, reason: str,
                 **extra) -> None:
            nonlocal last
            node = self.transfer(f"G/{param.name}:{kind}@{axis}{suffix}", kind, axis,
                                 "backward", chunk, param.layer, size,
                                 self.m if per_microbatch else 1, reason, stage=stage,
                                 tensor=param.name, per_microbatch=per_microbatch, **extra)
            for source in last:
                self.edge(source, node, port="x")
            last = [node]

        # A slice's gradient is gathered before the dp reduction shards it; a partial
        # sum can be summed over tp at the end, on the (possibly sharded) gradient.
        if fixup is not None and fixup.kind == "all_gather":
            step("all_gather", "tp", self._param_bytes(param, gradient_layout(storage)),
                 each_microbatch, reasons.parameter_fixup(self.plan, param.name, fixup,
                                                          use.data))
        if self.replicas > 1:
            kind = "all_reduce" if self.zero == 0 else "reduce_scatter"
            step(kind, "dp_cp", nbytes, each_microbatch,
                 reasons.data_parallel(self.plan, param.name, kind))
        shard = self.replicas if sharded_grad else 1
        if fixup is not None and fixup.kind == "all_reduce":
            step("all_reduce", "tp", nbytes / shard, False,
                 reasons.parameter_fixup(self.plan, param.name, fixup, use.data))
        if tied:
            step("all_reduce", "tied", nbytes / shard, False, reasons.tied(self.plan),
                 collective=f"G/{param.name}:all_reduce@tied",
                 peer_stage=self.pp - 1 if stage == 0 else 0)
        return last

    def _optimizer(self, chunk: int, group: str, ready: list[str], sites: list[_Site]) -> None:
        sharded = self.zero >= 1 and self.replicas > 1
        layer = sites[0].param.layer
        elements = sum(self._param_bytes(s.param, s.uses[0][1].storage) for s in sites) / \
            self.plan.model.dtype_bytes / (self.replicas if sharded else 1)
        flops = elements * OPTIMIZER_FLOPS_PER_ELEMENT[self.plan.train.optimizer.name]
        where = f"L{layer}" if layer is not None else group
        tied = self.plan.model.tie_embeddings and self.pp > 1
        suffix = f"#s{chunk % self.pp}" if group == "head" and tied else ""
        node = self.compute(f"O/{where}/optimizer{suffix}", "optimizer", "optimizer", chunk,
                            layer, flops, elements * self.plan.model.dtype_bytes, 1,
                            params=[s.param.name for s in sites], sharded=sharded,
                            recompute=False, per_microbatch=False)
        for source in ready:
            self.edge(source, node, port="grad")
        if self.zero not in (1, 2) or self.replicas == 1:
            return
        for site in sites:
            param = site.param
            own = f"#s{chunk % self.pp}" if param.name == "embedding.weight" and tied else ""
            gather = self.transfer(f"O/{param.name}:all_gather@dp_cp{own}", "all_gather",
                                   "dp_cp", "optimizer", chunk, param.layer,
                                   self._param_bytes(param, site.uses[0][1].storage), 1,
                                   reasons.zero_gather(self.plan, param.name),
                                   tensor=param.name, per_microbatch=False)
            self.edge(node, gather, port="x")

    # --- the whole step ---------------------------------------------------------------------

    def derive(self) -> nx.DiGraph:
        self.chunk_input: dict[int, str] = {}  # chunk -> its forward receive
        self.gradient_input: dict[int, str] = {}  # chunk -> its backward receive
        for chunk in range(len(self.chunks)):
            self._forward_chunk(chunk)
        for chunk in reversed(range(len(self.chunks))):
            self._backward_chunk(chunk)
        for chunk in range(len(self.chunks)):
            self._parameters(chunk)
        self.graph.graph.update(self._attributes())
        return self.graph

    def _attributes(self) -> dict:
        plan, virtual = self.plan, self.plan.shard.pp.virtual
        return {
            "format": "planc-graph", "version": GRAPH_FORMAT_VERSION, "plan": plan.name,
            "sizes": {"tp": self.tp, "cp": self.cp, "pp": self.pp, "dp": plan.mesh.dp},
            "microbatches": self.m, "microbatch_size": plan.microbatch_size,
            "pipeline": plan.schedule.pipeline, "virtual": virtual,
            "chunks": [list(c) for c in self.chunks], "dtype": plan.model.dtype,
            "zero": self.zero, "recompute": self.recompute,
            "stream_layout": str(self.tpp.stream),
            "layouts": {op: {"input": str(o.input), "output": str(o.output),
                             "grad_input": str(o.grad_input), "sharded": o.sharded}
                        for op, o in self.tpp.ops.items()},
            "schedule": {str(stage): " ".join(action_text(a, virtual) for a in schedule(
                plan.schedule.pipeline, stage, self.pp, self.m, virtual))
                for stage in range(self.pp)},
        }


def derive(plan: Plan) -> nx.DiGraph:
    """The raw communication graph of one training step of ``plan``."""
    return _Derivation(plan).derive()
