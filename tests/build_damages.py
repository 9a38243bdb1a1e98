"""The corpus of damaged builds of tests/test_damaged_builds.py (the build's documents)
and tests/test_damaged_programs.py (its programs/), and their runner.

A corpus of damaged builds (issue 12: "I tried 135 damaged builds"): one build of
plans/gpt-tiny.plan, compiled once, and several hundred copies of it, each with one
systematic damage to one of its files:

* every file (build.json, plan.json, graph.json, summary.json and each file of
  programs/): deleted, emptied, cut at several points, given bytes that are not UTF-8,
  holding JSON that is not an object, replaced by a directory, a named pipe, a symbolic
  link to /dev/zero or one to the valid file moved out of the build; programs/ itself
  deleted, emptied, a file, a link to /dev/zero, a link to itself (valid) moved out of
  the build;
* every top-level key of every JSON file: deleted, and given two values of the wrong type
  or range, in turn from: a string, a number, a list, null, an object, true, an integer
  of 41 digits, -1, the string "NaN", and the bare JSON literals NaN and Infinity that
  Python's reader accepts;
* deeper, each field deleted and given one to three such values: every field of plan.json's
  sections (plan.json re-signed, as an attacker would: its sha256 is a checksum); every
  attribute of graph.json's graph, of a bucket and one of its members, of the passes'
  report (a record, a route decision, a candidate), of one node of each type, of the
  first node with each optional attribute, and of one edge; every field of one
  instruction of each op in each part of a program, of its schedule, receives, bucket and
  bucket member, and of the rank, group and route tables;
* the damage that once reached a traceback or was accepted (:func:`regressions`).

Every damaged build goes through ``planc verify`` and ``planc programs --expand``, every
other one through one more read-only command (in turn ``programs --rank 7``, ``graph``,
``explain --buckets``, ``explain --routes``, ``simulate``), and the damage that once
reached a traceback or went through (``regressions``) through all of them; each run is a
child process forked from a driver that imported planc (tests/hostile_inputs.py's
runner), under a time limit. Each run must end with status 0, 1 or 2, without a
traceback, a time-out, a signal or a MemoryError, and a failure must say why with a
``planc: error:`` line.
"""


from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from planc.program.program import RankTable
from tests import hostile_inputs as hostile
from tests.conftest import PLANS, ROOT

TIME_LIMIT = 10.0  # CPU seconds per run; a run on this small build takes well under one
PROGRAMS = "programs"
# The files of a build of gpt-tiny (two pipeline stages), in the order they are read.
FILES = ("build.json", "plan.json", "graph.json", "summary.json", "programs/ranks.json",
         "programs/groups.json", "programs/routes.json", "programs/model.json",
         "programs/stage0.json", "programs/stage1.json")
NAN, INF = float("nan"), float("inf")
# Values of the wrong type (or range) for a field: name -> value.
WRONG = {"string": "x", "number": 7, "list": [], "null": None, "object": {}, "true": True,
         "huge": 10**40, "negative": -1, "nan-string": "NaN", "nan": NAN, "infinity": INF}
# For deeper fields, a rotating few of them.
ROTATION = ("string", "null", "huge", "negative", "nan", "list", "infinity", "object",
            "nan-string", "true", "number")
COMMANDS = (("verify", "{b}"), ("programs", "{b}", "--expand"))
THIRD = (("programs", "{b}", "--rank", "7"), ("graph", "{b}", "--format", "dot", "--all"),
         ("explain", "{b}", "--buckets"), ("explain", "{b}", "--routes"), ("simulate", "{b}"))


@dataclass(frozen=True)
class Damage:
    name: str  # FILE:what, such as graph.json:nodes[5].op=huge
    file: str  # the file (or directory) of the build it damages
    apply: Callable[[Path], None]
    every_command: bool = False  # a regression: through every command, not three


# --- editing a build ------------------------------------------------------------------------


def _dumps(data) -> str:
    return json.dumps(data, allow_nan=True)  # NaN and Infinity written as bare literals


def _resign(build: Path) -> None:
    """Make build.json and graph.json name plan.json's new sha256, as an attacker would."""
    from planc.build.directory import _fingerprint

    fingerprint = _fingerprint(json.loads((build / "plan.json").read_text()))
    manifest = json.loads((build / "build.json").read_text())
    manifest["plan_sha256"] = fingerprint
    (build / "build.json").write_text(_dumps(manifest))
    graph = json.loads((build / "graph.json").read_text())
    graph["graph"]["plan_sha256"] = fingerprint
    (build / "graph.json").write_text(_dumps(graph))


def _edit(file: str, path: tuple, value=None, delete: bool = False, resign: bool = False):
    def apply(build: Path) -> None:
        data = json.loads((build / file).read_text())
        holder = data
        for key in path[:-1]:
            holder = holder[key]
        if delete:
            del holder[path[-1]]
        else:
            holder[path[-1]] = value
        (build / file).write_text(_dumps(data))
        if resign:
            _resign(build)

    return apply


def _write_bytes(file: str, data: bytes):
    def apply(build: Path) -> None:
        (build / file).write_bytes(data)

    return apply


def _replace_with(file: str, what: str):
    def apply(build: Path) -> None:
        path = build / file
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif what != "file":
            path.unlink()
        if what == "directory":
            path.mkdir()
        elif what == "fifo":
            os.mkfifo(path)
        elif what == "dev-zero":
            path.symlink_to("/dev/zero")
        elif what == "file":
            path.write_text("{}\n")

    return apply


def _link_outside(file: str):
    """The file (or directory), valid as it is, moved out of the build and linked to from
    where it was: planc must not read it (issue 20)."""
    def apply(build: Path) -> None:
        path = build / file
        outside = build.parent / f"outside-{file.replace('/', '-')}"
        shutil.move(path, outside)
        path.symlink_to(outside)

    return apply


def _label(path: tuple) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else str(p))
                   for i, p in enumerate(path))


# --- the corpus -----------------------------------------------------------------------------


def _whole_file(file: str, raw: bytes) -> list[Damage]:
    cuts = {"cut-at-1": 1, "cut-in-half": len(raw) // 2, "cut-last-byte": len(raw) - 2}
    middle = len(raw) // 3
    damages = [Damage(f"{file}:missing", file, _replace_with(file, "missing")),
               Damage(f"{file}:empty", file, _write_bytes(file, b"")),
               Damage(f"{file}:not-utf8", file,
                      _write_bytes(file, raw[:middle] + b"\xff\xfe" + raw[middle + 2:])),
               Damage(f"{file}:json-list", file, _write_bytes(file, b"[]\n")),
               Damage(f"{file}:json-null", file, _write_bytes(file, b"null\n")),
               Damage(f"{file}:json-nan", file, _write_bytes(file, b"NaN\n")),
               Damage(f"{file}:directory", file, _replace_with(file, "directory")),
               Damage(f"{file}:fifo", file, _replace_with(file, "fifo")),
               Damage(f"{file}:dev-zero", file, _replace_with(file, "dev-zero")),
               Damage(f"{file}:outside-link", file, _link_outside(file))]
    damages += [Damage(f"{file}:{name}", file, _write_bytes(file, raw[:at]))
                for name, at in cuts.items()]
    return damages


def _fields(file: str, data, path: tuple, rotation: int, resign: bool = False,
            values: int = 2) -> list[Damage]:
    """Each field under ``path``: deleted, and ``values`` wrong values (rotating)."""
    holder = data
    for key in path:
        holder = holder[key]
    damages = []
    keys = list(holder) if isinstance(holder, dict) else list(range(len(holder)))
    for i, key in enumerate(keys):
        where = path + (key,)
        if isinstance(holder, dict):
            damages.append(Damage(f"{file}:{_label(where)}-deleted", file,
                                  _edit(file, where, delete=True, resign=resign)))
        for k in range(values):
            name = ROTATION[(rotation + i * values + k) % len(ROTATION)]
            if WRONG[name] == holder[key] and type(WRONG[name]) is type(holder[key]):
                name = ROTATION[(rotation + i * values + k + values) % len(ROTATION)]
            damages.append(Damage(f"{file}:{_label(where)}={name}", file,
                                  _edit(file, where, WRONG[name], resign=resign)))
    return damages


def _first(items: list, test) -> int:
    return next(i for i, item in enumerate(items) if test(item))


def _top_level(file: str, data: dict, rotation: int) -> list[Damage]:
    """Every top-level key: deleted, and given two values of the wrong type in turn (the
    whole list of WRONG comes round every few keys)."""
    out = []
    for i, key in enumerate(data):
        out.append(Damage(f"{file}:{key}-deleted", file, _edit(file, (key,), delete=True)))
        for k in range(2):
            name = ROTATION[(rotation + 2 * i + k) % len(ROTATION)]
            out.append(Damage(f"{file}:{key}={name}", file, _edit(file, (key,), WRONG[name])))
    return out


def damages(pristine: Path) -> list[Damage]:
    """The corpus, generated from the build ``pristine``: deterministic, since the build
    is."""
    out: list[Damage] = []
    documents = {file: json.loads((pristine / file).read_text()) for file in FILES}
    for n, file in enumerate(FILES):
        out += _whole_file(file, (pristine / file).read_bytes())
        out += _top_level(file, documents[file], 3 * n)
    out += [Damage(f"programs/:{what}", PROGRAMS, _replace_with(PROGRAMS, what))
            for what in ("missing", "directory", "file", "dev-zero")]
    out.append(Damage("programs/:outside-link", PROGRAMS, _link_outside(PROGRAMS)))
    # plan.json, re-signed: the checks of plan_from_dict
    plan = documents["plan.json"]
    for n, section in enumerate(("model", "mesh", "topology", "shard", "schedule", "optimize",
                                 "train")):
        out += _fields("plan.json", plan, (section,), n, resign=True, values=1)
    # graph.json: its attributes, buckets, pass report, nodes and edges
    graph = documents["graph.json"]
    out += [d for d in _fields("graph.json", graph, ("graph",), 0, values=1)
            if not d.name.startswith("graph.json:graph.plan_sha256")]
    bucket = next(iter(graph["graph"]["buckets"]))
    out += _fields("graph.json", graph, ("graph", "buckets", bucket), 1, values=1)
    out += _fields("graph.json", graph, ("graph", "buckets", bucket, "members", 1), 2, values=1)
    passes = graph["graph"]["passes"]
    out += _fields("graph.json", graph, ("graph", "passes"), 3, values=1)
    route = _first(passes, lambda record: record["name"] == "route")
    out += _fields("graph.json", graph, ("graph", "passes", route), 4, values=1)
    out += _fields("graph.json", graph, ("graph", "passes", route, "decisions", 0), 5,
                   values=1)
    out += _fields("graph.json", graph,
                   ("graph", "passes", route, "decisions", 0, "candidates", 0), 6, values=1)
    nodes = graph["nodes"]
    for n, kind in enumerate(sorted({node["type"] for node in nodes})):
        index = _first(nodes, lambda node, kind=kind: node["type"] == kind)
        out += _fields("graph.json", graph, ("nodes", index), n, values=1)
    from planc.graph.vocabulary import OPTIONAL_TYPES as _OPTIONAL_TYPES

    for n, key in enumerate(sorted(_OPTIONAL_TYPES)):  # the first node that has it
        index = next((i for i, node in enumerate(nodes) if key in node), None)
        if index is not None:
            out += [d for d in _fields("graph.json", graph, ("nodes", index), n, values=1)
                    if d.name.split(":", 1)[1].startswith(f"nodes[{index}].{key}")]
    out += _fields("graph.json", graph, ("edges", 0), 3, values=1)
    # programs/: one instruction of each op in each part of a program, its schedule,
    # receives and buckets; the rank, group and route tables
    program = documents["programs/stage0.json"]
    for n, (name, block) in enumerate([("prologue", program["prologue"]),
                                       ("epilogue", program["epilogue"])]
                                      + sorted(program["blocks"].items())):
        path = (name,) if name in ("prologue", "epilogue") else ("blocks", name)
        for op in sorted({i["op"] for i in block}):
            index = _first(block, lambda i, op=op: i["op"] == op)
            out += _fields("programs/stage0.json", program, path + (index,), n, values=1)
    out += _fields("programs/stage0.json", program, ("schedule", 0), 1, values=3)
    stream = next(iter(program["receives"]))
    out += _fields("programs/stage0.json", program, ("receives", stream, 0), 2, values=3)
    bucket = next(iter(program["buckets"]))
    out += _fields("programs/stage0.json", program, ("buckets", bucket), 3, values=1)
    out += _fields("programs/stage0.json", program, ("buckets", bucket, "members", 1), 4,
                   values=1)
    out += _fields("programs/ranks.json", documents["programs/ranks.json"], ("stages",), 5,
                   values=3)
    groups = documents["programs/groups.json"]
    out += _fields("programs/groups.json", groups, ("mesh",), 6, values=1)
    out += _fields("programs/groups.json", groups, ("groups", 0), 7, values=2)
    routes = documents["programs/routes.json"]
    recipe = next(iter(routes["recipes"]))
    out += _fields("programs/routes.json", routes, ("recipes", recipe), 8, values=1)
    out += _fields("programs/routes.json", routes, ("recipes", recipe, "steps", 0), 9,
                   values=2)
    model = documents["programs/model.json"]
    out += _fields("programs/model.json", model, ("model",), 10, values=1)
    out += _fields("programs/model.json", model, ("tokens",), 0, values=2)
    out += _fields("programs/model.json", model, ("optimizer",), 1, values=1)
    parameter = next(iter(model["parameters"]))
    out += _fields("programs/model.json", model, ("parameters", parameter), 2, values=2)
    out += regressions(documents)
    unique: dict[str, Damage] = {}
    for damage in out:  # a node may be the first of its type and the first with a key
        if damage.every_command or damage.name not in unique:
            unique[damage.name] = damage
    return list(unique.values())


def regressions(documents: dict) -> list[Damage]:
    """Damage that once reached a traceback or was accepted (found by this corpus and
    larger runs of it), each run through every command."""
    nodes = documents["graph.json"]["nodes"]
    compute = _first(nodes, lambda node: node["type"] == "compute")
    routed = _first(nodes, lambda node: "route_seconds" in node)
    moved = _first(nodes, lambda node: "producer" in node)
    route = _first(documents["graph.json"]["graph"]["passes"],
                   lambda record: record["name"] == "route")
    stage0, plan = "programs/stage0.json", "plan.json"
    cases = [  # (file, path, value or DELETE, re-sign plan.json)
        (plan, ("model", "family"), "NaN", True),  # simulate: KeyError
        (plan, ("model", "norm_eps"), -1, True),  # accepted
        ("graph.json", ("nodes", compute, "chunk"), 7, False),  # simulate: no progress
        ("graph.json", ("nodes", routed, "route_seconds"), "x", False),  # simulate
        ("graph.json", ("nodes", moved, "consumer"), None, False),  # explain: KeyError
        ("graph.json", ("graph", "passes", route, "decisions", 0, "route"), "x", False),
        ("graph.json", ("graph", "buckets", "c0.b0", "members", 1, "param"), [], False),
        ("graph.json", ("multigraph",), True, False),  # graph: ValueError
        (stage0, ("prologue", 0, "node"), "NaN", False),  # simulate: KeyError
        (stage0, ("stage",), 7, False),  # simulate: the schedule cannot progress
        (stage0, ("stage",), INF, False),  # OverflowError
        (stage0, ("buckets", "c0.b0", "members", 1, "param"), [], False),  # verify
        ("programs/ranks.json", ("pp",), 10**40, False),  # OverflowError
        ("programs/groups.json", ("devices_per_node",), INF, False),  # OverflowError
        ("programs/groups.json", ("groups", 0, "ref"), {}, False),  # accepted
    ]
    return [Damage(f"{file}:{_label(path)}" + ("-deleted" if value is None else
                                               f"=regression-{json.dumps(value)[:24]}"),
                   file, _edit(file, path, value, delete=value is None, resign=resign),
                   every_command=True)
            for file, path, value, resign in cases]


def commands_for(index: int, damage: Damage) -> list[tuple[str, ...]]:
    """verify and programs --expand; for every other damage one more command, in turn."""
    if damage.every_command:
        return [*COMMANDS, *THIRD]
    return [*COMMANDS, THIRD[index // 2 % len(THIRD)]] if index % 2 else [*COMMANDS]


# --- running --------------------------------------------------------------------------------

# Imported by the driver before it forks, so that each run starts at once.
PRELOAD = ("planc.cli", "planc.commands", "planc.commands.programs", "planc.commands.graph",
           "planc.commands.explain", "planc.commands.simulate", "planc.build.directory",
           "planc.verify.verifier", "planc.views.program_text", "planc.views.explain_text",
           "planc.views.graph.render", "planc.views.simulate_text", "planc.graph.select",
           "planc.simulate", "planc.lang.schema", "planc.compile")
DRIVER = f"""
import importlib, sys
sys.path.insert(0, {str(ROOT)!r})
from tests import hostile_inputs
for module in {PRELOAD!r}:
    importlib.import_module(module)
sys.exit(hostile_inputs._drive(sys.argv[1:]))
"""


def materialize(pristine: Path, damage: Damage, directory: Path) -> Path:
    build = directory / "b"
    shutil.copytree(pristine, build, symlinks=True)
    damage.apply(build)
    return build


def run(jobs: list[hostile.Job], scratch: Path, workers: int = 2) -> list[hostile.Result]:
    """Every job in a child forked from a driver that imported planc."""
    scratch.mkdir(parents=True, exist_ok=True)
    jobs_path, results_path = scratch / "jobs.json", scratch / "results.json"
    jobs_path.write_text(json.dumps([asdict(job) for job in jobs]))
    done = subprocess.run([sys.executable, "-c", DRIVER, "drive", str(jobs_path),
                           str(results_path), "--workers", str(workers)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"the driver failed ({done.returncode}):\n{done.stderr[-5000:]}")
    return [hostile.Result(**r) for r in json.loads(results_path.read_text())]


# --- the runs -------------------------------------------------------------------------------

ALL = (*COMMANDS, *THIRD)
# The build's documents, read before its programs, and the programs (the two test files).
DOCUMENTS = FILES[:4]
PROGRAM_FILES = (*FILES[4:], PROGRAMS)


def compile_pristine(directory: Path) -> Path:
    from planc.cli import main

    assert main(["compile", str(PLANS / "gpt-tiny.plan"), "-o", str(directory / "b")]) == 0
    return directory / "b"


def run_damaged(pristine: Path, corpus: list[Damage], files: tuple[str, ...], root: Path,
                with_pristine: bool):
    """Every damaged build of ``files`` through its commands and, ``with_pristine``, the
    pristine build through every command: (damage or None, job, result) per run, and the
    seconds it all took. A damage's commands depend on its place in the whole corpus
    (:func:`commands_for`), whichever file runs it."""
    start = time.monotonic()
    plan: list[tuple[Damage | None, hostile.Job]] = []
    for i, damage in enumerate([None, *corpus]):
        if damage is None and not with_pristine or damage is not None and \
                damage.file not in files:
            continue
        directory = root / f"{i:04d}"
        if damage is None:
            directory.mkdir()
            build = directory / "b"
            shutil.copytree(pristine, build)
        else:
            build = materialize(pristine, damage, directory)
        for argv in ALL if damage is None else commands_for(i, damage):
            name = f"{damage.name if damage else 'pristine'} :: {argv[0]} {' '.join(argv[2:])}"
            plan.append((damage, hostile.Job(name.strip(), [a.format(b=build) for a in argv],
                                             str(directory), "fork", TIME_LIMIT)))
    results = run([job for _, job in plan], root / "driver")
    seconds = time.monotonic() - start
    shutil.rmtree(root, ignore_errors=True)
    damaged = sum(damage.file in files for damage in corpus)
    print(f"\n{damaged} damaged builds, {len(results)} runs in {seconds:.1f} s")
    return [(damage, job, result) for (damage, job), result in zip(plan, results)], seconds


def damaged_fixtures(files: tuple[str, ...], with_pristine: bool):
    """A test module's fixtures: ``pristine`` (the build, compiled once), ``corpus`` (every
    damage) and ``runs`` (:func:`run_damaged` of the damage to ``files``)."""
    import pytest

    @pytest.fixture(scope="module")
    def pristine(tmp_path_factory) -> Path:
        return compile_pristine(tmp_path_factory.mktemp("pristine"))

    @pytest.fixture(scope="module")
    def corpus(pristine) -> list[Damage]:
        return damages(pristine)

    @pytest.fixture(scope="module")
    def runs(pristine, corpus, tmp_path_factory):
        return run_damaged(pristine, corpus, files, tmp_path_factory.mktemp("damaged"),
                           with_pristine)

    return pristine, corpus, runs


def expected_runs(corpus: list[Damage], files: tuple[str, ...], with_pristine: bool) -> int:
    return (len(ALL) if with_pristine else 0) + sum(
        len(commands_for(i + 1, damage)) for i, damage in enumerate(corpus)
        if damage.file in files)


VERIFY_SUMMARY = re.compile(r"^\d+ problems? found; these programs must not run\.$")


def problems(result: hostile.Result) -> list[str]:
    """What is wrong with one run: hostile_inputs' verdict (a traceback, a time-out, a
    signal, a MemoryError, a status other than 0, 1 or 2, silence on failure), and a
    failure that does not say why in ``planc: error:`` lines."""
    case = hostile.Case("damaged-build", "damaged-build", "args", plan=b"")
    found = hostile.problems(case, result)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    if result.status == 1 and not all(line.startswith("planc: error: ") or
                                      VERIFY_SUMMARY.match(line) for line in lines):
        found.append(f"status 1 with lines other than 'planc: error:': {lines[:3]!r}")
    if result.status == 2 and not any(line.startswith("planc: error: ") for line in lines):
        found.append("status 2 without a 'planc: error:' line")
    return found


def _report(failures) -> str:
    return "\n\n".join(f"{job.name}\n  planc {' '.join(job.argv)}\n  {'; '.join(found)}\n"
                        f"  status {result.status}, signal {result.signal}, "
                        f"{result.seconds:.2f} s\n  stderr: {result.stderr[-800:]!r}"
                        for job, result, found in failures)



# --- what every run must show (the assertions of both test files) ---------------------------


def check_every_run_ran(runs, corpus: list[Damage], files: tuple[str, ...],
                        with_pristine: bool) -> None:
    results, _ = runs
    assert len(results) == expected_runs(corpus, files, with_pristine)
    for _, job, result in results:
        assert not result.harness_error, (job.name, result.harness_error)


def check_refused_cleanly(runs, file: str) -> None:
    """No traceback, time-out, signal or MemoryError; status 0, 1 or 2; a failure says
    why with planc: error: lines (one, where the build could not be read)."""
    import pytest

    results, _ = runs
    mine = [(job, result) for damage, job, result in results
            if damage is not None and damage.file == file]
    assert mine
    failures = [(job, result, found) for job, result in mine if (found := problems(result))]
    if failures:
        pytest.fail(f"{len(failures)} of {len(mine)} runs on damaged {file} failed:\n\n"
                    + _report(failures[:40]), pytrace=False)


# The fields whose damage a build may carry and still verify, each for a reason: the
# manifest's provenance (planc compile's version, the source and its hash, its files'
# list and MFU, checked where they matter: `planc run` refuses a build whose files
# changed); summary.json (figures compile printed; planc reads none back); graph.json's
# attributes that only the passes and lowering used (the programs were lowered from
# them; the verifier reads the graph's nodes, edges and kinds, not these), and what the
# route pass recorded for planc explain; and in programs/, a freed buffer kept (memory,
# not correctness), a field deleted whose default is the value it held, or an empty
# table of rank overrides.
ACCEPTED_FIELDS = frozenset({
    *(f"build.json:{key}" for key in ("files", "mfu", "plan", "planc", "source",
                                      "source_sha256")),
    *(f"summary.json:{key}" for key in ("buckets", "device_memory", "edges", "format",
                                        "microbatches", "nodes", "passes", "plan", "version",
                                        "world")),
    *(f"graph.json:graph.{key}" for key in (
        "chunks", "dtype", "family", "format", "microbatch_size", "pipeline", "plan",
        "pp_scatter_gather", "recompute", "stream_layout", "virtual", "zero",
        "passes[].decisions[].axis", "passes[].decisions[].bytes",
        "passes[].decisions[].candidates[].reason", "passes[].decisions[].kind",
        "passes[].decisions[].stage")),
    "graph.json:edges[].port",
    *(f"graph.json:nodes[].{key}" for key in (
        "consumer", "dim", "microbatch", "placement", "repeat", "route_seconds",
        "scatter_gather", "shape", "source_layout", "stream", "toward", "tp_input",
        "tp_output", "weight_grad_of")),
    "programs/stage0.json:blocks.B0[].frees", "programs/stage0.json:blocks.F0[].frees",
    "programs/stage0.json:epilogue[].per_microbatch",
    "programs/stage0.json:prologue[].per_microbatch",
    "programs/ranks.json:overrides"})


def _field(damage: str) -> str:
    """A damage's field, its list indices dropped: "graph.json:nodes[2].dim=huge" ->
    "graph.json:nodes[].dim"."""
    field = damage.split("=")[0].removesuffix("-deleted")
    return re.sub(r"\[\d+\]", "[]", field)


def check_refused_not_ignored(runs, pristine: Path, files: tuple[str, ...],
                              always_refused: tuple[str, ...]) -> None:
    """Most damage is refused (status 1), at reading or by the verifier; what is accepted
    is what planc does not use (the manifest's source, summary.json's figures). Damage
    that once went through, or reached a traceback, is refused by every command that
    reads the damaged file."""
    from collections import Counter

    results, _ = runs
    verify = {damage.name: result.status for damage, job, result in results
              if damage is not None and job.argv[0] == "verify"}
    statuses = Counter(verify.values())
    assert set(statuses) <= {0, 1} and statuses[1] > 0.75 * len(verify), statuses
    # what is accepted is only damage to what no command relies on (ACCEPTED_FIELDS)
    accepted = {name for name, status in verify.items() if status == 0}
    assert {_field(name) for name in accepted} <= ACCEPTED_FIELDS, sorted(
        name for name in accepted if _field(name) not in ACCEPTED_FIELDS)
    for name in always_refused:
        assert verify[name] == 1, name
    # a link to a valid file or directory outside the build: refused, not followed
    links = [name for name in verify if name.endswith(":outside-link")]
    assert len(links) == len(files)
    assert {name: verify[name] for name in links} == dict.fromkeys(links, 1)
    documents = {file: json.loads((pristine / file).read_text()) for file in FILES}
    names = {damage.name for damage in regressions(documents) if damage.file in files}
    assert names
    ran = [(damage, job.argv, result.status) for damage, job, result in results
           if damage is not None and damage.name in names]
    assert len(ran) == len(names) * len(ALL)
    table = RankTable.from_json(documents["programs/ranks.json"])
    for damage, argv, status in ran:
        # graph and explain read no program; planc programs only the one its rank runs
        unread = damage.file.startswith(f"{PROGRAMS}/") and argv[0] in ("graph", "explain")
        if argv[0] == "programs" and damage.file.startswith(f"{PROGRAMS}/stage"):
            rank = int(argv[argv.index("--rank") + 1]) if "--rank" in argv else 0
            unread = damage.file != f"{PROGRAMS}/{table.program_of(rank)}"
        assert status in ({0, 1} if unread else {1}), (damage.name, argv, status)
