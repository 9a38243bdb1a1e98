"""Run a rank program, step after step: its instructions on their streams.

Two backends behind one interface. On CPU (gloo) every program stream is a thread,
created once per run, that runs its instructions in order each step; ``record`` sets
an event once the stream's previous instruction finished, ``wait`` blocks only its own
stream, and collectives are issued asynchronously and waited on through their work
handles, so computation and communication overlap as on a GPU (PyTorch releases the
interpreter lock inside its kernels and gloo progresses on its own threads).
Collectives of a group are issued by a single stream in program order, so every member
issues them in the same order. On CUDA (NCCL) one host thread issues every instruction
in program order onto a ``torch.cuda.Stream`` per program stream, with
``torch.cuda.Event`` for record and wait.

Each step reports its wall time and where the compute stream spent it: computing,
running or waiting for collectives (exposed communication), or waiting for a pipeline
receive. A step that stops making progress for ``timeout`` seconds raises :class:`Hang`,
whose message lists what every stream was waiting for, in the spirit of NCCL's flight
recorder.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from planc.program.names import RECEIVE_STREAMS, Stream
from planc.program.expansion import Expanded, expand
from planc.program.program import EVENT_NAMING_OPS, EVENT_OPS, Opcode
from planc.runtime.engine.interpreter import Interpreter, StepState
from planc.data.trace import Flow, flows_of

COMPUTE = Stream.COMPUTE


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
    op: str
    flows: tuple[Flow, ...] = ()  # arrows to and from peers (planc.data.trace)


@dataclass
class StepTimes:
    """Seconds of one step on this rank."""

    total: float = 0.0
    compute: float = 0.0  # the compute stream computing
    comm: float = 0.0  # any stream running a collective or a transfer
    exposed_comm: float = 0.0  # the compute stream running or waiting for collectives
    pipeline_wait: float = 0.0  # the compute stream waiting for a pipeline receive

    def as_list(self) -> list[float]:
        return [self.total, self.compute, self.comm, self.exposed_comm, self.pipeline_wait]


@dataclass
class StepResult:
    state: StepState
    times: StepTimes
    trace: list[TraceEvent] = field(default_factory=list)


def _describe(item: Expanded, interp: Interpreter) -> str:
    mb = f" (microbatch {item.microbatch})" if item.microbatch is not None else ""
    if item.op in EVENT_NAMING_OPS:
        return f"{item.op} {item.event}"
    if item.op is Opcode.SYNC:
        return "sync: waiting for every other stream to drain"
    if item.op is Opcode.COMPUTE:
        return f"compute {item.node}{mb}"
    call = interp.bound[(item.op, item.node)].call
    if call.peer is not None:
        verb = "send to" if item.op is Opcode.SEND else "receive from"
        return f"{item.op} {item.node}{mb}: {verb} rank {call.peer} (pp)"
    size = f" ({call.operands.bytes:,} bytes)" if call.operands.bytes is not None else ""
    return f"{item.op} {item.node}{mb} over {call.operands.group} group " \
        f"{list(call.members)}{size}"


def _flows(interp: Interpreter) -> dict[tuple[str, str], tuple[Flow, ...]]:
    """The trace's flow ends of every transfer and ring attention step, found once from
    its bound call or ring."""
    out = {}
    rank = interp.ctx.rank
    for (op, node), bound in interp.bound.items():
        if op is Opcode.COMPUTE and bound.spec.ring is not None:
            ring = bound.spec.ring
            out[(op, node)] = flows_of(op, node, rank, None, None, ring.members, ring.index)
        elif op is not Opcode.COMPUTE:
            call = bound.call
            out[(op, node)] = flows_of(op, node, rank, call.peer, call.operands.partner,
                                       call.members, call.index)
    return out


class _Plan:
    """The expanded program split over its streams, with what each wait waits for."""

    def __init__(self, interp: Interpreter):
        items = list(expand(interp.program))
        self.streams: dict[str, list[Expanded]] = defaultdict(list)
        for item in items:
            self.streams[item.stream].append(item)
        recorder = {i.event: i.stream for i in items if i.op is Opcode.RECORD}
        self.events = tuple(recorder)
        self.category: dict[int, str] = {}
        for item in items:
            if item.stream != COMPUTE:
                continue
            if item.op is Opcode.WAIT:
                source = recorder.get(item.event, COMPUTE)
                self.category[item.index] = "pipeline_wait" if source in RECEIVE_STREAMS \
                    else "exposed_comm"
            elif item.op is Opcode.SYNC:
                self.category[item.index] = "exposed_comm"
            elif item.op is not Opcode.COMPUTE and item.op is not Opcode.RECORD:
                self.category[item.index] = "exposed_comm"
        self.needed_before = {
            (name, item.index): {s: sum(1 for i in self.streams[s] if i.index < item.index)
                                 for s in self.streams if s != name}
            for name, stream_items in self.streams.items() for item in stream_items
            if item.op is Opcode.SYNC}


class CpuExecutor:
    """Program streams as threads, created once; see the module docstring."""

    def __init__(self, interpreter: Interpreter, timeout: float, trace: bool = False):
        self.interpreter, self.timeout, self.tracing = interpreter, timeout, trace
        self.plan = _Plan(interpreter)
        self.flows = _flows(interpreter) if trace else {}
        self.inbox = {s: queue.SimpleQueue() for s in self.plan.streams}
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.threads = [threading.Thread(target=self._loop, args=(s,), name=f"stream-{s}",
                                         daemon=True) for s in self.plan.streams]
        for thread in self.threads:
            thread.start()

    def _loop(self, name: str) -> None:
        while True:
            work = self.inbox[name].get()
            if work is None:
                return
            try:
                self._run_stream(name, work)
                self.outbox.put((name, None))
            except BaseException as exc:  # noqa: BLE001 - reported by the main thread
                work.abort.set()
                self.outbox.put((name, exc))

    def _run_stream(self, name: str, work: "_Step") -> None:
        interp, state = self.interpreter, work.state
        times = work.times[name]
        for item in self.plan.streams[name]:
            if work.abort.is_set():
                return
            work.current[name] = item
            start = time.perf_counter()
            if item.op is Opcode.WAIT:
                event = work.events[item.event]
                while not event.wait(0.05):
                    if work.abort.is_set():
                        return
            elif item.op is Opcode.RECORD:
                work.events[item.event].set()
            elif item.op is Opcode.SYNC:
                needed = self.plan.needed_before[(name, item.index)]
                with work.condition:
                    while not all(work.done[s] >= n for s, n in needed.items()):
                        if work.abort.is_set():
                            return
                        work.condition.wait(0.05)
            else:
                interp.run(state, item.op, item.node, item.microbatch)
                for buffer in item.source.frees:
                    state.buffers.pop((buffer, item.microbatch), None)
            end = time.perf_counter()
            category = self.plan.category.get(item.index)
            if category is not None:
                times[category] += end - start
            if item.op not in EVENT_OPS:
                times["compute" if item.op is Opcode.COMPUTE else "comm"] += end - start
                if self.tracing:
                    work.trace.append(TraceEvent(name, item.node, start, end,
                                                 item.microbatch, item.op,
                                                 self.flows.get((item.op, item.node), ())))
            with work.condition:
                work.done[name] += 1
                work.current[name] = None
                work.progress = time.monotonic()
                work.condition.notify_all()

    def run_step(self, step: int) -> StepResult:
        work = _Step(StepState(step), self.plan.streams, self.plan.events)
        self.interpreter.store.zero_grads()
        start = time.perf_counter()
        for name in self.plan.streams:
            self.inbox[name].put(work)
        finished: set[str] = set()
        while len(finished) < len(self.plan.streams):
            try:
                name, error = self.outbox.get(timeout=0.05)
            except queue.Empty:
                if time.monotonic() - work.progress > self.timeout:
                    work.abort.set()
                    raise Hang(self._hang_report(work, step)) from None
                continue
            finished.add(name)
            if error is not None:
                # Streams blocked inside a transfer cannot be stopped: report at once.
                work.abort.set()
                self._raise(error, work, step)
        total = time.perf_counter() - start
        times = StepTimes(total=total)
        for per_stream in work.times.values():
            for key, value in per_stream.items():
                setattr(times, key, getattr(times, key) + value)
        return StepResult(work.state, times, work.trace)

    def close(self) -> None:
        for name in self.plan.streams:
            self.inbox[name].put(None)

    def _raise(self, error: BaseException, work: "_Step", step: int):
        if isinstance(error, RuntimeError) and any(p in str(error) for p in _PEER_GONE):
            cause = str(error).split("\n")[0][:200]
            raise PeerLost(self._hang_report(work, step, lost=cause)) from error
        raise error

    def _hang_report(self, work: "_Step", step: int, lost: str | None = None) -> str:
        interp = self.interpreter
        ctx = interp.ctx
        who = (f"rank {ctx.rank} (stage {ctx.stage}, tp {ctx.tp_rank}, cp {ctx.cp_rank}, "
               f"dp {ctx.coords['dp']})")
        what = (f"lost a peer in step {step} ({lost})" if lost else
                f"made no progress for {self.timeout:g} s in step {step}")
        lines = [f"{who} {what}; its streams wait on:"]
        for stream in self.plan.streams:
            item = work.current.get(stream)
            text = "nothing (finished)" if item is None else \
                f"#{item.index} {_describe(item, interp)}"
            lines.append(f"  {stream}: {text}")
        return "\n".join(lines)


class _Step:
    """The shared state of one step's stream threads."""

    def __init__(self, state: StepState, streams, events):
        self.state = state
        self.events = {name: threading.Event() for name in events}
        self.done = {s: 0 for s in streams}
        self.current: dict[str, Expanded | None] = {s: None for s in streams}
        self.condition = threading.Condition()
        self.abort = threading.Event()
        self.progress = time.monotonic()
        self.times = {s: defaultdict(float) for s in streams}
        self.trace: list[TraceEvent] = []


class CudaExecutor:
    """Program streams as CUDA streams, issued in program order by one host thread."""

    def __init__(self, interpreter: Interpreter, timeout: float, trace: bool = False):
        self.interpreter, self.timeout, self.tracing = interpreter, timeout, trace
        self.streams = {name: torch.cuda.Stream() for name in interpreter.program.streams}
        self.items = list(expand(interpreter.program))  # the same every step

    def run_step(self, step: int) -> StepResult:
        interp = self.interpreter
        state = StepState(step)
        interp.store.zero_grads()
        events: dict[str, torch.cuda.Event] = {}
        torch.cuda.synchronize()
        start = time.perf_counter()
        for item in self.items:
            stream = self.streams[item.stream]
            if item.op is Opcode.RECORD:
                events[item.event] = torch.cuda.Event()
                events[item.event].record(stream)
            elif item.op is Opcode.WAIT:
                stream.wait_event(events[item.event])
            elif item.op is Opcode.SYNC:
                torch.cuda.synchronize()
            else:
                with torch.cuda.stream(stream):
                    interp.run(state, item.op, item.node, item.microbatch)
                for buffer in item.source.frees:
                    value = state.buffers.pop((buffer, item.microbatch), None)
                    if isinstance(value, torch.Tensor) and value.is_cuda:
                        value.record_stream(stream)  # still read there until it finishes
        torch.cuda.synchronize()
        return StepResult(state, StepTimes(total=time.perf_counter() - start))

    def close(self) -> None:
        pass
