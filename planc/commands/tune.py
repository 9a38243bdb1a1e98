"""``planc tune``: the best layouts of a plan's model on N devices (planc.tune)."""

from __future__ import annotations

import json
import sys

from planc.commands import EXIT_OK, EXIT_USAGE, fail, load_plan, outputs_refused
from planc.commands.arguments import Command, add_input, count, force, output
from planc.vocabulary.units import RANGES, SIZE


# The layout keys at values every model accepts: how tune reads a file whose own layout
# does not check (it is written for other devices, say); tune sets all of them anyway.
NEUTRAL = ("mesh.tp=1", "mesh.cp=1", "mesh.pp=1", "mesh.dp=1", "mesh.ep=1",
           "shard.pp.virtual=1", "shard.pp.stages=auto", "schedule.pipeline=1f1b",
           "schedule.microbatches=1", "shard.dp.zero=0", "topology.devices_per_node=1",
           "topology.nodes=1")


def devices_per_node(plan, source: str, gpus: int) -> int:
    """How many of the ``gpus`` devices a node holds: the file's devices_per_node, or its
    preset's; a file that names neither is one node of them all."""
    from planc.plan.presets import PRESETS
    from planc.tune.candidate_text import written_value

    written = written_value(source, "topology.devices_per_node")
    if written is not None and written.isdigit() and int(written) > 0:
        return int(written)
    preset = PRESETS.get(plan.topology.preset or "")
    if preset is not None:
        return preset.devices_per_node or gpus
    if plan.topology.preset is not None:  # a calibrated topology file: the plan read it
        return plan.topology.devices_per_node
    return gpus


def topology_settings(source: str, per_node: int, gpus: int) -> dict[str, str] | str:
    """The topology keys that put the file on ``gpus`` devices of ``per_node`` a node,
    or why it cannot be."""
    from planc.tune.candidate_text import written_value

    has_nodes = written_value(source, "topology.nodes") is not None
    if gpus < per_node:  # part of one node
        return {"topology.devices_per_node": str(gpus),
                **({"topology.nodes": "1"} if has_nodes else {})}
    if gpus % per_node:
        return (f"--gpus {gpus} does not fill whole nodes of {per_node} devices (the "
                f"topology's devices_per_node); try --gpus {gpus - gpus % per_node} or "
                f"{gpus + per_node - gpus % per_node}")
    settings = {"topology.nodes": str(gpus // per_node)} if has_nodes else {}
    if written_value(source, "topology.devices_per_node") is not None or \
            per_node == gpus and has_nodes:
        settings["topology.devices_per_node"] = str(per_node)
    return settings


def _an_override_is_wrong(loaded) -> bool:
    """Whether an error is at a --set override. The neutral layout tune reads the file by
    hides it; where no candidate checks either (each got the override: ``--set
    mesh.dp=0``), it is what to print, not "no layout fits". An override that fails only
    under the file's own layout (``schedule.pipeline = interleaved`` where the file has no
    virtual stages) is searched as before."""
    return any(d.is_error and d.span is not None and d.span.source is not None
               for d in loaded.diagnostics)


def main(args) -> int:
    from planc.lang import load_file, load_text
    from planc.simulate.accuracy import expected
    from planc.tune import tune
    from planc.tune.space import KEEPABLE
    from planc.views import tune_text

    from planc.plan.plan import LIMITS

    if args.gpus < 1 or args.top < 1:
        return fail(f"--{'gpus' if args.gpus < 1 else 'top'} must be at least 1", EXIT_USAGE)
    if args.gpus > LIMITS["world"]:  # the search grows with the devices' divisors
        return fail(f"--gpus {args.gpus}: more than planc's limit of {LIMITS['world']:,} "
                    f"ranks, the largest mesh a plan may have", EXIT_USAGE)
    unknown = [k for k in args.keep if k not in KEEPABLE]
    if unknown:
        return fail(f"--keep {unknown[0]}: not a choice tune makes; it can keep "
                    f"{', '.join(KEEPABLE)}", EXIT_USAGE)
    if args.budget is not None and not args.budget > 0:
        return fail(f"--budget {args.budget:g}: the search needs more than 0 seconds",
                    EXIT_USAGE)
    from planc.commands.simulate import resilience_problem

    problem = resilience_problem(args)
    if problem is not None:
        return fail(problem, EXIT_USAGE)
    most = RANGES[SIZE][1] / 1e9  # as a plan's device { memory } (also refuses inf, nan)
    if args.memory is not None and not 0 < args.memory <= most:
        return fail(f"--memory {args.memory:g}: memory per device must be more than 0 GB "
                    f"and at most {most:g} GB", EXIT_USAGE)
    refused = outputs_refused(args, (("the plan file", args.file),))
    if refused is not None:  # before the search, which takes up to --budget seconds
        return refused
    overrides = list(getattr(args, "set", None) or ())
    loaded = load_file(args.file, overrides)
    as_written = loaded
    if not loaded.ok and loaded.source is not None and not args.keep:
        neutral = load_file(args.file, overrides + list(NEUTRAL))
        loaded = neutral if neutral.ok else loaded
    if not loaded.ok:  # the file's own diagnostics, as planc check prints them
        return load_plan(args)[1]
    plan = loaded.plan
    per_node = devices_per_node(plan, loaded.source, args.gpus)
    topology = topology_settings(loaded.source, per_node, args.gpus)
    if isinstance(topology, str):
        return fail(topology, EXIT_USAGE)

    def check(text: str):
        checked = load_text(text, loaded.path, overrides)
        return checked.plan if checked.ok else None

    progress = tune_text.Progress(sys.stderr) if not args.json else None
    capacity = args.memory * 1e9 if args.memory is not None else None
    effective = None if args.mtbf is None else _effective(args)
    search = tune(plan, loaded.source, args.gpus, args.top, capacity, tuple(args.keep),
                  check, progress, topology, min(per_node, args.gpus), args.budget, effective)
    if progress is not None:
        progress.close()
    if search.best is None and _an_override_is_wrong(as_written):
        return load_plan(args)[1]  # every candidate got it: say where, as check does
    if args.json:
        print(json.dumps(search.to_json(args.top), indent=1))
    else:
        print(tune_text.render(search, args.gpus, args.top, expected(plan),
                               args.mtbf), end="")
    if search.best is None:
        memory = "" if search.capacity is None else f" of {search.capacity / 1e9:g} GB"
        return fail(f"no layout of this model on {args.gpus} devices passes the checker and "
                    f"fits in the memory{memory} per device; nothing was written")
    if args.output:
        from planc.host.files import write_atomically

        text = tune_text.best_file(search, args.gpus, args.argv)
        try:
            write_atomically(args.output, text.encode())
        except OSError as exc:
            return fail(f"cannot write {args.output}: {exc.strerror or exc}")
        print(f"best layout written to {args.output}", file=sys.stderr)
    return EXIT_OK


def _effective(args):
    """A layout's step with checkpoints and failures priced as --mtbf asks."""
    from planc.commands.simulate import pricing
    from planc.estimate.resilience import price

    settings = pricing(args)

    def effective(candidate, step: float) -> float:
        return price(candidate, step, **settings).effective_step_seconds
    return effective


def add_arguments(parser) -> None:
    """The arguments of planc tune."""
    add_input(parser)
    parser.add_argument("--gpus", type=count, required=True, metavar="N",
                        help="devices to lay the model out on")
    parser.add_argument("--top", type=count, default=5, metavar="K",
                        help="how many layouts to rank and show (default 5)")
    parser.add_argument("--memory", type=float, metavar="GB",
                        help="memory per device in GB (default: the topology's)")
    parser.add_argument("--keep", action="append", default=[], metavar="KEY",
                        help="hold the file's value of KEY (mesh.tp, schedule.pipeline, "
                        "shard.dp.zero, ...); repeatable")
    parser.add_argument("--budget", type=float, default=60.0, metavar="SECONDS",
                        help="stop simulating after this long; the candidates left, whose "
                        "estimates are the worst, are counted (default 60)")
    from planc.commands.simulate import add_resilience_arguments

    add_resilience_arguments(parser, checkpoints=False)  # ranked with failures priced
    output(parser, "-o", "--output", kind="tuned-plan", metavar="BEST.plan",
           help="write the best layout as a plan file")
    force(parser)
    parser.add_argument("--json", action="store_true", help="the result as JSON")


# planc.cli adds these to its command line, in this order.
COMMANDS = (
    Command("tune", add_arguments, main,
            help="the best layouts of a plan's model on N devices, by the simulator",
            description="Search the layouts of the plan's model on --gpus devices (tp, cp, pp, "
                        "dp, ep, the mesh order, the pipeline schedule with its virtual stages "
                        "and microbatches, ZeRO, sequence parallelism, recomputation), keep "
                        "those planc check accepts and that fit in memory, and rank them by "
                        "simulated step time (docs/tune.md).",
            keeps_collector=True),
)
