"""What planc run reports of a step beyond its times: throughput, MFU, peak memory, and
the TensorBoard scalars of the leader (docs/metrics.md).

The model FLOPs of a step and the device's peak come from the build (build.json's
``mfu``, written by the compiler: planc.models.step_model_flops); a rank only divides.
TFLOP/s per device and MFU follow Megatron-LM and PaLM (Chowdhery et al. 2022, appendix
B): the model FLOPs of the step, recomputation not counted, over the slowest rank's step
time and every device of the run.
"""

from __future__ import annotations

import errno
import math
import os
import resource
import sys

import torch

from planc.host.output_kinds import TENSORBOARD_SUFFIX

# The record's keys written as TensorBoard scalars, in this order, where the record has
# them (lr and grad_norm only when the plan's training computes them, eval_loss and
# eval_s at the steps that evaluate).
TENSORBOARD_SCALARS = ("loss", "lr", "grad_norm", "tokens_per_s", "tflops_per_device", "mfu",
                       "exposed_comm_s", "time_s", "eval_loss", "eval_s")


def peak_memory_mb(device: torch.device) -> tuple[float, str]:
    """This rank's peak memory so far in MiB and what was measured: on a GPU the most
    memory torch's allocator held for tensors (torch.cuda.max_memory_allocated), on a CPU
    the process's peak resident set (getrusage's ru_maxrss, KiB on Linux)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20, "cuda_max_allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "max_rss"


def throughput(model_flops_per_step: float, peak_flops_per_device: float | None,
               seconds: float, devices: int) -> dict[str, float]:
    """Model TFLOP/s per device and MFU of a step of ``seconds`` on ``devices``; no MFU
    without a peak (a plan that names no machine)."""
    per_device = model_flops_per_step / seconds / devices
    if peak_flops_per_device is None:
        return {"tflops_per_device": per_device / 1e12}
    return {"tflops_per_device": per_device / 1e12, "mfu": per_device / peak_flops_per_device}


class TensorBoardLog:
    """The leader's TensorBoard event file: every step's record as scalars, in float64
    (TensorBoard's tensor summaries), so that they read back equal to the metrics file.

    A log that cannot be written (a full disk) costs the log, not the run, as the
    metrics file does: one warning, then no more logs. SummaryWriter writes from a thread
    of its own, which re-raises an OSError out of the thread (a traceback on stderr) and
    hands it to a later call, so the event file's writes are guarded instead: the first
    failure is kept (the part of the event written cut off again), and every step asks
    for it after its flush, when that step's events have all been tried."""

    def __init__(self, directory: str):
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        if _no_room(directory):  # the first event would fail in the writer's thread
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), directory)
        # the suffix marks planc's event files: --force replaces only those (planc.host.output_kinds)
        self.writer = SummaryWriter(log_dir=directory, filename_suffix=TENSORBOARD_SUFFIX)
        self.failure: OSError | None = None
        self._guard(self.writer.file_writer.event_writer)

    def _guard(self, event_writer) -> None:
        """Catch the OSError of every write of the event file, in the thread that writes."""
        events = getattr(event_writer, "_general_file_writer", None)  # tensorboard's GFile
        if events is None:  # another tensorboard: its thread's errors surface in flush()
            return
        write = events.write

        def guarded(data) -> None:
            if self.failure is not None:
                return
            try:
                start = os.stat(events.filename).st_size
            except OSError:
                start = None
            try:
                write(data)
            except OSError as exc:
                self.failure = exc
                if start is not None:  # the event file ends with whole events
                    try:
                        os.truncate(events.filename, start)
                    except OSError:
                        pass

        events.write = guarded

    def write(self, record: dict) -> None:
        if self.writer is None:
            return
        step = record["step"] + 1  # the progress line's and planc plot's step numbers
        failure = None
        try:
            for key in TENSORBOARD_SCALARS:
                value = record.get(key)
                if isinstance(value, (int, float)) and not isinstance(value, bool) and \
                        math.isfinite(value):
                    self.writer.add_scalar(key, value, step, new_style=True,
                                           double_precision=True)
            self.writer.flush()  # a run stopped later still has every step written so far
        except OSError as exc:
            failure = exc
        failure = failure or self.failure
        if failure is not None:  # a full disk: say so once and train on
            print(f"planc: warning: cannot write the TensorBoard logs of step {step} "
                  f"({failure.strerror or failure}); no more TensorBoard logs are written",
                  file=sys.stderr)
            self.close()

    def close(self) -> None:
        writer, self.writer = self.writer, None
        if writer is not None:
            try:
                writer.close()
            except OSError:
                pass  # nothing is left to write: every step was flushed, or warned of


def _no_room(directory: str) -> bool:
    """Whether the file system ``directory`` is (or will be made) on has no free block."""
    path = os.path.abspath(directory)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        return os.statvfs(path).f_bavail == 0
    except OSError:
        return False


def open_tensorboard(directory: str | None) -> TensorBoardLog | None:
    """The leader's log in ``directory`` (planc run checked it before starting), or None
    after a warning: a log that cannot be written does not stop training."""
    if directory is None:
        return None
    try:
        return TensorBoardLog(directory)
    except (OSError, ImportError) as exc:
        print(f"planc: warning: cannot write TensorBoard logs into {directory} "
              f"({getattr(exc, 'strerror', None) or exc}); training goes on without them",
              file=sys.stderr)
        return None
