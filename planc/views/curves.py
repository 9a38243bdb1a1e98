"""Curves of ``planc run --metrics`` files: one value per step of each run, drawn with
matplotlib (``planc plot``, and the loss curve of ``planc report --metrics``).

matplotlib's object-oriented API only (a Figure and its Agg canvas, no pyplot): nothing
global is set, and nothing here imports torch.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass

# The numeric keys of a step's record planc plot draws, and their axis labels.
METRICS = {"loss": "loss", "eval_loss": "evaluation loss", "lr": "learning rate",
           "grad_norm": "gradient norm",
           "tokens_per_s": "tokens/s", "tflops_per_device": "TFLOP/s per device",
           "mfu": "MFU", "time_s": "step time (s)", "exposed_comm_s": "exposed communication (s)",
           "max_rss_mb": "peak resident memory, largest rank (MiB)"}
WIDTH_IN, HEIGHT_IN, DPI = 8.0, 4.5, 100  # a PNG of 800 x 450 pixels
LINE_STYLES = ("-", "--", ":", "-.")  # runs that coincide stay visible on top of each other


class CurveError(ValueError):
    """A metrics file without the values a curve needs; the message says which."""


@dataclass(frozen=True)
class Curve:
    label: str  # the run's plan name (the records' "plan"), or its file's name
    steps: tuple[int, ...]  # 1 for a run's first step, as planc run's progress line counts
    values: tuple[float, ...]


def curve(records: list[dict], metric: str, path: str) -> Curve:
    """The values of ``metric`` against the step in the records of one ``planc run
    --metrics`` file (read by planc.metrics_file.read_metrics): every step has a loss;
    another metric is drawn at the steps that have it (eval_loss where the run evaluated)."""
    steps, values = [], []
    for line, record in enumerate(records, 1):
        step, value = record.get("step"), record.get(metric)
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise CurveError(f"{path}: record {line} has no step number; it is not what "
                             f"planc run --metrics writes")
        if metric != "loss" and value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise CurveError(f"{path}: record {line} (step {step + 1}) has no {metric}"
                             + ("" if value is None else " that is a number"))
        steps.append(step + 1)
        values.append(float(value))
    if not steps:
        raise CurveError(f"{path}: no step has {metric}: the run did not record it "
                         f"(planc plot --metric {metric} needs a run that did)")
    plans = {record.get("plan") for record in records}
    (plan,) = plans if len(plans) == 1 else (None,)
    label = plan if isinstance(plan, str) and plan else os.path.basename(path)
    return Curve(label, tuple(steps), tuple(values))


def distinct(curves: list[Curve], paths: list[str]) -> list[Curve]:
    """The curves, those of the same plan told apart by their file's name."""
    labels = [c.label for c in curves]
    return [Curve(f"{c.label} ({os.path.basename(p)})", c.steps, c.values)
            if labels.count(c.label) > 1 else c for c, p in zip(curves, paths)]


def draw(curves: list[Curve], metric: str, image_format: str = "png") -> bytes:
    """The curves on one set of axes, a legend of their labels, as a PNG or an SVG."""
    from matplotlib import rc_context
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    figure = Figure(figsize=(WIDTH_IN, HEIGHT_IN), dpi=DPI, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    for k, c in enumerate(curves):
        axes.plot(c.steps, c.values, LINE_STYLES[k % len(LINE_STYLES)],
                  linewidth=2.2 - 0.4 * (k % len(LINE_STYLES)), label=c.label)
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole
    axes.set_xlabel("step")
    axes.set_ylabel(METRICS.get(metric, metric))
    axes.set_title(f"{METRICS.get(metric, metric)} per step")
    axes.grid(True, alpha=0.3)
    axes.legend()
    out = io.BytesIO()
    # no timestamps or generator versions: the same curves give the same file
    metadata = {"Date": None} if image_format == "svg" else {"Software": None}
    with rc_context({"svg.hashsalt": "planc"}):  # an SVG's ids from its content, not random
        figure.savefig(out, format=image_format, dpi=DPI, metadata=metadata)
    return out.getvalue()


def inline_svg(curves: list[Curve], metric: str) -> str:
    """The curves as an ``<svg>`` element to place in an HTML page."""
    text = draw(curves, metric, "svg").decode("utf-8")
    return text[text.index("<svg"):]
