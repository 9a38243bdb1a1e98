"""A checkpoint's ``manifest.json``, read as untrusted input: the names of the format and
the schema every manifest is checked against when it is read.

A checkpoint directory may come from anywhere (a shared file system, a download), so its
manifest is read the way a build's files are (:mod:`planc.build.directory`): a regular file inside
the step directory (never through a symbolic link), of bounded size, whose nesting and
numbers Python can hold. Then every field the readers use is checked, with its type and
range (true is not a number; a count is a whole number within planc's limits; a file is
a plain name inside the directory), and the fields that repeat each other must agree.
After :func:`check_manifest`, the code that reads a manifest (planc.checkpoint.format,
planc.runtime.checkpoint.checkpoints, planc.runtime.checkpoint.export_hf) can index it
without checking: a manifest is refused with one line naming the file and the field,
never with a traceback.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import json
import re
import typing
from pathlib import Path
from types import SimpleNamespace

from planc.checkpoint.manifest_fields import (MAX_WHOLE, _IDENTIFIER, _at, _fields, _list,
                                              _one_of, _real, _text, _whole, _Wrong,
                                              _wrong, file_name, shown)
from planc.host.files import read_regular_file
from planc.host.json_values import too_long_integer
from planc.plan.mesh import AXES

FORMAT = "planc-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
MODEL_INDEX = "model.safetensors.index.json"
OPTIMIZER_INDEX = "optimizer.safetensors.index.json"
RNG_FILE = "rng.safetensors"
RNG_TENSOR = "torch.cpu"  # torch's global CPU generator, the one state the RNG file holds
MAX_MANIFEST_BYTES = 64 << 20  # an entry of a few hundred bytes per parameter tensor
MAX_DIMENSIONS = 8
_SHA256 = re.compile(r"[0-9a-f]{64}")
_VERSION_TEXT = re.compile(r"[0-9][0-9A-Za-z.+-]{0,63}")


class CheckpointError(Exception):
    """A checkpoint that cannot be written or resumed; the message is one line saying why."""


class Incomplete(CheckpointError):
    """A step directory without a (readable) manifest: never finished."""


def state_keys(optimizer: dict) -> tuple[str, ...]:
    """The per-element state torch.optim keeps for every parameter: AdamW's moving
    averages, SGD's momentum buffer (none without momentum)."""
    if optimizer["name"] == "adamw":
        return ("exp_avg", "exp_avg_sq")
    return ("momentum_buffer",) if optimizer.get("momentum") else ()


def state_name(param: str, key: str) -> str:
    """The name of a parameter's optimizer state in the optimizer files."""
    return f"{param}.{key}"


def reason(exc: BaseException, path: Path | None = None) -> str:
    """Why a file could not be read, in a few words; ``path``: the file opened without
    following a symbolic link, which is refused (ELOOP) if it is one."""
    if isinstance(exc, OSError):
        if exc.errno == errno.ELOOP and path is not None and path.is_symlink():
            return "it is a symbolic link; a checkpoint's files lie inside its directory"
        return exc.strerror or str(exc)
    return str(exc).split("\n")[0]


# --- reading -------------------------------------------------------------------------------


def parse_json(raw: bytes, path: Path) -> object:
    """The JSON document of a checkpoint file: NaN and Infinity come back as floats (and
    are refused where a number must be finite); a key given twice is refused, since
    another reader could take the other value."""
    def unique(pairs: list) -> dict:
        keys = [key for key, _ in pairs]
        if len(set(keys)) != len(keys):
            twice = next(key for key in keys if keys.count(key) > 1)
            raise _Duplicate(twice)
        return dict(pairs)

    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=unique)
    except _Duplicate as exc:
        raise CheckpointError(f"{path} names {json.dumps(exc.args[0])} twice in one "
                              f"object") from None
    except UnicodeDecodeError:
        raise CheckpointError(f"{path} is not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON (line {exc.lineno}, column "
                              f"{exc.colno})") from None
    except ValueError:  # an integer of thousands of digits
        raise CheckpointError(f"{path} holds {too_long_integer()}, which no planc "
                              f"checkpoint file holds") from None
    except RecursionError:
        raise CheckpointError(f"{path} nests its values too deep to be a planc checkpoint "
                              f"file") from None


class _Duplicate(Exception):
    pass


def read_manifest(directory: Path) -> dict:
    """The manifest of a step directory, checked (:func:`check_manifest`), or
    CheckpointError (:class:`Incomplete` when there is none: a checkpoint still being
    written, or one whose writer was killed)."""
    path = directory / MANIFEST
    try:
        raw = read_regular_file(path, MAX_MANIFEST_BYTES + 1, follow=False)
    except FileNotFoundError:
        raise Incomplete(f"{directory} is not a complete checkpoint (no {MANIFEST}; was the "
                         f"run stopped while writing it?)") from None
    except OSError as exc:
        raise CheckpointError(f"{path} cannot be read ({reason(exc, path)})") from None
    if len(raw) > MAX_MANIFEST_BYTES:
        raise CheckpointError(f"{path} is larger than {MAX_MANIFEST_BYTES >> 20} MiB")
    manifest = parse_json(raw, path)
    check_manifest(manifest, path)
    return manifest


def check_manifest(manifest: object, path: Path) -> None:
    """Every field of a manifest that planc reads, with its type and range, and the
    fields that must agree with each other; CheckpointError naming the file and the
    field otherwise (``D/manifest.json: optimizer.steps is "lots", not a whole number >=
    0``)."""
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a planc checkpoint manifest (its format is "
                              f"not {json.dumps(FORMAT)})")
    version = manifest.get("version")
    if type(version) is not int or version != VERSION:
        raise CheckpointError(f"{path} has format version {shown(version)}; this planc "
                              f"reads version {VERSION}")
    try:
        _check(manifest)
    except _Wrong as wrong:
        raise CheckpointError(f"{path}: {wrong}") from None


# --- the schema ----------------------------------------------------------------------------


@functools.cache
def _language():
    """The language's rules for a model block, an optimizer and the limits: a manifest's
    sections are checked as the plan checks them. Loaded when a manifest is first read, so
    that a rank that does not resume never loads the language (planc.plan.plan)."""
    from planc.models import FAMILIES
    from planc.plan.plan import DTYPE_BYTES, LIMITS, Model, Optimizer

    return SimpleNamespace(families=FAMILIES, dtypes=DTYPE_BYTES, limits=LIMITS,
                           model=Model, optimizer=Optimizer,
                           model_types=typing.get_type_hints(Model))


def _model(value: object, where: str) -> None:
    """Every field of the plan's model block (planc.plan.plan.Model), as the plan checks it."""
    language = _language()
    names = [f.name for f in dataclasses.fields(language.model)
             if not (f.metadata.get("omitted_when_empty") and isinstance(value, dict)
                     and f.name not in value)]  # written only when the model has some
    _fields(value, where, names)
    for name in names:
        item, at, hint = value[name], _at(where, name), language.model_types[name]
        if name == "options":  # a family's own keys: names and plain JSON values
            if not isinstance(item, dict) or not item:
                raise _wrong(at, item, "an object of a family's keys and their values")
            for key, option in item.items():  # named, as a plan names a wrong value
                if not isinstance(option, (bool, int, float, str)):
                    raise _wrong(_at(at, key), option, "a number, text, true or false")
        elif name == "dtype":
            _one_of(item, at, language.dtypes)
        elif name == "family":
            _one_of(item, at, language.families)
        elif hint is bool:
            if not isinstance(item, bool):
                raise _wrong(at, item, "true or false")
        elif hint is int:
            _whole(item, at, 1, language.limits["layers"] if name == "layers" else MAX_WHOLE)
        elif hint is float:
            _real(item, at, positive=True)
        elif typing.get_args(hint) == (int, type(None)):
            if item is not None:
                _whole(item, at, 1)
        else:
            _text(item, at)
    from planc.plan.plan_json import options_problem

    # the family's keys, as planc check reads them (a family without any writes none)
    problem = options_problem(value["family"], value.get("options", {}))
    if problem is not None:
        raise _Wrong(_at(where, "options") + problem)
    _top_k_within_experts(value.get("options", {}), _at(where, "options"))


def _top_k_within_experts(options: dict, where: str) -> None:
    """A mixture's top_k at most its experts, as planc check holds a plan's
    (planc.models.moe.top_k_within_experts): each value alone is of its kind, but
    together no model has them (an export wrote a config transformers cannot build)."""
    top_k, experts = options.get("top_k"), options.get("experts")
    if isinstance(top_k, int) and isinstance(experts, int) and top_k > experts:
        raise _Wrong(f"{_at(where, 'top_k')} is {top_k}, more than {_at(where, 'experts')} "
                     f"({experts}): each token goes to top_k different experts")


def _optimizer(value: object, where: str, step: int) -> None:
    names = [f.name for f in dataclasses.fields(_language().optimizer)]
    optimizer = _fields(value, where, [*names, "state", "steps"])
    _one_of(optimizer["name"], _at(where, "name"), ("sgd", "adamw"))
    _real(optimizer["lr"], _at(where, "lr"), positive=True)
    _real(optimizer["eps"], _at(where, "eps"), positive=True)
    _real(optimizer["momentum"], _at(where, "momentum"))
    _real(optimizer["weight_decay"], _at(where, "weight_decay"))
    betas = _list(optimizer["betas"], _at(where, "betas"), 2, 2)
    for i, beta in enumerate(betas):
        _real(beta, _at(_at(where, "betas"), i), below=1)
    state = _list(optimizer["state"], _at(where, "state"), 0, 4)
    for i, key in enumerate(state):
        _text(key, _at(_at(where, "state"), i), _IDENTIFIER, "the name of a state")
    keys = list(state_keys(optimizer))
    if state != keys:
        raise _Wrong(f"{_at(where, 'state')} is {json.dumps(state)}, but {optimizer['name']} "
                     f"with these hyper-parameters keeps {json.dumps(keys)}")
    steps, counted = optimizer["steps"], optimizer["name"] == "adamw"  # AdamW counts steps
    if steps is not None or counted:
        _whole(steps, _at(where, "steps"))
        if not counted or steps != step:
            raise _Wrong(f"{_at(where, 'steps')} is {steps}, but " + (
                f"the checkpoint is at step {step} (AdamW takes one step per training step)"
                if counted else f"{optimizer['name']} counts no steps (null)"))


def _layout(value: object, where: str) -> dict:
    layout = _fields(value, where, (*AXES, "zero", "microbatches"))
    for axis in AXES:
        _whole(layout[axis], _at(where, axis), 1, _language().limits["world"])
    _whole(layout["zero"], _at(where, "zero"), 0, 3)
    _whole(layout["microbatches"], _at(where, "microbatches"), 1,
           _language().limits["microbatches"])
    return layout


def _order(segment: dict, where: str) -> None:
    """A segment's lr schedule, shuffle and grad_clip, written only when its plan set
    them."""
    if "shuffle" in segment and segment["shuffle"] is not True:
        raise _wrong(_at(where, "shuffle"), segment["shuffle"], "true")
    if "grad_clip" in segment:
        _real(segment["grad_clip"], _at(where, "grad_clip"), positive=True)
    if "lr_schedule" in segment:
        at = _at(where, "lr_schedule")
        schedule = _fields(segment["lr_schedule"], at, ("name", "warmup", "min_lr", "decay"))
        _text(schedule["name"], _at(at, "name"))
        _whole(schedule["warmup"], _at(at, "warmup"))
        _whole(schedule["decay"], _at(at, "decay"))
        _real(schedule["min_lr"], _at(at, "min_lr"))


def _history(manifest: dict) -> None:
    """Which plans trained which steps: segments 0..a, a + 1..b, ..., up to step - 1, the
    last one by the plan, layout, seed and data that wrote the checkpoint."""
    history = _list(manifest["history"], "history", 1)
    following = 0
    for i, segment in enumerate(history):
        where = _at("history", i)
        _fields(segment, where, ("plan", "first_step", "last_step", "layout", "seed", "data")
                + tuple(key for key in ("lr_schedule", "shuffle", "grad_clip")
                        if isinstance(segment, dict) and key in segment))
        _order(segment, where)
        _text(segment["plan"], _at(where, "plan"))
        first = _whole(segment["first_step"], _at(where, "first_step"))
        last = _whole(segment["last_step"], _at(where, "last_step"))
        _layout(segment["layout"], _at(where, "layout"))
        _whole(segment["seed"], _at(where, "seed"))
        _text(segment["data"], _at(where, "data"))
        if first != following:
            raise _Wrong(f"{where}.first_step is {first}, but " + (
                f"the segment before it ends at step {following - 1}" if i else
                "training starts at step 0"))
        if last < first:
            raise _Wrong(f"{where}.last_step is {last}, before its first_step ({first})")
        following = last + 1
    last = history[-1]
    where = _at("history", len(history) - 1)
    if following != manifest["step"]:
        raise _Wrong(f"{where}.last_step is {following - 1}, but the checkpoint is at step "
                     f"{manifest['step']} (steps 0 to {manifest['step'] - 1} are done)")
    pairs = [("plan", "plan", manifest["plan"]), ("seed", "data.seed", manifest["data"]["seed"]),
             ("data", "data.source", manifest["data"]["source"])]
    pairs += [(f"layout.{key}", f"layout.{key}", value)
              for key, value in manifest["layout"].items()]
    for mine, theirs, value in pairs:
        held = last
        for key in mine.split("."):
            held = held[key]
        if held != value:
            raise _Wrong(f"{where}.{mine} is {shown(held)}, but {theirs} is {shown(value)} "
                         f"(the last segment is the run that wrote the checkpoint)")


def _files(value: object) -> dict:
    files = _fields(value, "files", value if isinstance(value, dict) else ())
    for name, info in files.items():
        where = _at("files", name)
        file_name(name, f"the name of {where}")
        if name == MANIFEST:
            raise _Wrong(f"{where} is the manifest itself, which cannot hold its own sha256")
        _fields(info, where, ("sha256", "bytes"))
        _text(info["sha256"], _at(where, "sha256"), _SHA256, "64 lowercase hex digits")
        _whole(info["bytes"], _at(where, "bytes"))
    for name in (MODEL_INDEX, OPTIMIZER_INDEX):
        if name not in files:
            raise _Wrong(f"{_at('files', name)} is missing")
    return files


def _listed(name: str, where: str, files: dict) -> None:
    """A file named by a field must be a safetensors file the manifest lists (and so
    hashes)."""
    if name not in files or not name.endswith(".safetensors"):
        raise _Wrong(f"{where} is {json.dumps(name)}, which is not a safetensors file of "
                     f"files")


def _tensors(value: object, field: str, files: dict, file_keys: tuple[str, ...],
             what: str) -> None:
    """The object of named tensors under ``field`` (parameters, buffers): each with its
    shape and the safetensors files of ``file_keys``."""
    tensors = _fields(value, field, value if isinstance(value, dict) else ())
    if not tensors:
        raise _wrong(field, tensors, what)
    for name, info in tensors.items():
        where = _at(field, name)
        _text(name, f"the name of {where}")
        _fields(info, where, ("shape",) + file_keys)
        shape = _list(info["shape"], _at(where, "shape"), 0, MAX_DIMENSIONS)
        for i, size in enumerate(shape):
            _whole(size, _at(_at(where, "shape"), i))
        for key in file_keys:
            _listed(file_name(info[key], _at(where, key)), _at(where, key), files)


def _parameters(value: object, files: dict) -> None:
    _tensors(value, "parameters", files, ("file", "optimizer_file"),
             "an object naming every parameter")


def _buffers(value: object, files: dict) -> None:
    """State that is not trained (a mixture's balancing bias): each a tensor of a model
    file, with its shape."""
    _tensors(value, "buffers", files, ("file",), "an object naming at least one buffer")


def _check(manifest: dict) -> None:
    # "buffers" only in a checkpoint with state that is not trained
    _fields(manifest, "", ("format", "version", "planc", "plan", "step", "model", "optimizer",
                           "data", "rng", "layout", "history", "parameters", "files")
            + (("buffers",) if isinstance(manifest, dict) and "buffers" in manifest else ()))
    _text(manifest["planc"], "planc", _VERSION_TEXT, "a planc version")
    _text(manifest["plan"], "plan")
    step = _whole(manifest["step"], "step", 1)
    _model(manifest["model"], "model")
    _optimizer(manifest["optimizer"], "optimizer", step)
    data = _fields(manifest["data"], "data", ("next_step", "seed", "source"))
    if _whole(data["next_step"], "data.next_step") != step:
        raise _Wrong(f"data.next_step is {data['next_step']}, but the checkpoint is at step "
                     f"{step} (the next step to run)")
    _whole(data["seed"], "data.seed")
    _text(data["source"], "data.source")
    _layout(manifest["layout"], "layout")
    _history(manifest)
    files = _files(manifest["files"])
    rng = _fields(manifest["rng"], "rng", ("file", "tensors"))
    _listed(file_name(rng["file"], "rng.file"), "rng.file", files)
    if rng["tensors"] != [RNG_TENSOR]:
        raise _wrong("rng.tensors", rng["tensors"], json.dumps([RNG_TENSOR]))
    _parameters(manifest["parameters"], files)
    if "buffers" in manifest:
        _buffers(manifest["buffers"], files)
