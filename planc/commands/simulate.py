"""``planc simulate``: predict one training step of a plan or build on its topology."""

from __future__ import annotations

import json
import sys

from planc.commands import EXIT_OK, EXIT_USAGE, fail, load_programs, outputs_refused, the_input
from planc.commands.arguments import Command, add_input, force, output
from planc.data.metrics_file import MAX_STEP


def main(args) -> int:
    from planc.simulate import simulate
    from planc.simulate.accuracy import expected
    from planc.views import simulate_text

    problem = resilience_problem(args)
    if problem is not None:
        return fail(problem, EXIT_USAGE)
    refused = outputs_refused(args, (the_input(args.file),))
    if refused is not None:
        return refused
    if args.imbalance_from:
        problem = measured_imbalance(args)
        if problem is not None:
            return fail(problem)
    built, status = load_programs(args, verified=True)
    if built is None:
        return status
    measured_on = getattr(args, "imbalance_plans", None)
    if measured_on and built.plan.name not in measured_on:
        named = ", ".join(name if name.isprintable() else ascii(name) for name in measured_on)
        print(f"planc: warning: {args.imbalance_from} records a run of {named}"  # text of a file
              f", not of {built.plan.name}: its imbalance is another plan's", file=sys.stderr)
    result = simulate(built, keep_timeline=bool(args.trace))
    accuracy = expected(built.plan)
    priced = None
    if args.mtbf is not None or args.checkpoint_every is not None:
        from planc.estimate.resilience import price

        priced = price(built.plan, result.step_seconds, every=args.checkpoint_every,
                       **pricing(args))
    if args.json:
        data = result.to_json()
        data["expected_error"] = None if accuracy is None else {
            "median": accuracy.median, "largest": accuracy.largest, "runs": accuracy.runs}
        if priced is not None:
            data["checkpoints_and_failures"] = priced.to_json()
        print(json.dumps(data, indent=1))
    else:
        print(simulate_text.render(result, accuracy), end="")
        if priced is not None:
            from planc.views import resilience_text

            print(resilience_text.render(priced, pricing(args)["storage_bytes_per_s"]),
                  end="")
    if args.trace:
        from planc.simulate.trace import write

        try:
            write(args.trace, built, result)
        except OSError as exc:
            return fail(f"cannot write the trace to {args.trace}: {exc.strerror or exc}")
        print(f"trace written to {args.trace} (open it in https://ui.perfetto.dev)",
              file=sys.stderr)
    return EXIT_OK


# What the pricing options may be: far past any cluster, and never an overflow in a product.
LIMITS = {"--mtbf": (1e-6, 1e9), "--storage": (1e-6, 1e9), "--restart": (0.0, 1e9)}


def resilience_problem(args) -> str | None:
    """Why the options that price checkpoints and failures cannot be used, or None."""
    for flag, value in (("--mtbf", args.mtbf), ("--storage", args.storage),
                        ("--restart", args.restart)):
        low, high = LIMITS[flag]
        if value is not None and not low <= value <= high:  # also refuses nan
            return f"{flag} {value:g}: must be a number from {low:g} to {high:g}"
    every = getattr(args, "checkpoint_every", None)
    if every is not None and not 1 <= every <= MAX_STEP:
        return "--checkpoint-every must be a number of steps from 1 to 10^12"
    if args.mtbf is None and every is None:  # nothing is priced: the option would do nothing
        needs = "--mtbf" if not hasattr(args, "checkpoint_every") else \
            "--mtbf or --checkpoint-every"
        for flag, given in (("--checkpoint-async", args.checkpoint_async),
                            ("--storage", args.storage is not None),
                            ("--restart", args.restart is not None)):
            if given:
                return f"{flag} prices checkpoints, which only {needs} asks for"
    return None


def pricing(args) -> dict:
    """planc.estimate.resilience.price's settings from --mtbf (hours), --checkpoint-async,
    --storage (GB/s) and --restart (each its default where not given)."""
    from planc.estimate.resilience import RESTART_S, STORAGE_BYTES_PER_S

    storage = STORAGE_BYTES_PER_S if args.storage is None else args.storage * 1e9
    return {"mtbf_seconds": None if args.mtbf is None else args.mtbf * 3600,
            "asynchronous": args.checkpoint_async, "storage_bytes_per_s": storage,
            "restart_seconds": RESTART_S if args.restart is None else args.restart}


def _without_experts(args) -> str | None:
    """"plan X is model gpt, which has no experts" where the plan file (with the command
    line's --set) loads and its model takes no ``imbalance``; None otherwise (a plan that
    does not load says why when the command loads it)."""
    from planc.lang import load_file
    from planc.models import FAMILIES

    loaded = load_file(args.file, getattr(args, "set", None) or ())
    if not loaded.ok or "imbalance" in FAMILIES[loaded.plan.model.family].keys:
        return None
    return f"plan {loaded.plan.name} is model {loaded.plan.model.family}, which has no experts"


def measured_imbalance(args) -> str | None:
    """--imbalance-from M.jsonl: the median ``ep_imbalance`` of a run's steps becomes the
    plan's ``model.imbalance`` (an override, as --set), or why it cannot."""
    import os
    import statistics

    from planc.data.metrics_file import read_metrics
    from planc.lang.overrides import Given

    if os.path.isdir(args.file):
        return (f"--imbalance-from sets model.imbalance, an override of the plan file: give "
                f"the plan file, not the build {args.file}")
    without = _without_experts(args)
    if without is not None:
        return (f"--imbalance-from sets model.imbalance, the routing's imbalance of a "
                f"mixture of experts, and {without}")
    records, problem, cut = read_metrics(args.imbalance_from)
    if problem:
        return problem
    if cut:  # the records are used: say where they stopped, as plot and report do
        print(f"planc: warning: {cut}", file=sys.stderr)
    measured = [r["ep_imbalance"] for r in records if r.get("ep_imbalance") is not None]
    if not measured:
        return (f"{args.imbalance_from} records no ep_imbalance: planc run writes it for a "
                f"plan whose experts are split over ep")
    value = statistics.median(measured)  # at least 1: the reader refuses less
    args.set = [*(args.set or []), Given(f"model.imbalance={value:.6g}",
                                         f"--imbalance-from {args.imbalance_from}:")]
    args.imbalance_plans = sorted({r["plan"] for r in records if r.get("plan")})
    print(f"planc: model.imbalance = {value:.6g}, the median ep_imbalance of "
          + (f"the {len(measured)} steps" if len(measured) != 1 else "the one step")
          + f" in {args.imbalance_from}", file=sys.stderr)
    return None


def add_resilience_arguments(parser, checkpoints: bool = True) -> None:
    """--mtbf and what prices a checkpoint (planc.estimate.resilience)."""
    from planc.estimate.resilience import RESTART_S, STORAGE_BYTES_PER_S

    parser.add_argument("--mtbf", type=float, metavar="HOURS",
                        help="the job's mean time between failures, in hours (Llama 3 405B's "
                        "pre-training on 16,384 GPUs: 3.1): price the time lost to failures "
                        "and the best checkpoint interval")
    if checkpoints:
        parser.add_argument("--checkpoint-every", type=int, metavar="N",
                            help="price a checkpoint every N steps [with --mtbf: Young's "
                            "interval]")
    parser.add_argument("--checkpoint-async", action="store_true",
                        help="price asynchronous checkpoints (planc run --checkpoint-async)")
    parser.add_argument("--storage", type=float, metavar="GB/s",
                        help="write rate of the file system per node "
                        f"[{STORAGE_BYTES_PER_S / 1e9:.2f}: Llama 3's 2 TB/s over 2,048 nodes]")
    parser.add_argument("--restart", type=float, metavar="S",
                        help="seconds from a failure to training again, before the "
                        f"checkpoint is read [{RESTART_S:g}: measured here, bench/recovery.py]")


def add_arguments(parser) -> None:
    """The arguments of planc simulate."""
    add_input(parser, "FILE|DIR")
    parser.add_argument("--json", action="store_true", help="the result as JSON")
    add_resilience_arguments(parser)
    parser.add_argument("--imbalance-from", metavar="M.jsonl",
                        help="take model.imbalance from a planc run --metrics file of the "
                        "plan: the median of its steps' ep_imbalance")
    output(parser, "--trace", kind="simulated-trace", metavar="T.json",
           help="Chrome trace of the simulated step (Perfetto), with the tracks of planc "
           "run --trace")
    force(parser)


# planc.cli adds these to its command line, in this order.
COMMANDS = (
    Command("simulate", add_arguments, main,
            help="predict a training step: time, MFU, bubble, exposed comm, memory",
            description="Replay the rank programs of a plan or build on its topology's cost "
                        "model: the step time, TFLOP/s per device and MFU, the pipeline bubble, "
                        "the communication each stage waits for (per axis) and memory per "
                        "stage, without running anything."),
)
