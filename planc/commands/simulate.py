"""``planc simulate``: predict one training step of a plan or build on its topology."""

from __future__ import annotations

import json
import sys

from planc.commands import EXIT_OK, fail, load_programs, outputs_refused, the_input
from planc.commands.arguments import Command, add_input, force, output


def main(args) -> int:
    from planc.simulate import simulate
    from planc.simulate.accuracy import expected
    from planc.views import simulate_text

    refused = outputs_refused(args, (the_input(args.file),))
    if refused is not None:
        return refused
    built, status = load_programs(args, verified=True)
    if built is None:
        return status
    result = simulate(built, keep_timeline=bool(args.trace))
    accuracy = expected(built.plan)
    if args.json:
        data = result.to_json()
        data["expected_error"] = None if accuracy is None else {
            "median": accuracy.median, "largest": accuracy.largest, "runs": accuracy.runs}
        print(json.dumps(data, indent=1))
    else:
        print(simulate_text.render(result, accuracy), end="")
    if args.trace:
        from planc.simulate.trace import write

        try:
            write(args.trace, built, result)
        except OSError as exc:
            return fail(f"cannot write the trace to {args.trace}: {exc.strerror or exc}")
        print(f"trace written to {args.trace} (open it in https://ui.perfetto.dev)",
              file=sys.stderr)
    return EXIT_OK


def add_arguments(parser) -> None:
    """The arguments of planc simulate."""
    add_input(parser, "FILE|DIR")
    parser.add_argument("--json", action="store_true", help="the result as JSON")
    output(parser, "--trace", kind="simulated-trace", metavar="T.json",
           help="Chrome trace of the simulated step (Perfetto), with the tracks of planc "
           "run --trace")
    force(parser)


# planc.cli adds these to its command line, in this order.
COMMANDS = (
    Command("simulate", add_arguments, main,
            help="predict a training step: time, MFU, bubble, exposed comm, memory",
            description="Replay the rank programs of a plan or build on its topology's cost "
                        "model: the step time, TFLOP/s per GPU and MFU, the pipeline bubble, "
                        "the communication each stage waits for (per axis) and memory per "
                        "stage, without running anything."),
)
