"""Shared fixtures: paths of the repository, its example plans and a runner of the CLI."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PLANS = ROOT / "plans"

# A plan with exactly one error, the one of the language reference: tp = 8, heads = 12.
BAD_TP = """\
# tp does not divide heads
plan bad {
  model gpt {
    layers = 2
    hidden = 96
    heads  = 12
    vocab  = 256
    seq    = 32
    batch  = 8
  }
  mesh {
    tp = 8
  }
}
"""


@pytest.fixture
def run_planc():
    """Run the real ``planc`` command in a subprocess; returns CompletedProcess."""

    def run(*args: str, env: dict | None = None, cwd: Path | None = None, timeout: float = 120):
        return subprocess.run([sys.executable, "-m", "planc", *map(str, args)],
                              capture_output=True, text=True, env=env, cwd=cwd or ROOT,
                              timeout=timeout)

    return run
