"""Run a rank program for one training step: its instructions on their streams.

Two backends behind one interface. On CPU (gloo) every program stream is a thread that
runs its instructions in order; ``record`` sets an event once the stream's previous
instruction finished, ``wait`` blocks only its own stream, and collectives are issued
asynchronously and waited on through their work handles, so computation and
communication overlap as on a GPU (PyTorch releases the interpreter lock inside its
kernels and gloo progresses on its own threads). Collectives of a group are issued by a
single stream in program order, so every member issues them in the same order. On CUDA
(NCCL) one host thread issues every instruction in program order onto a
``torch.cuda.Stream`` per program stream, with ``torch.cuda.Event`` for record and wait;
NCCL's work handles order each stream after its collectives without blocking the host.

A step that stops making progress for ``timeout`` seconds raises :class:`Hang`, whose
message lists what every stream was waiting for (instruction, kind, group, peers), in
the spirit of NCCL's flight recorder.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field

import networkx as nx
import torch

from planc.graph.layouts import gradient_layout
from planc.graph.layouts import parse as parse_layout
from planc.lower.program import Expanded, Program
from planc.runtime.context import ParamStore, RankContext, pp_group_key
from planc.runtime.kernels import Kernels, Saved
from planc.runtime.model import split_feature
from planc.runtime.reference import make_optimizer
from planc.runtime.transfers import Transfers


class Hang(RuntimeError):
    """No progress for too long; the message says what each stream waits for."""


class PeerLost(RuntimeError):
    """A transfer failed because a peer went away; the message says what each stream
    was waiting for."""


_PEER_GONE = ("Connection closed", "Connection reset", "Broken pipe", "Timed out",
              "timed out", "NCCL communicator was aborted")


@dataclass
class TraceEvent:
    stream: str
    name: str
    start: float
    end: float
    microbatch: int | None


@dataclass
class StepState:
    step: int
    buffers: dict[str, object] = field(default_factory=dict)
    saved: dict[str, Saved] = field(default_factory=dict)
    loss: float | None = None
    trace: list[TraceEvent] = field(default_factory=list)


class Interpreter:
    """What each instruction does, whatever the streams it runs on."""

    def __init__(self, ctx: RankContext, graph: nx.DiGraph, program: Program):
        self.ctx, self.graph, self.program = ctx, graph, program
        self.kernels = Kernels(ctx)
        self.transfers = Transfers(ctx)
        self.store = ParamStore(ctx)
        self.optimizers: dict[str, torch.optim.Optimizer] = {}
        self.microbatches = program.microbatches
        self.recomputed = {n.replace("R/", "F/", 1) for n in graph.nodes if n.startswith("R/")}
        self.lock = threading.Lock()

    # --- reading buffers ---------------------------------------------------------------

    def _value(self, state: StepState, source: str, microbatch: int | None, edge: dict,
               consumer: dict):
        """The value an edge carries: a tensor, a gradient picked from a backward step's
        results, or, for once-per-step work reading per-microbatch results, their sum
        over the step's microbatches (gradient accumulation)."""
        source_data = self.graph.nodes[source]
        if source_data["per_microbatch"] and (microbatch is None or
                                              not consumer["per_microbatch"]):
            values = [self._pick(state.buffers[f"{source}#{k}"], edge, consumer)
                      for k in range(self.microbatches)]
            values = [v for v in values if v is not None]
            return sum(values[1:], values[0]) if values else None
        key = f"{source}#{microbatch}" if source_data["per_microbatch"] else source
        return self._pick(state.buffers[key], edge, consumer)

    @staticmethod
    def _pick(value, edge: dict, consumer: dict):
        if not isinstance(value, dict):
            return value
        if edge.get("grad_of") is not None:
            return value.get(edge["grad_of"])
        tensor = consumer.get("tensor")
        if tensor is not None:
            return value.get(f"param:{tensor}")
        return value

    def inputs(self, state: StepState, node: str, microbatch: int | None) -> dict[str, list]:
        consumer = self.graph.nodes[node]
        out: dict[str, list] = defaultdict(list)
        for source, _, edge in self.graph.in_edges(node, data=True):
            if edge.get("kind") != "data":
                continue
            if self.graph.nodes[source]["stage"] != self.ctx.stage:
                continue  # reached through this stage's receive
            value = self._value(state, source, microbatch, edge, consumer)
            if value is None:
                continue
            port = edge.get("port", "x")
            if consumer["type"] == "compute" and port in ("x", "skip", "grad"):
                value = self._local_slice(value, self._layout_of(source, edge),
                                          self._expected(consumer, port))
            out[port].append(value)
        return out

    # A replicated value meeting a consumer that wants a shard is sliced locally: the
    # "R -> S(d)" redistribution, which moves no data and so has no node of its own.

    def _layout_of(self, source: str, edge: dict):
        data = self.graph.nodes[source]
        tpp = self.ctx.tpp
        if data["type"] == "compute":
            if data["phase"] != "backward" or data.get("recompute"):
                return parse_layout(data.get("tp_output", "R"))
            port = edge.get("grad_of", "x")
            if port == "skip":
                return tpp.stream
            return tpp.ops[data["name"]].grad_input if port == "x" else None
        if data.get("axis") == "tp" and data.get("target_layout"):
            return parse_layout(data["target_layout"])
        if data.get("axis") == "pp":
            return tpp.stream
        return None

    def _expected(self, consumer: dict, port: str):
        layout = self.ctx.tpp.ops.get(consumer["name"])
        if layout is None:
            return None
        if port == "skip":
            return self.ctx.tpp.stream
        if port == "grad":
            return gradient_layout(layout.output)
        return layout.input

    def _local_slice(self, value, have, want):
        if have is None or want is None or have == want or not want.is_sharded or \
                have.kind != "R" or self.ctx.tp == 1 or not torch.is_tensor(value):
            return value
        axis = 1 if want.dim == "seq" else 2
        return split_feature(value, want.dim, self.ctx.tp, self.ctx.tp_rank, self.ctx.heads,
                             axis)

    @staticmethod
    def combine(values: list[torch.Tensor]) -> torch.Tensor:
        """Sum gradient contributions; a K/V gradient joins a qkv gradient in its k and v
        thirds."""
        if len(values) == 1:
            return values[0]
        widest = max(values, key=lambda v: v.shape[-1])
        total = torch.zeros_like(widest)
        for value in values:
            if value.shape == total.shape:
                total = total + value
            else:
                third = total.shape[-1] // 3
                shape = total.shape[:-1]
                view = total.reshape(*shape, 3, third).clone()
                view[..., 1:, :] += value.reshape(*shape, 2, third)
                total = view.reshape(total.shape)
        return total

    # --- running an instruction ------------------------------------------------------------

    def run(self, state: StepState, item: Expanded) -> None:
        node, mb = item.node, item.microbatch
        data = self.graph.nodes[node]
        if item.op == "compute":
            result = self._compute(state, node, data, mb)
        else:
            result = self._transfer(state, node, data, mb, item)
        for buffer in item.writes:
            state.buffers[buffer] = result

    def _params(self, state: StepState, node: str, data: dict, mb: int | None):
        params = {}
        by_name = {}
        for source, _, edge in self.graph.in_edges(node, data=True):
            if edge.get("port") == "param":
                by_name[self.graph.nodes[source]["tensor"]] = f"{source}#{mb}"
        for name in data.get("params", []):
            if name in by_name:
                params[name] = state.buffers[by_name[name]]
            else:
                params[name] = self.store.full[name]
        return params

    def _compute(self, state: StepState, node: str, data: dict, mb: int | None):
        if data["op"] == "optimizer":
            return self._optimizer(state, node, data)
        if data["phase"] == "backward" and not data.get("recompute"):
            forward = node.replace("B/", "F/", 1)
            recomputed = node.replace("B/", "R/", 1)
            key = f"{recomputed}#{mb}" if f"{recomputed}#{mb}" in state.saved else \
                f"{forward}#{mb}"
            saved = state.saved.pop(key)
            state.saved.pop(f"{forward}#{mb}", None)
            grads = self.inputs(state, node, mb).get("grad", [])
            grad = self.combine(grads) if grads else None
            return self.kernels.backward(data, saved, grad)
        inputs = {port: self.combine(values) for port, values in
                  self.inputs(state, node, mb).items() if port != "param"}
        forward = node.replace("R/", "F/", 1)
        if data.get("recompute"):  # inputs from outside the layer: what the forward kept
            kept = state.saved.get(f"{forward}#{mb}")
            if kept is not None:
                for port, tensor in kept.inputs.items():
                    inputs.setdefault(port, tensor.detach())
        keep_graph = data.get("recompute") or forward not in self.recomputed
        output, saved = self.kernels.forward(data, inputs, self._params(state, node, data, mb),
                                             state.step, mb, keep_graph=bool(keep_graph))
        if data.get("part") is None:  # what this step's backward will need
            state.saved[f"{node}#{mb}"] = saved
        return output

    def _optimizer(self, state: StepState, node: str, data: dict):
        grads: dict[str, torch.Tensor] = {}
        for source, _, edge in self.graph.in_edges(node, data=True):
            source_data = self.graph.nodes[source]
            if source_data["type"] == "transfer":
                value = self._value(state, source, None, edge, {})
                grads[source_data["tensor"]] = value
                continue
            for name in data["params"]:  # straight from the backward steps
                value = self._value(state, source, None, {}, {"tensor": name})
                if value is not None:
                    grads[name] = grads[name] + value if name in grads else value
        sharded = data.get("sharded", False)
        tensors = [self.store.shard[n] if sharded else self.store.full[n] for n in data["params"]]
        optimizer = self.optimizers.get(node)
        if optimizer is None:
            optimizer = self.optimizers[node] = make_optimizer(self.ctx.plan, tensors)
        for name, tensor in zip(data["params"], tensors):
            grad = grads.get(name)
            tensor.grad = (torch.zeros_like(tensor) if grad is None else
                           grad.reshape(tensor.shape).to(tensor.dtype))
        optimizer.step()
        for tensor in tensors:
            tensor.grad = None
        return None

    def _transfer(self, state: StepState, node: str, data: dict, mb: int | None,
                  item: Expanded):
        ctx, t = self.ctx, self.transfers
        axis, kind = data["axis"], data["kind"]
        if axis == "pp":
            peer = ctx.layout.rank({**ctx.coords, "pp": data["peer_stage"]})
            if kind == "send":
                inputs = self.inputs(state, node, mb)
                value = self.combine(inputs["x"] + inputs.get("grad", []))
                group = ctx.groups.handles[pp_group_key(ctx.rank, peer, data["phase"])]
                t.send(value.to(ctx.dtype), peer, group)
                return None
            group = ctx.groups.handles[pp_group_key(peer, ctx.rank, data["phase"])]
            return t.recv(self._stream_shape(), ctx.dtype, peer, group)
        source = node
        if item.op == "sendrecv":  # a ring shift sends what its send half reads
            source = next(p for p in self.graph.predecessors(node)
                          if self.graph.nodes[p].get("kind") == "send")
        inputs = self.inputs(state, source, mb)
        values = [v.detach() for v in inputs.get("x", []) + inputs.get("grad", [])]
        value = self.combine(values) if values else None
        tensor = data.get("tensor", "")
        if axis == "cp":
            steps = data.get("ring_steps")
            if item.op == "sendrecv":
                return t.kv_ring(value, steps) if tensor == "kv" else t.dkv_ring(value, steps)
            return t.kv_all_gather(value) if tensor == "kv" else t.dkv_reduce_scatter(value)
        if axis in ("dp_cp", "tied", "stage") or (axis == "tp" and tensor in ctx.storage):
            return self._parameter_transfer(state, node, data, value, tensor)
        return t.redistribute(value, data)

    def _parameter_transfer(self, state, node, data, value, tensor):
        t, kind, axis = self.transfers, data["kind"], data["axis"]
        if axis == "stage":  # the step's loss, summed over the last stage
            total = t.all_reduce(value.reshape(1).to(torch.float32), "stage")
            state.loss = float(total)
            return total
        if axis == "tp":
            if kind == "all_reduce":
                return t.all_reduce(value, "tp")
            use = self.ctx.storage[tensor]
            return t.slice_all_gather(value, use.data.dim, use.dims)
        if axis == "tied":
            return t.all_reduce(value, "tied")
        if kind == "all_reduce":
            return t.all_reduce(value, "dp_cp")
        if kind == "reduce_scatter":
            return t.flat_reduce_scatter(value)
        # all_gather: ZeRO-3 before a use, or ZeRO-1/2 after the optimizer step
        full = t.flat_all_gather(self.store.shard[tensor], self.store.shape[tensor])
        if data["phase"] == "optimizer":
            self.store.full[tensor] = full
        return full

    def _stream_shape(self):
        plan, ctx = self.ctx.plan, self.ctx
        tokens = plan.model.seq // plan.mesh.cp
        if ctx.tpp.stream.is_sharded and ctx.tp > 1:
            tokens //= ctx.tp
        return (plan.microbatch_size, tokens, plan.model.hidden)


def _describe(item: Expanded, graph: nx.DiGraph, ctx: RankContext) -> str:
    mb = f" (microbatch {item.microbatch})" if item.microbatch is not None else ""
    if item.op in ("record", "wait"):
        return f"{item.op} {item.event}"
    if item.op == "sync":
        return "sync: waiting for every other stream to drain"
    data = graph.nodes[item.node]
    if data["type"] == "compute":
        return f"compute {item.node}{mb}"
    axis = data["axis"]
    if axis == "pp":
        peer = ctx.layout.rank({**ctx.coords, "pp": data["peer_stage"]})
        verb = "send to" if data["kind"] == "send" else "receive from"
        return f"{data['kind']} {item.node}{mb}: {verb} rank {peer} (pp)"
    members = list(ctx.groups.members.get(axis, ()))
    return (f"{item.op} {item.node}{mb} over {axis} group {members} "
            f"({data['bytes']:,} bytes)")


class CpuExecutor:
    """Program streams as threads; see the module docstring."""

    def __init__(self, interpreter: Interpreter, timeout: float):
        self.interpreter, self.timeout = interpreter, timeout
        # Every step issues the same instructions: split them over the streams once.
        self.streams: dict[str, list[Expanded]] = defaultdict(list)
        for item in interpreter.program.expand():
            self.streams[item.stream].append(item)

    def run_step(self, step: int) -> StepState:
        interp, streams = self.interpreter, self.streams
        state = StepState(step)
        events: dict[str, threading.Event] = defaultdict(threading.Event)
        done_count = {s: 0 for s in streams}
        current: dict[str, Expanded | None] = {s: None for s in streams}
        condition = threading.Condition()
        failure: list[BaseException] = []
        progress = [time.monotonic()]
        abort = threading.Event()

        def needed_before(stream: str, index: int) -> int:
            return sum(1 for i in streams[stream] if i.index < index)

        def worker(name: str) -> None:
            try:
                for item in streams[name]:
                    if abort.is_set():
                        return
                    current[name] = item
                    start = time.time()
                    if item.op == "wait":
                        while not events[item.event].wait(0.05):
                            if abort.is_set():
                                return
                    elif item.op == "record":
                        events[item.event].set()
                    elif item.op == "sync":
                        needed = {s: needed_before(s, item.index) for s in streams if s != name}
                        with condition:
                            while not all(done_count[s] >= n for s, n in needed.items()):
                                if abort.is_set():
                                    return
                                condition.wait(0.05)
                    else:
                        interp.run(state, item)
                        state.trace.append(TraceEvent(name, item.node, start, time.time(),
                                                      item.microbatch))
                    with condition:
                        done_count[name] += 1
                        current[name] = None
                        progress[0] = time.monotonic()
                        condition.notify_all()
            except BaseException as exc:  # noqa: BLE001 - reported by the main thread
                failure.append(exc)
                abort.set()

        threads = [threading.Thread(target=worker, args=(s,), name=f"stream-{s}", daemon=True)
                   for s in streams]
        for thread in threads:
            thread.start()
        while any(t.is_alive() for t in threads):
            for thread in threads:
                thread.join(0.05)
            if failure:
                abort.set()
                self._raise(failure[0], current, step)
            if time.monotonic() - progress[0] > self.timeout:
                abort.set()
                raise Hang(self._hang_report(current, step))
        if failure:
            self._raise(failure[0], current, step)
        return state

    def _raise(self, error: BaseException, current: dict, step: int):
        if isinstance(error, RuntimeError) and any(p in str(error) for p in _PEER_GONE):
            cause = str(error).split("\n")[0][:200]
            raise PeerLost(self._hang_report(current, step, lost=cause)) from error
        raise error

    def _hang_report(self, current: dict, step: int, lost: str | None = None) -> str:
        interp = self.interpreter
        ctx = interp.ctx
        who = (f"rank {ctx.rank} (stage {ctx.stage}, tp {ctx.tp_rank}, cp {ctx.cp_rank}, "
               f"dp {ctx.coords['dp']})")
        what = (f"lost a peer in step {step} ({lost})" if lost else
                f"made no progress for {self.timeout:g} s in step {step}")
        lines = [f"{who} {what}; its streams wait on:"]
        for stream, item in current.items():
            what = "nothing (finished)" if item is None else \
                f"#{item.index} {_describe(item, interp.graph, ctx)}"
            lines.append(f"  {stream}: {what}")
        return "\n".join(lines)


class CudaExecutor:
    """Program streams as CUDA streams, issued in program order by one host thread."""

    def __init__(self, interpreter: Interpreter, timeout: float):
        self.interpreter, self.timeout = interpreter, timeout
        self.streams = {name: torch.cuda.Stream() for name in interpreter.program.streams}
        self.items = list(interpreter.program.expand())  # the same every step

    def run_step(self, step: int) -> StepState:
        interp = self.interpreter
        state = StepState(step)
        events: dict[str, torch.cuda.Event] = {}
        for item in self.items:
            stream = self.streams.setdefault(item.stream, torch.cuda.Stream())
            if item.op == "record":
                events[item.event] = torch.cuda.Event()
                events[item.event].record(stream)
            elif item.op == "wait":
                stream.wait_event(events[item.event])
            elif item.op == "sync":
                torch.cuda.synchronize()
            else:
                with torch.cuda.stream(stream):
                    interp.run(state, item)
        torch.cuda.synchronize()
        return state
