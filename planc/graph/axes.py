"""The transfers of the tp, cp and pp axes, as the derivation inserts them.

- tp: wherever a producer's layout differs from its consumer's,
  :func:`planc.graph.sharding.redistribute` gives the collective (a local slice moves no
  data and is marked on the edge instead);
- cp: K and V are all-gathered over cp (reduce-scattered in backward), or passed around
  the cp ring inside attention, one block per ring step, each step's shift overlapped with
  the partial attention on the block in hand (Liu et al. 2023, ring attention);
- pp: one send and one receive per microbatch, chunk boundary and direction.
"""

from __future__ import annotations

from planc.graph import reasons
from planc.graph.builder import GraphBuilder
from planc.graph.ir import Axis, EdgeKind, Kind, Payload, Phase, Port
from planc.graph.sharding import Layout, R, S, redistribute

PHASE_OF = {"F": Phase.FORWARD, "B": Phase.BACKWARD, "R": Phase.BACKWARD}
# The column-parallel GEMMs whose gathered input shard { tp { gathered_inputs = regather } }
# gathers again in the backward: a pre-norm block's first GEMM of each sub-block, and the
# head
REGATHERED = ("qkv", "fc1", "head")


class AxisRules:
    """The transfers of the tp, cp and pp axes, added to the graph ``builder`` makes."""

    def __init__(self, builder: GraphBuilder):
        # what the rules read of the graph under construction, and how they add to it
        b = builder
        self.plan, self.graph, self.tpp, self.shapes = b.plan, b.graph, b.tpp, b.shapes
        self.m, self.tp, self.cp, self.pp, self.stage_of = b.m, b.tp, b.cp, b.pp, b.stage_of
        self.transfer, self.edge, self.layout = b.transfer, b.edge, b.layout
        self.prefix, self.local_bytes = b.prefix, b.local_bytes

    # --- tp, cp and pp transfers ------------------------------------------------------

    def tp_transfer(self, u: str, *, letter: str, chunk: int, layer: int | None,
                     tensor: str, source: Layout, target: Layout, ops: tuple[str, str],
                     backward: bool = False) -> tuple[str, Layout | None]:
        """Insert the tp transfer from ``source`` to ``target`` after ``u``; return the
        node that now carries the tensor (``u`` itself when no transfer is needed) and the
        slice the consumer takes locally, if any."""
        move = redistribute(source, target)
        if move is None or self.tp == 1:
            return u, None
        if not move.is_transfer:
            return u, move.target
        node = self.transfer(
            f"{self.prefix(letter, layer)}{ops[0]}>{ops[1]}:{move.kind}@tp",
            kind=Kind(move.kind), axis=Axis.TP, payload=Payload.ACTIVATION,
            phase=PHASE_OF[letter], chunk=chunk, layer=layer,
            nbytes=self.shapes.bytes(tensor) * move.buffer_fraction(self.tp), repeat=self.m,
            reason=reasons.tensor_parallel(self.plan, self.tpp, ops, move, backward,
                                           letter == "R"),
            tensor=tensor, dim=move.dim, source_layout=str(move.source),
            target_layout=str(move.target), producer=ops[0], consumer=ops[1],
            **_redoing(letter))
        return node, None

    def connect(self, u: str, v: str, carried: tuple[str, Layout | None], port: Port,
                 grad_of: Port | None = None) -> None:
        """Edges u -> (transfer ->) v for a value carried as ``tp_transfer`` returned it."""
        carrier, local = carried
        if carrier == u:
            self.edge(u, v, port=port, grad_of=grad_of, local_slice=local)
        else:
            self.edge(u, carrier, port=Port.X, grad_of=grad_of)
            self.edge(carrier, v, port=port)

    def regather(self, gather: str, producer: str, backward: str) -> str | None:
        """The all-gather over tp that makes ``gather``'s output (a forward all-gather of
        the tokens, sequence parallelism's, into a column-parallel GEMM) again for the
        GEMM's ``backward`` step, from the shard ``producer`` wrote: the forward keeps the
        shard, not the gathered input (Korthikanti et al. 2022, section 4.2.2;
        Megatron-LM's sequence-parallel linear). It is issued once the gradient that
        reaches ``backward`` is one step away (order edges from what feeds the step
        before it, where there is one), so that it runs beside that step and each layer's
        input is whole only around its own backward. None where ``gather`` is not such
        an all-gather."""
        data = self.graph.nodes[gather]
        consumer = data.get("consumer")
        if data.get("kind") != Kind.ALL_GATHER or data.get("axis") != Axis.TP or \
                data.get("dim") != "seq" or consumer not in REGATHERED or \
                self.graph.out_degree(gather) != 1:
            return None
        layer = data["layer"]
        node = self.transfer(
            f"{self.prefix('B', layer)}{data['producer']}>{consumer}:all_gather@tp",
            kind=Kind.ALL_GATHER, axis=Axis.TP, payload=Payload.ACTIVATION,
            phase=Phase.BACKWARD, chunk=data["chunk"], layer=layer, nbytes=data["bytes"],
            repeat=self.m, reason=reasons.regather(self.plan, consumer),
            tensor=data["tensor"], dim="seq", source_layout=data["source_layout"],
            target_layout=data["target_layout"], producer=data["producer"],
            consumer=consumer, regathers=gather)
        self.edge(producer, node, port=Port.X)
        self.edge(node, backward, port=Port.GATHERED)
        feeding = _gradient_sources(self.graph, backward)
        for source in {s for f in feeding for s in _gradient_sources(self.graph, f)} or \
                feeding:
            self.edge(source, node, kind=EdgeKind.ORDER)
        return node

    def kv_bytes(self) -> float:
        """This rank's K and V for one microbatch: local tokens, local heads."""
        heads_sharded = self.layout("attention").input.is_sharded and self.tp > 1
        return self.shapes.bytes("kv") / (self.tp if heads_sharded else 1)

    def cp_forward(self, letter: str, chunk: int, layer: int, source: str, attention: str):
        """K and V over cp, between the (tp-redistributed) qkv and attention."""
        if self.plan.shard.cp.attention == "allgather":
            node = self.transfer(f"{letter}/L{layer}/kv:all_gather@cp", kind=Kind.ALL_GATHER,
                                 axis=Axis.CP, payload=Payload.KV, phase=PHASE_OF[letter],
                                 chunk=chunk, layer=layer,
                                 nbytes=self.kv_bytes() * self.cp, repeat=self.m,
                                 reason=reasons.context_allgather(self.plan, False,
                                                                  letter == "R"),
                                 tensor="kv", dim="seq", **_redoing(letter))
            self.edge(source, node, port=Port.X)
            self.edge(node, attention, port=Port.KV)
        else:
            self.ring_attention(attention, forward=letter != "B")

    def ring_attention(self, attention: str, forward: bool) -> None:
        """Ring attention runs as cp ring steps inside the attention step (Liu et al. 2023;
        picotron's ring attention): at step s the rank holds the K/V block of the cp rank
        s before it, sends it on to the next rank while it computes the partial attention
        on it, and merges the partials by their log-sum-exp (FlashAttention-2). Forward:
        cp - 1 K/V shifts; backward: cp - 1 K/V shifts and cp shifts of each block's
        dK/dV accumulator, which comes home after its last. The node records the steps
        and the block's bytes; the lowering writes them as its operands."""
        self.graph.nodes[attention].update(
            ring_steps=self.cp, ring_bytes=int(round(self.kv_bytes())),
            ring_reason=reasons.context_ring(self.plan, forward))

    def scatter_gather(self) -> bool:
        """Whether pipeline sends are scattered over tp and gathered on arrival
        (``optimize { pp_scatter_gather }``): only where tp > 1 and the residual stream is
        replicated over tp; under sequence parallelism it is already split."""
        return self.plan.optimize.pp_scatter_gather and self.tp > 1 and \
            not self.tpp.stream.is_sharded

    def scatter_gather_decision(self) -> dict:
        """What the scatter-gather rule decided and why (graph.json's
        ``graph.pp_scatter_gather``)."""
        return {"applied": self.scatter_gather(),
                "reason": reasons.scatter_gather_decision(self.plan, self.tpp.stream.is_sharded)}

    def pipeline(self, phase: Phase, source_chunk: int, target_chunk: int,
                 layout: Layout) -> tuple[str, str]:
        """The send and receive of one chunk boundary and direction; returns the send and
        the node that holds the whole tensor on arrival. ``layout``: the forward tensor's
        (the residual stream's, or the embedding's output when it crosses from a chunk of
        the embedding alone); its gradient has the same size. With scatter-gather
        (Narayanan et al. SC'21, section 4.1) a tensor replicated over tp is sent as each
        tp rank's own 1/tp of the tokens (a local slice, on the edge into the send) and
        the receiving stage all-gathers them over tp, inside its node: the bytes between
        stages drop by tp."""
        letter = "F" if phase == Phase.FORWARD else "B"
        whole = layout
        scattered = self.scatter_gather() and layout == R
        if scattered:
            layout = S("seq")
        nbytes = self.local_bytes("stream", layout)
        reason = reasons.pipeline(self.plan, phase.value, source_chunk, target_chunk,
                                  self.tp if scattered else 1)
        name = f"{letter}/c{source_chunk}>c{target_chunk}"
        tokens = self.shapes.seq // (self.tp if layout.is_sharded else 1)
        shape = [self.shapes.batch, tokens, self.shapes.hidden]  # (batch, tokens, hidden)
        extra = {"scatter_gather": self.tp} if scattered else {}
        # Forward goes to the next stage, backward to the previous, except on the way
        # back of a V, where both turn round.
        descends = self.plan.placement.descends(min(source_chunk, target_chunk), self.pp)
        toward = "prev" if descends == (phase == Phase.FORWARD) else "next"
        send = self.transfer(f"{name}:send@pp", kind=Kind.SEND, axis=Axis.PP,
                             payload=Payload.STREAM, phase=phase, chunk=source_chunk,
                             layer=None, nbytes=nbytes, repeat=self.m, reason=reason,
                             tensor="stream", peer_stage=self.stage_of[target_chunk],
                             shape=shape, toward=toward, **extra)
        recv = self.transfer(f"{name}:recv@pp", kind=Kind.RECV, axis=Axis.PP,
                             payload=Payload.STREAM, phase=phase, chunk=target_chunk,
                             layer=None, nbytes=nbytes, repeat=self.m, reason=reason,
                             tensor="stream", peer_stage=self.stage_of[source_chunk],
                             shape=shape, toward=toward, **extra)
        self.edge(send, recv)
        if not scattered:
            return send, recv
        move = redistribute(layout, whole)
        gather = self.transfer(
            f"{name}:{move.kind}@tp", kind=Kind(move.kind), axis=Axis.TP,
            payload=Payload.ACTIVATION, phase=phase, chunk=target_chunk, layer=None,
            nbytes=self.shapes.bytes("stream") * move.buffer_fraction(self.tp), repeat=self.m,
            reason=reasons.scatter_gather(self.plan, phase.value), tensor="stream",
            dim=move.dim, source_layout=str(layout), target_layout=str(move.target))
        self.edge(recv, gather, port=Port.X)
        return send, gather

    def into_send(self, send: str) -> None:
        """With scatter-gather, everything a send reads is this tp rank's slice of it."""
        if self.graph.nodes[send].get("scatter_gather"):
            for _, _, data in self.graph.in_edges(send, data=True):
                data["slice"] = str(S("seq"))


def _gradient_sources(graph, node: str) -> set[str]:
    """The steps whose output gradient flows into ``node``."""
    return {u for u, _, e in graph.in_edges(node, data=True) if e.get("port") == Port.GRAD}


def _redoing(letter: str) -> dict:
    """A recomputed forward's transfer (R) says so: it redoes the forward's in the
    backward phase (``recomputes``, as a recomputed mixture's all-to-alls do)."""
    return {"recomputes": True} if letter == "R" else {}
