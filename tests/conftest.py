"""Shared fixtures: paths of the repository, its example plans and a runner of the CLI."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PLANS = ROOT / "plans"


@pytest.fixture
def run_planc():
    """Run the real ``planc`` command in a subprocess; returns CompletedProcess."""

    def run(*args: str, env: dict | None = None, cwd: Path | None = None, timeout: float = 120):
        return subprocess.run([sys.executable, "-m", "planc", *map(str, args)],
                              capture_output=True, text=True, env=env, cwd=cwd or ROOT,
                              timeout=timeout)

    return run
