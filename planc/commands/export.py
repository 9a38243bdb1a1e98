"""``planc export``: a build in another tool's format (Chakra execution traces), or a
checkpoint as a Hugging Face transformers checkpoint."""

from __future__ import annotations

import os
import sys

from planc.commands import EXIT_OK, EXIT_USAGE, fail, load_programs


def main(args) -> int:
    from planc.export.chakra import export

    if os.path.exists(args.output) and not os.path.isdir(args.output):
        return fail(f"-o {args.output} exists and is not a directory", EXIT_USAGE)
    if args.format == "hf":
        return _hugging_face(args)
    built, status = load_programs(args, verified=True)
    if built is None:
        return status
    try:
        written = export(built, args.output, args.prefix)
    except OSError as exc:
        return fail(f"cannot write to {args.output}: {exc.strerror or exc}")
    print(f"wrote {len(written)} Chakra execution trace{'s' * (len(written) != 1)} (one per "
          f"pipeline stage's first rank) to {args.output}/: "
          + ", ".join(p.name for p in written[:4]) + (", ..." if len(written) > 4 else ""),
          file=sys.stderr)
    return EXIT_OK


def _hugging_face(args) -> int:
    """A checkpoint directory as a transformers checkpoint (needs torch and safetensors,
    the ``run`` extra)."""
    from planc.checkpoint import CheckpointError

    try:
        from planc.runtime.export_hf import export_hf
        source, count = export_hf(args.file, args.output)
    except ImportError:
        return fail("--format hf needs torch and safetensors: pip install 'planc[run]'",
                    EXIT_USAGE)
    except CheckpointError as exc:
        return fail(str(exc), EXIT_USAGE)
    except OSError as exc:
        return fail(f"cannot write to {args.output}: {exc.strerror or exc}")
    print(f"wrote {count} tensors of {source} to {args.output}/ (config.json, "
          f"model.safetensors) for LlamaForCausalLM.from_pretrained", file=sys.stderr)
    return EXIT_OK
