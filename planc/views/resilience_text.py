"""The "checkpoints and failures" section of ``planc simulate`` (planc.estimate.resilience)."""

from __future__ import annotations

from planc.diagnostics import counted
from planc.vocabulary.units import TIME, format_bytes, format_quantity


def _time(seconds: float) -> str:
    return format_quantity(seconds, TIME)


def render(res, storage_bytes_per_s: float) -> str:
    """The priced checkpoints of one plan, and the expected loss to failures."""
    mode = "asynchronous" if res.asynchronous else "synchronous"
    chosen = " (Young's interval)" if res.optimal_every == res.every else ""
    rows = [
        ["checkpoint", f"{format_bytes(res.state_bytes)}: fp32 parameters and optimizer "
                       f"state; the largest stage's writer {format_bytes(res.writer_bytes)}"],
        ["copy to host", f"{_time(res.copy_seconds)} (PCIe Gen5 x16, 64 GB/s)"],
        ["writing", f"{_time(res.write_seconds)} ({format_bytes(storage_bytes_per_s)}/s a "
                    f"node, {res.writers_per_node} writer{'s' * (res.writers_per_node != 1)} "
                    f"on a node)"],
        ["every", f"{counted(res.every, 'step', grouped=True)}{chosen}, {mode}: each holds "
                  f"the steps up "
                  f"{_time(res.blocked_seconds)}, {res.checkpoint_overhead:.2%} of a step"],
    ]
    if res.mtbf_seconds is not None:
        rows += [
            ["failures", f"one every {res.mtbf_seconds / 3600:.3g} h; each loses half an "
                         f"interval and a restart of {_time(res.restart_seconds)} "
                         f"(checkpoint read back included): {res.lost_fraction:.2%} of the "
                         f"time"],
            ["best interval", f"every {res.optimal_every:,} steps (Young 1974)"],
        ]
    if res.lost_fraction >= 1:
        rows.append(["step, all in", "never: a failure comes before the run gets back to "
                                     "where it was"])
    else:
        rows.append(["step, all in", f"{_time(res.effective_step_seconds)} "
                                     f"({res.effective_step_seconds / res.step_seconds - 1:+.1%}"
                                     f" on the step)"])
    width = max(len(name) for name, _ in rows)
    return "\ncheckpoints and failures (docs/simulate.md)\n" + "".join(
        f"  {name.ljust(width)}  {text}\n" for name, text in rows)
