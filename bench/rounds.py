"""What every speed benchmark asks of its command line: interleaved rounds (at least 3,
the project's rule for a speed claim) and more steps than the warm-up it drops."""

from __future__ import annotations

import argparse

MIN_ROUNDS = 3


def check_rounds_and_steps(parser: argparse.ArgumentParser, args, warmup: int) -> None:
    """Exit with a usage error (status 2) when ``args.rounds`` or ``args.steps`` is too
    small."""
    if args.rounds < MIN_ROUNDS:
        parser.error(f"--rounds must be at least {MIN_ROUNDS}: speed claims need interleaved "
                     f"rounds")
    if args.steps <= warmup:
        parser.error(f"--steps must be more than {warmup} (the warm-up steps)")
