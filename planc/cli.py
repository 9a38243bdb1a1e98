"""The ``planc`` command line: argument parsing and dispatch, nothing else.

Exit status: 0 success (warnings allowed), 1 errors in the input, 2 bad command line.
Diagnostics go to standard error (or, with ``--error-format json``, to standard
output as one JSON document); requested output goes to standard output.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Sequence, TextIO

from planc import __version__
from planc.diagnostics import render_json, render_text, summary_line
from planc.words import counted

EXIT_OK, EXIT_ERRORS, EXIT_USAGE = 0, 1, 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's own usage errors: status 2, no traceback
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def use_color(stream: TextIO) -> bool:
    """Colour only on a terminal, and never when NO_COLOR is set (no-color.org)."""
    if os.environ.get("NO_COLOR"):
        return False
    return hasattr(stream, "isatty") and stream.isatty() and os.environ.get("TERM") != "dumb"


def _add_input(parser: argparse.ArgumentParser, metavar: str = "FILE") -> None:
    parser.add_argument("file", metavar=metavar,
                        help="a .plan file" + (" or a build directory" if "DIR" in metavar
                                               else ""))
    parser.add_argument("--error-format", choices=("text", "json"), default="text",
                        help="how to print diagnostics (json: one document on stdout)")


def _add_overrides(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--set", action="append", type=_override, metavar="KEY=VALUE",
                        help="override a key of the plan, such as --set mesh.tp=4 or --set "
                        "'train.optimizer=adamw(lr = 3e-4)' (repeatable; docs/language.md)")


def _override(text: str) -> str:
    from planc.lang.overrides import override_argument  # a malformed one exits with 2

    return override_argument(text)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="planc", description="planc: a declarative parallel-plan compiler "
                     "for training transformer models.")
    parser.add_argument("--version", action="version", version=f"planc {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    check = commands.add_parser("check", help="check a plan and report every problem",
                                description="Parse and check a .plan file; report every "
                                "problem with its line and column.")
    _add_input(check)
    _add_overrides(check)
    check.add_argument("-v", "--verbose", action="store_true",
                       help="also print the resolved settings and the memory estimate")

    layout = commands.add_parser("layout", help="show which rank sits where, and the groups",
                                 description="Show the rank of every device, its mesh "
                                 "coordinates and node, and the communication groups.")
    _add_input(layout)
    layout.add_argument("--json", action="store_true",
                        help="print the layout as JSON (see README)")

    compile_ = commands.add_parser(
        "compile", help="derive the communication graph and write a build directory",
        description="Check a plan, derive every compute step and transfer of one training "
        "step, and write plan.json, graph.json and summary.json to a build directory "
        "(docs/build.md).")
    _add_input(compile_)
    _add_overrides(compile_)
    compile_.add_argument("-o", "--output", metavar="DIR",
                          help="build directory [build/NAME, NAME being the file's stem]")

    graph = commands.add_parser(
        "graph", help="draw the communication graph (dot, svg, png, graphml, json, html)",
        description="Draw the communication graph of a plan file or a build directory. Big "
        "graphs show one layer and one microbatch unless told otherwise.")
    _add_input(graph, "FILE|DIR")
    graph.add_argument("--format", choices=GRAPH_FORMATS, default=None,
                       help="output format [from -o's extension, else dot]")
    graph.add_argument("-o", "--output", metavar="OUT", help="output file [standard output]")
    graph.add_argument("--stage", type=_int_list, metavar="S[,S...]", help="pipeline stages")
    graph.add_argument("--layers", type=_layer_range, metavar="A..B", help="layer or range")
    graph.add_argument("--microbatch", type=_microbatches, metavar="K[,K...]|all",
                       help="unfold these microbatches (default: folded, or 0 for big graphs)")
    graph.add_argument("--phase", choices=("forward", "backward", "optimizer"),
                       action="append", help="keep this phase (repeatable)")
    graph.add_argument("--axis", choices=AXES, action="append",
                       help="keep transfers over this axis (repeatable)")
    graph.add_argument("--transfers-only", action="store_true",
                       help="only transfers, connected through the computation between them")
    graph.add_argument("--all", action="store_true",
                       help="the whole graph, even when it is big")

    explain = commands.add_parser(
        "explain", help="why each transfer exists: kind, group, size, reason",
        description="List the transfers of one layer (default: the first) or of one "
        "parameter's gradient, with kind, group, size and the reason for each, and totals "
        "per step.")
    _add_input(explain, "FILE|DIR")
    explain.add_argument("--layer", type=int, metavar="N", help="a layer")
    explain.add_argument("--param", metavar="NAME",
                         help="a parameter, such as layers.3.qkv.weight or embedding.weight")
    explain.add_argument("--axis", choices=AXES, help="only transfers over this axis")
    explain.add_argument("--buckets", action="store_true",
                         help="every parameter bucket: its members and why it closed")

    programs = commands.add_parser(
        "programs", help="print a rank's program: streams, blocks, events, schedule",
        description="Print the program a rank runs (the program of its pipeline stage): "
        "its blocks of instructions on named streams, the schedule of blocks, its receives "
        "and its epilogue. --expand prints one step's instructions in issue order.")
    _add_input(programs, "FILE|DIR")
    programs.add_argument("--rank", type=int, default=0, metavar="R", help="a rank [0]")
    programs.add_argument("--expand", action="store_true",
                          help="every instruction of one step, in issue order")
    programs.add_argument("--microbatch", type=int, metavar="K",
                          help="with --expand: only this microbatch (and per-step work)")

    verify = commands.add_parser(
        "verify", help="prove a build's programs cannot deadlock or mix up data",
        description="Check a build's rank programs without running them: collectives in "
        "the same order on every member of a group, every send matched by one receive of "
        "the same size, no deadlock, every wait after its record, no buffer overwritten "
        "while a transfer reads it.")
    _add_input(verify, "FILE|DIR")

    run = commands.add_parser(
        "run", help="train for real: every rank on this machine, torch.distributed",
        description="Compile the plan if given a file, verify its programs, and run every "
        "rank on this machine with torch.distributed (NCCL with CUDA streams on GPUs, gloo "
        "on CPUs). For a cluster, start `torchrun ... -m planc.runtime.worker DIR` on "
        "every node instead.")
    _add_input(run, "FILE|DIR")
    _add_overrides(run)
    run.add_argument("-o", "--output", metavar="DIR",
                     help="where to compile a plan file [build/NAME]")
    run.add_argument("--steps", type=int, metavar="N", help="steps [the plan's train.steps]")
    run.add_argument("--backend", choices=("gloo", "nccl"),
                     help="[nccl where CUDA is present, else gloo]")
    run.add_argument("--metrics", metavar="M.jsonl", help="one JSON object per step")
    run.add_argument("--trace", metavar="T.json", help="Chrome trace of every rank's streams")
    run.add_argument("--check", action="store_true",
                     help="also train in one process and compare every loss and parameter")
    run.add_argument("--timeout", type=float, default=120.0, metavar="S",
                     help="seconds without progress before every rank reports a hang [120]")
    run.add_argument("--no-verify", action="store_true",
                     help="run programs without verifying them (to debug a broken build)")
    return parser


GRAPH_FORMATS = ("dot", "svg", "png", "graphml", "json", "html")
AXES = ("tp", "cp", "pp", "dp_cp", "tied", "stage")


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, got "
                                         f"{text!r}") from None
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected non-negative integers, got {text!r}")
    return values


def _layer_range(text: str) -> tuple[int, int]:
    first, _, last = text.partition("..")
    try:
        low, high = int(first), int(last or first)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a layer N or a range A..B, got "
                                         f"{text!r}") from None
    if low < 0 or high < low:
        raise argparse.ArgumentTypeError(f"{text!r} is not a range of layers")
    return low, high


def _microbatches(text: str) -> tuple[int, ...] | str:
    return "all" if text == "all" else _int_list(text)


def _load(args) -> tuple[object, int]:
    """Load the plan named on the command line and print its diagnostics."""
    from planc.lang import load_file

    loaded = load_file(args.file, getattr(args, "set", None) or ())
    if args.error_format == "json":
        if loaded.diagnostics or not loaded.ok:
            print(render_json(loaded.diagnostics, loaded.path))
    elif loaded.diagnostics:
        text = render_text(loaded.diagnostics, loaded.path, loaded.source, use_color(sys.stderr))
        print(text, file=sys.stderr)
        print(summary_line(loaded.diagnostics), file=sys.stderr)
    return loaded, (EXIT_OK if loaded.ok else EXIT_ERRORS)


def cmd_check(args) -> int:
    from planc import memory
    from planc.views import memory_text, plan_text

    loaded, status = _load(args)
    if status != EXIT_OK or args.error_format == "json":
        return status
    plan = loaded.plan
    print(plan_text.one_line(plan, loaded.path))
    if args.verbose:
        print()
        print(plan_text.settings(plan))
        print()
        print(memory_text.render(memory.estimate(plan)))
    return EXIT_OK


def cmd_layout(args) -> int:
    from planc import memory
    from planc.layout import Layout
    from planc.views import layout_text, memory_text

    loaded, status = _load(args)
    if status != EXIT_OK:
        return status
    layout = Layout.of(loaded.plan)
    if args.json:
        print(json.dumps(layout.to_dict(), separators=(",", ":")))
        return EXIT_OK
    print(layout_text.render(layout, loaded.plan.name))
    print()
    print(memory_text.render(memory.estimate(loaded.plan)))
    return EXIT_OK


def _fail(message: str, status: int = EXIT_ERRORS) -> int:
    print(f"planc: error: {message}", file=sys.stderr)
    return status


def _load_build(args):
    """A build from a directory, or compiled in memory from a plan file."""
    from planc.compile import CompileError, compile_plan
    from planc import build

    if os.path.isdir(args.file):
        try:
            return build.read(args.file), EXIT_OK
        except build.BuildError as exc:
            return None, _fail(str(exc))
    loaded, status = _load(args)
    if status != EXIT_OK:
        return None, status
    try:
        return compile_plan(loaded.plan), EXIT_OK
    except (build.BuildError, CompileError) as exc:
        return None, _fail(str(exc))


def cmd_compile(args) -> int:
    from planc.compile import CompileError, compile_plan
    from planc import build
    from planc.views import summary_text

    loaded, status = _load(args)
    if status != EXIT_OK:
        return status
    output = args.output or os.path.join("build", os.path.splitext(os.path.basename(
        args.file))[0])
    try:
        result = compile_plan(loaded.plan)
        build.write(result, output, loaded.path, loaded.source)
    except (build.BuildError, CompileError) as exc:
        return _fail(str(exc))
    graph = result.graph
    microbatches = counted(loaded.plan.schedule.microbatches, "microbatch", "microbatches")
    print(f"{loaded.plan.name}: {graph.number_of_nodes():,} nodes and "
          f"{graph.number_of_edges():,} edges for one step ({microbatches} folded); build "
          f"written to {os.path.join(output, '')}")
    print(verified_line(result))
    print()
    print(summary_text.passes(result.summary), end="")
    print()
    print(summary_text.render(result.summary), end="")
    return EXIT_OK


def cmd_graph(args) -> int:
    from planc.files import write_atomically
    from planc.graph.select import Selection, default_selection, select
    from planc.views import render_graph

    fmt = args.format or (os.path.splitext(args.output)[1].lstrip(".").lower()
                          if args.output else "dot")
    if fmt not in GRAPH_FORMATS:
        return _fail(f"cannot tell the format from {args.output!r}; give --format "
                     f"({', '.join(GRAPH_FORMATS)})", EXIT_USAGE)
    if fmt == "png" and not args.output:
        return _fail("png output needs -o FILE", EXIT_USAGE)
    built, status = _load_build(args)
    if built is None:
        return status
    graph = built.graph
    total = graph.graph.get("microbatches", 1)
    microbatches = args.microbatch
    if microbatches == "all":
        microbatches = tuple(range(total))
    if microbatches is not None and any(k >= total for k in microbatches):
        return _fail(f"microbatch {max(microbatches)} does not exist; the plan has "
                     f"{total} (0..{total - 1})", EXIT_USAGE)
    layers = sorted({d["layer"] for _, d in graph.nodes(data=True) if d["layer"] is not None})
    if args.layers and layers and args.layers[1] > layers[-1]:
        return _fail(f"layer {args.layers[1]} does not exist; the plan has layers "
                     f"0..{layers[-1]}", EXIT_USAGE)
    stages = graph.graph.get("sizes", {}).get("pp", 1)
    if args.stage and max(args.stage) >= stages:
        return _fail(f"stage {max(args.stage)} does not exist; the plan has {stages} "
                     f"(0..{stages - 1})", EXIT_USAGE)
    selection = Selection(args.stage, args.layers, microbatches,
                          tuple(args.phase) if args.phase else None,
                          tuple(args.axis) if args.axis else None, args.transfers_only)
    if selection.is_empty and not args.all:
        selection = default_selection(graph)
        if not selection.is_empty:
            print(f"planc: note: the graph has {graph.number_of_nodes():,} nodes; showing "
                  f"{selection.describe()} (choose with --layers, --microbatch, --stage, or "
                  f"--all)", file=sys.stderr)
    view = select(graph, selection)
    title = f"{built.plan.name}: {view.graph['selection']}"
    try:
        data = render_graph.render(view, fmt, title)
    except render_graph.RenderError as exc:
        return _fail(str(exc))
    if args.output:
        try:
            write_atomically(args.output, data)
        except OSError as exc:
            return _fail(f"cannot write {args.output}: {exc.strerror}")
    else:
        sys.stdout.buffer.write(data)
        sys.stdout.flush()
    return EXIT_OK


def cmd_explain(args) -> int:
    from planc.lang.schema import did_you_mean
    from planc.views import explain_text

    built, status = _load_build(args)
    if built is None:
        return status
    graph, plan = built.graph, built.plan
    if args.layer is not None and not 0 <= args.layer < plan.model.layers:
        return _fail(f"layer {args.layer} does not exist; the plan has layers "
                     f"0..{plan.model.layers - 1}", EXIT_USAGE)
    if args.param is not None:
        params = {p for n in graph.nodes for p in graph.nodes[n].get("params", [])}
        if args.param not in params:
            hint = did_you_mean(args.param, params)
            return _fail(f"the plan has no parameter {args.param!r}" +
                         (f"; {hint}" if hint else ""), EXIT_USAGE)
    print(explain_text.explain(plan, graph, args.layer, args.param, args.axis, args.buckets),
          end="")
    return EXIT_OK


def _load_programs(args):
    from planc import build

    built, status = _load_build(args)
    if built is None:
        return None, status
    if built.programs is None:
        try:
            built = build.read_programs(built)
        except build.BuildError as exc:
            return None, _fail(str(exc))
    return built, EXIT_OK


def cmd_programs(args) -> int:
    from planc.views import program_text

    built, status = _load_programs(args)
    if built is None:
        return status
    if not 0 <= args.rank < built.plan.world:
        return _fail(f"rank {args.rank} does not exist; the world has {built.plan.world} "
                     f"ranks (0..{built.plan.world - 1})", EXIT_USAGE)
    m = built.plan.schedule.microbatches
    if args.microbatch is not None and not args.expand:
        return _fail("--microbatch needs --expand (programs are listed folded over "
                     "microbatches otherwise)", EXIT_USAGE)
    if args.microbatch is not None and not 0 <= args.microbatch < m:
        return _fail(f"microbatch {args.microbatch} does not exist; the plan has {m}",
                     EXIT_USAGE)
    print(program_text.render(built.plan, built.graph, built.programs, built.table, args.rank,
                              args.expand, args.microbatch), end="")
    return EXIT_OK


def cmd_verify(args) -> int:
    from planc.lower.verify import verify

    built, status = _load_programs(args)
    if built is None:
        return status
    report = verify(built.plan, built.graph, built.programs, built.table)
    if not report.ok:
        for problem in report.problems:
            print(f"planc: error: {problem}", file=sys.stderr)
        print(f"{counted(len(report.problems), 'problem')} found; these programs must not "
              f"run.", file=sys.stderr)
        return EXIT_ERRORS
    print(verified_line(built))
    return EXIT_OK


def cmd_run(args) -> int:
    from planc.compile import CompileError, compile_plan
    from planc import build
    from planc.lower.verify import verify

    if args.set and os.path.isdir(args.file):
        return _fail(f"--set needs a .plan file, but {args.file} is a directory (a build is "
                     f"already compiled); run the plan file with --set instead", EXIT_USAGE)
    if args.steps is not None and args.steps < 1:
        return _fail("--steps must be at least 1", EXIT_USAGE)
    if args.timeout <= 0:
        return _fail("--timeout must be positive", EXIT_USAGE)
    for flag, path in (("--metrics", args.metrics), ("--trace", args.trace)):
        parent = os.path.dirname(os.path.abspath(path)) if path else None
        if path and os.path.isdir(path):
            return _fail(f"{flag} {path}: is a directory; name a file")
        if parent and not (os.path.isdir(parent) and os.access(parent, os.W_OK)):
            return _fail(f"{flag} {path}: cannot write there ({parent} is not a writable "
                         f"directory)")
    directory = args.file
    if not os.path.isdir(args.file):
        loaded, status = _load(args)
        if status != EXIT_OK:
            return status
        directory = args.output or os.path.join(
            "build", os.path.splitext(os.path.basename(args.file))[0])
        try:
            build.write(compile_plan(loaded.plan), directory, loaded.path, loaded.source)
        except (build.BuildError, CompileError) as exc:
            return _fail(str(exc))
    try:
        built = build.read_programs(build.read(directory))
    except build.BuildError as exc:
        return _fail(str(exc))
    if not args.no_verify:
        report = verify(built.plan, built.graph, built.programs, built.table)
        if not report.ok:
            for problem in report.problems:
                print(f"planc: error: {problem}", file=sys.stderr)
            return _fail("the programs failed verification; nothing was run")
    if built.plan.world > MAX_LOCAL_RANKS:
        return _fail(f"the plan needs {built.plan.world} ranks and planc run starts every rank "
                     f"on this machine (at most {MAX_LOCAL_RANKS}); on a cluster start "
                     f"`torchrun ... -m planc.runtime.worker {directory}` on every node "
                     f"(docs/programs.md)")
    try:
        from planc.runtime.launch import gpus, launch
        from planc.runtime.model import data_problem
    except ImportError:
        return _fail("planc run needs PyTorch: pip install 'planc[run]'")
    problem = data_problem(built.plan)
    if problem:
        return _fail(f"{problem}; nothing was run")
    devices = gpus()
    backend = args.backend or ("nccl" if devices else "gloo")
    if backend == "nccl" and devices < built.plan.world:
        return _fail(f"the nccl backend needs a GPU per rank: the plan has "
                     f"{built.plan.world} ranks, this machine {devices} GPUs; use --backend "
                     f"gloo or torchrun across nodes", EXIT_USAGE)

    worker_args = ["--timeout", str(args.timeout)]
    if args.steps:
        worker_args += ["--steps", str(args.steps)]
    for flag, value in (("--metrics", args.metrics), ("--trace", args.trace)):
        if value:
            worker_args += [flag, os.path.abspath(value)]
    if args.check:
        worker_args.append("--check")
    steps = args.steps or built.plan.train.steps
    print(f"planc: running {built.plan.name} on {counted(built.plan.world, 'rank')} "
          f"({backend}), {counted(steps, 'step')}", file=sys.stderr)
    return launch(os.path.abspath(directory), built.plan.world, worker_args, backend)


MAX_LOCAL_RANKS = 64


def verified_line(built) -> str:
    return (f"verified {counted(len(built.programs), 'program')} for "
            f"{counted(built.plan.world, 'rank')}: collectives in the same order on every "
            f"group, every send matched, no deadlock, every wait after its record, no buffer "
            f"overwritten in flight")


COMMANDS = {"check": cmd_check, "layout": cmd_layout, "compile": cmd_compile,
            "graph": cmd_graph, "explain": cmd_explain, "programs": cmd_programs,
            "verify": cmd_verify, "run": cmd_run}


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        return COMMANDS[args.command](args)
    except BrokenPipeError:  # `planc layout big.plan | head`
        sys.stderr.close()
        return EXIT_OK
    except KeyboardInterrupt:
        return 130


def run() -> None:
    sys.exit(main())
