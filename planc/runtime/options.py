"""What one run asks of its ranks: a value that ``planc run`` builds from its command line
and hands to the launcher, and that a rank started by torchrun parses from its own
(``python -m planc.runtime.worker BUILD_DIR [options]``). No torch.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Sequence

from planc.data.identity import Identity, identities_text, parse_identities
from planc.data.metrics_file import MAX_STEP
from planc.runtime.stragglers import DEFAULT_MARGIN

DEFAULT_TIMEOUT = 120.0  # seconds without progress before a rank reports a hang


@dataclass(frozen=True)
class RunOptions:
    build: str  # the build directory, absolute when planc run starts the ranks
    backend: str | None = None  # None: nccl where CUDA is present, else gloo
    steps: int | None = None  # None: the plan's train.steps
    timeout: float = DEFAULT_TIMEOUT
    metrics: str | None = None
    trace: str | None = None
    tensorboard: str | None = None
    check: bool = False
    checkpoint_dir: str | None = None
    checkpoint_every: int | None = None
    checkpoint_async: bool = False  # written by a thread while the next steps train
    straggler_margin: float = DEFAULT_MARGIN  # planc.runtime.stragglers
    resume: str | None = None
    # planc run found and hashed the step directory already; a rank need not again
    resume_verified: bool = False
    # planc run --no-verify: nobody proved the programs, so one that cannot be bound is
    # the build's fault, said in one line (planc.runtime.engine.interpreter)
    unverified: bool = False
    # The data file as planc run checked it (planc.data.identity): every batch is read
    # from that file, unchanged, or the run stops.
    data_identity: Identity | tuple[Identity, ...] | None = None  # a mixture: one a source
    force: bool = False  # rank 0 may replace a trace an earlier run wrote at trace
    # planc run --on-failure replan: what the failure this run recovers from cost, as JSON
    # (planc.commands.replan); the first step's record and progress line carry it
    recovery: str | None = None
    # planc run --checkpoint-peer-memory: the host-memory directory of the copies after
    # every step (planc.runtime.checkpoint.peer_memory)
    peer_memory: str | None = None

    @staticmethod
    def parse(argv: Sequence[str] | None = None) -> "RunOptions":
        """The options of a worker's command line; a wrong one exits with status 2."""
        parser = _parser()
        args = parser.parse_args(argv)
        for flag, value in (("--steps", args.steps), ("--checkpoint-every",
                                                      args.checkpoint_every)):
            if value is not None and not 1 <= value <= MAX_STEP:  # what metrics record
                parser.error(f"{flag} must be a number of steps from 1 to 10^12")
        if args.checkpoint_every is not None and not args.checkpoint_dir:
            parser.error("--checkpoint-every needs --checkpoint-dir")
        if args.checkpoint_async and not args.checkpoint_dir:
            parser.error("--checkpoint-async needs --checkpoint-dir")
        return RunOptions(**vars(args))

    def to_argv(self) -> list[str]:
        """The worker's command line that :meth:`parse` reads back as these options."""
        out = [self.build, "--timeout", str(self.timeout)]
        if self.backend:
            out += ["--backend", self.backend]
        if self.data_identity is not None:
            out += ["--data-identity", identities_text(self.data_identity)]
        if self.straggler_margin != DEFAULT_MARGIN:
            out += ["--straggler-margin", repr(self.straggler_margin)]
        for flag, value in (("--steps", self.steps), ("--checkpoint-dir", self.checkpoint_dir),
                            ("--checkpoint-every", self.checkpoint_every),
                            ("--resume", self.resume), ("--metrics", self.metrics),
                            ("--trace", self.trace), ("--tensorboard", self.tensorboard),
                            ("--recovery", self.recovery), ("--peer-memory", self.peer_memory)):
            if value:
                out += [flag, str(value)]
        for flag, on in (("--resume-verified", self.resume_verified), ("--check", self.check),
                         ("--unverified", self.unverified),
                         ("--force", self.force), ("--checkpoint-async", self.checkpoint_async)):
            if on:
                out.append(flag)
        return out


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="planc.runtime.worker",
                                     description="One rank of a planc training run.")
    parser.add_argument("build", metavar="DIR", help="a build directory (planc compile)")
    parser.add_argument("--steps", type=int, help="optimizer steps [the plan's train.steps]")
    parser.add_argument("--backend", choices=("gloo", "nccl"))
    parser.add_argument("--metrics", metavar="M.jsonl", help="one JSON object per step")
    parser.add_argument("--trace", metavar="T.json", help="Chrome trace of every rank")
    parser.add_argument("--check", action="store_true",
                        help="compare with the single-process reference")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT,
                        help="seconds without progress before a rank reports a hang")
    parser.add_argument("--checkpoint-dir", metavar="D",
                        help="write consolidated checkpoints into D (docs/checkpoints.md)")
    parser.add_argument("--checkpoint-every", type=int, metavar="N",
                        help="with --checkpoint-dir: after every N-th step (and the last)")
    parser.add_argument("--checkpoint-async", action="store_true",
                        help="with --checkpoint-dir: write each checkpoint in the background")
    parser.add_argument("--straggler-margin", type=float, default=DEFAULT_MARGIN, metavar="F",
                        help="name a rank whose compute stream is busy more than 1 + F times its "
                        "peers' for 5 steps in a row [0.2]")
    parser.add_argument("--resume", metavar="D",
                        help="continue from the newest complete checkpoint in D, or from the "
                        "step directory D; --steps counts from the start of training")
    parser.add_argument("--resume-verified", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--unverified", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--data-identity", type=parse_identities, help=argparse.SUPPRESS)
    parser.add_argument("--recovery", help=argparse.SUPPRESS)
    parser.add_argument("--peer-memory", help=argparse.SUPPRESS)
    parser.add_argument("--tensorboard", metavar="DIR",
                        help="the leader writes TensorBoard scalars of every step into DIR")
    parser.add_argument("--force", action="store_true",
                        help="rank 0 may replace a trace an earlier run wrote at --trace")
    return parser
