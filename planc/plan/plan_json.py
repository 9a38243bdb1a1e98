"""Reading a plan back from plan.json: the inverse of :meth:`planc.plan.plan.Plan.to_dict`.

A build directory is untrusted input, so plan.json is read strictly: every field present,
of its type, within planc's limits (:data:`planc.plan.plan.LIMITS`) and consistent with the
others, or a ValueError that names the field.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import typing
from typing import Any, Mapping

from planc.host.json_values import json_kind
from planc.plan.data_source import checked
from planc.diagnostics import Span
from planc.plan.lr_schedule import SCHEDULE_ARGUMENTS, problems
from planc.plan.mesh import is_axis_order
from planc.plan.topology import TUNED_COLLECTIVES
from planc.plan.optimize import GRAD_ACCUMULATIONS, KERNEL_MODES
from planc.plan.plan import (DTYPE_BYTES, GRAD_REDUCES, LIMITS, PLAN_FORMAT_VERSION,
                             REDUCE_DTYPES, Plan, Sources)
from planc.vocabulary.units import MAX_RATE, MAX_SECONDS, SMALLEST
from planc.vocabulary.versions import is_version


def plan_from_dict(data: Mapping[str, Any]) -> Plan:
    """Inverse of :meth:`Plan.to_dict`. Strict: raises ValueError naming the field when a
    field is missing, unknown, of the wrong type, or inconsistent with the others."""
    if not isinstance(data, Mapping):
        raise ValueError("the plan is not a JSON object")
    if not is_version(data.get("version"), PLAN_FORMAT_VERSION):
        raise ValueError(f"unsupported plan format version {data.get('version')!r}")
    body = {k: v for k, v in data.items() if k != "version"}
    sources = body.pop("sources", None)
    if not isinstance(sources, Mapping) or not isinstance(sources.get("path"), str) or \
            not isinstance(sources.get("spans"), Mapping):
        raise ValueError("plan.sources must hold a path and spans")
    try:
        spans = {str(k): Span(*v) for k, v in sources["spans"].items()}
    except TypeError:
        raise ValueError("plan.sources.spans holds a malformed span") from None
    plan = _build(Plan, body, "plan", skip=("sources",))
    plan = dataclasses.replace(plan, sources=Sources(sources["path"], spans))
    _check_types(plan)
    _check_values(plan)
    problem = options_problem(plan.model.family, plan.model.options)
    if problem is not None:
        raise ValueError(f"plan.model.options{problem}")
    _check_consistency(plan)
    return plan


def holds(kind, value: Any) -> bool:
    """Whether ``value``, as a plan holds it, is one the language's ``kind`` reads
    (planc.vocabulary.kinds): an integer or a number in its range, on or off, one of a
    choice's words, a positive quantity; True for the kinds this cannot judge alone
    (checked by their own rules)."""
    from planc.vocabulary.kinds import (MAX_INTEGER, Boolean, Choice, Integer, OnOffOrCount,
                                        Quantity, Real)

    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(kind, Integer):
        return type(value) is int and kind.minimum <= value <= min(
            MAX_INTEGER, kind.maximum if kind.maximum is not None else MAX_INTEGER)
    if isinstance(kind, Real):
        return number and math.isfinite(value) and (
            value > kind.minimum or value == kind.minimum and kind.minimum_allowed) and \
            (kind.maximum is None or value <= kind.maximum)
    if isinstance(kind, Boolean):
        return isinstance(value, bool)
    if isinstance(kind, OnOffOrCount):
        return isinstance(value, bool) or type(value) is int and 1 <= value <= MAX_INTEGER
    if isinstance(kind, Choice):
        return isinstance(value, str) and value in kind.words
    if isinstance(kind, Quantity):  # and Time: a positive amount in its base unit
        return number and math.isfinite(value) and value > 0
    return True


def options_problem(family: str, options: Mapping[str, Any]) -> str | None:
    """What is wrong with a model block's family keys (``model.options`` of a plan.json or
    of a checkpoint's manifest), as the rest of a message after ``options``; None if
    nothing: every key of the family that is not optional is there, and each holds a
    value its kind reads. ``family`` is one of planc.models.FAMILIES."""
    from planc.models import FAMILIES
    from planc.plan.plan import Model

    described = FAMILIES[family]
    core = {f.name for f in dataclasses.fields(Model)}
    for name, key in described.keys.items():
        if name == "preset":
            continue
        if name not in options:  # a key of every model is held beside the options
            if not key.optional and name not in core:
                return f" has no {name}, a key of model {described.name}"
        elif not holds(key.kind, options[name]):
            return f".{name} is {options[name]!r}, not {key.kind.noun}"
    return None


@functools.lru_cache(maxsize=None)
def _field_types(cls: type) -> dict[str, Any]:
    """A dataclass's field annotations, evaluated (once per class: reading a plan.json
    walks every section three times)."""
    return typing.get_type_hints(cls)


def _check_types(value: Any, where: str = "plan") -> None:  # noqa: C901
    """Check every field of a dataclass tree against its annotation."""
    hints = _field_types(type(value))
    for f in dataclasses.fields(value):
        item, hint = getattr(value, f.name), hints[f.name]
        path = f"{where}.{f.name}"
        _check_item(item, hint, path)
        if isinstance(item, int) and not isinstance(item, bool) and f.name in _COUNTS \
                and item < 1:
            raise ValueError(f"{path} must be at least 1, got {item}")


def _item_hints(hint: Any, count: int) -> tuple:
    """The annotation of each of ``count`` items of a tuple annotated ``hint``:
    ``tuple[X, ...]``'s X for each, or ``tuple[X, Y]``'s own (their number is then the
    count the items must have)."""
    args = typing.get_args(hint)
    return (args[0],) * count if len(args) == 2 and args[1] is Ellipsis else args


def _check_item(item: Any, hint: Any, path: str) -> None:
    """One field's value against its annotation; a tuple's items one by one, so that a
    message names the item (``plan.topology.intra.collectives[0].bandwidth``)."""
    if dataclasses.is_dataclass(item) and not isinstance(item, type):
        _check_types(item, path)
        return
    if typing.get_origin(hint) is tuple and isinstance(item, tuple):
        # as many items as the hint names: _convert refused any other count
        for i, (x, a) in enumerate(zip(item, _item_hints(hint, len(item)))):
            _check_item(x, a, f"{path}[{i}]")
        return
    if not _matches(item, hint):
        # 2.0 in a count: the number shown, as JSON wrote it
        what = repr(item) if isinstance(item, float) else f"a JSON {json_kind(item)}"
        raise TypeError(f"{path} is {what} where {_expected(hint)} belongs")


_COUNTS = {"layers", "hidden", "heads", "ffn", "vocab", "seq", "batch", "tp", "cp", "pp", "dp", "ep",
           "nodes", "devices_per_node", "virtual", "microbatches", "steps"}


# A field's Python type as JSON calls what it holds, for messages.
_JSON_NAMES = {int: "a whole number (no decimal point)", float: "a number", str: "a string",
               bool: "true or false", type(None): "null"}


def _expected(hint: Any) -> str:
    """What a field of type ``hint`` holds, in JSON's words ("a whole number or null")."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return " or ".join(dict.fromkeys(_expected(a) for a in args))
    if origin is tuple:
        return "an array"
    if origin is not None:
        return "an object"
    return _JSON_NAMES.get(hint, f"a {getattr(hint, '__name__', hint)}")


def _matches(item: Any, hint: Any) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return True
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return any(_matches(item, a) for a in args)
    if origin is tuple:
        if not isinstance(item, tuple):
            return False
        inner = _item_hints(hint, len(item))
        return len(item) == len(inner) and all(_matches(x, a) for x, a in zip(item, inner))
    if origin is not None:  # Mapping and the like: trust the container
        return isinstance(item, origin)
    if hint is type(None):
        return item is None
    if hint is float:
        return isinstance(item, (int, float)) and not isinstance(item, bool)
    if hint is int:
        return isinstance(item, int) and not isinstance(item, bool)
    return isinstance(item, hint)


def _build(cls, data: Any, where: str, skip: tuple[str, ...] = ()) -> Any:
    """A dataclass from its asdict() form, every field required and none unknown."""
    if not isinstance(data, Mapping):
        raise ValueError(f"{where} is not a JSON object")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    missing = [name for name in fields if name not in data and name not in skip
               and not fields[name].metadata.get("omitted_when_empty")
               and not fields[name].metadata.get("omitted_when_default")]
    unknown = [name for name in data if name not in fields]
    if missing or unknown:
        raise ValueError(f"{where} has " + ", ".join(
            ([f"no {', '.join(missing)}"] if missing else [])
            + ([f"unknown {', '.join(unknown)}"] if unknown else [])))
    hints = _field_types(cls)
    values = {}
    for name in fields:
        if name in skip or name not in data:
            continue
        values[name] = _convert(data[name], hints[name], f"{where}.{name}")
    return cls(**values)  # skipped fields take their defaults


def _convert(value: Any, hint: Any, where: str) -> Any:
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _build(hint, value, where)
    if typing.get_origin(hint) is tuple:
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{where} is not a list")
        inner = _item_hints(hint, len(value))
        if len(inner) != len(value):
            raise ValueError(f"{where} should hold {len(inner)} items")
        return tuple(_convert(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(value, inner)))
    return value


# Floats that must be above 0; every other float must be 0 or more. None is finite.
_POSITIVE = {"flops", "bandwidth", "efficiency", "lr", "eps", "memory", "norm_eps",
             "rope_theta"}


# A topology's figures within what planc check lets a plan write (planc.lang.schema and
# planc.vocabulary.units's ranges) and a calibrated topology hold (planc.plan.presets):
# beyond them the cost model's sums overflow or lose a kernel's time, and a quotient of
# two reaches 0.
_RATE_RANGE, _TIME_RANGE = (1.0, MAX_RATE), (0.0, MAX_SECONDS)
_TOPOLOGY_RANGES = {"flops": _RATE_RANGE, "bandwidth": _RATE_RANGE, "memory": _RATE_RANGE,
                    "exp_rate": _RATE_RANGE, "efficiency": (SMALLEST, 1.0), "overlap": (0.0, 1.0),
                    "overhead": _TIME_RANGE, "backward_overhead": _TIME_RANGE,
                    "handoff": _TIME_RANGE, "latency": _TIME_RANGE}
# The topology's fields that hold rows of numbers: a sweep's (bytes, bytes/s), an
# operator's (name, forward s, gradient s).
_ROW_RANGES = {"sweep": _RATE_RANGE, "overheads": _TIME_RANGE}


def _real(hint: Any) -> bool:
    """Whether a field annotated ``hint`` holds a real number (JSON may write it as an
    integer: 1 for 1.0)."""
    return hint is float or float in typing.get_args(hint)


def _check_values(value: Any, where: str = "plan") -> None:
    """Every number finite and in its range, every enum word known, every limit kept:
    what planc check guarantees, for a plan read back from a build's plan.json."""
    hints = _field_types(type(value))
    for f in dataclasses.fields(value):
        item, path = getattr(value, f.name), f"{where}.{f.name}"
        number = isinstance(item, (int, float)) and not isinstance(item, bool)
        if dataclasses.is_dataclass(item):
            _check_values(item, path)
        elif isinstance(item, tuple):
            for i, x in enumerate(item):
                if dataclasses.is_dataclass(x):
                    _check_values(x, f"{path}[{i}]")
                elif f.name in _ROW_RANGES:
                    _check_row(x, _ROW_RANGES[f.name], f"{path}[{i}]")
                elif isinstance(x, float) and not (math.isfinite(x) and 0 <= x < 1
                                                   if f.name == "betas" else math.isfinite(x)):
                    raise ValueError(f"{path}[{i}] is {_spelled(x)}")
            if f.name == "sweep":
                _check_sweep_order(item, path)
        elif number and (isinstance(item, float) or f.name in _POSITIVE or
                         _real(hints[f.name])):
            if not math.isfinite(item) or item < 0 or (item == 0 and f.name in _POSITIVE):
                raise ValueError(f"{path} is {_spelled(item)}, not a "
                                 f"{'positive' if f.name in _POSITIVE else 'non-negative'} "
                                 f"finite number")
            if where.startswith("plan.topology") and f.name in _TOPOLOGY_RANGES:
                _check_within(item, _TOPOLOGY_RANGES[f.name], path)
    if where != "plan":
        return
    plan = value
    if plan.model.dtype not in DTYPE_BYTES:
        raise ValueError(f"plan.model.dtype is {plan.model.dtype!r}, not one of "
                         f"{', '.join(DTYPE_BYTES)}")
    from planc.models import FAMILIES

    if plan.model.family not in FAMILIES:
        raise ValueError(f"plan.model.family is {plan.model.family!r}, not one of "
                         f"{', '.join(FAMILIES)}")
    family = FAMILIES[plan.model.family]
    for key, value in plan.model.options.items():
        # the value by its key's kind: options_problem, which plan_from_dict asks next
        if key not in family.keys or not isinstance(value, (bool, int, float, str)) or \
                isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"plan.model.options.{key} is not a value of a key of model "
                             f"{family.name}")
    if plan.train.optimizer.name not in ("sgd", "adamw"):
        raise ValueError(f"plan.train.optimizer.name is {plan.train.optimizer.name!r}")
    if plan.optimize.grad_accumulation not in GRAD_ACCUMULATIONS:
        raise ValueError(f"plan.optimize.grad_accumulation is "
                         f"{plan.optimize.grad_accumulation!r}, not one of "
                         f"{', '.join(GRAD_ACCUMULATIONS)}")
    for key in ("data", "eval_data"):
        checked(getattr(plan.train, key), f"plan.train.{key}")
    for level in ("intra", "inter"):
        for i, tuning in enumerate(getattr(plan.topology, level).collectives):
            if tuning.kind not in TUNED_COLLECTIVES:
                raise ValueError(f"plan.topology.{level}.collectives[{i}].kind is "
                                 f"{tuning.kind!r}, not one of {', '.join(TUNED_COLLECTIVES)}")
    if plan.optimize.kernels not in KERNEL_MODES:
        raise ValueError(f"plan.optimize.kernels is {plan.optimize.kernels!r}, not one of "
                         f"{', '.join(KERNEL_MODES)}")
    if plan.shard.dp.reduce_dtype not in REDUCE_DTYPES:
        raise ValueError(f"plan.shard.dp.reduce_dtype is {plan.shard.dp.reduce_dtype!r}, "
                         f"not one of {', '.join(REDUCE_DTYPES)}")
    if plan.shard.dp.grad_reduce not in GRAD_REDUCES:
        raise ValueError(f"plan.shard.dp.grad_reduce is {plan.shard.dp.grad_reduce!r}, "
                         f"not one of {', '.join(GRAD_REDUCES)}")
    if plan.shard.dp.grad_reduce == "all_reduce" and plan.shard.dp.zero != 1:
        raise ValueError(f"plan.shard.dp.grad_reduce is all_reduce with zero = "
                         f"{plan.shard.dp.zero}")
    _check_lr_schedule(plan.train)
    if plan.train.init_form not in ((None,) if plan.train.init is None else ("saved", "memory")):
        raise ValueError(f"plan.train.init_form is {plan.train.init_form!r}")
    mesh, pp = plan.mesh, plan.shard.pp
    for what, have in (("world", mesh.world), ("layers", plan.model.layers),
                       ("microbatches", plan.schedule.microbatches),
                       ("schedule", mesh.pp * pp.virtual * plan.schedule.microbatches)):
        if have > LIMITS[what]:
            raise ValueError(f"plan's {what} ({have}) is more than planc's limit of "
                             f"{LIMITS[what]}")


def _spelled(number: float) -> str:
    """A number as plan.json spells it (NaN, Infinity), not as Python prints it; an
    integer of thousands of digits by its length."""
    text = json.dumps(number)
    return text if len(text) <= 20 else f"an integer of {len(text.lstrip('-')):,} digits"


def _check_row(row: tuple, within: tuple[float, float], path: str) -> None:
    """A row of numbers inside a tuple field: a link's ``sweep`` (sizes and bandwidths,
    which the cost model divides by and takes the logarithms of: planc.plan.topology.
    Link.swept) or a device's ``overheads`` (seconds), each in a calibrated topology's
    range."""
    for j, y in enumerate(row):
        if isinstance(y, (int, float)) and not isinstance(y, bool):
            _check_within(y, within, f"{path}[{j}]")


def _check_within(number: float, within: tuple[float, float], path: str) -> None:
    low, high = within
    if not low <= number <= high:
        raise ValueError(f"{path} is {_spelled(number)}, not a number from {low:g} to "
                         f"{high:g}")


def _check_sweep_order(sweep: tuple, path: str) -> None:
    """A sweep's buffer sizes in increasing order, as Link.swept interpolates between
    neighbours."""
    for i in range(1, len(sweep)):
        if sweep[i][0] <= sweep[i - 1][0]:
            raise ValueError(f"{path}[{i}][0] is {_spelled(sweep[i][0])}, not above "
                             f"{path}[{i - 1}][0] ({_spelled(sweep[i - 1][0])}): a sweep's "
                             f"buffer sizes increase")


def _check_lr_schedule(train) -> None:
    """train.lr_schedule as planc check accepts it (planc.plan.lr_schedule)."""
    schedule = train.lr_schedule
    if schedule.name not in SCHEDULE_ARGUMENTS:
        raise ValueError(f"plan.train.lr_schedule.name is {schedule.name!r}")
    found = problems(schedule, train.optimizer.lr, train.steps)
    if found or (schedule.name == "wsd") != (schedule.decay > 0):
        raise ValueError("plan.train.lr_schedule: " +
                         (found[0][1] if found else "decay is wsd's alone, and wsd needs it"))


def _check_consistency(plan: "Plan") -> None:
    mesh, pp = plan.mesh, plan.shard.pp
    if not is_axis_order(mesh.order):
        raise ValueError("plan.mesh.order must name tp, cp, pp and dp once each")
    if plan.topology.nodes * plan.topology.devices_per_node != mesh.world:
        raise ValueError("plan.topology does not hold the mesh's world")
    chunks = pp.chunks
    if len(chunks) != mesh.pp * pp.virtual or chunks[0][0] != 0 or \
            chunks[-1][1] != plan.model.layers - 1 or any(
                b[0] != a[1] + 1 for a, b in zip(chunks, chunks[1:])) or any(
                c[0] > c[1] for c in chunks[1:-1]) or any(c[0] > c[1] + 1 for c in chunks):
        # Only the first and the last chunk may be empty (the embedding or head alone).
        raise ValueError("plan.shard.pp.chunks do not cover the layers in order")
    if (mesh.tp * mesh.cp * mesh.dp) % mesh.ep:
        raise ValueError(f"plan.mesh.ep ({mesh.ep}) does not divide a stage's tp x cp x dp "
                         f"ranks")
    chunks_overlap = plan.optimize.tp_overlap
    if type(chunks_overlap) is int and mesh.tp > 1 and \
            (plan.model.seq // mesh.cp) % (mesh.tp * chunks_overlap):
        raise ValueError(f"plan.optimize.tp_overlap ({chunks_overlap}) does not cut seq / cp "
                         f"by tp")
    if plan.model.batch % (mesh.dp * plan.schedule.microbatches) or \
            "head_dim" not in plan.model.options and plan.model.hidden % plan.model.heads:
        raise ValueError("plan.model does not divide as the plan needs")
