"""The build directory: what ``planc compile`` writes and later commands read.

Layout (format version 4, documented in docs/build.md):

    build.json     manifest: format, version, planc version, source file and its sha256,
                   the model FLOPs of a step and the device's peak (planc run's MFU)
    plan.json      the validated plan (Plan.to_dict)
    graph.json     the communication graph, networkx node-link format
    summary.json   per stage and step: transfers by axis, kind and phase; FLOPs; memory
    programs/      one rank program per pipeline stage, ranks.json (the rank table),
                   groups.json (the process groups the programs use) and routes.json
                   (the recipes of tree and hierarchical routes) and model.json (the
                   model table: what the runtime needs of the model, as data)
    logs/          written by planc run

Everything else a build directory holds is its user's or a later command's (a run's
metrics, TensorBoard logs, a graph, a report, notes): replacing the build carries it,
logs/ included, into the new one untouched; only the entries above are compile's.

A build is written into a temporary sibling directory and renamed into place, so a
reader never sees half a build, and a failed compile leaves the old build untouched.
A build is read as untrusted input: no file or directory inside it may be a symbolic
link (the build directory itself may be one).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import networkx as nx

from planc import __version__
from planc.build.files import (BUILD_FORMAT_VERSION, GROUPS, MALFORMED,  # noqa: F401 (API)
                               MANIFEST, MAX_JSON_BYTES, MODEL_TABLE, PROGRAMS, RANK_TABLE,
                               ROUTES, BuildError, PlanShape, invalid_plan,
                               read_manifest_and_plan_data, read_program_files)
from planc.build.files import fingerprint as _fingerprint
from planc.build.files import parse_json, read_json_bytes
from planc.build.files import read_json as _read_json
from planc.host.collector import without_collector
from planc.host.files import open_regular_file, umask
from planc.host.json_values import malformed_text
from planc.estimate.plan_rates import mfu_peak
from planc.graph import ir
from planc.program.groups import GroupTable
from planc.lower.tables import plan_group_table, split_refs
from planc.program.model_table import ModelTable
from planc.program.routes import RouteTable
from planc.program.program import Program, RankTable, dumps
from planc.lower.tabulate_model import model_table
from planc.models import step_model_flops
from planc.plan.plan import Plan
from planc.lang.schema import schema_problem
from planc.plan.plan_json import plan_from_dict
from planc.vocabulary.versions import is_version

FILES = ("plan.json", "graph.json", "summary.json")
LOGS = "logs"

@dataclass(frozen=True)
class Build:
    plan: Plan
    graph: nx.DiGraph
    summary: dict
    path: str | None = None  # the directory it was read from, if any
    programs: dict[str, Program] | None = None
    table: RankTable | None = None
    groups: GroupTable | None = None
    routes: RouteTable | None = None
    model: ModelTable | None = None


def graph_to_json(graph: nx.DiGraph) -> dict:
    return nx.node_link_data(graph, edges="edges")


def graph_from_json(data: dict) -> nx.DiGraph:
    return nx.node_link_graph(data, directed=True, multigraph=False, edges="edges")


def _dump(data: dict, compact: bool = False) -> str:
    if compact:  # the graph: tens of megabytes for big plans, read by programs
        return json.dumps(data, separators=(",", ":")) + "\n"
    return json.dumps(data, indent=1, sort_keys=False) + "\n"


NAME_MAX = 255  # bytes in one file name (Linux, macOS)
STAGING_SUFFIX = 16  # ".NAME.tmp-XXXXXXXX": the staging directory's extra bytes


@without_collector
def write(build: Build, directory: str | Path, source_path: str, source_text: str) -> Path:
    """Write ``build`` to ``directory`` atomically; replaces an earlier planc build there."""
    # a symbolic link is followed: its target is written and the link kept (README,
    # "Outputs"); renaming over the link itself replaced it with a directory
    target = Path(os.path.realpath(directory) if os.path.islink(directory) else directory)
    name_bytes = len(os.fsencode(target.name))
    if name_bytes > NAME_MAX - STAGING_SUFFIX:
        raise BuildError(f"the name {target.name[:40]}... is {name_bytes} bytes; a file name "
                         f"holds at most {NAME_MAX}, and planc needs {STAGING_SUFFIX} more "
                         f"for the temporary directory it writes first")
    try:
        target.exists()
    except OSError as exc:
        raise BuildError(f"cannot create {target}: {exc.strerror}") from None
    if target.exists() and not target.is_dir():
        raise BuildError(f"{target} exists and is not a directory")
    if target.exists() and Path.cwd().resolve().is_relative_to(target.resolve()):
        raise BuildError("planc replaces the whole build directory, so it cannot be the current "
                         "directory or hold it; name a subdirectory, such as -o build/NAME")
    if target.is_dir() and any(target.iterdir()) and not (target / MANIFEST).is_file():
        raise BuildError(f"{target} exists and is not a planc build directory (no {MANIFEST}); "
                         f"refusing to overwrite it")
    earlier = earlier_build(target, build.plan, source_path, source_text)
    if earlier is not None and earlier.kind == "foreign":
        raise BuildError(f"{target} holds files planc did not write where a build's own go "
                         f"({MANIFEST}, {', '.join(FILES)}, {PROGRAMS}/); refusing to "
                         f"overwrite them")
    manifest = {"format": "planc-build", "version": BUILD_FORMAT_VERSION,
                "planc": __version__, "source": os.path.abspath(source_path),
                "source_sha256": hashlib.sha256(source_text.encode()).hexdigest(),
                "plan": build.plan.name, "plan_sha256": plan_fingerprint(build.plan),
                "files": list(FILES) + [PROGRAMS],
                "mfu": {"model_flops_per_step": step_model_flops(build.plan),
                        # none where the plan names no machine: no MFU against a guess
                        "peak_flops_per_device": mfu_peak(build.plan)
                        if build.plan.topology.device.peak_known else None}}
    graph_data = graph_to_json(build.graph)
    graph_data["graph"] = {**graph_data["graph"], "plan_sha256": manifest["plan_sha256"]}
    contents = {MANIFEST: manifest, "plan.json": build.plan.to_dict(),
                "graph.json": graph_data, "summary.json": build.summary}
    programs = {name: program.to_json() for name, program in (build.programs or {}).items()}
    if build.table is not None:
        programs[RANK_TABLE] = build.table.to_json()
    if build.groups is not None:
        programs[GROUPS] = build.groups.to_json()
    if build.routes is not None:
        programs[ROUTES] = build.routes.to_json()
    if build.model is not None:
        programs[MODEL_TABLE] = build.model.to_json()
    try:
        parent = target.resolve().parent
        parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=parent))
        os.chmod(staging, 0o777 & ~umask())  # mkdtemp's 0700 is not what users expect
    except RuntimeError:  # how pathlib reports a loop of symbolic links
        raise BuildError(f"cannot create {target}: its path has a loop of symbolic "
                         f"links") from None
    except OSError as exc:
        raise BuildError(f"cannot create {target}: {exc.strerror}") from None
    try:
        for name, data in contents.items():
            (staging / name).write_text(_dump(data, name == "graph.json"), encoding="utf-8")
        if programs:
            (staging / PROGRAMS).mkdir()
            (staging / PROGRAMS).chmod(staging.stat().st_mode & 0o777)
            for name, data in programs.items():
                (staging / PROGRAMS / name).write_text(dumps(data), encoding="utf-8")
        _replace(staging, target)
    except BaseException as exc:  # a full disk, or a Ctrl-C: no half-written build is left
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(exc, OSError):
            raise BuildError(f"cannot write {target}: {exc.strerror}") from None
        raise
    return target


# What compile writes into a build directory; every other entry is carried over.
COMPILED = frozenset({MANIFEST, *FILES, PROGRAMS})


def _replace(staging: Path, target: Path) -> None:
    """Move the finished build into place, swapping out an older one. What the older
    build holds besides compile's own files (logs/, a run's metrics, a user's notes) is
    not compile's to drop: it moves into the new build."""
    if not target.exists():
        os.rename(staging, target)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
    os.rmdir(old)
    os.rename(target, old)
    carried: list[str] = []
    moved = False
    try:
        for name in sorted(os.listdir(old)):
            if name not in COMPILED:
                os.rename(old / name, staging / name)
                carried.append(name)
        os.rename(staging, target)
        moved = True
    except BaseException:  # an error or a signal between the renames
        if not moved:
            for name in carried:  # put the old build back as it was
                os.rename(staging / name, old / name)
            os.rename(old, target)
        raise
    shutil.rmtree(old, ignore_errors=True)


@dataclass(frozen=True)
class Earlier:
    """The build a compile into a directory would replace. ``kind``: "same" (this plan,
    compiled by this planc), "earlier" (another version of the same plan file, or the
    same text), "other" (another plan file, with other text), "damaged" (its build.json
    cannot be read, and the rest is what compile writes) or "foreign" (a build.json that
    is not planc's, or files of someone else's where compile writes); ``source`` the plan
    file it names; ``kept`` the entries that are not compile's (logs/, a run's metrics, a
    user's files), which the new build keeps."""

    kind: str
    source: str | None
    kept: tuple[str, ...]


def earlier_build(directory: str | Path, plan: Plan, source_path: str,
                  source_text: str) -> Earlier | None:
    """What ``directory`` holds, if it holds a planc build (None otherwise: nothing, an
    empty directory, or something :func:`write` refuses anyway)."""
    target = Path(directory)
    try:
        if not target.is_dir() or not os.path.lexists(target / MANIFEST):
            return None
        kept = tuple(sorted(n for n in os.listdir(target) if n not in COMPILED))
    except OSError:
        return None
    try:
        manifest = _read_json(target, MANIFEST)
    except BuildError:
        return Earlier(_damaged_or_foreign(target), None, kept)
    source = manifest.get("source")
    if manifest.get("format") != "planc-build":
        # readable JSON that does not say it is planc's: a file of someone else's
        return Earlier("foreign", None, kept)
    if not isinstance(source, str):
        return Earlier(_damaged_or_foreign(target), None, kept)
    if (manifest.get("version"), manifest.get("planc"), manifest.get("plan_sha256")) == (
            BUILD_FORMAT_VERSION, __version__, _fingerprint(plan.to_dict())):
        return Earlier("same", source, kept)
    if source != os.path.abspath(source_path) and manifest.get("source_sha256") != \
            hashlib.sha256(source_text.encode()).hexdigest():
        return Earlier("other", source, kept)
    return Earlier("earlier", source, kept)


def _damaged_or_foreign(target: Path) -> str:
    """"damaged" where what a replacement would overwrite or delete looks like what
    compile writes (plan.json, graph.json and summary.json, where present, JSON objects
    or empty, as a power cut leaves a file; programs/ JSON files alone), else "foreign":
    a build.json that cannot be read proves nothing, and a file of the user's there would
    be lost."""
    programs = target / PROGRAMS
    try:
        for name in FILES:
            path = target / name
            if os.path.lexists(path):
                with open_regular_file(path, follow=False) as file:
                    head = file.read(64).lstrip()
                if head and not head.startswith(b"{"):
                    return "foreign"
        if os.path.lexists(programs):
            if programs.is_symlink() or not programs.is_dir():
                return "foreign"
            for entry in os.scandir(programs):
                if not entry.name.endswith(".json") or not entry.is_file(follow_symlinks=False):
                    return "foreign"
    except OSError:
        return "foreign"
    return "damaged"


def plan_fingerprint(plan: Plan) -> str:
    """The build's fingerprint (``plan_sha256`` of build.json): what a run's metrics carry
    so that ``planc report`` can tell the metrics of another build."""
    return _fingerprint(plan.to_dict())


@without_collector
def read(directory: str | Path) -> Build:
    """Load a build directory, checking its manifest and every file's format."""
    path = Path(directory)
    manifest, plan_data = read_manifest_and_plan_data(path)
    try:
        plan = plan_from_dict(plan_data)
    except MALFORMED as exc:
        raise invalid_plan(path, exc) from None
    problem = schema_problem(plan)  # as planc check reads each key's value
    if problem is not None:
        raise invalid_plan(path, ValueError(problem))
    raw_graph = read_json_bytes(path, "graph.json")
    graph_data = parse_json(path / "graph.json", raw_graph)
    attributes = graph_data.get("graph")
    if not isinstance(attributes, dict) or \
            not is_version(attributes.get("version"), ir.GRAPH_FORMAT_VERSION):
        raise BuildError(f"{path / 'graph.json'} is not a version {ir.GRAPH_FORMAT_VERSION} "
                         f"graph; run planc compile again")
    if attributes.get("plan_sha256") != manifest["plan_sha256"]:
        raise BuildError(f"{path / 'graph.json'} does not match plan.json (it was derived from "
                         f"another plan); run planc compile again")
    if graph_data.get("directed") is not True or graph_data.get("multigraph") is not False:
        raise BuildError(f"{path / 'graph.json'} is not a simple directed graph (directed "
                         f"true, multigraph false); run planc compile again")
    try:
        graph = graph_from_json(graph_data)
    except (*MALFORMED, nx.NetworkXError) as exc:
        raise BuildError(f"{path / 'graph.json'} is not a valid graph ({malformed_text(exc)}); "
                         f"run planc compile again") from None
    ir.coerce(graph)  # the schema's enums, as the graph compile derived holds them
    _check_graph_attributes(path / "graph.json", attributes, plan)
    derived = _derived_text(plan, manifest["plan_sha256"])
    # Byte for byte what compile writes for this plan: the schema holds by construction.
    # Otherwise the schema's first problem names the damage, or, if none, the difference.
    if raw_graph != derived.encode("utf-8"):
        _check_graph(path / "graph.json", graph, plan)
        if json.loads(derived) != graph_data:
            raise BuildError(f"{path / 'graph.json'} is not the graph this planc derives "
                             f"from plan.json (it was edited, or written by another "
                             f"version); run planc compile again")
    summary = _read_json(path, "summary.json")
    if not isinstance(summary.get("stages"), list):
        raise BuildError(f"{path / 'summary.json'} has no stages; run planc compile again")
    return Build(plan, graph, summary, str(path))


def _derived_text(plan: Plan, plan_sha256: str) -> str:
    """graph.json as compile writes it for ``plan``: derive, then the passes
    (deterministic). The programs are proven against the graph (planc.verify), so a
    graph.json edited along with them, its optimizer step gone from both, must not pass
    as the plan's."""
    from planc import passes
    from planc.graph.derive import derive

    derived = graph_to_json(passes.run(derive(plan), passes.PassContext.of(plan), None,
                                       owned=True))
    derived["graph"] = {**derived["graph"], "plan_sha256": plan_sha256}
    return _dump(derived, compact=True)


def _check_graph_attributes(path: Path, attributes: dict, plan: Plan) -> None:
    """The graph's own attributes belong to the plan (read before the graph is derived
    again, so that a graph of another plan is named as such)."""
    if attributes.get("sizes") != plan.mesh.sizes or \
            attributes.get("microbatches") != plan.schedule.microbatches or \
            not isinstance(attributes.get("schedule"), dict) or \
            not isinstance(attributes.get("layouts"), dict) or \
            not isinstance(attributes.get("buckets"), dict) or \
            not isinstance(attributes.get("passes"), list):
        raise BuildError(f"{path} does not match plan.json (mesh, microbatches, schedule or "
                         f"buckets); run planc compile again")


def _check_graph(path: Path, graph: nx.DiGraph, plan: Plan) -> None:
    """The graph (coerced) follows the schema of planc.graph.ir."""
    problems = ir.validate(graph, microbatches=plan.schedule.microbatches,
                           stages=plan.mesh.pp, layers=plan.model.layers,
                           chunks=len(plan.shard.pp.chunks), stage_of_chunk=plan.stage_of_chunk,
                           limit=1)
    if problems:
        raise BuildError(f"{path}: {problems[0]}; run planc compile again")


@without_collector
def read_programs(build: Build, rank: int | None = None) -> Build:
    """The build with its rank programs and rank table, read from programs/; with
    ``rank`` (a rank of the plan's world), of the programs only the one it runs (planc
    programs --rank on a build of a thousand stages reads one program, not all)."""
    directory = Path(build.path) / PROGRAMS
    plan = build.plan
    table, groups, routes, model, programs = read_program_files(
        Path(build.path), PlanShape.of(plan.to_dict(), Path(build.path)), rank)
    if groups != plan_group_table(plan, split_refs(build.graph)):
        raise BuildError(f"{directory / GROUPS} is not the group table of plan.json and "
                         f"graph.json; run planc compile again")
    if model != model_table(plan):
        raise BuildError(f"{directory / MODEL_TABLE} is not the model table of plan.json; "
                         f"run planc compile again")
    graph_buckets = ir.buckets(build.graph)
    for name, program in programs.items():
        other = next((b for b, bucket in program.buckets.items()
                      if graph_buckets.get(b) != bucket), None)
        if other is not None:
            raise BuildError(f"{directory / name} holds bucket {other!r}, which is not that "
                             f"bucket of graph.json; run planc compile again")
    unknown = [i.node for p in programs.values()
               for b in (*p.blocks.values(), p.prologue, p.epilogue)
               for i in b if i.node is not None and i.node not in build.graph]
    if unknown:
        raise BuildError(f"{directory} names node {unknown[0]!r}, which graph.json does not "
                         f"have; run planc compile again")
    return Build(build.plan, build.graph, build.summary, build.path, programs, table, groups,
                 routes, model)
