"""What every speed benchmark asks of its command line: interleaved rounds (at least 3,
the project's rule for a speed claim) and more steps than the warm-up it drops."""

from __future__ import annotations

import argparse
import os

MIN_ROUNDS = 3


def rounds_and_threads(description: str) -> argparse.ArgumentParser:
    """A benchmark's parser with ``--rounds`` (3) and ``--threads`` (this process's
    cores), for the micro-benchmarks that time operators on one process's threads."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--rounds", type=int, default=MIN_ROUNDS)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    return parser


def check_rounds(parser: argparse.ArgumentParser, args) -> None:
    """Exit with a usage error (status 2) when ``args.rounds`` is too small."""
    if args.rounds < MIN_ROUNDS:
        parser.error(f"--rounds must be at least {MIN_ROUNDS}: speed claims need interleaved "
                     f"rounds")


def check_rounds_and_steps(parser: argparse.ArgumentParser, args, warmup: int) -> None:
    """Exit with a usage error (status 2) when ``args.rounds`` or ``args.steps`` is too
    small."""
    check_rounds(parser, args)
    if args.steps <= warmup:
        parser.error(f"--steps must be more than {warmup} (the warm-up steps)")
