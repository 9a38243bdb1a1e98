"""``planc simulate``: predict one training step of a plan or build on its topology."""

from __future__ import annotations

import json
import sys

from planc.commands import EXIT_OK, fail, load_programs, outputs_refused, the_input


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
