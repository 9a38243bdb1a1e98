"""The transfers of the tp, cp and pp axes, as the derivation inserts them.

- tp: wherever a producer's layout differs from its consumer's,
  :func:`planc.graph.layouts.redistribute` gives the collective (a local slice moves no
  data and is marked on the edge instead);
- cp: K and V are all-gathered over cp (reduce-scattered in backward), or passed around
  the cp ring (Liu et al. 2023, ring attention);
- pp: one send and one receive per microbatch, chunk boundary and direction.
"""

from __future__ import annotations

from planc.graph import reasons
from planc.graph.ir import Axis, Kind, Payload, Phase, Port
from planc.graph.layouts import Layout, redistribute
from planc.mesh import RING_NEXT, RING_PREVIOUS

PHASE_OF = {"F": Phase.FORWARD, "B": Phase.BACKWARD, "R": Phase.BACKWARD}


class AxisRules:
    """Mixed into the derivation, which provides the graph, the plan, nodes and edges."""

    # --- tp, cp and pp transfers ------------------------------------------------------

    def _tp(self, letter: str, chunk: int, layer: int | None, tensor: str, source: Layout,
            target: Layout, ops: tuple[str, str], u: str, backward: bool = False
            ) -> tuple[str, Layout | None]:
        """Insert the tp transfer from ``source`` to ``target`` after ``u``; return the
        node that now carries the tensor (``u`` itself when no transfer is needed) and the
        slice the consumer takes locally, if any."""
        move = redistribute(source, target)
        if move is None or self.tp == 1:
            return u, None
        if not move.is_transfer:
            return u, move.target
        node = self.transfer(
            f"{self._prefix(letter, layer)}{ops[0]}>{ops[1]}:{move.kind}@tp", Kind(move.kind),
            Axis.TP, Payload.ACTIVATION, PHASE_OF[letter], chunk, layer,
            self.shapes.bytes(tensor) * move.buffer_fraction(self.tp), self.m,
            reasons.tensor_parallel(self.plan, self.tpp, ops, move, backward, letter == "R"),
            tensor=tensor, dim=move.dim, source_layout=str(move.source),
            target_layout=str(move.target), producer=ops[0], consumer=ops[1])
        return node, None

    def _connect(self, u: str, v: str, carried: tuple[str, Layout | None], port: Port,
                 grad_of: Port | None = None) -> None:
        """Edges u -> (transfer ->) v for a value carried as ``_tp`` returned it."""
        carrier, local = carried
        if carrier == u:
            self.edge(u, v, port=port, grad_of=grad_of, local_slice=local)
        else:
            self.edge(u, carrier, port=Port.X, grad_of=grad_of)
            self.edge(carrier, v, port=port)

    def _kv_bytes(self) -> float:
        """This rank's K and V for one microbatch: local tokens, local heads."""
        heads_sharded = self.layout("attention").input.is_sharded and self.tp > 1
        return self.shapes.bytes("kv") / (self.tp if heads_sharded else 1)

    def _cp_forward(self, letter: str, chunk: int, layer: int, source: str, attention: str):
        """K and V over cp, between the (tp-redistributed) qkv and attention."""
        if self.plan.shard.cp.attention == "allgather":
            node = self.transfer(f"{letter}/L{layer}/kv:all_gather@cp", Kind.ALL_GATHER,
                                 Axis.CP, Payload.KV, PHASE_OF[letter], chunk, layer,
                                 self._kv_bytes() * self.cp, self.m,
                                 reasons.context_allgather(self.plan, False, letter == "R"),
                                 tensor="kv", dim="seq")
            self.edge(source, node, port=Port.X)
        else:
            node = self._ring(letter, chunk, layer, Payload.KV, self.cp - 1, source)
        self.edge(node, attention, port=Port.KV)

    def _ring(self, letter: str, chunk: int, layer: int, payload: Payload, steps: int,
              source: str, grad_of: Port | None = None) -> str:
        """One ring shift over cp (a send to the next rank, a receive from the previous),
        run ``steps`` times; returns the receive."""
        phase = PHASE_OF[letter]
        tensor = payload.value
        reason = reasons.context_ring(self.plan, tensor)
        send = self.transfer(f"{letter}/L{layer}/{tensor}:send@cp", Kind.SEND, Axis.CP, payload,
                             phase, chunk, layer, self._kv_bytes(), self.m * steps, reason,
                             tensor=tensor, ring_steps=steps, peer=RING_NEXT)
        recv = self.transfer(f"{letter}/L{layer}/{tensor}:recv@cp", Kind.RECV, Axis.CP, payload,
                             phase, chunk, layer, self._kv_bytes(), self.m * steps, reason,
                             tensor=tensor, ring_steps=steps, peer=RING_PREVIOUS)
        self.edge(source, send, port=Port.X, grad_of=grad_of)
        self.edge(send, recv, port=Port.X)
        return recv

    def _pipeline(self, phase: Phase, source_chunk: int, target_chunk: int,
                  layout: Layout) -> tuple[str, str]:
        """``layout``: the forward tensor's (the residual stream's, or the embedding's
        output when it crosses from a chunk of the embedding alone); its gradient has
        the same size."""
        letter = "F" if phase == Phase.FORWARD else "B"
        nbytes = self._local_bytes("stream", layout)
        reason = reasons.pipeline(self.plan, phase.value, source_chunk, target_chunk)
        name = f"{letter}/c{source_chunk}>c{target_chunk}"
        tokens = self.shapes.seq // (self.tp if layout.is_sharded else 1)
        shape = [self.shapes.batch, tokens, self.shapes.hidden]  # (batch, tokens, hidden)
        # Forward goes to the next stage, backward to the previous, except on the way
        # back of a V, where both turn round.
        descends = self.plan.placement.descends(min(source_chunk, target_chunk), self.pp)
        toward = "prev" if descends == (phase == Phase.FORWARD) else "next"
        send = self.transfer(f"{name}:send@pp", Kind.SEND, Axis.PP, Payload.STREAM, phase,
                             source_chunk, None, nbytes, self.m, reason, tensor="stream",
                             peer_stage=self.stage_of[target_chunk], shape=shape,
                             toward=toward)
        recv = self.transfer(f"{name}:recv@pp", Kind.RECV, Axis.PP, Payload.STREAM, phase,
                             target_chunk, None, nbytes, self.m, reason, tensor="stream",
                             peer_stage=self.stage_of[source_chunk], shape=shape,
                             toward=toward)
        self.edge(send, recv)
        return send, recv
