"""Run a rank program, step after step: its instructions on their streams.

Two backends behind one interface. On CPU (gloo) every program stream is a thread,
created once per run, that runs the function generated for it from the program
(planc.program.step_code: one statement per instruction of the step, microbatches
unrolled, checked to issue exactly the program's instructions in order): ``record`` sets
an event, ``wait`` blocks only its own stream, and collectives are issued asynchronously
and waited on through their work handles, so computation and communication overlap as
on a GPU (PyTorch releases the interpreter lock inside its kernels and gloo progresses
on its own threads). Collectives of a group are issued by a single stream in program
order, so every member issues them in the same order. On CUDA (NCCL) one host thread
issues every instruction in program order onto a ``torch.cuda.Stream`` per program
stream, with ``torch.cuda.Event`` for record and wait.

Each step reports its wall time and where the compute stream spent it: computing,
running or waiting for collectives (exposed communication), or waiting for a pipeline
receive. A step whose streams finish no instruction for ``timeout`` seconds raises
:class:`Hang`, whose message lists what every stream was waiting for, in the spirit of
NCCL's flight recorder.
"""

from __future__ import annotations

import dataclasses
import functools
import queue
import threading
import time
from dataclasses import dataclass, field

import torch

from planc.program import step_code
from planc.program.expansion import Expanded, expand
from planc.program.names import Stream
from planc.program.program import EVENT_NAMING_OPS, EVENT_OPS, Opcode
from planc.runtime.engine.interpreter import Interpreter, StepState
from planc.runtime.launcher.torch_threads import own_intra_op_threads
from planc.data.trace import Flow, flows_of


class Hang(RuntimeError):
    """No progress for too long; the message says what each stream waits for."""


class PeerLost(RuntimeError):
    """A transfer failed because a peer went away; the message says what each stream
    was waiting for."""


PEER_GONE = ("Connection closed", "Connection reset", "Broken pipe", "Timed out",
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
    route: str | None = None  # the recipe a collective ran (tree, hierarchical), if any


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


def _routes(interp: Interpreter) -> dict[tuple[str, str], str]:
    """The route of every collective bound to a recipe of the build's route table (a
    tree or hierarchical route, run as its steps: planc.runtime.engine.routes), for the
    trace to show which ran."""
    return {(op, node): bound.call.operands.route for (op, node), bound in
            interp.bound.items() if op is not Opcode.COMPUTE and bound.call.route is not None}


class _Aborted(Exception):
    """Another stream failed: this one stops at its next wait."""


class StreamThreads:
    """One thread per program stream name, created on first use and kept for the run,
    each running the stream functions it is handed in turn. The compute stream's thread
    gets the rank's ``threads`` intra-op threads, every other one a single thread. The
    evaluation's executor runs on the training's threads: a compute thread of its own
    with the rank's count would be a second OpenMP team (the slowdown CpuExecutor
    describes), and one with a single thread would evaluate on one core of many."""

    def __init__(self, threads: int):
        self.threads = threads
        self._inboxes: dict[str, queue.SimpleQueue] = {}

    def inbox(self, stream: str) -> queue.SimpleQueue:
        """The queue of ``stream``'s thread: it runs each callable put there, and stops
        at None."""
        if stream not in self._inboxes:
            inbox: queue.SimpleQueue = queue.SimpleQueue()
            intra_op = self.threads if stream == Stream.COMPUTE else 1
            threading.Thread(target=self._loop, args=(inbox, intra_op), daemon=True,
                             name=f"stream-{stream}").start()
            self._inboxes[stream] = inbox
        return self._inboxes[stream]

    @staticmethod
    def _loop(inbox: queue.SimpleQueue, intra_op: int) -> None:
        own_intra_op_threads(intra_op)
        while True:
            job = inbox.get()
            if job is None:
                return
            job()

    def close(self) -> None:
        for inbox in self._inboxes.values():
            inbox.put(None)


class CpuExecutor:
    """Program streams as threads, created once, each running the function generated
    for it from the program (planc.program.step_code, proven to issue the program's
    instructions before it runs); see the module docstring.

    The compute stream gets the rank's ``threads`` intra-op threads, every other stream
    one, and the rank's main thread must run its operators on one (planc.runtime.worker)
    while the streams run. Each thread that runs a parallel operator with more than one
    thread keeps a team of OpenMP threads of its own (libgomp), and a team beside
    another one, even an idle one, runs every parallel region about 2.5 times slower:
    on 2 cores a 524,288-value multiply took 28 µs on a thread whose team was the
    process's only one and 73 µs beside the main thread's idle team
    (bench/omp_teams.py; docs/performance.md has a rank's step before and after). The
    transfer streams' own work (copies into and out of buckets) is small beside the
    compute, and gloo runs the collectives on threads of its own.
    """

    def __init__(self, interpreter: Interpreter, timeout: float, trace: bool = False,
                 threads: int = 1, shared: "StreamThreads | None" = None):
        self.interpreter, self.timeout, self.tracing = interpreter, timeout, trace
        self.code = step_code.generate(interpreter.program, trace)
        checked = step_code.check(self.code, interpreter.program)
        namespace: dict = {}
        exec(compile(checked, f"<planc step of rank {interpreter.ctx.rank}>", "exec"),
             namespace)
        self.functions = [namespace[stream.function] for stream in self.code.streams]
        self.items = self.code.items()
        self.calls: list = [None] * (max(self.items, default=-1) + 1)
        for index, item in self.items.items():
            if item.op not in EVENT_OPS:
                self.calls[index] = interpreter.instruction(item.op, item.node,
                                                            item.microbatch,
                                                            item.source.frees)
        self.flows = _flows(interpreter) if trace else {}
        self.routes = _routes(interpreter) if trace else {}
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        # the threads are the run's (``shared``: the training's, for its evaluation)
        self.owns_threads = shared is None
        self.streams = StreamThreads(threads) if shared is None else shared
        self.inbox = [self.streams.inbox(stream.name) for stream in self.code.streams]

    def _run_stream(self, k: int, work: "_Step") -> None:
        try:
            spent = self.functions[k](work.state, self.calls, work.events, work.wait,
                                      work.sync, work.check, work.done,
                                      time.perf_counter, work.trace.append)
            self.outbox.put((k, spent, None))
        except _Aborted:
            self.outbox.put((k, None, None))
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            work.abort.set()
            self.outbox.put((k, None, exc))

    def run_step(self, step: int) -> StepResult:
        work = _Step(StepState(step), self.code)
        start = time.perf_counter()  # the step's work includes zeroing its gradients
        self.interpreter.store.zero_grads()
        for k, inbox in enumerate(self.inbox):
            inbox.put(functools.partial(self._run_stream, k, work))
        times = StepTimes()
        finished, seen, progress = 0, 0, time.monotonic()
        while finished < len(self.inbox):
            try:
                k, spent, error = self.outbox.get(timeout=0.05)
            except queue.Empty:
                done = sum(work.done)  # instructions finished: progress is a change
                if done != seen:
                    seen, progress = done, time.monotonic()
                elif time.monotonic() - progress > self.timeout:
                    work.abort.set()
                    raise Hang(self._hang_report(work, step)) from None
                continue
            finished += 1
            progress = time.monotonic()
            if error is not None:
                # Streams blocked inside a transfer cannot be stopped: report at once.
                work.abort.set()
                self._raise(error, work, step)
            if spent is not None:
                compute, comm, exposed, pipeline = spent
                times.compute += compute
                times.comm += comm
                times.exposed_comm += exposed
                times.pipeline_wait += pipeline
        times.total = time.perf_counter() - start
        trace = []
        for index, begin, end in work.trace:
            item = self.items[index]
            key = (item.op, item.node)
            trace.append(TraceEvent(item.stream, item.node, begin, end, item.microbatch,
                                    item.op, self.flows.get(key, ()), self.routes.get(key)))
        return StepResult(work.state.settle(), times, trace)

    def close(self) -> None:
        if self.owns_threads:
            self.streams.close()

    def _raise(self, error: BaseException, work: "_Step", step: int):
        if isinstance(error, RuntimeError) and any(p in str(error) for p in PEER_GONE):
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
        for k, stream in enumerate(self.code.streams):
            done = work.done[k]
            text = "nothing (finished)" if done >= len(stream.items) else \
                f"#{stream.items[done].index} {_describe(stream.items[done], interp)}"
            lines.append(f"  {stream.name}: {text}")
        return "\n".join(lines)


class _Step:
    """The shared state of one step's stream threads: its events, each stream's count of
    finished instructions, the abort flag, the trace records."""

    def __init__(self, state: StepState, code: step_code.StepCode):
        self.state = state
        self.events = [threading.Event() for _ in code.events]
        self.done = [0] * len(code.streams)
        self.syncs = code.syncs
        self.abort = threading.Event()
        self.trace: list[tuple[int, float, float]] = []

    def wait(self, event: threading.Event) -> None:
        while not event.wait(0.05):
            if self.abort.is_set():
                raise _Aborted

    def check(self) -> None:
        """Stop this stream if another one failed."""
        if self.abort.is_set():
            raise _Aborted

    def sync(self, index: int) -> None:
        """Until every other stream finished what it issues before instruction ``index``."""
        needed = self.syncs[index]
        while not all(self.done[k] >= n for k, n in needed):
            if self.abort.is_set():
                raise _Aborted
            time.sleep(0.0005)


def tensors_in(value, depth: int = 0):
    """Every tensor a buffer's value holds: itself, or those of a dict's values, a list's
    or tuple's items and a dataclass's fields (a backward step's gradients by port, a
    mixture's Routed rows and their Hops), so that each is kept from the caching
    allocator until the stream that last reads it has finished: the allocator hands a
    freed block back to its own stream at once unless it was recorded on the others
    (torch.Tensor.record_stream)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif depth > 8 or value is None or isinstance(value, (str, bytes, int, float, bool)):
        return
    elif isinstance(value, dict):
        for item in value.values():
            yield from tensors_in(item, depth + 1)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from tensors_in(item, depth + 1)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield from tensors_in(getattr(value, f.name), depth + 1)


class CudaExecutor:
    """Program streams as CUDA streams, issued in program order by one host thread."""

    def __init__(self, interpreter: Interpreter, timeout: float, trace: bool = False):
        self.interpreter, self.timeout, self.tracing = interpreter, timeout, trace
        self.streams = {name: torch.cuda.Stream() for name in interpreter.program.streams}
        self.items = list(expand(interpreter.program))  # the same every step

    def run_step(self, step: int) -> StepResult:
        interp = self.interpreter
        state = StepState(step)
        torch.cuda.synchronize()  # the previous step's kernels are done before the clock
        start = time.perf_counter()  # the step's work includes zeroing its gradients
        interp.store.zero_grads()
        events: dict[str, torch.cuda.Event] = {}
        torch.cuda.synchronize()  # zeroed before any program stream adds into them
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
                    value, let_go = interp.release(state, buffer, item.microbatch)
                    for tensor in tensors_in(value):  # a dict of gradients, a mixture's rows
                        if tensor.is_cuda:
                            tensor.record_stream(stream)  # read there until it finishes
                    if let_go is not None:  # recorded first: freed once the stream is done
                        let_go()
        torch.cuda.synchronize()
        return StepResult(state.settle(), StepTimes(total=time.perf_counter() - start))

    def close(self) -> None:
        pass
