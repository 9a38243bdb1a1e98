"""Every step's record: the ranks' times gathered to the leader without holding up the
next step, printed as the progress line, written to the metrics file and TensorBoard
(docs/metrics.md). What a record holds beyond the times is planc.runtime.step_metrics'."""

from __future__ import annotations

import errno
import json
import os
import resource
import sys
import time

import torch
import torch.distributed as dist

from planc.data.blend import shares
from planc.host.files import append_line, held_pipe
from planc.runtime.engine.context import RankContext
from planc.runtime.step_metrics import open_tensorboard, peak_memory_mb, throughput
from planc.runtime.stragglers import DEFAULT_MARGIN, StragglerWatch
from planc.runtime.stragglers import STREAMS as STRAGGLER_STREAMS
from planc.runtime.stragglers import describe as describe_straggler


def routing_balance(rows: list[float], groups: list[float]) -> dict:
    """``ep_rows``: the (token, expert) rows each rank's experts ran in the step (None on a
    rank without experts over ep); ``ep_imbalance``: the busiest rank's rows over its ep
    group's mean, the worst group's (what ``model { imbalance }`` declares for planc
    simulate). Empty without experts over ep."""
    members: dict[int, list[float]] = {}
    for count, group in zip(rows, groups):
        if group >= 0:
            members.setdefault(int(group), []).append(count)
    if not members:
        return {}
    ratios = [max(c) * len(c) / sum(c) for c in members.values() if sum(c) > 0]
    return {"ep_rows": [int(c) if g >= 0 else None for c, g in zip(rows, groups)],
            "ep_imbalance": max(ratios) if ratios else 1.0}


def describe_recovery(recovery: dict) -> str:
    """The progress line's words for the failure a run continues after."""
    lost = recovery["lost_ranks"]
    redone = recovery["steps_redone"]
    what = (f"grew back from {recovery['from']}" if recovery.get("event") == "grew" else
            f"recovered: lost rank{'s' * (len(lost) != 1)} {', '.join(map(str, lost))} of "
            f"{recovery['from']}")
    return (f"{what}; now {recovery['to']} on {recovery['ranks']} ranks from "
            f"step {recovery['resumed_step']}, {redone} step{'s' * (redone != 1)} redone, "
            f"{recovery['seconds_lost']:.1f} s from the failure to this step's end")


def progress_line(step: int, steps: int, record: dict) -> None:
    width = 24
    filled = int(width * (step + 1) / steps)
    bar = "#" * filled + "-" * (width - filled)
    exposed = record["exposed_comm_s"] / max(record["time_s"], 1e-12)
    text = (f"[{bar}] step {step + 1}/{steps}  loss {record['loss']:.6f}  "
            f"{record['time_s'] * 1000:.0f} ms  exposed comm {record['exposed_comm_s'] * 1000:.0f}"
            f" ms ({100 * exposed:.0f}%)  {record['tokens_per_s']:,.0f} tokens/s  "
            f"{record['tflops_per_device']:.3g} TFLOP/s per device" +
            (f"  MFU {100 * record['mfu']:.2g}%" if "mfu" in record else "") +
            (f"  eval loss {record['eval_loss']:.6f}" if "eval_loss" in record else "") +
            (f" ({record['eval_s']:.3g} s)" if "eval_loss" in record and "eval_s" in record
             else "") +
            (f"  {describe_straggler(record['straggler'])}" if "straggler" in record else "") +
            (f"  {describe_recovery(record['recovery'])}" if "recovery" in record else ""))
    end = "\r" if sys.stderr.isatty() and step + 1 < steps else "\n"
    print(text, end=end, file=sys.stderr, flush=True)


class StepRecords:
    """Every step's times, gathered from every rank to the leader without holding up the
    next step: the gather of step k is issued when step k ends and completed when step
    k + 1 does. ``time_s`` is the slowest rank's step; the other times are that rank's;
    ``max_rss_mb`` the largest peak resident memory of any rank so far; ``build`` the
    build's fingerprint, so that ``planc report`` refuses the metrics of another build;
    ``tflops_per_device`` and ``mfu`` the step's model FLOPs over ``time_s`` and every
    device, ``peak_memory_mb`` every rank's peak memory (planc.runtime.step_metrics);
    ``page_faults`` the most minor page faults any rank took since its last record."""

    FIELDS = ("time_s", "compute_s", "comm_s", "exposed_comm_s", "pipeline_wait_s")

    def __init__(self, ctx: RankContext, steps: int, path: str | None, fingerprint: str,
                 mfu, plan: str, tensorboard: str | None = None,
                 straggler_margin: float = DEFAULT_MARGIN, recovery: str | None = None):
        self.ctx, self.steps = ctx, steps
        # planc run --on-failure replan: the failure this run continues after, for its
        # first record, with the seconds from the failure to the end of that step
        self.recovery = json.loads(recovery) if recovery else None
        self.mfu, self.plan = mfu, plan
        self.tensorboard = open_tensorboard(tensorboard) if ctx.rank == ctx.leader else None
        self.leader = ctx.leader
        self.world = dist.get_world_size()
        self.group = dist.new_group(list(range(self.world)), backend="gloo") \
            if self.world > 1 else None
        # appended: planc run has emptied a file --force replaces and kept a resumed
        # run's (planc.host.outputs); under torchrun an existing file is continued, never
        # replaced, and only if it is a metrics file
        self.file = metrics_file(path) if path and ctx.rank == self.leader else None
        self.build = fingerprint if self.file else None
        self.pending = None
        self.records: list[dict] = []
        self.notes: dict[int, dict] = {}  # step -> values its record adds (grad_norm, ...)
        # peers run the same program: the ranks of one stage
        stages: dict[int, list[int]] = {}
        for rank in range(self.world):
            stages.setdefault(ctx.ranks.stage_of(rank), []).append(rank)
        self.stragglers = StragglerWatch(list(stages.values()), straggler_margin)
        self.faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt

    def step(self, step: int, times, loss: float | None,
             routed: tuple[int, tuple[int, ...]] | None = None,
             dropped: tuple[int, int] | None = None,
             expert_imbalance: float | None = None) -> None:
        """``routed``: the rows this rank's experts ran in the step and its ep group
        (planc.runtime.engine.kernels.Kernels.take_routed), None without experts over ep;
        ``dropped``: the (token, expert) pairs its mixtures dropped and chose
        (``take_dropped``), None without ``capacity``; ``expert_imbalance``: the busiest
        expert's load over the mean of this rank's stage (its worst block), None without
        ``bias_update``."""
        self.flush()
        if self.recovery is not None and "seconds_lost" not in self.recovery:
            failed_at = self.recovery.pop("failed_at")
            self.recovery["seconds_lost"] = round(time.time() - failed_at, 3)
        memory, self.memory_kind = peak_memory_mb(self.ctx.device)
        usage = resource.getrusage(resource.RUSAGE_SELF)
        peak = memory if self.memory_kind == "max_rss" else usage.ru_maxrss / 1024  # KiB
        faults = usage.ru_minflt - self.faults
        self.faults = usage.ru_minflt
        rows, group = routed if routed is not None else (0, (-1,))
        lost, pairs = dropped if dropped is not None else (0, 0)
        mine = torch.tensor(times.as_list() + [rows, group[0], lost, pairs,
                                               expert_imbalance or 0.0, faults, peak, memory],
                            dtype=torch.float64)
        if self.world == 1:
            self.pending = (step, None, [mine], loss)
            return
        gathered = [torch.empty_like(mine) for _ in range(self.world)] \
            if self.ctx.rank == self.leader else None
        work = dist.gather(mine, gathered, dst=self.leader, group=self.group, async_op=True)
        self.pending = (step, work, gathered, loss)

    def flush(self) -> None:
        if self.pending is None:
            return
        step, work, gathered, loss = self.pending
        self.pending = None
        if work is not None:
            work.wait()
        if self.ctx.rank != self.leader:
            return
        table = torch.stack(gathered)
        slowest = int(table[:, 0].argmax())
        values = dict(zip(self.FIELDS, (float(v) for v in table[slowest])))
        values["max_rss_mb"] = round(float(table[:, -2].max()), 1)
        record = {"step": step, "loss": loss, **values,
                  "tokens_per_s": self.ctx.tokens_per_step / values["time_s"],
                  "slowest_rank": slowest}
        record["lr"] = self.ctx.model.lr_at(step)  # the lr of the step's update
        straggler = self.stragglers.observe(
            {key: [float(v) for v in table[:, self.FIELDS.index(key)]]
             for _, key in STRAGGLER_STREAMS})
        if straggler is not None:
            record["straggler"] = straggler
        share = shares(self.ctx.data.path, (step + 1) * self.ctx.data.batch)
        if share is not None:  # a mixture: each source's share of the samples so far
            record["data_share"] = share
        at = len(self.FIELDS)
        record.update(routing_balance(table[:, at].tolist(), table[:, at + 1].tolist()))
        pairs = float(table[:, at + 3].sum())
        if pairs > 0:  # model { capacity }: the share of the step's pairs it dropped
            record["moe_dropped"] = float(table[:, at + 2].sum()) / pairs
        worst = float(table[:, at + 4].max())
        if worst > 0:  # model { bias_update }: what the balancing bias works against
            record["moe_expert_imbalance"] = worst
        record["page_faults"] = int(table[:, at + 5].max())
        record.update(self.notes.pop(step, {}))
        if self.recovery is not None:
            record["recovery"], self.recovery = self.recovery, None
        record.update(throughput(self.mfu.model_flops_per_step, self.mfu.peak_flops_per_device,
                                 values["time_s"], self.world),
                      peak_memory_mb=[round(float(v), 1) for v in table[:, -1]],
                      peak_memory=self.memory_kind, plan=self.plan)
        self.records.append(record)
        progress_line(step, self.steps, record)
        if self.tensorboard:
            self.tensorboard.write(record)
        if self.file:
            try:  # the whole line or none of it: a reader stops at a half line
                append_line(self.file, json.dumps({**record, "build": self.build}) + "\n")
            except OSError as exc:  # a full disk: say so once and train on
                print(f"planc: warning: cannot write the metrics of step {step + 1} "
                      f"({exc.strerror}); no more metrics are written", file=sys.stderr)
                try:  # now, not when collected: a buffer it cannot write is no traceback
                    self.file.close()
                except OSError:
                    pass
                self.file = None

    def close(self) -> None:
        self.flush()
        if self.file:
            self.file.close()
        if self.tensorboard:
            self.tensorboard.close()


def metrics_file(path: str):
    from planc.host.output_kinds import METRICS
    from planc.host.outputs import existing_problem

    refusal = existing_problem("--metrics", path, METRICS, append=True)  # continued
    if refusal is not None:
        raise SystemExit(f"planc: error: {refusal.message}")
    try:  # opened for writing, a pipe no process reads would hold the rank forever
        descriptor = held_pipe(path)
    except OSError as exc:
        if exc.errno == errno.ENXIO:
            raise SystemExit(f"planc: error: --metrics {path}: {exc.strerror}") from None
        raise
    if descriptor is None:  # not a named pipe
        return open(path, "a")
    os.set_blocking(descriptor, True)
    return os.fdopen(descriptor, "a")
