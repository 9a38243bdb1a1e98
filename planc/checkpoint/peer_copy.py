"""A checkpoint put together from the copies in peer memory that outlive a failure
(``planc run --checkpoint-peer-memory``; planc.runtime.checkpoint.peer_memory writes
them). No torch.

Each node's memory is ``ROOT/node-K/`` (a tmpfs directory: on one machine, the nodes of
a local run share it, and losing a node is removing its directory, as its memory would
be gone). After a failure, the newest step that the nodes left hold is put together in
``ROOT/assembled/step-NNNNNN`` from hard links to their files, then read and verified as
any checkpoint (planc.checkpoint.format.find).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from planc.checkpoint import format as fmt

SHARED_MEMORY = "/dev/shm"  # Linux's tmpfs: host memory


def node_directory(root: str | os.PathLike, node: int) -> Path:
    return Path(root) / f"node-{node}"


def make_root() -> str:
    """A fresh directory in host memory, only this user's (0700); OSError if none."""
    if not os.path.isdir(SHARED_MEMORY):
        raise OSError(f"{SHARED_MEMORY} (host memory as files) is not on this machine")
    return tempfile.mkdtemp(prefix="planc-peer-memory-", dir=SHARED_MEMORY)


def forget(root: str, nodes) -> None:
    """The memory of ``nodes`` is gone with them."""
    for node in nodes:
        shutil.rmtree(node_directory(root, node), ignore_errors=True)


def assemble(root: str) -> Path | None:
    """The newest checkpoint whose every file some node left holds, put together in
    ``ROOT/assembled``; None if there is none."""
    steps: dict[int, list[Path]] = {}
    for holder in sorted(Path(root).glob("node-*")):
        for step_dir in holder.glob("step-*"):
            match = fmt.STEP_DIR.fullmatch(step_dir.name)
            if match and (step_dir / fmt.MANIFEST).is_file():
                steps.setdefault(int(match.group(1)), []).append(step_dir)
    target_root = Path(root) / "assembled"
    for step in sorted(steps, reverse=True):
        holders = steps[step]
        try:
            manifest = json.loads((holders[0] / fmt.MANIFEST).read_text())
            names = [*manifest["files"], fmt.MANIFEST]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        where = {name: next((h / name for h in holders if (h / name).is_file()), None)
                 for name in names}
        if any(path is None for path in where.values()):
            continue
        shutil.rmtree(target_root, ignore_errors=True)
        target = target_root / fmt.step_name(step)
        target.mkdir(parents=True)
        for name, path in where.items():
            os.link(path, target / name)
        return target
    return None


def clear(root: str) -> None:
    """Every node's memory, once what the run goes on from is put together."""
    for holder in Path(root).glob("node-*"):
        shutil.rmtree(holder, ignore_errors=True)


def remove(root: str) -> None:
    """The run's peer memory, at its end."""
    shutil.rmtree(root, ignore_errors=True)
