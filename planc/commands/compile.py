"""``planc compile``: derive, optimise, lower and verify; write the build directory."""

from __future__ import annotations

import os

from planc.commands import (EXIT_OK, command_line, counted, fail, load_plan, outputs_refused,
                            replaceable, say_replaced, take_lock, verified_line)
from planc.commands.arguments import Command, add_input, force, output


def main(args) -> int:
    from planc.build import directory as build
    from planc.compile import CompileError, compile_plan
    from planc.host.locks import lock_build
    from planc.views import summary_text

    loaded, status = load_plan(args)
    if status != EXIT_OK:
        return status
    output = args.output or os.path.join("build", os.path.splitext(os.path.basename(
        args.file))[0])
    refused = outputs_refused(args, (("the plan file", args.file),), {"output": output})
    if refused is not None:
        return refused
    # held while the build is checked and written: a run of it, or another compile into
    # it, would lose its work (issue 20)
    lock, status = take_lock(lambda: lock_build(output, command_line(args)), output,
                             "wait for it to finish or use another -o")
    if lock is None:
        return status
    with lock:
        earlier, status = replaceable(output, loaded, args.force)
        if status != EXIT_OK:
            return status
        try:
            result = compile_plan(loaded.plan)
            build.write(result, output, loaded.path, loaded.source)
        except (build.BuildError, CompileError) as exc:
            return fail(str(exc))
    say_replaced(output, earlier)
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


def add_arguments(parser) -> None:
    """The arguments of planc compile."""
    add_input(parser)
    output(parser, "-o", "--output", kind="build", metavar="DIR",
           help="build directory [build/NAME, NAME being the file's stem]")
    force(parser, "a build of another plan file in DIR (what the build does not own, "
          "such as logs/, is kept)")


# planc.cli adds these to its command line, in this order.
COMMANDS = (
    Command("compile", add_arguments, main,
            help="derive the communication graph and write a build directory",
            description="Check a plan, derive every compute step and transfer of one training "
                        "step, and write plan.json, graph.json and summary.json to a build "
                        "directory (docs/build.md)."),
)
