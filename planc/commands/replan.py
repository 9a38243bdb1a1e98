"""``planc run --on-failure replan``: a run that loses a rank, or a node, goes on by itself
on a layout of the devices left, from its newest checkpoint (docs/checkpoints.md).

Each launch is a segment. When the launcher reports ranks lost (killed by a signal it did
not send, or stopped for --timeout: planc.runtime.launcher.launch.launch_watched), their
devices are taken out, planc.commands.replan_search picks the fastest layout of the same
model on what is left that resumes from the newest complete checkpoint, and it is
compiled into ``BUILD/replans/N/``, verified and launched with ``--resume``: what a person
would do with ``planc tune``, ``planc compile`` and ``planc run --resume``. A failure
during that segment is handled the same way. SIGUSR1 says the devices are back: the run
grows back onto all of them once its next checkpoint is complete. The first step after
each switch says in its metrics record and progress line what was lost, the layouts
before and after, the steps redone and the seconds from the failure to that step's end.

Megatron-LM's in-process restart and TorchFT keep the layout (spare nodes, or one
data-parallel replica fewer); a consolidated checkpoint lets planc change it instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import signal
import sys
import time

from planc.commands import fail

REPLANS = "replans"  # BUILD/replans/N: the build of a run's N-th switch of layout
STEP_DIRECTORY = re.compile(r"step-([0-9]{6,})")


def newest_step(directory: str) -> int:
    """The step of the newest checkpoint directory in ``directory`` (complete: a step
    directory appears only once renamed into place), -1 if none."""
    try:
        names = os.listdir(directory)
    except OSError:
        return -1
    steps = [int(m.group(1)) for m in map(STEP_DIRECTORY.fullmatch, names) if m]
    return max(steps, default=-1)


class GrowSignal:
    """SIGUSR1: the devices lost are back. :meth:`due` turns true once a checkpoint newer
    than the newest at the signal is complete: the run grows back from it."""

    def __init__(self, checkpoint_dir: str):
        self.checkpoint_dir = checkpoint_dir
        self.received_at: float | None = None
        self.mark: int | None = None
        self.previous = signal.signal(signal.SIGUSR1, self._handle)

    def _handle(self, signum, frame) -> None:
        self.received_at = self.received_at or time.time()

    def due(self) -> bool:
        if self.received_at is None:
            return False
        if self.mark is None:
            self.mark = newest_step(self.checkpoint_dir)
        return newest_step(self.checkpoint_dir) > self.mark

    def reset(self) -> None:
        self.received_at = self.mark = None

    def close(self) -> None:
        signal.signal(signal.SIGUSR1, self.previous)


@dataclasses.dataclass
class Segment:
    """One launch: its build, what its ranks are asked, the devices its ranks 0, 1, ...
    take, the checkpoint it resumes from (None: step 0) and its layout in one line."""

    built: object
    options: object
    devices: tuple[int, ...]
    found: object
    layout: str


def keep_training(args, built, directory: str, options, found, interrupts) -> int:
    """Launch ``built`` (in ``directory``) with ``options`` (resuming from ``found``),
    and again on a new layout after each failure that loses devices, until the run ends
    or cannot go on."""
    from planc.commands.tune import devices_per_node
    from planc.runtime.launcher.launch import launch_watched
    from planc.tune.space import of_plan

    source = plan_source(args, built)
    if isinstance(source, str):
        return fail(f"--on-failure replan: {source}")
    text, path = source
    world = built.plan.world
    per_node = devices_per_node(built.plan, text, world)
    segment = first = Segment(built, options, tuple(range(world)), found,
                              of_plan(built.plan).text())
    reached = found.manifest["step"] if found else 0  # steps the run had finished
    grow = GrowSignal(args.checkpoint_dir)
    lost: set[int] = set()
    try:
        while True:
            shrunk = len(lost) > 0
            outcome = launch_watched(segment.options, segment.built.plan.world, interrupts,
                                     grow.due if shrunk else None, segment.devices)
            reached = max(reached, outcome.steps_done or 0)
            if outcome.status is None:  # the devices are back and a checkpoint is done
                event, failed_at, gone = "grew", grow.received_at, ()
                lost.clear()
                print(f"planc: the devices are back (SIGUSR1); growing back onto all "
                      f"{world} from the checkpoint written since", file=sys.stderr)
            elif outcome.lost:
                event, failed_at = "lost", outcome.failed_at
                gone = tuple(segment.devices[r] for r in outcome.lost)
                lost.update(gone)
                _forget_lost_nodes(args, segment, outcome.lost)
                print(f"planc: lost {_ranks(outcome.lost)} (device"
                      f"{'s' * (len(gone) != 1)} {', '.join(map(str, gone))}) of "
                      f"{segment.layout} after step {reached}; replanning onto the "
                      f"{world - len(lost)} device{'s' * (world - len(lost) != 1)} left", file=sys.stderr)
            else:
                return outcome.status
            grow.reset()
            left = tuple(d for d in range(world) if d not in lost)
            recovery = {"event": event, "lost_ranks": list(outcome.lost),
                        "from": segment.layout, "failed_at": failed_at}
            following = _switch(args, segment, first, directory, text, path, per_node,
                                left, reached, recovery)
            if isinstance(following, int):
                return following
            segment = following
    finally:
        grow.close()


def _ranks(ranks) -> str:
    return f"rank{'s' * (len(ranks) != 1)} {', '.join(map(str, ranks))}"


def plan_source(args, built) -> tuple[str, str] | str:
    """(the plan text the run's layouts are searched from, with the --set overrides
    written into it; the file's path, against which its relative paths resolve), or why
    there is none: a build directory is searched from its plan file, if that still
    compiles to the build's plan."""
    from planc.build.directory import plan_fingerprint
    from planc.lang import load_file
    from planc.lang.overrides import parse_overrides
    from planc.tune.candidate_text import with_settings

    path = args.file
    overrides = list(args.set or ())
    if os.path.isdir(args.file):  # the plan file build.json names, as it is now
        from planc.build.files import MANIFEST

        try:
            with open(os.path.join(args.file, MANIFEST), encoding="utf-8") as handle:
                path = json.load(handle).get("source") or ""
        except (OSError, ValueError, AttributeError):
            path = ""
        overrides = []
    loaded = load_file(path, overrides) if path else None
    if loaded is None or not loaded.ok:
        return (f"the plan file {path or '(unknown)'} of the build does not check any more; "
                f"run the plan file itself")
    if os.path.isdir(args.file) and plan_fingerprint(loaded.plan) != \
            plan_fingerprint(built.plan):
        return (f"the build {args.file} is no longer what its plan file {path} compiles to; "
                f"run the plan file itself")
    settings = {o.key: o.text.partition("=")[2].strip() for o in parse_overrides(overrides)}
    return (with_settings(loaded.source, settings) if settings else loaded.source), path


def _switch(args, segment: Segment, first: Segment, directory: str, text: str, path: str,
            per_node: int, left: tuple[int, ...], reached: int, recovery: dict):
    """The next :class:`Segment`: on every device again, the run's own build; else the
    layout the search finds for the devices ``left``, compiled and verified; either
    resuming from the newest checkpoint. Or the exit status, after saying why the run
    cannot go on."""
    from planc.build import directory as build_dir
    from planc.commands import MAX_LOCAL_RANKS
    from planc.commands.replan_search import best_layout
    from planc.commands.run_prepare import (checkpoint_found, resume_problem, run_options,
                                           verified_build)
    from planc.lang import load_text

    found = segment.found
    newest = newest_step(args.checkpoint_dir)
    in_memory = _in_peer_memory(args, newest)
    if in_memory is not None or newest >= 0:  # verified as --resume verifies one
        found, status = checkpoint_found(argparse.Namespace(
            **{**vars(args), "resume": in_memory or args.checkpoint_dir}))
        if found is None:
            return status
        if in_memory is not None:
            print(f"planc: the copy in peer memory (step {found.manifest['step']}) is newer "
                  f"than {args.checkpoint_dir}'s (step {newest})", file=sys.stderr)
    started = time.perf_counter()
    if len(left) == len(first.devices):  # the user's own layout, as the run began
        target, built, devices, layout = directory, first.built, first.devices, first.layout
        simulated = ""
    else:
        def check(candidate: str):
            loaded = load_text(candidate, path)
            return loaded.plan if loaded.ok else None

        choice = best_layout(segment.built.plan, text, check, left, per_node,
                             min(MAX_LOCAL_RANKS, len(left)),
                             lambda build: resume_problem(args, found, build.plan,
                                                        build.graph.graph["buckets"]))
        if isinstance(choice, str):
            where = (f"; its newest checkpoint is {found.directory} (step "
                     f"{found.manifest['step']}): continue with --resume "
                     f"{args.checkpoint_dir} once devices are back") if found else ""
            return fail(f"the run cannot go on: {choice}{where}")
        target = _next_build(directory)
        try:
            build_dir.write(choice.build, target, path, choice.text)
        except build_dir.BuildError as exc:
            return fail(f"the run cannot go on: {exc}")
        built, status = verified_build(args, target)
        if built is None:
            return status
        devices, layout = choice.devices, choice.layout
        simulated = f", simulated {choice.step_seconds * 1e3:.3g} ms a step"
    problem = resume_problem(args, found, built.plan, built.graph.graph["buckets"])
    if problem is not None:
        return fail(f"the run cannot go on: {problem}")
    resumed = found.manifest["step"] if found else 0
    recovery.update({"to": layout, "ranks": built.plan.world, "resumed_step": resumed,
                     "steps_redone": max(reached - resumed, 0)})
    redone = recovery["steps_redone"]
    print(f"planc: {'grew back' if recovery['event'] == 'grew' else 'replanned'} in "
          f"{time.perf_counter() - started:.1f} s: {segment.layout} -> {layout} on "
          f"{built.plan.world} rank{'s' * (built.plan.world != 1)} (devices "
          f"{', '.join(map(str, devices))}){simulated}, build {target}; "
          + (f"resuming from {found.directory}" if found else "starting again from step 0")
          + f", {redone} step{'s' * (redone != 1)} to redo", file=sys.stderr)
    if args.metrics and os.path.isfile(args.metrics):
        from planc.commands.run_outputs import drop_partial_record

        drop_partial_record(args.metrics)  # a leader killed while it wrote a record
    options = dataclasses.replace(
        run_options(args, target, segment.options.backend, found,
                    segment.options.data_identity), recovery=json.dumps(recovery))
    return Segment(built, options, devices, found, layout)


def _forget_lost_nodes(args, segment: Segment, lost_ranks) -> None:
    """--checkpoint-peer-memory: a node whose every rank was lost took its memory, and the
    copies in it, along (on one machine, its directory is removed)."""
    root = getattr(args, "peer_memory_root", None)
    if root is None:
        return
    from planc.checkpoint.peer_copy import forget

    per_node = segment.built.plan.topology.devices_per_node
    forget(root, [node for node in {r // per_node for r in lost_ranks}
                  if all(r in lost_ranks for r in range(node * per_node,
                                                          (node + 1) * per_node))])


def _in_peer_memory(args, newest: int) -> str | None:
    """--checkpoint-peer-memory: the checkpoint put together from the nodes' memory, if it
    is newer than the file system's newest (step ``newest``)."""
    root = getattr(args, "peer_memory_root", None)
    if root is None:
        return None
    from planc.checkpoint.format import STEP_DIR
    from planc.checkpoint.peer_copy import assemble

    assembled = assemble(root)
    if assembled is None or int(STEP_DIR.fullmatch(assembled.name).group(1)) <= newest:
        return None
    return str(assembled)


def _next_build(directory: str) -> str:
    """BUILD/replans/N for the first N not taken: nothing of an earlier run is replaced."""
    root = os.path.join(directory, REPLANS)
    number = 1
    while os.path.lexists(os.path.join(root, str(number))):
        number += 1
    return os.path.join(root, str(number))

