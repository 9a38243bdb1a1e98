"""The ``planc`` command line: argument parsing and dispatch, nothing else.

Exit status (README, "Exit status"): 0 success (warnings allowed), 1 an input is wrong or
the work failed, 2 a wrong command line, 128 + N stopped by signal N.
Diagnostics go to standard error (or, with ``--error-format json``, to standard
output as one JSON document); requested output goes to standard output.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Sequence

from planc import __version__
from planc.host.interrupts import Interrupted, Interrupts
from planc.views.curves import METRICS as CURVE_METRICS

EXIT_OK, EXIT_USAGE = 0, 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's own usage errors: status 2, no traceback
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def _add_input(parser: argparse.ArgumentParser, metavar: str = "FILE") -> None:
    from planc.diagnostics import MAX_SHOWN

    parser.add_argument("file", metavar=metavar, type=_path,
                        help="a .plan file" + (" or a build directory" if "DIR" in metavar
                                               else ""))
    parser.add_argument("--error-format", choices=("text", "json"), default="text",
                        help="how to print diagnostics (json: one document on stdout)")
    parser.add_argument("--max-errors", type=_count, metavar="N", default=None,
                        help=f"print at most N diagnostics, then count the rest (default: "
                        f"{MAX_SHOWN} as text, all as json; 0: all)")
    _add_overrides(parser)


def _output(parser: argparse.ArgumentParser, *flags: str, kind: str, **options) -> None:
    """An output path: declared with its kind (planc.host.outputs), so that the command checks
    it before any work and no output flag escapes the rule (tests/test_outputs.py)."""
    action = parser.add_argument(*flags, type=_path, **options)
    declared = parser.get_default("outputs") or ()
    parser.set_defaults(outputs=(*declared, (action.dest, flags[0], kind)))


def _force(parser: argparse.ArgumentParser, what: str = "an output of the same kind that "
           "planc wrote earlier") -> None:
    parser.add_argument("--force", action="store_true", help=f"replace {what} (README, "
                        f"\"Outputs\")")


def _path(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("an empty path names nothing")
    if "\0" in text:
        raise argparse.ArgumentTypeError("a path cannot hold a NUL character")
    return text


def _add_overrides(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--set", action="append", type=_override, metavar="KEY=VALUE",
                        help="override a key of the plan, such as --set mesh.tp=4 or --set "
                        "'train.optimizer=adamw(lr = 3e-4)' (repeatable; docs/language.md)")


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} is negative")
    return value


def _override(text: str) -> str:
    from planc.lang.overrides import override_argument  # a malformed one exits with 2

    return override_argument(text)


def build_parser() -> argparse.ArgumentParser:
    from planc.commands import GRAPH_FORMATS
    from planc.graph.ir import Axis

    axes = tuple(axis.value for axis in Axis)
    parser = _Parser(prog="planc", description="planc: a declarative parallel-plan compiler "
                     "for training transformer models.")
    parser.add_argument("--version", action="version", version=f"planc {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    check = commands.add_parser("check", help="check a plan and report every problem",
                                description="Parse and check a .plan file; report every "
                                "problem with its line and column.")
    _add_input(check)
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
    _output(compile_, "-o", "--output", kind="build", metavar="DIR",
            help="build directory [build/NAME, NAME being the file's stem]")
    _force(compile_, "a build of another plan file in DIR (what the build does not own, "
           "such as logs/, is kept)")

    graph = commands.add_parser(
        "graph", help="draw the communication graph (dot, svg, png, graphml, json, html)",
        description="Draw the communication graph of a plan file or a build directory. Big "
        "graphs show one layer and one microbatch unless told otherwise.")
    _add_input(graph, "FILE|DIR")
    graph.add_argument("--format", choices=GRAPH_FORMATS, default=None,
                       help="output format [from -o's extension, else dot]")
    _output(graph, "-o", "--output", kind="graph", metavar="OUT",
            help="output file [standard output]")
    _force(graph)
    graph.add_argument("--stage", type=_int_list, metavar="S[,S...]", help="pipeline stages")
    graph.add_argument("--layers", type=_layer_range, metavar="A..B", help="layer or range")
    graph.add_argument("--microbatch", type=_microbatches, metavar="K[,K...]|all",
                       help="unfold these microbatches (default: folded, or 0 for big graphs)")
    graph.add_argument("--phase", choices=("forward", "backward", "optimizer"),
                       action="append", help="keep this phase (repeatable)")
    graph.add_argument("--axis", choices=axes, action="append",
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
    explain.add_argument("--axis", choices=axes, help="only transfers over this axis")
    explain.add_argument("--buckets", action="store_true",
                         help="every parameter bucket: its members and why it closed")
    explain.add_argument("--routes", action="store_true",
                         help="for each collective, every route (ring, tree, hierarchical) "
                         "with its predicted time and why it was or was not chosen")

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
    _output(run, "-o", "--output", kind="build", metavar="DIR",
            help="where to compile a plan file [build/NAME]")
    _force(run, "a build of another plan file in DIR, or an earlier run's metrics, trace, "
           "TensorBoard logs or checkpoints at the paths given")
    run.add_argument("--steps", type=int, metavar="N",
                     help="steps from the start of training, also with --resume [the plan's "
                     "train.steps]")
    run.add_argument("--backend", choices=("gloo", "nccl"),
                     help="[nccl where CUDA is present, else gloo]")
    _output(run, "--metrics", kind="metrics", metavar="M.jsonl",
            help="one JSON object per step (a resumed run continues the file)")
    _output(run, "--trace", kind="run-trace", metavar="T.json",
            help="Chrome trace of every rank's streams")
    run.add_argument("--check", action="store_true",
                     help="also train in one process and compare every loss and parameter")
    run.add_argument("--timeout", type=float, default=120.0, metavar="S",
                     help="seconds without progress before every rank reports a hang [120]")
    run.add_argument("--no-verify", action="store_true",
                     help="run programs without verifying them (to debug a broken build)")
    _output(run, "--checkpoint-dir", kind="checkpoints", metavar="D",
            help="write a consolidated checkpoint (whole fp32 tensors in safetensors, "
            "optimizer state, data position) into D/step-NNNNNN after the last step, and "
            "after every N-th with --checkpoint-every; any plan of the same model can "
            "resume from it (docs/checkpoints.md)")
    run.add_argument("--checkpoint-every", type=int, metavar="N",
                     help="with --checkpoint-dir: also after every N-th step")
    run.add_argument("--resume", metavar="D", type=_path,
                     help="continue from the newest complete checkpoint in D (or from D, a "
                     "step-NNNNNN directory), under any layout of the same model; steps "
                     "count from the start of training: with train.steps = 4 (or --steps "
                     "4) a step-2 checkpoint runs steps 2 and 3")
    _output(run, "--tensorboard", kind="tensorboard", metavar="DIR",
            help="write every step's loss, lr, grad norm, tokens/s, TFLOP/s, MFU, exposed "
            "communication and step time as TensorBoard scalars into DIR (docs/metrics.md)")

    simulate = commands.add_parser(
        "simulate", help="predict a training step: time, MFU, bubble, exposed comm, memory",
        description="Replay the rank programs of a plan or build on its topology's cost "
        "model: the step time, TFLOP/s per GPU and MFU, the pipeline bubble, the "
        "communication each stage waits for (per axis) and memory per stage, without "
        "running anything.")
    _add_input(simulate, "FILE|DIR")
    simulate.add_argument("--json", action="store_true", help="the result as JSON")
    _output(simulate, "--trace", kind="simulated-trace", metavar="T.json",
            help="Chrome trace of the simulated step (Perfetto), with the tracks of planc "
            "run --trace")
    _force(simulate)

    tune = commands.add_parser(
        "tune", help="the best layouts of a plan's model on N devices, by the simulator",
        description="Search the layouts of the plan's model on --gpus devices (tp, cp, pp, "
        "dp, ep, the mesh order, the pipeline schedule with its virtual stages and "
        "microbatches, ZeRO, sequence parallelism, recomputation), keep those planc check "
        "accepts and that fit in memory, and rank them by simulated step time "
        "(docs/tune.md).")
    _add_input(tune)
    tune.add_argument("--gpus", type=_count, required=True, metavar="N",
                      help="devices to lay the model out on")
    tune.add_argument("--top", type=_count, default=5, metavar="K",
                      help="how many layouts to rank and show (default 5)")
    tune.add_argument("--memory", type=float, metavar="GB",
                      help="memory per device in GB (default: the topology's)")
    tune.add_argument("--keep", action="append", default=[], metavar="KEY",
                      help="hold the file's value of KEY (mesh.tp, schedule.pipeline, "
                      "shard.dp.zero, ...); repeatable")
    tune.add_argument("--budget", type=float, default=60.0, metavar="SECONDS",
                      help="stop simulating after this long; the candidates left, whose "
                      "estimates are the worst, are counted (default 60)")
    _output(tune, "-o", "--output", kind="tuned-plan", metavar="BEST.plan",
            help="write the best layout as a plan file")
    _force(tune)
    tune.add_argument("--json", action="store_true", help="the result as JSON")

    report = commands.add_parser(
        "report", help="one self-contained HTML page: layout, memory, transfers, timeline",
        description="Write one offline HTML page about a plan or build: the plan, a picture "
        "of the layout, memory per stage against the device, transfers per axis and kind, "
        "the simulated timeline of a step, and, with --metrics, predicted against measured.")
    _add_input(report, "FILE|DIR")
    _output(report, "-o", "--output", kind="report", required=True, metavar="PAGE.html")
    _force(report)
    report.add_argument("--metrics", metavar="M.jsonl", type=_path,
                        help="a planc run --metrics file of the same build")
    report.add_argument("--tune", metavar="T.json", type=_path,
                        help="a planc tune --json file: its ranked layouts beside this plan")

    export = commands.add_parser(
        "export", help="a build as Chakra execution traces, or a checkpoint for transformers",
        description="--format chakra (the default): write one step of a plan or build as "
        "Chakra execution traces (et_def.proto, length-delimited): one PREFIX.RANK.et file "
        "per pipeline stage's first rank, with compute, collective and point-to-point "
        "nodes, their stream dependencies and simulated durations. --format hf: write the "
        "newest complete checkpoint of a planc run --checkpoint-dir D as a Hugging Face "
        "checkpoint (config.json, model.safetensors) that from_pretrained loads: "
        "LlamaForCausalLM's for a llama model, MixtralForCausalLM's for a moe model "
        "without shared experts or dense first blocks.")
    _add_input(export, "FILE|DIR")
    _output(export, "-o", "--output", kind="export", required=True, metavar="DIR")
    _force(export, "the files of an earlier planc export in DIR")
    export.add_argument("--format", choices=("chakra", "hf"), default="chakra",
                        help="chakra: execution traces of a plan or build; hf: a checkpoint "
                        "directory as a transformers checkpoint [chakra]")
    export.add_argument("--prefix", default="planc", help="file name prefix [planc]")

    diff = commands.add_parser(
        "diff", help="two plans or builds side by side: layout, memory, transfers, time",
        description="Compare two plans or builds: world, mesh, nodes, memory per stage, "
        "transfers and bytes per axis, and the simulated step time, MFU and bubble. "
        "--set-b changes B only, to compare a plan with a variant of itself.")
    diff.add_argument("a", metavar="A", type=_path, help="a .plan file or a build directory")
    diff.add_argument("b", metavar="B", type=_path, help="a .plan file or a build directory")
    diff.add_argument("--set-b", action="append", metavar="KEY=VALUE",
                      help="override a key of B (a .plan file), as --set does")
    diff.add_argument("--error-format", choices=("text", "json"), default="text",
                      help=argparse.SUPPRESS)

    plot = commands.add_parser(
        "plot", help="draw the loss of planc run --metrics files against the step",
        description="Draw one curve per planc run --metrics file, labelled with its plan's "
        "name: the loss against the step, or another metric of every step (docs/metrics.md). "
        "Needs matplotlib (planc[run]).")
    plot.add_argument("metrics", nargs="+", metavar="M.jsonl", type=_path,
                      help="planc run --metrics files")
    _output(plot, "-o", "--output", kind="plot", required=True, metavar="PLOT.png",
            help="the image to write: .png or .svg")
    _force(plot)
    plot.add_argument("--metric", default="loss", choices=tuple(CURVE_METRICS),
                      help="what to draw [loss]")

    calibrate = commands.add_parser(
        "calibrate", help="measure this machine's links and write a topology plans can use",
        description="Start ranks on this machine, measure the latency and bandwidth of "
        "all-reduces inside and between (emulated) nodes and the compute rate, and write a "
        "topology that a plan names with topology { preset = \"FILE\" }, so that the cost "
        "model predicts this machine. On a cluster run `python -m planc.runtime.calibrate` "
        "on every node instead (docs/routes.md).")
    _output(calibrate, "-o", "--output", kind="topology", required=True, metavar="FILE",
            help="the topology to write (JSON)")
    _force(calibrate)
    calibrate.add_argument("--ranks", type=int, default=2, metavar="N",
                           help="ranks to start [2]")
    calibrate.add_argument("--nodes", type=int, default=1, metavar="K",
                           help="split the ranks into K nodes of consecutive ranks [1]")
    calibrate.add_argument("--repeats", type=int, default=5, metavar="R",
                           help="timed repetitions per size [5]")
    calibrate.add_argument("--quick", action="store_true",
                           help="messages of 4 KB to 1 MB, a small model's, instead of up "
                                "to 16 MB: seconds rather than a minute (make demo)")
    return parser


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


# command -> (module of planc.commands, function): imported only when the command runs,
# so that check and layout never load what compile and run need.
COMMANDS = {"check": ("check", "check"), "layout": ("check", "layout"),
            "compile": ("compile", "main"), "graph": ("graph", "main"),
            "explain": ("explain", "main"), "programs": ("programs", "programs"),
            "verify": ("programs", "verify"), "run": ("run", "main"),
            "calibrate": ("calibrate", "main"), "simulate": ("simulate", "main"),
            "diff": ("diff", "main"), "report": ("report", "main"),
            "export": ("export", "main"), "tune": ("tune", "main"),
            "plot": ("plot", "main")}


def main(argv: Sequence[str] | None = None) -> int:
    # Signals first: a Ctrl-C at any moment stops the command with 128 + its number and
    # one line, never a traceback; the imports below are inside the handling too.
    with Interrupts() as interrupts:
        try:
            status = _dispatch(argv, interrupts)
            if interrupts.received is not None and status != 128 + interrupts.received:
                interrupts.check()  # a signal recorded where it could not be raised
            return status
        except BrokenPipeError:  # `planc layout big.plan | head`
            sys.stderr.close()
            return EXIT_OK
        except Interrupted as stop:
            print(f"\nplanc: interrupted by signal {stop.signum}", file=sys.stderr)
            return stop.status
        except KeyboardInterrupt:  # raised by Python's own handler, before ours
            print("\nplanc: interrupted by signal 2", file=sys.stderr)
            return 130


def _dispatch(argv: Sequence[str] | None, interrupts: Interrupts) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    args.interrupts = interrupts  # commands that start processes defer signals with it
    args.argv = list(sys.argv[1:] if argv is None else argv)  # named in the locks it holds
    module, function = COMMANDS[args.command]
    command = getattr(importlib.import_module(f"planc.commands.{module}"), function)
    return command(args)
