"""What ``planc run --tensorboard DIR`` needs before any rank starts: the tensorboard
package, and a directory it can write (or create). Checked without importing torch or
tensorboard, so that a wrong command line fails at once and changes nothing."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from planc.files import unwritable_ancestor


def tensorboard_problem(path: str) -> str | None:
    """Why the leader could not write TensorBoard logs into ``path``, or None."""
    if importlib.util.find_spec("tensorboard") is None:
        return ("--tensorboard needs the tensorboard package, which is not installed: "
                "pip install 'planc[run]'")
    target = Path(path)
    if target.exists() or target.is_symlink():
        if not target.is_dir():
            return f"--tensorboard {path}: is not a directory; name a directory for the logs"
        if not os.access(target, os.W_OK | os.X_OK):
            return f"--tensorboard {path}: is not writable"
        return None
    parent = unwritable_ancestor(target)
    if parent is not None:
        return f"--tensorboard {path}: cannot be created ({parent} is not a writable directory)"
    return None
