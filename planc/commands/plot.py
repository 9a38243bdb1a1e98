"""``planc plot M.jsonl [M2.jsonl ...] -o PLOT.png``: the loss (or another metric) of
``planc run --metrics`` files against the step, one curve per run, labelled with its
plan's name (docs/metrics.md). Needs matplotlib, never torch."""

from __future__ import annotations

import os
import sys

from planc.commands import EXIT_OK, EXIT_USAGE, fail, outputs_refused
from planc.commands.arguments import Command, force, output, path
from planc.views.curves import METRICS as CURVE_METRICS

FORMATS = {".png": "png", ".svg": "svg"}


def main(args) -> int:
    from planc.host.files import write_atomically
    from planc.data.metrics_file import read_metrics
    from planc.host.output_kinds import PLOT, marked
    from planc.views.curves import CurveError, curve, distinct, draw

    refused = outputs_refused(args, [("a metrics file", path)
                                     for path in args.metrics])
    if refused is not None:
        return refused
    image_format = FORMATS.get(os.path.splitext(args.output)[1].lower())
    if image_format is None:
        return fail(f"-o {args.output}: planc plot writes a .png or an .svg file; name one",
                    EXIT_USAGE)
    curves, warnings = [], []
    for path in args.metrics:
        metrics = read_metrics(path)
        if metrics.problem:
            return fail(metrics.problem)
        try:
            curves.append(curve(metrics.records, args.metric, path))
        except CurveError as exc:
            return fail(str(exc))
        warnings += [metrics.warning] if metrics.warning else []
        if all(value != value for value in curves[-1].values):  # NaN: a gap where it is
            warnings.append(f"{path}: every step's {args.metric} is NaN or infinite (the "
                            f"run diverged from its first step): its curve has no point")
    try:
        image = draw(distinct(curves, args.metrics), args.metric, image_format)
    except ImportError as exc:
        if (exc.name or "").split(".")[0] != "matplotlib":
            raise
        return fail("planc plot needs matplotlib, which is not installed: pip install "
                    "'planc[run]'")
    try:
        write_atomically(args.output, marked(image, image_format, PLOT.generator))
    except OSError as exc:
        return fail(f"cannot write {args.output}: {exc.strerror or exc}")
    for warning in warnings:  # once the image is written: a failure prints its error alone
        print(f"planc: warning: {warning}", file=sys.stderr)
    print(f"planc: {args.metric} of {len(curves)} run{'s' * (len(curves) > 1)} written to "
          f"{args.output}", file=sys.stderr)
    return EXIT_OK


def add_arguments(parser) -> None:
    """The arguments of planc plot."""
    parser.add_argument("metrics", nargs="+", metavar="M.jsonl", type=path,
                        help="planc run --metrics files")
    output(parser, "-o", "--output", kind="plot", required=True, metavar="PLOT.png",
           help="the image to write: .png or .svg")
    force(parser)
    parser.add_argument("--metric", default="loss", choices=tuple(CURVE_METRICS),
                        help="what to draw [loss]")


# planc.cli adds these to its command line, in this order.
COMMANDS = (
    Command("plot", add_arguments, main,
            help="draw the loss of planc run --metrics files against the step",
            description="Draw one curve per planc run --metrics file, labelled with its plan's "
                        "name: the loss against the step, or another metric of every step "
                        "(docs/metrics.md). Needs matplotlib (planc[run])."),
)
