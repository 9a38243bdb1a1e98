"""``planc export``: a build in another tool's format (Chakra execution traces), or a
checkpoint as a Hugging Face transformers checkpoint."""

from __future__ import annotations

import os
import shlex
import sys

from planc.commands import (EXIT_OK, EXIT_USAGE, fail, load_programs, missing_runtime,
                            outputs_refused, the_input)
from planc.commands.arguments import Command, add_input, force, output


def main(args) -> int:
    from planc.export.chakra import ExportTooLarge, export, trace_file
    from planc.host.output_kinds import HF_FILES

    if args.format == "hf":
        what = "the checkpoint directory" if os.path.isdir(args.file) else "the input"
        refused = outputs_refused(args, ((what, args.file),),
                                  members=lambda name: name in HF_FILES)
        return refused if refused is not None else _hugging_face(args)
    if not args.prefix or "/" in args.prefix or args.prefix.startswith(".") or \
            not args.prefix.isprintable():
        return fail(f"--prefix {args.prefix!r}: a file name's start, without '/' or control "
                    f"characters and not starting with '.'", EXIT_USAGE)
    from planc.host.outputs import NAME_MAX
    from planc.plan.plan import LIMITS

    # checked before any work: a trace's name is PREFIX.RANK.et, for ranks up to the
    # largest mesh's; a name too long stopped the export after writing the first traces
    longest = len(os.fsencode(args.prefix)) + len(f".{LIMITS['world'] - 1}.et")
    if longest > NAME_MAX:
        return fail(f"--prefix is {len(os.fsencode(args.prefix))} bytes; a trace's file name "
                    f"(PREFIX.RANK.et) holds at most {NAME_MAX}, so the prefix at most "
                    f"{NAME_MAX - longest + len(os.fsencode(args.prefix))}", EXIT_USAGE)
    refused = outputs_refused(args, (the_input(args.file),),
                              members=lambda name: trace_file(name, args.prefix))
    if refused is not None:
        return refused
    if _a_checkpoint(args.file):
        command = shlex.join(["planc", "export", args.file, "--format", "hf", "-o",
                              args.output])
        return fail(f"{args.file} holds a planc checkpoint, not a build; to export it for "
                    f"transformers (LlamaForCausalLM), add --format hf: {command}", EXIT_USAGE)
    built, status = load_programs(args, verified=True)
    if built is None:
        return status
    try:
        written = export(built, args.output, args.prefix)
        _remove_stale(args.output, args.prefix, {path.name for path in written})
    except ExportTooLarge as exc:
        return fail(str(exc), EXIT_USAGE)
    except OSError as exc:
        return fail(f"cannot write {exc.filename or args.output}: {exc.strerror or exc}")
    print(f"wrote {len(written)} Chakra execution trace{'s' * (len(written) != 1)} (one per "
          f"pipeline stage's first rank) to {args.output}/: "
          + ", ".join(p.name for p in written[:4]) + (", ..." if len(written) > 4 else ""),
          file=sys.stderr)
    return EXIT_OK


def _remove_stale(directory: str, prefix: str, written: set[str]) -> None:
    """The traces an earlier export (replaced with --force) wrote for ranks this one has
    not: they belong to the replaced output."""
    from planc.export.chakra import trace_file
    from planc.host.output_kinds import CHAKRA, is_ours

    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if trace_file(name, prefix) and name not in written and os.path.isfile(path) and \
                is_ours(path, CHAKRA):
            os.unlink(path)


def _a_checkpoint(path: str) -> bool:
    """A checkpoint directory (or one of its step directories) given where Chakra export
    needs a plan or a build: the user meant --format hf."""
    from planc.build.directory import MANIFEST as BUILD_MANIFEST
    from planc.checkpoint.format import holds_checkpoints

    return (os.path.isdir(path) and not os.path.lexists(os.path.join(path, BUILD_MANIFEST))
            and holds_checkpoints(path))


def _hugging_face(args) -> int:
    """A checkpoint directory as a transformers checkpoint (needs torch and safetensors,
    the ``run`` extra)."""
    from planc.checkpoint.format import CheckpointError

    try:
        with args.interrupts.deferred():  # torch swallows a Ctrl-C during its import
            from planc.runtime.checkpoint.export_hf import export_hf
    except ImportError as exc:
        if not missing_runtime(exc):
            raise
        return fail(f"--format hf needs torch and safetensors ({exc}): pip install "
                    f"'planc[run]'")
    try:
        # as planc run --resume says it: what is written is not the newest step
        source, count, architecture = export_hf(args.file, args.output, lambda why: print(
            f"planc: warning: passed over a checkpoint: {why}", file=sys.stderr))
    except CheckpointError as exc:  # a checkpoint is an input: status 1
        return fail(str(exc))
    except OSError as exc:
        return fail(f"cannot write to {args.output}: {exc.strerror or exc}")
    print(f"wrote {count} tensors of {source} to {args.output}/ (config.json, "
          f"model.safetensors) for {architecture}.from_pretrained", file=sys.stderr)
    return EXIT_OK


def add_arguments(parser) -> None:
    """The arguments of planc export."""
    add_input(parser, "FILE|DIR")
    output(parser, "-o", "--output", kind="export", required=True, metavar="DIR")
    force(parser, "the files of an earlier planc export in DIR")
    parser.add_argument("--format", choices=("chakra", "hf"), default="chakra",
                        help="chakra: execution traces of a plan or build; hf: a checkpoint "
                        "directory as a transformers checkpoint [chakra]")
    parser.add_argument("--prefix", default="planc", help="file name prefix [planc]")


# planc.cli adds these to its command line, in this order.
COMMANDS = (
    Command("export", add_arguments, main,
            help="a build as Chakra execution traces, or a checkpoint for transformers",
            description="--format chakra (the default): write one step of a plan or build as "
                        "Chakra execution traces (et_def.proto, length-delimited): one "
                        "PREFIX.RANK.et file per pipeline stage's first rank, with compute, "
                        "collective and point-to-point nodes, their stream dependencies and "
                        "simulated durations. --format hf: write the newest complete checkpoint "
                        "of a planc run --checkpoint-dir D as a Hugging Face checkpoint "
                        "(config.json, model.safetensors) that from_pretrained loads: "
                        "LlamaForCausalLM's for a llama model, MixtralForCausalLM's for a moe "
                        "model without shared experts or dense first blocks."),
)
