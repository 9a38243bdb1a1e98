"""``planc programs`` and ``planc verify``: the rank programs, shown or proven."""

from __future__ import annotations

import sys
from itertools import islice

from planc.commands import (
    EXIT_ERRORS,
    EXIT_OK,
    EXIT_USAGE,
    counted,
    fail,
    load_programs,
    verified_line,
)
from planc.commands.arguments import Command, add_input

# A step's code is a line per instruction: --code prints steps up to this long.
MAX_CODE_INSTRUCTIONS = 100_000


def programs(args) -> int:
    from planc.views import program_text

    built, status = load_programs(args, rank=args.rank)
    if built is None:
        return status
    m = built.plan.schedule.microbatches
    if args.code:
        if args.expand or args.microbatch is not None:
            return fail("--code prints the whole step; it takes neither --expand nor "
                        "--microbatch", EXIT_USAGE)
        return _code(built, args.rank)
    if args.microbatch is not None and not args.expand:
        return fail("--microbatch needs --expand (programs are listed folded over "
                    "microbatches otherwise)", EXIT_USAGE)
    if args.microbatch is not None and not 0 <= args.microbatch < m:
        return fail(f"microbatch {args.microbatch} does not exist; the plan has {m}",
                     EXIT_USAGE)
    print(program_text.render(built.plan, built.graph, built.programs, built.table, args.rank,
                              args.expand, args.microbatch), end="")
    return EXIT_OK


def _code(built, rank: int) -> int:
    """The step's code rank ``rank`` generates from its program and runs (planc run on
    CPU; planc.program.step_code)."""
    from planc.program import step_code
    from planc.program.expansion import expand

    name = built.table.program_of(rank)
    program = built.programs[name]
    # counted without the buffers, and no further than the bound
    count = sum(1 for _ in islice(expand(program, operands=False),
                                  MAX_CODE_INSTRUCTIONS + 1))
    if count > MAX_CODE_INSTRUCTIONS:
        return fail(f"rank {rank}'s step has more than {MAX_CODE_INSTRUCTIONS:,} "
                    f"instructions, the most --code prints (--expand lists any step)",
                    EXIT_USAGE)
    try:  # a build's program is untrusted input: one that cannot become code is refused
        code = step_code.generate(program)
        step_code.check(code, program)
    except step_code.StepCodeError as exc:
        return fail(f"rank {rank}'s program {name} cannot become step code ({exc}); planc "
                    f"verify {built.path} says what is wrong with it")
    print(f"# rank {rank}: program {name}, {count:,} instructions on "
          f"{len(code.streams)} streams")
    print(code.source, end="")
    return EXIT_OK


def verify(args) -> int:
    from planc.verify.verifier import verify_build

    built, status = load_programs(args)
    if built is None:
        return status
    report = verify_build(built)
    if not report.ok:
        for problem in report.problems:
            print(f"planc: error: {problem}", file=sys.stderr)
        print(f"{counted(len(report.problems), 'problem')} found; these programs must not "
              f"run.", file=sys.stderr)
        return EXIT_ERRORS
    print(verified_line(built))
    return EXIT_OK


def add_programs_arguments(parser) -> None:
    """The arguments of planc programs."""
    add_input(parser, "FILE|DIR")
    parser.add_argument("--rank", type=int, default=0, metavar="R", help="a rank [0]")
    parser.add_argument("--expand", action="store_true",
                        help="every instruction of one step, in issue order")
    parser.add_argument("--microbatch", type=int, metavar="K",
                        help="with --expand: only this microbatch (and per-step work)")
    parser.add_argument("--code", action="store_true",
                        help="the Python code the rank generates from its program and runs: "
                             "a function per stream, a statement per instruction")


def add_verify_arguments(parser) -> None:
    """The arguments of planc verify."""
    add_input(parser, "FILE|DIR")


# planc.cli adds these to its command line, in this order.
COMMANDS = (
    Command("programs", add_programs_arguments, programs,
            help="print a rank's program: streams, blocks, events, schedule",
            description="Print the program a rank runs (the program of its pipeline stage): its "
                        "blocks of instructions on named streams, the schedule of blocks, its "
                        "receives and its epilogue. --expand prints one step's instructions in "
                        "issue order."),
    Command("verify", add_verify_arguments, verify,
            help="prove a build's programs cannot deadlock or mix up data",
            description="Check a build's rank programs without running them: collectives in the "
                        "same order on every member of a group, every send matched by one "
                        "receive of the same size, no deadlock, every wait after its record, no "
                        "buffer overwritten while a transfer reads it."),
)
