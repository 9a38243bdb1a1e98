"""``planc data prepare SOURCE... -o OUT.tokens --tokenizer T``: text, JSONL, Parquet or a
Hugging Face dataset cut by a model's own tokenizer into a token file (docs/data.md,
"Preparing your own data"). Never torch."""

from __future__ import annotations

import os
import sys

from planc.commands import EXIT_OK, EXIT_USAGE, fail
from planc.commands.arguments import Command, force, output, path
from planc.data.documents import SAMPLE_BY
from planc.diagnostics import counted

REFRESH_SECONDS = 0.25


def _progress_line(progress) -> str:
    documents = counted(progress.documents, "document", grouped=True)
    if progress.blank:
        documents += f" ({counted(progress.blank, 'blank one', grouped=True)} skipped)"
    return (f"planc data prepare: {documents}, {counted(progress.tokens, 'token', grouped=True)}"
            f", {progress.bytes_read / 1e6:,.1f} MB read at "
            f"{progress.megabytes_per_second:,.1f} MB/s")


class _Bar:
    """The progress line on a terminal, redrawn at most every REFRESH_SECONDS."""

    def __init__(self, stream):
        self.stream, self.shown, self.last = stream, stream.isatty(), 0.0

    def __call__(self, progress) -> None:
        if self.shown and progress.seconds - self.last >= REFRESH_SECONDS:
            self.last = progress.seconds
            print(f"\r{_progress_line(progress)}", end="", file=self.stream, flush=True)

    def close(self) -> None:
        if self.shown and self.last:
            print("\r\033[K", end="", file=self.stream, flush=True)


def prepare_main(args) -> int:
    from planc.data.documents import Source, SourceError
    from planc.data.prepare import PrepareError, prepare, width_for
    from planc.data.provenance import description_path
    from planc.data.tokenizer import Tokenizer, TokenizerError
    from planc.data.tokens import DTYPES
    from planc.host import outputs
    from planc.host.output_kinds import TOKENS

    inputs = [("a source", source) for source in args.sources] + \
        [("the tokenizer", args.tokenizer)]
    refusal = outputs.first_problem(
        [outputs.Output("-o", args.output, TOKENS),
         outputs.Output("-o", description_path(args.output), TOKENS)],
        args.force, inputs=inputs)
    if refusal is not None:
        return fail(refusal.message, refusal.status)
    if os.path.exists(args.output) and not os.path.isfile(args.output):
        return fail(f"-o {args.output}: is not a regular file; a token file is read back "
                    f"by position, so name a file", EXIT_USAGE)
    try:
        sources = [Source.of(source) for source in args.sources]
        tokenizer = Tokenizer(args.tokenizer, args.eos)
    except (SourceError, TokenizerError) as exc:
        return fail(str(exc))
    bar = _Bar(sys.stderr)
    try:
        progress = prepare(sources, args.output, tokenizer, text_key=args.text_key,
                           sample_by=args.sample_by, report=bar)
    except (SourceError, PrepareError) as exc:
        bar.close()
        return fail(f"{exc}; {args.output} was not written")
    except OSError as exc:
        bar.close()
        return fail(f"cannot write {args.output}: {exc.strerror or exc}")
    bar.close()
    print(f"{_progress_line(progress)}, in {progress.seconds:.1f} s", file=sys.stderr)
    tokens = counted(progress.tokens, "token", grouped=True)
    print(f"planc: {args.output} written ({tokens} of "
          f"{DTYPES[width_for(tokenizer.vocab_size)]}, end-of-text id "
          f"{tokenizer.eos_id}), described in {description_path(args.output)}",
          file=sys.stderr)
    return EXIT_OK


def main(args) -> int:
    if args.data_command is None:
        args.data_parser.print_help(sys.stderr)
        return EXIT_USAGE
    return prepare_main(args)


def add_arguments(parser) -> None:
    """The arguments of planc data and its subcommands."""
    parser.set_defaults(data_parser=parser)
    commands = parser.add_subparsers(dest="data_command", metavar="SUBCOMMAND")
    prepare = commands.add_parser(
        "prepare", help="cut text, JSONL, Parquet or a Hugging Face dataset into a token "
        "file with a model's tokenizer",
        description="Cut each document of the sources with the tokenizer, end it with the "
                    "tokenizer's end-of-text id and write the ids as a token file for train "
                    "{ data } (docs/data.md), with a description beside it (OUT.json) that "
                    "planc check compares with an init checkpoint's tokenizer. Atomic: a "
                    "failed or interrupted prepare leaves no file.")
    prepare.add_argument("sources", nargs="+", metavar="SOURCE", type=path,
                         help="JSONL (.jsonl, .json, .ndjson; each may be .gz), plain text "
                              "(may be .gz), Parquet (.parquet), "
                              "or a Hugging Face dataset's directory (save_to_disk's, or data "
                              "files such as a Hub snapshot in the cache)")
    output(prepare, "-o", "--output", kind="tokens", required=True, metavar="OUT.tokens",
           help="the token file to write")
    prepare.add_argument("--tokenizer", required=True, type=path, metavar="T",
                         help="a Hugging Face tokenizer.json, or the directory holding it "
                              "(an init checkpoint's)")
    prepare.add_argument("--text-key", default="text", metavar="KEY",
                         help="the field (JSONL) or column (Parquet, datasets) holding the "
                              "text [text]")
    prepare.add_argument("--sample-by", default="line", choices=SAMPLE_BY,
                         help="plain text: what one document is [line]")
    prepare.add_argument("--eos", metavar="TOKEN",
                         help="the token that ends each document [the tokenizer's eos_token]")
    force(prepare)


# planc.cli adds these to its command line, in this order.
COMMANDS = (
    Command("data", add_arguments, main,
            help="prepare training data: planc data prepare",
            description="Prepare training data for train { data }: planc data prepare cuts "
                        "text with a model's tokenizer into a token file (docs/data.md)."),
)
