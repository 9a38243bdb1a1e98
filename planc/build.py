"""The build directory: what ``planc compile`` writes and later commands read.

Layout (format version 3, documented in docs/build.md):

    build.json     manifest: format, version, planc version, source file and its sha256
    plan.json      the validated plan (Plan.to_dict)
    graph.json     the communication graph, networkx node-link format
    summary.json   per stage and step: transfers by axis, kind and phase; FLOPs; memory
    programs/      one rank program per pipeline stage, ranks.json (the rank table),
                   groups.json (the process groups the programs use) and routes.json
                   (the recipes of tree and hierarchical routes) and model.json (the
                   model table: what the runtime needs of the model, as data)
    logs/          written by planc run; carried into the new build when one is replaced

A build is written into a temporary sibling directory and renamed into place, so a
reader never sees half a build, and a failed compile leaves the old build untouched.
A build is read as untrusted input: no file or directory inside it may be a symbolic
link (the build directory itself may be one).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import networkx as nx

from planc import __version__
from planc.collector import without_collector
from planc.files import read_regular_file, umask
from planc.graph import ir
from planc.lower.groups import GroupTable, group_table
from planc.lower.model_table import ModelTable
from planc.lower.routes import RouteTable, split_refs
from planc.lower.program import Program, RankTable, dumps
from planc.lower.tabulate_model import model_table
from planc.plan import Plan

BUILD_FORMAT_VERSION = 3  # 3: programs/model.json, the model table
MANIFEST = "build.json"
FILES = ("plan.json", "graph.json", "summary.json")
PROGRAMS = "programs"
RANK_TABLE = "ranks.json"
GROUPS = "groups.json"
ROUTES = "routes.json"
MODEL_TABLE = "model.json"
LOGS = "logs"


class BuildError(Exception):
    """A build directory that cannot be written or read; the message says why."""


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
    target = Path(directory)
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
    if target.exists() and target.resolve() == Path.cwd().resolve():
        raise BuildError("planc replaces the whole build directory, so it cannot be the current "
                         "directory; name a subdirectory, such as -o build/NAME")
    if target.is_dir() and any(target.iterdir()) and not (target / MANIFEST).is_file():
        raise BuildError(f"{target} exists and is not a planc build directory (no {MANIFEST}); "
                         f"refusing to overwrite it")
    manifest = {"format": "planc-build", "version": BUILD_FORMAT_VERSION,
                "planc": __version__, "source": os.path.abspath(source_path),
                "source_sha256": hashlib.sha256(source_text.encode()).hexdigest(),
                "plan": build.plan.name, "plan_sha256": plan_fingerprint(build.plan),
                "files": list(FILES) + [PROGRAMS]}
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
    except OSError as exc:
        shutil.rmtree(staging, ignore_errors=True)
        raise BuildError(f"cannot write {target}: {exc.strerror}") from None
    return target


def _replace(staging: Path, target: Path) -> None:
    """Move the finished build into place, swapping out an older one. The older build's
    logs/ are run outputs, not compiler outputs: they move into the new build."""
    if not target.exists():
        os.rename(staging, target)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
    os.rmdir(old)
    os.rename(target, old)
    logs = old / LOGS
    carried = logs.is_dir() and not logs.is_symlink()
    try:
        if carried:
            os.rename(logs, staging / LOGS)
        os.rename(staging, target)
    except OSError:
        if carried and (staging / LOGS).is_dir():
            os.rename(staging / LOGS, logs)
        os.rename(old, target)  # put the old build back
        raise
    shutil.rmtree(old, ignore_errors=True)


@dataclass(frozen=True)
class Earlier:
    """The build a compile into a directory would replace. ``kind``: "same" (this plan,
    compiled by this planc), "earlier" (another version of the same plan file, or the
    same text), "other" (another plan file, with other text) or "damaged" (its build.json
    cannot be read); ``source`` the plan file it names; ``logs`` whether it has logs/."""

    kind: str
    source: str | None
    logs: bool


def earlier_build(directory: str | Path, plan: Plan, source_path: str,
                  source_text: str) -> Earlier | None:
    """What ``directory`` holds, if it holds a planc build (None otherwise: nothing, an
    empty directory, or something :func:`write` refuses anyway)."""
    target = Path(directory)
    try:
        if not target.is_dir() or not os.path.lexists(target / MANIFEST):
            return None
        logs = (target / LOGS).is_dir() and not (target / LOGS).is_symlink()
    except OSError:
        return None
    try:
        manifest = _read_json(target, MANIFEST)
    except BuildError:
        return Earlier("damaged", None, logs)
    source = manifest.get("source")
    if manifest.get("format") != "planc-build" or not isinstance(source, str):
        return Earlier("damaged", None, logs)
    if (manifest.get("version"), manifest.get("planc"), manifest.get("plan_sha256")) == (
            BUILD_FORMAT_VERSION, __version__, _fingerprint(plan.to_dict())):
        return Earlier("same", source, logs)
    if source != os.path.abspath(source_path) and manifest.get("source_sha256") != \
            hashlib.sha256(source_text.encode()).hexdigest():
        return Earlier("other", source, logs)
    return Earlier("earlier", source, logs)


def plan_fingerprint(plan: Plan) -> str:
    """The build's fingerprint (``plan_sha256`` of build.json): what a run's metrics carry
    so that ``planc report`` can tell the metrics of another build."""
    return _fingerprint(plan.to_dict())


def _fingerprint(plan_data: dict) -> str:
    """Hash of the plan's content, independent of JSON formatting: the manifest keeps it so
    that a plan.json edited after compile cannot pair with a graph derived from another."""
    canonical = json.dumps(plan_data, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


MAX_JSON_BYTES = 256 << 20  # the largest plan within the limits builds tens of MB
# What reading a well-formed JSON document of the wrong shape raises (OverflowError: a
# number such as 1e400, which JSON allows and Python reads as infinity, used as a count).
MALFORMED = (KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError)


def _read_json(directory: Path, name: str) -> dict:
    """One JSON file of a build, read as untrusted input: a regular file (a named pipe or a
    link to /dev/zero is refused, not read forever), of bounded size, whose numbers and
    nesting Python can hold."""
    path = directory / name
    try:
        raw = read_regular_file(path, MAX_JSON_BYTES + 1, follow=False)
    except FileNotFoundError:
        raise BuildError(f"{directory} is incomplete: {name} is missing; run planc compile "
                         f"again") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP and os.path.islink(path):
            raise BuildError(_linked(path)) from None
        raise BuildError(f"cannot read {path}: {exc.strerror or exc}") from None
    if len(raw) > MAX_JSON_BYTES:
        raise BuildError(f"{path} is larger than {MAX_JSON_BYTES >> 20} MiB; run planc "
                         f"compile again")
    try:
        data = json.loads(raw.decode("utf-8"))
    except json.JSONDecodeError as exc:
        raise BuildError(f"{path} is not valid JSON (line {exc.lineno}, column {exc.colno}); "
                         f"run planc compile again") from None
    except UnicodeDecodeError:
        raise BuildError(f"{path} is not UTF-8 text; run planc compile again") from None
    except ValueError as exc:  # an integer of thousands of digits
        raise BuildError(f"{path} holds a value Python cannot read ({exc}); run planc "
                         f"compile again") from None
    except RecursionError:
        raise BuildError(f"{path} nests its values too deep to be a planc build file; run "
                         f"planc compile again") from None
    if not isinstance(data, dict):
        raise BuildError(f"{path} does not hold a JSON object; run planc compile again")
    return data


def _linked(path: Path) -> str:
    """A symbolic link inside a build: refused, not followed, wherever it points (a build
    is untrusted input, and its files are planc's, never another directory's)."""
    return f"{path} is a symbolic link, and a build holds none; run planc compile again"


@without_collector
def read(directory: str | Path) -> Build:
    """Load a build directory, checking its manifest and every file's format."""
    path = Path(directory)
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
    manifest = _read_json(path, MANIFEST)
    if manifest.get("format") != "planc-build":
        raise BuildError(f"{path / MANIFEST} is not a planc build manifest (format "
                         f"{manifest.get('format')!r}); run planc compile again")
    if manifest.get("version") != BUILD_FORMAT_VERSION:
        raise BuildError(f"{path / MANIFEST} says build format {manifest.get('version')!r}; "
                         f"this planc reads version {BUILD_FORMAT_VERSION}: compile again")
    plan_data = _read_json(path, "plan.json")
    if manifest.get("plan_sha256") != _fingerprint(plan_data):
        raise BuildError(f"{path / 'plan.json'} is not the plan this build was compiled from "
                         f"(edited since?); change the .plan file and run planc compile again")
    try:
        plan = Plan.from_dict(plan_data)
    except MALFORMED as exc:
        raise BuildError(f"{path / 'plan.json'} is not a valid plan ({exc}); run planc "
                         f"compile again") from None
    graph_data = _read_json(path, "graph.json")
    attributes = graph_data.get("graph")
    if not isinstance(attributes, dict) or \
            attributes.get("version") != ir.GRAPH_FORMAT_VERSION:
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
        raise BuildError(f"{path / 'graph.json'} is not a valid graph ({exc}); run planc "
                         f"compile again") from None
    _check_graph(path / "graph.json", graph, plan)
    summary = _read_json(path, "summary.json")
    if not isinstance(summary.get("stages"), list):
        raise BuildError(f"{path / 'summary.json'} has no stages; run planc compile again")
    return Build(plan, graph, summary, str(path))


def _check_graph(path: Path, graph: nx.DiGraph, plan: Plan) -> None:
    """The graph belongs to the plan and follows the schema of planc.graph.ir."""
    attributes = graph.graph
    if attributes.get("sizes") != plan.mesh.sizes or \
            attributes.get("microbatches") != plan.schedule.microbatches or \
            not isinstance(attributes.get("schedule"), dict) or \
            not isinstance(attributes.get("layouts"), dict) or \
            not isinstance(attributes.get("buckets"), dict) or \
            not isinstance(attributes.get("passes"), list):
        raise BuildError(f"{path} does not match plan.json (mesh, microbatches, schedule or "
                         f"buckets); run planc compile again")
    problems = ir.validate(ir.coerce(graph), microbatches=plan.schedule.microbatches,
                           stages=plan.mesh.pp, layers=plan.model.layers,
                           chunks=len(plan.shard.pp.chunks), limit=1)
    if problems:
        raise BuildError(f"{path}: {problems[0]}; run planc compile again")


@without_collector
def read_programs(build: Build) -> Build:
    """The build with its rank programs and rank table, read from programs/."""
    directory = Path(build.path) / PROGRAMS
    if directory.is_symlink():
        raise BuildError(_linked(directory))
    if not directory.is_dir():
        raise BuildError(f"{build.path} has no {PROGRAMS}/ directory; run planc compile again")
    try:
        os.listdir(directory)  # a directory that cannot be read fails here, with its reason
    except OSError as exc:
        raise BuildError(f"cannot read {directory}: {exc.strerror or exc}") from None
    try:
        table = RankTable.from_json(_read_json(directory, RANK_TABLE))
    except MALFORMED as exc:
        raise BuildError(f"{directory / RANK_TABLE} is not a valid rank table ({exc}); run "
                         f"planc compile again") from None
    if (table.world, table.pp) != (build.plan.world, build.plan.mesh.pp):
        raise BuildError(f"{directory / RANK_TABLE} is for {table.world} ranks and {table.pp} "
                         f"stages, plan.json for {build.plan.world} and {build.plan.mesh.pp}; "
                         f"run planc compile again")
    try:
        groups = GroupTable.from_json(_read_json(directory, GROUPS))
    except MALFORMED as exc:
        raise BuildError(f"{directory / GROUPS} is not a valid group table ({exc}); run "
                         f"planc compile again") from None
    if groups.mesh != build.plan.mesh:
        raise BuildError(f"{directory / GROUPS} is for another mesh than plan.json; run "
                         f"planc compile again")
    plan = build.plan
    if groups != group_table(plan.mesh, plan.topology.devices_per_node,
                             plan.model.tie_embeddings, plan.shard.pp.virtual,
                             split_refs(build.graph)):
        raise BuildError(f"{directory / GROUPS} is not the group table of plan.json and "
                         f"graph.json; run planc compile again")
    try:
        routes = RouteTable.from_json(_read_json(directory, ROUTES))
    except MALFORMED as exc:
        raise BuildError(f"{directory / ROUTES} is not a valid route table ({exc}); run "
                         f"planc compile again") from None
    try:
        model = ModelTable.from_json(_read_json(directory, MODEL_TABLE))
    except MALFORMED as exc:
        raise BuildError(f"{directory / MODEL_TABLE} is not a valid model table ({exc}); "
                         f"run planc compile again") from None
    if model != model_table(plan):
        raise BuildError(f"{directory / MODEL_TABLE} is not the model table of plan.json; "
                         f"run planc compile again")
    programs = {}
    for name in table.names:
        if "/" in name or name.startswith(".") or name == MODEL_TABLE:
            raise BuildError(f"{directory / RANK_TABLE} names {name!r}, not a program file")
        try:
            programs[name] = Program.from_json(_read_json(directory, name))
        except MALFORMED as exc:
            raise BuildError(f"{directory / name} is not a valid program ({exc}); run planc "
                             f"compile again") from None
        if programs[name].microbatches != build.plan.schedule.microbatches:
            raise BuildError(f"{directory / name} is for another number of microbatches than "
                             f"plan.json; run planc compile again")
    for rank, name in [(None, name) for name in table.stages] + list(table.overrides.items()):
        stage = table.stages[name] if rank is None else table.stage_of(rank)
        if programs[name].stage != stage:
            raise BuildError(f"{directory / name} is the program of stage "
                             f"{programs[name].stage}, but {directory / RANK_TABLE} runs it "
                             f"on stage {stage}; run planc compile again")
    graph_buckets = ir.buckets(build.graph)
    for name, program in programs.items():
        missing = next((block for block, _ in program.schedule
                        if block not in program.blocks), None)
        if missing is not None:
            raise BuildError(f"{directory / name} schedules block {missing!r}, which it does "
                             f"not define; run planc compile again")
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
