"""Curves of ``planc run --metrics`` files: one value per step of each run, drawn with
matplotlib (``planc plot``, and the loss curve of ``planc report --metrics``).

matplotlib's object-oriented API only (a Figure and its Agg canvas, no pyplot): nothing
global is set, and nothing here imports torch.
"""

from __future__ import annotations

import io
import math
import os
from dataclasses import dataclass

# The numeric keys of a step's record planc plot draws, and their axis labels.
METRICS = {"loss": "loss", "eval_loss": "evaluation loss", "eval_s": "evaluation time (s)",
           "lr": "learning rate",
           "grad_norm": "gradient norm",
           "tokens_per_s": "tokens/s", "tflops_per_device": "TFLOP/s per device",
           "mfu": "MFU", "time_s": "step time (s)", "exposed_comm_s": "exposed communication (s)",
           "max_rss_mb": "peak resident memory, largest rank (MiB)",
           # a mixture of experts: its routing's balance, and what its capacity dropped
           "ep_imbalance": "busiest ep rank's rows / mean",
           "moe_expert_imbalance": "busiest expert's load / mean",
           "moe_dropped": "share of (token, expert) pairs dropped"}
WIDTH_IN, HEIGHT_IN, DPI = 8.0, 4.5, 100  # a PNG of 800 x 450 pixels
LINE_STYLES = ("-", "--", ":", "-.")  # runs that coincide stay visible on top of each other
MAX_LABEL = 48  # characters of a curve's label
# entries of a legend: more do not fit beside the axes of a WIDTH_IN x HEIGHT_IN figure
# (300 runs' collapsed the axes to nothing); the rest are counted in the last entry
MAX_LEGEND = 10
# Text from a file is drawn as it is, never as markup: no TeX (a user's matplotlibrc may
# turn it on), and every Text is made with parse_math=False (no mathtext for "$...$").
PLAIN_TEXT = {"text.usetex": False, "svg.hashsalt": "planc"}  # an SVG's ids from its content


class CurveError(ValueError):
    """A metrics file without the values a curve needs; the message says which."""


@dataclass(frozen=True)
class Curve:
    label: str  # the run's plan name (the records' "plan"), or its file's name
    steps: tuple[int, ...]  # 1 for a run's first step, as planc run's progress line counts
    values: tuple[float, ...]


def curve(records: list[dict], metric: str, path: str) -> Curve:
    """The values of ``metric`` against the step in the records of one ``planc run
    --metrics`` file (read, and its steps and numbers checked, by
    planc.data.metrics_file.read_metrics): every step has a loss; another metric is drawn at the
    steps that have it (eval_loss where the run evaluated). A loss that is NaN or infinite
    (a run that diverged) is drawn as a gap."""
    steps, values = [], []
    for record in records:
        step, value = record["step"], record.get(metric)
        if metric != "loss" and value is None:
            continue
        if value is None:
            raise CurveError(f"{path}: the record of step {step + 1} has no {metric}")
        steps.append(step + 1)
        values.append(float(value) if math.isfinite(value) else math.nan)
    if not steps:
        raise CurveError(f"{path}: no step has {metric}: the run did not record it "
                         f"(planc plot --metric {metric} needs a run that did)")
    plans = {record.get("plan") for record in records}
    (plan,) = plans if len(plans) == 1 else (None,)
    label = plan if isinstance(plan, str) and plan else os.path.basename(path)
    return Curve(plain(label), tuple(steps), tuple(values))


def plain(text: str) -> str:
    """A label from a file as a legend shows it: printable characters only (a control
    character has no glyph; matplotlib warns), at most MAX_LABEL of them (a legend as wide
    as a long name takes minutes to lay out)."""
    text = "".join(c if c.isprintable() else "?" for c in text)
    return text if len(text) <= MAX_LABEL else text[:MAX_LABEL - 1] + "\u2026"


def distinct(curves: list[Curve], paths: list[str]) -> list[Curve]:
    """The curves, those of the same plan told apart by their file's name."""
    labels = [c.label for c in curves]
    return [Curve(f"{c.label} ({plain(os.path.basename(p))})", c.steps, c.values)
            if labels.count(c.label) > 1 else c for c, p in zip(curves, paths)]


def draw(curves: list[Curve], metric: str, image_format: str = "png") -> bytes:
    """The curves on one set of axes, a legend of their labels, as a PNG or an SVG."""
    from matplotlib import rc_context
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    out = io.BytesIO()
    with rc_context(PLAIN_TEXT):  # Text reads usetex when it is made: the whole figure
        figure = Figure(figsize=(WIDTH_IN, HEIGHT_IN), dpi=DPI, layout="constrained")
        FigureCanvasAgg(figure)
        axes = figure.add_subplot()
        lines = [axes.plot(c.steps, c.values, LINE_STYLES[k % len(LINE_STYLES)],
                           linewidth=2.2 - 0.4 * (k % len(LINE_STYLES)))[0]
                 for k, c in enumerate(curves)]
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole
        axes.set_xlabel("step", parse_math=False)
        axes.set_ylabel(METRICS.get(metric, metric), parse_math=False)
        axes.set_title(f"{METRICS.get(metric, metric)} per step", parse_math=False)
        axes.grid(True, alpha=0.3)
        # labels given with their lines: one starting with "_" is not hidden from them
        for text in axes.legend(*_legend(lines, [c.label for c in curves])).get_texts():
            text.set_parse_math(False)
        # no timestamps or generator versions: the same curves give the same file
        metadata = {"Date": None} if image_format == "svg" else {"Software": None}
        figure.savefig(out, format=image_format, dpi=DPI, metadata=metadata)
    return out.getvalue()


def _legend(lines: list, labels: list[str]) -> tuple[list, list[str]]:
    """The legend's entries: every line's label, or, past :data:`MAX_LEGEND` lines, the
    first ones' and how many more were drawn."""
    if len(lines) <= MAX_LEGEND:
        return lines, labels
    from matplotlib.lines import Line2D

    more = len(lines) - (MAX_LEGEND - 1)
    return ([*lines[:MAX_LEGEND - 1], Line2D([], [], linestyle="none")],
            [*labels[:MAX_LEGEND - 1], f"and {more} more runs"])


def inline_svg(curves: list[Curve], metric: str) -> str:
    """The curves as an ``<svg>`` element to place in an HTML page."""
    text = draw(curves, metric, "svg").decode("utf-8")
    return text[text.index("<svg"):]
