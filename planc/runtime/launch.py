"""``planc run``: start every rank of a plan on this machine with torch.distributed's own
launcher (torch.distributed.launcher, the machinery behind torchrun).

Workers are forked from a fork server that imported torch and planc once (Python's
``forkserver`` start method with a preload), so a world of eight starts without
importing torch eight times, and no worker is forked from a process whose other
threads (the launcher's own) might hold a lock at that moment. CUDA runs use spawn,
since CUDA cannot be forked. If a rank raises, the launcher stops every
other rank at once and the failing rank's traceback is shown; Ctrl-C stops them all.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import uuid

from planc.net import free_port
from planc.runtime.worker import entry


def gpus() -> int:
    """CUDA devices on this machine (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def launch(build_dir: str, world: int, worker_args: list[str], backend: str) -> int:
    """Run ``world`` ranks of the worker on ``build_dir``; 0 if every rank succeeded."""
    import logging

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    for name in ("torch.distributed.elastic", "torch.multiprocessing"):
        logging.getLogger(name).setLevel(logging.CRITICAL)  # planc reports failures itself
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # ranks share this machine's cores
    # glibc returns freed blocks above a dynamic threshold to the system and maps them
    # again on the next step: thousands of page faults per step with activations of a few
    # MB each. Keeping freed memory (as PyTorch's CUDA caching allocator does on GPUs)
    # removes them; a user's own setting wins.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(64 * 2**20))
    os.environ.setdefault("MALLOC_TRIM_THRESHOLD_", str(256 * 2**20))
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std

    run_id = f"planc-{uuid.uuid4().hex[:8]}"
    # Every rank's output is kept in BUILD/logs/RUN_ID and copied to this console.
    logs = DefaultLogsSpecs(log_dir=os.path.join(build_dir, "logs"), redirects=Std.ALL,
                            tee=Std.ALL)
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=world, run_id=run_id, logs_specs=logs,
        log_line_prefix_template="[rank ${rank}] ",
        rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{free_port()}", max_restarts=0,
        monitor_interval=0.1, start_method="spawn" if backend == "nccl" else "forkserver")
    multiprocessing.set_forkserver_preload(["planc.runtime.worker"])
    try:
        elastic_launch(config, entry)([build_dir, "--backend", backend, *worker_args])
    except ChildFailedError as failure:
        print(_failure_report(failure), file=sys.stderr)
        return 1
    except (SignalException, KeyboardInterrupt) as interrupt:
        # torch's launcher has already stopped every rank when this reaches us
        signal = getattr(interrupt, "sigval", None)
        print(f"\nplanc: interrupted{f' by signal {int(signal)}' if signal else ''}; every "
              f"rank was stopped", file=sys.stderr)
        return 130
    return 0


def _failure_report(failure) -> str:
    lines = []
    root_rank, root = failure.get_first_failure()
    for rank, info in sorted(failure.failures.items()):
        if info.exitcode == 3:
            what = "stopped after reporting what it waited for (above)"
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
    if root.exitcode != 3 and message and "SystemExit" not in str(message) and \
            "To enable traceback" not in str(message):
        lines.append(f"planc: traceback of rank {root_rank}, the first to fail:")
        lines.append(str(message).rstrip())
    return "\n".join(lines)
