"""``planc calibrate``: measure this machine's links and write a topology (JSON)."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import sys
import tempfile
from pathlib import Path

from planc.commands import EXIT_OK, EXIT_USAGE, MAX_LOCAL_RANKS, fail, outputs_refused
from planc.host.files import held_pipe
from planc.host.interrupts import Interrupted, blocked_in_children
from planc.commands.arguments import Command, force, output

# Each repeat times every size of every measurement once more: at the default 5 a
# calibration takes seconds to a minute; a thousand, hours.
MAX_REPEATS = 1000


def _rank(env: dict[str, str], argv: list[str]) -> None:
    """One calibration rank, forked from this process once it has imported torch: eight
    ranks on two cores start in a second rather than importing torch eight times."""
    os.environ.update(env)
    from planc.runtime.calibrate import main

    sys.exit(main(argv))


def main(args) -> int:
    if not 2 <= args.ranks <= MAX_LOCAL_RANKS:
        return fail(f"--ranks must be between 2 and {MAX_LOCAL_RANKS}", EXIT_USAGE)
    if args.nodes < 1 or args.ranks % args.nodes:
        return fail(f"--nodes must divide --ranks ({args.ranks})", EXIT_USAGE)
    if not 1 <= args.repeats <= MAX_REPEATS:
        return fail(f"--repeats must be between 1 and {MAX_REPEATS}", EXIT_USAGE)
    output = Path(args.output)
    refused = outputs_refused(args)
    if refused is not None:
        return refused
    # a pipe's reader, found before a minute of measuring, and held so that it sees one
    # end of file, after the topology (planc.host.files.held_pipe)
    try:
        pipe = held_pipe(args.output)
    except OSError as exc:
        return fail(f"cannot write the calibration to {output}: {exc.strerror}; nothing was "
                    f"measured")
    try:
        return _calibrate(args, output)
    finally:
        if pipe is not None:
            os.close(pipe)


def _calibrate(args, output: Path) -> int:
    """The ranks' measurement, written to ``output``, and its summary."""
    from planc.plan.presets import calibrated_preset
    from planc.runtime.launcher.rendezvous import private_store, rank_environment, remove_store
    from planc.vocabulary.units import TIME, format_quantity

    # the ranks meet in a store only this user can open, as planc run's do; rank 0 leaves
    # its measurement beside it, and this process writes the output (the ranks write
    # nothing the command line names, so a refused output is this process's one line)
    private = tempfile.mkdtemp(prefix="planc-calibrate-")
    store = private_store(private)
    measured_file = os.path.join(private, "calibration.json")
    env = {**os.environ, **rank_environment(store), "WORLD_SIZE": str(args.ranks),
           "OMP_NUM_THREADS": "1"}
    argv = ["--devices-per-node", str(args.ranks // args.nodes), "-o", measured_file,
            "--repeats", str(args.repeats)] + ["--quick"] * args.quick
    print(f"planc: calibrating {args.ranks} gloo ranks on {args.nodes} "
          f"node{'s' * (args.nodes > 1)} of this machine", file=sys.stderr)
    workers = []
    try:
        with args.interrupts.deferred(raise_at_end=False):
            # torch once, here, without starting its thread pool (a forked child would
            # inherit a pool whose threads are gone: planc.runtime.launcher.torch_threads)
            import planc.runtime.calibrate  # noqa: F401
        args.interrupts.check()
        fork = multiprocessing.get_context("fork")
        with args.interrupts.deferred(raise_at_end=False), blocked_in_children():
            for r in range(args.ranks):
                worker = fork.Process(target=_rank, args=({**env, "RANK": str(r)}, argv))
                worker.start()
                workers.append(worker)
        args.interrupts.check()
        for w in workers:
            w.join()
        codes = [w.exitcode for w in workers]
    except Interrupted as stop:
        for w in workers:
            w.kill()
            w.join()
        return fail("interrupted; nothing was written", stop.status)
    finally:
        remove_store(store)
        text = _taken(measured_file)
        # and what a rank killed while writing left (its temporary file)
        shutil.rmtree(private, ignore_errors=True)
    failed = next((code for code in codes if code), None)
    if failed is not None or text is None:
        return fail("the calibration ranks wrote no measurement; nothing was written"
                    if failed is None else f"a calibration rank {_ended(failed)}; nothing "
                    f"was written")
    from planc.host.files import write_atomically

    try:
        write_atomically(output, text)
    except OSError as exc:
        return fail(f"cannot write the calibration to {output}: {exc.strerror or exc}")
    data = json.loads(text)
    preset = calibrated_preset(data, str(output))
    for name, bandwidth, latency, tunings in (
            ("intra-node", preset.intra_bandwidth, preset.intra_latency,
             preset.intra_collectives),
            ("inter-node", preset.inter_bandwidth, preset.inter_latency,
             preset.inter_collectives)):
        level = name.split("-")[0]
        measured = level in data["measured"]
        # an unmeasured level holds the measured one's figures, marks included
        points = data["measured"].get(level) or data["measured"].get("intra", {})
        timings = points.get("timings", {})
        print(f"{name}: {bandwidth / 1e9:.3g} GB/s"
              f"{interval_text(bandwidth, timings.get('point_to_point'))} and "
              f"{format_quantity(latency, TIME)} per message"
              + ("" if measured else " (not measured: the other link's figures)")
              + (UNSTEADY if fixed_cost_bound(points.get("point_to_point")) else ""))
        for tuning in tunings:
            print(f"  {tuning.kind}: {tuning.bandwidth / 1e9:.3g} GB/s bus bandwidth"
                  f"{interval_text(tuning.bandwidth, timings.get(tuning.kind))}, "
                  f"{format_quantity(tuning.latency, TIME)} per call"
                  + (UNSTEADY if fixed_cost_bound(points.get(tuning.kind)) else ""))
    backward = preset.topology(1).device.gradient_step_overhead
    print(f"compute: {preset.flops['fp32'] / 1e9:.3g} GFLOP/s per rank, "
          f"{format_quantity(preset.overhead, TIME)} per forward instruction and "
          f"{format_quantity(backward, TIME)} per backward one beyond its arithmetic\n"
          f"{_operators(preset.overheads)}"
          + (f"exponentials: {preset.exp_rate / 1e9:.3g} billion a second per rank\n"
             if preset.exp_rate else "") +
          f"hand-off: {format_quantity(preset.handoff, TIME)} per transfer between the "
          f"runtime's stream threads\n"
          f"overlap: {preset.overlap:.2f} of an all_reduce hidden behind a matrix multiply\n"
          + (f"written to {output}; use it with topology {{ preset = \"PATH\" }}, PATH "
             f"relative to the plan file ({os.path.abspath(output)} from anywhere)"
             if output.is_file() else f"written into {output}"))
    return EXIT_OK


def _ended(code: int) -> str:
    """How a rank that failed ended, from its exit code (negative: the signal that
    killed it, as multiprocessing reports one)."""
    if code < 0:
        import signal

        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def _taken(path: str) -> bytes | None:
    """The measurement rank 0 left at ``path`` (None when it left none), removed."""
    try:
        with open(path, "rb") as handle:
            return handle.read()
    except FileNotFoundError:
        return None
    finally:
        if os.path.exists(path):
            os.unlink(path)


def add_arguments(parser) -> None:
    """The arguments of planc calibrate."""
    output(parser, "-o", "--output", kind="topology", required=True, metavar="FILE",
           help="the topology to write (JSON)")
    force(parser)
    parser.add_argument("--ranks", type=int, default=2, metavar="N",
                        help="ranks to start [2]")
    parser.add_argument("--nodes", type=int, default=1, metavar="K",
                        help="split the ranks into K nodes of consecutive ranks [1]")
    parser.add_argument("--repeats", type=int, default=5, metavar="R",
                        help="timed repetitions per size [5]")
    parser.add_argument("--quick", action="store_true",
                        help="messages of 4 KB to 1 MB, a small model's, instead of up "
                             "to 16 MB: seconds rather than a minute (make demo)")


# planc.cli adds these to its command line, in this order.
COMMANDS = (
    Command("calibrate", add_arguments, main,
            help="measure this machine's links and write a topology plans can use",
            description="Start ranks on this machine, measure the latency and bandwidth of "
                        "all-reduces inside and between (emulated) nodes and the compute rate, "
                        "and write a topology that a plan names with topology { preset = "
                        "\"FILE\" }, so that the cost model predicts this machine. On a cluster "
                        "run `python -m planc.runtime.calibrate` on every node instead "
                        "(docs/routes.md).",
            keeps_collector=True),
)


# Where the largest message took less than this much longer than the smallest, its
# time is mostly the call's fixed cost: the bandwidth is the slope of a few percent of
# the times, and noise moves it by ten times and more (eight calibrations of 8 ranks on 2
# cores: 9.9x to 25.6x apart). Said beside the figure, not hidden.
STEADY_GROWTH = 0.25
UNSTEADY = " (the calls' fixed cost at every size measured: the bandwidth is not a steady figure)"


def fixed_cost_bound(points) -> bool:
    """Whether a collective's measured (bytes, seconds) points are dominated by the
    call's fixed cost: the largest size took under STEADY_GROWTH more than the smallest."""
    if not isinstance(points, list) or len(points) < 2:
        return False
    (_, smallest), (_, largest) = min(points), max(points)
    return largest < smallest * (1 + STEADY_GROWTH)


def interval_text(bandwidth: float, timings) -> str:
    """" (95 % interval: 1.5 to 5.1 GB/s over 9 timings)" for a bandwidth, from the
    timings behind it (planc.runtime.calibrate_fit); nothing where they cannot say (fewer
    than three timings, or a topology calibrated before timings were kept)."""
    from planc.runtime.calibrate_fit import bandwidth_interval

    interval = bandwidth_interval(timings)
    if interval is None:
        return ""
    count, lowest, highest = interval
    low = f"{bandwidth * lowest / 1e9:.3g}"
    if highest is None:
        return f" (95 % interval: {low} GB/s or more, over {count} timings)"
    return f" (95 % interval: {low} to {bandwidth * highest / 1e9:.3g} GB/s over {count} " \
        f"timings)"


def _operators(overheads: tuple[tuple[str, float, float], ...]) -> str:
    """The line of the operators' own fixed costs, if any were measured."""
    from planc.vocabulary.units import TIME, format_quantity

    if not overheads:
        return ""
    slowest = max(overheads, key=lambda row: row[1] + row[2])
    return (f"operators: {len(overheads)} timed on the runtime's own instructions, "
            f"{format_quantity(min(r[1] for r in overheads), TIME)} to "
            f"{format_quantity(max(r[1] for r in overheads), TIME)} forward and "
            f"{format_quantity(min(r[2] for r in overheads), TIME)} to "
            f"{format_quantity(max(r[2] for r in overheads), TIME)} a gradient step beyond "
            f"their arithmetic (the most: {slowest[0]})\n")
