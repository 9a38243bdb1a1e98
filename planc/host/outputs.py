"""Where planc may write: one rule for every output path of every command (README,
"Outputs").

- An output never replaces a file planc did not write for that same purpose: a plan, a
  build's own files, a checkpoint, another kind of output, a user's notes.
- An output of the same kind that an earlier command wrote is replaced only with
  ``--force``; a resumed run continues its metrics and TensorBoard logs instead.
- Nothing lands over the command's own input, inside a checkpoint directory (it holds
  checkpoints only) or inside a directory or file another run holds (planc.host.locks).
- Every path is checked here before any work starts, for real: the directory that
  would hold it is written to and cleaned up, so a read-only mount or /proc is refused
  even for root, whom permission bits do not stop. Files are then written atomically
  (planc.host.files.write_atomically).

How planc knows its own files: each kind carries a mark near its start (a comment or
key naming the command that wrote it, a PNG text chunk), or has a shape nothing else
writes (a metrics record, a build's manifest, a checkpoint). An empty file holds
nothing to lose and is treated as absent (``mktemp`` then ``-o``); a device or a named
pipe (/dev/null, a FIFO) is written into and never replaced.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
import struct
import tempfile
import zlib
from dataclasses import dataclass, field
from typing import Callable, Iterable

from planc.host.files import open_regular_file
from planc.host.locks import held_by

EXIT_ERRORS, EXIT_USAGE = 1, 2
NAME_MAX = 255  # bytes in one file name (Linux, macOS)
STAGING_SUFFIX = 16  # a build's staging directory, ".NAME.tmp-XXXXXXXX" (planc.build.directory)
HEAD_BYTES = 64 << 10  # how much of an existing file is read to find its mark
MAX_SAFETENSORS_HEADER = 100 << 20  # safetensors' own limit

# The prefixes a mark takes in each format: a comment (DOT, SVG, GraphML), an HTML meta
# tag, a JSON key, a PNG text chunk, a plan file's header.
_MARK_PREFIXES = (b"written by ", b'<meta name="generator" content="', b'"generator": "',
                  b"tEXtSoftware\x00", b"# Chosen by ")


@dataclass(frozen=True)
class Kind:
    """What an output is for. ``generator`` is the mark written into it (and the command
    named in messages); ``directory``: the output is a directory."""

    key: str
    what: str
    generator: str
    directory: bool = False
    appendable: bool = False  # a resumed run continues it


METRICS = Kind("metrics", "a metrics file", "planc run --metrics",
               appendable=True)
RUN_TRACE = Kind("run-trace", "a run's trace", "planc run --trace")
SIMULATED_TRACE = Kind("simulated-trace", "a simulated trace", "planc simulate --trace")
GRAPH = Kind("graph", "a graph", "planc graph")
REPORT = Kind("report", "a report", "planc report")
PLOT = Kind("plot", "a plot", "planc plot")
TUNED_PLAN = Kind("tuned-plan", "a tuned plan", "planc tune")
TOPOLOGY = Kind("topology", "a calibrated topology", "planc calibrate")
CHAKRA = Kind("chakra", "a Chakra trace", "planc export --format chakra", True)
HUGGING_FACE = Kind("hf", "a Hugging Face export", "planc export --format hf", True)
TOKENS = Kind("tokens", "a token file", "planc data prepare")
TENSORBOARD = Kind("tensorboard", "TensorBoard logs",
                   "planc run --tensorboard", True, appendable=True)
BUILD = Kind("build", "a build", "planc compile", True)
CHECKPOINTS = Kind("checkpoints", "checkpoints", "planc run --checkpoint-dir", True)
KINDS = (METRICS, RUN_TRACE, SIMULATED_TRACE, GRAPH, REPORT, PLOT, TUNED_PLAN, TOPOLOGY,
         CHAKRA, HUGGING_FACE, TOKENS, TENSORBOARD, BUILD, CHECKPOINTS)
BY_KEY = {kind.key: kind for kind in KINDS}

# TensorBoard event files planc writes end so (SummaryWriter's filename_suffix), so that
# --force removes planc's own and no other tool's.
TENSORBOARD_SUFFIX = ".planc"
HF_FILES = ("config.json", "model.safetensors")
# A build directory's own entries: what compile writes, and the runs' logs.
BUILD_OWNED = frozenset({"build.json", "plan.json", "graph.json", "summary.json", "programs",
                         "logs"})


@dataclass(frozen=True)
class Refusal:
    """Why an output path cannot be used: the message, and the exit status (2: the
    command line names a wrong path; 1: the path cannot be written now)."""

    message: str
    status: int


@dataclass(frozen=True)
class Output:
    """One output path of a command line: ``flag`` as the user typed it ("-o",
    "--metrics"), the path, and its kind. ``members``: for a directory output that
    writes files of its own into a directory of others (Chakra traces, a Hugging Face
    export), which names are the output's."""

    flag: str
    path: str
    kind: Kind
    members: Callable[[str], bool] | None = field(default=None, compare=False)


# --- marks ---------------------------------------------------------------------------------


def comment(generator: str) -> str:
    """The text of a comment mark: "written by planc graph"."""
    return f"written by {generator}"


def marked(data: bytes, image_format: str, generator: str) -> bytes:
    """``data`` (a rendered file) with its mark: a PNG text chunk, a comment after an XML
    declaration, a DOT comment, an HTML meta tag or a first JSON key."""
    if image_format == "png":
        return _png_with_text(data, "Software", generator)
    if image_format in ("svg", "graphml"):
        mark = f"<!-- {comment(generator)} -->\n".encode()
        if data.startswith(b"<?xml"):
            end = data.index(b"?>") + 2
            return data[:end] + b"\n" + mark + data[end:].lstrip(b"\n")
        return mark + data
    if image_format == "dot":
        return f"// {comment(generator)}\n".encode() + data
    if image_format == "html":
        head = data.index(b"<head>") + len(b"<head>")
        return data[:head] + f'<meta name="generator" content="{generator}">'.encode() + \
            data[head:]
    if image_format == "json":
        rest = data[1:].lstrip()
        return f'{{"generator": "{generator}"'.encode() + (b"" if rest.startswith(b"}") else
                                                            b", ") + rest
    raise ValueError(f"no mark for the format {image_format!r}")


def _png_with_text(data: bytes, keyword: str, text: str) -> bytes:
    """A PNG with a tEXt chunk right after its header chunk (PNG specification, 11.3.4.3:
    Latin-1 keyword, NUL, text; the CRC covers the type and the data)."""
    body = b"tEXt" + keyword.encode("latin-1") + b"\0" + text.encode("latin-1")
    chunk = struct.pack(">I", len(body) - 4) + body + struct.pack(">I", zlib.crc32(body))
    header_end = 8 + 8 + 13 + 4  # signature, IHDR's length and type, its 13 bytes, CRC
    return data[:header_end] + chunk + data[header_end:]


# --- whose file is it ----------------------------------------------------------------------


def _head(path: str, limit: int = HEAD_BYTES) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        return os.read(fd, limit)
    finally:
        os.close(fd)


def _carries(head: bytes, generator: str) -> bool:
    mark = generator.encode()
    return any(prefix + mark in head for prefix in _MARK_PREFIXES)


def _metrics_file(head: bytes) -> bool:
    """A planc run metrics file: its first line a step record (the writer's keys)."""
    line = head.split(b"\n", 1)[0]
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):
        return False
    return isinstance(record, dict) and {"step", "time_s", "loss"} <= set(record)


def _topology(head: bytes) -> bool:
    try:
        data = json.loads(head)
    except (ValueError, RecursionError):
        return False
    return isinstance(data, dict) and data.get("format") == "planc-topology"


def _safetensors_of(path: str, generator: str) -> bool:
    """A safetensors file whose header's ``__metadata__`` names ``generator``."""
    try:  # a named pipe in the file's place is not read (it would block): OSError
        with open_regular_file(path) as handle:
            size = struct.unpack("<Q", handle.read(8))[0]
            if size > MAX_SAFETENSORS_HEADER:
                return False
            header = json.loads(handle.read(size))
    except (OSError, ValueError, struct.error, RecursionError):
        return False
    metadata = header.get("__metadata__") if isinstance(header, dict) else None
    return isinstance(metadata, dict) and metadata.get("generator") == generator


def is_ours(path: str, kind: Kind) -> bool:
    """Whether the regular file ``path`` is one planc wrote as ``kind`` (for a directory
    kind: one of the files such an output writes)."""
    try:
        head = _head(path)
    except OSError:
        return False
    if kind is METRICS:
        return _metrics_file(head)
    if kind is TOPOLOGY:
        return _topology(head)
    if kind is HUGGING_FACE:
        directory = os.path.dirname(path)
        return _safetensors_of(os.path.join(directory, "model.safetensors"), kind.generator)
    if kind is TOKENS:  # a token file's header is planc's alone; its description is marked
        return head.startswith(b"PLANCTOK") or _carries(head, kind.generator)
    if kind is CHAKRA:  # protobuf: the mark is an attribute of the first message
        return kind.generator.encode() in head[:4096]
    return _carries(head, kind.generator)


def _described(path: str) -> str:
    """What a file planc will not replace is, when planc wrote it for another purpose."""
    for kind in KINDS:
        if not kind.directory and is_ours(path, kind):
            return f" (it is {kind.what} from {kind.generator})"
    return ""


def build_directory(path: str) -> bool:
    """Whether ``path`` is a planc build directory (its manifest says so)."""
    try:
        return b'"format": "planc-build"' in _head(os.path.join(path, "build.json"), 4096)
    except OSError:
        return False


_STEP = re.compile(r"step-[0-9]{6,}")


def checkpoint_directory(path: str) -> bool:
    """Whether ``path`` is a planc checkpoint directory or one of its step directories:
    a step manifest, a step-NNNNNN directory, or ``latest`` naming one."""
    try:
        if b'"planc-checkpoint"' in _head(os.path.join(path, "manifest.json"), 4096):
            return True
    except OSError:
        pass
    try:
        entries = os.listdir(path)
    except OSError:
        return False
    if any(_STEP.fullmatch(e) and os.path.isdir(os.path.join(path, e)) for e in entries):
        return True
    try:
        return bool(_STEP.fullmatch(_head(os.path.join(path, "latest"), 256).decode(
            errors="replace").strip()))
    except OSError:
        return False


# --- the rule ------------------------------------------------------------------------------


def problem(output: Output, force: bool = False, append: bool = False,
            inputs: Iterable[tuple[str, str]] = (), made: str | None = None
            ) -> Refusal | None:
    """Why ``output`` may not be written, or None. ``force``: an earlier output of the
    same kind may be replaced; ``append``: it is continued (a resumed run's metrics and
    logs); ``inputs``: (what it is, path) of every input the command reads; ``made``: a
    directory the command creates before it writes its outputs (a run's build), which an
    output may name as its directory before it exists."""
    flag, path, kind = output.flag, output.path, output.kind
    append = append and kind.appendable
    shown = f"{flag} {path}"
    name_bytes = len(os.fsencode(os.path.basename(os.path.normpath(path))))
    room = NAME_MAX - (STAGING_SUFFIX if kind is BUILD else 0)
    if name_bytes > room:
        extra = (f", and planc needs {STAGING_SUFFIX} more for the temporary directory it "
                 f"writes first" if kind is BUILD else "")
        return Refusal(f"the name {os.path.basename(os.path.normpath(path))[:40]}... is "
                       f"{name_bytes} bytes; a file name holds at most {NAME_MAX}{extra}",
                       EXIT_ERRORS)
    real = os.path.realpath(path)  # a symbolic link: its target is what is written
    for what, given in inputs:
        if given and _same(real, given):
            return Refusal(f"{shown}: is {what}, which this command reads; name another "
                           f"path", EXIT_USAGE)
    refusal = _inside_something(shown, real, kind)
    if refusal is not None:
        return refusal
    try:
        mode = os.stat(real).st_mode
    except (FileNotFoundError, NotADirectoryError):  # the latter: a file above it
        mode = None
    except OSError as exc:
        return Refusal(f"{shown}: cannot be used ({exc.strerror})", EXIT_ERRORS)
    if kind.directory:
        return _directory_problem(output, real, mode, force, append)
    if mode is not None and stat.S_ISDIR(mode):
        return Refusal(f"{shown}: is a directory; name a file", EXIT_USAGE)
    if mode is not None and stat.S_ISREG(mode) and os.stat(real).st_size > 0:
        refusal = _existing(shown, real, kind, force, append)
        if refusal is not None:
            return refusal
    if mode is not None and not stat.S_ISREG(mode):
        return None  # a device or a named pipe: written into, never replaced
    parent = os.path.dirname(real)
    if made is not None and not os.path.lexists(parent) and \
            os.path.abspath(parent) == os.path.abspath(made):
        return _creatable(shown, parent)
    return _writable(shown, parent)


def _device(path: str) -> bool:
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


def _same(real: str, given: str) -> bool:
    try:
        return os.path.samefile(real, given)
    except OSError:
        return real == os.path.realpath(given)


def existing_problem(flag: str, path: str, kind: Kind, force: bool = False,
                     append: bool = False) -> Refusal | None:
    """The rule's part about what already lies at ``path`` alone, for a rank started
    without planc run (torchrun), which holds no locks and checked nothing."""
    real = os.path.realpath(path)
    if os.path.isfile(real) and os.path.getsize(real) > 0:
        return _existing(f"{flag} {path}", real, kind, force, append and kind.appendable)
    return None


def _existing(shown: str, real: str, kind: Kind, force: bool, append: bool
              ) -> Refusal | None:
    """An existing, non-empty file at an output's path."""
    if not is_ours(real, kind):
        return Refusal(f"{shown}: exists and is not {kind.what} that planc wrote"
                       f"{_described(real)}; planc never replaces such a file: name another "
                       f"path, or remove it first", EXIT_USAGE)
    if force or append:
        return None
    if kind is METRICS:
        return Refusal(f"{shown}: holds {kind.what} already; continue it with --resume, "
                       f"replace it with --force, or name another file", EXIT_USAGE)
    return Refusal(f"{shown}: holds {kind.what} already ({kind.generator} wrote it); "
                   f"replace it with --force, or name another path", EXIT_USAGE)


def _inside_something(shown: str, real: str, kind: Kind) -> Refusal | None:
    """The path itself or a directory above it that another run holds, that is a
    checkpoint directory, or a build's own file."""
    here = real
    while True:
        taken = held_by(here)
        if taken is not None and here == real:  # as planc.commands.take_lock says it
            held = shown.split(" ", 1)[1] if kind is BUILD else shown  # a build: its path
            return Refusal(f"{held} is in use by planc ({taken}); wait for it to finish or "
                           f"use another {shown.split()[0]}", EXIT_ERRORS)
        if taken is not None:
            return Refusal(f"{shown}: {here}, which holds it, is in use by planc ({taken}); "
                           f"wait for it to finish or name another path", EXIT_ERRORS)
        if not (kind is CHECKPOINTS and here == real) and checkpoint_directory(here):
            what = "is" if here == real else f"is inside {here},"
            return Refusal(f"{shown}: {what} a checkpoint directory, which holds only "
                           f"checkpoints; name a path outside it", EXIT_USAGE)
        parent = os.path.dirname(here)
        name = os.path.relpath(real, parent).split(os.sep)[0]
        if name in BUILD_OWNED and build_directory(parent):
            part = "" if here == real else "inside "
            return Refusal(f"{shown}: is {part}{name} of the build {parent}, which planc "
                           f"compile and planc run write; name a path outside them",
                           EXIT_USAGE)
        if parent == here:
            return None
        here = parent


def _directory_problem(output: Output, real: str, mode: int | None, force: bool,
                       append: bool) -> Refusal | None:
    shown, kind = f"{output.flag} {output.path}", output.kind
    if mode is None:
        return _creatable(shown, real)
    if not stat.S_ISDIR(mode):
        return Refusal(f"{shown}: is not a directory", EXIT_USAGE)
    try:
        entries = sorted(os.listdir(real))
    except OSError as exc:
        return Refusal(f"{shown}: cannot be read ({exc.strerror})", EXIT_ERRORS)
    if kind is TENSORBOARD:
        earlier = [e for e in entries if "tfevents" in e and e.endswith(TENSORBOARD_SUFFIX)]
        if earlier and not (force or append):
            return Refusal(f"{shown}: holds {kind.what} already ({len(earlier)} event "
                           f"file{'s' * (len(earlier) > 1)}); continue them with --resume, "
                           f"replace them with --force, or name another directory",
                           EXIT_USAGE)
    elif output.members is not None:
        for name in (e for e in entries if output.members(e)):
            member = os.path.join(real, name)
            try:
                found = os.lstat(member)
            except OSError:  # gone since it was listed
                continue
            if stat.S_ISLNK(found.st_mode) or stat.S_ISDIR(found.st_mode):
                # planc writes its members as files: a link (written through, outside
                # the directory) or a directory there is someone else's
                what = "a symbolic link" if stat.S_ISLNK(found.st_mode) else "a directory"
                return Refusal(f"{output.flag} {os.path.join(output.path, name)}: is {what}, "
                               f"not {kind.what} that planc wrote; planc never replaces it: "
                               f"name another path, or remove it first", EXIT_USAGE)
            if stat.S_ISREG(found.st_mode) and found.st_size == 0:
                continue
            refusal = _existing(f"{output.flag} {os.path.join(output.path, name)}", member,
                                kind, force, append)
            if refusal is not None:
                return refusal
    # a build is written beside itself and renamed into place (planc.build.directory)
    return _writable(shown, os.path.dirname(real) if kind is BUILD else real)


def _writable(shown: str, directory: str) -> Refusal | None:
    """Whether a file can be created in ``directory``: created and removed, for real."""
    if not os.path.isdir(directory):
        what = "is not a directory" if os.path.lexists(directory) else "does not exist"
        return Refusal(f"{shown}: cannot write there ({directory} {what})", EXIT_ERRORS)
    try:
        handle, probe = tempfile.mkstemp(prefix=".planc-probe-", dir=directory)
    except OSError as exc:
        return Refusal(f"{shown}: cannot write there ({directory}: {_reason(exc)})",
                       EXIT_ERRORS)
    os.close(handle)
    os.unlink(probe)
    return None


def _creatable(shown: str, real: str) -> Refusal | None:
    """Whether the directory ``real`` (missing) can be created: its nearest existing
    ancestor takes a new directory, made and removed for real."""
    parent = os.path.dirname(real)
    while not os.path.lexists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return Refusal(f"{shown}: cannot be created ({parent} is not a directory)",
                       EXIT_ERRORS)
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".planc-probe-", dir=parent))
    except OSError as exc:
        return Refusal(f"{shown}: cannot be created ({parent}: {_reason(exc)})", EXIT_ERRORS)
    return None


def _reason(exc: OSError) -> str:
    if exc.errno in (errno.EACCES, errno.EPERM):
        return "permission denied"
    if exc.errno == errno.EROFS:
        return "a read-only file system"
    return exc.strerror or str(exc)


def first_problem(outputs: Iterable[Output], force: bool = False, append: bool = False,
                  inputs: Iterable[tuple[str, str]] = (), made: str | None = None
                  ) -> Refusal | None:
    """The first refusal among ``outputs`` (also two outputs on one path), or None."""
    inputs = list(inputs)
    seen: dict[str, str] = {}
    for output in outputs:
        if not output.path:
            continue
        real = os.path.realpath(output.path)
        if real in seen and not _device(real):  # /dev/null takes any number of outputs
            return Refusal(f"{output.flag} {output.path}: is also {seen[real]}'s path; name "
                           f"another", EXIT_USAGE)
        seen[real] = output.flag
        refusal = problem(output, force, append, inputs, made)
        if refusal is not None:
            return refusal
    return None
