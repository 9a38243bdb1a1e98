"""``planc run``: start every rank of a plan on this machine with torch.distributed's own
launcher (torch.distributed.launcher, the machinery behind torchrun).

Workers are forked from this process, which has already imported torch, so a world of
eight starts in a fraction of a second instead of importing torch eight times (CUDA
runs use spawn, since CUDA cannot be forked). If a rank raises, the launcher stops every
other rank at once and the failing rank's traceback is shown; Ctrl-C stops them all.
"""

from __future__ import annotations

import os
import socket
import sys
import uuid

from planc.runtime.worker import entry


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(build_dir: str, world: int, worker_args: list[str], backend: str) -> int:
    """Run ``world`` ranks of the worker on ``build_dir``; 0 if every rank succeeded."""
    import logging

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    for name in ("torch.distributed.elastic", "torch.multiprocessing"):
        logging.getLogger(name).setLevel(logging.CRITICAL)  # planc reports failures itself
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # ranks share this machine's cores
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=world, run_id=f"planc-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{_free_port()}", max_restarts=0,
        monitor_interval=0.1, start_method="spawn" if backend == "nccl" else "fork")
    try:
        elastic_launch(config, entry)([build_dir, "--backend", backend, *worker_args])
    except ChildFailedError as failure:
        print(_failure_report(failure), file=sys.stderr)
        return 1
    return 0


def _failure_report(failure) -> str:
    lines = []
    root_rank, root = failure.get_first_failure()
    for rank, info in sorted(failure.failures.items()):
        if info.exitcode == 3:
            what = "stopped by its hang report (above)"
        elif info.exitcode and info.exitcode < 0:
            what = f"killed by signal {-info.exitcode}"
        else:
            what = f"exited with status {info.exitcode}"
        lines.append(f"planc: rank {rank} {what}")
    message = root.message
    if isinstance(message, dict):
        trace = message.get("message", "")
        extra = message.get("extraInfo", {}).get("py_callstack", "")
        message = extra or trace
    if message and "SystemExit" not in str(message) and \
            "To enable traceback" not in str(message):
        lines.append(f"planc: traceback of rank {root_rank}, the first to fail:")
        lines.append(str(message).rstrip())
    return "\n".join(lines)
