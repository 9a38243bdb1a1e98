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

Whose file is it: planc.host.output_kinds (each kind's mark). An empty file holds
nothing to lose and is treated as absent (``mktemp`` then ``-o``); a device or a named
pipe (/dev/null, a FIFO) is written into and never replaced.
"""

from __future__ import annotations

import argparse
import errno
import os
import stat
import tempfile
from dataclasses import dataclass, field
from typing import Callable, Iterable

from planc.host.files import real_path
from planc.host.locks import held_by
from planc.host.output_kinds import (BUILD, CHECKPOINTS, METRICS, TENSORBOARD,
                                     TENSORBOARD_SUFFIX, BUILD_OWNED, Kind, build_directory,
                                     checkpoint_directory, described, is_ours)

EXIT_ERRORS, EXIT_USAGE = 1, 2
NAME_MAX = 255  # bytes in one file name (Linux, macOS)
STAGING_SUFFIX = 16  # a build's staging directory, ".NAME.tmp-XXXXXXXX" (planc.build.directory)


def path(text: str) -> str:
    """A command line's output or input path, as argparse's ``type``: an empty one names
    nothing, and no path holds a NUL."""
    if not text:
        raise argparse.ArgumentTypeError("an empty path names nothing")
    if "\0" in text:
        raise argparse.ArgumentTypeError("a path cannot hold a NUL character")
    return text


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
    real = real_path(path)  # a symbolic link: its target is what is written
    for what, given in inputs:
        if given and _same(real, given):
            return Refusal(f"{shown}: is {what} this command reads; name another path",
                           EXIT_USAGE)
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
    if path.endswith(os.sep):  # realpath dropped it: "page.html/" wrote a file page.html
        return Refusal(f"{shown}: ends with '{os.sep}', which names a directory; name a "
                       f"file", EXIT_USAGE)
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
                       f"{described(real)}; planc never replaces such a file: name another "
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
