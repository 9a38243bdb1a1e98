"""``planc report``: one self-contained HTML page about a plan or build."""

from __future__ import annotations

import json
import sys

from planc.commands import EXIT_OK, fail, load_programs, outputs_refused, the_input
from planc.host.files import read_regular_file
from planc.data.metrics_file import in_range, read_metrics
from planc.commands.arguments import Command, add_input, force, output, path
from planc.plan.mesh import AXES
from planc.plan.plan import LIMITS
from planc.vocabulary.versions import is_version


def _other_build(path: str, records: list[dict], build_path: str, fingerprint: str
                 ) -> tuple[str | None, str | None]:
    """(why the metrics are refused, why they could not be checked): a ``planc run
    --metrics`` file carries the fingerprint of the build that ran (``plan_sha256`` of its
    build.json) in every record; a file of an older planc carries none."""
    found = {record.get("build") for record in records}
    if found == {None}:
        return None, (f"{path} has no build fingerprint (a planc run older than "
                      f"fingerprints wrote it), so it cannot be checked against {build_path}; "
                      f"it is compared as it is")
    if len(found) > 1 and fingerprint in found and _replanned(records):
        return None, None
    if len(found) > 1:
        return (f"{path} mixes the metrics of {len(found)} runs (build fingerprints "
                f"{', '.join(sorted(str(f)[:12] for f in found))}); give the file of one "
                f"run"), None
    (theirs,) = found
    if theirs != fingerprint:
        return (f"{path} holds the metrics of another build (fingerprint "
                f"{str(theirs)[:12]}), not of {build_path} (fingerprint {fingerprint[:12]}); "
                f"report the build that ran, or run this one with planc run {build_path} "
                f"--metrics FILE"), None
    return None, None


def _replanned(records: list[dict]) -> bool:
    """Whether the build changes only where a record says the run switched layouts
    (``recovery``: planc run --on-failure replan): one run, over several builds."""
    return all(a.get("build") == b.get("build") or "recovery" in b
               for a, b in zip(records, records[1:]))


TUNE_FIELDS = {"mesh": dict, "order": list, "virtual": int, "microbatches": int,
               "pipeline": str, "zero": int, "sequence_parallel": bool, "recompute": str,
               "step_seconds": (int, float), "tflops_per_gpu": (int, float),
               "mfu": (int, float), "bubble": (int, float), "memory_bytes": (int, float)}
MAX_TUNE_BYTES = 64 << 20  # a candidate with its plan text is a few KiB
TUNE_NUMBERS = ("step_seconds", "tflops_per_gpu", "mfu", "bubble", "memory_bytes")


def _tune(path: str) -> tuple[list[dict] | None, str | None]:
    """The ranked candidates of a ``planc tune --json`` file, or why it cannot be read."""
    try:  # a regular file of at most MAX_TUNE_BYTES: not /dev/zero, a pipe or a directory
        data = json.loads(read_regular_file(path, MAX_TUNE_BYTES + 1).decode("utf-8"))
    except OSError as exc:
        return None, f"cannot read {path}: {exc.strerror or exc}"
    except (ValueError, RecursionError):
        return None, f"{path} is not a planc tune --json file (not JSON)"
    if not isinstance(data, dict) or data.get("format") != "planc-tune" or \
            not is_version(data.get("version"), 1) or not isinstance(data.get("candidates"), list):
        return None, f"{path} is not a planc tune --json file (format planc-tune, version 1)"
    for k, item in enumerate(data["candidates"], 1):
        bad = [key for key, kind in TUNE_FIELDS.items() if not isinstance(item, dict) or
               not isinstance(item.get(key), kind) or isinstance(item.get(key), bool) and
               kind is not bool]
        mesh = item.get("mesh") if isinstance(item, dict) else None
        if not bad and not (all(a in mesh for a in ("tp", "cp", "pp", "dp", "ep")) and all(
                isinstance(degree, int) and not isinstance(degree, bool)
                for degree in mesh.values())):
            bad = ["mesh"]
        if not bad and not all(1 <= mesh[a] <= LIMITS["world"] for a in mesh) or \
                not bad and mesh["tp"] * mesh["cp"] * mesh["pp"] * mesh["dp"] > LIMITS["world"]:
            bad = ["mesh"]  # degrees of a mesh planc check accepts
        if not bad and not (all(isinstance(a, str) for a in item["order"]) and
                            sorted(item["order"]) == sorted(set(item["order"])) and
                            set(item["order"]) <= set(AXES)):
            bad = ["order"]  # the mesh's axes by name, each once
        if not bad:  # a schedule and a recomputation planc check accepts, by name
            bad = [key for key in ("pipeline", "recompute")
                   if item[key] not in _words(key)][:1]
        if not bad:
            bad = [key for key, low, high in (("virtual", 1, LIMITS["layers"] + 2),
                                              ("microbatches", 1, LIMITS["microbatches"]),
                                              ("zero", 0, 3))
                   if not low <= item[key] <= high][:1]
        if not bad:  # formatted with floats: 10**400 overflows, as in a metrics file
            bad = [key for key in TUNE_NUMBERS if not (in_range(item[key]) and item[key] >= 0)]
        if bad:
            return None, (f"{path}: candidate {k} has no valid {bad[0]}; it is not what "
                          f"planc tune --json writes")
    return data["candidates"], None


def _words(key: str) -> tuple[str, ...]:
    """The values a tune candidate's ``pipeline`` or ``recompute`` may have: the plan
    language's own (planc.lang.schema)."""
    from planc.lang.schema import PLAN_SCHEMA

    block = "schedule" if key == "pipeline" else "optimize"
    return PLAN_SCHEMA.blocks[block].keys[key].kind.words


def main(args) -> int:
    from planc.build.directory import plan_fingerprint
    from planc.host.files import write_atomically
    from planc.host.output_kinds import REPORT, marked
    from planc.simulate import simulate
    from planc.views import report_html

    refused = outputs_refused(args, (the_input(args.file), ("the metrics file", args.metrics),
                                     ("the tune file", args.tune)))
    if refused is not None:
        return refused
    metrics = cut = None
    if args.metrics:
        metrics, problem, cut = read_metrics(args.metrics)
        if problem:
            return fail(problem)
    ranked = None
    if args.tune:
        ranked, problem = _tune(args.tune)
        if problem:
            return fail(problem)
    built, status = load_programs(args, verified=True)
    if built is None:
        return status
    unchecked = None
    if metrics:
        # a build directory's own fingerprint, as its runs wrote it (build.json, checked
        # against plan.json when read): a plan.json of an older planc, without a key
        # added since, reads back to a plan whose fingerprint today differs
        fingerprint = built.graph.graph.get("plan_sha256") or plan_fingerprint(built.plan)
        refused, unchecked = _other_build(args.metrics, metrics, args.file, fingerprint)
        if refused:
            return fail(refused)
        mine = [r for r in metrics if r.get("build") == fingerprint]
        if unchecked is None and len(mine) < len(metrics):
            print(f"planc: warning: {args.metrics} is a run that switched layouts (planc run "
                  f"--on-failure replan): the {len(mine)} of its {len(metrics)} steps this "
                  f"build ran are compared; report BUILD/replans/N for the others",
                  file=sys.stderr)
            metrics = mine
        if cut:  # the records are used: say where they stopped
            print(f"planc: warning: {cut}", file=sys.stderr)
        if unchecked:
            print(f"planc: warning: {unchecked}", file=sys.stderr)
    result = simulate(built, keep_timeline=True)
    page = report_html.render(built, result, metrics, unchecked=unchecked, ranked=ranked)
    try:
        write_atomically(args.output, marked(page.encode(), "html", REPORT.generator))
    except OSError as exc:
        return fail(f"cannot write {args.output}: {exc.strerror or exc}")
    print(f"report written to {args.output} ({len(page) // 1024} KB, self-contained)",
          file=sys.stderr)
    return EXIT_OK


def add_arguments(parser) -> None:
    """The arguments of planc report."""
    add_input(parser, "FILE|DIR")
    output(parser, "-o", "--output", kind="report", required=True, metavar="PAGE.html")
    force(parser)
    parser.add_argument("--metrics", metavar="M.jsonl", type=path,
                        help="a planc run --metrics file of the same build")
    parser.add_argument("--tune", metavar="T.json", type=path,
                        help="a planc tune --json file: its ranked layouts beside this plan")


# planc.cli adds these to its command line, in this order.
COMMANDS = (
    Command("report", add_arguments, main,
            help="one self-contained HTML page: layout, memory, transfers, timeline",
            description="Write one offline HTML page about a plan or build: the plan, a picture "
                        "of the layout, memory per stage against the device, transfers per axis "
                        "and kind, the simulated timeline of a step, and, with --metrics, "
                        "predicted against measured."),
)
