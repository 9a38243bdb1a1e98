"""The project's tokenised corpus, which the loss benchmarks train on."""

from __future__ import annotations

import os
import subprocess
import sys

TOKENS = "data/tiny-corpus.tokens"


def ensure_corpus(root: str) -> None:
    """Make ``root``/data/tiny-corpus.tokens (python -m planc.data.corpus) if missing."""
    if not os.path.exists(os.path.join(root, TOKENS)):
        subprocess.run([sys.executable, "-m", "planc.data.corpus", "-o",
                        os.path.join(root, TOKENS)], check=True)


def loss_bench_arguments(description: str, steps: int, plot: str, root: str,
                         flags: dict[str, str] | None = None,
                         options: dict[str, tuple] | None = None):
    """A loss benchmark's ``--steps`` and ``--plot`` (``plot``: under docs/), its own
    on/off ``flags`` (name: help) and ``options`` (name: (type, default, help)),
    parsed; the working directory set to ``root`` and the corpus made."""
    import argparse

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--plot", default=os.path.join(root, "docs", plot))
    for flag, text in (flags or {}).items():
        parser.add_argument(flag, action="store_true", help=text)
    for option, (kind, default, text) in (options or {}).items():
        parser.add_argument(option, type=kind, default=default, help=text)
    args = parser.parse_args()
    os.chdir(root)
    ensure_corpus(root)
    return args


def loss_axes(ylabel: str = "training loss (cross-entropy)"):
    """A figure and axes for a curve over the steps (matplotlib, headless), or None
    without matplotlib (it says so)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no plot")
        return None
    figure, axes = plt.subplots(figsize=(6, 3.4))
    axes.set_xlabel("step")
    axes.set_ylabel(ylabel)
    return figure, axes


def save_curves(figure, axes, title: str, path: str) -> None:
    """A legend and ``title`` on ``axes``, the figure written to ``path``."""
    axes.set_title(title, fontsize=9)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    print(f"wrote {path}")
