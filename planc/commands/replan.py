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

import dataclasses
import json
import os
import signal
import sys
import time

from planc.checkpoint.format import MANIFEST, STEP_DIR
from planc.commands import fail

REPLANS = "replans"  # BUILD/replans/N: the build of a run's N-th switch of layout


def committed(directory: str) -> dict[str, tuple[int, int]]:
    """Every step directory of ``directory`` with a manifest: its name and the manifest's
    (inode, modification time), which a checkpoint committed again changes."""
    found = {}
    try:
        names = os.listdir(directory)
    except OSError:
        return found
    for name in filter(STEP_DIR.fullmatch, names):
        try:
            info = os.stat(os.path.join(directory, name, MANIFEST))
        except OSError:
            continue
        found[name] = (info.st_ino, info.st_mtime_ns)
    return found


def own_checkpoints(directory: str, before: dict) -> list[tuple[int, str]]:
    """(step, path) of every checkpoint in ``directory`` that this run committed, newest
    first: not there, or not the same, in ``before`` (:func:`committed` as the run began).
    Not ``latest``: a run resumed from an older step of the directory would find the
    abandoned steps there."""
    own = [name for name, seen in committed(directory).items() if before.get(name) != seen]
    steps = sorted(((int(STEP_DIR.fullmatch(name).group(1)), name) for name in own),
                   reverse=True)
    return [(step, os.path.join(directory, name)) for step, name in steps]


def newest_own(directory: str, before: dict) -> tuple[int, str | None]:
    """(step, path) of the newest of :func:`own_checkpoints`; (-1, None) if none."""
    own = own_checkpoints(directory, before)
    return own[0] if own else (-1, None)


class GrowSignal:
    """SIGUSR1: the devices lost are back. :meth:`due` turns true once this run has
    committed a checkpoint newer than its newest at the signal, short of the last step:
    the run grows back from it."""

    def __init__(self, checkpoint_dir: str, before: dict, steps: int):
        self.checkpoint_dir, self.before, self.steps = checkpoint_dir, before, steps
        self.received_at: float | None = None
        self.mark: int | None = None
        self.previous = signal.signal(signal.SIGUSR1, self._handle)

    def _handle(self, signum, frame) -> None:
        self.received_at = self.received_at or time.time()

    def due(self) -> bool:
        if self.received_at is None:
            return False
        newest = newest_own(self.checkpoint_dir, self.before)[0]
        if self.mark is None:
            self.mark = newest
        return self.mark < newest < self.steps  # the last step's: the run is ending

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


def keep_training(args, built, directory: str, options, found, source, interrupts) -> int:
    """Launch ``built`` (in ``directory``) with ``options`` (resuming from ``found``),
    and again on a new layout after each failure that loses devices, until the run ends
    or cannot go on; ``source``: :func:`plan_source`'s (text, path)."""
    from planc.commands.tune import devices_per_node
    from planc.runtime.launcher.launch import launch_watched
    from planc.tune.space import of_plan

    text, path = source
    earlier = committed(args.checkpoint_dir)  # the checkpoints of earlier runs
    world = built.plan.world
    per_node = devices_per_node(built.plan, text, world)
    segment = first = Segment(built, options, tuple(range(world)), found,
                              of_plan(built.plan).text())
    reached = found.manifest["step"] if found else 0  # steps the run had finished
    grow = GrowSignal(args.checkpoint_dir, earlier, args.steps or built.plan.train.steps)
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
                remaining = world - len(lost)
                print(f"planc: lost {_ranks(outcome.lost)} (device"
                      f"{'s' * (len(gone) != 1)} {', '.join(map(str, gone))}) of "
                      f"{segment.layout} after step {reached}; replanning onto the "
                      f"{remaining} device{'s' * (remaining != 1)} left", file=sys.stderr)
            else:
                return outcome.status
            grow.reset()
            left = tuple(d for d in range(world) if d not in lost)
            recovery = {"event": event, "lost_ranks": list(outcome.lost),
                        "from": segment.layout, "failed_at": failed_at}
            following = _switch(args, segment, first, directory, text, path, per_node,
                                left, reached, recovery, earlier, interrupts)
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
                path = json.load(handle).get("source")
        except (OSError, ValueError, AttributeError):
            path = ""
        path = path if isinstance(path, str) else ""
        overrides = []
    loaded = load_file(path, overrides) if path else None
    if loaded is None or not loaded.ok:
        return (f"the plan file {path or '(unknown)'} of the build does not check any more; "
                f"run the plan file itself")
    if os.path.isdir(args.file) and plan_fingerprint(loaded.plan) != \
            plan_fingerprint(built.plan):
        return (f"the build {args.file} is not what its plan file {path} compiles to as it "
                f"is now (the file changed, or the build was compiled with --set); run the "
                f"plan file, with its --set, instead")
    settings = {o.key: o.text.partition("=")[2].strip() for o in parse_overrides(overrides)}
    return (with_settings(loaded.source, settings) if settings else loaded.source), path


def _switch(args, segment: Segment, first: Segment, directory: str, text: str, path: str,
            per_node: int, left: tuple[int, ...], reached: int, recovery: dict,
            earlier: dict, interrupts):
    """The next :class:`Segment`: on every device again, the run's own build; else the
    layout the search finds for the devices ``left``, compiled and verified; either
    resuming from the newest checkpoint. Or the exit status, after saying why the run
    cannot go on."""
    from planc.build import directory as build_dir
    from planc.commands import MAX_LOCAL_RANKS
    from planc.commands.replan_search import best_layout
    from planc.commands.run_prepare import resume_problem, run_options, verified_build
    from planc.lang import load_text

    found = newest_checkpoint(args, segment, earlier, interrupts)
    started = time.perf_counter()
    if len(left) == len(first.devices):  # the user's own layout, as the run began
        target, built, devices, layout = directory, first.built, first.devices, first.layout
        simulated = ""
        problem = resume_problem(args, found, built.plan, built.graph.graph["buckets"])
        if problem is not None:
            return fail(f"the run cannot go on: {problem}")
    else:  # the search kept only layouts that resume from ``found``
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


def newest_checkpoint(args, segment: Segment, earlier: dict, interrupts):
    """The newest whole checkpoint the run can go on from, verified as --resume verifies
    one: the newest intact one of this run's in --checkpoint-dir, the one put together from the
    nodes' memory (--checkpoint-peer-memory) and the one the segment started from (None:
    step 0); one that does not verify is passed over, with a warning."""
    from planc.checkpoint.format import CheckpointError
    from planc.commands.run_prepare import verified_checkpoint

    # every one of this run's, newest first: a damaged newest leaves the one before it
    candidates = [(step, path, "") for step, path in own_checkpoints(args.checkpoint_dir,
                                                                      earlier)]
    step = candidates[0][0] if candidates else -1
    root = getattr(args, "peer_memory_root", None)
    if root is not None:
        from planc.checkpoint.peer_copy import assemble, clear

        assembled = assemble(root)
        clear(root)  # the next layout's nodes start afresh; the assembled copy stays
        if assembled is not None:
            memory = int(STEP_DIR.fullmatch(assembled.name).group(1))
            candidates.append((memory, str(assembled), f" (the copy in peer memory, newer "
                                                       f"than {args.checkpoint_dir}'s step "
                                                       f"{max(step, 0)})"))
    if segment.found is not None:
        candidates.append((segment.found.manifest["step"], str(segment.found.directory), ""))
    for step, path, why in sorted(candidates, key=lambda c: -c[0]):
        try:
            found = verified_checkpoint(path, interrupts)
        except CheckpointError as exc:
            print(f"planc: warning: passing over {path}: {exc}", file=sys.stderr)
            continue
        if why:
            print(f"planc: going on from step {step}{why}", file=sys.stderr)
        return found
    return None


def _next_build(directory: str) -> str:
    """BUILD/replans/N for the first N not taken: nothing of an earlier run is replaced."""
    root = os.path.join(directory, REPLANS)
    number = 1
    while os.path.lexists(os.path.join(root, str(number))):
        number += 1
    return os.path.join(root, str(number))

