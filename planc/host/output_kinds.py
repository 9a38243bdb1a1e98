"""What planc's outputs are and how planc knows its own files (README, "Outputs").

Each kind of output carries a mark near its start (a comment or key naming the command
that wrote it, a PNG text chunk), or has a shape nothing else writes (a metrics record, a
build's manifest, a checkpoint). planc.host.outputs' rule replaces a file only when it
is planc's own, of the same kind.
"""

from __future__ import annotations

import json
import os
import re
import struct
import zlib
from dataclasses import dataclass

from planc.host.files import open_regular_file

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
    if kind is HUGGING_FACE:  # each file by its own mark: a user's config.json beside
        # planc's weights is still the user's
        if os.path.basename(path) == "model.safetensors":
            return _safetensors_of(path, kind.generator)
        return _carries(head, kind.generator)
    if kind is TOKENS:  # a token file's header is planc's alone; its description is marked
        return head.startswith(b"PLANCTOK") or _carries(head, kind.generator)
    if kind is CHAKRA:  # protobuf: the mark is an attribute of the first message
        return kind.generator.encode() in head[:4096]
    return _carries(head, kind.generator)


def described(path: str) -> str:
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
