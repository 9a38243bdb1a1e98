"""Reading a build directory's files as untrusted input, without the graph: the part of
:mod:`planc.build.directory` that the ranks share (docs/build.md).

The compiler's commands read a build with :func:`planc.build.directory.read` and
:func:`planc.build.directory.read_programs`, which also parse graph.json and check every program
against it and the tables against the plan; a rank (planc.runtime.worker) reads only what
it runs: the manifest, plan.json (for the run's name, steps and checkpoint manifests)
and programs/ (:func:`read_for_run`). No networkx here. ``planc run`` verifies the whole
build before it starts the ranks.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from planc.host.files import read_regular_file
from planc.host.json_values import malformed_text, too_long_integer
from planc.program.groups import GroupTable
from planc.program.model_table import ModelTable
from planc.program.program import Program, RankTable
from planc.program.routes import RouteTable
from planc.plan.mesh import AXES, is_axis_order
from planc.checkpoint.training_record import TrainingRecord
from planc.vocabulary.versions import is_version

BUILD_FORMAT_VERSION = 4  # 3: programs/model.json, the model table; 4: build.json's mfu
MANIFEST = "build.json"
PROGRAMS = "programs"
RANK_TABLE = "ranks.json"
GROUPS = "groups.json"
ROUTES = "routes.json"
MODEL_TABLE = "model.json"


class BuildError(Exception):
    """A build directory that cannot be written or read; the message says why."""


def fingerprint(plan_data: dict) -> str:
    """Hash of the plan's content, independent of JSON formatting: the manifest keeps it so
    that a plan.json edited after compile cannot pair with a graph derived from another."""
    canonical = json.dumps(plan_data, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


MAX_JSON_BYTES = 256 << 20  # the largest plan within the limits builds tens of MB
# What reading a well-formed JSON document of the wrong shape raises (OverflowError: a
# number such as 1e400, which JSON allows and Python reads as infinity, used as a count).
MALFORMED = (KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError)


def read_json(directory: Path, name: str) -> dict:
    """One JSON file of a build, read as untrusted input: a regular file (a named pipe or a
    link to /dev/zero is refused, not read forever), of bounded size, whose numbers and
    nesting Python can hold."""
    return parse_json(directory / name, read_json_bytes(directory, name))


def read_json_bytes(directory: Path, name: str) -> bytes:
    """The bytes of one JSON file of a build, unparsed (:func:`read_json`'s first half):
    a regular file, not a link, of at most MAX_JSON_BYTES."""
    path = directory / name
    try:
        raw = read_regular_file(path, MAX_JSON_BYTES + 1, follow=False)
    except FileNotFoundError:
        raise BuildError(f"{directory} is incomplete: {name} is missing; run planc compile "
                         f"again") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP and os.path.islink(path):
            raise BuildError(linked(path)) from None
        raise BuildError(f"cannot read {path}: {exc.strerror or exc}") from None
    if len(raw) > MAX_JSON_BYTES:
        raise BuildError(f"{path} is larger than {MAX_JSON_BYTES >> 20} MiB; run planc "
                         f"compile again")
    return raw


def parse_json(path: Path, raw: bytes) -> dict:
    """``raw``, the bytes of the build's file ``path``, as the JSON object it must hold
    (:func:`read_json`'s second half)."""
    try:
        data = json.loads(raw.decode("utf-8"))
    except json.JSONDecodeError as exc:
        raise BuildError(f"{path} is not valid JSON (line {exc.lineno}, column {exc.colno}); "
                         f"run planc compile again") from None
    except UnicodeDecodeError:
        raise BuildError(f"{path} is not UTF-8 text; run planc compile again") from None
    except ValueError:  # an integer of thousands of digits
        raise BuildError(f"{path} holds {too_long_integer()}, which no planc build file "
                         f"holds; run planc compile again") from None
    except RecursionError:
        raise BuildError(f"{path} nests its values too deep to be a planc build file; run "
                         f"planc compile again") from None
    if not isinstance(data, dict):
        raise BuildError(f"{path} does not hold a JSON object; run planc compile again")
    return data


def linked(path: Path) -> str:
    """A symbolic link inside a build: refused, not followed, wherever it points (a build
    is untrusted input, and its files are planc's, never another directory's)."""
    return f"{path} is a symbolic link, and a build holds none; run planc compile again"


def read_manifest_and_plan_data(path: Path) -> tuple[dict, dict]:
    """build.json (a planc build of this format) and plan.json, the plan it was compiled
    from, as JSON (the compiler reads it back into a planc.plan.plan.Plan; a rank needs only
    :class:`PlanShape` and planc.checkpoint.format.TrainingRecord of it)."""
    try:
        if not path.is_dir():
            raise BuildError(f"{path} is not a directory")
        os.listdir(path)  # a directory that cannot be read fails here, with its reason
        has_manifest = os.path.lexists(path / MANIFEST)
    except OSError as exc:
        raise BuildError(f"cannot read {path}: {exc.strerror or exc}") from None
    if not has_manifest:
        raise BuildError(f"{path} is not a planc build directory (no {MANIFEST}); make one "
                         f"with planc compile FILE -o {path}")
    manifest = read_json(path, MANIFEST)
    if manifest.get("format") != "planc-build":
        raise BuildError(f"{path / MANIFEST} is not a planc build manifest (format "
                         f"{manifest.get('format')!r}); run planc compile again")
    if not is_version(manifest.get("version"), BUILD_FORMAT_VERSION):
        raise BuildError(f"{path / MANIFEST} says build format {manifest.get('version')!r}; "
                         f"this planc reads version {BUILD_FORMAT_VERSION}: compile again")
    plan_data = read_json(path, "plan.json")
    if manifest.get("plan_sha256") != fingerprint(plan_data):
        raise BuildError(f"{path / 'plan.json'} is not the plan this build was compiled from "
                         f"(edited since?); change the .plan file and run planc compile again")
    return manifest, plan_data


def invalid_plan(path: Path, exc: BaseException) -> BuildError:
    return BuildError(f"{path / 'plan.json'} is not a valid plan ({malformed_text(exc)}); run "
                      f"planc compile again")


@dataclass(frozen=True)
class PlanShape:
    """What programs/ must agree with in plan.json: the mesh and the microbatches."""

    sizes: dict[str, int]
    order: tuple[str, ...]
    microbatches: int

    @property
    def world(self) -> int:
        out = 1
        for size in self.sizes.values():
            out *= size
        return out

    @staticmethod
    def of(plan_data: dict, path: Path) -> "PlanShape":
        try:
            mesh = plan_data["mesh"]
            sizes = {axis: mesh[axis] for axis in AXES}
            order = tuple(mesh["order"])
            microbatches = plan_data["schedule"]["microbatches"]
        except MALFORMED as exc:
            raise invalid_plan(path, exc) from None
        if not all(type(v) is int and v >= 1 for v in (*sizes.values(), microbatches)) or \
                not all(isinstance(a, str) for a in order) or not is_axis_order(order):
            raise invalid_plan(path, "its mesh or microbatches are not positive integers "
                                     "over the mesh's axes")
        return PlanShape(sizes, order, microbatches)


def _table(directory: Path, name: str, parse, what: str):
    """``parse`` of the JSON file ``name`` of programs/; a malformed one is a BuildError
    that says it is not a valid ``what``."""
    try:
        return parse(read_json(directory, name))
    except MALFORMED as exc:
        raise BuildError(f"{directory / name} is not a valid {what} ({malformed_text(exc)}); "
                         f"run planc compile again") from None


def read_program_files(path: Path, plan: PlanShape, rank: int | None = None) -> tuple[
        RankTable, GroupTable, RouteTable, ModelTable, dict[str, Program]]:
    """The tables and programs of programs/, each well-formed and consistent with the
    others and with the plan's mesh and microbatches; with ``rank`` (a rank of the
    plan's world), of the programs only the one that rank runs."""
    directory = path / PROGRAMS
    if directory.is_symlink():
        raise BuildError(linked(directory))
    if not directory.is_dir():
        raise BuildError(f"{path} has no {PROGRAMS}/ directory; run planc compile again")
    try:
        os.listdir(directory)  # a directory that cannot be read fails here, with its reason
    except OSError as exc:
        raise BuildError(f"cannot read {directory}: {exc.strerror or exc}") from None
    table = _table(directory, RANK_TABLE, RankTable.from_json, "rank table")
    if (table.world, table.pp) != (plan.world, plan.sizes["pp"]):
        raise BuildError(f"{directory / RANK_TABLE} is for {table.world} ranks and {table.pp} "
                         f"stages, plan.json for {plan.world} and {plan.sizes['pp']}; "
                         f"run planc compile again")
    groups = _table(directory, GROUPS, GroupTable.from_json, "group table")
    if (groups.ranks.sizes, groups.ranks.order) != (plan.sizes, plan.order):
        raise BuildError(f"{directory / GROUPS} is for another mesh than plan.json; run "
                         f"planc compile again")
    routes = _table(directory, ROUTES, RouteTable.from_json, "route table")
    model = _table(directory, MODEL_TABLE, ModelTable.from_json, "model table")
    for name in table.names:
        if "/" in name or name.startswith(".") or name == MODEL_TABLE:
            raise BuildError(f"{directory / RANK_TABLE} names {name!r}, not a program file")
    wanted = table.names if rank is None else [table.program_of(rank)]
    programs = {}
    for name in wanted:
        programs[name] = _table(directory, name, Program.from_json, "program")
        if programs[name].microbatches != plan.microbatches:
            raise BuildError(f"{directory / name} is for another number of microbatches than "
                             f"plan.json; run planc compile again")
    for runs, name in [(None, name) for name in table.stages] + list(table.overrides.items()):
        if name not in programs:
            continue
        stage = table.stages[name] if runs is None else table.stage_of(runs)
        if programs[name].stage != stage:
            raise BuildError(f"{directory / name} is the program of stage "
                             f"{programs[name].stage}, but {directory / RANK_TABLE} runs it "
                             f"on stage {stage}; run planc compile again")
    for name, program in programs.items():
        missing = next((block for block, _ in program.schedule
                        if block not in program.blocks), None)
        if missing is not None:
            raise BuildError(f"{directory / name} schedules block {missing!r}, which it does "
                             f"not define; run planc compile again")
    return table, groups, routes, model, programs


@dataclass(frozen=True)
class RunBuild:
    """What a rank reads of a build: programs/, build.json's fingerprint, and of plan.json
    what a checkpoint records (``record``); ``plan_data``, plan.json itself, goes only to
    the single-process reference of --check."""

    path: str
    record: TrainingRecord
    plan_data: dict
    plan_sha256: str
    programs: dict[str, Program]
    table: RankTable
    groups: GroupTable
    routes: RouteTable
    model: ModelTable
    mfu: "StepFlops"


MAX_FLOPS = 1e30


@dataclass(frozen=True)
class StepFlops:
    """build.json's ``mfu``: what planc run divides to report TFLOP/s and MFU, written by
    the compiler (planc.models.step_model_flops, recomputation not counted, and the
    topology's peak per device, None where the plan names no machine) so that a rank
    only divides."""

    model_flops_per_step: float
    peak_flops_per_device: float | None

    @staticmethod
    def of(manifest: dict, path: Path) -> "StepFlops":
        section = manifest.get("mfu")
        flops, peak = [section.get(key) if isinstance(section, dict) else None
                       for key in ("model_flops_per_step", "peak_flops_per_device")]
        # bounded so that a rank's TFLOP/s and MFU stay finite numbers (a metrics file
        # holds no Infinity): no step of a model has 1e30 FLOPs, no device under 1 FLOP/s
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and
                   1 <= v <= MAX_FLOPS for v in ([flops] if peak is None else [flops, peak])):
            raise BuildError(f"{path / MANIFEST} has no valid mfu section (the model FLOPs "
                             f"of a step and the peak FLOP/s of a device, numbers from 1 to "
                             f"{MAX_FLOPS:g}); "
                             f"run planc compile again")
        return StepFlops(float(flops), None if peak is None else float(peak))


def read_for_run(directory: str | Path) -> RunBuild:
    """The build as a rank reads it (graph.json and summary.json are not read)."""
    path = Path(directory)
    manifest, plan_data = read_manifest_and_plan_data(path)
    try:
        record = TrainingRecord.of(plan_data)
    except MALFORMED as exc:
        raise invalid_plan(path, exc) from None
    table, groups, routes, model, programs = read_program_files(
        path, PlanShape.of(plan_data, path))
    if model.cp != table.axes["cp"][0]:
        raise BuildError(f"{path / PROGRAMS / MODEL_TABLE} is for cp = {model.cp}, "
                         f"{path / PROGRAMS / RANK_TABLE} for {table.axes['cp'][0]}; run "
                         f"planc compile again")
    for name, program in programs.items():  # every parameter a rank holds has a rule
        try:
            member = next((m["param"] for bucket in program.buckets.values()
                           for m in bucket["members"]
                           if m["param"] not in model.parameters or
                           list(model.parameters[m["param"]].shape) != m["full_shape"]), None)
        except MALFORMED as exc:
            raise BuildError(f"{path / PROGRAMS / name} has malformed buckets "
                             f"({malformed_text(exc)}); run planc compile again") from None
        if member is not None:
            raise BuildError(f"{path / PROGRAMS / name} holds parameter {member!r}, which "
                             f"{MODEL_TABLE} does not list with that shape; run planc "
                             f"compile again")
    return RunBuild(str(path), record, plan_data, manifest["plan_sha256"], programs, table,
                    groups, routes, model, StepFlops.of(manifest, path))
