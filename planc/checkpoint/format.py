"""Checkpoints that move between plans: their format, and finding and checking one.

This half needs no torch (``planc run`` checks a checkpoint before any rank starts); the
ranks' half, which gathers, writes and reshards tensors, is
:mod:`planc.runtime.checkpoint.checkpoints`. docs/checkpoints.md describes the format.

A checkpoint is *consolidated*: every parameter, and every optimizer state of the same
shape, is stored whole (unsharded over tp and ZeRO) under its global planc name, so a
plan with another tp, cp, pp, dp or ZeRO stage can load it and take its own slices, the
way torch.distributed.checkpoint's load-time resharding and Megatron's
dist-checkpointing (sharded tensors saved by global offsets, loaded under a new
parallel layout) let a run continue on a different layout. The tensors are in
safetensors files, one per pipeline stage and kind, with a Hugging Face style index
(``model.safetensors.index.json``: name -> file); ``manifest.json`` names the model,
the optimizer, the step and every file with its sha256.

A checkpoint directory ``D`` holds ``step-NNNNNN/`` directories and ``latest``, the name
of the newest. A step directory is assembled as ``.step-NNNNNN.partial/``, its manifest
written last, and renamed into place, then ``latest`` is replaced; every file goes
through a temporary name, fsync and rename. A reader takes only step directories with a
complete manifest whose files match it, so a run killed while writing leaves the
previous checkpoint usable (the commit protocol of torch.distributed.checkpoint's
``.metadata`` file, written last by the coordinator).

A checkpoint is untrusted input: its manifest is checked field by field when it is read
(:mod:`planc.checkpoint.manifest`), its files are opened only as regular files inside
the step directory and checked against the manifest (:mod:`planc.checkpoint.files`),
and its values by :mod:`planc.runtime.checkpoint.values`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path

from planc.checkpoint.files import verify_files
from planc.checkpoint.manifest import (FORMAT, MANIFEST, MODEL_INDEX,  # noqa: F401 (API)
                                       OPTIMIZER_INDEX, RNG_FILE, RNG_TENSOR, VERSION,
                                       CheckpointError, read_manifest, reason, shown,
                                       state_keys, state_name)
from planc.host.files import (TEMPORARY_PREFIX, fsync_directory, kind_of,  # noqa: F401 (API)
                              read_regular_file, unwritable_ancestor, write_atomically)
from planc.checkpoint.training_record import TrainingRecord

LATEST = "latest"
STEP_DIR = re.compile(r"step-([0-9]{6,})")
# What a checkpoint directory may hold besides step directories and `latest`: staging
# directories of a checkpoint being written, older step directories being replaced,
# temporary files of `latest` (planc.host.files.write_atomically's ``.planc-XXXXXXXX``, left
# behind by a run killed between writing and renaming one) and the lock of the run
# writing it (planc.host.locks).
STRAY_TEMPORARY = re.compile(re.escape(TEMPORARY_PREFIX) + r"[A-Za-z0-9_]+")
# a step directory being written (staging: what a run that stopped leaves, and removes
# once it holds the lock) or replaced: never read as a checkpoint
STAGING = re.compile(r"\.step-\d{6,}\.partial")
IN_PROGRESS = re.compile(STAGING.pattern + r"|\.step-\d{6,}\.old-.*")
_OURS = re.compile(r"^(step-\d{6,}|latest|" + IN_PROGRESS.pattern + r"|\.latest\..*|"
                   + STRAY_TEMPORARY.pattern + r"|\.lock)$")


def step_name(step: int) -> str:
    return f"step-{step:06d}"


def remove_stray_temporaries(root: Path) -> None:
    """Remove what a run killed while replacing ``latest`` left: write_atomically's
    ``.planc-XXXXXXXX`` temporary (the directory is this run's while it holds its lock,
    so no other writer's temporary is there)."""
    for entry in os.scandir(root):
        if STRAY_TEMPORARY.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
            os.unlink(entry.path)


def staging_name(step: int) -> str:
    return f".{step_name(step)}.partial"


def model_file(stage: int, stages: int) -> str:
    return f"model-{stage:05d}-of-{stages:05d}.safetensors"


def optimizer_file(stage: int, stages: int) -> str:
    return f"optimizer-{stage:05d}-of-{stages:05d}.safetensors"


# --- writing files: whole or not at all --------------------------------------------------


def write_durably(path: str | os.PathLike, data: bytes) -> str:
    """Write ``data`` to ``path`` whole or not at all, also after a crash (file and
    directory fsynced: planc.host.files.write_atomically with ``durable``); returns the sha256
    of the data, which the manifest records."""
    write_atomically(path, data, durable=True)
    return hashlib.sha256(data).hexdigest()


def dump_json(data: dict) -> bytes:
    return (json.dumps(data, indent=1, sort_keys=True) + "\n").encode()


# --- the manifest ------------------------------------------------------------------------


def make_manifest(record: TrainingRecord, step: int, parameters: dict[str, dict], files: dict[str, dict],
                  history: list[dict], optimizer_steps: int | None,
                  buffers: dict[str, dict] | None = None) -> dict:
    """The manifest of the checkpoint written after ``step`` steps (0-based steps 0 to
    step - 1 are done; the next to run is ``step``); ``buffers``: the state that is not
    trained (a mixture's balancing bias), written only when there is some."""
    optimizer = dict(record.optimizer)
    return {
        "format": FORMAT, "version": VERSION, "planc": _planc_version(),
        "plan": record.name, "step": step,
        "model": dict(record.model),
        "optimizer": {**optimizer, "state": list(state_keys(optimizer)),
                      "steps": optimizer_steps},
        "data": {"next_step": step, "seed": record.seed, "source": record.data},
        "rng": {"file": RNG_FILE, "tensors": [RNG_TENSOR]},
        "layout": dict(record.layout),
        "history": history,
        "parameters": parameters,
        **({"buffers": buffers} if buffers else {}),
        "files": files,
    }


def history_segment(record: TrainingRecord, first: int, last: int) -> dict:
    """Who trained steps first..last: plan, layout, seed and data."""
    return {"plan": record.name, "first_step": first, "last_step": last,
            "layout": dict(record.layout), "seed": record.seed, "data": record.data,
            # written only when set: the segments of plans without them stay as they were
            **({"lr_schedule": record.lr_schedule} if record.lr_schedule else {}),
            **({"shuffle": True} if record.shuffle else {}),
            **({"grad_clip": record.grad_clip} if record.grad_clip is not None else {})}


def _planc_version() -> str:
    from planc import __version__

    return __version__


# --- finding the checkpoint to resume ------------------------------------------------------


@dataclass
class Found:
    directory: Path
    manifest: dict
    skipped: list[str] = field(default_factory=list)  # why newer candidates were passed over
    note: str = ""  # what planc run says about it


def is_step_directory(path: Path) -> bool:
    return bool(STEP_DIR.fullmatch(path.name)) or (path / MANIFEST).exists()


def holds_checkpoints(path: str | os.PathLike) -> bool:
    """Whether ``path`` looks like a checkpoint directory or one of its step directories
    (``latest``, a ``step-NNNNNN`` directory or a manifest), so that a command given one
    where it needs something else can name the command that reads it."""
    root = Path(path)
    try:
        return (root / MANIFEST).is_file() or os.path.lexists(root / LATEST) or any(
            STEP_DIR.fullmatch(entry) for entry in os.listdir(root))
    except (OSError, ValueError):  # unreadable, or a path holding a NUL
        return False


def find(path: str | os.PathLike, hashes: bool = True) -> Found:
    """The checkpoint ``--resume PATH`` means: PATH itself if it is a step directory,
    else the newest complete checkpoint in PATH: the one ``latest`` names, or, if that one
    is incomplete or damaged, the highest step directory that is complete and intact (the
    ones passed over are listed in ``skipped``). A step directory found in PATH must be a
    directory of PATH, not a symbolic link to one elsewhere."""
    root = Path(path)
    try:
        if not root.exists():
            raise CheckpointError(f"{root}: no such checkpoint directory")
        if not root.is_dir():
            raise CheckpointError(f"{root} is not a directory (name a checkpoint directory "
                                  f"or one of its step-NNNNNN directories)")
        if is_step_directory(root):
            if IN_PROGRESS.fullmatch(root.resolve().name):
                raise CheckpointError(f"{root} is a checkpoint being written or replaced, "
                                      f"which is never read: name its checkpoint directory")
            manifest = read_manifest(root)
            verify_files(root, manifest, hashes)
            return Found(root, manifest)
        entries = sorted((e for e in os.listdir(root) if STEP_DIR.fullmatch(e)),
                         key=lambda e: int(STEP_DIR.fullmatch(e).group(1)), reverse=True)
    except OSError as exc:
        raise CheckpointError(f"{root} cannot be read ({reason(exc)})") from None
    latest = _latest(root)
    candidates = ([latest] if latest else []) + [e for e in entries if e != latest]
    skipped: list[str] = []
    for name in candidates:
        candidate = root / name
        try:
            _step_directory(candidate, name == latest)
            manifest = read_manifest(candidate)
            verify_files(candidate, manifest, hashes)
            # the newest is chosen by name: a step directory renamed (or copied under
            # another step's name) would pass an older state off as the newest
            if int(STEP_DIR.fullmatch(name).group(1)) != manifest["step"]:
                raise CheckpointError(f"{candidate} holds the checkpoint of step "
                                      f"{manifest['step']}, not of the step its name says")
        except CheckpointError as problem:
            skipped.append(str(problem))
            continue
        return Found(candidate, manifest, skipped)
    if skipped:
        raise CheckpointError(f"{root} holds no complete checkpoint ({len(skipped)} "
                              f"incomplete or damaged; the newest: {skipped[0]})")
    raise CheckpointError(f"{root} holds no checkpoint (no step-NNNNNN directory)")


def _latest(root: Path) -> str | None:
    """The step directory ``latest`` names (None without ``latest``). planc replaces it
    whole (a temporary file and a rename), so anything but the name of a step directory
    is damage, refused: what it names is never looked for outside the directory."""
    pointer = root / LATEST
    try:
        raw = read_regular_file(pointer, 256, follow=False)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise CheckpointError(f"{pointer} cannot be read ({reason(exc, pointer)})") from None
    name = raw.decode("utf-8", errors="replace").strip()
    if not STEP_DIR.fullmatch(name):
        raise CheckpointError(f"{pointer} names {shown(name)}, not a step-NNNNNN directory "
                              f"of {root}")
    return name


def _step_directory(path: Path, latest: bool) -> None:
    """A step directory found in a checkpoint directory: a directory there, not a link
    to one elsewhere."""
    try:
        mode = os.lstat(path).st_mode
    except OSError as exc:
        raise CheckpointError((f"{path.parent / LATEST} names {path.name}, which"
                               if latest else f"{path}")
                              + f" cannot be read ({reason(exc)})") from None
    if stat.S_ISLNK(mode):
        raise CheckpointError(f"{path} is a symbolic link; a checkpoint's step directories "
                              f"lie inside it")
    if not stat.S_ISDIR(mode):
        what = "a file" if stat.S_ISREG(mode) else kind_of(mode)
        raise CheckpointError(f"{path} is {what}, not a step directory")


def problems_resuming(manifest: dict, record: TrainingRecord, buckets: dict[str, dict] | None,
                      steps: int) -> str | None:
    """Why the plan of ``record`` cannot continue from the checkpoint, or None: another model (any key of
    the model block), another optimizer (its kind or a hyper-parameter: the state would mean
    something else), parameters of other names or shapes than the build's ``buckets`` (not
    compared when None: before compiling), or no step left to run."""
    differences = _differences(manifest["model"], record.model)
    if differences:
        return f"the checkpoint's model differs from the plan's: {differences}"
    saved = {k: v for k, v in manifest["optimizer"].items() if k not in ("state", "steps")}
    differences = _differences(saved, record.optimizer)
    if differences:
        return (f"the checkpoint's optimizer differs from the plan's: {differences} (its "
                f"state would not mean the same)")
    keys = list(state_keys(record.optimizer))
    if list(manifest["optimizer"].get("state") or []) != keys:
        return (f"the checkpoint holds optimizer state {manifest['optimizer'].get('state')}, "
                f"the plan's optimizer needs {keys}")
    needed = {m["param"]: list(m["full_shape"]) for b in (buckets or {}).values()
              for m in b["members"]}
    stored = {name: info.get("shape") for name, info in manifest["parameters"].items()}
    if buckets is not None and needed != stored:
        missing = sorted(set(needed) - set(stored))
        extra = sorted(set(stored) - set(needed))
        wrong = sorted(n for n in set(needed) & set(stored) if needed[n] != stored[n])
        what = (f"missing {missing[0]}" if missing else f"has no use for {extra[0]}"
                if extra else f"{wrong[0]} is {stored[wrong[0]]}, the plan needs "
                f"{needed[wrong[0]]}")
        return f"the checkpoint's parameters are not the plan's ({what})"
    step = manifest["step"]
    if step >= steps:
        return (f"the checkpoint is at step {step} and the run ends at step {steps} (steps "
                f"count from the start of training): nothing left to run; raise --steps or "
                f"train.steps")
    return None


# What a history segment that does not name these keys was trained with.
TRAINED_WITHOUT = {"lr_schedule": None, "shuffle": False, "grad_clip": None}


def _as_planned(key: str, value) -> str:
    """A training setting as a .plan file writes it (``cosine(warmup = 1, ...)``, ``on``,
    ``off``), not as Python shows it (a dict, True, None)."""
    if value is None:
        return {"lr_schedule": "constant", "source": "synthetic",
                "data": "synthetic"}.get(key, "off")
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, dict) and isinstance(value.get("name"), str):
        if value["name"] == "constant" and not value.get("warmup"):
            return "constant"
        return value["name"] + "(" + ", ".join(
            f"{k} = {_as_planned(k, v)}" for k, v in value.items() if k != "name") + ")"
    if isinstance(value, str):
        return json.dumps(value)
    return str(value)


def problems_checking(manifest: dict, record: TrainingRecord) -> str | None:
    """--check with --resume compares with one process trained from step 0 under the plan:
    it needs every step of the checkpoint trained with the plan's seed, data, lr schedule,
    sample order and gradient clipping."""
    for segment in manifest["history"]:
        for key, mine in (("seed", record.seed), ("data", record.data),
                          ("lr_schedule", record.lr_schedule), ("shuffle", record.shuffle),
                          ("grad_clip", record.grad_clip)):
            theirs = segment.get(key, TRAINED_WITHOUT.get(key))
            if theirs != mine:
                return (f"--check with --resume compares with one process trained from step "
                        f"0 under this plan, but steps {segment.get('first_step')}.."
                        f"{segment.get('last_step')} of the checkpoint were trained with "
                        f"{key} {_as_planned(key, theirs)} (the plan: "
                        f"{_as_planned(key, mine)})")
    return None


def resume_notes(manifest: dict, record: TrainingRecord) -> list[str]:
    """Warnings: the plan draws its batches from another seed or source, follows another
    lr schedule or reads its samples in another order than the checkpoint's last steps
    did (what problems_checking refuses under --check)."""
    data, last, step = manifest["data"], manifest["history"][-1], manifest["step"]
    notes = []
    for key, mine in (("seed", record.seed), ("source", record.data)):
        if data.get(key) != mine:
            notes.append(f"the checkpoint was trained with data {key} "
                         f"{_as_planned(key, data.get(key))}, the plan has "
                         f"{_as_planned(key, mine)}: steps from {step} on read the plan's")
    for key, mine, what in (("lr_schedule", record.lr_schedule, "follow the plan's"),
                            ("shuffle", record.shuffle, "read the plan's order of samples"),
                            ("grad_clip", record.grad_clip, "clip as the plan says")):
        theirs = last.get(key, TRAINED_WITHOUT[key])
        if theirs != mine:
            notes.append(f"the checkpoint was trained with {key} {_as_planned(key, theirs)}, "
                         f"the plan has {_as_planned(key, mine)}: steps from {step} on {what}")
    return notes


def _differences(saved: dict, mine: dict) -> str:
    keys = sorted(set(saved) | set(mine))
    parts = [f"{k} = {_show(saved.get(k, '(absent)'))} in the checkpoint, "
             f"{_show(mine.get(k, '(absent)'))} in the plan"
             for k in keys if saved.get(k, "(absent)") != mine.get(k, "(absent)")]
    return "; ".join(parts)


def _show(value) -> str:
    return json.dumps(value) if not isinstance(value, str) or value == "(absent)" else value


# --- the checkpoint directory --------------------------------------------------------------


_STEP_FILE = re.compile(r"(model|optimizer)-\d{5}-of-\d{5}\.safetensors")
_STEP_FILES = frozenset({MANIFEST, MODEL_INDEX, OPTIMIZER_INDEX, RNG_FILE})


def not_ours(root: Path, name: str) -> str | None:
    """Why the entry ``name`` of a checkpoint directory, named as planc names its own, is
    not one planc wrote, or None: a run writes ``latest`` and its temporaries in place
    (never through a link), replaces a step directory whole and removes staging
    directories, so each must be what planc makes: a regular file, or a directory of
    nothing but a checkpoint's files (some perhaps missing or damaged)."""
    if name == ".lock":  # the lock of a run (planc.host.locks checks it)
        return None
    mode = os.lstat(root / name).st_mode
    if stat.S_ISLNK(mode):
        return f"{name} is a symbolic link"
    if not STEP_DIR.fullmatch(name) and not IN_PROGRESS.fullmatch(name):  # files
        return None if stat.S_ISREG(mode) else f"{name} is {kind_of(mode)}, not a file"
    if not stat.S_ISDIR(mode):
        what = "a file" if stat.S_ISREG(mode) else kind_of(mode)
        return f"{name} is {what}, not a checkpoint's directory"
    staging = not STEP_DIR.fullmatch(name)  # being written or replaced: removed whole,
    try:  # so it too must hold nothing but a checkpoint's files
        inside = os.listdir(root / name)
    except OSError as exc:
        return f"{name} cannot be read ({reason(exc)})"
    for entry in sorted(inside):  # a damaged checkpoint's files are still its own
        if staging and STRAY_TEMPORARY.fullmatch(entry):  # a write cut short
            continue
        if entry not in _STEP_FILES and not _STEP_FILE.fullmatch(entry):
            return f"{name}/{entry} is not a file of a checkpoint"
        if not stat.S_ISREG(os.lstat(root / name / entry).st_mode):
            return f"{name}/{entry} is not a regular file"
    return None


def writable_problem(path: str) -> str | None:
    """Why ``--checkpoint-dir PATH`` cannot hold checkpoints, or None. PATH may not exist
    yet (its nearest existing parent must be writable); an existing one must be a
    directory holding nothing but checkpoints, so that a typo cannot fill another one."""
    target = Path(path)
    if target.exists():
        if not target.is_dir():
            return f"--checkpoint-dir {path}: is not a directory"
        try:
            foreign = sorted(e for e in os.listdir(target) if not _OURS.match(e))
        except OSError as exc:
            return f"--checkpoint-dir {path}: cannot be read ({reason(exc)})"
        if foreign:
            return (f"--checkpoint-dir {path}: holds {foreign[0]!r}, which is not a "
                    f"checkpoint; name an empty or a checkpoint directory")
        for name in sorted(os.listdir(target)):
            problem = not_ours(target, name)
            if problem:
                return (f"--checkpoint-dir {path}: {problem}; planc writes, replaces and "
                        f"removes only what it wrote there: move it, or name another "
                        f"directory")
        if not os.access(target, os.W_OK | os.X_OK):
            return f"--checkpoint-dir {path}: is not writable"
        return None
    parent = unwritable_ancestor(target)
    if parent is not None:
        return f"--checkpoint-dir {path}: cannot be created ({parent} is not writable)"
    return None
