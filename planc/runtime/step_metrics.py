"""What planc run reports of a step beyond its times: throughput, MFU, peak memory, and
the TensorBoard scalars of the leader (docs/metrics.md).

The model FLOPs of a step and the device's peak come from the build (build.json's
``mfu``, written by the compiler: planc.models.step_model_flops); a rank only divides.
TFLOP/s per device and MFU follow Megatron-LM and PaLM (Chowdhery et al. 2022, appendix
B): the model FLOPs of the step, recomputation not counted, over the slowest rank's step
time and every device of the run.
"""

from __future__ import annotations

import math
import resource
import sys

import torch

from planc.outputs import TENSORBOARD_SUFFIX

# The record's keys written as TensorBoard scalars, in this order, where the record has
# them (lr and grad_norm only when the plan's training computes them, eval_loss at the
# steps that evaluate).
TENSORBOARD_SCALARS = ("loss", "lr", "grad_norm", "tokens_per_s", "tflops_per_device", "mfu",
                       "exposed_comm_s", "time_s", "eval_loss")


def peak_memory_mb(device: torch.device) -> tuple[float, str]:
    """This rank's peak memory so far in MiB and what was measured: on a GPU the most
    memory torch's allocator held for tensors (torch.cuda.max_memory_allocated), on a CPU
    the process's peak resident set (getrusage's ru_maxrss, KiB on Linux)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20, "cuda_max_allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "max_rss"


def throughput(model_flops_per_step: float, peak_flops_per_device: float, seconds: float,
               devices: int) -> dict[str, float]:
    """Model TFLOP/s per device and MFU of a step of ``seconds`` on ``devices``."""
    per_device = model_flops_per_step / seconds / devices
    return {"tflops_per_device": per_device / 1e12, "mfu": per_device / peak_flops_per_device}


class TensorBoardLog:
    """The leader's TensorBoard event file: every step's record as scalars, in float64
    (TensorBoard's tensor summaries), so that they read back equal to the metrics file."""

    def __init__(self, directory: str):
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        # the suffix marks planc's event files: --force replaces only those (planc.outputs)
        self.writer = SummaryWriter(log_dir=directory, filename_suffix=TENSORBOARD_SUFFIX)

    def write(self, record: dict) -> None:
        step = record["step"] + 1  # the progress line's and planc plot's step numbers
        for key in TENSORBOARD_SCALARS:
            value = record.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and \
                    math.isfinite(value):
                self.writer.add_scalar(key, value, step, new_style=True,
                                       double_precision=True)
        self.writer.flush()  # a run stopped later still has every step written so far

    def close(self) -> None:
        self.writer.close()


def open_tensorboard(directory: str | None) -> TensorBoardLog | None:
    """The leader's log in ``directory`` (planc run checked it before starting), or None
    after a warning: a log that cannot be written does not stop training."""
    if directory is None:
        return None
    try:
        return TensorBoardLog(directory)
    except (OSError, ImportError) as exc:
        print(f"planc: warning: cannot write TensorBoard logs into {directory} ({exc}); "
              f"training goes on without them", file=sys.stderr)
        return None
